"""Where an RMSNorm-fused gate/up GEMM's extra time goes: the norm pass alone (with and without
its copy of the rows), the GEMM's epilogue with statistics given (no pass), the two together,
and the GEMM started during the pass (programmatic dependent launch) or after it. Each line is
a CUDA graph of REPEAT calls, replayed and timed with CUDA events, the lines interleaved.

usage: python3 benchmarks/norm_probe.py OUT_DIR [REPS] [SHAPES]  (SHAPES: HIDDEN:INTERMEDIATE:M,...)
"""

import json
import random
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.epilogue import Epilogue, silu
from ctapipelining.gemm import GemmLaunch, grid_size, matmul
from ctapipelining.kernels.gemm import PLAIN_CONFIG
from ctapipelining.launcher import RawLaunch
from ctapipelining.timing import environment, median_ci

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
SHAPES = [
    tuple(int(v) for v in s.split(":"))
    for s in (sys.argv[3] if len(sys.argv) > 3 else "4096:14336:1024,4096:14336:4096,8192:28672:4096").split(",")
]
REPEAT = 10


def graph(fn):
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(REPEAT):
            fn()
    return g


def probe(H, INTER, M):
    torch.manual_seed(0)
    x = torch.randn(M, H, device="cuda").bfloat16()
    gu = (torch.randn(H, 2 * INTER, device="cuda") * H**-0.5).bfloat16()
    half = torch.empty(M, INTER, device="cuda").bfloat16()
    y = torch.empty_like(x)
    sq = x.float().pow(2).sum(1, keepdim=True).contiguous()
    cfg = PLAIN_CONFIG  # the block's (split tail)
    gated, rms = Epilogue(silu, gated=True), Epilogue(silu, gated=True, rms_eps=1e-5)
    grid = grid_size(M, INTER * 2, cfg, x.device)
    own = GemmLaunch(M, 2 * INTER, H, cfg, grid, x.device, epilogue=rms)
    given = GemmLaunch(M, 2 * INTER, H, cfg, grid, x.device, epilogue=rms, norm_sums=sq)
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731
    lines = {
        "copy": lambda: y.copy_(x),
        "pass": lambda: own.stats(x, stream()),
        "pass_copy": lambda: own.stats(x, stream(), y),
        "gemm_gated": lambda: matmul(x, gu, out=half, config=cfg, epilogue=gated),
        "gemm_rms_given": lambda: given(x, gu, half),
        "pass_gemm_after": lambda: own(x, gu, half, a_copy=y),
    }
    graphs = {k: graph(fn) for k, fn in lines.items()}
    after = RawLaunch.after
    RawLaunch.after = RawLaunch.__call__  # the same launches, each kernel after the one before
    try:
        own._calls.clear()
        graphs["pass_gemm_serial"] = graph(lambda: own(x, gu, half, a_copy=y))
    finally:
        RawLaunch.after = after
    times = {k: [] for k in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    names = list(graphs)
    for _ in range(REPS):
        random.shuffle(names)
        for k in names:
            torch.cuda.synchronize()
            start.record()
            graphs[k].replay()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end) * 1000 / REPEAT)  # us a call
    med = {k: statistics.median(v) for k, v in times.items()}
    ci = median_ci([a / b for a, b in zip(times["pass_gemm_after"], times["pass_gemm_serial"])])
    out = {"us": med, "after/serial": ci}
    print(H, INTER, M, json.dumps(out, indent=1), flush=True)
    return out


def main():
    report = {"environment": environment(), "command": " ".join(sys.argv), "shapes": {}}
    for H, INTER, M in SHAPES:
        report["shapes"][f"H{H}_I{INTER}_M{M}"] = probe(H, INTER, M)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "norm_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
