"""The real Triton kernels of a small 2-stage chain on the CPU, under the Triton interpreter.

Grid programs run one after another there, so the stages run in order (producer, then
consumer): the kernels' hooks, counters, ring, epochs and error word are exercised exactly as
on the GPU, but not their concurrency (the reference executor covers interleavings).
fp16, because Triton 3.6's interpreter computes ``tl.dot`` on bf16 operands wrongly.
"""

from __future__ import annotations

import dataclasses
import os


def run_interpreted_chain(M: int = 40, K: int = 32, N: int = 48, seed: int = 0, epochs: int = 2) -> list[str]:
    """Run ``x @ A @ B`` through :class:`~ctapipelining.pipeline.Pipeline` on the CPU; return
    report lines. Must be called before anything imports the kernels without the interpreter."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from .kernels.gemm import GemmConfig
    from .pipeline import Pipeline, PipelineTimeout

    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(K, N, generator=g) / K**0.5).half()
    b = (torch.randn(N, N, generator=g) / N**0.5).half()
    cfg = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_stages=2, num_warps=4)
    lines = []
    for policy in ("workqueue", "static"):
        pipe = Pipeline([a, b], policy=policy, config=cfg, timeout_s=0.1)
        for _ in range(epochs):
            x = torch.randn(M, K, generator=g).half()
            y = pipe(x)
            ref = x.double() @ a.double() @ b.double()
            err = float((y.double() - ref).norm() / ref.norm())
            if not err < 1e-2:
                raise AssertionError(f"{policy}: relative error {err:.2e}")
        plan = pipe.plan(M)
        link = plan.links[0]
        lines.append(
            f"[{policy}] {epochs} runs without reset: rel. error {err:.1e}; counters {link.counters.tolist()} "
            f"(= {epochs} x need {link.dep.need.tolist()})"
            + (f", ring tail {int(link.tail)}" if policy == "workqueue" else "")
        )
        try:  # a consumer launched with no producer must time out, report, and recover
            pipe._launch(plan, x, torch.empty_like(y), only=[1])
            pipe.check_errors(plan)
            lines.append(f"[{policy}] ERROR: the lone consumer did not time out")
        except PipelineTimeout as e:
            lines.append(f"[{policy}] lone consumer -> PipelineTimeout: {str(e).split('. State')[0]}")
        y = pipe(x)
        lines.append(
            f"[{policy}] next call after the timeout: rel. error {float((y.double() - ref).norm() / ref.norm()):.1e}"
        )
    # both idle ends filled: the second stage prefills the first rows of layer 1, the first
    # stage drains the last rows of both layers (on GPUs: each on its own device)
    pipe = Pipeline([a, b], config=dataclasses.replace(cfg, split_tail=True), ends="balanced")
    y = pipe(x)
    plan = pipe.plan(M)
    same = torch.equal(y, pipe.sequential(x))
    lines.append(
        f"[static, ends='balanced'] prefill {plan.prefill_rows} + drain {plan.drain_rows} of {M} rows: "
        f"bitwise equal to the sequential GEMMs cut the same way: {same}"
    )
    if not same:
        raise AssertionError("ends='balanced': output differs from the sequential GEMMs")
    return lines
