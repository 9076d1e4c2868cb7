"""Where a fused block's bound eager call spends its host time (8B dims, 1024 rows), segment by
segment, each call from a synchronised GPU (as the eager-against-graph timing runs it) and
queued behind a busy GPU. Diagnostic: usage python3 benchmarks/host_profile_block.py OUT.json"""

import json
import statistics
import sys
import time

import torch

from ctapipelining.launcher import launch_hooks
from ctapipelining.nn import LlamaMLP, _direct
from ctapipelining.operands import is_dense, signature
from ctapipelining.timing import capture

H, INTER, M = 4096, 14336, 1024
dev = "cuda:0"
r = lambda *s: (torch.randn(*s, device=dev) * s[-1] ** -0.5).bfloat16()  # noqa: E731
block = LlamaMLP(r(INTER, H), r(INTER, H), r(H, INTER), (1 + 0.1 * torch.randn(H, device=dev)).bfloat16())
x = r(M, H)
for _ in range(5):
    block(x)
torch.cuda.synchronize()
g = capture(lambda: block(x), [0])
last = block._last
assert last is not None
stream = last.key[1]
ns = time.perf_counter_ns


def inline():
    t = [ns()]
    _direct(x)
    t.append(ns())
    la = block._last
    assert la is not None and is_dense(x) and signature(x) == la.key[0] and not launch_hooks()
    t.append(ns())
    assert 0 == torch._C._cuda_getDevice() and not torch._C._cuda_isCurrentStreamCapturing()
    assert torch._C._cuda_getCurrentRawStream(0) == stream
    t.append(ns())
    block._follow_source()
    first, second = block._epilogues()
    assert la.call.first.epilogue is first and la.call.second.epilogue is second
    t.append(ns())
    y = torch.empty_like(x)
    t.append(ns())
    h = torch._C._cuda_cudaCachingAllocator_raw_alloc(x.shape[0] * la.h_row_bytes, stream)
    t.append(ns())
    assert (h, y.data_ptr()) == la.key[2:]
    t.append(ns())
    la.call.run(stream)
    t.append(ns())
    torch._C._cuda_cudaCachingAllocator_raw_delete(h)
    del y
    return [(b - a) / 1e3 for a, b in zip(t, t[1:])]


names = ["_direct", "last+signature+hooks", "device/capture/stream", "follow+epilogues", "empty_like y",
         "raw h", "ptr compare", "lock+graph launch"]  # fmt: skip


def whole(f):
    t0 = ns()
    f()
    return (ns() - t0) / 1e3


res = {}
one = {"empty_like": lambda: torch.empty_like(x), "empty(shape, dtype=, device=)": lambda: torch.empty(
    x.shape, dtype=x.dtype, device=x.device), "new_empty": lambda: x.new_empty(x.shape),
    "empty_like contiguous": lambda: torch.empty_like(x, memory_format=torch.contiguous_format),
    "_epilogues": block._epilogues, "signature": lambda: signature(x), "_direct": lambda: _direct(x)}  # fmt: skip
cold = {k: [] for k in one}
for _ in range(300):
    for k, f in one.items():
        torch.cuda.synchronize()
        cold[k].append(whole(f))
res["one piece from sync"] = {k: round(statistics.median(v), 2) for k, v in cold.items()}
for mode in ("sync", "busy"):
    segs, tot = [], {"block(x)": [], "forward(x)": [], "_replay(x)": [], "torch replay": [], "ours replay": []}
    for _ in range(300):
        for name, f in [("inline", inline), ("block(x)", lambda: block(x)), ("forward(x)", lambda: block.forward(x)),
                        ("_replay(x)", lambda: block._replay(x)), ("torch replay", g.replay),
                        ("ours replay", lambda: last.call.run(stream))]:  # fmt: skip
            torch.cuda.synchronize()
            if mode == "busy":
                torch.cuda._sleep(2_000_000)
            if name == "inline":
                segs.append(inline())
            else:
                tot[name].append(whole(f))
    torch.cuda.synchronize()
    res[mode] = {n: round(statistics.median(s[i] for s in segs), 2) for i, n in enumerate(names)}
    res[mode]["inline total"] = round(statistics.median(sum(s) for s in segs), 2)
    res[mode] |= {k: round(statistics.median(v), 2) for k, v in tot.items()}
print(json.dumps(res, indent=1))
open(sys.argv[1], "w").write(json.dumps(res, indent=1) + "\n")
