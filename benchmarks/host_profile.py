"""Where an eager call's host time goes (a diagnostic: deleted once its finding is written down).

usage: python3 benchmarks/host_profile.py OUT_DIR

While the GPU sleeps, 40 eager calls of the plain GEMM (X[2048, 8192] @ W[8192, 8192], ``out``
given) and of a two-stage chain on cuda:0 (``check=False``), profiled with cProfile (five
batches); prints the functions by own time and writes OUT_DIR/host_profile.txt.
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")


def batches(call, n=40, times=5, profile=None):
    us = []
    for _ in range(times):
        torch.cuda._sleep(1_000_000_000)
        if profile:
            profile.enable()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        us.append((time.perf_counter() - t0) / n * 1e6)
        if profile:
            profile.disable()
        torch.cuda.synchronize()
    return sorted(us)


def main():
    torch.manual_seed(0)
    w = (torch.randn(8192, 8192, device="cuda:0") * 8192**-0.5).bfloat16()
    x = torch.randn(2048, 8192, device="cuda:0").bfloat16()
    y = torch.empty_like(x)
    pipe = Pipeline([w, w])
    calls = {
        "plain": lambda: matmul(x, w, out=y),
        "chain": lambda: pipe(x, out=y),
        "cublas": lambda: torch.mm(x, w, out=y),
    }
    text = io.StringIO()
    for name, call in calls.items():
        call()
        torch.cuda.synchronize()
        plain_us = batches(call)
        prof = cProfile.Profile()
        profiled_us = batches(call, profile=prof)
        print(f"== {name}: host us per call {plain_us} (profiled {profiled_us})", file=text)
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(28)
    (OUT / "host_profile.txt").write_text(text.getvalue())
    print(text.getvalue())


if __name__ == "__main__":
    main()
