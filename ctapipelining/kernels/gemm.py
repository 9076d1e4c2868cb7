"""Persistent TMA GEMM with CTA-pipelining hooks, and its configurations.

``C[M, N] = A[M, K] @ B[K, N]`` (bf16/fp16 in and out, fp32 accumulate). A and B are read
with TMA descriptors (out-of-bounds rows and columns read as zero, so no size needs to divide
a block); C is written with an asynchronous TMA store (``c_desc``) or, for an output whose
rows are padded, with masked stores through ``c_ptr``; either may point into another GPU.

Each CTA loops over tiles (persistent). Two hooks, each an argument bundle that is ``None``
when off (so its code vanishes at compile time and the plain GEMM is exactly the plain
persistent GEMM), wrap the compute body (:func:`_mma_tile`):

* ``wait`` (:class:`~ctapipelining.kernels.sync.Wait`, prologue): choose the next tile by
  policy and wait until its input rows are written: ``QUEUE`` claims ring positions in
  readiness order, otherwise the CTA walks the tile order and waits on each tile's counters,
  in ``PARTS`` pieces of its K range: the first before the tile, the others inside the K
  loop a pipeline depth before the first step that reads them (:func:`_part_step`);
* ``signal`` (:class:`~ctapipelining.kernels.sync.Signal`, epilogue): publish the stored tile
  to the next stage's scoreboard (under ``QUEUE``, also push newly ready consumer tiles). A
  tile is signalled a quarter into the CTA's next K loop, when its writes have drained, and a
  CTA's last tile after its loop.

``tail`` (:class:`Tail`, :func:`_split_tail`, :class:`ctapipelining.deps.TailSplit`) changes
the schedule, not the protocol: the persistent loop runs the full rounds, and the partial last
round's tiles are computed as K-slices by the CTAs that would otherwise idle, then summed in a
fixed order (with ``split_k``, fewer tiles than SMs: every tile, on a CTA per slice).
"""

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import triton
import triton.language as tl

from . import epilogue
from .sync import (
    KIND_COUNTER,
    bulk_store_wait,
    claim,
    cta_all,
    cta_barrier,
    fence_proxy_async,
    globaltimer,
    poll_geq,
    report_timeout,
    signal_tile,
    wait_slot,
)


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration: the knobs a user chooses per shape.

    ``block_m`` x ``block_n`` output tiles, ``block_k`` K-steps. ``group_m``: row-blocks per
    group of the tile order (1 = row-major; see :func:`ctapipelining.deps.tile_order` for why
    it matters to a producer). ``num_stages``: TMA pipeline depth. ``num_warps``: warps per CTA.
    ``split_tail``: split the partial last round's tiles along K over the CTAs it leaves idle
    (:class:`ctapipelining.deps.TailSplit`; plain and ``static`` kernels and producers; a
    ``workqueue`` consumer's order is dynamic). ``split_k``: a GEMM of fewer tiles than its
    CTAs, one partial round, runs every tile as K-slices too, on a CTA per slice (split-K, for
    few rows, where the weights' bandwidth bounds the time; :func:`ctapipelining.gemm.launch_grid`;
    ``workqueue`` consumers and chain kernels' stages excepted). Off in the measured tables (the
    plain GEMM's few-rows tiles, split, lost at 16 and 64 rows); on in
    :data:`ctapipelining.nn.FEW_ROWS_CONFIGS`.
    ``wait_parts``: a ``static`` consumer waits for its input rows in this many pieces of the
    producer's columns, each just before the K-steps that read it, so a tile starts while its
    rows' right-hand columns are still being written (1: the whole row-block before the tile;
    :func:`ctapipelining.deps.build_dependency`, :func:`_part_step`). A ``workqueue`` consumer
    takes whole tiles once ready, so a pipeline gives it one part.

    Always on, where they apply: TMA stores (an output with padded rows takes ordinary
    stores), the flattened persistent loop, a producer signalling each tile a quarter into its
    next tile's K loop (see :data:`PLAIN_CONFIG` for the measurements).
    """

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 1
    num_stages: int = 3
    num_warps: int = 8
    split_tail: bool = False
    wait_parts: int = 1
    split_k: bool = False

    def __post_init__(self):
        for name in ("split_tail", "split_k"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemmConfig.{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("block_m", "block_n", "block_k", "group_m", "num_stages", "num_warps", "wait_parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GemmConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value & (value - 1):
                raise ValueError(f"GemmConfig.{name} must be a power of two, got {value}")
        for name in ("block_m", "block_n", "block_k"):  # tl.dot's least, and TMA's 16-byte rows
            if getattr(self, name) < 16:
                raise ValueError(f"GemmConfig.{name} must be at least 16, got {getattr(self, name)}")

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        """Shared memory a CTA needs: the TMA load ring and the TMA store's staging tile."""
        loads = self.num_stages * (self.block_m + self.block_n) * self.block_k * elem_bytes
        return loads + self.block_m * self.block_n * elem_bytes


SMEM_LIMIT = 227 * 1024  # Hopper, per CTA
TRACE_FIELDS = tl.constexpr(5)  # per tile: wait begun, compute begun, stored, epilogue done, CTA

# Defaults chosen by measurement on 2x H200 at X[16384, 8192] @ [8192, 8192], interleaved runs
# (benchmarks/results/2026-11-30-h200x2-protocol/, -tails/, -parts/, -ends/; each folder's README):
# - plain GEMM: grouped order (B reused in L2), TMA-store epilogue, flattened persistent loop
#   (1-5% faster than without), split tail (0.981x [0.961-0.998] without it, paired):
#   0.90-0.95x cuBLAS.
# - pipeline: groups of 4 row-blocks (128 tiles, about one wave of 132 CTAs, so each wave
#   completes consumer row-blocks); each tile signalled a quarter into the CTA's next tile
#   (the producer alone then runs as fast as the plain GEMM, 3.280 vs 3.286 ms; signalling
#   right after the store: 3.396 ms); TMA-store producers 0.980-0.995x ordinary stores over the
#   whole chain, paired (their writes into the peer are asynchronous bulk copies). A split
#   tail bought that chain nothing (0.999x), so PIPELINE_CONFIG has none; a pipeline built
#   without a configuration takes its tiles per plan height from a table measured on two stages
#   sharing one H200 (Pipeline.plan_configs), with a split last round where it measured faster.
# - waiting in parts: a static consumer waiting for its rows in 2 / 4 / 8 parts ran the chain
#   0.976x / 0.951x / 0.948x the whole-row-block wait (the consumer's tiles are faster than
#   the producer's, so it catches up and would otherwise start each round only when a whole
#   group of row-blocks is written).
# - both ends filled (Pipeline(ends="balanced")): split tails on, because the drain leaves the
#   consumer a last round of 8 tiles and a prefill a partial round, each a full round's time
#   unless split (512 + 512 rows: 0.982-0.991x the chain without ends with split tails,
#   0.989-1.002x without).
PLAIN_CONFIG = GemmConfig(128, 256, 64, group_m=8, num_stages=3, num_warps=8, split_tail=True)
PIPELINE_CONFIG = GemmConfig(128, 256, 64, group_m=4, num_stages=3, num_warps=8, wait_parts=8)
ENDS_CONFIG = dataclasses.replace(PIPELINE_CONFIG, split_tail=True)
# a GEMM with a fused epilogue: the plain GEMM's tiles and split tail (the summing CTA applies the
# epilogue; with Llama's gated RMSNorm, ptxas (sm_90a) then gives the kernel 255 registers and 212
# bytes of spills, 180 and none on whole tiles, and the 8B gate/up GEMM at 4096 rows ran 1.028x
# cuBLAS's against 1.035x on whole tiles: benchmarks/results/2026-12-01-h200-mlp/parts-8b/split-401cc06/);
# with a residual that its epilogue loads (a pipeline stage's, or into an output with padded rows),
# whose tile needs shared memory too, 128 x 256 tiles fit two stages only, and 128 x 128 tiles with
# four ran a Llama-70B down GEMM 0.85x as long (benchmarks/results/2026-12-01-h200-mlp/)
EPILOGUE_CONFIG = PLAIN_CONFIG
RESIDUAL_CONFIG = dataclasses.replace(PLAIN_CONFIG, block_n=128, num_stages=4, split_tail=False)

CONFIGS = [
    PLAIN_CONFIG,
    PIPELINE_CONFIG,
    GemmConfig(128, 256, 64, 8, 3, 8),
    GemmConfig(128, 128, 64, 8, 4, 8),
    GemmConfig(64, 128, 64, 1, 4, 4),
]


def fits_loaded_residual(config: GemmConfig, elem_bytes: int = 2) -> bool:
    """Whether a GEMM whose epilogue loads a residual tile fits shared memory in ``config``: its
    load ring and store tile, and room for the residual's (``RESIDUAL_CONFIG`` fits; the plain
    128 x 256 tiles with three stages do not)."""
    return config.smem_bytes(elem_bytes) + config.block_m * config.block_n * elem_bytes <= SMEM_LIMIT


def get_configs(elem_bytes: int = 2) -> list[GemmConfig]:
    """The configurations that fit in shared memory."""
    return [c for c in CONFIGS if c.smem_bytes(elem_bytes) <= SMEM_LIMIT]


class Operands(NamedTuple):
    """A GEMM's operands and shape inside a kernel (built there: descriptors are the kernel's
    own arguments): A and B; C as a TMA descriptor, or (``c_desc`` None) ``c_ptr`` with
    ``c_rows`` rows ``stride_cm`` apart; ``N`` output columns; ``k_tiles`` K-steps."""

    a_desc: object
    b_desc: object
    c_desc: object
    c_ptr: object
    c_rows: object
    N: object
    k_tiles: object
    stride_cm: object


class Protocol(NamedTuple):
    """A stage's protocol state inside a kernel: the run count ``epoch``, its error word and
    index, its waits' ``timeout_ns``, its per-tile stamps (``trace_ptr`` None: none)."""

    epoch: object
    err_ptr: object
    stage: object
    timeout_ns: object
    trace_ptr: object


class Tail(NamedTuple):
    """A split tail's kernel arguments (:class:`ctapipelining.deps.TailSplit`)."""

    workspace: object  # *fp32 [tiles * splits, BLOCK_M * BLOCK_N]: the slices' partial tiles
    counters: object  # *i32 [tiles]: slices arrived per tail tile (back to 0 after each launch)
    first: object  # tile-order position of the first tail tile (the end of the full rounds)
    splits: object  # K-slices per tail tile


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
    pending, epoch, signal, TMA_STORE: tl.constexpr, QUEUE: tl.constexpr, INTERPRET: tl.constexpr
):  # fmt: skip
    """Signal the stored tile ``pending`` (-1: none; a TMA store: once it completed). Returns -1."""
    if pending >= 0:
        if TMA_STORE:
            bulk_store_wait(0, INTERPRET)
        signal_tile(pending, epoch, signal, QUEUE, INTERPRET)
    return pending * 0 - 1


@triton.jit
def _part_step(q, wait, BLOCK_K: tl.constexpr):
    """K-step at which a consumer waits for part ``q`` of its input rows (the producer's
    column-blocks ``[q * part_cols // PARTS, ...)``, ``part_block`` columns each; see
    :func:`ctapipelining.deps.part_columns`): ``AHEAD`` (the pipeline depth) steps before the
    first step that reads it, because the software pipeline issues a step's TMA loads
    ``num_stages - 1`` steps early. -1: the part is read so soon that it is waited for
    before the tile."""
    first = (q * wait.part_cols // wait.PARTS) * wait.part_block // BLOCK_K
    return tl.maximum(first - wait.AHEAD, -1)


@triton.jit
def _poll_counter(wait, c, epoch, timeout_ns, ok, INTERPRET: tl.constexpr):
    """This thread waits for counter ``c`` to reach ``epoch * need[c]`` (a thread whose earlier
    wait on this tile failed only looks once). Returns this thread's ``ok`` and'ed with the
    outcome: per thread, so only a vote (:func:`cta_all`) may decide anything with it."""
    target = epoch * tl.load(wait.need + c)
    seen = poll_geq(wait.counters + c, target, tl.where(ok, timeout_ns, 0), INTERPRET)
    return ok & (seen - target >= 0)


@triton.jit
def _poll_before(wait, c0, epoch, timeout_ns, ALL: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """Before a tile (counters from ``c0``): this thread waits for part 0 and for every part
    read before the K loop can wait for it (``ALL``: every part). Returns this thread's ok."""
    ok = tl.program_id(0) >= 0
    for q in tl.static_range(wait.PARTS):
        if ALL or q == 0 or _part_step(q, wait, BLOCK_K) < 0:
            ok = _poll_counter(wait, c0 + q, epoch, timeout_ns, ok, INTERPRET)
    return ok


@triton.jit
def _report_wait(wait, c0, tile, epoch, err_ptr, stage):
    """The CTA gave up on ``tile`` (a failed vote): record the first of its counters that is
    still short (the first one if all have arrived since). CTA-uniform control flow only."""
    bad = c0 + wait.PARTS - 1
    bad_seen = tl.load(wait.counters + bad, volatile=True)
    bad_target = epoch * tl.load(wait.need + bad)
    for i in tl.static_range(1, wait.PARTS):
        c = c0 + wait.PARTS - 1 - i
        seen = tl.load(wait.counters + c, volatile=True)
        target = epoch * tl.load(wait.need + c)
        short = (seen - target < 0) | (bad_seen - bad_target >= 0)
        bad = tl.where(short, c, bad)
        bad_seen = tl.where(short, seen, bad_seen)
        bad_target = tl.where(short, target, bad_target)
    report_timeout(err_ptr, stage, tile, KIND_COUNTER, bad, bad_seen, bad_target)


@triton.jit
def _mma_tile(
    op, pm, pn, k_begin, k_end, prot, signal, pending, wait, c0, ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUEUE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The compute body: one output tile of ``op`` (:class:`Operands`) from K-steps
    ``[k_begin, k_end)`` (all of K but in a split tail), fp32 accumulator. Two hooks reach into
    the K loop, each a branch at one step: with ``signal`` the CTA's previous tile
    (``pending``) is signalled a quarter into the loop, by when its writes have drained; with
    ``wait`` in parts this thread waits for part ``q`` of the input rows (counters from ``c0``)
    at step :func:`_part_step` (``ok``: per thread). Otherwise the loop is the plain GEMM's.
    Returns ``(acc, pending, ok)``."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_begin, k_end):
        a = op.a_desc.load([pm * BLOCK_M, ki * BLOCK_K])
        b = op.b_desc.load([ki * BLOCK_K, pn * BLOCK_N])
        acc = tl.dot(a, b, acc)
        if signal is not None:
            if ki == k_begin + (k_end - k_begin) // 4:
                pending = _signal_pending(pending, prot.epoch, signal, op.c_desc is not None, QUEUE, INTERPRET)
        if wait is not None:
            for q in tl.static_range(1, wait.PARTS):
                if ki == _part_step(q, wait, BLOCK_K):
                    ok = _poll_counter(wait, c0 + q, prot.epoch, prot.timeout_ns, ok, INTERPRET)
                    fence_proxy_async(INTERPRET)  # this thread's acquire before its TMA reads of the part
    return acc, pending, ok


@triton.jit
def _out_cols(op, epi):
    """C's columns: the GEMM's, or half of them with a gated epilogue ``epi``."""
    n = op.N
    if epi.GATED is not None:
        n = op.N // 2
    return n


@triton.jit
def _store_tile(op, acc, pm, pn, epi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write tile (pm, pn) of C (:class:`Operands`), after its epilogue: an asynchronous TMA
    store (clipped to C's rows by the descriptor), or ordinary stores masked to ``c_rows`` x
    the output's columns (half of ``N`` with a gated epilogue); then, if the epilogue asks, the
    stored rows' sums of squares (:func:`.epilogue.store_sums`)."""
    acc = epilogue.apply(epi, acc, pm, pn, op.c_rows, _out_cols(op, epi), BLOCK_M)
    OUT_N: tl.constexpr = acc.shape[1]
    if op.c_desc is not None:
        stored = acc.to(op.c_desc.dtype)
        if epi.ACCUMULATE is not None:
            op.c_desc.atomic_add([pm * BLOCK_M, pn * OUT_N], stored)  # onto the residual C holds
        else:
            op.c_desc.store([pm * BLOCK_M, pn * OUT_N], stored)
    else:
        tl.static_assert(epi.ACCUMULATE is None, "a tile is added onto C by TMA only")
        stored = acc.to(op.c_ptr.dtype.element_ty)
        offs_m = (pm * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = pn * OUT_N + tl.arange(0, OUT_N)
        mask = (offs_m[:, None] < op.c_rows) & (offs_n[None, :] < _out_cols(op, epi))
        ptrs = op.c_ptr + offs_m[:, None] * op.stride_cm + offs_n[None, :]
        tl.store(ptrs, stored, mask=mask)
    epilogue.store_sums(epi, stored, pm, pn, op.c_rows, _out_cols(op, epi), BLOCK_M)


@triton.jit
def _now(trace_ptr):
    """``%globaltimer`` when tracing, else nothing (the stamp compiles away)."""
    if trace_ptr is not None:
        return globaltimer()
    else:
        return 0


@triton.jit
def _record(trace_ptr, tile, t_wait, t_start, t_stored):
    """Trace row of ``tile``: wait begun, compute begun, stored, epilogue done, CTA."""
    if trace_ptr is not None:
        row = trace_ptr + tile.to(tl.int64) * TRACE_FIELDS
        tl.store(row + 0, t_wait)
        tl.store(row + 1, t_start)
        tl.store(row + 2, t_stored)
        tl.store(row + 3, globaltimer())
        tl.store(row + 4, tl.program_id(0).to(tl.int64))


@triton.jit
def _run_tile(
    op, prot, tile, num_n, signal, pending, wait, c0, ok, t_wait, epi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, QUEUE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """One tile (``epi``: its :class:`.epilogue.Epilogue`, all None for none): compute, then, if every wait of every
    thread held (a static consumer's one vote per tile; ``ok`` comes in per thread), store it
    and note it for signalling, else report the timeout and drop it. Returns ``(tile still to
    signal, ok)``, ``ok`` CTA-uniform."""
    pm = tile // num_n
    pn = tile % num_n
    t_start = _now(prot.trace_ptr)
    acc, pending, ok = _mma_tile(
        op, pm, pn, 0, op.k_tiles, prot, signal, pending, wait, c0, ok, BLOCK_M, BLOCK_N, BLOCK_K, QUEUE, INTERPRET
    )
    if wait is not None:
        ok = cta_all(ok, INTERPRET)
    if ok:
        _store_tile(op, acc, pm, pn, epi, BLOCK_M, BLOCK_N)
        if signal is not None:
            pending = tile  # signalled a quarter into the next tile, or after the loop
        _record(prot.trace_ptr, tile, t_wait, t_start, _now(prot.trace_ptr))
    else:
        if wait is not None:
            _report_wait(wait, c0, tile, prot.epoch, prot.err_ptr, prot.stage)
    return pending, ok


@triton.jit
def _split_tail(
    op, prot, tail, item, num_m, num_n, alive, wait, signal, epi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    QUEUE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """After the full rounds: work item ``item`` of the split tail (:class:`Tail`,
    :class:`ctapipelining.deps.TailSplit`) of ``op`` (the plain kernel's CTA ``i`` runs item
    ``i``; a chain kernel's CTAs claim them). ``epi``: the GEMM's epilogue, applied by the CTA
    that sums a tile's slices, to the whole tile.

    Item ``i`` computes K-slice ``i % splits`` of tail tile ``j = i // splits`` (after waiting
    for its input, in a consumer: every part of it, one vote) and stores the fp32 partial in
    ``workspace`` (slot ``i``). Ordering: every thread's partial stores, a CTA barrier, then
    one thread's ``atom.add.acq_rel.gpu`` on the tile's arrival counter (release: the partials
    before the count). The CTA that brings the count to ``splits`` has acquired every other
    slice's release; after a second barrier its threads read all partials from L2 (``.cg``),
    add them in slice order (so the sum does not depend on who came last), store and signal
    the tile, and set the counter back to 0 for the next launch. Returns whether its waits
    held (CTA-uniform; ``alive`` if the item has no slice).
    """
    j = item // tail.splits
    ready = alive
    if (tail.first + j < num_m * num_n) & alive:  # items past tiles * splits have no slice
        part = item % tail.splits
        tile = tile_of_position(tail.first + j, num_m, num_n, GROUP_M)
        t_wait = _now(prot.trace_ptr)
        ready = True
        c0 = 0
        if wait is not None:
            c0 = tl.load(wait.counter_of_tile + tile)
            ready = cta_all(_poll_before(wait, c0, prot.epoch, prot.timeout_ns, True, BLOCK_K, INTERPRET), INTERPRET)
        if ready:
            if wait is not None:
                fence_proxy_async(INTERPRET)
            t_start = _now(prot.trace_ptr)
            pm = tile // num_n
            pn = tile % num_n
            k0, k1 = part * op.k_tiles // tail.splits, (part + 1) * op.k_tiles // tail.splits
            acc, _, _ = _mma_tile(
                op, pm, pn, k0, k1, prot, None, -1, None, 0, True, BLOCK_M, BLOCK_N, BLOCK_K, QUEUE, INTERPRET
            )
            offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
            partials = tail.workspace + (j * tail.splits).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(partials + part * (BLOCK_M * BLOCK_N) + offs, acc)
            cta_barrier(INTERPRET)  # every thread's partial before thread 0's release
            arrived = tl.atomic_add(tail.counters + j, 1, sem="acq_rel", scope="gpu") + 1
            if arrived == tail.splits:
                tl.atomic_xchg(tail.counters + j, 0, sem="relaxed", scope="gpu")  # all slices are in: rearm
                cta_barrier(INTERPRET)  # thread 0's acquire before every thread's reads
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in range(tail.splits):  # in slice order, whoever came last
                    acc += tl.load(partials + p * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
                _store_tile(op, acc, pm, pn, epi, BLOCK_M, BLOCK_N)
                t_stored = _now(prot.trace_ptr)
                if signal is not None:
                    _signal_pending(tile, prot.epoch, signal, op.c_desc is not None, QUEUE, INTERPRET)
                _record(prot.trace_ptr, tile, t_wait, t_start, t_stored)
        else:
            if wait is not None:
                _report_wait(wait, c0, tile, prot.epoch, prot.err_ptr, prot.stage)
    return ready


@triton.jit(do_not_specialize=["c_rows", "stage", "timeout_ns"])
def gemm_kernel(
    a_desc, b_desc, c_desc, c_ptr,  # A, B; C as a TMA descriptor, or (c_desc None) a pointer
    M, N, k_tiles,  # the tile grid: M x N outputs (A and C may have fewer rows: TMA reads zeros, stores clip)
    c_rows, stride_cm,  # C's rows and row stride (ordinary stores)
    wait, signal, tail, epi,  # the hooks (sync.Wait, sync.Signal), the split tail (Tail): None, off; the epilogue
    epoch_ptr, err_ptr, trace_ptr,  # this stage's runs before this one, error word, per-tile stamps; None: unused
    stage, timeout_ns,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_CTAS: tl.constexpr, QUEUE: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """``C = A @ B`` over a persistent grid of ``NUM_CTAS`` CTAs; ``QUEUE``: the hooks follow
    the workqueue policy (else static)."""
    tl.static_assert(not (tail is not None and wait is not None and QUEUE), "a workqueue consumer has no split tail")
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    epoch = 0
    if wait is not None or signal is not None:
        epoch = tl.load(epoch_ptr) + 1  # this run: the host bumps the count after the launch (sync.py)
    pending = tl.program_id(0) * 0 - 1  # tile stored but not yet signalled
    op = Operands(a_desc, b_desc, c_desc, c_ptr, c_rows, N, k_tiles, stride_cm)
    prot = Protocol(epoch, err_ptr, stage, timeout_ns, trace_ptr)
    # Without a wait `alive` is the constant True, so the plain GEMM has no branch on it.
    alive = True
    if wait is not None:
        alive = tl.program_id(0) >= 0
    if wait is not None and QUEUE:
        # workqueue: claim ring positions until past this run's tiles; tiles in readiness order
        pos = claim(wait.head, epoch, num_tiles, NUM_CTAS)
        while pos < num_tiles:
            t_wait = _now(trace_ptr)
            tile, ok = wait_slot(wait.slots, pos, epoch, num_tiles, err_ptr, stage, timeout_ns, INTERPRET)
            if ok:  # CTA-uniform (voted)
                fence_proxy_async(INTERPRET)
                pending, _ = _run_tile(
                    op, prot, tile, num_n, signal, pending, None, 0, True, t_wait, epi, BLOCK_M, BLOCK_N, BLOCK_K,
                    QUEUE, INTERPRET,
                )  # fmt: skip
                pos = claim(wait.head, epoch, num_tiles, NUM_CTAS)
            else:
                pos = pos * 0 + num_tiles  # timed out (the CTA as one): recorded in err_ptr; leave
    else:
        # plain or static: walk the tile order (the full rounds only, with a split tail); a
        # static consumer waits on each tile's counters (in parts: the first before the tile)
        loop_end = num_tiles
        if tail is not None:
            loop_end = tail.first
        for pos in tl.range(tl.program_id(0), loop_end, NUM_CTAS, flatten=True):
            if alive:  # after a timeout the CTA skips its remaining tiles
                tile = tile_of_position(pos, num_m, num_n, GROUP_M)
                t_wait = _now(trace_ptr)
                c0 = 0
                ok = True
                if wait is not None:
                    c0 = tl.load(wait.counter_of_tile + tile)
                    ok = _poll_before(wait, c0, epoch, timeout_ns, False, BLOCK_K, INTERPRET)
                    fence_proxy_async(INTERPRET)  # this thread's acquire before its TMA reads
                pending, ok = _run_tile(
                    op, prot, tile, num_n, signal, pending, wait, c0, ok, t_wait, epi, BLOCK_M, BLOCK_N, BLOCK_K,
                    QUEUE, INTERPRET,
                )  # fmt: skip
                if wait is not None:
                    alive = ok
    if signal is not None:  # the CTA's last tile
        _signal_pending(pending, epoch, signal, c_desc is not None, QUEUE, INTERPRET)
    if tail is not None:
        _split_tail(
            op, prot, tail, tl.program_id(0), num_m, num_n, alive, wait, signal, epi,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, QUEUE, INTERPRET,
        )  # fmt: skip
