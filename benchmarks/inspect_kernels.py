"""Compile every hook combination of the GEMM on a GPU and report what the compiler made of it:
registers, spills, shared memory, whether wgmma is used, and what the hooks added (acquire
spins, system-scope atomics, proxy fences, CTA barriers). Writes the consumer kernel's PTX.

usage: python3 benchmarks/inspect_kernels.py OUT_DIR
"""

import re
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import launch_gemm
from ctapipelining.pipeline import Pipeline

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = K = 2048
A = torch.randn(K, K, device="cuda:0").bfloat16()
B = torch.randn(K, K, device="cuda:1").bfloat16()
x = torch.randn(M, K, device="cuda:0").bfloat16()
PATTERNS = {
    "wgmma": r"wgmma\.mma_async",
    "ld.acquire.sys": r"ld\.acquire\.sys",
    "atom.*.sys": r"atom\.[a-z_.]*sys",
    "fence.proxy.async": r"fence\.proxy\.async",
    "globaltimer": r"%globaltimer",
    "bar.sync": r"bar\.sync|barrier\.sync",
}


def report(name, k):
    ptx = k.asm["ptx"]
    counts = {p: len(re.findall(rx, ptx)) for p, rx in PATTERNS.items()}
    print(
        f"{name:28s} regs={k.n_regs:4d} spills={k.n_spills:3d} smem={k.metadata.shared:6d} "
        + " ".join(f"{p}={c}" for p, c in counts.items())
    )
    return ptx


for policy in ("workqueue", "static"):
    pipe = Pipeline([A, B], policy=policy)
    pipe(x)
    plan = pipe.plan(M)
    out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
    plain = launch_gemm(x, A, plan.inputs[1], pipe.config, plan.num_ctas[0])
    prod = pipe._launch(plan, x, out, only=[0])[0]
    if policy == "workqueue":
        report("plain (both hooks off)", plain)
    report(f"producer SIGNAL {policy}", prod)
    pipe.reset()
    # the consumer alone, against the epoch its producer just completed
    out1 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
    pipe._launch(plan, x, out1, only=[0])
    cons = pipe._launch(plan, x, out1, only=[1], advance_epoch=False)[1]
    ptx = report(f"consumer WAIT {policy}", cons)
    pipe.check_errors()
    if policy == "workqueue":
        (out_dir / "consumer_workqueue.ptx").write_text(ptx)
        loop = ptx[ptx.find("WAIT_LOOP") - 200 : ptx.find("WAIT_DONE") + 40]
        print("spin loop as compiled:\n" + loop)
