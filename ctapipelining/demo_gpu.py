"""``ctapipelining demo`` with GPUs: the real CTA-pipelined chain, checked and timed. With 2+
GPUs the two stages run on cuda:0 and cuda:1; with one, both share it in one chain kernel
(:mod:`ctapipelining.kernels.chain`).

The GEMM and the pipeline are imported inside :func:`demo_gpu`: importing them fixes Triton's
mode, and the CLI imports this module on CPU-only machines too, where the demo runs the kernels
under the interpreter instead.
"""

from __future__ import annotations

import statistics
import time

from .timing import Method, capture, time_interleaved


def demo_gpu(args, ngpu: int) -> int:
    import torch

    from .gemm import matmul
    from .pipeline import Pipeline

    M, K = args.gpu_m, args.gpu_k
    d1 = "cuda:1" if ngpu >= 2 else "cuda:0"
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(ngpu))
    where = "cuda:1" if ngpu >= 2 else "cuda:0 too (the stages share it: one chain kernel)"
    print(f"{ngpu} GPU(s) found ({names}). 2-stage chain X[{M},{K}] @ A[{K},{K}] on cuda:0 -> @ B[{K},{K}] on {where}")
    torch.manual_seed(args.seed)
    A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
    B = (torch.randn(K, K, device=d1) / K**0.5).bfloat16()
    x = torch.randn(M, K, device="cuda:0").bfloat16()
    devices = list(range(min(ngpu, 2)))

    def sequential():
        return matmul(matmul(x, A).to(d1), B)

    fp32 = (x.float() @ A.float()).to(d1) @ B.float()
    err = float((sequential().float() - fp32).norm() / fp32.norm())

    what = "GEMM, copy, GEMM" if ngpu >= 2 else "our GEMM twice"
    print(f"  sequential ({what}): bf16 vs fp32 reference: rel. error {err:.1e}")
    if ngpu >= 2:
        variants = {"workqueue": dict(policy="workqueue"), "static": dict(), "static, both ends": dict(ends="balanced")}
    else:  # one chain kernel: the policy only chooses how stages on different GPUs wait
        variants = {"one chain kernel": dict(always_pipelined=True)}
        note = "a Pipeline on one GPU runs plain GEMMs one after another by default (ours, or cuBLAS where faster)"
        print(f"  ({note}; here its chain kernel)")
    if ngpu >= 2:  # its GEMMs on two GPUs cannot be captured from one stream: eager
        methods, how = [Method("sequential", sequential)], "eager"
    else:  # like the chain: one CUDA graph
        h, y = torch.empty(M, K, dtype=A.dtype, device=d1), torch.empty(M, K, dtype=A.dtype, device=d1)
        replay = capture(lambda: (matmul(x, A, out=h), matmul(h, B, out=y)), [0]).replay
        methods, how = [Method("sequential", replay)], "CUDA graph"
    graphs = {}
    for name, kw in variants.items():
        pipe = Pipeline([A, B], **kw)
        t0 = time.perf_counter()
        y = pipe(x, check=True)  # waits for the call and reads its error words
        first = (time.perf_counter() - t0) * 1e3
        ref = pipe.sequential(x)  # the same GEMMs, one after another
        graphed = pipe.capture(M)  # one call in a CUDA graph, kept together with what it needs
        same = torch.equal(y, ref) and torch.equal(graphed(x), ref)
        print(f"  [{name}] bitwise equal to the sequential GEMMs: {same} (first call incl. compile: {first:.0f} ms)")
        if not same:
            return 1
        graphs[name] = (graphed, ref)
        methods.append(Method(name, graphed.replay))
    # every line in one run, in a fresh order each repetition (ctapipelining.timing)
    times = {k: statistics.median(v) for k, v in time_interleaved(methods, devices, 20, 3).items()}
    print(f"  sequential ({what}, {how}): {times['sequential']:.3f} ms")
    for name, (graphed, ref) in graphs.items():
        graphed.check_errors()
        if not torch.equal(graphed.out, ref):
            return 1
        t = times[name]
        print(f"  [{name}] {t:.3f} ms per call (CUDA graph), {t / times['sequential']:.2f}x sequential")
    return 0
