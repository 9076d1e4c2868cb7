"""Device code of the handshake between the segments of a chain that run in separate launches
(one process per GPU: :mod:`ctapipelining.distributed`).

Within one process, a call's stages are ordered by streams and events: a producer starts only
after the previous call's consumer has finished, and a consumer's deadline starts when its
launch does, at the same moment as its producer's. Across processes nothing orders them, so
each segment (the stages one launch runs) brackets its call with two one-CTA kernels on its
stream:

- :func:`gate` first: it counts the call (``calls``: calls of this plan on this segment), then
  waits until the previous segment has *started* the same call (``started_in``, in our
  memory), so that the segment's own deadlines count from when its producer runs, not from
  when this process got ahead of it (a rank descheduled, or still queueing); and checks that
  the producer's call has as many rows as ours (``rows_in``: a rank given other rows would
  read or write the wrong ones). It waits until the next segment has *finished* the call before
  (``consumed_out``, in our memory): until then it still reads the buffer this call's last
  stage overwrites. Then it tells the next segment this call's rows (``rows_out``) and that it
  has started (``started_out``, released after them; both in its memory);
- :func:`finish` last, after the segment's kernels: it tells the previous segment that this
  call no longer reads its input (``consumed_in``, in the previous segment's memory).

Every wait is bounded (a long deadline: the time a peer may lag) and reported in the segment's
error word (``KIND_START`` / ``KIND_DONE``); the values are int64 call counts compared on their
signed difference, wrap-safe like every counter. Releases and acquires are at system scope,
one thread each (scalar atomics), as in :mod:`ctapipelining.kernels.sync`.
"""

import triton
import triton.language as tl

from .sync import KIND_DONE, KIND_ROWS, KIND_START, cta_barrier, report_timeout, wait_geq


@triton.jit(do_not_specialize=["stage", "rows", "timeout_ns"])
def gate(
    calls,
    started_in,
    rows_in,
    consumed_out,
    started_out,
    rows_out,
    err,
    stage,
    rows,
    timeout_ns,
    HAS_IN: tl.constexpr,
    HAS_OUT: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    n = tl.atomic_add(calls, 1, sem="relaxed", scope="gpu") + 1  # one thread; the CTA shares it
    if HAS_IN:
        seen, ok = wait_geq(started_in, n, timeout_ns, INTERPRET)
        if not ok:
            report_timeout(err, stage, -1, KIND_START, 0, seen, n)
        else:  # one thread reads (after its acquire) and the CTA shares the value: a uniform branch
            theirs = tl.atomic_add(rows_in, 0, sem="relaxed", scope="sys")
            if theirs != rows:
                report_timeout(err, stage, -1, KIND_ROWS, 0, theirs, rows)
    if HAS_OUT:
        seen, ok = wait_geq(consumed_out, n - 1, timeout_ns, INTERPRET)
        if not ok:
            report_timeout(err, stage, -1, KIND_DONE, 0, seen, n - 1)
        # told even after a failed wait: the error is recorded here, the next segment need not time out too
        tl.store(rows_out, rows.to(tl.int64))
        cta_barrier(INTERPRET)  # the rows' store before thread 0's release (cumulative)
        tl.atomic_xchg(started_out, n, sem="release", scope="sys")


@triton.jit
def finish(calls, consumed_in):
    n = tl.atomic_add(calls, 0, sem="relaxed", scope="gpu")
    tl.atomic_xchg(consumed_in, n, sem="release", scope="sys")
