"""The work-queue ring under many calls: does its head and tail stay in step with the epoch
(head == e * (T + P), tail == e * T)?

usage: python3 benchmarks/diagnose_workqueue.py accounting [M] [CALLS]
       python3 benchmarks/diagnose_workqueue.py neighbours [M] [REPLAYS]

``accounting``: every work-queue variant (signal timing, TMA store), eager and replayed from a
CUDA graph, ``CALLS`` calls each, checked every 20. ``neighbours``: one replayed work-queue
pipeline interleaved (synchronised in between) with one other kind of work at a time (TP,
micro-batching, another pipeline's graphs, cuBLAS), checked after every replay.
"""

import dataclasses
import sys

import torch

from ctapipelining.baselines import MicroBatch, TensorParallel
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout
from ctapipelining.timing import capture

MODE = sys.argv[1] if len(sys.argv) > 1 else "accounting"
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
CALLS = REPLAYS = int(sys.argv[3]) if len(sys.argv) > 3 else 200
K = 8192
torch.manual_seed(0)
ws = [(torch.randn(K, K, device=f"cuda:{d}") / K**0.5).bfloat16() for d in (0, 1)]
x = torch.randn(M, K, device="cuda:0").bfloat16()
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
VARIANTS = {
    "workqueue now": dict(policy="workqueue", config=dataclasses.replace(PIPELINE_CONFIG, signal="now")),
    "workqueue in_loop": dict(policy="workqueue"),
    "workqueue tma now": dict(
        policy="workqueue", config=dataclasses.replace(PIPELINE_CONFIG, tma_store=True, signal="now")
    ),
}


def state(pipe):
    plan = pipe.plan(M)
    link = plan.links[0]
    return int(plan.epochs[1]), int(link.head), int(link.tail), plan.num_ctas[1], link.dep.consumer.num_tiles


def accounting():
    for name, kw in VARIANTS.items():
        for mode in ("eager", "graph"):
            pipe = Pipeline(ws, timeout_s=0.5, **kw)
            ref = pipe(x)
            torch.cuda.synchronize(1)
            call = lambda pipe=pipe: pipe(x, out=out, check=False)  # noqa: E731
            run = call if mode == "eager" else capture(call, [0, 1]).replay
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
    g_other = capture(lambda: other._launch(other_plan, x, out, only=[0]), [0, 1])
    g_plain = capture(lambda: matmul(x, ws[0], out=c0), [0, 1])
    static = Pipeline(ws)
    KEEP.extend([other, static])
    g_static = capture(lambda: static(x, out=out, check=False), [0, 1])
    return {
        "nothing": lambda: None,
        "tp (eager, NCCL)": tp,
        "microbatch graph": mb,
        "other pipeline's producer-alone graph": g_other.replay,
        "plain GEMM graph": g_plain.replay,
        "static pipeline graph": g_static.replay,
        "cuBLAS eager": lambda: torch.matmul(x, ws[0], out=c0),
    }


def neighbours_check():
    for name, work in neighbours().items():
        pipe = Pipeline(ws, policy="workqueue")
        KEEP.append(pipe)
        pipe(x)
        g = capture(lambda pipe=pipe: pipe(x, out=out, check=False), [0, 1])
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


if __name__ == "__main__":
    {"accounting": accounting, "neighbours": neighbours_check}[MODE]()
