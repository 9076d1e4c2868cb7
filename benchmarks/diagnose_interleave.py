"""Does any neighbour break a replayed work-queue pipeline? Replays one pipeline's CUDA graph
interleaved (synchronised in between) with one other kind of work, and after every replay
checks that both stages' epochs agree and that the ring's head moved by T + P.

usage: python3 benchmarks/diagnose_interleave.py [M] [REPLAYS]
"""

import sys

import torch

from ctapipelining.baselines import MicroBatch, TensorParallel
from ctapipelining.bench import _capture
from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline

M = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
REPLAYS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
K = 8192
torch.manual_seed(0)
ws = [(torch.randn(K, K, device=f"cuda:{d}") / K**0.5).bfloat16() for d in (0, 1)]
x = torch.randn(M, K, device="cuda:0").bfloat16()
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")


def sync():
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)


KEEP = []  # every pipeline a graph captured: the graph keeps its addresses, not its buffers


def neighbours():
    tp = TensorParallel(ws[0], ws[1].to("cuda:0"), [0, 1], M)
    for xg in tp.x:
        xg.copy_(x)
    mb = MicroBatch(ws, M, 1024)
    other = Pipeline(ws, policy="workqueue")
    other_plan = other.plan(M)
    g_other = _capture(lambda: other._launch(other_plan, x, out, only=[0]), [0, 1])
    g_plain = _capture(lambda: matmul(x, ws[0], out=c0), [0, 1])
    static = Pipeline(ws)
    KEEP.extend([other, static])
    g_static = _capture(lambda: static(x, out=out, check=False), [0, 1])
    return {
        "nothing": lambda: None,
        "tp (eager, NCCL)": tp,
        "microbatch graph": mb,
        "other pipeline's producer-alone graph": g_other.replay,
        "plain GEMM graph": g_plain.replay,
        "static pipeline graph": g_static.replay,
        "cuBLAS eager": lambda: torch.matmul(x, ws[0], out=c0),
    }


for name, work in neighbours().items():
    pipe = Pipeline(ws, policy="workqueue")
    KEEP.append(pipe)
    pipe(x)
    g = _capture(lambda pipe=pipe: pipe(x, out=out, check=False), [0, 1])
    plan, link = pipe.plan(M), pipe.plan(M).links[0]
    T, P = link.dep.consumer.num_tiles, plan.num_ctas[1]
    bad = None
    for i in range(REPLAYS):
        work()
        sync()
        g.replay()
        sync()
        e0, e1, head, tail = int(plan.epochs[0]), int(plan.epochs[1]), int(link.head), int(link.tail)
        if e0 != e1 or head != e1 * (T + P) or tail != e0 * T:
            bad = dict(replay=i, epoch0=e0, epoch1=e1, head=head, head_expected=e1 * (T + P), tail=tail)
            break
    err = ""
    try:
        pipe.check_errors()
    except Exception as ex:  # noqa: BLE001
        err = str(ex)[:160]
    print(f"{name:40s} first bad replay: {bad}  {err}", flush=True)
