"""Why is a call from idle GPUs slower when it writes into the peer?

usage: python3 benchmarks/rested_remote.py OUT_DIR [M] [REPS] [REST_MS]

Session 5's bench with 50 ms of rest before each run (``2026-11-30-h200x2-s5/bench/rested``)
gave our GEMM writing into GPU 1 0.37 ms more than writing locally (0.03 ms back to back),
and its replayed traces (``s5c``) show the chain's producer stalled in its second round (median
tile 298 us against 106 us) where it waits for its first round's remote stores to complete.
Each variant below is one CUDA graph, replayed after ``REST_MS`` of idle GPUs (shuffled,
interleaved, ``timing.time_interleaved``):

* ``local`` / ``remote``: our GEMM writing into GPU 0 / into GPU 1;
* ``remote_gpu1_busy``: ``remote`` while GPU 1 starts with a short spin kernel
  (``torch.cuda._sleep``): does waking the receiving GPU speed the writes up?
* ``remote_ping``: ``remote`` with a 4 KiB copy engine copy into GPU 1 issued beside it at the
  start: does traffic on the link ahead of the GEMM's first stores wake it in time?
* ``chain`` / ``chain_ping``: the default pipeline, without / with that ping.

Writes OUT_DIR/rested_remote.json (every repetition) and prints medians.
"""

import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.bench import chain_operands
from ctapipelining.fabric import _cudart, enable_peer_access
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, environment, fork_join, time_interleaved

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
REPS = int(sys.argv[3]) if len(sys.argv) > 3 else 20
REST_MS = float(sys.argv[4]) if len(sys.argv) > 4 else 50.0
K = 8192
out_dir.mkdir(parents=True, exist_ok=True)
x, A, B = chain_operands(M, K)
c_local = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
c_peer = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
ping_src = torch.zeros(1024, dtype=torch.int32, device="cuda:0")
ping_dst = torch.zeros(1024, dtype=torch.int32, device="cuda:1")
side0, side1 = torch.cuda.Stream(0), torch.cuda.Stream(1)
pipe = Pipeline([A, B], config=PIPELINE_CONFIG)
enable_peer_access([0, 1])
SPIN_CYCLES = 200_000  # 0.1 ms at 1.98 GHz, 0.6 ms at an idle 345 MHz: well inside the GEMM


def beside(side, work):
    """``fn`` with ``work`` run on ``side`` (another stream, either GPU) beside it."""
    return lambda fn: lambda: fork_join(side, work, fn)


def spin_gpu1():
    with torch.cuda.device(1):
        torch.cuda._sleep(SPIN_CYCLES)


def ping():
    # a device-to-device cudaMemcpyAsync on the side stream alone, peer access on (torch's peer
    # copy would also sync with GPU 1's current stream, which is not part of the capture, and
    # cudaMemcpyPeerAsync cannot be captured: CUDA error 900)
    v = ctypes.c_void_p
    rc = _cudart().cudaMemcpyAsync(
        v(ping_dst.data_ptr()), v(ping_src.data_ptr()), ctypes.c_size_t(4096), 3, v(side0.cuda_stream)
    )
    if rc != 0:
        raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {rc}")


gemm_local = lambda: matmul(x, A, out=c_local, config=PIPELINE_CONFIG)  # noqa: E731
gemm_remote = lambda: matmul(x, A, out=c_peer, config=PIPELINE_CONFIG)  # noqa: E731
chain = lambda: pipe(x, out=out, check=False)  # noqa: E731
VARIANTS = {
    "local": gemm_local,
    "remote": gemm_remote,
    "remote_gpu1_busy": beside(side1, spin_gpu1)(gemm_remote),
    "remote_ping": beside(side0, ping)(gemm_remote),
    "chain": chain,
    "chain_ping": beside(side0, ping)(chain),
}
graphs = {}
for name, fn in VARIANTS.items():
    fn()
    for d in (0, 1):
        torch.cuda.synchronize(d)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(0), torch.cuda.graph(g):
        fn()
    graphs[name] = g
methods = [Method(name, g.replay) for name, g in graphs.items()]
times = time_interleaved(methods, [0, 1], REPS, warmup=3, rest_ms=REST_MS)
pipe.check_errors()
ok = torch.equal(out, pipe.sequential(x))
med = {k: statistics.median(v) for k, v in times.items()}
for k, v in times.items():
    print(f"{k:20s} {med[k]:8.4f} ms  [{min(v):.4f}, {max(v):.4f}]  /local {med[k] / med['local']:.3f}")
print("chain output bitwise equal to the sequential GEMMs:", ok)
report = dict(environment=environment(), M=M, K=K, reps=REPS, rest_ms=REST_MS, chain_bitwise=ok, ms=times, median=med)
(out_dir / "rested_remote.json").write_text(json.dumps(report, indent=1))
