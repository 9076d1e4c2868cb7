"""Tune the GEMM and the pipeline at one shape on two GPUs, all in one interleaved run.

usage: python3 benchmarks/tune.py OUT_DIR [M] [K] [REPS]

``X[M, K] @ A[K, K]`` (cuda:0) ``@ B[K, K]`` (cuda:1), bf16. Every line is replayed from a CUDA
graph and timed by the bench's harness (:func:`ctapipelining.timing.time_interleaved`: the lines
take turns in a fresh order each repetition, on rotating inputs), so only ratios inside one run
count:

* cuBLAS one layer, and our plain GEMM under each configuration of ``PLAIN``;
* the two-stage pipeline under each policy and configuration of ``CHAIN``, and with
  ``ends="balanced"`` under each configuration of ``ENDS``; each pipeline is checked bitwise
  against the same GEMMs run one after another before it is timed.

Only :class:`~ctapipelining.kernels.gemm.GemmConfig`'s user knobs are varied (tile shape,
``group_m``, ``num_stages``, ``split_tail``, ``wait_parts``). Writes OUT_DIR/tune.json (every
repetition; :meth:`ctapipelining.sim.Calibration.from_results` reads the 128x128 tile's cost
from it) and prints medians over the fastest plain GEMM.
"""

import json
import statistics
import sys
import traceback
from pathlib import Path

import torch

from ctapipelining.bench import Row
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, capture, environment, time_interleaved

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
K = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
REPS = int(sys.argv[4]) if len(sys.argv) > 4 else 20
WARMUP, SETS, DEVS = 5, 3, [0, 1]


def config(block=(128, 256, 64), group_m=8, num_stages=3, split_tail=False, wait_parts=1) -> GemmConfig:
    bm, bn, bk = block
    return GemmConfig(
        block_m=bm,
        block_n=bn,
        block_k=bk,
        group_m=group_m,
        num_stages=num_stages,
        num_warps=8,
        split_tail=split_tail,
        wait_parts=wait_parts,
    )


def name(cfg: GemmConfig) -> str:
    tail = " split" if cfg.split_tail else ""
    parts = f" parts{cfg.wait_parts}" if cfg.wait_parts > 1 else ""
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} st{cfg.num_stages}{tail}{parts}"


PLAIN = [
    config(),
    config(group_m=4),
    config(split_tail=True),
    config(block=(128, 128, 64), num_stages=4),
]
CHAIN = [config(group_m=g, split_tail=t, wait_parts=p) for g in (4, 8) for t in (False, True) for p in (1, 8)]
ENDS = [config(group_m=4, split_tail=True, wait_parts=8), config(group_m=8, split_tail=True, wait_parts=8)]

out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
xs = [torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(SETS)]
x_plain = torch.empty_like(xs[0])
c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
methods: list[Method] = []
notes: dict[str, str] = {}


def add(label: str, build) -> None:
    """``build()`` returns ``(replay, input tensor the replay reads, note)``; a failure is reported, not fatal."""
    try:
        replay, x_in, note = build()
    except Exception as e:
        print(f"{label:48s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        traceback.print_exc(limit=1)
        return
    methods.append(Method(label, replay, lambda i, x_in=x_in: x_in.copy_(xs[i % SETS])))
    notes[label] = note


def plain(fn):
    return lambda: (capture(fn, DEVS).replay, x_plain, "")


def pipeline(**kw):
    def build():
        pipe = Pipeline([A, B], always_pipelined=True, **kw)
        ok = all(torch.equal(pipe(x, check=True), pipe.sequential(x)) for x in xs)
        graphed = pipe.capture(M)
        return graphed.replay, graphed.x, "bitwise OK" if ok else "WRONG"

    return build


add("cublas", plain(lambda: torch.matmul(x_plain, A, out=c0)))
for cfg in PLAIN:
    add(f"plain {name(cfg)}", plain(lambda cfg=cfg: matmul(x_plain, A, out=c0, config=cfg)))
for policy in ("static", "workqueue"):
    for cfg in CHAIN:
        if policy == "workqueue" and (cfg.wait_parts > 1 or cfg.split_tail):
            continue  # a work-queue consumer takes whole ready tiles in a dynamic order
        add(f"pipeline {policy} {name(cfg)}", pipeline(policy=policy, config=cfg))
for cfg in ENDS:
    add(f"pipeline ends {name(cfg)}", pipeline(config=cfg, ends="balanced"))

times = time_interleaved(methods, DEVS, REPS, WARMUP)
floor = min(statistics.median(times[m.name]) for m in methods if m.name.startswith("plain "))
rows = []
for m in methods:
    r = Row(m.name, M, times[m.name], note=notes[m.name])
    rows.append(r.summary() | {"ms": times[m.name]})
    print(f"{m.name:48s} {r.median:8.4f} ms  {r.median / floor:6.3f}x  {notes[m.name]}", flush=True)
report = dict(environment=environment(), M=M, K=K, reps=REPS, floor_ms=floor, rows=rows)
(out_dir / "tune.json").write_text(json.dumps(report, indent=1))
print("wrote", out_dir / "tune.json")
