"""A small 2-stage chain on one GPU, for compute-sanitizer (memcheck, racecheck, synccheck).

usage: compute-sanitizer --tool TOOL python3 benchmarks/sanitize_chain.py [loopback | cross]

X[512, 1024] @ A[1024, 1024] @ B[1024, 1024], bf16, both policies, two calls each, checked
bitwise against the stages one after another; deadlines of 60 s, far beyond the tools'
slowdown. ``loopback``: the stages as two kernels on split SMs instead of one chain kernel;
``cross``: B on cuda:1, the producer writing into it across NVLink (two GPUs).
Prints one line per policy and exits non-zero on a wrong result.
"""

import sys

import torch

from ctapipelining.pipeline import Pipeline


def main() -> int:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    loopback = mode == "loopback"
    torch.manual_seed(0)
    a, b = ((torch.randn(1024, 1024, device="cuda:0") / 32).bfloat16() for _ in range(2))
    if mode == "cross":
        b = b.to("cuda:1")
    bad = 0
    for policy in ("static", "workqueue"):
        pipe = Pipeline([a, b], policy=policy, timeout_s=60.0, loopback=loopback, always_pipelined=True)
        for _ in range(2):
            x = torch.randn(512, 1024, device="cuda:0").bfloat16()
            same = torch.equal(pipe(x, check=True), pipe.sequential(x))
            bad += not same
        print(f"{policy} {mode or 'chain'}: bitwise equal to sequential: {same}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
