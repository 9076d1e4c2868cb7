"""Timing GPU work fairly, and recording what it ran on.

:func:`time_interleaved` is the one harness every measurement of the project goes through (the
bench, :meth:`Pipeline.tune_ends`, the GPU demo, the scripts under ``benchmarks/``): an untimed
``prepare`` (pick an input set, so caches do not flatter), all devices synchronised, host clock,
the method, all devices synchronised again; methods take turns within each repetition.
:func:`capture` puts a call in a CUDA graph, and :func:`environment` records the versions and
devices a result belongs to.

This module depends on the standard library and torch only, never on other modules of the
package, so anything may import it. torch is imported inside the functions that need it: the
CLI imports this module to build its parser, and ``--help`` should not pay for torch.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Method:
    """One timed thing: ``prepare(i)`` (untimed: pick input set ``i``) then ``run()``."""

    name: str
    run: Callable[[], object]
    prepare: Callable[[int], object] = lambda i: None
    chunk: int | None = None
    note: str = ""


def time_interleaved(
    methods: list[Method],
    devices,
    reps: int,
    warmup: int,
    *,
    order: str = "shuffled",
    rest_ms: float = 0.0,
    seed: int = 0,
    positions: dict[str, list[int]] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds of ``reps`` runs of every method (host clock, all ``devices`` synchronised
    around each run). Methods take turns within each repetition, so a drift of the GPUs'
    clocks during the run affects all of them alike and their ratios stay fair.

    ``order="shuffled"`` (default) runs each repetition's methods in a fresh random order
    (``random.Random(seed)``, so a run can be repeated); ``"fixed"`` in the order given. Why
    shuffle: an H200 running our GEMM sits at its 700 W cap (2026-11-30-h200x2-transfer/transport),
    so the clock a call gets depends on the energy of the call just before it. In a fixed order
    each method always follows the same neighbour, a bias no number of repetitions removes.
    ``rest_ms``: idle time before each timed run (after the devices are synchronised), so every
    run starts from a rested GPU rather than from its predecessor's power state.
    ``positions`` (optional): filled with each method's place in every repetition.
    """
    if order not in ("shuffled", "fixed"):
        raise ValueError(f"order must be 'shuffled' or 'fixed', got {order!r}")
    if rest_ms < 0:
        raise ValueError(f"rest_ms must be >= 0, got {rest_ms}")
    rng = random.Random(seed)

    def turn():
        ms = list(methods)
        if order == "shuffled":
            rng.shuffle(ms)
        return ms

    def sync():
        if devices:
            import torch

            for d in devices:
                torch.cuda.synchronize(d)

    for i in range(warmup):
        for m in turn():
            m.prepare(i)
            m.run()
            # one method at a time, as in the timed runs: some methods' streams do not wait for
            # the caller's (TP), and nothing should overlap a pipeline whose CTAs need every SM
            sync()
    out: dict[str, list[float]] = {m.name: [] for m in methods}
    if positions is not None:
        positions.update({m.name: [] for m in methods})
    for i in range(reps):
        for place, m in enumerate(turn()):
            m.prepare(i)
            sync()
            if rest_ms:
                time.sleep(rest_ms / 1e3)
            t0 = time.perf_counter()
            m.run()
            sync()
            out[m.name].append((time.perf_counter() - t0) * 1e3)
            if positions is not None:
                positions[m.name].append(place)
    return out


def time_method(run: Callable[[], object], prepare: Callable[[int], object], devices, reps: int, warmup: int):
    """Milliseconds of ``reps`` runs of one method (see :func:`time_interleaved`)."""
    return time_interleaved([Method("m", run, prepare)], devices, reps, warmup)["m"]


def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """The median of ``values`` and a distribution-free confidence interval for it: the order
    statistics ``k`` and ``n + 1 - k`` with the largest ``k`` whose binomial tail
    ``P(Binom(n, 1/2) < k)`` stays within ``(1 - level) / 2`` (for n = 30 at 95%: the 10th and
    21st smallest). Fewer than 6 values give no interval at 95% (``nan`` ends)."""
    v = sorted(values)
    n = len(v)
    if n == 0:
        raise ValueError("median_ci of no values")
    tail, k, cdf = (1 - level) / 2, 0, 0.0
    while True:
        cdf += math.comb(n, k) / 2**n  # P(Binom(n, 1/2) <= k), so P(< k + 1)
        if cdf > tail:
            break
        k += 1
    if k == 0:
        return statistics.median(v), math.nan, math.nan
    return statistics.median(v), v[k - 1], v[n - k]


def capture(fn: Callable[[], object], devices):
    """Warm ``fn`` up (``devices`` synchronised after it), then capture it in a CUDA graph on
    cuda:0's stream; returns the ``torch.cuda.CUDAGraph``."""
    import torch

    fn()
    for d in devices:
        torch.cuda.synchronize(d)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.device(0), torch.cuda.graph(g):
        fn()
    return g


class Rotation:
    """Input sets used in turn: ``select(i)`` (untimed) picks set ``i``, ``x`` is the current one."""

    def __init__(self, xs):
        self.xs, self.x = xs, xs[0]

    def get(self, i):
        return self.xs[i % len(self.xs)]

    def select(self, i):
        self.x = self.get(i)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """What a measurement ran on: date, versions, the command, the NVLink-related environment
    variables, and the GPUs with their peer access. Triton's version comes from its package
    metadata, so this module needs no Triton import."""
    import torch

    env = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=_version("triton"),
        python=platform.python_version(),
        command=" ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
        env={
            k: os.environ.get(k)
            for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
        },
    )
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(n)]
        env["p2p"] = {
            f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j
        }
    return env
