"""A Llama MLP block from ``transformers``, fused into two GEMMs: checked, compiled, timed.

    python3 examples/llama_block.py [--hidden 4096] [--intermediate 14336] [--rows 1024]

It builds ``transformers``' ``LlamaMLP`` and ``LlamaRMSNorm`` with random weights and turns them
into :class:`ctapipelining.nn.LlamaMLP` (``from_hf``: the norm's weight folded into the gate and
up weights, gate and up columns interleaved). Then:

1. accuracy: the fused block's error against the block computed in float32, beside the error
   of ``transformers``' own block in the same precision (the fused block must stay within 2x);
2. ``torch.compile`` of a model that calls the block, with ``fullgraph=True`` (a graph break
   would raise): the block is the custom operator ``torch.ops.ctapipelining.mlp_block``;
3. on a GPU, the time of one call: the fused block and ``transformers``' block, each
   graph-replayed, in turns (``ctapipelining.timing``), and the fused block called eagerly.

On a GPU the block is bf16 with the library's tiles. Without one, it runs the same kernels under
Triton's CPU interpreter in fp16 on small tiles (slowly: pass small sizes, e.g. ``--hidden 64
--intermediate 128 --rows 32``) and times nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

if not torch.cuda.is_available():  # before the kernels are first imported: Triton decides then
    os.environ.setdefault("TRITON_INTERPRET", "1")

from transformers import LlamaConfig  # noqa: E402  (after the interpreter switch)
from transformers.models.llama.modeling_llama import LlamaMLP as HFLlamaMLP  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from ctapipelining.kernels.gemm import GemmConfig  # noqa: E402
from ctapipelining.nn import LlamaMLP  # noqa: E402

CPU_TILES = GemmConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_stages=2, num_warps=4)  # interpreter sizes


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


def float32_block(mlp, norm, x: torch.Tensor) -> torch.Tensor:
    """``x + mlp(norm(x))`` in float32, from the same weights."""
    x = x.float()
    xn = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight.float()
    gate, up = xn @ mlp.gate_proj.weight.float().t(), xn @ mlp.up_proj.weight.float().t()
    return x + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.float().t()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H (default 4096, Llama-8B's)")
    p.add_argument("--intermediate", type=int, default=14336, help="intermediate size I (default 14336)")
    p.add_argument("--rows", type=int, default=1024, help="rows of x, tokens (default 1024)")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions on a GPU (default 20)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda:0", torch.bfloat16) if gpu else ("cpu", torch.float16)
    H, inter, M = args.hidden, args.intermediate, args.rows

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=H, intermediate_size=inter, hidden_act="silu", rms_norm_eps=1e-5)
    mlp = HFLlamaMLP(config).to(device, dtype)
    norm = LlamaRMSNorm(H, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
    norm = norm.to(device, dtype)
    tiles = {} if gpu else dict(gate_up_config=CPU_TILES, down_config=CPU_TILES)
    block = LlamaMLP.from_hf(mlp, norm, **tiles)
    x = torch.randn(M, H, device=device).to(dtype)
    print(f"Llama MLP block, hidden {H}, intermediate {inter}, {M} rows, {dtype} on {device}")
    kind = "unfused" if block.runs_unfused(M) else "fused"  # (at the rows of LlamaMLP.unfused_rows: unfused)

    with torch.no_grad():
        ref = float32_block(mlp, norm, x)
        theirs = x + mlp(norm(x))
        ours = block(x)
        ok = not ours.isnan().any() and rel_err(ours, ref) <= 2 * max(rel_err(theirs, ref), 1e-4)
        print(
            f"  error against float32: {kind} {rel_err(ours, ref):.2e}, transformers' block "
            f"{rel_err(theirs, ref):.2e} ({'within' if ok else 'NOT within'} 2x)"
        )

        class Model(torch.nn.Module):  # a model that calls the block between two other ops
            def __init__(self):
                super().__init__()
                self.block = block

            def forward(self, t):
                return self.block(t * 0.5) * 2

        compiled = torch.compile(Model(), backend="eager" if not gpu else "inductor", fullgraph=True)
        same = torch.equal(compiled(x), block(x * 0.5) * 2)
        print(f"  torch.compile(fullgraph=True) traces through the block: equal to eager {same}")
        ok = ok and same
        if gpu:
            from ctapipelining.timing import Method, capture, time_interleaved

            y = torch.empty_like(x)
            fused = capture(lambda: y.copy_(block(x)), [0])
            hf = capture(lambda: y.copy_(x + mlp(norm(x))), [0])
            methods = [Method("fused", fused.replay), Method("transformers", hf.replay)]
            methods.append(Method("eager", lambda: block(x)))
            ms = {k: statistics.median(v) for k, v in time_interleaved(methods, [0], args.reps, 3).items()}
            print(
                f"  graph-replayed: {kind} {ms['fused']:.3f} ms, transformers' block {ms['transformers']:.3f} ms "
                f"({ms['fused'] / ms['transformers']:.3f}x); the {kind} block called eagerly {ms['eager']:.3f} ms"
            )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
