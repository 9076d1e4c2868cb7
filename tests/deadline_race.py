"""A consumer whose counters (or ring slots) are released at about its deadline, many times:
each trial must end with a right result or a clean PipelineTimeout, and the process must
neither hang nor die. Run in a subprocess with a watchdog (tests/test_gpu_core.py):

    python tests/deadline_race.py TRIALS_PER_POLICY [OUT.json] [cross]

One GPU: both stages on cuda:0 (loopback); ``cross``: stage 1 on cuda:1, released from cuda:0
(peer writes into its counters, the cross-GPU link's path). Stage 1's input is written once by the plain GEMM;
per trial the consumer is launched alone and a side stream sleeps, then releases what it waits
on: everything (both policies), or only the last part of each row-block's input, the others
being there from the start (``static_late_part``: the race is then on a wait inside the K
loop). The sleeps sweep a window centred on the deadline, found first by bisection (on the
majority of three trials per step), so a share of the trials release within a few microseconds
of it either way; the centre follows the outcomes on the wrong side of it (the edge drifts with
the clocks, and one bisection step misled by a late launch misplaces it).
Prints one JSON line."""

import contextlib
import json
import random
import sys

import torch

from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline, PipelineTimeout

TIMEOUT_S = 300e-6
EDGE_STEP_US = 0.5  # how far the window's centre moves for each outcome on the wrong side of it


def run_policy(policy, ws, x, side, cycles_per_us, trials, late_part=False) -> dict:
    """Bisect for the deadline, then ``trials`` releases around it; the outcome counts.
    ``late_part`` (static): every part of the consumer's input but the last is there before it
    starts, so the wait that races its deadline is the one inside the K loop."""
    dev, M, K = x.device, x.shape[0], x.shape[1]  # the releases are made on x's GPU (the producer's)
    pipe = Pipeline(ws, loopback=True, policy=policy, timeout_s=TIMEOUT_S)
    plan = pipe.plan(M)
    link = plan.links[0]
    idle = torch.cuda.Stream(ws[1].device) if ws[1].device != dev else None
    plan.inputs[1].copy_(matmul(x, ws[0], config=pipe.stage_config(0, plan.configs)))
    ref = matmul(plan.inputs[1], ws[1], config=pipe.stage_config(1, plan.configs))
    need = torch.as_tensor(link.dep.need, dtype=torch.int64, device=dev)
    T = link.dep.consumer.num_tiles
    tiles = torch.arange(T, dtype=torch.int64, device=dev)
    out = torch.empty(M, K, dtype=torch.bfloat16, device=ws[1].device)
    parts = link.dep.parts
    early = torch.arange(len(need), device=dev) % parts != parts - 1  # counter r * parts + q: part q
    if late_part:
        assert policy == "static" and parts > 1, (policy, parts)

    def trial(delay_us: float) -> str:
        e = plan.epoch + 1
        out.fill_(float("nan"))
        if late_part:
            link.counters.copy_(torch.where(early, e, e - 1) * need)
        sync()
        pipe._launch(plan, x, out, only=[1])
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(delay_us * cycles_per_us))
            # a copy into another GPU also waits for that GPU's current stream: one there that
            # waits only for this sleep (its default stream would wait for the consumer, which
            # waits for this copy)
            if idle is not None:
                idle.wait_stream(side)
            with torch.cuda.stream(idle) if idle is not None else contextlib.nullcontext():
                link.counters.copy_(e * need)
                link.slots.copy_(e * T + tiles)
                link.tail.fill_(e * T)
        sync()
        try:
            pipe.check_errors(plan)
        except PipelineTimeout:
            pipe.reset(plan)  # the side stream is done: nothing lands after the reset
            return "timeout"
        return "right" if torch.equal(out, ref) else "WRONG"

    lo, hi = 0.0, 3 * TIMEOUT_S * 1e6  # bisect: release late enough to time out, early enough not to
    for _ in range(14):
        mid = (lo + hi) / 2
        # the majority of three trials: one trial launched late can misplace the edge by more than
        # the window's half-width, and the window then misses it
        if [trial(mid) for _ in range(3)].count("timeout") >= 2:
            hi = mid
        else:
            lo = mid
    edge = (lo + hi) / 2
    rng = random.Random(1)
    counts = {"right": 0, "timeout": 0, "WRONG": 0}
    near = {"right": 0, "timeout": 0}
    for _ in range(trials):
        d = edge + rng.uniform(-15, 15)
        r = trial(d)
        counts[r] += 1
        if abs(d - edge) <= 5 and r in near:
            near[r] += 1
        # the edge drifts with the clocks, and the bisection may misplace it: a release after the
        # centre that ran right says the deadline is later, one before it that timed out that it is
        # earlier; the centre follows those (balanced where both sides are equally likely)
        if r == "right" and d > edge or r == "timeout" and d < edge:
            edge += EDGE_STEP_US if r == "right" else -EDGE_STEP_US
    return {"edge_delay_us": edge, "counts": counts, "within_5us_of_edge": near}


def sync():
    for d in range(torch.cuda.device_count()):
        torch.cuda.synchronize(d)


def main(trials: int, out_path: str | None, cross: bool = False) -> dict:
    torch.manual_seed(0)
    dev = "cuda:0"
    M, K = 1024, 1024
    ws = [(torch.randn(K, K, device=d) / K**0.5).bfloat16() for d in (dev, "cuda:1" if cross else dev)]
    x = torch.randn(M, K, device=dev).bfloat16()
    side = torch.cuda.Stream(dev)
    # clock64 cycles per microsecond, for torch.cuda._sleep
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    torch.cuda.synchronize()
    cycles_per_us = 20_000_000 / (a.elapsed_time(b) * 1e3)
    report = {"trials_per_policy": trials, "timeout_us": TIMEOUT_S * 1e6, "cycles_per_us": cycles_per_us}
    report["devices"] = [str(w.device) for w in ws]
    for policy in ("static", "workqueue"):
        report[policy] = run_policy(policy, ws, x, side, cycles_per_us, trials)
    report["static_late_part"] = run_policy("static", ws, x, side, cycles_per_us, trials, late_part=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None, sys.argv[3:] == ["cross"])))
