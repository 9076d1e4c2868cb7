"""Deeper TMA pipelines for the plain GEMM at 192-768 rows (diagnostic).

usage: python3 benchmarks/stages_probe.py OUT_DIR [REPS]

At these row counts a CTA's K loop waits on operand loads (one round of tiles; wide_probe), so
more stages in flight may hide more of that latency: ``matmul`` under candidates with 5-8 stages
(narrower K steps where a stage would not fit) against the table's configuration and cuBLAS,
``X[M, 8192] @ W[8192, 8192]`` bf16, each line a CUDA graph of 10 calls, shuffled turns,
paired against cuBLAS.
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul, plain_config
from ctapipelining.kernels.gemm import SMEM_LIMIT, GemmConfig
from ctapipelining.timing import Method, environment, median_ci, time_interleaved

ROWS = (192, 256, 384, 640, 768)
SHAPES = [  # (bm, bn, bk, stages, warps)
    (128, 128, 64, 5, 8), (128, 128, 64, 6, 8), (128, 256, 32, 6, 8), (128, 256, 32, 5, 8),
    (64, 256, 32, 6, 4), (64, 256, 32, 8, 4), (64, 128, 64, 8, 4), (128, 128, 32, 8, 8),
]  # fmt: skip
CANDIDATES = {
    f"{bm}x{bn}x{bk}_s{st}_w{wp}{'_split' if split else ''}": GemmConfig(
        bm, bn, bk, group_m=8, num_stages=st, num_warps=wp, split_tail=split
    )
    for bm, bn, bk, st, wp in SHAPES
    for split in (False, True)
}


def graph_of(fn, calls):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g.replay


def main():
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    w = (torch.randn(8192, 8192, device="cuda") * 8192**-0.5).bfloat16()
    report = {"environment": environment(), "command": " ".join(sys.argv), "reps": reps, "rows": {}}
    for M in ROWS:
        x = torch.randn(M, 8192, device="cuda").bfloat16()
        want = torch.mm(x, w)
        y = torch.empty_like(want)
        runs = {"cublas": graph_of(lambda: torch.mm(x, w, out=y), 10)}  # noqa: B023 (captured now)
        runs["table"] = graph_of(lambda: matmul(x, w, out=y), 10)  # noqa: B023
        for name, cfg in CANDIDATES.items():
            if cfg.smem_bytes() > SMEM_LIMIT:
                continue
            try:
                err = float((matmul(x, w, config=cfg).float() - want.float()).abs().max())
            except Exception as e:  # noqa: BLE001 (out of resource: reported)
                print(M, name, "refused:", str(e).splitlines()[0][:120], flush=True)
                continue
            assert err < 0.05, (M, name, err)
            runs[name] = graph_of(lambda c=cfg: matmul(x, w, out=y, config=c), 10)  # noqa: B023
        times = time_interleaved([Method(k, r) for k, r in runs.items()], [0], reps, 3)
        med = {k: statistics.median(v) / 10 for k, v in times.items()}
        pairs = {}
        for k in times:
            if k != "cublas":
                m, lo, hi = median_ci([a / b for a, b in zip(times[k], times["cublas"])])
                pairs[k] = {"median": m, "ci95": [lo, hi]}
        best = min(pairs, key=lambda k: pairs[k]["median"])
        report["rows"][M] = {
            "table_config": str(plain_config(M)),
            "ms_per_call": med,
            "over_cublas": pairs,
            "best": best,
        }
        print(
            f"{M}: table {pairs['table']['median']:.3f}, best {best} {pairs[best]['median']:.3f} "
            f"[{pairs[best]['ci95'][0]:.3f}, {pairs[best]['ci95'][1]:.3f}]",
            flush=True,
        )
        for k in sorted(pairs, key=lambda k: pairs[k]["median"])[:6]:
            print(f"   {k:28s} {pairs[k]['median']:.3f} [{pairs[k]['ci95'][0]:.3f}, {pairs[k]['ci95'][1]:.3f}]")
    (out_dir / "stages_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
