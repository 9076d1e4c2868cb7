"""Programmatic dependent launches between our GEMMs, against the tree before them, on one GPU,
graph-replayed (and the blocks also eager), paired, in one run: two 8192-wide GEMMs one after
another (``matmul`` twice) and the fused Llama blocks, this tree's against an earlier tree's
(``ctapipelining_old`` in OLD_PARENT), with cuBLAS's GEMMs for reference (the blocks': its
gate/up GEMM as one ``[H, 2I]`` GEMM, then its down GEMM, fed the same data).

usage: python3 benchmarks/pdl_pairs.py OUT_DIR REPS OLD_PARENT

Writes pdl_pairs.json in OUT_DIR and prints each row's ratios (median [95% CI]).
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.nn import LlamaMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT, REPS, OLD = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
K = 8192


def graphed(fn):
    return capture(fn, [0]).replay


def ratios(times: dict, pairs) -> dict:
    out = {}
    for num, den in pairs:
        med, lo, hi = median_ci([p / q for p, q in zip(times[num], times[den])])
        out[f"{num}/{den}"] = {"median": med, "ci95": [lo, hi]}
    return out


def row(times, pairs) -> dict:
    return {"median_ms": {k: statistics.median(v) for k, v in times.items()}} | ratios(times, pairs)


def show(name, r):
    print(name, {k: [round(v["median"], 4), [round(c, 4) for c in v["ci95"]]] for k, v in r.items() if "/" in k},
          flush=True)  # fmt: skip


def time_block(H: int, inter: int, M: int, OldMLP) -> dict:
    """The Llama block of these dims on M rows, this tree's and the earlier one's, graph-replayed
    and eager, with its cuBLAS GEMMs."""
    shapes = ((inter, H), (inter, H), (H, inter))
    ws = [(torch.randn(*s, device="cuda:0") * s[-1] ** -0.5).bfloat16() for s in shapes]
    g = (1 + 0.2 * torch.randn(H, device="cuda:0")).bfloat16()
    block, old = LlamaMLP(*ws, g), OldMLP(*ws, g)
    x = torch.randn(M, H, device="cuda:0").bfloat16()
    want = block(x)
    assert torch.equal(want, old(x)), (H, M)
    w_in, w_down = torch.cat([ws[0], ws[1]]).t().contiguous(), ws[2].t().contiguous()
    hh, yy = torch.empty(M, 2 * inter, dtype=x.dtype, device=x.device), torch.empty_like(x)
    h_real = (0.1 * torch.randn(M, inter, device=x.device)).to(x.dtype)
    for _ in range(3):  # bound: the eager calls below replay their own graphs
        block(x), old(x)
    torch.cuda.synchronize()
    methods = [
        Method("cublas", graphed(lambda: (torch.mm(x, w_in, out=hh), torch.mm(h_real, w_down, out=yy)))),
        Method("block", graphed(lambda: block(x))),
        Method("block_old", graphed(lambda: old(x))),
        Method("block_eager", lambda: block(x)),
        Method("block_old_eager", lambda: old(x)),
    ]
    times = time_interleaved(methods, [0], REPS, 5)
    assert torch.equal(block(x), want) and torch.equal(old(x), want), (H, M)
    pairs = [
        ("block", "block_old"), ("block", "cublas"), ("block_old", "cublas"), ("block_eager", "block_old_eager"),
        ("block_eager", "block"), ("block_old_eager", "block_old"),
    ]  # fmt: skip
    return row(times, pairs)


def main():
    sys.path.insert(0, OLD)
    from ctapipelining_old.gemm import matmul as old_matmul
    from ctapipelining_old.nn import LlamaMLP as OldMLP

    torch.manual_seed(0)
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "gemms": {}, "blocks": {}}
    a, b = ((torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
    for M in (640, 1024, 2048, 16384):
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        h, y = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0"), torch.empty_like(x)
        new = matmul(matmul(x, a), b)
        assert torch.equal(new, old_matmul(old_matmul(x, a), b)), M
        methods = [
            Method("cublas", graphed(lambda x=x, h=h, y=y: (torch.mm(x, a, out=h), torch.mm(h, b, out=y)))),
            Method("ours", graphed(lambda x=x, h=h, y=y: (matmul(x, a, out=h), matmul(h, b, out=y)))),
            Method("ours_old", graphed(lambda x=x, h=h, y=y: (old_matmul(x, a, out=h), old_matmul(h, b, out=y)))),
        ]
        times = time_interleaved(methods, [0], REPS, 5)
        r = report["gemms"][M] = row(times, [("ours", "ours_old"), ("ours", "cublas")])
        show(f"two GEMMs, {M} rows", r)
    for H, inter, M in ((4096, 14336, 1024), (4096, 14336, 4096), (8192, 28672, 4096)):
        r = report["blocks"][f"H{H}_I{inter}_M{M}"] = time_block(H, inter, M, OldMLP)
        show(f"block H{H} I{inter} M{M}", r)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "pdl_pairs.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
