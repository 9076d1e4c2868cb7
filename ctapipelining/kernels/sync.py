"""Device-side synchronisation of CTA-pipelining: signal, bounded wait, queue claim/push, fences.

These ``@triton.jit`` functions are the only code a kernel needs beyond its compute body:
a *prologue* (:func:`poll_geq` on a tile's counters, or :func:`claim` + :func:`wait_slot`,
then :func:`fence_proxy_async`), a vote (:func:`cta_all`) before anything the CTA does with
the tile's result, and an *epilogue* (:func:`signal_tile`). The data structures are
those of :mod:`ctapipelining.deps`; the reference executor runs the same logic on the CPU.

Memory-ordering argument
------------------------
Producer (stage ``s`` on GPU ``p``), after computing a tile:

1. the tile goes straight into the consumer GPU's memory, either with ordinary stores by every
   thread, or with an asynchronous TMA store: then, before the tile is signalled,
   ``cp.async.bulk.wait_group`` in each issuing thread says its writes are complete and
   ``fence.proxy.async`` orders those async-proxy writes before the generic-proxy release
   (:func:`bulk_store_wait`). The kernel signals a tile a quarter into the CTA's next tile,
   when its writes have drained (:func:`ctapipelining.kernels.gemm._mma_tile`), and a CTA's
   last tile after its loop; the ordering argument is the same for both;
2. a CTA barrier (``bar.sync``, :func:`cta_barrier`): all those stores (and every issuing
   thread's bulk-store wait) happen-before what thread 0 does next;
3. thread 0 bumps each counter with ``atom.add.acq_rel.sys`` (release at system scope is
   cumulative: it publishes every store ordered before it, the other threads' included);
4. if that bump filled the counter (``old + 1 == epoch * need``) and the policy is
   ``workqueue``, thread 0 has also *acquired* every earlier producer's release on that
   counter; it claims ring positions with ``fetch_add(tail)`` and the CTA writes the tagged
   tile ids with ``atom.exch.release.sys`` (ordered after thread 0's acquire by the barrier
   that broadcasts the claim), so the consumer that acquires a slot sees the data of *all*
   producer tiles behind the counter.

Consumer (stage ``s + 1`` on GPU ``c``), before reading its input tile:

1. every thread spins with ``ld.acquire.sys`` on the counter (``static``) or on the ring slot
   (``workqueue``), so each thread is ordered after the producers' releases without a
   block-wide barrier per poll; the loop is in one inline-PTX block bounded by a
   ``%globaltimer`` deadline. Threads may leave it with different answers (a value landing
   within a poll of the deadline), so no control flow depends on one thread's answer: the CTA
   votes (``bar.red.and.pred``, :func:`cta_all`) and goes on only if *every* thread saw the
   target, so each thread that reads has acquired it itself, and the decision is the same in
   every thread. (Decided per thread, such a value split a CTA into threads that computed and
   threads that left: barriers, wgmma and TMA then hung the GPU or faulted.) A ``workqueue``
   CTA votes on each slot before it takes the tile. A ``static`` CTA votes once per tile,
   before its store: it computes the tile whatever its threads saw (each thread that gave up
   looks only once at later counters of that tile) and stores and signals it only if every
   wait of every thread held; otherwise the result is dropped;
2. ``fence.proxy.async.global``: the data was written through the generic proxy and is read
   by TMA (the async proxy); the proxy fence orders the acquire before those reads. A consumer
   that waits in parts does 1-2 again for each later part, inside its K loop, before the TMA
   loads of that part are issued (:func:`ctapipelining.kernels.gemm._part_step` says when);
3. on a failed vote the CTA records (stage, tile, what it waited on, value seen, value needed)
   in the stage's error word and leaves its loop, so a protocol bug never hangs the GPU.

A residual (a fused epilogue's, :mod:`ctapipelining.kernels.epilogue`) is the input of the
stage before, read by ordinary loads in the consumer's epilogue, possibly from the GPU before
(a peer pointer). Its rows ``r`` were written (and released at system scope) before that
stage's tiles of rows ``r`` acquired them, each of those tiles reads all of its input rows (all
its parts), and the consumer acquired at least one of those tiles' signals before its
epilogue: release-acquire at system scope is cumulative and causality is transitive, so the
residual's rows are visible to it, whichever policy, parts or split tail (a split tail's slices
each wait for every part). The call's own ``x`` was written before any kernel of the call was
queued (every stage's stream waits for the caller's streams). The rows' partial sums a norm
of the next stage reads are ordinary stores of the producer's epilogue, made before the tile's
``bar.sync`` and release like the tile's own, and read in the consumer's epilogue, after its
vote: the same argument as the tile's data.

A stage's epoch tensor holds its runs before this one: a kernel runs run ``load + 1``, and the
host bumps the tensor after the stage's launches, on their stream (so a call's first kernel
starts without waiting for the bump; the next launch on that stream sees it, as stream order
puts the bump between them).

Counters, epochs, ring slots, head and tail are int64 and compared on their signed
difference, so no number of calls (graph replays advance the epochs where the host does not
see them) wraps them: at 2^63 tile signals that is millennia of back-to-back calls.

Under the Triton interpreter (``INTERPRET``), where inline PTX does not run, the waits poll a
bounded number of times with Triton atomics instead; grid programs run one after another
there, so a wait either holds at once (the producer ran first) or times out.
"""

from typing import NamedTuple

import triton
import triton.language as tl


class Wait(NamedTuple):
    """The wait-for-input hook's kernel arguments: this stage's scoreboard and ring (its own
    memory; :class:`ctapipelining.deps.Dependency` builds the lists). UPPER_CASE fields are
    ``tl.constexpr``."""

    counters: object  # *i64 [num_counters]: signals received, only growing
    counter_of_tile: object  # *i32 [tiles]: each tile's first counter (static)
    need: object  # *i32 [num_counters]: signals a counter gets per run
    slots: object  # *i64 [tiles]: the ring (workqueue)
    head: object  # *i64 [1]: the ring's next position to claim (workqueue)
    part_cols: object  # the producer's column-blocks (waits in parts; see gemm._part_step)
    part_block: object  # their width in columns
    PARTS: object  # pieces a static consumer waits for its input rows in
    AHEAD: object  # K-steps before its first read a part is waited for (the TMA pipeline depth)


class Signal(NamedTuple):
    """The signal-output hook's kernel arguments: the next stage's scoreboard and ring (its
    GPU's memory) and this stage's CSR lists (ours). UPPER_CASE fields are ``tl.constexpr``."""

    counters: object  # *i64: the consumer's counters
    signal_ptr: object  # *i32 [tiles + 1]: CSR row pointers, producer tile -> counters
    signal_counters: object  # *i32: the counters each tile bumps
    need: object  # *i32 [num_counters]: signals per run (a bump that reaches epoch * need fills it)
    push_ptr: object  # *i32 [num_counters + 1]: CSR, counter -> consumer tiles it releases (workqueue)
    push_tiles: object  # *i32
    slots: object  # *i64: the consumer's ring (workqueue)
    tail: object  # *i64 [1]: the ring's next position to fill (workqueue)
    consumer_tiles: object  # tiles of the consumer per run
    PUSH_BLOCK: object  # power of two >= the most consumer tiles one counter releases
    MAX_SIGNALS: object  # the most counters one tile bumps


# Error word layout: int64[len(ERR_FIELDS)] per stage, on the stage's device.
ERR_FIELDS = ("flag", "stage", "tile", "kind", "index", "seen", "target", "cta")
ERR_FLAG, ERR_STAGE, ERR_TILE, ERR_KIND, ERR_INDEX, ERR_SEEN, ERR_TARGET, ERR_CTA = (tl.constexpr(i) for i in range(8))
KIND_COUNTER = tl.constexpr(1)  # waited on a counter (static policy)
KIND_SLOT = tl.constexpr(2)  # waited on a ring slot (workqueue policy)
KIND_HEAD = tl.constexpr(3)  # claimed a ring position before this run's: the ring state is inconsistent
KIND_TICKET = tl.constexpr(4)  # a chain kernel claimed outside its run's positions: its ticket is out of step
KIND_START = tl.constexpr(5)  # a segment's gate waited for the previous segment to start the call (handshake)
KIND_DONE = tl.constexpr(6)  # a segment's gate waited for the next segment to finish the call before (handshake)
KIND_ROWS = tl.constexpr(7)  # a segment's gate found the previous segment's call on other rows (handshake)
INTERPRET_POLLS = tl.constexpr(64)

# Every thread polls ld.acquire.sys until the value reaches the target or its deadline passes
# (64-bit values, compared on their signed difference: wrap-safe). Labels live inside { } so the
# block can be inlined many times; the warp reconverges before it leaves (the .aligned wgmma and
# barriers after it need the whole warp). Threads may leave this loop with different answers (a value
# landing within a poll of the deadline): :func:`cta_all` makes the CTA's decision one.
_SPIN_PTX = tl.constexpr("""
{
  .reg .pred %wp<2>;
  .reg .u64 %wt<2>;
  .reg .s64 %wd;
  mov.u64 %wt0, %globaltimer;
  add.u64 %wt0, %wt0, $3;
WAIT_LOOP:
  ld.acquire.sys.global.b64 $0, [$1];
  sub.s64 %wd, $0, $2;
  setp.ge.s64 %wp0, %wd, 0;
  @%wp0 bra WAIT_DONE;
  mov.u64 %wt1, %globaltimer;
  setp.lt.u64 %wp1, %wt1, %wt0;
  @%wp1 bra WAIT_LOOP;
WAIT_DONE:
  bar.warp.sync -1;
}
""")

# A CTA-wide vote: bar.red.and.pred is a barrier (every thread of the CTA arrives) that also
# returns, to every thread, the AND of the predicate over all of them.
_ALL_PTX = tl.constexpr("""
{
  .reg .pred %vp<2>;
  setp.ne.s32 %vp0, $1, 0;
  bar.red.and.pred %vp1, 1, %vp0;
  selp.s32 $0, 1, 0, %vp1;
}
""")


@triton.jit
def globaltimer():
    """Nanoseconds of the GPU's global timer (coarse: it ticks every ~1 us on Hopper)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def fence_proxy_async(INTERPRET: tl.constexpr):
    """Order this thread's generic-proxy acquire before its later TMA (async-proxy) reads."""
    if not INTERPRET:
        tl.inline_asm_elementwise(
            "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )


@triton.jit
def bulk_store_wait(PENDING: tl.constexpr, INTERPRET: tl.constexpr):
    """Wait until at most ``PENDING`` of this thread's TMA (bulk) stores are in flight, their
    writes *complete* (not only their shared-memory reads), then order those async-proxy
    writes before this thread's later generic-proxy release."""
    if not INTERPRET:
        if PENDING == 0:
            asm: tl.constexpr = "cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;"
        else:
            asm: tl.constexpr = "cp.async.bulk.wait_group 1; fence.proxy.async.global; mov.u32 $0, 0;"
        tl.inline_asm_elementwise(asm, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cta_barrier(INTERPRET: tl.constexpr):
    """Every thread of the CTA meets here, with CTA-scope memory ordering (``bar.sync``).

    Named barrier 1 in inline PTX rather than ``tl.debug_barrier()``: Triton 3.6 stops
    software-pipelining a loop that contains its own barrier, and a tile may be signalled
    inside the next tile's K loop. Every warp runs the same code (no warp specialisation in
    a signalling kernel), so all of them arrive."""
    if INTERPRET:
        tl.debug_barrier()
    else:
        tl.inline_asm_elementwise("bar.sync 1; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def cta_all(pred, INTERPRET: tl.constexpr):
    """True in every thread iff ``pred`` holds in every thread of the CTA. A barrier: every
    thread must reach it (call it from CTA-uniform control flow only)."""
    if INTERPRET:
        return pred
    else:
        vote = tl.inline_asm_elementwise(_ALL_PTX, "=r,r", [pred.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        return vote != 0


@triton.jit
def poll_geq(ptr, target, timeout_ns, INTERPRET: tl.constexpr):
    """Spin until ``*ptr >= target`` (int64, wrap-safe: the signed difference) with acquire at
    system scope, at most ``timeout_ns`` (0: look once). Returns the last value *this thread*
    saw: threads may disagree (a value landing within a poll of the deadline), so no control
    flow may depend on it before a vote (:func:`cta_all`)."""
    if INTERPRET:
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        polls = 0
        while (seen - target < 0) & (polls < INTERPRET_POLLS) & (timeout_ns > 0):
            seen = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
            polls += 1
    else:
        seen = tl.inline_asm_elementwise(
            _SPIN_PTX, "=l,l,l,l", [ptr, target.to(tl.int64), timeout_ns.to(tl.uint64)], dtype=tl.int64,
            is_pure=False, pack=1,
        )  # fmt: skip
    return seen


@triton.jit
def wait_geq(ptr, target, timeout_ns, INTERPRET: tl.constexpr):
    """:func:`poll_geq`, then a vote. Returns ``(seen, ok)``: the last value this thread saw,
    and whether *every* thread of the CTA saw the target (the same in every thread, so a
    branch on it keeps the CTA together: a thread that saw the value just before the deadline
    and one that gave up just after must not part ways into barriers, wgmma and TMA)."""
    seen = poll_geq(ptr, target, timeout_ns, INTERPRET)
    return seen, cta_all(seen - target >= 0, INTERPRET)


@triton.jit
def report_timeout(err_ptr, stage, tile, kind, index, seen, target):
    """Record the first timeout of this stage in its error word (later ones are dropped)."""
    zero = tl.full((), 0, tl.int64)
    first = tl.atomic_cas(err_ptr + ERR_FLAG, zero, zero + 1, sem="relaxed", scope="gpu") == 0
    if first:
        tl.store(err_ptr + ERR_STAGE, stage)
        tl.store(err_ptr + ERR_TILE, tile)
        tl.store(err_ptr + ERR_KIND, kind)
        tl.store(err_ptr + ERR_INDEX, index)
        tl.store(err_ptr + ERR_SEEN, seen)
        tl.store(err_ptr + ERR_TARGET, target)
        tl.store(err_ptr + ERR_CTA, tl.program_id(0))


@triton.jit
def claim(head, epoch, num_tiles, NUM_CTAS: tl.constexpr):
    """``workqueue`` policy: claim the next ring position of this run (``>= num_tiles``: done).
    Each run moves the (int64) head by ``num_tiles + NUM_CTAS`` (every CTA claims once past the
    end). A scalar atomic: one thread claims and the CTA shares its answer."""
    base = (epoch - 1) * (num_tiles + NUM_CTAS)
    return tl.atomic_add(head, 1, sem="relaxed", scope="gpu") - base


@triton.jit
def wait_slot(slots, pos, epoch, num_tiles, err_ptr, stage, timeout_ns, INTERPRET: tl.constexpr):
    """``workqueue`` policy prologue: wait for ring position ``pos`` of run ``epoch`` to be
    filled and return ``(tile, ok)``. A slot holds ``lap * num_tiles + tile`` (int64: the
    position ``q`` of a run grows with every run, and ``q % num_tiles`` needs it whole).

    A negative ``pos`` means the head is behind this run (state that only an inconsistent
    ring gives: a run whose consumer never claimed, or buffers overwritten): it is reported
    and nothing is read, so a corrupted head can never index outside the ring."""
    target = epoch * num_tiles
    q = (epoch - 1) * num_tiles + pos
    if pos >= 0:
        seen, ok = wait_geq(slots + q % num_tiles, target, timeout_ns, INTERPRET)
        if not ok:
            report_timeout(err_ptr, stage, -1, KIND_SLOT, q, seen, target)
    else:
        seen = target - 1
        ok = False
        report_timeout(err_ptr, stage, -1, KIND_HEAD, pos, pos, 0)
    return (seen - target).to(tl.int32), ok


@triton.jit
def signal_tile(tile, epoch, signal, QUEUE: tl.constexpr, INTERPRET: tl.constexpr):
    """Epilogue: publish ``tile`` (already stored by every thread) to the consumer
    (``signal``: :class:`Signal`; ``QUEUE``: the workqueue policy).

    Bumps each counter the tile feeds (at most ``MAX_SIGNALS``: a static loop, so the
    persistent loop around it stays a simple ``for`` Triton can flatten); under ``QUEUE`` the
    bump that fills a counter pushes that counter's consumer tiles (at most ``PUSH_BLOCK``)
    into the consumer's ring.
    """
    cta_barrier(INTERPRET)  # all threads' tile stores (or bulk-store waits) before thread 0's release
    first_signal = tl.load(signal.signal_ptr + tile)
    num_signals = tl.load(signal.signal_ptr + tile + 1) - first_signal
    for j in tl.static_range(signal.MAX_SIGNALS):
        if j < num_signals:
            c = tl.load(signal.signal_counters + first_signal + j)
            if QUEUE:
                old = tl.atomic_add(signal.counters + c, 1, sem="acq_rel", scope="sys")
                if old + 1 == epoch * tl.load(signal.need + c):
                    first = tl.load(signal.push_ptr + c)
                    n = tl.load(signal.push_ptr + c + 1) - first
                    pos = tl.atomic_add(signal.tail, n, sem="relaxed", scope="sys")
                    k = tl.arange(0, signal.PUSH_BLOCK)
                    ts = tl.load(signal.push_tiles + first + k, mask=k < n, other=0)
                    q = pos + k
                    tl.atomic_xchg(
                        signal.slots + q % signal.consumer_tiles,
                        (q // signal.consumer_tiles + 1) * signal.consumer_tiles + ts,
                        mask=k < n,
                        sem="release",
                        scope="sys",
                    )
            else:
                tl.atomic_add(signal.counters + c, 1, sem="release", scope="sys")
