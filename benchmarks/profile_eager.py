"""Where an eager call's host time goes (the ~0.26 ms an eager call costs over a replay).

usage: python3 benchmarks/profile_eager.py [M] [CALLS]
Times the host side of ``CALLS`` eager calls (until ``Pipeline.__call__`` returns, and until
both GPUs are done), then profiles them with cProfile and prints the functions that take the
most time.
"""

import cProfile
import pstats
import statistics
import sys
import time

import torch

from ctapipelining.pipeline import Pipeline

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
K = 8192
ws = [(torch.randn(K, K, device=f"cuda:{d}") / K**0.5).bfloat16() for d in (0, 1)]
x = torch.randn(M, K, device="cuda:0").bfloat16()
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
pipe = Pipeline(ws)
for _ in range(5):
    pipe(x, out=out, check=False)


def sync():
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


host, total = [], []
for _ in range(CALLS):
    sync()
    t0 = time.perf_counter()
    pipe(x, out=out, check=False)
    t1 = time.perf_counter()
    sync()
    t2 = time.perf_counter()
    host.append((t1 - t0) * 1e3)
    total.append((t2 - t0) * 1e3)
print(f"host time of a call {statistics.median(host):.3f} ms, call until done {statistics.median(total):.3f} ms")
sync()
prof = cProfile.Profile()
prof.enable()
for _ in range(CALLS):
    pipe(x, out=out, check=False)
prof.disable()
sync()
pipe.check_errors()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
