"""Two stages sharing one GPU, against the same two GEMMs one after another (the floor).

usage: python3 benchmarks/shared_gpu.py OUT_DIR [REPS]

``X[M, 8192] @ A[8192, 8192] @ B[8192, 8192]`` on cuda:0, bf16, at M = 128, 640, 768, 1024,
2048 and 16384, every line graph-replayed and timed by the bench's harness (shuffled turns,
paired), so only ratios inside one run count:

* ``cublas_seq``: ``torch.mm`` twice; ``ours_seq``: :func:`~ctapipelining.gemm.matmul` twice
  (full-GPU grids, each row count in its measured configuration);
* ``chain``: a :class:`~ctapipelining.pipeline.Pipeline` whose two stages share the GPU in one
  chain kernel (one grid, tiles claimed in one combined order), in its configuration per plan
  height (:meth:`~ctapipelining.pipeline.Pipeline.plan_configs`: the measured table;
  ``always_pipelined=True``);
* ``default``: the ``Pipeline`` as a user builds it, which runs plain GEMMs one after another
  (:attr:`~ctapipelining.pipeline.Pipeline.one_after_another`: ours, or cuBLAS's at the row
  counts where it measured faster, :func:`~ctapipelining.serial.runs_cublas`) and should time as
  the faster of ``ours_seq`` and ``cublas_seq``;
* ``chain_wide``: the same on ``PIPELINE_CONFIG``'s 128 x 256 tiles at every height, as are the
  variants below;
* ``loopback``: the same stages as two kernels, each on half the SMs, both resident
  (``loopback=True``);
* ``chain_sm120``: the chain kernel with ``sm_budget=120`` (12 SMs left free for other kernels);
* ``chain_g8``: the chain kernel with groups of 8 row-blocks (the plain GEMM's), not 4;
* ``chain_split``: the chain kernel with its last partial round split along K (``split_tail``);
* ``chain_stage_major``: the chain kernel with its stages one after the other in its combined
  order (:meth:`~ctapipelining.chain.ChainLaunch.set_order` ``None``), not interleaved;
* ``chain_graphedcall``: ``chain`` replayed through :meth:`~ctapipelining.pipeline.Pipeline.capture`'s
  :class:`~ctapipelining.pipeline.GraphedCall` (its host work included), where every other line
  is a bare CUDA graph of its calls (:func:`ctapipelining.timing.capture`).

Each pipeline is checked bitwise against its :meth:`~ctapipelining.pipeline.Pipeline.sequential`
first. Prints and writes OUT_DIR/shared_gpu.json: medians (ms) and, per M, each line over the
faster of the two sequential lines, and the pairs of its ``for num, den`` list (``chain_wide``
over ``loopback``, each variant over ``chain_wide``, ``chain`` over ``chain_wide``; median and 95%
CI).
"""

import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul, plain_config
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
K = 8192
ROWS = (128, 640, 768, 1024, 2048, 16384)


def ci(ratios):
    med, lo, hi = median_ci(ratios)
    return {"median": med, "ci95": [lo, hi]}


def graphed(fn):
    """``fn`` captured in a CUDA graph on cuda:0 (:func:`ctapipelining.timing.capture`): its replay."""
    return capture(fn, [0]).replay


def main():
    torch.manual_seed(0)
    a, b = ((torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
    wide = PIPELINE_CONFIG
    pipes = {
        "chain": Pipeline([a, b], always_pipelined=True),  # its configuration per plan height (the table)
        "default": Pipeline([a, b]),  # plain GEMMs one after another (ours, or cuBLAS's where faster)
        "chain_wide": Pipeline([a, b], config=wide),  # 128 x 256 tiles at every height: the variants'
        "loopback": Pipeline([a, b], loopback=True, config=wide),
        "chain_sm120": Pipeline([a, b], sm_budget=120, config=wide),
        "chain_g8": Pipeline([a, b], config=dataclasses.replace(wide, group_m=8)),
        "chain_split": Pipeline([a, b], config=dataclasses.replace(wide, split_tail=True)),
        "chain_stage_major": Pipeline([a, b], config=wide),
    }
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "rows": {}}
    for M in ROWS:
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        h, y = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0"), torch.empty_like(x)
        for launch in pipes["chain_stage_major"].plan(M).launches:
            launch.gemm.set_order(None)
        for name, pipe in pipes.items():
            assert torch.equal(pipe(x, check=True), pipe.sequential(x)), (name, M)
        methods = [
            Method("cublas_seq", graphed(lambda x=x, h=h, y=y: (torch.mm(x, a, out=h), torch.mm(h, b, out=y)))),
            Method("ours_seq", graphed(lambda x=x, h=h, y=y: (matmul(x, a, out=h), matmul(h, b, out=y)))),
        ] + [Method(name, graphed(lambda pipe=pipe, x=x, y=y: pipe(x, out=y))) for name, pipe in pipes.items()]
        # the same chain through the public GraphedCall (its host work before the replay included)
        graphed_call = pipes["chain"].capture(M)
        graphed_call.x.copy_(x)
        methods.append(Method("chain_graphedcall", graphed_call.replay))
        times = time_interleaved(methods, [0], REPS, 5)
        floor = min(("cublas_seq", "ours_seq"), key=lambda k: statistics.median(times[k]))
        row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}, "floor": floor}
        # what the model of the run (sim.validate_shared) runs: the configurations these lines ran
        chain = pipes["chain"]
        row["configs"] = {
            "ours_seq": dataclasses.asdict(plain_config(M)),
            "chain": dataclasses.asdict(chain.plan_configs(chain.plan(M).M)[-1]),
        }
        for name in ("ours_seq", *pipes):
            row[f"{name}/{floor}"] = ci([p / q for p, q in zip(times[name], times[floor])])
        for num, den in (
            ("chain_wide", "loopback"), ("chain_sm120", "chain_wide"), ("chain", "ours_seq"),
            ("chain_g8", "chain_wide"), ("chain_split", "chain_wide"), ("chain_stage_major", "chain_wide"),
            ("chain", "chain_wide"), ("chain_graphedcall", "chain"), ("default", "chain"), ("default", "ours_seq"),
        ):  # fmt: skip
            row[f"{num}/{den}"] = ci([p / q for p, q in zip(times[num], times[den])])
        for pipe in pipes.values():
            pipe.check_errors()
        report["rows"][M] = row
        print(M, json.dumps({k: v for k, v in row.items()}), flush=True)
    (OUT / "shared_gpu.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
