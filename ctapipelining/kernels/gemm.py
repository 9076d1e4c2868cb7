"""Persistent TMA GEMM with CTA-pipelining hooks, and its configurations.

``C[M, N] = A[M, K] @ B[K, N]`` (bf16/fp16 in and out, fp32 accumulate). A and B are read
with TMA descriptors (out-of-bounds rows and columns read as zero, so no size needs to divide
a block); C is written with masked stores through a plain pointer or with a TMA store, either
of which may point into another GPU's memory.

Each CTA loops over tiles (persistent). Two constexpr hooks wrap the compute body
(:func:`_mma_tile`):

* ``WAIT_INPUT`` (prologue): choose the next tile by policy and wait until its input rows are
  written: ``QUEUE`` claims ring positions in readiness order, otherwise the CTA walks the
  tile order and waits on each tile's counter;
* ``SIGNAL_OUTPUT`` (epilogue): publish the stored tile to the next stage's scoreboard and,
  under ``QUEUE``, push newly ready consumer tiles.

A producer may signal a stored tile right after its store, or a quarter into its next tile's
K loop, once the writes have drained (``GemmConfig.signal``; see :func:`_epilogue`). A static
consumer may wait for its input rows in parts (``GemmConfig.wait_parts``): part 0 before the
tile, part ``q`` inside the K loop a pipeline depth before the first step that reads it
(:func:`_part_step`). Those are the places the hooks reach into the K loop, each a branch at one
step. With both hooks off the branches vanish at compile time and the kernel is the plain
persistent GEMM.

``SPLIT_TAIL`` (:func:`_split_tail`, :class:`ctapipelining.deps.TailSplit`) changes the schedule,
not the protocol: the persistent loop runs the full rounds, and the partial last round's tiles
are computed as K-slices by the CTAs that would otherwise idle, then summed in a fixed order.
"""

import dataclasses
from dataclasses import dataclass

import triton
import triton.language as tl

from .sync import (
    bulk_store_wait,
    claim,
    cta_barrier,
    fence_proxy_async,
    globaltimer,
    signal_tile,
    wait_on,
    wait_slot,
)

# When a producer signals a stored tile (see _epilogue); GemmConfig.signal names them.
SIGNAL_NOW, SIGNAL_NEXT_TILE, SIGNAL_IN_LOOP = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SIGNAL_MODES = {"now": SIGNAL_NOW.value, "next_tile": SIGNAL_NEXT_TILE.value, "in_loop": SIGNAL_IN_LOOP.value}


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration.

    ``group_m``: row-blocks per group of the tile order (1 = row-major; see
    :func:`ctapipelining.deps.tile_order` for why it matters to a producer). ``num_stages``:
    TMA pipeline depth. ``flatten`` / ``warp_specialize``: Triton's options for the persistent
    ``for`` loop (plain and ``static`` kernels; the ``workqueue`` consumer loop is dynamic;
    a signalling kernel runs without warp specialisation: its CTA barrier needs every warp;
    so does a waiting one: its TMA loads must follow the wait in the issuing thread's order).
    ``tma_store``: write each tile with an asynchronous TMA store (else ordinary stores).
    ``signal``: when a producer signals a stored tile: ``"now"``, ``"next_tile"`` (TMA store,
    loop not flattened) or ``"in_loop"`` (see :func:`ctapipelining.kernels.gemm._epilogue`).
    ``split_tail``: split the partial last round's tiles along K over the CTAs it leaves idle,
    slices of at least ``tail_slice_k`` K-steps (:class:`ctapipelining.deps.TailSplit`; plain
    and ``static`` kernels and producers; a ``workqueue`` consumer's order is dynamic).
    ``wait_parts``: a ``static`` consumer waits for its input rows in this many pieces of the
    producer's columns, each just before the K-steps that read it, so a tile starts while its
    rows' right-hand columns are still being written (1: the whole row-block before the tile;
    :func:`ctapipelining.deps.build_dependency`, :func:`_part_step`). A ``workqueue``
    consumer takes whole tiles once ready, so a pipeline gives it one part.
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 1
    num_stages: int = 3
    num_warps: int = 8
    flatten: bool = False
    warp_specialize: bool = False
    tma_store: bool = False
    signal: str = "now"
    split_tail: bool = False
    tail_slice_k: int = 16
    wait_parts: int = 1

    def __post_init__(self):
        if self.signal not in SIGNAL_MODES:
            raise ValueError(f"GemmConfig.signal must be one of {sorted(SIGNAL_MODES)}, got {self.signal!r}")
        if self.signal == "next_tile" and not self.tma_store:
            raise ValueError("GemmConfig(signal='next_tile') needs tma_store=True (it waits on bulk-store groups)")
        if self.signal == "next_tile" and self.flatten:
            # 2x H200 (benchmarks/results/2026-11-30-h200x2-s3/next-tile): with Triton 3.6's flattened
            # loop every CTA's last tile was signalled twice, so counters ran ahead of the data
            raise ValueError("GemmConfig(signal='next_tile') needs flatten=False (flattened, it signals tiles twice)")
        if self.split_tail and self.signal == "next_tile":
            # its failures (2026-11-30-h200x2-s3/replay-trace) were flattened runs; unflattened: not run
            raise ValueError("GemmConfig(split_tail=True) does not support signal='next_tile'")
        if self.tail_slice_k < 1:
            raise ValueError(f"GemmConfig.tail_slice_k must be >= 1, got {self.tail_slice_k}")
        if not isinstance(self.wait_parts, int) or self.wait_parts < 1:
            raise ValueError(f"GemmConfig.wait_parts must be an int >= 1, got {self.wait_parts!r}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        loads = self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes
        return loads + (self.block_m * self.block_n * elem_bytes if self.tma_store else 0)


SMEM_LIMIT = 227 * 1024  # Hopper, per CTA
TRACE_FIELDS = tl.constexpr(5)  # per tile: wait begun, compute begun, stored, epilogue done, CTA

# Defaults chosen by measurement on 2x H200 at X[16384, 8192] @ [8192, 8192], interleaved runs
# (benchmarks/results/2026-11-30-h200x2/tune1.json, tune2.json; 2026-11-30-h200x2-s2/tune-a..e):
# - plain GEMM: grouped order (B reused in L2), TMA-store epilogue, flattened persistent loop:
#   0.90-0.95x cuBLAS in tune-a..d (flatten: 1-5% faster than without in each of them).
# - pipeline: groups of 4 row-blocks (128 tiles, about one wave of 132 CTAs, so each wave
#   completes consumer row-blocks), each tile signalled a quarter
#   into the CTA's next tile (tune-c: producer alone 3.280 ms = the plain GEMM's 3.286; signalling
#   right after the store: 3.396; whole chain 3.414 vs 3.600 ms), flattened loop (tune-d: 3.329
#   vs 3.378 ms). TMA-store producers: 1% slower in tune-c (signalled right after the store),
#   then faster in every later run, paired per repetition over the whole chain: 0.980 (tune-d),
#   0.988 (tune-g), 0.995 (final), 0.994 (final-check), 0.980 (s3/split-tail), 0.992
#   (s3/final-variants): the default since session 3 (their writes into the peer are
#   asynchronous bulk copies; ordinary stores hold the CTA until issued).
# - split tail (2026-11-30-h200x2-s3/split-tail): the plain GEMM 1.9% faster (paired over 25
#   interleaved repetitions, 0.981x [0.961-0.998]: faster in every one; 0.983x and 0.981x in
#   final-variants and next-tile), so on by default there.
#   In the chain it bought nothing (static 0.999x, TMA-store producers 1.007x, paired): off in
#   PIPELINE_CONFIG.
# - waiting in parts (2026-11-30-h200x2-s4/tune-parts, 25 interleaved repetitions, paired):
#   a static consumer waiting for its rows in 2 / 4 / 8 parts ran the chain 0.976x / 0.951x /
#   0.948x the whole-row-block wait; 8 vs 4 parts 0.997x (faster in 18 of 25). The consumer's
#   tiles are faster than the producer's (which write into the peer), so it catches up and
#   each round of it used to start only when a whole group of row-blocks was written.
PLAIN_CONFIG = GemmConfig(
    128, 256, 64, group_m=8, num_stages=3, num_warps=8, flatten=True, tma_store=True, split_tail=True
)
PIPELINE_CONFIG = GemmConfig(
    128, 256, 64, group_m=4, num_stages=3, num_warps=8, flatten=True, tma_store=True, signal="in_loop", wait_parts=8
)
# - both ends filled (Pipeline(ends="balanced"): a prefill on the second GPU, a drain on the first):
#   512 + 512 rows took 0.982x / 0.991x / 0.985x the chain without ends with split tails and
#   1.000x / 1.002x / 0.989x without them (2026-11-30-h200x2-s6/e1, e2, e3, paired over 30
#   repetitions), and only with them did larger prefills pay: the drain leaves the consumer a last
#   round of 8 tiles and a prefill a partial round, each a full round's time unless split.
ENDS_CONFIG = dataclasses.replace(PIPELINE_CONFIG, split_tail=True)

CONFIGS = [
    PLAIN_CONFIG,
    PIPELINE_CONFIG,
    GemmConfig(128, 256, 64, 8, 3, 8, tma_store=True),
    GemmConfig(128, 256, 64, 8, 3, 8, warp_specialize=True),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(64, 128, 64, 1, 4, 4),
]


def get_configs(elem_bytes: int = 2) -> list[GemmConfig]:
    """The configurations that fit in shared memory."""
    return [c for c in CONFIGS if c.smem_bytes(elem_bytes) <= SMEM_LIMIT]


@triton.jit
def tile_of_position(pos, num_m, num_n, GROUP_M: tl.constexpr):
    """Row-major tile id at position ``pos`` of the grouped order (== deps.grouped_tile)."""
    per_group = GROUP_M * num_n
    first_m = (pos // per_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pm = first_m + (pos % per_group) % size_m
    pn = (pos % per_group) // size_m
    return pm * num_n + pn


@triton.jit
def _signal_pending(
    pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
    consumer_tiles, TMA_STORE: tl.constexpr, QUEUE: tl.constexpr, PUSH_BLOCK: tl.constexpr,
    MAX_SIGNALS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Signal the stored tile ``pending`` (-1: none; TMA: once its bulk store completed). Returns -1."""
    if pending >= 0:
        if TMA_STORE:
            bulk_store_wait(0, INTERPRET)
        signal_tile(
            pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
            consumer_tiles, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
        )  # fmt: skip
    return pending * 0 - 1


@triton.jit
def _part_step(q, part_cols, part_block, BLOCK_K: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr):
    """K-step at which a consumer waits for part ``q`` of its input rows (the producer's
    column-blocks ``[q * part_cols // WAIT_PARTS, ...)``, ``part_block`` columns each; see
    :func:`ctapipelining.deps.part_columns`): ``WAIT_AHEAD`` (the pipeline depth) steps before
    the first step that reads it, because the software pipeline issues a step's TMA loads
    ``num_stages - 1`` steps early. -1: the part is read so soon that it is waited for
    before the tile."""
    first = (q * part_cols // WAIT_PARTS) * part_block // BLOCK_K
    return tl.maximum(first - WAIT_AHEAD, -1)


@triton.jit
def _wait_parts(
    in_counters, c0, in_need, tile, epoch, part_cols, part_block, err_ptr, stage, timeout_ns, alive,
    ALL: tl.constexpr, BLOCK_K: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Before a tile: wait for part 0 of its input (counter ``c0``) and for every part read
    before the K loop can wait for it (``ALL``: every part). Returns whether the tile may run."""
    for q in tl.static_range(WAIT_PARTS):
        if ALL or q == 0 or _part_step(q, part_cols, part_block, BLOCK_K, WAIT_PARTS, WAIT_AHEAD) < 0:
            if alive:
                alive = wait_on(in_counters, c0 + q, in_need, tile, epoch, err_ptr, stage, timeout_ns, INTERPRET)
    return alive


@triton.jit
def _mma_tile(
    a_desc, b_desc, pm, pn, k_begin, k_tiles, signal_at, pending, epoch, counters, signal_ptr, signal_counters, need,
    push_ptr, push_tiles, slots, tail, consumer_tiles, tile, ok, in_counters, c0, in_need, part_cols, part_block,
    err_ptr, stage, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SIGNAL_IN_LOOP: tl.constexpr,
    TMA_STORE: tl.constexpr, QUEUE: tl.constexpr, PUSH_BLOCK: tl.constexpr,
    MAX_SIGNALS: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The compute body: one output tile (K-steps ``[k_begin, k_tiles)``: all of K but in a
    split tail), fp32 accumulator. Two hooks may reach into the K loop, each a branch at one
    step: under ``SIGNAL_IN_LOOP`` the previous tile (``pending``) is signalled at step
    ``signal_at``, by when its writes have drained; with ``WAIT_PARTS > 1`` a consumer waits
    for part ``q`` of its input rows (counter ``c0 + q``) at step :func:`_part_step` (a
    timed-out wait clears ``ok`` and the tile is neither stored nor signalled). Otherwise
    the loop is the plain GEMM's. Returns ``(acc, pending, ok)``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_begin, k_tiles):
        a = a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
        b = b_desc.load([ki * BLOCK_K, pn * BLOCK_N])
        acc = tl.dot(a, b, acc)
        if SIGNAL_IN_LOOP:
            if ki == signal_at:
                pending = _signal_pending(
                    pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
                    consumer_tiles, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
                )  # fmt: skip
        for q in tl.static_range(1, WAIT_PARTS):
            if ki == _part_step(q, part_cols, part_block, BLOCK_K, WAIT_PARTS, WAIT_AHEAD):
                if ok:
                    ok = wait_on(in_counters, c0 + q, in_need, tile, epoch, err_ptr, stage, timeout_ns, INTERPRET)
                    fence_proxy_async(INTERPRET)  # the acquire before the TMA reads of that part
    return acc, pending, ok


@triton.jit
def _store_tile(
    c_desc, c_ptr, acc, pm, pn, M, N, stride_cm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA_STORE: tl.constexpr
):  # fmt: skip
    """Write tile (pm, pn) of C: an asynchronous TMA store, or masked ordinary stores."""
    if TMA_STORE:
        c_desc.store([pm * BLOCK_M, pn * BLOCK_N], acc.to(c_desc.dtype))
    else:
        offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _compute_store(
    a_desc, b_desc, c_desc, c_ptr, tile, pending, num_n, M, N, k_tiles, stride_cm, epoch, counters, signal_ptr,
    signal_counters, need, push_ptr, push_tiles, slots, tail, consumer_tiles, ok, in_counters, c0, in_need,
    part_cols, part_block, err_ptr, stage, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SIGNAL_IN_LOOP: tl.constexpr,
    TMA_STORE: tl.constexpr, QUEUE: tl.constexpr, PUSH_BLOCK: tl.constexpr,
    MAX_SIGNALS: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The compute body for one tile, then its store (TMA: asynchronous) unless a part of its
    input timed out. Returns ``(tile still to signal, ok)`` (``SIGNAL_IN_LOOP`` signals the
    previous one a quarter into the K loop)."""
    pm = tile // num_n
    pn = tile % num_n
    acc, pending, ok = _mma_tile(
        a_desc, b_desc, pm, pn, 0, k_tiles, k_tiles // 4, pending, epoch, counters, signal_ptr, signal_counters, need,
        push_ptr, push_tiles, slots, tail, consumer_tiles, tile, ok, in_counters, c0, in_need, part_cols, part_block,
        err_ptr, stage, timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K,
        SIGNAL_IN_LOOP, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, WAIT_PARTS, WAIT_AHEAD, INTERPRET,
    )  # fmt: skip
    if ok:
        _store_tile(c_desc, c_ptr, acc, pm, pn, M, N, stride_cm, BLOCK_M, BLOCK_N, TMA_STORE)
    return pending, ok


@triton.jit
def _epilogue(
    tile, pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
    consumer_tiles, SIGNAL_OUTPUT: tl.constexpr, SIGNAL_WHEN: tl.constexpr, TMA_STORE: tl.constexpr,
    QUEUE: tl.constexpr, PUSH_BLOCK: tl.constexpr, MAX_SIGNALS: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Signal-output hook after ``tile``'s store; returns the tile stored but not yet
    signalled (-1: none). A tile is signalled once its writes are complete (``SIGNAL_WHEN``):

    * ``SIGNAL_NOW``: here (a TMA store is waited for first);
    * ``SIGNAL_NEXT_TILE`` (TMA store): in the CTA's next epilogue, once every bulk store but
      the newest completed: the write drains while the next tile computes, but consumers
      hear of it a whole tile later;
    * ``SIGNAL_IN_LOOP``: a quarter into the CTA's next K loop (:func:`_mma_tile`): the write
      has drained by then, so waiting for it costs nothing, and consumers hear of it a
      quarter tile later.

    A CTA's last tile is signalled after its loop (:func:`_flush`).
    """
    if SIGNAL_OUTPUT:
        if SIGNAL_WHEN == SIGNAL_NEXT_TILE:
            bulk_store_wait(1, INTERPRET)
            if pending >= 0:
                signal_tile(
                    pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
                    consumer_tiles, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
                )  # fmt: skip
            pending = tile
        elif SIGNAL_WHEN == SIGNAL_IN_LOOP:
            pending = tile
        else:
            pending = _signal_pending(
                tile, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
                consumer_tiles, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
            )  # fmt: skip
    return pending


@triton.jit
def _flush(
    pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
    consumer_tiles, SIGNAL_OUTPUT: tl.constexpr, TMA_STORE: tl.constexpr, QUEUE: tl.constexpr,
    PUSH_BLOCK: tl.constexpr, MAX_SIGNALS: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """After the loop: signal the CTA's last tile if it is still pending."""
    if SIGNAL_OUTPUT:
        _signal_pending(
            pending, epoch, counters, signal_ptr, signal_counters, need, push_ptr, push_tiles, slots, tail,
            consumer_tiles, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
        )  # fmt: skip


@triton.jit
def _now(TRACE: tl.constexpr):
    """``%globaltimer`` when tracing, else nothing (the stamp compiles away)."""
    if TRACE:
        return globaltimer()
    else:
        return 0


@triton.jit
def _record(trace_ptr, tile, t_wait, t_start, t_stored, TRACE: tl.constexpr):
    """Trace row of ``tile``: wait begun, compute begun, stored, epilogue done, CTA."""
    if TRACE:
        row = trace_ptr + tile.to(tl.int64) * TRACE_FIELDS
        tl.store(row + 0, t_wait)
        tl.store(row + 1, t_start)
        tl.store(row + 2, t_stored)
        tl.store(row + 3, globaltimer())
        tl.store(row + 4, tl.program_id(0).to(tl.int64))


@triton.jit
def _process_tile(
    a_desc, b_desc, c_desc, c_ptr, tile, pending, t_wait, num_n, M, N, k_tiles, stride_cm, epoch,
    out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles, out_slots, out_tail,
    consumer_tiles, trace_ptr, ok, in_counters, c0, in_need, part_cols, part_block, err_ptr, stage, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WAIT_INPUT: tl.constexpr,
    SIGNAL_OUTPUT: tl.constexpr, SIGNAL_WHEN: tl.constexpr, QUEUE: tl.constexpr,
    PUSH_BLOCK: tl.constexpr, MAX_SIGNALS: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr,
    TMA_STORE: tl.constexpr, TRACE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One tile whose input is ready (with ``WAIT_PARTS > 1``: its first part): proxy fence
    (its input came through the generic proxy), compute and store, epilogue hook, trace row.
    Returns ``(tile still to signal, ok)``; ``ok`` is False when a later part timed out."""
    if WAIT_INPUT:
        fence_proxy_async(INTERPRET)
    t_start = _now(TRACE)
    pending, ok = _compute_store(
        a_desc, b_desc, c_desc, c_ptr, tile, pending, num_n, M, N, k_tiles, stride_cm, epoch, out_counters,
        out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles, out_slots, out_tail,
        consumer_tiles, ok, in_counters, c0, in_need, part_cols, part_block, err_ptr, stage, timeout_ns,
        BLOCK_M, BLOCK_N, BLOCK_K, SIGNAL_OUTPUT and SIGNAL_WHEN == SIGNAL_IN_LOOP, TMA_STORE, QUEUE,
        PUSH_BLOCK, MAX_SIGNALS, WAIT_PARTS, WAIT_AHEAD, INTERPRET,
    )  # fmt: skip
    if ok:
        t_stored = _now(TRACE)
        pending = _epilogue(
            tile, pending, epoch, out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr,
            out_push_tiles, out_slots, out_tail, consumer_tiles,
            SIGNAL_OUTPUT, SIGNAL_WHEN, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, INTERPRET,
        )  # fmt: skip
        _record(trace_ptr, tile, t_wait, t_start, t_stored, TRACE)
    return pending, ok


@triton.jit
def _split_tail(
    a_desc, b_desc, c_desc, c_ptr, tail_ws, tail_counters, tail_first, tail_splits, num_m, num_n, M, N, k_tiles,
    stride_cm, epoch, alive, in_counters, in_counter_of_tile, in_need, out_counters, out_signal_ptr,
    out_signal_counters, out_need, out_push_ptr, out_push_tiles, out_slots, out_tail, consumer_tiles, err_ptr,
    stage, timeout_ns, trace_ptr, part_cols, part_block,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    WAIT_INPUT: tl.constexpr, SIGNAL_OUTPUT: tl.constexpr, QUEUE: tl.constexpr, PUSH_BLOCK: tl.constexpr,
    MAX_SIGNALS: tl.constexpr, WAIT_PARTS: tl.constexpr, WAIT_AHEAD: tl.constexpr, TMA_STORE: tl.constexpr,
    TRACE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """After the full rounds: this CTA's slice of the split tail (:class:`ctapipelining.deps.TailSplit`).

    CTA ``i`` computes K-slice ``i % tail_splits`` of tail tile ``j = i // tail_splits`` (after
    waiting for its input, in a consumer: every part of it) and stores the fp32 partial in ``tail_ws`` (slot
    ``i``). Ordering: every thread's partial stores, a CTA barrier, then one thread's
    ``atom.add.acq_rel.gpu`` on the tile's arrival counter (release: the partials before the
    count). The CTA that brings the count to ``tail_splits`` has acquired every other slice's
    release; after a second barrier its threads read all partials from L2 (``.cg``), add them
    in slice order (so the sum does not depend on who came last), store and signal the tile,
    and set the counter back to 0 for the next launch.
    """
    item = tl.program_id(0)
    j = item // tail_splits
    if (tail_first + j < num_m * num_n) & alive:  # items past tiles * splits have no slice
        part = item % tail_splits
        tile = tile_of_position(tail_first + j, num_m, num_n, GROUP_M)
        t_wait = _now(TRACE)
        ready = True
        if WAIT_INPUT:
            ready = _wait_parts(
                in_counters, tl.load(in_counter_of_tile + tile), in_need, tile, epoch, part_cols, part_block, err_ptr,
                stage, timeout_ns, tl.program_id(0) >= 0, True, BLOCK_K, WAIT_PARTS, WAIT_AHEAD, INTERPRET,
            )  # fmt: skip
        if ready:
            if WAIT_INPUT:
                fence_proxy_async(INTERPRET)
            t_start = _now(TRACE)
            pm = tile // num_n
            pn = tile % num_n
            acc, _, _ = _mma_tile(
                a_desc, b_desc, pm, pn, part * k_tiles // tail_splits, (part + 1) * k_tiles // tail_splits, -1, -1,
                epoch, out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles,
                out_slots, out_tail, consumer_tiles, tile, True, in_counters, 0, in_need, 0, 1, err_ptr, stage,
                timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K, False, TMA_STORE, QUEUE, PUSH_BLOCK, MAX_SIGNALS, 1, 0,
                INTERPRET,
            )  # fmt: skip
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            partials = tail_ws + (j * tail_splits).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(partials + part * (BLOCK_M * BLOCK_N) + offs, acc)
            cta_barrier(INTERPRET)  # every thread's partial before thread 0's release
            arrived = tl.atomic_add(tail_counters + j, 1, sem="acq_rel", scope="gpu") + 1
            if arrived == tail_splits:
                tl.atomic_xchg(tail_counters + j, 0, sem="relaxed", scope="gpu")  # all slices are in: rearm
                cta_barrier(INTERPRET)  # thread 0's acquire before every thread's reads
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in range(tail_splits):
                    acc += tl.load(partials + p * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
                _store_tile(c_desc, c_ptr, acc, pm, pn, M, N, stride_cm, BLOCK_M, BLOCK_N, TMA_STORE)
                t_stored = _now(TRACE)
                if SIGNAL_OUTPUT:
                    _signal_pending(
                        tile, epoch, out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr,
                        out_push_tiles, out_slots, out_tail, consumer_tiles, TMA_STORE, QUEUE, PUSH_BLOCK,
                        MAX_SIGNALS, INTERPRET,
                    )  # fmt: skip
                _record(trace_ptr, tile, t_wait, t_start, t_stored, TRACE)


@triton.jit(do_not_specialize=["stage", "timeout_ns", "consumer_tiles", "tail_first", "tail_splits", "part_cols"])
def gemm_kernel(
    a_desc,
    b_desc,
    c_desc,
    c_ptr,
    # wait-for-input hook: this stage's scoreboard and ring (local memory)
    in_counters,
    in_counter_of_tile,
    in_need,
    in_slots,
    in_head,
    # signal-output hook: the next stage's scoreboard and ring (its GPU's memory)
    out_counters,
    out_signal_ptr,
    out_signal_counters,
    out_need,
    out_push_ptr,
    out_push_tiles,
    out_slots,
    out_tail,
    epoch_ptr,
    err_ptr,
    trace_ptr,
    # split tail: fp32 partials [tiles * splits, BLOCK_M * BLOCK_N], arrival counter per tail tile
    tail_ws,
    tail_counters,
    M,
    N,
    k_tiles,
    stride_cm,
    consumer_tiles,
    stage,
    timeout_ns,
    tail_first,
    tail_splits,
    # wait in parts: the producer's column-blocks and their width (see _part_step)
    part_cols,
    part_block,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_CTAS: tl.constexpr,
    WAIT_INPUT: tl.constexpr,
    WAIT_PARTS: tl.constexpr,
    WAIT_AHEAD: tl.constexpr,
    SIGNAL_OUTPUT: tl.constexpr,
    QUEUE: tl.constexpr,
    SIGNAL_WHEN: tl.constexpr,
    PUSH_BLOCK: tl.constexpr,
    MAX_SIGNALS: tl.constexpr,
    TMA_STORE: tl.constexpr,
    FLATTEN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
    SPLIT_TAIL: tl.constexpr,
    TRACE: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tl.static_assert(not (SPLIT_TAIL and WAIT_INPUT and QUEUE), "a workqueue consumer runs tiles in readiness order")
    tl.static_assert(WAIT_PARTS == 1 or (WAIT_INPUT and not QUEUE), "only a static consumer waits in parts")
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    epoch = 0
    if WAIT_INPUT or SIGNAL_OUTPUT:
        epoch = tl.load(epoch_ptr)
    pending = tl.program_id(0) * 0 - 1  # tile stored but not yet signalled (TMA store)
    # Without WAIT_INPUT `alive` is the constant True, so the plain GEMM has no branch on it.
    alive = True
    if WAIT_INPUT:
        alive = tl.program_id(0) >= 0
    if WAIT_INPUT and QUEUE:
        # workqueue: claim ring positions until past this run's tiles; tiles in readiness order
        pos = claim(in_head, epoch, num_tiles, NUM_CTAS)
        while pos < num_tiles:
            t_wait = _now(TRACE)
            tile, ok = wait_slot(in_slots, pos, epoch, num_tiles, err_ptr, stage, timeout_ns, INTERPRET)
            if ok:
                pending, _ = _process_tile(
                    a_desc, b_desc, c_desc, c_ptr, tile, pending, t_wait, num_n, M, N, k_tiles, stride_cm, epoch,
                    out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles,
                    out_slots, out_tail, consumer_tiles, trace_ptr, True, in_counters, 0, in_need, 0, 1, err_ptr,
                    stage, timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K, WAIT_INPUT, SIGNAL_OUTPUT, SIGNAL_WHEN, QUEUE,
                    PUSH_BLOCK, MAX_SIGNALS, 1, 0, TMA_STORE, TRACE, INTERPRET,
                )  # fmt: skip
                pos = claim(in_head, epoch, num_tiles, NUM_CTAS)
            else:
                pos = pos * 0 + num_tiles  # timed out (the CTA as one): recorded in err_ptr; leave
    else:
        # plain or static: walk the tile order (the full rounds only, with a split tail);
        # under WAIT_INPUT wait on each tile's counter (in parts: the first before the tile).
        loop_end = num_tiles
        if SPLIT_TAIL:
            loop_end = tail_first
        for pos in tl.range(tl.program_id(0), loop_end, NUM_CTAS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            tile = tile_of_position(pos, num_m, num_n, GROUP_M)
            t_wait = _now(TRACE)
            c0 = 0
            if WAIT_INPUT:
                c0 = tl.load(in_counter_of_tile + tile)
                # after a timeout the CTA skips its remaining tiles (alive stays False)
                alive = _wait_parts(
                    in_counters, c0, in_need, tile, epoch, part_cols, part_block, err_ptr, stage, timeout_ns, alive,
                    False, BLOCK_K, WAIT_PARTS, WAIT_AHEAD, INTERPRET,
                )  # fmt: skip
            if alive:
                pending, ok = _process_tile(
                    a_desc, b_desc, c_desc, c_ptr, tile, pending, t_wait, num_n, M, N, k_tiles, stride_cm, epoch,
                    out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles,
                    out_slots, out_tail, consumer_tiles, trace_ptr, alive, in_counters, c0, in_need, part_cols,
                    part_block, err_ptr, stage, timeout_ns, BLOCK_M, BLOCK_N, BLOCK_K, WAIT_INPUT, SIGNAL_OUTPUT,
                    SIGNAL_WHEN, QUEUE, PUSH_BLOCK, MAX_SIGNALS, WAIT_PARTS, WAIT_AHEAD, TMA_STORE, TRACE, INTERPRET,
                )  # fmt: skip
                if WAIT_INPUT:
                    alive = ok
    _flush(
        pending, epoch, out_counters, out_signal_ptr, out_signal_counters, out_need, out_push_ptr, out_push_tiles,
        out_slots, out_tail, consumer_tiles, SIGNAL_OUTPUT, TMA_STORE, QUEUE, PUSH_BLOCK,
        MAX_SIGNALS, INTERPRET,
    )  # fmt: skip
    if SPLIT_TAIL:
        _split_tail(
            a_desc, b_desc, c_desc, c_ptr, tail_ws, tail_counters, tail_first, tail_splits, num_m, num_n, M, N,
            k_tiles, stride_cm, epoch, alive, in_counters, in_counter_of_tile, in_need, out_counters, out_signal_ptr,
            out_signal_counters, out_need, out_push_ptr, out_push_tiles, out_slots, out_tail, consumer_tiles, err_ptr,
            stage, timeout_ns, trace_ptr, part_cols, part_block, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, WAIT_INPUT,
            SIGNAL_OUTPUT, QUEUE, PUSH_BLOCK, MAX_SIGNALS, WAIT_PARTS, WAIT_AHEAD, TMA_STORE, TRACE, INTERPRET,
        )  # fmt: skip
