"""Where a fused block's eager call spends its host time (8B dims, 1024 rows), piece by piece."""

import cProfile
import io
import json
import pstats
import statistics
import sys
import time

import torch

from ctapipelining.launcher import launch_hooks
from ctapipelining.nn import LlamaMLP, _check_input, _direct
from ctapipelining.operands import signature, tma_ready
from ctapipelining.timing import capture

out = sys.argv[1]
H, INTER, M = 4096, 14336, 1024
dev = "cuda:0"
r = lambda *s: (torch.randn(*s, device=dev) * s[-1] ** -0.5).bfloat16()
block = LlamaMLP(r(INTER, H), r(INTER, H), r(H, INTER), (1 + 0.1 * torch.randn(H, device=dev)).bfloat16())
x = r(M, H)
for _ in range(5):
    block(x)
torch.cuda.synchronize()
g = capture(lambda: block(x), [0])
res = {}


def t(name, f, n=3000):
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        ts.append((time.perf_counter_ns() - t0) / n / 1e3)
    res[name] = round(min(ts), 3)


w_out = block.w_out
t("_check_input", lambda: _check_input(x, H))
t("dtype/device check", lambda: x.dtype != block.w_out.dtype or x.device != block.w_out.device)
t("flat", lambda: x.dim() == 2 and x.stride() == (H, 1))
t("_direct", lambda: _direct(x))
t("_follow_source", lambda: block._follow_source())
t("_epilogues", lambda: block._epilogues())
t(
    "own/fits",
    lambda: (
        (None is None and block.w_in is block.w_in)
        and x.shape[1:] == (H,)
        and (x.dtype, x.device) == (w_out.dtype, w_out.device)
    ),
)
t("tma_ready", lambda: tma_ready(x))
t("empty_like", lambda: torch.empty_like(x))
t("empty h", lambda: torch.empty(M, 2 * INTER, dtype=x.dtype, device=x.device))
t("both empties", lambda: (torch.empty_like(x), torch.empty(M, 2 * INTER, dtype=x.dtype, device=x.device)))
t("x.device", lambda: x.device)
t("x.is_cuda+index", lambda: x.is_cuda and x.device.index)
t("current_device", lambda: torch.cuda.current_device())
t("is_current_stream_capturing", lambda: torch.cuda.is_current_stream_capturing())
t("cuda.is_available", lambda: torch.cuda.is_available())
t("launch_hooks", lambda: launch_hooks())
t("raw stream", lambda: torch._C._cuda_getCurrentRawStream(0))
t("signature", lambda: signature(x))
t("x.data_ptr", lambda: x.data_ptr())


# launches: time with the GPU kept busy (queue only)
def queued(name, f, n=200):
    ts = []
    for _ in range(5):
        torch.cuda._sleep(200_000_000)
        t0 = time.perf_counter_ns()
        for _ in range(n):
            f()
        ts.append((time.perf_counter_ns() - t0) / n / 1e3)
        torch.cuda.synchronize()
    res[name] = round(min(ts), 3)


bound = [b for b in block._bound.values() if b is not None][0]
stream = torch._C._cuda_getCurrentRawStream(0)
queued("graph replay (ours)", lambda: bound.graph.replay(stream))
queued("steps one by one", lambda: bound.launch(stream))
queued("torch graph replay", g.replay)
queued("block(x) busy", lambda: block(x))
# whole call from a synchronised GPU: host until it returns
hs = []
for _ in range(200):
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    block(x)
    hs.append((time.perf_counter_ns() - t0) / 1e3)
res["block(x) from sync, median"] = statistics.median(hs)
hs = []
for _ in range(200):
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    g.replay()
    hs.append((time.perf_counter_ns() - t0) / 1e3)
res["torch replay from sync, median"] = statistics.median(hs)
pr = cProfile.Profile()
torch.cuda.synchronize()
pr.enable()
for _ in range(300):
    block(x)
pr.disable()
torch.cuda.synchronize()
s = io.StringIO()
pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
print(json.dumps(res, indent=1))
print(s.getvalue()[:6000])
open(out, "w").write(json.dumps(res, indent=1) + "\n" + s.getvalue())
