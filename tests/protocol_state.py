"""Test helpers: put a plan in the state that ``e`` clean calls leave, to test what happens
past a counter's or ring position's wrap without making billions of calls; call a pipeline from
two streams to test that calls are ordered."""

import torch


def preset_epoch(plan, e: int) -> None:
    """Epochs ``e``, every counter ``e x need``, tail ``e x T``, head ``e x (T + P)`` (``P`` the
    consumer's CTAs), ring slots of lap ``e``, each chain kernel's ticket ``e`` runs of claims:
    what ``e`` calls leave (``plan.epoch`` too)."""
    for ep in plan.epochs:
        ep.fill_(e)
    for s, link in enumerate(plan.links, 1):
        T, P = link.dep.consumer.num_tiles, plan.num_ctas[s]
        link.counters.copy_(e * torch.as_tensor(link.dep.need, dtype=torch.int64))
        link.tail.fill_(e * T)
        link.head.fill_(e * (T + P))
        link.slots.fill_(e * T)
    chains = [lc.gemm for lc in plan.launches if len(lc.stages) > 1]  # in the order of plan.tickets
    for ticket, launch in zip(plan.tickets, chains):
        ticket.fill_(e * launch.claims_per_run)
    plan.epoch = e


def calls_from_two_streams(pipe, x1, x2, out2=None):
    """Call ``pipe`` on ``x1`` from the default stream behind a ~50 ms sleep, then on ``x2``
    (into ``out2``) from another stream that did not wait for it. Returns both results and
    whether call 2 ended after call 1 (as it must: every call is ordered after the one before)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # before call 1, on the default stream
    out1 = pipe(x1)
    end1 = torch.cuda.Event(enable_timing=True)
    end1.record()
    with torch.cuda.stream(torch.cuda.Stream()):
        out2 = pipe(x2, out=out2)
        end2 = torch.cuda.Event(enable_timing=True)
        end2.record()
    torch.cuda.synchronize()
    return out1, out2, end1.elapsed_time(end2) > 0
