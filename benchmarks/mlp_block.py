"""One fused MLP block on one GPU against ``torch.compile`` of ``transformers``' block and
against its two GEMMs alone in cuBLAS (issue 16's speed targets).

usage: python3 benchmarks/mlp_block.py OUT_DIR [REPS] [COMPILE_MODE] [BLOCKS] [ONLY]

BLOCKS (default ``llama``; ``llama,gpt`` for both): Llama-70B (hidden 8192, intermediate
28672) at M = 4096 and 8192 and Llama-8B (4096, 14336) at M = 1024 and 4096; a GPT-style block
(4096, 16384) at M = 4096; ``decode``: the two Llama blocks and the GPT block at decode-sized
inputs (M = 1, 16 and 64), where the weights' bandwidth bounds the time (the lines' medians also
give the weights' bytes per second, ``weights_tbps``); ``few``: the same three blocks at M = 128,
256, 384, 512 and 768 (the rows of :data:`ctapipelining.nn.FEW_ROWS_CONFIGS` past 64); ``rows``:
the three blocks at every M of :data:`ROWS` (what the classes' ``unfused_rows`` are chosen on).
ONLY: the shapes whose key (as printed, e.g. ``H8192_I28672_M4096``) contains it. bf16. Lines,
graph-replayed, timed by the bench's harness (shuffled turns, paired):

* ``ours``: :class:`ctapipelining.nn.LlamaMLP` (two GEMMs, norm, SiLU gate and residual fused),
  or :class:`ctapipelining.nn.GPTMLP` (LayerNorm, biases, GELU and residual fused), as built
  without configurations (at the row counts of its class's ``unfused_rows``, unfused);
* ``unfused``: the block's ``unfused`` (its norm, cuBLAS's GEMMs, its activation, bias and
  residual as passes of their own);
* ``fused``: where ``ours`` runs unfused, the fused block in the tiles it has there (also
  ``fused_eager``, called eagerly, and ``ours_eager4`` / ``fused_eager4``: four such blocks
  called eagerly in a row, each on the last one's output, as a model's layers are, from a
  synchronised GPU);
* ``compiled``: ``torch.compile`` of ``x + mlp(norm(x))`` with ``transformers``' modules
  (COMPILE_MODE, default ``max-autotune-no-cudagraphs``; ``default``: torch's default mode;
  ``none``: no such line);
* ``cublas_gemms``: the block's two GEMMs alone in cuBLAS (``x @ [gate|up]``, then the real
  intermediate ``@ down``), nothing else.

Also ``ours_eager``: the block called eagerly, paired with its replay. Prints and writes
OUT_DIR/mlp_block.json: medians and, per shape, ratios with 95% CIs.
"""

import functools
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.nn import GPTMLP, LlamaMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
MODE = sys.argv[3] if len(sys.argv) > 3 else "max-autotune-no-cudagraphs"
BLOCKS = (sys.argv[4] if len(sys.argv) > 4 else "llama").split(",")
ONLY = sys.argv[5] if len(sys.argv) > 5 else ""
LLAMA = ((4096, 14336), (8192, 28672))  # Llama-8B, Llama-70B
FEW = (128, 256, 384, 512, 768)
ROWS = (1, 16, 64, 128, 192, 256, 264, 288, 320, 384, 448, 512, 520, 576, 640, 704, 768, 1024)
SHAPES = {  # (kind, hidden, intermediate, M)
    "llama": [
        ("llama", H, inter, M)
        for H, inter, M in ((8192, 28672, 4096), (8192, 28672, 8192), (4096, 14336, 1024), (4096, 14336, 4096))
    ],
    "gpt": [("gpt", 4096, 16384, 4096)],
    "decode": [("llama", H, inter, M) for H, inter in LLAMA for M in (1, 16, 64)]
    + [("gpt", 4096, 16384, M) for M in (1, 16, 64)],
    "few": [("llama", H, inter, M) for H, inter in LLAMA for M in FEW] + [("gpt", 4096, 16384, M) for M in FEW],
    "rows": [("llama", H, inter, M) for H, inter in LLAMA for M in ROWS] + [("gpt", 4096, 16384, M) for M in ROWS],
}


def ci(ratios):
    med, lo, hi = median_ci(ratios)
    return {"median": med, "ci95": [lo, hi]}


def main():
    report = {"environment": environment(), "reps": REPS, "compile_mode": MODE, "command": " ".join(sys.argv)}
    report["shapes"] = {}
    for kind, H, inter, M in [shape for k in BLOCKS for shape in SHAPES[k]]:
        key = f"{'GPT_' if kind == 'gpt' else ''}H{H}_I{inter}_M{M}"
        if ONLY not in key:
            continue
        report["shapes"][key] = row = one_shape(H, inter, M, kind)
        print(key, json.dumps(row), flush=True)
        torch._dynamo.reset()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mlp_block.json").write_text(json.dumps(report, indent=1))


@functools.cache
def modules(kind: str, H: int, inter: int):
    """``transformers``' block of one shape (random weights, seeded), our block built from it,
    and the plain ``[H, N]`` weights of its two GEMMs for cuBLAS; built once per shape."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=inter, num_attention_heads=64)
        mlp, norm = HFMLP(cfg).cuda().bfloat16().eval(), LlamaRMSNorm(H, eps=1e-5).cuda().bfloat16()
        block = LlamaMLP.from_hf(mlp, norm)
        w_in = torch.cat([mlp.gate_proj.weight.t(), mlp.up_proj.weight.t()], 1).contiguous()
        w_out = mlp.down_proj.weight.t().contiguous()
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        cfg = transformers.GPT2Config(n_embd=H, n_head=32, activation_function="gelu_new")
        mlp, norm = GPT2MLP(inter, cfg).cuda().bfloat16().eval(), torch.nn.LayerNorm(H).cuda().bfloat16()
        block = GPTMLP.from_hf(mlp, norm)
        w_in, w_out = mlp.c_fc.weight.contiguous(), mlp.c_proj.weight.contiguous()  # Conv1D: [in, out]
    for p in list(mlp.parameters()) + list(norm.parameters()):
        p.requires_grad_(False)
    return mlp, norm, block, w_in, w_out


def one_shape(H: int, inter: int, M: int, kind: str = "llama") -> dict:
    """Every line on one block shape and input height; medians and paired ratios."""
    mlp, norm, block, w_in, w_out = modules(kind, H, inter)
    torch.manual_seed(M)
    x = torch.randn(M, H, device="cuda").bfloat16()
    h_real = block.first_gemm(x)
    gu_out = torch.empty(M, w_in.shape[1], device="cuda", dtype=torch.bfloat16)
    y = torch.empty(M, H, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        methods = [
            Method("ours", capture(lambda: block(x), [0]).replay),
            Method("ours_eager", lambda: block(x)),
            Method("unfused", capture(lambda: block.unfused(x), [0]).replay),
            Method(
                "cublas_gemms",
                capture(lambda: (torch.mm(x, w_in, out=gu_out), torch.mm(h_real, w_out, out=y)), [0]).replay,
            ),
        ]
        if block.runs_unfused(M):  # the fused block in the tiles it has at M, replayed and eager
            ours4 = [type(block).from_hf(mlp, norm) for _ in range(4)]  # four layers (each replays its own last call)
            fused4 = [type(block).from_hf(mlp, norm) for _ in range(4)]
            for b in fused4:
                b.in_config, b.out_config = block.configs_for(M)
            fused = fused4[0]
            methods += [
                Method("fused", capture(lambda: fused(x), [0]).replay),
                Method("fused_eager", lambda: fused(x)),
                # four blocks called in a row, each on the last one's output, as a model's layers call them
                Method("ours_eager4", lambda: ours4[3](ours4[2](ours4[1](ours4[0](x))))),
                Method("fused_eager4", lambda: fused4[3](fused4[2](fused4[1](fused4[0](x))))),
            ]
        if MODE != "none":
            compiled = torch.compile(lambda x: x + mlp(norm(x)), mode=None if MODE == "default" else MODE)
            compiled(x)
            compiled(x)
            methods.append(Method("compiled", capture(lambda: compiled(x), [0]).replay))
        times = time_interleaved(methods, [0], REPS, 3)
    row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}}
    weight_bytes = (w_in.numel() + w_out.numel()) * w_in.element_size()
    row["weights_tbps"] = {k: round(weight_bytes / (ms * 1e-3) / 1e12, 3) for k, ms in row["median_ms"].items()}
    for num, den in (("ours", "compiled"), ("ours", "cublas_gemms"), ("ours_eager", "ours"),
                     ("compiled", "cublas_gemms"), ("unfused", "cublas_gemms"), ("unfused", "ours"),
                     ("fused", "cublas_gemms"), ("unfused", "fused"), ("ours_eager", "fused_eager"),
                     ("ours_eager4", "fused_eager4")):  # fmt: skip
        if num in times and den in times:
            row[f"{num}/{den}"] = ci([p / q for p, q in zip(times[num], times[den])])
    return row


if __name__ == "__main__":
    main()
