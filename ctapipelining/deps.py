"""The dependency structure of CTA-pipelining: tile grids, dependency arrays, counters,
tile orders, policies and epochs. Pure Python/NumPy; the same objects drive the Triton
kernels, the CPU reference executor (:mod:`ctapipelining.refexec`) and the simulator.

The protocol
------------
A chain of *stages* runs concurrently, placed on devices (several may share one). Stage ``s`` writes an output matrix
``[M, N_s]`` tile by tile (``BLOCK_M x BLOCK_N`` per tile) straight into the memory of stage
``s + 1``. Between two consecutive stages we build:

* the **dependency array**: for each consumer tile, the producer tiles it reads. A *rule*
  decides it from row and column ranges. In a GEMM chain (:class:`GemmRule`) consumer rows
  ``[r0, r1)`` read the producer's rows ``[r0, r1)`` across all of its columns (its K), so
  they need every producer tile whose rows overlap ``[r0, r1)``, whatever the two BLOCK_M
  are and whether or not M divides them. In an element-wise stage (:class:`ElementwiseRule`)
  a consumer tile needs the producer tiles that overlap it in rows *and* columns.
* **counters** (the scoreboard): consumer tiles with identical dependency sets share one
  counter; in a GEMM chain that is one counter per consumer row-block. ``need[c]`` is the
  number of producer tiles that bump counter ``c``.
* the **signal lists**: for each producer tile, the counters it bumps (CSR, int32).
* the **push lists**: for each counter, the consumer tiles that become ready when it fills
  (CSR, int32). Under the ``workqueue`` policy the producer whose bump fills a counter pushes
  them into the consumer's ring.

Epochs
------
Counters only grow. In run (epoch) ``e = 1, 2, ...`` counter ``c`` is full when
``count >= e * need[c]``, so back-to-back runs need no reset and a run can be captured in a
CUDA graph. The work-queue grows the same way:

* ``tail``: producers ``fetch_add`` it; after epoch ``e`` it is exactly ``e * T`` (``T``
  consumer tiles a run). Slot ``pos`` of the ring (capacity ``T``) holds the tagged value
  ``lap * T + tile`` with ``lap = pos // T + 1`` (== the epoch), so a consumer knows a slot is
  filled *for this run* when its value is ``>= e * T``; values in a slot only grow.
* ``head``: consumer CTAs ``fetch_add`` it to claim a position. Each of the ``P`` consumer
  CTAs claims until it gets a position past the run's ``T`` tiles, so a run moves the head by
  exactly ``T + P``: run ``e`` numbers its claims from ``(e - 1) * (T + P)``.

Counters, slots, head, tail and epochs are int64 on the device and compared on their signed
difference, so they never wrap in practice (2^63 bumps) and the owner never has to reset
them; the CSR lists are int32.

Policies and orders are separate
--------------------------------
A *tile order* is a permutation of tile ids (row-major ids ``pm * num_n + pn``): the order a
persistent kernel's CTA loop visits positions ``pid, pid + P, ...``. A *policy* says how a
consumer decides what to run next: ``static`` runs tiles in the order and waits on each one's
counter (cuSync-style); ``workqueue`` runs them in the order they became ready (the paper's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal

import numpy as np

# --------------------------------------------------------------------------- tile grids


@dataclass(frozen=True)
class TileGrid:
    """The output tiles of one stage: an ``[M, N]`` matrix in ``BLOCK_M x BLOCK_N`` tiles.

    Tile ids are row-major: ``tile = pm * num_n + pn``. Edge tiles are smaller when the sizes
    do not divide the blocks.
    """

    M: int
    N: int
    block_m: int
    block_n: int

    def __post_init__(self):
        for name in ("M", "N", "block_m", "block_n"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"TileGrid.{name} must be a positive int, got {v!r}")

    @property
    def num_m(self) -> int:
        return -(-self.M // self.block_m)

    @property
    def num_n(self) -> int:
        return -(-self.N // self.block_n)

    @property
    def num_tiles(self) -> int:
        return self.num_m * self.num_n

    def coords(self, tile: int) -> tuple[int, int]:
        """``(pm, pn)`` of a row-major tile id."""
        if not 0 <= tile < self.num_tiles:
            raise IndexError(f"tile {tile} outside grid of {self.num_tiles} tiles")
        return divmod(int(tile), self.num_n)

    def rows(self, pm: int) -> tuple[int, int]:
        """Half-open row range of row-block ``pm``."""
        return pm * self.block_m, min((pm + 1) * self.block_m, self.M)

    def cols(self, pn: int) -> tuple[int, int]:
        """Half-open column range of column-block ``pn``."""
        return pn * self.block_n, min((pn + 1) * self.block_n, self.N)

    def tile_slices(self, tile: int) -> tuple[slice, slice]:
        pm, pn = self.coords(tile)
        return slice(*self.rows(pm)), slice(*self.cols(pn))


def _blocks_covering(lo: int, hi: int, block: int) -> range:
    """Indices of the blocks of size ``block`` that overlap ``[lo, hi)``."""
    return range(lo // block, (hi - 1) // block + 1)


# --------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class GemmRule:
    """Consumer ``out = in @ W``: consumer rows ``[r0, r1)`` read every column of the producer's
    rows ``[r0, r1)``, so they need all producer tiles overlapping those rows."""

    name: str = "gemm"

    def check(self, producer: TileGrid, consumer: TileGrid, consumer_k: int | None = None) -> None:
        if producer.M != consumer.M:
            raise ValueError(f"gemm rule: producer M={producer.M} != consumer M={consumer.M}")
        if consumer_k is not None and consumer_k != producer.N:
            raise ValueError(f"gemm rule: consumer K={consumer_k} != producer N={producer.N}")

    def needs(self, producer: TileGrid, consumer: TileGrid, tile: int) -> tuple[range, range]:
        """``(producer row-blocks, producer column-blocks)`` the consumer tile reads."""
        cm, _ = consumer.coords(tile)
        return _blocks_covering(*consumer.rows(cm), producer.block_m), range(producer.num_n)


@dataclass(frozen=True)
class ElementwiseRule:
    """Consumer ``out = f(in)`` tile by tile: a consumer tile needs the producer tiles that
    overlap it in rows and columns (the same tile when both grids agree)."""

    name: str = "elementwise"

    def check(self, producer: TileGrid, consumer: TileGrid, consumer_k: int | None = None) -> None:
        if (producer.M, producer.N) != (consumer.M, consumer.N):
            raise ValueError(
                f"elementwise rule: producer [{producer.M}, {producer.N}] != consumer [{consumer.M}, {consumer.N}]"
            )

    def needs(self, producer: TileGrid, consumer: TileGrid, tile: int) -> tuple[range, range]:
        cm, cn = consumer.coords(tile)
        return (
            _blocks_covering(*consumer.rows(cm), producer.block_m),
            _blocks_covering(*consumer.cols(cn), producer.block_n),
        )


Rule = GemmRule | ElementwiseRule
RULES: dict[str, Rule] = {"gemm": GemmRule(), "elementwise": ElementwiseRule()}


# --------------------------------------------------------------------------- dependency


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.zeros(len(lists) + 1, dtype=np.int32)
    ptr[1:] = np.cumsum([len(x) for x in lists], dtype=np.int64)
    flat = np.fromiter((v for x in lists for v in x), dtype=np.int32, count=int(ptr[-1]))
    return ptr, flat


@dataclass(frozen=True, eq=False)
class Dependency:
    """Dependency arrays, counters and CSR lists between one producer and one consumer stage.

    Attributes (all int32 NumPy arrays, ready to copy to a GPU)
    ----------
    counter_of_tile : ``[consumer.num_tiles]`` the counter each consumer tile waits on
        before it starts (its part 0); part ``q`` is counter ``counter_of_tile[t] + q``.
    need : ``[num_counters]`` producer tiles that bump each counter.
    signal_ptr, signal_counters : CSR, producer tile ``p`` bumps
        ``signal_counters[signal_ptr[p]:signal_ptr[p + 1]]``.
    push_ptr, push_tiles : CSR, counter ``c`` readies consumer tiles
        ``push_tiles[push_ptr[c]:push_ptr[c + 1]]`` (ascending ids). A ``workqueue``
        consumer runs whole tiles in readiness order, so it uses ``parts = 1``.
    """

    producer: TileGrid
    consumer: TileGrid
    rule: Rule
    counter_of_tile: np.ndarray
    need: np.ndarray
    signal_ptr: np.ndarray
    signal_counters: np.ndarray
    push_ptr: np.ndarray
    push_tiles: np.ndarray
    _needs: tuple[tuple[int, ...], ...] = field(repr=False)
    parts: int = 1
    part_first_col: tuple[int, ...] = (0,)

    @property
    def num_counters(self) -> int:
        return len(self.need)

    def needs(self, consumer_tile: int) -> tuple[int, ...]:
        """Producer tile ids (ascending) that consumer tile ``consumer_tile`` reads."""
        c = int(self.counter_of_tile[consumer_tile])
        return tuple(sorted(p for q in range(self.parts) for p in self._needs[c + q]))

    def part_needs(self, consumer_tile: int, part: int) -> tuple[int, ...]:
        """Producer tile ids that part ``part`` of ``consumer_tile``'s input is written by."""
        if not 0 <= part < self.parts:
            raise IndexError(f"part {part} outside {self.parts} parts")
        return self._needs[int(self.counter_of_tile[consumer_tile]) + part]

    def part_k_start(self, part: int) -> int:
        """First consumer K index (a column of the producer's output) that part ``part`` covers."""
        return self.part_first_col[part] * self.producer.block_n

    def signals(self, producer_tile: int) -> np.ndarray:
        return self.signal_counters[self.signal_ptr[producer_tile] : self.signal_ptr[producer_tile + 1]]

    def pushes(self, counter: int) -> np.ndarray:
        return self.push_tiles[self.push_ptr[counter] : self.push_ptr[counter + 1]]

    @cached_property
    def max_need(self) -> int:
        return int(self.need.max())

    @cached_property
    def max_signals(self) -> int:
        """Most counters one producer tile bumps."""
        return int(np.diff(self.signal_ptr).max())

    @cached_property
    def max_push(self) -> int:
        """Most consumer tiles one counter readies."""
        return int(np.diff(self.push_ptr).max())


def part_columns(num_n: int, parts: int) -> tuple[int, ...]:
    """First producer column-block of each of ``parts`` near-equal pieces of ``range(num_n)``."""
    if not 1 <= parts <= num_n:
        raise ValueError(f"parts must be in [1, {num_n}] (the producer's column-blocks), got {parts}")
    return tuple(q * num_n // parts for q in range(parts))


def build_dependency(
    producer: TileGrid,
    consumer: TileGrid,
    rule: Rule | str = "gemm",
    consumer_k: int | None = None,
    parts: int = 1,
) -> Dependency:
    """Dependency arrays from ``producer`` tiles to ``consumer`` tiles under ``rule``.

    Consumer tiles whose dependency sets are identical share one counter; counters are
    numbered in order of their first consumer tile (so a GEMM chain gets one counter per
    consumer row-block, counter ``c`` == row-block ``c``). With ``parts > 1`` (GEMM rule)
    each such set gets ``parts`` consecutive counters, one per piece of the producer's
    columns (row-block ``r``, part ``q``: counter ``r * parts + q``).
    """
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; choose from {sorted(RULES)}")
        rule = RULES[rule]
    rule.check(producer, consumer, consumer_k)
    if parts != 1 and not isinstance(rule, GemmRule):
        raise ValueError(f"parts={parts}: only a GEMM consumer reads its input along a K loop (rule {rule.name!r})")
    first_cols = part_columns(producer.num_n, parts)
    counter_of_key: dict[tuple, int] = {}
    counter_of_tile = np.empty(consumer.num_tiles, dtype=np.int32)
    needs: list[tuple[int, ...]] = []
    push: list[list[int]] = []
    for t in range(consumer.num_tiles):
        rows, cols = rule.needs(producer, consumer, t)
        key = (rows.start, rows.stop, cols.start, cols.stop)
        c = counter_of_key.get(key)
        if c is None:
            c = counter_of_key[key] = len(needs)
            bounds = [cols.start + f for f in first_cols] + [cols.stop]
            for q in range(parts):
                needs.append(tuple(pm * producer.num_n + pn for pm in rows for pn in range(bounds[q], bounds[q + 1])))
                push.append([])
        counter_of_tile[t] = c
        for q in range(parts):
            push[c + q].append(t)
    signal: list[list[int]] = [[] for _ in range(producer.num_tiles)]
    for c, tiles in enumerate(needs):
        for p in tiles:
            signal[p].append(c)
    signal_ptr, signal_counters = _csr(signal)
    push_ptr, push_tiles = _csr(push)
    return Dependency(
        producer=producer,
        consumer=consumer,
        rule=rule,
        counter_of_tile=counter_of_tile,
        need=np.array([len(x) for x in needs], dtype=np.int32),
        signal_ptr=signal_ptr,
        signal_counters=signal_counters,
        push_ptr=push_ptr,
        push_tiles=push_tiles,
        _needs=tuple(needs),
        parts=parts,
        part_first_col=first_cols,
    )


# --------------------------------------------------------------------------- tile orders


def grouped_tile(pos: int, num_m: int, num_n: int, group_m: int) -> int:
    """Row-major tile id visited at position ``pos`` of the grouped order.

    The same arithmetic as the kernels' ``_tile_coords`` (Triton's persistent-matmul
    tutorial): groups of ``group_m`` row-blocks, column-major inside a group. ``group_m = 1``
    is plain row-major.
    """
    per_group = group_m * num_n
    group = pos // per_group
    first_m = group * group_m
    size_m = np.minimum(num_m - first_m, group_m)  # (pos may be an array of positions: tile_order)
    pm = first_m + (pos % per_group) % size_m
    pn = (pos % per_group) // size_m
    return pm * num_n + pn


def tile_order(grid: TileGrid, group_m: int = 1) -> np.ndarray:
    """Permutation ``order[pos] = tile`` of the grouped order (``group_m = 1``: row-major).

    Why it matters for pipelining: a GEMM-chain counter fills only when a whole producer
    row-block is written. Row-major (``group_m = 1``) completes row-blocks one after another,
    so consumers start after about ``num_n / P`` of a wave; a group of ``g`` row-blocks is
    finished only when the whole group is, so consumers wait ``g * num_n`` tiles. Larger
    groups reuse the weight in L2 better; pick the smallest group that keeps the GEMM fast.
    """
    if group_m < 1:
        raise ValueError(f"group_m must be >= 1, got {group_m}")
    return grouped_tile(np.arange(grid.num_tiles), grid.num_m, grid.num_n, group_m).astype(np.int32)


TAIL_MIN_SLICE_K = 16  # K-steps a split tail's slice has at least on a GPU (shorter: mostly pipeline fill)


@dataclass(frozen=True)
class TailSplit:
    """The last, partial round of a persistent loop, split along K over the CTAs it leaves idle.

    A persistent GEMM of ``T`` tiles on ``P`` CTAs runs ``T // P`` full rounds and then one
    round of ``T % P`` tiles. That round takes about a whole tile time however few tiles it
    has: at X[16384, 8192] @ [8192, 8192] with 128x256 tiles on an H200, 4096 tiles are
    31 rounds of 132 plus 4 tiles, so the 32nd round costs ~3% of the GEMM for 0.1% of its
    work. In a two-stage chain both stages pay it on the critical path (the consumer's last
    row-blocks wait for the producer's last round, then run their own last round).

    Here each of those ``tiles`` tail tiles is cut into ``splits`` slices of its K loop, one
    per CTA (``tiles * splits <= P``). Each slice writes an fp32 partial tile to a workspace
    (slot ``item``); the CTA that stores the last partial of a tile (an arrival counter says
    which) adds the partials in slice order and writes and signals the tile. The order is
    fixed, so the result does not depend on which CTA arrives last; it differs in rounding
    from the unsplit tile.

    A GEMM of fewer tiles than CTAs is one partial round, split whole here: split-K, for few
    rows, where the weights' bandwidth bounds the time and whole tiles would stream them on few
    SMs (a Llama-8B block's down GEMM at decode: 16 tiles of 128 x 256). A configuration asks
    for it (``GemmConfig.split_k``); the GEMM's grid is then a CTA per slice
    (:func:`ctapipelining.gemm.launch_grid`: the plain GEMM's and a pipeline stage's alike).

    Positions ``[first_pos, first_pos + tiles)`` of the tile order are the tail; item
    ``i < tiles * splits`` (run by CTA ``i``) is slice ``i % splits`` of tail tile ``i // splits``.
    (Sharing the last full round too, stream-K, measured slower on an H200: at 640-1024 rows no
    stream-K configuration was the plain GEMM's fastest, and a Llama-8B block at 4096 rows with
    both GEMMs stream-K took 1.10x as long;
    ``benchmarks/results/2026-12-05-h200-suite/e1b2825/configs-parts-output.txt``.)
    """

    first_pos: int
    tiles: int
    splits: int

    def __post_init__(self):
        if self.first_pos < 0 or self.tiles < 1 or self.splits < 2:
            raise ValueError(f"a TailSplit needs first_pos >= 0, tiles >= 1 and splits >= 2, got {self}")

    @property
    def items(self) -> int:
        """Work items (K-slices), one per CTA; also the workspace's partial tiles."""
        return self.tiles * self.splits

    def check(self, num_tiles: int, num_ctas: int, k_tiles: int) -> None:
        """Raise a clear error unless this splits the tail of ``num_tiles`` tiles of ``k_tiles``
        K-steps on ``num_ctas`` CTAs: its tiles end the tile order, each slice has a CTA
        (``items <= num_ctas``) and K-steps to run (``splits <= k_tiles``; an empty slice is a
        CTA's work for nothing)."""
        why = None
        if self.first_pos + self.tiles != num_tiles:
            why = f"its tiles {self.first_pos}-{self.first_pos + self.tiles - 1} are not the last"
        elif self.items > num_ctas:
            why = f"{self.items} slices for {num_ctas} CTAs"
        elif self.splits > k_tiles:
            why = f"more slices a tile than its {k_tiles} K-steps"
        if why is not None:
            raise ValueError(f"{self} is not a tail of {num_tiles} tiles on {num_ctas} CTAs: {why}")

    def slice_of(self, item: int, k_tiles: int) -> tuple[int, int, int]:
        """``(position, k_begin, k_end)`` of work item ``item`` (K in BLOCK_K steps)."""
        j, part = divmod(item, self.splits)
        return self.first_pos + j, part * k_tiles // self.splits, (part + 1) * k_tiles // self.splits


def split_tail(num_tiles: int, num_ctas: int, k_tiles: int, min_slice_k: int) -> TailSplit | None:
    """How to split the partial last round of ``num_tiles`` tiles on ``num_ctas`` CTAs, each
    slice at least ``min_slice_k`` K-steps long (shorter slices are mostly pipeline fill and
    make the final sum read more partials); None when there is no partial round or no split
    of at least 2 slices fits. Fewer tiles than CTAs are one partial round, split whole
    (split-K: a GEMM of few rows, which the weights' bandwidth bounds, then streams them on
    more SMs); a grid of as many CTAs as tiles has no partial round."""
    if min_slice_k < 1:
        raise ValueError(f"min_slice_k must be >= 1, got {min_slice_k}")
    tiles = num_tiles % num_ctas
    if tiles == 0:
        return None
    splits = min(num_ctas // tiles, k_tiles // min_slice_k)
    return TailSplit(num_tiles - tiles, tiles, splits) if splits >= 2 else None


def last_stage_tail(tiles: list[int], num_ctas: int, k_tiles: int, min_slice_k: int) -> TailSplit | None:
    """The split tail of one persistent loop over several stages' tiles in turn (``tiles[s]``
    each; a chain kernel's combined order): :func:`split_tail` of the whole, if it lies within
    the last stage (``k_tiles``: its K-steps), with ``first_pos`` counted from the last stage's
    first tile, as the stage run alone counts it; else None."""
    split = split_tail(sum(tiles), num_ctas, k_tiles, min_slice_k)
    before = sum(tiles[:-1])
    if split is None or split.first_pos < before:
        return None
    return TailSplit(split.first_pos - before, split.tiles, split.splits)


STAGE_SHIFT = 24  # a chain order's code: stage << STAGE_SHIFT | the stage's own position
CHAIN_MAX_STAGES = 4  # stages one chain kernel runs (kernels/chain.py MAX_STAGES); more run in further kernels


def chain_order(
    num_m: int,
    num_ns: list[int],
    group_m: int,
    lag: int | None,
    tail: TailSplit | None = None,
    ring_first: bool = False,
) -> np.ndarray:
    """The combined tile order of a chain kernel over stages of ``num_ns[s]`` column-blocks on
    ``num_m`` row-blocks: ``code[pos] = stage << STAGE_SHIFT | q``, ``q`` the stage's own
    position in its grouped order (with ``tail``, the last stage's positions past
    ``tail.first_pos`` are its tail tiles' K-slices, ``tail.splits`` each). ``ring_first``: the
    first stage's input comes through a ring, so its ``q``-th position runs the tile that became
    ready ``q``-th, whichever it is: the second stage then waits for all of the first.

    Each stage keeps its own order; a tile of stage ``s > 0`` reads its row-block of stage
    ``s - 1`` and is placed after every tile of it, so a tile waits only on earlier positions
    (the kernel's no-deadlock argument). ``lag=None``: stage after stage. Otherwise stages
    interleave: before each position, the deepest stage whose next tile's inputs were placed
    more than ``lag`` positions ago takes it (about one round of the grid: those inputs are then
    likely written when it is claimed), else the first stage with work whose inputs are
    placed. The last stage's rows then come out from the first rounds on, not only after every
    earlier stage is done: what a next GPU waits for, and what it needs to start."""
    S = len(num_ns)
    if S < 1 or S > 1 << (31 - STAGE_SHIFT) or num_m < 1 or min(num_ns) < 1 or group_m < 1:
        raise ValueError(f"chain_order: bad shape num_m={num_m}, num_ns={num_ns}, group_m={group_m}")
    if lag is not None and lag < 0:
        raise ValueError(f"lag must be >= 0 or None, got {lag}")
    rows = []  # rows[s][q]: the row-block of stage s's position q
    for s, num_n in enumerate(num_ns):
        tiles = num_m * num_n
        if max(tiles, 1) >= 1 << STAGE_SHIFT:
            raise ValueError(f"stage {s} has {tiles} tiles: at most {(1 << STAGE_SHIFT) - 1} in a chain order")
        q_tile = np.arange(tiles)
        if s == S - 1 and tail is not None:
            slices = np.arange(tail.items)
            q_tile = np.concatenate([np.arange(tail.first_pos), tail.first_pos + slices // tail.splits])
        rows.append(list(tile_order(TileGrid(num_m, num_n, 1, 1), group_m)[q_tile] // num_n))
    spans = [len(r) for r in rows]
    # per stage and row-block: positions placed, and the last one's place in the combined order
    done = [np.zeros(num_m, dtype=np.int64) for _ in range(S)]
    last = [np.zeros(num_m, dtype=np.int64) for _ in range(S)]
    full = [np.bincount(r, minlength=num_m) for r in rows]  # positions of each row-block
    nxt = [0] * S
    codes = np.empty(sum(spans), dtype=np.int32)

    if ring_first:
        rows[0] = [0] * spans[0]  # one row-block as far as the order knows: the second stage waits for all
        full[0] = np.bincount(rows[0], minlength=num_m)

    def input_rows(s: int) -> int:
        """The row-block of stage ``s - 1`` that stage ``s``'s next position reads."""
        return 0 if s == 1 and ring_first else rows[s][nxt[s]]

    def inputs_placed(s: int) -> bool:
        return s == 0 or done[s - 1][input_rows(s)] == full[s - 1][input_rows(s)]

    for pos in range(len(codes)):
        pick = None
        if lag is not None:
            for s in range(S - 1, 0, -1):  # the deepest stage whose next tile's inputs are old enough
                if nxt[s] < spans[s] and inputs_placed(s) and pos - last[s - 1][input_rows(s)] > lag:
                    pick = s
                    break
        if pick is None:  # the first stage with work whose inputs are placed (one always is; stage
            # after stage, the first with work, every stage before it being done)
            pick = next(s for s in range(S) if nxt[s] < spans[s] and inputs_placed(s))
        r = rows[pick][nxt[pick]]
        codes[pos] = pick << STAGE_SHIFT | nxt[pick]
        done[pick][r] += 1
        last[pick][r] = pos
        nxt[pick] += 1
    return codes


def balanced_ends(M: int, N0: int, N1: int, block_m: int, block_n: int, num_sms: int) -> tuple[int, int]:
    """``(R, D)``: the rows a two-stage chain's second GPU prefills and its first GPU drains
    (``Pipeline(ends="balanced")``), so that the two GPUs' paths are about as long.

    ``D``: the most whole row-blocks whose tiles fit one round of ``num_sms`` CTAs in both drain
    GEMMs (layer 1 has ``N0`` columns, layer 2 ``N1``), at least one: a GEMM's partial round
    costs as much as a full one. ``R``: ``D`` plus ``M / 64`` rows, rounded down to a
    row-block: one round each way, and a little more for a longer chain, because the
    producer's writes into the peer slow its GPU in proportion to its work.

    On 2x H200 at ``K = N = 8192`` (bf16, 128x256 tiles, so ``D`` = 512) this rule's prefill
    is at or near the best at M = 2048 and 8192; at 16384 the best prefill differs from machine
    to machine (640 to 1536 rows) and this rule's is a safe middle
    (benchmarks/results/2026-11-30-h200x2-ends/). :meth:`Pipeline.tune_ends` measures the
    machine at hand.
    """
    tiles_per_row_block = max(-(-N0 // block_n), -(-N1 // block_n))
    D = max(1, num_sms // tiles_per_row_block) * block_m
    R = (D + M // 64) // block_m * block_m
    return R, D


# --------------------------------------------------------------------------- policies

PolicyName = Literal["workqueue", "static"]


@dataclass(frozen=True)
class StaticPolicy:
    """Consumer CTA ``pid`` of ``P`` runs ``order[pid::P]`` and waits on each tile's counter."""

    name: str = "static"
    uses_queue: bool = False

    def tiles_of_cta(self, order: np.ndarray, pid: int, num_ctas: int) -> np.ndarray:
        return order[pid::num_ctas]


@dataclass(frozen=True)
class WorkQueuePolicy:
    """Consumer CTAs claim queue positions from the head and run tiles in readiness order;
    the producer that fills a counter pushes that counter's tiles."""

    name: str = "workqueue"
    uses_queue: bool = True


Policy = StaticPolicy | WorkQueuePolicy
POLICIES: dict[str, Policy] = {"static": StaticPolicy(), "workqueue": WorkQueuePolicy()}


def get_policy(policy: Policy | str) -> Policy:
    if isinstance(policy, str):
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
        return POLICIES[policy]
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy or one of {sorted(POLICIES)}, got {policy!r}")
    return policy


def wait_target(dep: Dependency, tile: int, epoch: int, part: int = 0) -> tuple[int, int]:
    """``(counter, value)``: consumer tile ``tile`` may start (``part > 0``: read part
    ``part`` of its input) in ``epoch`` once ``counter >= value``."""
    c = int(dep.counter_of_tile[tile]) + part
    return c, epoch * int(dep.need[c])


def fills(dep: Dependency, counter: int, old: int, epoch: int) -> bool:
    """Whether the bump that read ``old`` is the one that fills ``counter`` in ``epoch``."""
    return old + 1 == epoch * int(dep.need[counter])


def slot_value(pos: int, num_tiles: int, tile: int) -> int:
    """Tagged ring value for queue position ``pos``: ``lap * T + tile``, ``lap = pos // T + 1``."""
    return (pos // num_tiles + 1) * num_tiles + tile


def head_base(epoch: int, num_tiles: int, num_ctas: int) -> int:
    """First head value of ``epoch``: each run moves the head by ``T + P``."""
    return (epoch - 1) * (num_tiles + num_ctas)


def bucket_rows(M: int, block_m: int, per_octave: int) -> int:
    """The row count of the plan that serves inputs of ``M`` rows: ``M`` itself when
    ``per_octave`` is 0; else ``M`` rounded up to whole row-blocks, and above 8 row-blocks to
    the next of ``per_octave`` sizes per octave (``2^k * (1 + i / per_octave)``, whole
    row-blocks). A serving loop whose row count varies then builds a few plans per octave
    (4 per octave: 8 for 2049-8192 rows, 2048 being a height of its own) and computes at most ``1 / per_octave`` more
    rows than it needs (the extra rows read zeros and are not written)."""
    if not isinstance(per_octave, int) or per_octave < 0 or per_octave & (per_octave - 1):
        # a power of two: every size is then whole row-blocks, and a size is its own bucket
        raise ValueError(f"per_octave must be 0 or a power of two, got {per_octave!r}")
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    if per_octave == 0:
        return M
    blocks = -(-M // block_m)
    if blocks <= 8:
        return blocks * block_m
    base = 1 << (blocks.bit_length() - 1)  # the octave [base, 2 * base) of row-blocks
    step = -(-(blocks - base) * per_octave // base)  # the first size of the octave >= blocks
    return -(-(base * per_octave + step * base) // per_octave) * block_m
