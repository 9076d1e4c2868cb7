"""Does it matter for GPU 0's clock which GPU moves the producer's output across NVLink?

usage: python3 benchmarks/transport_power.py OUT_DIR [M] [SECONDS]

Session 4 (`2026-11-30-h200x2-s4/bench/clocks_under_load.json`) found the producer GEMM
writing into GPU 1 at 1350 MHz / 691 W against 1425 MHz / 583 W for the same GEMM writing
locally: 4.9% slower. This probe asks whether that cost follows the bytes (any transfer of
the 256 MB output out of GPU 0 costs GPU 0 the same) or the initiator (GPU 0's SMs storing to
a peer). Each phase runs GPU 0's GEMM writing locally, in lock step with one transfer of the
same bytes per call, made by a different agent:

* ``local``: the GEMM alone; ``sm_push``: the GEMM writing into GPU 1 (what the chain does);
* ``ce_push``: a copy engine, issued from GPU 0 (torch's peer copy);
* ``ce_pull``: a copy engine, issued from GPU 1 (``cudaMemcpyPeerAsync`` on a GPU 1 stream);
* ``sm_pull``: 16 CTAs on GPU 1 loading GPU 0's memory and storing locally;
* ``ce_push_alone`` / ``sm_pull_alone``: the transfers without the GEMM.

Per phase: ms per call (CUDA events on GPU 0), SM clock, power and clock-event reasons of both
GPUs (nvidia-smi every 50 ms). Phases run twice, the second pass in reverse order.
Writes OUT_DIR/transport_power.json.
"""

import ctypes
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ctapipelining.bench import chain_operands
from ctapipelining.fabric import _cudart, enable_peer_access
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.timing import environment, fork_join, run_for, sample_gpus

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 1.5
K = 8192
PULL_CTAS = 16
out_dir.mkdir(parents=True, exist_ok=True)


@triton.jit
def _copy(src, dst, n, BLOCK: tl.constexpr, NPROG: tl.constexpr):
    """dst[i] = src[i] for i < n, by NPROG CTAs striding over BLOCK-element chunks."""
    for start in range(tl.program_id(0) * BLOCK, n, NPROG * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


enable_peer_access([0, 1, 0])
x, A, _ = chain_operands(M, K)
c_local = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
c_peer = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
src0 = torch.randn(M, K, device="cuda:0").bfloat16()  # what the transfers move: the output's size
dst1 = torch.empty_like(src0, device="cuda:1")
side0, side1 = torch.cuda.Stream(0), torch.cuda.Stream(1)
NBYTES = src0.numel() * src0.element_size()


def gemm_local():
    matmul(x, A, out=c_local, config=PIPELINE_CONFIG)


def ce_push():
    with torch.cuda.stream(side0):
        dst1.copy_(src0, non_blocking=True)


def ce_pull():
    v = ctypes.c_void_p
    with torch.cuda.device(1):
        rc = _cudart().cudaMemcpyPeerAsync(
            v(dst1.data_ptr()), 1, v(src0.data_ptr()), 0, ctypes.c_size_t(NBYTES), v(side1.cuda_stream)
        )
    if rc != 0:
        raise RuntimeError(f"cudaMemcpyPeerAsync failed with CUDA error {rc}")


def sm_pull():
    with torch.cuda.device(1), torch.cuda.stream(side1):
        n = NBYTES // 8
        _copy[(PULL_CTAS,)](src0.view(torch.int64), dst1.view(torch.int64), n, BLOCK=4096, NPROG=PULL_CTAS)


def lockstep(gemm, transfer, side):
    """One call: the transfer starts with the GEMM, and the next call waits for both."""
    if transfer is None:
        return gemm
    return lambda: fork_join(side, transfer, gemm)


PHASES = {
    "local": lockstep(gemm_local, None, None),
    "sm_push": lockstep(lambda: matmul(x, A, out=c_peer, config=PIPELINE_CONFIG), None, None),
    "ce_push": lockstep(gemm_local, ce_push, side0),
    "ce_pull": lockstep(gemm_local, ce_pull, side1),
    "sm_pull": lockstep(gemm_local, sm_pull, side1),
    "ce_push_alone": lockstep(None, ce_push, side0),
    "sm_pull_alone": lockstep(None, sm_pull, side1),
}


def reasons_field():
    for field in ("clocks_event_reasons.active", "clocks_throttle_reasons.active"):
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True)
        if r.returncode == 0:
            return field
    return None


REASONS = reasons_field()
FIELDS = ("clocks.sm", "power.draw", "temperature.gpu") + ((REASONS,) if REASONS else ())


def run(call):
    for _ in range(5):
        call()
    return run_for(call, SECONDS)


def summary(rows):
    rows = [r for r in rows if all(isinstance(v, float) for v in r[:3])]  # no "[N/A]" readings
    if not rows:
        return dict(samples=0)
    out = dict(
        samples=len(rows),
        sm_mhz_median=statistics.median(r[0] for r in rows),
        power_w_median=statistics.median(r[1] for r in rows),
        temp_c_max=max(r[2] for r in rows),
    )
    if REASONS and rows and len(rows[0]) > 3:
        masks = [int(r[3], 16) for r in rows if str(r[3]).startswith("0x")]
        if masks:
            out["reasons_mode"] = hex(statistics.mode(masks))
            out["sw_power_cap_fraction"] = round(sum(bool(m & 0x4) for m in masks) / len(masks), 2)
    return out


report = dict(environment=environment(), M=M, K=K, seconds=SECONDS, bytes_per_call=NBYTES, reasons_field=REASONS)
report["passes"] = []
for order in (list(PHASES), list(reversed(PHASES))):
    results = {}
    for name in order:
        try:
            (calls, ms), rows = sample_gpus(lambda name=name: run(PHASES[name]), FIELDS)
        except Exception as e:  # e.g. a transfer the driver refuses: report and go on
            results[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            print(name, results[name], flush=True)
            continue
        phase = dict(calls=calls, ms_per_call=round(ms, 4))
        phase |= {f"gpu{d}": summary(r) for d, r in rows.items() if r}
        results[name] = phase
        print(name, json.dumps(phase), flush=True)
    report["passes"].append(results)
torch.testing.assert_close(dst1, src0.to("cuda:1"), rtol=0, atol=0)  # the last transfer moved the bytes
(out_dir / "transport_power.json").write_text(json.dumps(report, indent=1))
