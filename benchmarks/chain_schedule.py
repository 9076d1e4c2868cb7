"""Experiment: the chain kernel's tile schedule, ticket (every tile claimed from an atomic) against
a static flattened loop (CTA i runs positions i, i + NUM_CTAS, ...), next to the plain GEMM.

usage: python3 benchmarks/chain_schedule.py OUT_DIR [REPS]
"""

import json
import random
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.chain import ChainLaunch, ChainStage
from ctapipelining.gemm import GemmLaunch, grid_size, matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG, PLAIN_CONFIG
from ctapipelining.pipeline import Pipeline, _i64
from ctapipelining.timing import Method, capture, environment, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
K = 8192
DEV = torch.device("cuda:0")


def ci(ratios, n=2000):
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(n))
    return {"median": statistics.median(ratios), "ci95": [meds[int(0.025 * n)], meds[int(0.975 * n)]]}


def schedule(launch: ChainLaunch, value: int) -> ChainLaunch:
    launch._constexprs["SCHEDULE"] = value
    launch._trailing = tuple(launch._constexprs.values())
    return launch


def main():
    torch.manual_seed(0)
    a, b = ((torch.randn(K, K, device=DEV) * K**-0.5).bfloat16() for _ in range(2))
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "single": {}, "chain": {}}
    # one stage: the kernels' per-tile efficiency, no dependencies
    for M in (2048, 16384):
        x, y = torch.randn(M, K, device=DEV).bfloat16(), torch.empty(M, K, dtype=torch.bfloat16, device=DEV)
        ctas = grid_size(M, K, PIPELINE_CONFIG, DEV)
        gemm = GemmLaunch(M, K, K, PIPELINE_CONFIG, ctas, DEV)
        chains = {}
        for name, value in (("chain1_ticket", 0), ("chain1_static", 1), ("chain1_capped", 2)):
            t, e = _i64(2, DEV), _i64(1, DEV)
            chains[name] = (schedule(ChainLaunch(M, [ChainStage(K, K)], PIPELINE_CONFIG, ctas, DEV, ticket=t,
                                                 epoch=e), value), e)  # fmt: skip
        ref = matmul(x, a, config=PIPELINE_CONFIG)
        methods = [
            Method("gemm_pipeline_cfg", capture(lambda: gemm(x, a, y), [0]).replay),
            Method("gemm_plain_cfg", capture(lambda: matmul(x, a, out=y), [0]).replay),
        ]
        for name, (cl, e) in chains.items():
            e.add_(1)
            cl([(x, a, y)])
            torch.cuda.synchronize()
            assert torch.equal(y, ref), name
            methods.append(Method(name, capture(lambda cl=cl, e=e: (e.add_(1), cl([(x, a, y)])), [0]).replay))
        times = time_interleaved(methods, [0], REPS, 5)
        row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}}
        for num in ("chain1_ticket", "chain1_static", "chain1_capped", "gemm_plain_cfg"):
            row[f"{num}/gemm_pipeline_cfg"] = ci([p / q for p, q in zip(times[num], times["gemm_pipeline_cfg"])])
        row["chain1_static/chain1_ticket"] = ci([p / q for p, q in zip(times["chain1_static"], times["chain1_ticket"])])
        report["single"][M] = row
        print("single", M, json.dumps(row), flush=True)
    # two stages on the GPU
    for M in (640, 2048, 16384):
        x = torch.randn(M, K, device=DEV).bfloat16()
        h, y = torch.empty(M, K, dtype=torch.bfloat16, device=DEV), torch.empty(M, K, dtype=torch.bfloat16, device=DEV)
        pipes = {"ticket": Pipeline([a, b]), "static": Pipeline([a, b]), "capped": Pipeline([a, b])}
        for name, pipe in pipes.items():
            schedule(pipe.plan(M).launches[0].gemm, {"ticket": 0, "static": 1, "capped": 2}[name])
            assert torch.equal(pipe(x, check=True), pipe.sequential(x)), name
        graphs = {name: pipe.capture(M) for name, pipe in pipes.items()}
        methods = [Method("ours_seq", capture(lambda: (matmul(x, a, out=h), matmul(h, b, out=y)), [0]).replay)]
        methods += [Method(name, g.replay) for name, g in graphs.items()]
        times = time_interleaved(methods, [0], REPS, 5)
        row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}}
        for num, den in (
            ("ticket", "ours_seq"),
            ("static", "ours_seq"),
            ("capped", "ours_seq"),
            ("static", "ticket"),
            ("capped", "ticket"),
        ):
            row[f"{num}/{den}"] = ci([p / q for p, q in zip(times[num], times[den])])
        for g in graphs.values():
            g.check_errors()
        report["chain"][M] = row
        print("chain", M, json.dumps(row), flush=True)
    (OUT / "chain_schedule.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
