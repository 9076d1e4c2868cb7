"""Diagnostic: where the eager chain-kernel and loopback calls spend their time before their first
kernel (torch.profiler, 2048 rows), beside the default pipeline and a graph replay."""

import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import capture

OUT = Path(sys.argv[1])
K, M = 8192, 2048
ws = [(torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2)]
x = torch.randn(M, K, device="cuda:0").bfloat16()
y = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
pipes = {"chain": Pipeline(ws, always_pipelined=True), "loopback": Pipeline(ws, loopback=True), "default": Pipeline(ws)}
calls = {k: (lambda p=p: p(x, out=y)) for k, p in pipes.items()}
for f in calls.values():
    f()
    f()
calls["graph_chain"] = capture(calls["chain"], [0]).replay
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for i in range(8):
        for n, f in calls.items():
            torch.cuda.synchronize()
            with record_function(f"{n}_{i}"):
                f()
            torch.cuda.synchronize()
path = OUT / "trace.json"
prof.export_chrome_trace(str(path))
t = json.loads(path.read_text())
ev = [e for e in t["traceEvents"] if e.get("ph") == "X"]
ann = sorted((e for e in ev if e.get("cat") == "user_annotation"), key=lambda e: e["ts"])
gpu = sorted((e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
host = sorted((e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver", "cpu_op")), key=lambda e: e["ts"])
report = {}
for a in ann:
    name = a["name"].rsplit("_", 1)[0]
    t0 = a["ts"]
    first = next(k for k in gpu if k["ts"] >= t0)
    before = [(round(e["ts"] - t0, 1), round(e["dur"], 1), e["name"][:60]) for e in host if t0 <= e["ts"] < first["ts"]]
    gpu_ops = [(round(k["ts"] - t0, 1), round(k["dur"], 1), k["name"][:40]) for k in gpu if t0 <= k["ts"] < t0 + a["dur"] + 2000]
    r = report.setdefault(name, {"first_gpu_op_us": [], "example_host_ops_before": None, "example_gpu_ops": None})
    r["first_gpu_op_us"].append(round(first["ts"] - t0, 1))
    if a["name"].endswith("_4"):
        r["example_host_ops_before"], r["example_gpu_ops"] = before, gpu_ops
for r in report.values():
    r["median_first_gpu_op_us"] = statistics.median(r["first_gpu_op_us"])
(OUT / "profile.json").write_text(json.dumps(report, indent=1))
print(json.dumps(report, indent=1))
