"""CPU reference executor of the CTA-pipelining protocol.

Every CTA of every stage is a Python generator that performs the protocol's memory
operations one at a time (write a tile, bump a counter, claim a queue position, fill a slot,
wait) and yields after each. A seeded scheduler interleaves them; a CTA whose wait condition
does not hold is not runnable. The counters, the ring, its tail and head, the epochs, the
tile orders and the policies are the ones of :mod:`ctapipelining.deps` that the GPU kernels
use, and each tile's data is really computed with NumPy, so the executor checks that:

* every tile of every stage runs exactly once per run (epoch);
* no consumer tile runs before all the producer tiles it reads were written in this run
  (the intermediate buffers are also poisoned with NaN before each run); with
  ``Chain(wait_parts=P)`` a static GEMM consumer reads its input rows in ``P`` pieces of K,
  each after its own wait, as the kernels do, and no piece is read before it is written;
* the result equals the sequential chain in float64 (up to float32 rounding);
* there is no deadlock (a state where CTAs remain but none can run raises);
* after ``E`` runs without any reset every counter is exactly ``E * need`` and the queue
  tail is ``E * T``.

Memory here is sequentially consistent: the executor checks the protocol's logic (what is
waited for, pushed and claimed, in any interleaving), not the GPU's memory ordering, which the
fences in :mod:`ctapipelining.kernels.sync` provide.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from . import deps

Schedule = Literal["random", "consumers_first", "producers_first", "stall_one"]
SCHEDULES: tuple[str, ...] = ("random", "consumers_first", "producers_first", "stall_one")


class DeadlockError(RuntimeError):
    """CTAs remain but none of them can run."""


class ProtocolViolation(AssertionError):
    """A check of the protocol failed (a tile ran twice, too early, or not at all)."""


@dataclass(frozen=True)
class Stage:
    """One stage of a chain: ``out[M, n] = in @ weight`` (``kind='gemm'``) or
    ``out = relu(in)`` tile by tile (``kind='elementwise'``, ``n`` = the input's columns)."""

    kind: Literal["gemm", "elementwise"]
    n: int
    block_m: int
    block_n: int
    num_ctas: int
    group_m: int = 1


def relu(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0)


@dataclass
class Chain:
    """A chain of stages on an input ``[M, K0]``, with its tile grids and dependencies.
    ``wait_parts``: the pieces a GEMM consumer waits for its input rows in (capped at the
    producer's column-blocks, as :class:`ctapipelining.pipeline.Pipeline` caps them)."""

    M: int
    K0: int
    stages: list[Stage]
    wait_parts: int = 1
    grids: list[deps.TileGrid] = field(init=False)
    links: list[deps.Dependency] = field(init=False)  # links[s-1]: stage s-1 -> stage s
    orders: list[np.ndarray] = field(init=False)

    def __post_init__(self):
        if not self.stages:
            raise ValueError("a chain needs at least one stage")
        k = self.K0
        self.grids, self.orders = [], []
        for st in self.stages:
            if st.kind == "elementwise" and st.n != k:
                raise ValueError(f"an elementwise stage keeps the width: n={st.n} != input width {k}")
            if st.num_ctas < 1:
                raise ValueError("num_ctas must be >= 1")
            grid = deps.TileGrid(self.M, st.n, st.block_m, st.block_n)
            self.grids.append(grid)
            self.orders.append(deps.tile_order(grid, st.group_m))
            k = st.n
        self.links = [
            deps.build_dependency(
                self.grids[s - 1],
                self.grids[s],
                self.stages[s].kind,
                parts=min(self.wait_parts, self.grids[s - 1].num_n) if self.stages[s].kind == "gemm" else 1,
            )
            for s in range(1, len(self.stages))
        ]

    def make_weights(self, rng: np.random.Generator) -> list[np.ndarray | None]:
        ws, k = [], self.K0
        for st in self.stages:
            ws.append(rng.standard_normal((k, st.n)).astype(np.float32) / np.sqrt(k) if st.kind == "gemm" else None)
            k = st.n
        return ws

    def reference(self, x: np.ndarray, weights: list[np.ndarray | None]) -> np.ndarray:
        y = x.astype(np.float64)
        for st, w in zip(self.stages, weights):
            y = y @ w.astype(np.float64) if st.kind == "gemm" else relu(y)
        return y


@dataclass
class LinkState:
    """Scoreboard and work-queue of one link, living in the consumer's memory."""

    counters: np.ndarray
    slots: np.ndarray
    tail: int = 0
    head: int = 0

    @classmethod
    def empty(cls, dep: deps.Dependency) -> LinkState:
        return cls(np.zeros(dep.num_counters, np.int64), np.zeros(dep.consumer.num_tiles, np.int64))


@dataclass
class Event:
    step: int
    epoch: int
    stage: int
    cta: int
    kind: str  # "ready" (pushed or counter filled), "run", "signal"
    tile: int


@dataclass
class RunReport:
    epochs: int
    steps: int
    events: list[Event]
    outputs: list[np.ndarray]
    max_error: float

    def order(self, stage: int, kind: str, epoch: int | None = None) -> list[int]:
        """Tiles of ``stage`` in the order their ``kind`` events happened (in one ``epoch``)."""
        return [e.tile for e in self.events if e.stage == stage and e.kind == kind and epoch in (None, e.epoch)]


class _Wait:
    __slots__ = ("cond",)

    def __init__(self, cond: Callable[[], bool]):
        self.cond = cond


class Executor:
    """Runs a :class:`Chain` under a policy and a schedule; see the module docstring."""

    def __init__(
        self, chain: Chain, policy: deps.Policy | str = "workqueue", schedule: Schedule = "random", seed: int = 0
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {schedule!r}; choose from {SCHEDULES}")
        self.chain = chain
        self.policy = deps.get_policy(policy)
        if self.policy.uses_queue and any(d.parts > 1 for d in chain.links):
            raise ValueError("a workqueue consumer runs whole tiles once ready: build the chain with wait_parts=1")
        self.schedule = schedule
        self.rng = random.Random(seed)
        self.state = [LinkState.empty(d) for d in chain.links]
        self.epoch = 0
        self.events: list[Event] = []
        self.steps = 0

    # -- one CTA, as a generator of memory operations ---------------------------------------
    def _cta(self, s: int, pid: int, bufs, weights, written) -> Iterator[_Wait | None]:
        ch, e = self.chain, self.epoch
        grid, st = ch.grids[s], ch.stages[s]
        if s == 0 or not self.policy.uses_queue:
            for tile in deps.POLICIES["static"].tiles_of_cta(ch.orders[s], pid, st.num_ctas):
                tile = int(tile)
                if s > 0:
                    c, v = deps.wait_target(ch.links[s - 1], tile, e)
                    yield _Wait(lambda c=c, v=v, counters=self.state[s - 1].counters: counters[c] >= v)
                yield from self._run_tile(s, pid, tile, bufs, weights, written)
            return
        link, T = self.state[s - 1], grid.num_tiles
        base = deps.head_base(e, T, st.num_ctas)
        while True:
            idx = link.head - base  # fetch_add(head, 1): one atomic step
            link.head += 1
            yield None
            if idx >= T:
                return
            pos = (e - 1) * T + idx
            yield _Wait(lambda r=pos % T: link.slots[r] >= e * T)
            tile = int(link.slots[pos % T] - e * T)
            if not 0 <= tile < T:
                raise ProtocolViolation(f"stage {s}: slot {pos} holds {link.slots[pos % T]}, not a tile of epoch {e}")
            yield from self._run_tile(s, pid, tile, bufs, weights, written)

    def _check_written(self, s, tile, producer_tiles, written):
        missing = [p for p in producer_tiles if written[s - 1][p] != self.epoch]
        if missing:
            raise ProtocolViolation(f"stage {s} tile {tile} read producer tiles {missing} before they were written")

    def _run_tile(self, s, pid, tile, bufs, weights, written) -> Iterator[_Wait | None]:
        """Compute a tile whose input (part 0 of it, when waiting in parts) is ready."""
        ch, e = self.chain, self.epoch
        rows, cols = ch.grids[s].tile_slices(tile)
        src = bufs[s]
        dep = ch.links[s - 1] if s > 0 else None
        if dep is not None and dep.parts > 1:
            # the K loop reads the rows piece by piece, each after waiting for its counter
            K, out = src.shape[1], np.zeros((rows.stop - rows.start, cols.stop - cols.start), np.float32)
            self._log(s, pid, "run", tile)
            for q in range(dep.parts):
                if q > 0:
                    c, v = deps.wait_target(dep, tile, e, part=q)
                    yield _Wait(lambda c=c, v=v, counters=self.state[s - 1].counters: counters[c] >= v)
                self._check_written(s, tile, dep.part_needs(tile, q), written)
                k = slice(dep.part_k_start(q), dep.part_k_start(q + 1) if q + 1 < dep.parts else K)
                out += src[rows, k] @ weights[s][k, cols]
        else:
            if dep is not None:
                self._check_written(s, tile, dep.needs(tile), written)
            out = src[rows, :] @ weights[s][:, cols] if ch.stages[s].kind == "gemm" else relu(src[rows, cols])
            self._log(s, pid, "run", tile)
        bufs[s + 1][rows, cols] = out
        if written[s][tile] == e:
            raise ProtocolViolation(f"stage {s} tile {tile} ran twice in epoch {e}")
        written[s][tile] = e
        yield None
        if s + 1 < len(ch.stages):
            yield from self._signal(s, pid, tile)

    def _signal(self, s, pid, tile) -> Iterator[None]:
        dep, link, e = self.chain.links[s], self.state[s], self.epoch
        T = dep.consumer.num_tiles
        for c in dep.signals(tile):
            old = int(link.counters[c])  # fetch_add(counter, 1), release
            link.counters[c] += 1
            yield None
            if not deps.fills(dep, int(c), old, e):
                continue
            for t in dep.pushes(int(c)):
                self._log(s + 1, pid, "ready", int(t))
            if self.policy.uses_queue:
                tiles = dep.pushes(int(c))
                pos = link.tail  # fetch_add(tail, len(tiles))
                link.tail += len(tiles)
                yield None
                for k, t in enumerate(tiles):  # one release store per slot
                    link.slots[(pos + k) % T] = deps.slot_value(pos + k, T, int(t))
                    yield None

    def _log(self, stage, cta, kind, tile):
        self.events.append(Event(self.steps, self.epoch, stage, cta, kind, tile))

    # -- scheduling -------------------------------------------------------------------------
    def _pick(self, runnable: list[tuple[int, int]]) -> tuple[int, int]:
        if self.schedule == "random":
            return self.rng.choice(runnable)
        if self.schedule == "stall_one":
            others = [k for k in runnable if k != (0, 0)]
            return self.rng.choice(others or runnable)
        best = max(k[0] for k in runnable) if self.schedule == "consumers_first" else min(k[0] for k in runnable)
        return self.rng.choice([k for k in runnable if k[0] == best])

    def run(self, x: np.ndarray, weights: list[np.ndarray | None], max_steps: int | None = None) -> np.ndarray:
        """One run (epoch) of the whole chain on ``x``; returns the last stage's output."""
        ch = self.chain
        if x.shape != (ch.M, ch.K0):
            raise ValueError(f"x has shape {x.shape}, chain expects {(ch.M, ch.K0)}")
        self.epoch += 1
        bufs = [x.astype(np.float32)] + [np.full((ch.M, g.N), np.nan, np.float32) for g in ch.grids]
        written = [np.zeros(g.num_tiles, np.int64) for g in ch.grids]
        ctas = {
            (s, p): self._cta(s, p, bufs, weights, written)
            for s, st in enumerate(ch.stages)
            for p in range(st.num_ctas)
        }
        waits: dict[tuple[int, int], _Wait | None] = {k: None for k in ctas}
        # every tile costs a bounded number of steps (run, bumps, pushes, claims): far below this
        ops = sum(g.num_tiles for g in ch.grids) * (3 + sum(d.max_need for d in ch.links))
        limit = max_steps or 20 * ops + 10_000
        start = self.steps
        while ctas:
            runnable = [k for k in ctas if waits[k] is None or waits[k].cond()]
            if not runnable:
                blocked = sorted(ctas)
                raise DeadlockError(f"epoch {self.epoch}: CTAs {blocked[:8]} (stage, cta) all wait and none can run")
            if self.steps - start > limit:
                raise DeadlockError(f"epoch {self.epoch}: no completion after {limit} steps")
            k = self._pick(runnable)
            self.steps += 1
            try:
                waits[k] = next(ctas[k])
            except StopIteration:
                del ctas[k], waits[k]
        for s, w in enumerate(written):
            if not (w == self.epoch).all():
                raise ProtocolViolation(f"stage {s}: tiles {np.flatnonzero(w != self.epoch)[:8]} never ran")
        self._check_counters()
        return bufs[-1]

    def _check_counters(self):
        for s, (dep, link) in enumerate(zip(self.chain.links, self.state)):
            if not (link.counters == self.epoch * dep.need).all():
                raise ProtocolViolation(f"link {s}: counters {link.counters} != epoch {self.epoch} x need {dep.need}")
            if self.policy.uses_queue and link.tail != self.epoch * dep.consumer.num_tiles:
                raise ProtocolViolation(f"link {s}: tail {link.tail} != {self.epoch} x {dep.consumer.num_tiles}")


def run_chain(
    chain: Chain,
    policy: deps.Policy | str = "workqueue",
    schedule: Schedule = "random",
    epochs: int = 1,
    seed: int = 0,
    rtol: float = 1e-4,
) -> RunReport:
    """Run ``epochs`` back-to-back runs with fresh random data each, checking every one."""
    rng = np.random.default_rng(seed)
    ex = Executor(chain, policy, schedule, seed)
    weights = chain.make_weights(rng)
    outputs, worst = [], 0.0
    for _ in range(epochs):
        x = rng.standard_normal((chain.M, chain.K0)).astype(np.float32)
        y = ex.run(x, weights)
        ref = chain.reference(x, weights)
        if np.isnan(y).any():
            raise ProtocolViolation("NaN in the output: a tile read an unwritten input")
        err = float(np.abs(y - ref).max() / max(1.0, np.abs(ref).max()))
        if err > rtol:
            raise ProtocolViolation(f"output differs from the float64 reference: {err:.3g} > {rtol}")
        worst = max(worst, err)
        outputs.append(y)
    runs = Counter((e.stage, e.tile) for e in ex.events if e.kind == "run")
    if any(v != epochs for v in runs.values()) or len(runs) != sum(g.num_tiles for g in chain.grids):
        raise ProtocolViolation("some tile did not run exactly once per epoch")
    return RunReport(epochs, ex.steps, ex.events, outputs, worst)
