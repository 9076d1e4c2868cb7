"""Why ``signal="next_tile"`` gives NaN results from a pipeline's second call on (two GPUs).

usage: python3 benchmarks/diagnose_next_tile.py OUT_DIR [CALLS]

``stress_split_tail.py`` found 49 of 60 calls of a static TMA-store ``next_tile`` pipeline at
X[16384, 8192] wrong, NaN in the rows of the last group, from the second call on. For
``next_tile`` with and without the flattened loop, and ``in_loop`` as the control: ``CALLS``
calls with the consumer's input poisoned, each result checked against the sequential GEMMs,
then every scoreboard counter compared with epoch x need: a signal sent twice or never shows
up there. Writes OUT_DIR/next_tile.json. (Result at 2122288: flattened, every CTA's last tile
was signalled twice; ``GemmConfig`` has refused that combination since, and this script
reports it as refused.)
"""

import dataclasses
import json
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
M, K = 16384, 8192
out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
x = torch.randn(M, K, device="cuda:0").bfloat16()
TMA = dataclasses.replace(PIPELINE_CONFIG, tma_store=True, split_tail=False)
report = {}
VARIANTS = {  # name: config changes
    "next_tile_flatten": dict(signal="next_tile", flatten=True),
    "next_tile_no_flatten": dict(signal="next_tile", flatten=False),
    "in_loop_flatten": dict(signal="in_loop", flatten=True),
}
for name, changes in VARIANTS.items():
    try:
        cfg = dataclasses.replace(TMA, **changes)
    except ValueError as e:  # GemmConfig refuses next_tile + flatten since this diagnosis (a53fee8)
        report[name] = dict(refused=str(e))
        print(name, report[name], flush=True)
        continue
    pipe = Pipeline([A, B], policy="static", config=cfg)
    ref = matmul(matmul(x, A, config=cfg).to("cuda:1"), B, config=cfg)
    plan = pipe.plan(M)
    row = dict(calls=CALLS, wrong=[], nan=[], timeouts=0)
    for i in range(CALLS):
        plan.inputs[1].fill_(float("nan"))
        try:
            y = pipe(x)
        except PipelineTimeout as e:
            row["timeouts"] += 1
            row["timeout_message"] = str(e)[:300]
            continue
        if not torch.equal(y, ref):
            row["wrong"].append(i)
        if y.isnan().any():
            row["nan"].append(i)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    link = plan.links[0]
    excess = (link.counters.cpu() - plan.epoch * torch.as_tensor(link.dep.need)).tolist()
    row["epoch"] = plan.epoch
    row["counters_off_target"] = {c: e for c, e in enumerate(excess) if e}
    report[name] = row
    print(name, json.dumps(row)[:600], flush=True)
(out_dir / "next_tile.json").write_text(json.dumps(report, indent=1))
