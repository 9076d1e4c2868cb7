"""Tune the GEMM and the pipeline at one shape, all in one run (same harness as `bench`).

usage: python3 benchmarks/tune.py OUT_DIR [M] [K]
Times cuBLAS, the plain Triton GEMM under each option, the producer alone, and the whole
pipeline for each policy x tile order x warp specialisation; checks each pipeline bitwise
against the sequential Triton GEMMs. Writes OUT_DIR/tune.json and prints a table.
"""

import dataclasses
import json
import sys
import traceback
from pathlib import Path

import torch

from ctapipelining.bench import Row
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Rotation, environment, time_method

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
K = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
REPS, WARM, DEVS = 20, 5, [0, 1]
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
rot = Rotation([torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(3)])
c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
rows = []


def add(name, run, cfg=None, note=""):
    try:
        ms = time_method(run, rot.select, DEVS, REPS, WARM)
        r = Row(name, M, ms, note=note)
        rows.append(r.summary() | {"config": dataclasses.asdict(cfg) if cfg else None})
        print(f"{name:60s} {r.median:8.4f} ms  [{min(ms):.4f}, {max(ms):.4f}] {note}", flush=True)
    except Exception as e:
        print(f"{name:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        traceback.print_exc(limit=1)


add("cublas", lambda: torch.matmul(rot.x, A, out=c0))
PLAIN = [dict(group_m=8, flatten=True, tma_store=True), dict(group_m=8, tma_store=True), dict(group_m=8)]
for opts in PLAIN:
    cfg = GemmConfig(**opts)
    add(f"plain {opts}", lambda cfg=cfg: matmul(rot.x, A, out=c0, config=cfg), cfg)
for tma in (False, True):
    cfg = GemmConfig(group_m=8, tma_store=tma)
    add(f"plain remote write tma_store={tma}", lambda cfg=cfg: matmul(rot.x, A, out=out, config=cfg), cfg)
refs = [matmul(matmul(x, A).to("cuda:1"), B) for x in rot.xs]
VARIANTS = [
    dict(group_m=g, tma_store=t, warp_specialize=w) for t in (True, False) for g in (4, 8) for w in (False, True)
]
for policy in ("workqueue", "static"):
    for opts in VARIANTS:
        cfg = GemmConfig(**opts)
        name = f"pipeline {policy} {opts}"
        try:
            pipe = Pipeline([A, B], policy=policy, config=cfg)
            ok = all(torch.equal(pipe(x), r) for x, r in zip(rot.xs, refs))
        except Exception as e:
            print(f"{name:60s} FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        add(name, lambda pipe=pipe: pipe(rot.x, out=out, check=False), cfg, note="bitwise OK" if ok else "WRONG")
        pipe.check_errors()
        if not opts["warp_specialize"] and opts["group_m"] == 8:
            plan = pipe.plan(M)
            add(
                f"producer alone {policy} {opts}",
                lambda pipe=pipe, plan=plan: pipe._launch(plan, rot.x, out, only=[0]),
                cfg,
            )
            pipe.reset()
(out_dir / "tune.json").write_text(json.dumps(dict(environment=environment(), M=M, K=K, rows=rows), indent=1))
