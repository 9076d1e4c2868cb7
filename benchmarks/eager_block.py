"""Diagnostic: where a fused MLP block's eager call loses time against its graph replay.

usage: python3 benchmarks/eager_block.py OUT_DIR

Per shape (Llama-70B and -8B at M = 4096): (1) host time per eager call while the GPU is busy
(queued behind a sleep): the block, its operator's body alone, the norm pass, each GEMM; (2) the
GPU operations' durations and the gaps between them under torch.profiler, eager and replayed, in
turns; (3) eager / graph wall time, paired, with and without a rest before each call.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from ctapipelining.nn import LlamaMLP
from ctapipelining.timing import Method, capture, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")


def host_busy(call, n=20, batches=5):
    call()
    torch.cuda.synchronize()
    us = []
    for _ in range(batches):
        torch.cuda._sleep(2_000_000_000)
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        us.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(us)


def gpu_ops(call, reps=6):
    runs = []
    for _ in range(reps):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)  # fmt: skip
        runs.append([(e.name[:40], e.time_range.start, e.time_range.end) for e in ev])
    n = min(len(r) for r in runs)
    out = []
    for i in range(n):
        dur = statistics.median(r[i][2] - r[i][1] for r in runs)
        gap = statistics.median(r[i][1] - r[i - 1][2] for r in runs) if i else None
        out.append({"op": runs[0][i][0], "dur_us": dur, "gap_before_us": gap})
    return out


def main():
    report = {}
    for H, inter, M in ((8192, 28672, 4096), (4096, 14336, 4096)):
        report[f"H{H}_I{inter}_M{M}"] = row = one(H, inter, M)
        print(json.dumps({f"H{H}_M{M}": row}, indent=1), flush=True)
        torch.cuda.empty_cache()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "eager_block.json").write_text(json.dumps(report, indent=1))


def one(H, inter, M):
    if True:
        torch.manual_seed(0)

        def w(r, c):
            return (torch.randn(r, c, device="cuda") * c**-0.5).bfloat16()

        block = LlamaMLP(w(inter, H), w(inter, H), w(H, inter), torch.ones(H, device="cuda").bfloat16())
        x = torch.randn(M, H, device="cuda").bfloat16()
        first, second = block._epilogues()
        from ctapipelining.gemm import matmul

        h = block.first_gemm(x)
        row = {
            "host_us_gpu_busy": {
                "block": host_busy(lambda: block(x)),
                "operator_body": host_busy(lambda: block._run(x, block.w_in, block.w_out)),
                "first_gemm_with_norm": host_busy(
                    lambda: matmul(x, block.w_in, config=block.in_config, epilogue=first)
                ),
                "second_gemm_with_residual": host_busy(
                    lambda: matmul(h, block.w_out, config=block.out_config, epilogue=second, residual=x)
                ),
                "empty_like": host_busy(lambda: torch.empty_like(h)),
            }
        }
        with torch.no_grad():
            replay = capture(lambda: block(x), [0]).replay
            row["eager_ops"] = gpu_ops(lambda: block(x))
            row["graph_ops"] = gpu_ops(replay)
            for rest in (0.0, 2.0):
                times = time_interleaved([Method("eager", lambda: block(x)), Method("graph", replay)], [0], 20, 3,
                                         rest_ms=rest)  # fmt: skip
                med, lo, hi = median_ci([a / b for a, b in zip(times["eager"], times["graph"])])
                row[f"eager/graph rest {rest} ms"] = [med, lo, hi, statistics.median(times["graph"])]
    return row


if __name__ == "__main__":
    main()
