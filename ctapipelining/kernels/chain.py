"""One persistent kernel over the stages that share a GPU (a *chain kernel*).

Stages ``s0 .. s0 + S - 1`` of a chain on one GPU (``S <= MAX_STAGES``) run in one launch,
from one *combined tile order* (:func:`ctapipelining.deps.chain_order`, a plan-time table):
each stage's tiles in its own grouped order, a later stage's tiles placed about one round of the
grid after the rows they read (or, on request, stage after stage).
Each CTA claims the next position from an atomic *ticket* and runs that tile with its
stage's body; a tile of a later stage first waits on its counters (the same dependency
arrays and counters as a link between GPUs, in this GPU's memory), so a consumer tile starts
as soon as its input rows are written and fills the SMs its producer leaves idle. For
``X[640, 8192] @ A @ B`` (160 tiles a layer on 132 SMs) that is three rounds of tiles where
two kernels one after the other take four (``docs/design.md``, placement).

No deadlock whatever the number of resident CTAs: a tile only waits for tiles of the stage
before it, which sit at earlier positions, and a position is claimed only by a CTA that is
running; so the earliest unfinished position never waits, and by induction every tile ends.
A CTA signals its tiles late (a quarter into its next tile, :func:`~.gemm._mma_tile`), so
before it waits on a tile of a later stage it signals the tile it still holds.

The first stage may wait on a previous GPU, and the last may signal a next one, exactly as a
stage of :func:`~.gemm.gemm_kernel` does (``QUEUE``: those links follow the workqueue
policy; the ticket's position of a first-stage tile is then its ring position). The links
inside the kernel always wait on counters (``static``), in parts (``Wait.PARTS``).

With a split tail (:class:`~.gemm.Tail`, the host's ``chain_tail_split``), the combined order's
partial last round, when it lies within the last stage, is cut into K-slices: each of its tiles
becomes ``splits`` positions, claimed from the ticket like the others, each run as an item of
:func:`~.gemm._split_tail` (after waiting for every part of the tile's input; the CTA that
brings a tile's last slice sums them in slice order, applies the last stage's epilogue, stores
and signals it), so the last round takes a fraction of a tile time where whole tiles would take
one. The kernel then holds the last stage's body twice: ``ptxas -v`` (sm_90a) gives two
128x256 stages 255 registers and 8 bytes of spills with it, 202 and none without. It pays where
the last round is partial and short: two 8192-wide stages at 640 rows ran 0.93-0.94x the unsplit
chain, and within 1% of it at the other heights (``benchmarks/shared_gpu.py``'s ``chain_split``
line on 128 x 256 tiles, ``benchmarks/results/2026-12-01-h200-configs/run6-table/`` and
``run11-parts/``); the pipeline table, measured per tile shape, splits at 128 and 640 rows.

The ticket only grows, like the counters: each CTA of the grid (whatever its size) claims a fixed
number of times, one more than an even share of the positions (so its loop has a trip count, and
a fast CTA may take an extra tile from a slow one), so a run moves it by ``grid * trips`` and run
``epoch``'s positions are the claims past ``(epoch - 1) * grid * trips`` (int64: no wrap). Every
CTA claims its full count also after a timeout (it skips the tiles), so the count never goes
wrong; a claim outside the run's (a ticket out of step with the epoch: buffers overwritten, a
kernel that never ended) is reported (``KIND_TICKET``) and the CTA runs nothing more. A ``for``
loop with a trip count rather than a loop
until the ticket runs out: Triton then keeps the TMA store's staging buffer apart from the
load ring, so a tile's store overlaps the next tile's loads (two 8192-wide stages on one H200
at 16384 rows ran 0.988x as long as with a loop until the ticket runs out;
``benchmarks/results/2026-12-01-h200-chain/``).
"""

from typing import NamedTuple

import triton
import triton.language as tl

from .gemm import (
    Operands,
    Protocol,
    _now,
    _poll_before,
    _run_tile,
    _signal_pending,
    _split_tail,
    tile_of_position,
)
from .sync import KIND_TICKET, fence_proxy_async, report_timeout, wait_slot

STAGE_SHIFT: tl.constexpr = tl.constexpr(24)  # the combined order's code: stage << STAGE_SHIFT | position (deps)
POSITION_MASK: tl.constexpr = tl.constexpr((1 << 24) - 1)

MAX_STAGES = 4  # stages one chain kernel runs (the kernel takes their descriptors one by one)


class Stage(NamedTuple):
    """One stage's kernel arguments in a chain kernel (its TMA descriptors are the kernel's
    own arguments, where Triton's launcher expands them)."""

    N: object  # the stage's output columns (its rows are the kernel's M)
    k_tiles: object  # K-steps of its K loop
    wait: object  # sync.Wait: its input link (None: its input is ready before the launch)
    signal: object  # sync.Signal: its output link (None: the chain's last stage)
    err_ptr: object  # *i64: its error word (the last stage's: also where an inconsistent ticket is reported)
    trace_ptr: object  # *i64 [tiles, TRACE_FIELDS]: per-tile stamps (None: no trace)
    stage: object  # its index in the chain (error words name it)
    epi: object  # its epilogue (.epilogue.Epilogue; all None for none)


@triton.jit
def _span(stage, tail, num_m, LAST: tl.constexpr, BLOCK_N: tl.constexpr):
    """The positions of ``stage`` in the combined order: its tiles, or, for the last stage with
    a split tail, its whole tiles and then each tail tile's ``splits`` K-slices."""
    tiles = num_m * tl.cdiv(stage.N, BLOCK_N)
    if tail is not None and LAST:
        tiles = tail.first + (tiles - tail.first) * tail.splits
    return tiles


@triton.jit
def _flush(
    pending, pending_stage, epoch, stages, c_descs, KEEP: tl.constexpr, S: tl.constexpr, QUEUE: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Signal the CTA's pending tile unless it belongs to stage ``KEEP`` (-1: whatever its
    stage; the last stage's signal may push into a next GPU's ring, ``QUEUE``). Returns the
    pending tile left (-1 if it was signalled)."""
    for t in tl.static_range(S):
        if t != KEEP:
            if stages[t].signal is not None:
                if pending_stage == t:
                    pending = _signal_pending(
                        pending, epoch, stages[t].signal, c_descs[t] is not None, QUEUE and t == S - 1, INTERPRET
                    )  # fmt: skip
    return pending


@triton.jit
def _stage_tile(
    stage, op, pos, num_m, epoch, pending, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    QUEUE_IN: tl.constexpr, QUEUE_OUT: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The tile at position ``pos`` of ``stage`` (a :class:`Stage`; its operands ``op``:
    :class:`~.gemm.Operands`; ``QUEUE_IN``: its input comes through a ring, ``QUEUE_OUT``: its
    signal pushes into one). Returns ``(pending, alive)``: the tile still to signal, and false
    if a wait timed out (CTA-uniform, reported)."""
    num_n = tl.cdiv(stage.N, BLOCK_N)
    prot = Protocol(epoch, stage.err_ptr, stage.stage, timeout_ns, stage.trace_ptr)
    t_wait = _now(stage.trace_ptr)
    alive = tl.program_id(0) >= 0
    if QUEUE_IN:
        # the ring of a link from the previous GPU: the tile that became ready pos-th
        tile, ok = wait_slot(
            stage.wait.slots, pos, epoch, num_m * num_n, stage.err_ptr, stage.stage, timeout_ns, INTERPRET
        )
        if ok:  # CTA-uniform (voted)
            fence_proxy_async(INTERPRET)
            pending, _ = _run_tile(
                op, prot, tile, num_n, stage.signal, pending, None, 0, True, t_wait, stage.epi, BLOCK_M,
                BLOCK_N, BLOCK_K, QUEUE_OUT, INTERPRET,
            )  # fmt: skip
        alive = ok
    else:
        tile = tile_of_position(pos.to(tl.int32), num_m, num_n, GROUP_M)
        counter0 = 0  # the tile's first counter
        ok = True
        if stage.wait is not None:
            counter0 = tl.load(stage.wait.counter_of_tile + tile)
            ok = _poll_before(stage.wait, counter0, epoch, timeout_ns, False, BLOCK_K, INTERPRET)
            fence_proxy_async(INTERPRET)  # this thread's acquire before its TMA reads
        pending, ok = _run_tile(
            op, prot, tile, num_n, stage.signal, pending, stage.wait, counter0, ok, t_wait, stage.epi,
            BLOCK_M, BLOCK_N, BLOCK_K, QUEUE_OUT, INTERPRET,
        )  # fmt: skip
        if stage.wait is not None:
            alive = ok
    return pending, alive


@triton.jit(do_not_specialize=["c_rows", "timeout_ns"])
def chain_kernel(
    a0, b0, c0, a1, b1, c1, a2, b2, c2, a3, b3, c3,  # each stage's A, B, C descriptors (None: no such stage)
    stages, tail,  # tuple of Stage, one per stage; the last stage's split tail (gemm.Tail; None: off)
    M, c_ptr, c_rows, stride_cm,  # the rows of every stage; the last stage's C by ordinary stores (c descriptor None)
    ticket, order, epoch_ptr, timeout_ns,  # *i64 [1] claims, all runs; *i32 the combined order; *i64 [1] runs before
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    QUEUE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The stages of ``stages`` over a persistent grid (any size), tiles claimed in
    the combined order (module docstring)."""
    a_descs = (a0, a1, a2, a3)
    b_descs = (b0, b1, b2, b3)
    c_descs = (c0, c1, c2, c3)
    # the stages present (len(stages) does not compile in Triton 3.6; a stage has an A descriptor)
    S: tl.constexpr = 1 + (a1 is not None) + (a2 is not None) + (a3 is not None)
    num_m = tl.cdiv(M, BLOCK_M)
    tl.static_assert(tail is None or not (S == 1 and QUEUE and stages[0].wait is not None), "a ring has no split tail")
    total = 0  # positions: each stage's tiles (the last stage's tail tiles as their K-slices)
    for s in tl.static_range(S):
        total += _span(stages[s], tail, num_m, s == S - 1, BLOCK_N)
    epoch = tl.load(epoch_ptr) + 1  # this run: the host bumps the count after the launch (sync.py)
    pending = tl.program_id(0) * 0 - 1  # a tile stored but not yet signalled, of stage pending_stage
    pending_stage = pending
    alive = tl.program_id(0) >= 0  # false after a timeout: claim on, run nothing
    # one claim more than an even share of the positions: a loop with a trip count, so Triton keeps
    # the TMA store's staging buffer apart from the load ring (module docstring); each stage's K loop
    # stays a loop of its own, its loads after its waits
    grid = tl.num_programs(0)
    trips = tl.cdiv(total, grid) + 1
    base = (epoch - 1) * grid * trips  # the claims of the runs before this one
    for _ in tl.range(0, trips, flatten=True):
        pos = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu") - base  # one thread; the CTA shares it
        if (pos < 0) | (pos >= grid * trips):  # not this run's: the ticket is out of step with the epoch
            report_timeout(stages[S - 1].err_ptr, stages[S - 1].stage, -1, KIND_TICKET, pos, pos, grid * trips)
            alive = alive & False
        if (pos < total) & alive:  # CTA-uniform
            code = tl.load(order + pos)  # the stage and its own position (deps.chain_order)
            at = code >> STAGE_SHIFT
            q = code & POSITION_MASK
            for s in tl.static_range(S):
                if at == s:
                    # the CTA's tile of another stage is signalled before this one waits (a later
                    # tile may need it) and before this one's signal (each stage signals its own)
                    pending = _flush(pending, pending_stage, epoch, stages, c_descs, s, S, QUEUE, INTERPRET)
                    pending_stage = pending * 0 + s
                    tl.static_assert(c_descs[s] is not None or s == S - 1, "only the last stage stores without TMA")
                    op = Operands(
                        a_descs[s], b_descs[s], c_descs[s], c_ptr, c_rows, stages[s].N, stages[s].k_tiles, stride_cm
                    )
                    queue_in: tl.constexpr = QUEUE and s == 0 and stages[s].wait is not None
                    if tail is not None and s == S - 1:
                        if q >= tail.first:  # a K-slice of a tail tile: the CTA's held tile first
                            if stages[s].signal is not None:  # (pending_stage is s: set above)
                                pending = _signal_pending(
                                    pending, epoch, stages[s].signal, c_descs[s] is not None, QUEUE, INTERPRET
                                )
                            prot = Protocol(epoch, stages[s].err_ptr, stages[s].stage, timeout_ns, stages[s].trace_ptr)
                            alive = _split_tail(
                                op, prot, tail, q - tail.first, num_m,
                                tl.cdiv(stages[s].N, BLOCK_N), alive, stages[s].wait, stages[s].signal, stages[s].epi,
                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, QUEUE, INTERPRET,
                            )  # fmt: skip
                        else:
                            pending, alive = _stage_tile(
                                stages[s], op, q, num_m, epoch, pending, timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K,
                                GROUP_M, queue_in, QUEUE, INTERPRET,
                            )  # fmt: skip
                    else:
                        pending, alive = _stage_tile(
                            stages[s], op, q, num_m, epoch, pending, timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K,
                            GROUP_M, queue_in, QUEUE and s == S - 1, INTERPRET,
                        )  # fmt: skip
    # the CTA's last tile: its stage's signal (the last stage's may cross to the next GPU)
    _flush(pending, pending_stage, epoch, stages, c_descs, -1, S, QUEUE, INTERPRET)
