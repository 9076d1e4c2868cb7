"""Many back-to-back full-size calls, each compared bitwise with the sequential Triton GEMMs.

usage: python3 benchmarks/diagnose_race.py [M] [calls]
For each policy and producer-fence variant: how many calls were wrong, whether NaN (poisoned
input read before written) or stale values, and which consumer row-blocks were affected.
"""

import sys
import time

import torch

from ctapipelining import gemm as G
from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline

M = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else 60
K = 8192
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
xs = [torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(3)]
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
refs = None
for fence in (False, True):
    G.FENCE_EACH_THREAD = fence
    if refs is None:
        refs = [matmul(matmul(x, A).to("cuda:1"), B) for x in xs]
    for policy in ("workqueue", "static"):
        for poison in (False, True):
            pipe = Pipeline([A, B], policy=policy)
            plan = pipe.plan(M)
            bad, nan_calls, blocks = 0, 0, {}
            t = []
            for i in range(CALLS):
                if poison:
                    plan.inputs[1].fill_(float("nan"))
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t0 = time.perf_counter()
                pipe(xs[i % 3], out=out, check=False)
                torch.cuda.synchronize(0)
                torch.cuda.synchronize(1)
                t.append((time.perf_counter() - t0) * 1e3)
                ref = refs[i % 3]
                if not torch.equal(out, ref):
                    bad += 1
                    nan_calls += int(out.isnan().any())
                    rows = (out != ref).any(1).nonzero().flatten()
                    for rb in (rows // 128).unique().tolist():
                        blocks[rb] = blocks.get(rb, 0) + 1
            pipe.check_errors()
            t.sort()
            print(
                f"fence_each_thread={fence!s:5} {policy:9s} poison={poison!s:5} M={M}: {bad}/{CALLS} wrong, "
                f"{nan_calls} with NaN, row-blocks {dict(sorted(blocks.items())[:12])} "
                f"median {t[len(t) // 2]:.3f} ms",
                flush=True,
            )
