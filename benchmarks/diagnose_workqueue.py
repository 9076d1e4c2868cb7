"""Work-queue accounting under many calls: which configuration, eager or replayed, keeps the
ring's head and tail in step with the epoch (head == e * (T + P), tail == e * T).

usage: python3 benchmarks/diagnose_workqueue.py [M] [CALLS]
"""

import dataclasses
import sys

import torch

from ctapipelining.bench import _capture
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 200
K = 8192
torch.manual_seed(0)
ws = [(torch.randn(K, K, device=f"cuda:{d}") / K**0.5).bfloat16() for d in (0, 1)]
x = torch.randn(M, K, device="cuda:0").bfloat16()
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
VARIANTS = {
    "workqueue now": dict(policy="workqueue", config=dataclasses.replace(PIPELINE_CONFIG, signal="now")),
    "workqueue in_loop": dict(policy="workqueue"),
    "workqueue tma now": dict(
        policy="workqueue", config=dataclasses.replace(PIPELINE_CONFIG, tma_store=True, signal="now")
    ),
    "static in_loop": dict(policy="static"),
}


def state(pipe):
    plan = pipe.plan(M)
    link = plan.links[0]
    return int(plan.epochs[1]), int(link.head), int(link.tail), plan.num_ctas[1], link.dep.consumer.num_tiles


for name, kw in VARIANTS.items():
    for mode in ("eager", "graph"):
        pipe = Pipeline(ws, timeout_s=0.5, **kw)
        ref = pipe(x)
        torch.cuda.synchronize(1)
        call = lambda pipe=pipe: pipe(x, out=out, check=False)  # noqa: E731
        run = call if mode == "eager" else _capture(call, [0, 1]).replay
        first_bad, wrong = None, 0
        for i in range(CALLS):
            run()
            if i % 20 == 19 or i == CALLS - 1:
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                e, head, tail, P, T = state(pipe)
                ok_acct = head == e * (T + P) and tail == e * T
                same = torch.equal(out, ref)
                wrong += not same
                try:
                    pipe.check_errors()
                    err = ""
                except PipelineTimeout as ex:
                    err = str(ex)[:200]
                if (not ok_acct or err or not same) and first_bad is None:
                    first_bad = (i, e, head, e * (T + P), tail, e * T, same, err)
                    break
        print(f"{name:20s} {mode:6s} calls={i + 1} first_bad={first_bad} wrong_batches={wrong}", flush=True)
