"""The fused Llama block with each candidate tile configuration of its GEMMs, against its two
cuBLAS GEMMs, graph-replayed and paired in one run (one GPU): which configuration a block of a
given shape should take.

usage: python3 benchmarks/block_configs.py OUT_DIR [REPS] [SHAPES]

SHAPES: comma-separated ``HIDDEN:INTERMEDIATE:M`` (default ``4096:14336:4096,4096:14336:1024``,
Llama-8B). Lines per shape: ``cublas_gemms`` (the block's two GEMMs alone in cuBLAS, the second
on the block's real intermediate), ``block`` (:class:`ctapipelining.nn.LlamaMLP` in its default
configurations) and ``gate_up=NAME`` (the block with its gate/up GEMM in candidate ``NAME``,
its down GEMM in its default). A candidate that does not compile (shared memory,
registers) is reported and skipped; each block is checked against the default block (within a
rounding: another tile shape sums K in another order only with a split tail). Writes
OUT_DIR/block_configs.json: medians (ms) and each line over ``cublas_gemms`` and over ``block``
(median and 95% CI of the paired ratios).
"""

import dataclasses
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from ctapipelining.kernels.gemm import EPILOGUE_CONFIG
from ctapipelining.nn import LlamaMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
SHAPES = [
    tuple(int(v) for v in s.split(":"))
    for s in (sys.argv[3] if len(sys.argv) > 3 else "4096:14336:4096,4096:14336:1024").split(",")
]
BASE = EPILOGUE_CONFIG  # the block's default for both GEMMs
CANDIDATES = {
    "g4": dataclasses.replace(BASE, group_m=4),
    "g16": dataclasses.replace(BASE, group_m=16),
    "whole": dataclasses.replace(BASE, split_tail=False),
    "256x128": dataclasses.replace(BASE, block_m=256, block_n=128),
    "128x256x128_s2": dataclasses.replace(BASE, block_k=128, num_stages=2),
}
GEMMS = ("gate_up",)  # which GEMM takes the candidates (the 8B block's gap to cuBLAS is its gate/up GEMM's)


def ci(ratios):
    med, lo, hi = median_ci(ratios)
    return {"median": med, "ci95": [lo, hi]}


def one_shape(H: int, inter: int, M: int) -> dict:
    torch.manual_seed(0)

    def w(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * cols**-0.5).bfloat16()

    weights = (w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device="cuda")).bfloat16())
    x = torch.randn(M, H, device="cuda").bfloat16()
    block = LlamaMLP(*weights, 1e-5)
    want = block(x)
    h = block.first_gemm(x)
    bufs = [torch.empty(M, 2 * inter, device="cuda").bfloat16(), torch.empty(M, H, device="cuda").bfloat16()]

    def gemms():
        torch.mm(x, block.w_in, out=bufs[0])
        torch.mm(h, block.w_out, out=bufs[1])

    row = {"skipped": {}, "error_vs_block": {}}
    blocks = {"block": block}
    for name, cfg in CANDIDATES.items():
        for which in GEMMS:
            label = f"{which}={name}"
            try:
                b = LlamaMLP(*weights, 1e-5, **{f"{which}_config": cfg})
                y = b(x)
                torch.cuda.synchronize()
            except Exception as e:  # a configuration this GEMM cannot take (shared memory, registers)
                row["skipped"][label] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            err = float((y.float() - want.float()).norm() / want.float().norm())
            row["error_vs_block"][label] = err
            if not err < 1e-2:
                row["skipped"][label] = f"wrong: relative error {err:.2e} against the default block"
                continue
            blocks[label] = b
    with torch.no_grad():
        methods = [Method("cublas_gemms", capture(gemms, [0]).replay)]
        methods += [Method(k, capture(lambda b=b: b(x), [0]).replay) for k, b in blocks.items()]
        times = time_interleaved(methods, [0], REPS, 3)
    row["median_ms"] = {k: statistics.median(v) for k, v in times.items()}
    for k in blocks:
        row[f"{k}/cublas_gemms"] = ci([p / q for p, q in zip(times[k], times["cublas_gemms"])])
        if k != "block":
            row[f"{k}/block"] = ci([p / q for p, q in zip(times[k], times["block"])])
    return row


def main():
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "shapes": {}}
    OUT.mkdir(parents=True, exist_ok=True)
    for H, inter, M in SHAPES:
        key = f"H{H}_I{inter}_M{M}"
        try:
            report["shapes"][key] = row = one_shape(H, inter, M)
        except Exception:
            report["shapes"][key] = {"failed": traceback.format_exc()}
            print(key, "FAILED", traceback.format_exc(), flush=True)
            continue
        best = sorted((v["median"], k) for k, v in row.items() if k.endswith("/block"))[:4]
        print(key, "block/cublas", round(row["block/cublas_gemms"]["median"], 4), "best:", best, flush=True)
        print(key, "skipped:", list(row["skipped"]), flush=True)
        (OUT / "block_configs.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
