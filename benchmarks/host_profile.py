"""Diagnostic (kept in git history only): where the host time of an eager call goes.

cProfile of 200 eager calls of the chain kernel and of the default pipeline at 2048 rows; their
host time from a synchronised GPU and with the GPU busy. usage: OUT=dir python3 benchmarks/host_profile.py
"""

import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch

from ctapipelining.pipeline import Pipeline

K = 8192
dev = "cuda:0"


def rand(*s, scale=1.0):
    return (torch.randn(*s, device=dev) * scale).bfloat16()


ws = [rand(K, K, scale=K**-0.5) for _ in range(2)]
pipe = Pipeline(ws, always_pipelined=True)
default = Pipeline(ws)
x = rand(2048, K)
y = torch.empty(2048, K, dtype=torch.bfloat16, device=dev)
for p in (pipe, default):
    for _ in range(5):
        p(x, out=y)
    p(x, out=y, check=True)
torch.cuda.synchronize()
out = {}
for name, p in (("chain", pipe), ("default", default)):
    hosts = []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        p(x, out=y)
        hosts.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    # host time with the GPU busy (queued behind a sleep): pure host cost
    busy = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter_ns()
        for _ in range(20):
            p(x, out=y)
        busy.append((time.perf_counter_ns() - t0) / 20e3)
        torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(200):
        torch.cuda.synchronize()
        p(x, out=y)
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
    s2 = io.StringIO()
    pstats.Stats(pr, stream=s2).sort_stats("cumulative").print_stats(45)
    out[name] = dict(host_from_sync_us=statistics.median(hosts), host_busy_us=statistics.median(busy))
    print(f"==== {name}: host from sync {statistics.median(hosts):.1f} us, busy {statistics.median(busy):.1f} us")
    print(s.getvalue()[:9000])
    print(s2.getvalue()[:9000])
# a bare add_ and a bare cuda event record, for scale
e = torch.zeros(1, dtype=torch.int64, device=dev)
torch.cuda._sleep(200_000_000)
t0 = time.perf_counter_ns()
for _ in range(100):
    e.add_(1)
out["add_us"] = (time.perf_counter_ns() - t0) / 100e3
torch.cuda.synchronize()
print(json.dumps(out))
od = os.environ.get("OUT")
if od:
    open(os.path.join(od, "prof.json"), "w").write(json.dumps(out))
