"""Where an eager call's host time goes: the chain kernel (two 8192-wide layers on one GPU) at
2048 rows, 300 calls back to back under cProfile, and the host time per call with the GPU busy.

usage: python3 benchmarks/profile_eager.py OUT_DIR
"""

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

from ctapipelining.pipeline import Pipeline

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")


def main():
    torch.manual_seed(0)
    ws = [(torch.randn(8192, 8192, device="cuda") / 90).bfloat16() for _ in range(2)]
    pipe = Pipeline(ws)
    x = torch.randn(2048, 8192, device="cuda").bfloat16()
    out = torch.empty(2048, 8192, device="cuda").bfloat16()
    for _ in range(20):
        pipe(x, out=out)
    pipe.check_errors()
    torch.cuda.synchronize()
    # host time per call while the GPU is busy (a long sleep first)
    torch.cuda._sleep(2_000_000_000)
    t0 = time.perf_counter()
    for _ in range(100):
        pipe(x, out=out)
    host = (time.perf_counter() - t0) / 100 * 1e6
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    torch.cuda._sleep(4_000_000_000)
    prof.enable()
    for _ in range(300):
        pipe(x, out=out)
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
    report = f"host us per eager call (GPU busy): {host:.1f}\n" + s.getvalue()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "profile_eager.txt").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
