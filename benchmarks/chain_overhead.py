"""Where a chain kernel's time goes, this tree's kernel against an old tree's, paired (diagnostic).

usage: python3 benchmarks/chain_overhead.py OUT_DIR [REPS] [OLD_PARENT]

``X[M, 8192] @ A[8192, 8192] @ B[8192, 8192]`` on cuda:0, bf16, every line graph-replayed in
one interleaved run (:func:`ctapipelining.timing.time_interleaved`), at M = 640, 1024, 2048 and
16384, all on ``PIPELINE_CONFIG``'s 128 x 256 tiles:

* ``cublas_seq``, ``ours_seq``: the two GEMMs one after another (cuBLAS; our GEMM in that config);
* ``claims``: each GEMM as a one-stage chain kernel (tiles claimed from the ticket, no signal, no
  wait), its epoch bumped before it; ``ours_seq_bumps``: ``ours_seq`` with the same two bumps;
* ``chain``: the two stages in one chain kernel (``Pipeline``), waiting in 8 parts; ``chain_wp1``:
  waiting for whole rows; ``major``: stage after stage in the combined order (8 parts);
* each of ``claims``, ``chain``, ``chain_wp1``, ``major`` also from ``OLD_PARENT``'s
  ``ctapipelining_old`` (suffix ``_old``), if given.

Writes OUT_DIR/chain_overhead.json: medians (ms) and per M each line over ``ours_seq`` and each
new line over its old one (median, 95% CI).
"""

import dataclasses
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.timing import Method, environment, median_ci, time_interleaved
from ctapipelining.timing import capture as capture_graph

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
OLD = sys.argv[3] if len(sys.argv) > 3 else None
K = 8192
ROWS = (640, 1024, 2048, 16384)


def ci(ratios):
    med, lo, hi = median_ci(ratios)
    return {"median": med, "ci95": [lo, hi]}


def packages():
    """``{suffix: (pipeline module, chain module)}`` for this tree and the old one."""
    import ctapipelining.chain as nc
    import ctapipelining.pipeline as np_

    out = {"": (np_, nc)}
    if OLD:
        sys.path.insert(0, OLD)
        import ctapipelining_old.chain as oc
        import ctapipelining_old.pipeline as op

        out["_old"] = (op, oc)
    return out


def capture(fn, devices):
    """``fn`` captured in a CUDA graph: its replay."""
    return capture_graph(fn, devices).replay


def one_stage(chain_mod, M, w, sms):
    """A one-stage chain kernel over ``w`` on M rows (no hooks) and its epoch: ``(launch, epoch)``."""
    dev = w.device
    err = torch.zeros(8, dtype=torch.int64, device=dev)
    stage = chain_mod.ChainStage(w.shape[1], w.shape[0], err=err, stage=0)
    ticket, epoch = (torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(2))
    launch = chain_mod.ChainLaunch(M, [stage], PIPELINE_CONFIG_OF[chain_mod], sms, dev, ticket=ticket, epoch=epoch)
    return launch, epoch, err


PIPELINE_CONFIG_OF = {}


def main():
    torch.manual_seed(0)
    a, b = ((torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pkgs = packages()
    pipes = {}
    for sfx, (pm, cm) in pkgs.items():
        cfg = importlib.import_module(cm.__name__.rsplit(".", 1)[0] + ".kernels.gemm").PIPELINE_CONFIG
        PIPELINE_CONFIG_OF[cm] = cfg
        pipes["chain" + sfx] = pm.Pipeline([a, b], config=cfg)
        pipes["chain_wp1" + sfx] = pm.Pipeline([a, b], config=dataclasses.replace(cfg, wait_parts=1))
        pipes["major" + sfx] = pm.Pipeline([a, b], config=cfg)
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "rows": {}}
    for M in ROWS:
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        h, y = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0"), torch.empty_like(x)
        want = pipes["chain"].sequential(x)
        for sfx in pkgs:
            for launch in pipes["major" + sfx].plan(M).launches:
                launch.gemm.set_order(None)
        for name, pipe in pipes.items():
            assert torch.equal(pipe(x, check=True), want), (name, M)
        bump = torch.zeros(2, dtype=torch.int64, device="cuda:0")

        def ours(bumps=False, x=x, h=h, y=y, bump=bump):
            if bumps:
                bump[0:1].add_(1)
            matmul(x, a, out=h, config=PIPELINE_CONFIG)
            if bumps:
                bump[1:2].add_(1)
            matmul(h, b, out=y, config=PIPELINE_CONFIG)

        methods = [
            Method("cublas_seq", capture(lambda x=x, h=h, y=y: (torch.mm(x, a, out=h), torch.mm(h, b, out=y)), [0])),
            Method("ours_seq", capture(ours, [0])),
            Method("ours_seq_bumps", capture(lambda ours=ours: ours(True), [0])),
        ]
        errs = []
        for sfx, (_, cm) in pkgs.items():
            (la, ea, erra), (lb, eb, errb) = one_stage(cm, M, a, sms), one_stage(cm, M, b, sms)
            errs += [erra, errb]

            def claims(x=x, h=h, y=y, la=la, lb=lb, ea=ea, eb=eb):
                ea.add_(1)
                la([(x, a, h)])
                eb.add_(1)
                lb([(h, b, y)])

            for _ in range(3):
                claims()
            torch.cuda.synchronize()
            print(M, "claims" + sfx, "equal to the chain:", torch.equal(y, want), "tickets", la.ticket.item(),
                  lb.ticket.item(), "per run", la.claims_per_run, lb.claims_per_run, "errors", erra.tolist(),
                  errb.tolist(), flush=True)  # fmt: skip
            methods.append(Method("claims" + sfx, capture(claims, [0])))
        methods += [Method(name, capture(lambda p=pipe, x=x, y=y: p(x, out=y), [0])) for name, pipe in pipes.items()]
        times = time_interleaved(methods, [0], REPS, 3)
        row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}}
        for name in times:
            row[f"{name}/ours_seq"] = ci([p / q for p, q in zip(times[name], times["ours_seq"])])
        for name in ("claims", "chain", "chain_wp1", "major"):
            if name + "_old" in times:
                row[f"{name}/{name}_old"] = ci([p / q for p, q in zip(times[name], times[name + "_old"])])
        row["claims/ours_seq_bumps"] = ci([p / q for p, q in zip(times["claims"], times["ours_seq_bumps"])])
        for pipe in pipes.values():
            pipe.check_errors()
        row["claims_errors"] = [e.tolist() for e in errs]  # [new a, new b, old a, old b]: flag first
        report["rows"][M] = row
        print(M, json.dumps(row), flush=True)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / "chain_overhead.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
