"""Host time of a block's eager call (Llama-8B and GPT blocks from random weights, at 16 and 1024
rows): whether the call binds (``_last``), its median host time per call (synchronised before,
not after: the time until ``forward`` returns) and a profile of 200 calls.

usage: python3 host_probe.py OUT_DIR"""

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from ctapipelining.nn import GPTMLP, LlamaMLP

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
dev = "cuda:0"
torch.manual_seed(0)
H = 4096
report = {}
blocks = {
    "llama8b": LlamaMLP(
        *(torch.randn(14336, H, device=dev).bfloat16() * 0.02 for _ in range(2)),
        torch.randn(H, 14336, device=dev).bfloat16() * 0.01,
        torch.rand(H, device=dev).bfloat16() + 0.5,
    ),
    "gpt": GPTMLP(
        torch.randn(16384, H, device=dev).bfloat16() * 0.02,
        torch.randn(16384, device=dev).bfloat16() * 0.1,
        torch.randn(H, 16384, device=dev).bfloat16() * 0.01,
        torch.randn(H, device=dev).bfloat16() * 0.1,
        torch.rand(H, device=dev).bfloat16() + 0.5,
        torch.randn(H, device=dev).bfloat16() * 0.1,
    ),
}
with torch.no_grad():
    for name, block in blocks.items():
        for M in (16, 1024):
            x = torch.randn(M, H, device=dev).bfloat16()
            for _ in range(5):
                block(x)
            torch.cuda.synchronize()
            host, gpu = [], []
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                block(x)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append((t1 - t0) * 1e6)
                gpu.append((time.perf_counter() - t0) * 1e6)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                block(x)
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            key = f"{name}_M{M}"
            report[key] = {
                "bound_last": block._last is not None,
                "bound_calls": sum(v is not None for v in block._bound.values()),
                "graphed": block._last is not None and block._last.call.graph is not None,
                "host_us_median": statistics.median(host),
                "call_us_median": statistics.median(gpu),
                "configs": [str(c) for c in block.configs_for(M)],
            }
            print(key, json.dumps(report[key]), flush=True)
            (OUT / f"profile-{key}.txt").write_text(s.getvalue())
(OUT / "host_probe.json").write_text(json.dumps(report, indent=1))
