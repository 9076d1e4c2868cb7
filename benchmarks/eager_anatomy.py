"""Diagnostic: where an eager chain call's host time goes, on one GPU.

usage: python3 benchmarks/eager_anatomy.py OUT_DIR [OLD_PACKAGE_PARENT]

The chain (two 8192-wide layers sharing the GPU, one chain kernel) at M = 2048. While the GPU
sleeps (calls only queue), the host time of each step of a call, alone, 2000 times (us, median
of 5 batches), and of the whole call (this tree's and an older one's). Then, from a
synchronised GPU, the host time until the call returns and until the GPU is done, eager and
graph-replayed, with the cuda events' time from the call's entry to the kernel's start.
Writes anatomy.json.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import capture, environment

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
OLD = sys.argv[2] if len(sys.argv) > 2 else None
DEV, K, M = "cuda:0", 8192, 2048


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).bfloat16()


def host_us(steps: dict, n=400, batches=5):
    out = {k: [] for k in steps}
    for _ in range(batches):
        for name, fn in steps.items():
            torch.cuda._sleep(400_000_000)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out[name].append((time.perf_counter() - t0) / n * 1e6)
            torch.cuda.synchronize()
    return {k: round(statistics.median(v), 2) for k, v in out.items()}


def from_rest(calls: dict, reps=30):
    """Per call, from a synchronised GPU: host time to return, wall time to the GPU's end, and
    the GPU time from an event recorded before the call to one recorded after it (us)."""
    out = {}
    for name, call in calls.items():
        rows = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            b.record()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            rows.append(((t1 - t0) * 1e6, (t2 - t0) * 1e6, a.elapsed_time(b) * 1e3))
        out[name] = {
            k: round(statistics.median(r[i] for r in rows), 1) for i, k in enumerate(("host", "wall", "events"))
        }
    return out


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    ws = [rand(K, K, scale=K**-0.5) for _ in range(2)]
    pipe = Pipeline(ws)
    x, y = rand(M, K), torch.empty(M, K, dtype=torch.bfloat16, device=DEV)
    pipe(x, out=y, check=True)
    plan = pipe.plan(M)
    epoch, err = torch.zeros(1, dtype=torch.int64, device=DEV), plan.errors[0].clone()
    err_host = torch.zeros(err.shape, dtype=err.dtype, pin_memory=True)
    ev = torch.cuda.Event()
    steps = {
        "call": lambda: pipe(x, out=y),
        "check_input": lambda: pipe.check_input(x),
        "check_output": lambda: pipe.check_output(y, x),
        "raise_finished_errors": pipe._raise_finished_errors,
        "capturing": pipe._capturing,
        "plan": lambda: pipe.plan(M),
        "refresh_replicas": pipe._refresh_replicas,
        "current_device": torch.cuda.current_device,
        "current_stream": lambda: torch.cuda.current_stream(0),
        "raw_stream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "epoch_add": lambda: epoch.add_(1),
        "err_copy": lambda: err_host.copy_(err, non_blocking=True),
        "event_record": ev.record,
        "plain_matmul": lambda: matmul(x, ws[0], out=y),
    }
    if OLD:
        sys.path.insert(0, OLD)
        import ctapipelining_old.pipeline as op

        old = op.Pipeline(ws)
        old(x, out=y, check=True)
        steps["old_call"] = lambda: old(x, out=y)
    report = {"environment": environment(), "command": " ".join(sys.argv), "host_us": host_us(steps)}
    print(json.dumps(report["host_us"], indent=1), flush=True)
    replay = capture(lambda: pipe(x, out=y), [0]).replay
    calls = {"eager": lambda: pipe(x, out=y), "graph": replay, "plain_eager": lambda: matmul(x, ws[0], out=y)}
    if OLD:
        calls["old_eager"] = lambda: old(x, out=y)
    report["from_rest"] = from_rest(calls)
    print(json.dumps(report["from_rest"], indent=1), flush=True)
    pipe.check_errors()
    assert torch.equal(pipe(x, out=y, check=True), pipe.sequential(x))
    (OUT / "anatomy.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
