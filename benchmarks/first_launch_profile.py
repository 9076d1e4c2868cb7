"""Diagnostic (kept in git history only): host time from an eager call's start to its first raw
launch, and who asks torch for the current device (cProfile callers). usage: OUT=dir python3 benchmarks/first_launch_profile.py
"""

import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch

from ctapipelining import launcher
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
stamps = []
orig = launcher.RawLaunch.__call__


def stamped(self, *a):
    stamps.append(time.perf_counter_ns())
    return orig(self, *a)


launcher.RawLaunch.__call__ = stamped
out = {}
for name, p in (("chain", pipe), ("default", default)):
    first = []
    for _ in range(200):
        torch.cuda.synchronize()
        stamps.clear()
        t0 = time.perf_counter_ns()
        p(x, out=y)
        first.append((stamps[0] - t0) / 1e3 if stamps else -1)
    torch.cuda.synchronize()
    out[name] = dict(to_first_launch_us=statistics.median(first), p10=sorted(first)[20], p90=sorted(first)[180])
launcher.RawLaunch.__call__ = orig
pr = cProfile.Profile()
pr.enable()
for _ in range(200):
    torch.cuda.synchronize()
    pipe(x, out=y)
pr.disable()
s = io.StringIO()
st = pstats.Stats(pr, stream=s)
st.print_callers(r"_get_current_device_index|__init__.py:\d+\(__init__\)|getenv|current_stream|_get_device_index")
print(s.getvalue()[:12000])
print(json.dumps(out))
od = os.environ.get("OUT")
if od:
    open(os.path.join(od, "prof2.json"), "w").write(json.dumps(out))
