"""Where the fused Llama block's time goes: each of its GEMMs with each part of its epilogue,
against the same GEMM plain and in cuBLAS, graph-replayed, paired (one H200; default the
Llama-70B MLP at M = 4096). The down GEMM's residual two ways: loaded by the epilogue on 128 x
128 tiles (as a pipeline stage does), and added onto the output by TMA on the plain GEMM's tiles
(``matmul``). Each plain GEMM, and each with its whole epilogue, also with its last partial
round split along K (``_split``: the summing CTA applies the epilogue), and on 128 x 128
tiles (``_n128``). The whole block (:class:`ctapipelining.nn.LlamaMLP`, ``block``) against its
two cuBLAS GEMMs in one graph (``gemms_cublas``), and, with OLD_PARENT (a folder holding an
older tree as ``ctapipelining_old``), the old tree's block (``block_old``) in the same run.

usage: python3 benchmarks/mlp_parts.py OUT_DIR [REPS] [SHAPES] [OLD_PARENT]

SHAPES: comma-separated ``HIDDEN:INTERMEDIATE:M`` (default ``8192:28672:4096``); OUT_DIR/mlp_parts.json
holds one record per shape.
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.epilogue import Epilogue, silu
from ctapipelining.gemm import GemmLaunch, grid_size, matmul
from ctapipelining.kernels.gemm import PLAIN_CONFIG
from ctapipelining.nn import LlamaMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
SHAPES = [
    tuple(int(v) for v in s.split(":")) for s in (sys.argv[3] if len(sys.argv) > 3 else "8192:28672:4096").split(",")
]
OLD = sys.argv[4] if len(sys.argv) > 4 else None


def main():
    old_block = None  # the older tree's LlamaMLP, imported once
    if OLD:
        sys.path.insert(0, OLD)
        from ctapipelining_old.nn import LlamaMLP as old_block
    report = {"environment": environment(), "command": " ".join(sys.argv), "shapes": {}}
    for H, INTER, M in SHAPES:
        report["shapes"][f"H{H}_I{INTER}_M{M}"] = parts(H, INTER, M, old_block)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "mlp_parts.json").write_text(json.dumps(report, indent=1))


def parts(H: int, INTER: int, M: int, old_block=None) -> dict:
    torch.manual_seed(0)
    x = torch.randn(M, H, device="cuda").bfloat16()
    gu = (torch.randn(H, 2 * INTER, device="cuda") * H**-0.5).bfloat16()
    down = (torch.randn(INTER, H, device="cuda") * INTER**-0.5).bfloat16()
    h = torch.randn(M, INTER, device="cuda").bfloat16()
    full, half = torch.empty(M, 2 * INTER, device="cuda").bfloat16(), torch.empty(M, INTER, device="cuda").bfloat16()
    y = torch.empty(M, H, device="cuda").bfloat16()
    cfg3 = dataclasses.replace(PLAIN_CONFIG, split_tail=False)
    split3 = dataclasses.replace(PLAIN_CONFIG, split_tail=True)
    n128 = dataclasses.replace(cfg3, block_n=128, num_stages=4)
    gated, gated_rms = Epilogue(silu, gated=True), Epilogue(silu, gated=True, rms_eps=1e-5)
    res = Epilogue(residual=True)
    # the residual loaded by the epilogue (as a pipeline stage does), on the tiles that leave it room
    load = GemmLaunch(M, H, INTER, n128, grid_size(M, H, INTER, n128, x.device), x.device, epilogue=res)
    lines = {
        "gu_cublas": lambda: torch.mm(x, gu, out=full),
        "gu_plain": lambda: matmul(x, gu, out=full, config=cfg3),
        "gu_plain_split": lambda: matmul(x, gu, out=full, config=split3),
        "gu_plain_n128": lambda: matmul(x, gu, out=full, config=n128),
        "gu_gated": lambda: matmul(x, gu, out=half, config=cfg3, epilogue=gated),
        "gu_gated_rms": lambda: matmul(x, gu, out=half, config=cfg3, epilogue=gated_rms),
        "gu_gated_rms_split": lambda: matmul(x, gu, out=half, config=split3, epilogue=gated_rms),
        "down_cublas": lambda: torch.mm(h, down, out=y),
        "down_plain3": lambda: matmul(h, down, out=y, config=cfg3),
        "down_plain3_split": lambda: matmul(h, down, out=y, config=split3),
        "down_plain_n128": lambda: matmul(h, down, out=y, config=n128),
        "down_res_load_n128": lambda: load(h, down, y, residual=x),
        "down_res_add3": lambda: matmul(h, down, out=y, config=cfg3, epilogue=res, residual=x),
        "down_res_add3_split": lambda: matmul(h, down, out=y, config=split3, epilogue=res, residual=x),
    }
    w_gate, w_up = ((torch.randn(INTER, H, device="cuda") * H**-0.5).bfloat16() for _ in range(2))
    w_down = (torch.randn(H, INTER, device="cuda") * INTER**-0.5).bfloat16()
    g = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
    blocks = {"block": LlamaMLP(w_gate, w_up, w_down, g)}
    if old_block is not None:
        blocks["block_old"] = old_block(w_gate, w_up, w_down, g)
    with torch.no_grad():
        want = blocks["block"](x).float()
        for name, blk in blocks.items():  # the old tree's norm pass may sum in another order
            assert float((blk(x).float() - want).norm() / want.norm()) < 1e-2, name
            lines[name] = lambda blk=blk: blk(x)
    h_real = blocks["block"].first_gemm(x)
    lines["gemms_cublas"] = lambda: (torch.mm(x, gu, out=full), torch.mm(h_real, down, out=y))
    methods = [Method(k, capture(fn, [0]).replay) for k, fn in lines.items()]
    times = time_interleaved(methods, [0], REPS, 3)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {f"{k}/{base}": round(med[k] / med[base], 4) for k in med for base in ("gu_cublas", "down_cublas")
              if k.split("_")[0] == base.split("_")[0]}  # fmt: skip
    for name in blocks:
        ratios[f"{name}/gemms_cublas"] = round(med[name] / med["gemms_cublas"], 4)
    if "block_old" in times:
        med_, lo, hi = median_ci([p / q for p, q in zip(times["block"], times["block_old"])])
        ratios["block/block_old"] = {"median": med_, "ci95": [lo, hi]}
    print(H, INTER, M, json.dumps({"median_ms": med, "ratios": ratios}, indent=1), flush=True)
    return {"median_ms": med, "ratios": ratios}


if __name__ == "__main__":
    main()
