"""Tile configurations for a fused block's two GEMMs at few rows (decode), each GEMM alone with
its epilogue against the same GEMM in cuBLAS: what ``ctapipelining.nn.FEW_ROWS_CONFIGS`` holds.

usage: python3 benchmarks/block_tiles.py OUT_DIR [REPS] [ROWS] [BLOCKS]  (an empty ROWS or BLOCKS: the default)

On cuda:0, bf16, blocks from random weights (BLOCKS, default ``llama8b,llama70b``: the Llama-8B
(hidden 4096, intermediate 14336) and Llama-70B (8192, 28672) blocks; ``gpt``: a GPT-style block
(4096, 16384)), at each M of ROWS (default 1, 16, 64, 128, 256, 384, 512, 768): the first GEMM
(its norm pass, the norm's row scale and the activation in its epilogue, copying ``x`` into the
output; ``gate_up``, or ``up`` for GPT) and the down GEMM (adding onto the output) under each candidate of
:data:`CANDIDATES`, each checked against the block's own configuration; and cuBLAS's
``x @ [gate|up]`` and ``h @ down``. Each line is a CUDA graph of 10 calls, timed by the bench's
harness (shuffled turns, paired). Writes OUT_DIR/block_tiles.json: per shape, M and GEMM the
medians, each candidate over cuBLAS (median and 95% CI) and the fastest by median, ``best``.
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import EPILOGUE_CONFIG, SMEM_LIMIT, GemmConfig
from ctapipelining.nn import GPTMLP, LlamaMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
ARGS = sys.argv[3:] + ["", ""]  # ROWS, BLOCKS; empty: the default
ROWS = [int(m) for m in ARGS[0].split(",")] if ARGS[0] else [1, 16, 64, 128, 256, 384, 512, 768]
BLOCKS = (ARGS[1] or "llama8b,llama70b").split(",")
SHAPES = {"llama8b": (4096, 14336), "llama70b": (8192, 28672), "gpt": (4096, 16384)}
CALLS = 10  # calls per graph: a line's time is long next to the harness's synchronisation


def _candidates() -> dict[str, GemmConfig]:
    out = {"default": EPILOGUE_CONFIG}
    tiles = [(128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (64, 256, 32, 8, 4), (64, 128, 64, 5, 4), (64, 128, 64, 8, 4),
             (64, 128, 128, 4, 4), (64, 64, 128, 6, 4), (64, 64, 64, 10, 4)]  # fmt: skip
    for bm, bn, bk, st, wp in tiles:
        for split in (True, False):
            c = GemmConfig(bm, bn, bk, group_m=8, num_stages=st, num_warps=wp, split_tail=split, split_k=split)
            if c.smem_bytes() <= SMEM_LIMIT:
                out[f"{bm}x{bn}x{bk}_s{st}_w{wp}{'_split' if split else ''}"] = c
    return out


CANDIDATES = _candidates()


def graphed(fn):
    def calls():
        for _ in range(CALLS):
            fn()

    return capture(calls, [0]).replay


def one(H: int, inter: int, M: int, gpt: bool = False) -> dict:
    torch.manual_seed(M)
    dev = "cuda:0"
    w_down = (torch.randn(H, inter, device=dev) * inter**-0.5).bfloat16()
    if gpt:
        w_1 = (torch.randn(inter, H, device=dev) * H**-0.5).bfloat16()
        b_1, b_2 = (torch.randn(n, device=dev).bfloat16() * 0.1 for n in (inter, H))
        norm = torch.rand(H, device=dev).bfloat16() + 0.5, torch.randn(H, device=dev).bfloat16() * 0.1
        block, w_in_plain = GPTMLP(w_1, b_1, w_down, b_2, *norm), w_1.t().contiguous()
    else:
        w_gate, w_up = ((torch.randn(inter, H, device=dev) * H**-0.5).bfloat16() for _ in range(2))
        block = LlamaMLP(w_gate, w_up, w_down, torch.rand(H, device=dev).bfloat16() + 0.5)
        w_in_plain = torch.cat([w_gate.t(), w_up.t()], 1).contiguous()
    first, second = block._epilogues()
    name_in = "up" if gpt else "gate_up"
    x = torch.randn(M, H, device=dev).bfloat16()
    y, h = torch.empty(M, H, device=dev, dtype=torch.bfloat16), torch.empty(M, inter, device=dev, dtype=torch.bfloat16)
    h_real = matmul(x, block.w_in, config=EPILOGUE_CONFIG, epilogue=first, a_copy=y)
    y_ref = matmul(h_real, block.w_out, out=y.copy_(x), config=EPILOGUE_CONFIG, epilogue=second, residual=y).clone()
    w_out_plain = w_down.t().contiguous()
    gu_out, dn_out = torch.empty(M, w_in_plain.shape[1], device=dev, dtype=torch.bfloat16), torch.empty_like(y)
    lines = {name_in: {"cublas": lambda: torch.mm(x, w_in_plain, out=gu_out)},
             "down": {"cublas": lambda: torch.mm(h_real, w_out_plain, out=dn_out)}}  # fmt: skip
    wrong = {}
    for name, c in CANDIDATES.items():
        got_h = matmul(x, block.w_in, config=c, epilogue=first, a_copy=y)
        got_y = matmul(h_real, block.w_out, out=y.copy_(x), config=c, epilogue=second, residual=y)
        for what, got, want in ((name_in, got_h, h_real), ("down", got_y, y_ref)):
            err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
            if not err < 2e-2:
                wrong[f"{name}/{what}"] = err
        lines[name_in][name] = lambda c=c: matmul(x, block.w_in, out=h, config=c, epilogue=first, a_copy=y)
        lines["down"][name] = lambda c=c: matmul(h_real, block.w_out, out=y, config=c, epilogue=second, residual=y)
    if wrong:
        raise AssertionError(f"H={H} I={inter} M={M}: candidates off the default configuration: {wrong}")
    row = {}
    for gemm, fns in lines.items():
        methods = [Method(name, graphed(fn)) for name, fn in fns.items()]
        times = time_interleaved(methods, [0], REPS, 3)
        ms = {k: statistics.median(v) / CALLS for k, v in times.items()}
        over = {}
        for k in fns:
            med, lo, hi = median_ci([p / q for p, q in zip(times[k], times["cublas"])])
            over[k] = {"median": med, "ci95": [lo, hi]}
        best = min((k for k in fns if k != "cublas"), key=ms.__getitem__)
        row[gemm] = {"median_ms": ms, "over_cublas": over, "best": best}
        print(f"  {gemm}: cublas {ms['cublas'] * 1e3:.1f} us; best {best} {over[best]['median']:.3f}; "
              f"default {over['default']['median']:.3f}", flush=True)  # fmt: skip
    return row


def main():
    report = {"environment": environment(), "reps": REPS, "calls_per_graph": CALLS, "command": " ".join(sys.argv)}
    report["candidates"] = {k: dataclasses.asdict(c) for k, c in CANDIDATES.items()}
    report["shapes"] = {}
    for name in BLOCKS:
        H, inter = SHAPES[name]
        for M in ROWS:
            print(f"{name} M={M}", flush=True)
            report["shapes"][f"{name}_M{M}"] = one(H, inter, M, gpt=name == "gpt")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "block_tiles.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
