"""Llama MLP blocks stacked: one pipeline (:class:`ctapipelining.nn.LlamaStack`) against the
same fused blocks one after another, on one GPU (issue 16's stacks; the 2-GPU runs place one
block per GPU).

usage: python3 benchmarks/mlp_stack.py OUT_DIR [REPS] [ONLY]

Two blocks of Llama-8B (hidden 4096, intermediate 14336) at M = 1024, 4096 and of Llama-70B
(8192, 28672) at M = 4096, bf16, different weights per block. ONLY: the shapes whose key
contains it. Lines, graph-replayed, timed by the bench's harness (shuffled turns, paired):

* ``stack``: the stack as one pipeline (``always_pipelined=True``: on one GPU the default stack
  runs its blocks one after another, the ``blocks`` line), each GEMM in its block's
  configuration (four kernels one after another on the GPU's stream);
* ``stack_chain``: the same with its four GEMMs in one chain kernel (``nn.STACK_CONFIG``);
* ``blocks``: the two :class:`ctapipelining.nn.LlamaMLP` blocks called one after another;
* ``cublas_gemms``: the four GEMMs alone in cuBLAS (each reading the block's real input).

Also ``stack_eager``: the stack called eagerly. Checks the stack bitwise against its GEMMs one
after another first.

With two or more GPUs, also two Llama-70B blocks at M = 4096 and 8192 with one block per GPU
(``two_gpus`` in the JSON), every line graph-replayed:

* ``stack``: the stack as one pipeline over cuda:0 and cuda:1 (block 0's second GEMM feeding
  block 1's first GEMM on the other GPU, row-block by row-block), each GEMM in its block's
  configuration (a GPU's two GEMMs one kernel after the other);
* ``stack_chain``: the same with every GEMM in ``nn.STACK_CONFIG``, so that a GPU's two GEMMs
  share one chain kernel (the model puts this well ahead of ``stack``: ``sim.figure_blocks``);
* ``floor``: one fused block on one GPU (half the stack's work);
* ``microbatch/C``: the same fused blocks micro-batched over the two GPUs in chunks of C rows
  (:class:`ctapipelining.baselines.MicroBatch`; the fused block runs within 1.0x of
  ``torch.compile`` of ``transformers``' block on one H200, so it is the faster kernel to
  micro-batch);
* ``tp``, ``tp_overlap``: Megatron tensor parallelism of each block over both GPUs, its NCCL
  all-reduce after the block, or overlapped in 4 chunks of rows
  (:class:`ctapipelining.baselines.TensorParallelBlocks`);
* ``split``: one block split the paper's way, its gate/up GEMM on cuda:0 and its down GEMM on
  cuda:1 (two thirds of the work on the first GPU), against ``floor`` (the same block on one GPU).

Prints and writes OUT_DIR/mlp_stack.json: medians and paired ratios with 95% CIs.
"""

import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.baselines import MicroBatch, TensorParallelBlocks
from ctapipelining.nn import STACK_CONFIG, LlamaMLP, LlamaStack
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
ONLY = sys.argv[3] if len(sys.argv) > 3 else ""
SHAPES = [(4096, 14336, 1024), (4096, 14336, 4096), (8192, 28672, 4096)]
SHAPES_2GPU = [(8192, 28672, 4096), (8192, 28672, 8192)]
CHUNKS = (512, 1024, 2048)


def ci(ratios):
    med, lo, hi = median_ci(ratios)
    return {"median": med, "ci95": [lo, hi]}


def block_weights(H: int, inter: int) -> tuple:
    """A Llama block's gate, up, down and norm weights."""

    def w(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * cols**-0.5).bfloat16()

    return w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device="cuda")).bfloat16()


def one_shape(H: int, inter: int, M: int) -> dict:
    torch.manual_seed(0)
    blocks = [LlamaMLP(*block_weights(H, inter), 1e-5) for _ in range(2)]
    x = torch.randn(M, H, device="cuda").bfloat16()
    stack, chain = (LlamaStack(blocks, config=c, always_pipelined=True) for c in (None, STACK_CONFIG))
    row = {"bitwise": all(torch.equal(s(x), s.sequential(x)) for s in (stack, chain))}
    row["default_is_blocks"] = torch.equal(LlamaStack(blocks)(x), blocks[1](blocks[0](x)))
    h0 = blocks[0].first_gemm(x)
    x1 = blocks[0](x)
    h1 = blocks[1].first_gemm(x1)
    bufs = [torch.empty(M, n, device="cuda", dtype=torch.bfloat16) for n in (2 * inter, H, 2 * inter, H)]

    def gemms():
        torch.mm(x, blocks[0].w_in, out=bufs[0])
        torch.mm(h0, blocks[0].w_out, out=bufs[1])
        torch.mm(x1, blocks[1].w_in, out=bufs[2])
        torch.mm(h1, blocks[1].w_out, out=bufs[3])

    with torch.no_grad():
        methods = [
            Method("stack", capture(lambda: stack(x), [0]).replay),
            Method("stack_eager", lambda: stack(x)),
            Method("stack_chain", capture(lambda: chain(x), [0]).replay),
            Method("blocks", capture(lambda: blocks[1](blocks[0](x)), [0]).replay),
            Method("cublas_gemms", capture(gemms, [0]).replay),
        ]
        times = time_interleaved(methods, [0], REPS, 3)
    stack.pipeline.check_errors()
    row["median_ms"] = {k: statistics.median(v) for k, v in times.items()}
    for num, den in (("stack", "blocks"), ("stack_chain", "blocks"),  ("stack", "cublas_gemms"),
                     ("blocks", "cublas_gemms"), ("stack_eager", "stack")):  # fmt: skip
        row[f"{num}/{den}"] = ci([p / q for p, q in zip(times[num], times[den])])
    return row


def two_gpus(H: int, inter: int, M: int) -> dict:
    """Two blocks, one per GPU, against one block on one GPU, micro-batching and tensor
    parallelism (module docstring)."""
    torch.manual_seed(0)
    weights = [block_weights(H, inter) for _ in range(2)]
    placed = [LlamaMLP(*(w.to(f"cuda:{d}") for w in ws), 1e-5) for d, ws in enumerate(weights)]
    stack, chain = LlamaStack(placed), LlamaStack(placed, config=STACK_CONFIG)
    x = torch.randn(M, H, device="cuda:0").bfloat16()
    want = stack(x)
    row = {"bitwise": torch.equal(want, stack.sequential(x)) and torch.equal(chain(x), chain.sequential(x))}
    y1, y2 = torch.empty_like(want), torch.empty_like(want)  # the captured stacks' outputs (a graph's buffers stay put)
    (w_in, w_out), configs, epilogues = placed[0].pipeline_stages()
    # split: its down GEMM on the second GPU, its residual read from the first
    split = Pipeline([w_in, w_out.to("cuda:1")], config=configs, epilogues=epilogues)
    row["split_bitwise"] = torch.equal(split(x), split.sequential(x))
    y_split = torch.empty_like(want)
    lines = {f"microbatch/{c}": MicroBatch(placed, M, c) for c in CHUNKS if c < M}
    on_first = [LlamaMLP(*ws, 1e-5) for ws in weights]  # split by TensorParallelBlocks
    lines["tp"] = TensorParallelBlocks(on_first, [0, 1], M, chunks=1, graph=True)
    lines["tp_overlap"] = TensorParallelBlocks(on_first, [0, 1], M, chunks=4, graph=True)
    row["graphed"] = {}
    for name, line in lines.items():
        for xs in line.x if isinstance(line.x, list) else [line.x]:
            xs.copy_(x)
        got = line().to(want.device)
        row[f"{name}_max_abs_diff"] = float((got.float() - want.float()).abs().max())  # their own roundings
        row["graphed"][name] = line.graphed or line.graph_error[:120]
    with torch.no_grad():
        methods = [
            Method("stack", capture(lambda: stack.pipeline(x, out=y1), [0, 1]).replay),
            Method("stack_chain", capture(lambda: chain.pipeline(x, out=y2), [0, 1]).replay),
            Method("floor", capture(lambda: placed[0](x), [0]).replay),
            Method("split", capture(lambda: split(x, out=y_split), [0, 1]).replay),
            *(Method(name, line) for name, line in lines.items()),
        ]
        times = time_interleaved(methods, [0, 1], REPS, 3)
    stack.pipeline.check_errors()
    chain.pipeline.check_errors()
    split.check_errors()
    med = row["median_ms"] = {k: statistics.median(v) for k, v in times.items()}
    best = min((k for k in med if k.startswith("microbatch/")), key=med.get)
    row["best_microbatch"] = best
    for num, den in (
        ("stack", "floor"),
        ("stack", best),
        ("stack_chain", "floor"),
        ("stack_chain", best),
        ("stack", "tp"),
        ("stack", "tp_overlap"),
        ("tp_overlap", "tp"),
        ("split", "floor"),
    ):
        row[f"{num}/{den.split('/')[0]}"] = ci([p / q for p, q in zip(times[num], times[den])])
    return row


def main():
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "shapes": {}}
    for H, inter, M in SHAPES:
        key = f"H{H}_I{inter}_M{M}"
        if ONLY not in key:
            continue
        report["shapes"][key] = row = one_shape(H, inter, M)
        print(key, json.dumps(row), flush=True)
    if torch.cuda.device_count() >= 2:
        report["two_gpus"] = {}
        for H, inter, M in SHAPES_2GPU:
            key = f"H{H}_I{inter}_M{M}"
            if ONLY not in key:
                continue
            report["two_gpus"][key] = row = two_gpus(H, inter, M)
            print("2 GPUs", key, json.dumps(row), flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "mlp_stack.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
