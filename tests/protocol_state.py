"""Test helper: put a plan in the state that ``e`` clean calls leave, to test what happens
past a counter's or ring position's wrap without making billions of calls."""

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
