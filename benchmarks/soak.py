"""Many calls on one pipeline, each checked: nothing wrong, nothing hung, no memory growth.

usage: python3 benchmarks/soak.py OUT_DIR [CALLS]

One :class:`~ctapipelining.pipeline.Pipeline` of two 2048-wide layers (with two GPUs, one per
GPU; with one, both on cuda:0 as two kernels, ``loopback=True``) with a 50 ms timeout, CALLS
(default 10000) calls in a seeded random mix:

* eager calls (``check=True`` every 16th) on fresh inputs of mixed heights (1 to 3000 rows);
* graph replays (:meth:`~ctapipelining.pipeline.Pipeline.capture`) at 1024 and 2048 rows;
* calls whose producer starts late, by up to half the timeout: they must be right;
* a few calls whose producer never comes (only the consumer launched): they must raise
  :class:`~ctapipelining.pipeline.PipelineTimeout`, and the next call must be right.

Then the default pipeline of the same two layers on cuda:0 (plain GEMMs one after another: ours,
or cuBLAS's at the heights where it measured faster, :func:`~ctapipelining.serial.runs_cublas`;
its eager calls on operands seen before launch their bound GEMMs), CALLS calls in a seeded random
mix: eager calls on inputs from a pool of a few tensors per height (their signatures recur),
each filled with fresh values, into an ``out`` from a pool or a new one, from the default
stream or a side stream, some ``check=True``, and graph replays at 640, 1024 and 2048 rows. Twice:
with many operands (their signatures outnumber the bound calls kept, so eager calls both bind
and launch bound GEMMs), then with one input and one ``out`` per height at three heights (every
signature kept: after its first call, every eager call launches bound GEMMs).

Every result is compared bitwise with :meth:`~ctapipelining.pipeline.Pipeline.sequential`.
Memory: the allocated bytes on every GPU and the process's resident set, after the first
1000 calls and at the end (of each part). Writes OUT_DIR/soak.json; exits 1 if any result is
wrong or a timeout did not raise, or if allocated memory grew.
"""

import json
import random
import resource
import sys
import time
from pathlib import Path

import torch

from ctapipelining.pipeline import Pipeline, PipelineTimeout
from ctapipelining.timing import environment

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 10_000
K = 2048
TIMEOUT_S = 0.05
HEIGHTS = (1, 37, 128, 300, 500, 640, 1024, 2048, 3000)  # 300, 640: the default's stages run cuBLAS there


def memory() -> dict:
    return {
        "allocated": [torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count())],
        "reserved": [torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count())],
        "max_rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
    }


def grew(start: dict | None, end: dict) -> bool:
    """Whether any GPU's allocated memory grew from ``start`` (:func:`memory`; None: not read) to ``end``."""
    return start is not None and any(e > s for s, e in zip(start["allocated"], end["allocated"]))


def main() -> int:
    torch.manual_seed(0)
    rng = random.Random(0)
    two = torch.cuda.device_count() >= 2
    devs = ["cuda:0", "cuda:1" if two else "cuda:0"]
    ws = [(torch.randn(K, K, device=d) * K**-0.5).bfloat16() for d in devs]
    pipe = Pipeline(ws, loopback=not two, timeout_s=TIMEOUT_S)
    graphs = {M: pipe.capture(M) for M in (1024, 2048)}
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    torch.cuda.synchronize()
    cycles_per_s = 20_000_000 / (a.elapsed_time(b) * 1e-3)
    counts = {k: 0 for k in ("eager", "graph", "delayed", "never")}
    wrong, unraised, after_timeout_wrong = [], [], []
    mem_start = None
    t0 = time.time()
    x = y = None
    for i in range(CALLS):
        if i == 1000:
            x = y = None  # nothing of a call held where memory is read
            torch.cuda.synchronize()
            mem_start = memory()
        r = rng.random()
        kind = "eager" if r < 0.7 else "graph" if r < 0.95 else "delayed" if r < 0.995 else "never"
        M = rng.choice(tuple(graphs)) if kind == "graph" else rng.choice(HEIGHTS)
        x = torch.randn(M, K, device=devs[0]).bfloat16()
        counts[kind] += 1
        if kind == "eager":
            y = pipe(x, check=i % 16 == 0)
        elif kind == "graph":
            y = graphs[M](x)
        else:
            plan = pipe.plan(M)
            y = torch.full((M, K), float("nan"), dtype=torch.bfloat16, device=devs[1])
            if kind == "delayed":
                delay = int(rng.uniform(0, TIMEOUT_S / 2) * cycles_per_s)
                pipe._launch(plan, x, y, delay_cycles={0: delay})
                pipe.check_errors(plan)
            else:
                pipe._launch(plan, x, y, only=[1])
                try:
                    pipe.check_errors(plan)
                    unraised.append(i)
                except PipelineTimeout:
                    pass
                # the next call on the same plan must be right
                x = torch.randn(M, K, device=devs[0]).bfloat16()
                y = pipe(x, check=True)
                if not torch.equal(y, pipe.sequential(x)):
                    after_timeout_wrong.append(i)
                continue
        if not torch.equal(y, pipe.sequential(x)):
            wrong.append((i, kind, M))
    x = y = None
    pipe.check_errors()
    torch.cuda.synchronize()
    mem_end = memory()
    loopback_grew = grew(mem_start, mem_end)
    default = soak_default([w.to("cuda:0") for w in ws], random.Random(1))
    kept = soak_default([w.to("cuda:0") for w in ws], random.Random(2), (128, 640, 2048), 1, (1,))
    report = {
        "environment": environment(),
        "command": " ".join(sys.argv),
        "devices": devs,
        "calls": CALLS,
        "counts": counts,
        "wrong": wrong,
        "timeouts_not_raised": unraised,
        "wrong_after_a_timeout": after_timeout_wrong,
        "memory_after_1000_calls": mem_start,
        "memory_at_end": mem_end,
        "allocated_grew": loopback_grew,
        "wall_s": round(time.time() - t0, 1),
        "default_one_gpu": default,
        "default_one_gpu_every_signature_kept": kept,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "environment"}))
    failed = any(part["wrong"] or part["allocated_grew"] for part in (default, kept))
    return 1 if wrong or unraised or after_timeout_wrong or loopback_grew or failed else 0


def soak_default(ws: list[torch.Tensor], rng: random.Random, heights=HEIGHTS, inputs=3, outputs=(None, 2)) -> dict:
    """The default pipeline of ``ws`` on cuda:0 (module docstring), CALLS checked calls on
    ``inputs`` tensors per height of ``heights``, into ``outputs`` (``None``: a new one; a
    number: that many tensors per height)."""
    pipe = Pipeline(ws)
    assert pipe.one_after_another
    graphs = {M: pipe.capture(M) for M in (640, 1024, 2048)}
    pools = {M: [torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0") for _ in range(inputs)] for M in heights}
    outs = {
        M: [
            torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0") if n else None
            for n in outputs
            for _ in range(n or 1)
        ]
        for M in heights
    }
    side = torch.cuda.Stream()
    counts = {k: 0 for k in ("eager", "eager_side", "checked", "graph")}
    wrong, mem_start, t0 = [], None, time.time()
    for i in range(CALLS):
        if i == 1000:
            torch.cuda.synchronize()
            mem_start = memory()
        r = rng.random()
        kind = "graph" if r < 0.15 else "checked" if r < 0.2 else "eager_side" if r < 0.4 else "eager"
        counts[kind] += 1
        if kind == "graph":
            M = rng.choice(tuple(graphs))
            x = torch.randn(M, K, device="cuda:0").bfloat16()
            y = graphs[M](x)
        else:
            M = rng.choice(heights)
            x = rng.choice(pools[M])
            x.normal_()
            out = rng.choice(outs[M])
            if kind == "eager_side":
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    y = pipe(x, out=out)
                torch.cuda.current_stream().wait_stream(side)
            else:
                y = pipe(x, out=out, check=kind == "checked")
        if not torch.equal(y, pipe.sequential(x)):
            wrong.append((i, kind, M))
        x = y = None  # nothing of a call held where memory is read
    pipe.check_errors()
    torch.cuda.synchronize()
    mem_end = memory()
    return {
        "calls": CALLS,
        "counts": counts,
        "bound_calls_kept": len(pipe._bound_calls),
        "wrong": wrong,
        "memory_after_1000_calls": mem_start,
        "memory_at_end": mem_end,
        "allocated_grew": grew(mem_start, mem_end),
        "wall_s": round(time.time() - t0, 1),
    }


if __name__ == "__main__":
    sys.exit(main())
