"""Experiment (not committed): the chain kernel with gpu-scope signals and waits (this tree)
against sys scope (.old/ctapipelining_old), two 8192-wide stages on cuda:0, graph-replayed, paired."""
import json, statistics, sys
from pathlib import Path
import torch
sys.path.insert(0, ".old")
import ctapipelining_old.pipeline as op
from ctapipelining.pipeline import Pipeline
from ctapipelining.gemm import matmul
from ctapipelining.timing import Method, capture, median_ci, time_interleaved, environment

OUT = Path(sys.argv[1])
K = 8192
torch.manual_seed(0)
a, b = ((torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
new, old = Pipeline([a, b]), op.Pipeline([a, b])
report = {"environment": environment(), "rows": {}}
for M in (640, 2048, 16384):
    x = torch.randn(M, K, device="cuda:0").bfloat16()
    y1, y2, h = (torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0") for _ in range(3))
    assert torch.equal(new(x, check=True), old(x, check=True))
    assert torch.equal(new(x, check=True), new.sequential(x))
    ms = [Method("gpu_scope", capture(lambda: new(x, out=y1), [0]).replay),
          Method("sys_scope", capture(lambda: old(x, out=y2), [0]).replay),
          Method("ours_seq", capture(lambda: (matmul(x, a, out=h), matmul(h, b, out=y2)), [0]).replay)]
    t = time_interleaved(ms, [0], 30, 5)
    row = {k: statistics.median(v) for k, v in t.items()}
    for n, d in (("gpu_scope", "sys_scope"), ("gpu_scope", "ours_seq"), ("sys_scope", "ours_seq")):
        row[f"{n}/{d}"] = median_ci([p / q for p, q in zip(t[n], t[d])])
    new.check_errors(); old.check_errors()
    report["rows"][M] = row
    print(M, json.dumps(row), flush=True)
(OUT / "scope_exp.json").write_text(json.dumps(report, indent=1))
