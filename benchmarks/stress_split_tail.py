"""Stress the split tail: many back-to-back calls, every result checked bitwise.

usage: python3 benchmarks/stress_split_tail.py OUT_DIR [CALLS]

One GPU: the plain GEMM with a split tail (TMA and ordinary stores), ``CALLS`` calls over 3
rotating inputs, each result compared with that input's first result (the partials are
summed in a fixed order, so every call must give the same bits). Two GPUs (when present):
the same for pipelines with split-tail producers in each signal mode, inputs poisoned (NaN)
before every call, results compared with the sequential GEMMs. For each variant: calls,
mismatches, NaN results, and the rows of the first mismatch. Writes OUT_DIR/stress.json.
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG, PLAIN_CONFIG
from ctapipelining.pipeline import Pipeline

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
M, K = 16384, 8192
out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
xs = [torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(3)]
report = {}


class Tally:
    """Counts of one variant, each result compared as soon as it exists."""

    def __init__(self, name):
        self.name, self.row = name, dict(calls=0, mismatches=0, nan_results=0)

    def check(self, y, ref):
        self.row["calls"] += 1
        self.row["nan_results"] += bool(y.isnan().any())
        if not torch.equal(y, ref):
            self.row["mismatches"] += 1
            if "first_mismatch_rows" not in self.row:
                rows = (y != ref).any(dim=1).nonzero()[:, 0]
                self.row["first_mismatch_rows"] = [int(rows.min()), int(rows.max()), int(rows.numel())]
                self.row["first_mismatch_call"] = self.row["calls"] - 1

    def done(self):
        report[self.name] = self.row
        print(self.name, self.row, flush=True)


for name, cfg in {
    "plain_tma_split": dataclasses.replace(PLAIN_CONFIG, split_tail=True),
    "plain_stores_split": dataclasses.replace(PIPELINE_CONFIG, split_tail=True),
}.items():
    firsts = [matmul(x, A, config=cfg) for x in xs]
    t = Tally(name)
    for i in range(CALLS):
        t.check(matmul(xs[i % 3], A, config=cfg), firsts[i % 3])
    t.done()

if torch.cuda.device_count() >= 2:
    B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
    TMA = dataclasses.replace(PIPELINE_CONFIG, tma_store=True)
    variants = {
        "static_stores_in_loop_split": dataclasses.replace(PIPELINE_CONFIG, split_tail=True),
        "static_tma_in_loop_split": dataclasses.replace(TMA, split_tail=True),
        "static_tma_next_tile": dataclasses.replace(TMA, signal="next_tile", flatten=False),
        "static_tma_now_split": dataclasses.replace(TMA, signal="now", split_tail=True),
    }
    for name, cfg in variants.items():
        pipe = Pipeline([A, B], policy="static", config=cfg)
        refs = [pipe.sequential(x) for x in xs]
        t = Tally(name)
        for i in range(CALLS // 2):
            pipe.plan(M).inputs[1].fill_(float("nan"))
            t.check(pipe(xs[i % 3]), refs[i % 3])
        t.done()
(out_dir / "stress.json").write_text(json.dumps(report, indent=1))
