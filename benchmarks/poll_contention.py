"""Does polling by every thread slow down the write it waits for? (one GPU)

usage: python3 benchmarks/poll_contention.py OUT_DIR [REPS]

``WAITERS`` CTAs of 256 threads wait on one int32 flag with the pipeline's bounded wait
(``sync.wait_geq``), every thread spinning or thread 0 only (``ONE_POLLER``). On another
stream one CTA sleeps ``DELAY_US`` and then sets the flag with a system-scope release, as a
producer's signal does. Each waiter stamps ``%globaltimer`` when released. Per mode and
repetition: release latency (median and last waiter minus the setter's stamp after its
write) and how long the setter's atomic itself took. Local (same-GPU) atomics stand in for
the NVLink ones: the question is contention at the flag's L2 line. Writes OUT_DIR/poll.json.
"""

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ctapipelining.kernels.sync import globaltimer, wait_geq

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
WAITERS, DELAY_US = 120, 50
out_dir.mkdir(parents=True, exist_ok=True)


@triton.jit
def waiter_kernel(flag, stamps, target, timeout_ns, ONE_POLLER: tl.constexpr):
    wait_geq(flag, target, timeout_ns, False, ONE_POLLER)
    tl.store(stamps + tl.program_id(0), globaltimer())


@triton.jit
def setter_kernel(flag, stamps, value, delay_ns):
    end = globaltimer() + delay_ns
    now = globaltimer()
    while now < end:
        now = globaltimer()
    before = globaltimer()
    tl.atomic_xchg(flag, value, sem="release", scope="sys")
    tl.store(stamps + 0, before)
    tl.store(stamps + 1, globaltimer())


flag = torch.zeros(1, dtype=torch.int32, device="cuda:0")
wait_stamps = torch.zeros(WAITERS, dtype=torch.int64, device="cuda:0")
set_stamps = torch.zeros(2, dtype=torch.int64, device="cuda:0")
side = torch.cuda.Stream()
report = {}
for mode, one in (("every_thread", False), ("one_thread", True)):
    rows = []
    for rep in range(REPS + 2):  # two warm-ups (compilation)
        target = rep + 1
        torch.cuda.synchronize()
        waiter_kernel[(WAITERS,)](flag, wait_stamps, target, 2_000_000_000, ONE_POLLER=one, num_warps=8)
        with torch.cuda.stream(side):
            setter_kernel[(1,)](flag, set_stamps, target, DELAY_US * 1000, num_warps=1)
        torch.cuda.synchronize()
        w, (before, after) = wait_stamps.cpu(), set_stamps.cpu().tolist()
        if rep >= 2:
            lat = (w - after).double() / 1e3
            rows.append(dict(median_us=float(lat.median()), last_us=float(lat.max()), atomic_us=(after - before) / 1e3))
    flag.zero_()
    report[mode] = {
        k: dict(median=round(statistics.median(r[k] for r in rows), 3), min=round(min(r[k] for r in rows), 3),
                max=round(max(r[k] for r in rows), 3))
        for k in rows[0]
    }  # fmt: skip
    print(mode, report[mode], flush=True)
report["setup"] = dict(waiters=WAITERS, threads_per_waiter=256, delay_us=DELAY_US, reps=REPS)
(out_dir / "poll.json").write_text(json.dumps(report, indent=1))
