"""Is the producer slower in the chain because of where it writes, or because of its clocks?

usage: python3 benchmarks/clocks_under_load.py OUT_DIR [M] [SECONDS]

The replayed traces of the third session measured producer tiles of 93-96 us writing into the
peer against 89-91 us for the same kernel writing locally. This runs each phase below
back to back from a CUDA graph for ``SECONDS`` while ``nvidia-smi`` samples both GPUs' SM
clock and power every 50 ms, and reports per phase the milliseconds per call (CUDA events
on GPU 0 around the whole phase) and the median clock and power of each GPU:

1. ``local``: the pipeline's GEMM (``PIPELINE_CONFIG``) on GPU 0 writing into GPU 0;
2. ``into_peer``: the same GEMM writing into GPU 1's memory (no signals);
3. ``producer_alone``: the chain's producer (writes and signals), no consumer;
4. ``chain``: the whole chain; 5. ``chain_parts4``: the chain with ``wait_parts=4``.

Writes OUT_DIR/clocks_under_load.json.
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.bench import chain_operands
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import capture, environment, run_for, sample_gpus

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 1.5
K = 8192
out_dir.mkdir(parents=True, exist_ok=True)
x, A, B = chain_operands(M, K)
c_local = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
c_peer = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
keep = []  # a CUDA graph keeps addresses, not buffers: keep every pipeline alive


def chain(cfg):
    pipe = Pipeline([A, B], config=cfg)
    keep.append(pipe)
    return lambda: pipe(x, out=out, check=False)


def producer_alone():
    pipe = Pipeline([A, B])
    keep.append(pipe)
    plan = pipe.plan(M)
    return lambda: pipe._launch(plan, x, out, only=[0])


PHASES = {
    "local": lambda: lambda: matmul(x, A, out=c_local, config=PIPELINE_CONFIG),
    "into_peer": lambda: lambda: matmul(x, A, out=c_peer, config=PIPELINE_CONFIG),
    "producer_alone": producer_alone,
    "chain": lambda: chain(PIPELINE_CONFIG),
    "chain_parts4": lambda: chain(dataclasses.replace(PIPELINE_CONFIG, wait_parts=4)),
}


report = dict(environment=environment(), M=M, K=K, seconds=SECONDS, phases={})
for name, make in PHASES.items():
    fn = make()
    g = capture(fn, [0, 1])
    for _ in range(5):
        g.replay()
    for d in (0, 1):
        torch.cuda.synchronize(d)

    (calls, ms), rows = sample_gpus(lambda g=g: run_for(g.replay, SECONDS, batch=20))
    phase = dict(calls=calls, ms_per_call=round(ms, 4))
    for d, r in rows.items():
        r = [v for v in r if all(isinstance(t, float) for t in v)]  # no "[N/A]" readings
        if r:
            phase[f"gpu{d}"] = dict(
                samples=len(r),
                sm_mhz_median=statistics.median(v[0] for v in r),
                sm_mhz_min=min(v[0] for v in r),
                power_w_median=statistics.median(v[1] for v in r),
                temp_c_max=max(v[2] for v in r),
            )
    report["phases"][name] = phase
    print(name, json.dumps(phase), flush=True)
for p in keep:
    p.check_errors()
(out_dir / "clocks_under_load.json").write_text(json.dumps(report, indent=1))
