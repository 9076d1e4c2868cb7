"""Micro-probe of the cross-GPU hand-off: two single-CTA kernels on two GPUs bounce a flag.

Each round trip is: release store into the peer's memory, the peer's acquire spin sees it,
the peer answers the same way. One-way visibility latency = elapsed / (2 * rounds). The
last round's timestamps also give the offset between the two GPUs' ``%globaltimer`` clocks
(used to draw both GPUs' traces on one time axis).
"""

import triton
import triton.language as tl

from .sync import globaltimer, wait_geq


@triton.jit(do_not_specialize=["rounds", "timeout_ns"])
def pingpong_kernel(local_flag, remote_flag, out, rounds, timeout_ns, SERVE: tl.constexpr):
    """``SERVE``: send first (GPU A); otherwise answer (GPU B). Flags must start at 0.
    ``out``: [elapsed ns, rounds completed, last send time, last receive time]."""
    t0 = globaltimer()
    t_send = t0
    t_recv = t0
    i = tl.full((), 1, tl.int32)
    done = tl.full((), 0, tl.int32)  # rounds completed
    ok = i > 0
    while (i <= rounds) & ok:  # ``ok`` is the CTA's vote: the loop stays CTA-uniform
        if SERVE:
            t_send = globaltimer()
            tl.atomic_xchg(remote_flag, i, sem="release", scope="sys")
            _, ok = wait_geq(local_flag, i, timeout_ns, False)
            t_recv = globaltimer()
        else:
            _, ok = wait_geq(local_flag, i, timeout_ns, False)
            t_recv = globaltimer()
            if ok:
                tl.atomic_xchg(remote_flag, i, sem="release", scope="sys")
        done = tl.where(ok, i, done)
        i += 1
    tl.store(out, globaltimer() - t0)
    tl.store(out + 1, done.to(tl.int64))
    tl.store(out + 2, t_send)
    tl.store(out + 3, t_recv)
