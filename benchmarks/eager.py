"""Eager calls against graph replays, the host time per kernel launch, and the kernels of this
tree against those of an earlier one (no regression), on one GPU, graph-replayed and paired.

usage: python3 benchmarks/eager.py OUT_DIR [REPS] [OLD_PACKAGE_PARENT]

1. Host time per launch: while the GPU sleeps, the host time of 40 ``check=False`` calls,
   divided by the stream operations they issue (the plain GEMM: 1 a call; the chain on one
   GPU: its chain kernel, its epoch bump and its error word's copy; the default pipeline: its
   2 GEMMs), at M = 2048; median and
   range of 7 batches (with
   OLD_PACKAGE_PARENT, the earlier tree's batches taking turns with these).
2. Eager against graph-replayed (1. and 2. unless CALLS=0): the plain GEMM (and cuBLAS, for reference) at M = 2048 and
   the chain (two 8192-wide layers sharing the GPU, one chain kernel; with OLD_PACKAGE_PARENT,
   the earlier tree's eager beside it) at M = 2048 and 16384, and
   the default ``Pipeline``, which runs our GEMMs one after another there (also its graph against
   the chain's; with OLD_PACKAGE_PARENT, the earlier tree's default eager beside it, and both
   defaults' host time), the GEMMs and the chains each in a run of their own: median wall
   time of >= 30 synchronised calls each, taking turns in a shuffled order; the ratio eager /
   graph per repetition, median and distribution-free 95% CI (:func:`ctapipelining.timing.median_ci`).
3. No regression (unless KERNELS=0): if OLD_PACKAGE_PARENT holds ``ctapipelining_old`` (an
   earlier tree's package, renamed), the plain GEMM and the producer and consumer kernels alone (static; the consumer
   with its counters already full) at M = 16384, K = N = 8192, old and new graph-replayed in
   one interleaved run; new / old per repetition, median and 95% CI.
4. Blocks (unless BLOCKS=0): the fused Llama block (Llama-70B dims at 4096 rows, -8B dims at
   4096 and 1024), eager against graph-replayed, with the host time of an eager call and its
   wall time from a synchronised GPU; with OLD_PACKAGE_PARENT the earlier tree's block beside it.
5. Chunked prefill (unless PREFILL=0): the blocks called eagerly at a row count that changes at
   every call, the first time they see it and again, beside the block's PyTorch form
   (:func:`prefill`).
With two GPUs, 2. also for the two layers on two GPUs (``cross_*``: a producer on cuda:0
writing into cuda:1, a consumer there) at M = 2048 and 16384.
Writes eager.json in OUT_DIR and prints a table.
"""

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from ctapipelining import deps
from ctapipelining.gemm import GemmLaunch, grid_size, matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.plan import Link
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
OLD = sys.argv[3] if len(sys.argv) > 3 else None
DEV = "cuda:0"
K = 8192


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).bfloat16()


def graphed(fn):
    """``fn`` captured in a CUDA graph on cuda:0 (:func:`ctapipelining.timing.capture`): its replay."""
    return capture(fn, [0]).replay


def host_per_launch(calls: dict, batches=7, n=40):
    """``{name: (call, kernels per call)}`` -> ``{name: {median_us, min_us, max_us}}`` per kernel
    launch, the batches of each name taking turns."""
    for call, _ in calls.values():
        call()
    torch.cuda.synchronize()
    us = {name: [] for name in calls}
    for _ in range(batches):
        for name, (call, kernels) in calls.items():
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the calls below only queue
            t0 = time.perf_counter()
            for _ in range(n):
                call()
            us[name].append((time.perf_counter() - t0) / n / kernels * 1e6)
            torch.cuda.synchronize()
    return {k: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)} for k, v in us.items()}


def host_and_total(calls: dict, reps=30):
    """``{name: call}`` -> per name the medians (us) of the host time until the call returns
    and of the wall time until the GPU is done, each call from a synchronised GPU: where an
    eager call's extra time goes (host work before the kernel starts, or after)."""
    out = {name: ([], []) for name in calls}
    for _ in range(reps):
        for name, call in calls.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            out[name][0].append((t1 - t0) * 1e6)
            out[name][1].append((t2 - t0) * 1e6)
    return {k: {"host_us": statistics.median(h), "total_us": statistics.median(t)} for k, (h, t) in out.items()}


def paired(methods, pairs, devices=(0,)):
    times = time_interleaved(methods, list(devices), REPS, 5)
    out = {m.name: {"median_ms": statistics.median(times[m.name]), "p10": sorted(times[m.name])[REPS // 10],
                    "p90": sorted(times[m.name])[(9 * REPS) // 10]} for m in methods}  # fmt: skip
    for num, den in pairs:
        med, lo, hi = median_ci([a / b for a, b in zip(times[num], times[den])])
        out[f"{num}/{den}"] = {"median": med, "ci95": [lo, hi]}
    return out


def gemms_and_chains() -> dict:
    """Parts 1 and 2 of the module's description: host time per launch, and the plain GEMM, cuBLAS,
    the chain kernel and the default pipeline eager against graph-replayed."""
    report = {}
    w = rand(K, K, scale=K**-0.5)
    ws = [rand(K, K, scale=K**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, always_pipelined=True)  # both stages on one GPU: one chain kernel at every height
    default = Pipeline(ws)  # our GEMMs one after another (Pipeline.one_after_another)
    x2k = rand(2048, K)
    y2k = torch.empty(2048, K, dtype=torch.bfloat16, device=DEV)
    calls = {
        "plain_2048": (lambda: matmul(x2k, w, out=y2k), 1),
        "chain_2048_per_launch": (lambda: pipe(x2k, out=y2k), 3),
    }
    if OLD:
        sys.path.insert(0, OLD)
        import ctapipelining_old.gemm as og
        import ctapipelining_old.pipeline as op

        try:  # the old tree's chain kernel (its default may run our GEMMs one after another)
            old_pipe = op.Pipeline(ws, always_pipelined=True)
        except TypeError:  # a tree from before always_pipelined: its default is the chain kernel
            old_pipe = op.Pipeline(ws)
        calls["old_plain_2048"] = (lambda: og.matmul(x2k, w, out=y2k), 1)
        calls["old_chain_2048_per_launch"] = (lambda: old_pipe(x2k, out=y2k), 3)
    old_default = None
    if OLD:  # the old tree's default Pipeline, where it runs our GEMMs one after another too
        old_default = op.Pipeline(ws)
        if not getattr(old_default, "one_after_another", False):
            old_default = None
    calls["default_2048_per_launch"] = (lambda: default(x2k, out=y2k), 2)
    if old_default is not None:
        calls["old_default_2048_per_launch"] = (lambda: old_default(x2k, out=y2k), 2)
    report["host_us_per_launch"] = host_per_launch(calls)
    defaults = {"default_2048_eager": lambda: default(x2k, out=y2k)}
    if old_default is not None:
        defaults["old_default_2048_eager"] = lambda: old_default(x2k, out=y2k)
    report["host_and_total_default_2048"] = host_and_total(defaults)
    chains = {"chain_2048_eager": lambda: pipe(x2k, out=y2k)}
    if OLD:
        chains["old_chain_2048_eager"] = lambda: old_pipe(x2k, out=y2k)
    report["host_and_total_chain_2048"] = host_and_total(chains)
    methods, pairs = [], []
    methods += [Method("plain_2048_eager", lambda: matmul(x2k, w, out=y2k))]
    methods += [Method("plain_2048_graph", graphed(lambda: matmul(x2k, w, out=y2k)))]
    pairs.append(("plain_2048_eager", "plain_2048_graph"))
    # the same measure for cuBLAS (torch.mm): what an eager launch costs a library with a C++ host path
    methods += [Method("cublas_2048_eager", lambda: torch.mm(x2k, w, out=y2k))]
    methods += [Method("cublas_2048_graph", graphed(lambda: torch.mm(x2k, w, out=y2k)))]
    pairs.append(("cublas_2048_eager", "cublas_2048_graph"))
    report["host_and_total_2048"] = host_and_total({m.name: m.run for m in methods})
    # the GEMMs and the chains each take turns among themselves: a 7 ms chain call before a
    # 0.4 ms GEMM in one turn and not the other would move the GEMM's ratio by its clock's state
    report["eager_vs_graph"] = paired(methods, pairs)
    methods, pairs = [], []
    for M in (2048, 16384):
        x, y = rand(M, K), torch.empty(M, K, dtype=torch.bfloat16, device=DEV)
        pipe(x, out=y)  # the plan (built outside the capture)
        replay = graphed(lambda x=x, y=y: pipe(x, out=y))  # a bare CUDA graph of the call, like the GEMM's
        methods += [Method(f"chain_{M}_eager", lambda x=x, y=y: pipe(x, out=y)), Method(f"chain_{M}_graph", replay)]
        pairs.append((f"chain_{M}_eager", f"chain_{M}_graph"))
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
        if OLD:  # the old tree's chain kernel, eager
            old_pipe(x, out=y)
            methods += [Method(f"old_chain_{M}_eager", lambda x=x, y=y: old_pipe(x, out=y))]
            pairs += [(f"chain_{M}_eager", f"old_chain_{M}_eager"), (f"old_chain_{M}_eager", f"chain_{M}_graph")]
        if default.one_after_another:  # the default Pipeline's call, and against the chain kernel
            replay = graphed(lambda x=x, y=y: default(x, out=y))
            methods += [Method(f"default_{M}_eager", lambda x=x, y=y: default(x, out=y))]
            methods += [Method(f"default_{M}_graph", replay)]
            pairs += [(f"default_{M}_eager", f"default_{M}_graph"), (f"default_{M}_graph", f"chain_{M}_graph")]
            assert torch.equal(default(x, check=True), default.sequential(x))
            if old_default is not None:  # the same call on the old tree, eager
                methods += [Method(f"old_default_{M}_eager", lambda x=x, y=y: old_default(x, out=y))]
                pairs += [(f"default_{M}_eager", f"old_default_{M}_eager")]
                pairs += [(f"old_default_{M}_eager", f"default_{M}_graph")]
                assert torch.equal(old_default(x, check=True), default.sequential(x))
    report["eager_vs_graph"] |= paired(methods, pairs)
    pipe.check_errors()
    if torch.cuda.device_count() >= 2:  # the two layers on two GPUs: the cross-GPU chain
        cross = Pipeline([ws[0], ws[1].to("cuda:1")])
        methods, pairs = [], []
        for M in (2048, 16384):
            x, y = rand(M, K), torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
            cross(x, out=y)
            replay = capture(lambda x=x, y=y: cross(x, out=y), [0, 1]).replay
            eager = Method(f"cross_{M}_eager", lambda x=x, y=y: cross(x, out=y))
            methods += [eager, Method(f"cross_{M}_graph", replay)]
            pairs.append((f"cross_{M}_eager", f"cross_{M}_graph"))
            assert torch.equal(cross(x, check=True), cross.sequential(x))
        report["eager_vs_graph"] |= paired(methods, pairs, (0, 1))
        cross.check_errors()
    return report


def main():
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv)}
    if os.environ.get("CALLS", "1") != "0":
        report |= gemms_and_chains()
    if os.environ.get("BLOCKS", "1") != "0":
        report["block_eager_vs_graph"] = blocks()
    if os.environ.get("PREFILL", "1") != "0":
        report["prefill_changing_rows"] = prefill()
    if OLD and os.environ.get("KERNELS", "1") != "0":
        report["new_vs_old"] = new_vs_old()
    (OUT / "eager.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "environment"}, indent=1))


def blocks():
    """The fused Llama block (:class:`ctapipelining.nn.LlamaMLP`, random weights) called eagerly
    against its graph replay, at the issue's shapes (Llama-70B at 4096 rows, -8B at 4096 and 1024), the block
    of ``OLD_PACKAGE_PARENT`` beside it on the same weights; all four lines of a shape take turns."""
    from ctapipelining.nn import LlamaMLP

    out = {}
    for H, inter, M in ((8192, 28672, 4096), (4096, 14336, 4096), (4096, 14336, 1024)):
        ws = [rand(inter, H, scale=H**-0.5), rand(inter, H, scale=H**-0.5), rand(H, inter, scale=inter**-0.5)]
        norm = 1 + 0.1 * torch.randn(H, device=DEV).bfloat16()
        x = rand(M, H)
        block = LlamaMLP(*ws, norm)
        lines = {"new": block}
        if OLD:
            sys.path.insert(0, OLD)
            from ctapipelining_old.nn import LlamaMLP as OldMLP

            lines["old"] = OldMLP(*ws, norm)
        methods, pairs = [], []
        for name, b in lines.items():
            assert torch.equal(b(x), block(x))
            methods += [
                Method(f"{name}_eager", lambda b=b, x=x: b(x)),
                Method(f"{name}_graph", graphed(lambda b=b, x=x: b(x))),
            ]
            pairs.append((f"{name}_eager", f"{name}_graph"))
        if OLD:
            pairs.append(("new_eager", "old_eager"))
        got = paired(methods, pairs)
        got["host_and_total"] = host_and_total({m.name: m.run for m in methods if m.name.endswith("_eager")})
        out[f"H{H}_I{inter}_M{M}"] = got
        print(f"H{H}_I{inter}_M{M}", json.dumps({k: v for k, v in got.items() if "/" in k}), flush=True)
    return out


def prefill(shapes=((4096, 14336), (8192, 28672)), low=2049, high=8192, n=30):
    """Eager calls of the fused Llama blocks (-8B and -70B dims) at row counts that change at
    every call, as chunked prefill gives them: 30 counts drawn from 2049-8192, none twice, after
    one warm-up call at 2047 and one at 2048 rows (Triton compiles a kernel once per kind of row
    count, a multiple of 16 or not: the first of each is not timed). Each call from a
    synchronised GPU: its host time (until it returns) and wall time (until the GPU is done),
    the first time the block sees its row count (``new``: the block binds its launches for it)
    and in a second pass over the same counts (``seen``), beside the same rows through the
    block's PyTorch form in eager mode (``torch``: RMSNorm, cuBLAS GEMMs, SiLU, as
    ``transformers``' LlamaMLP runs). Medians and ranges, and per call new / seen and new / torch."""
    from ctapipelining.nn import LlamaMLP

    rng = random.Random(0)
    out = {}
    for H, inter in shapes:
        wg, wu = rand(inter, H, scale=H**-0.5), rand(inter, H, scale=H**-0.5)
        wd, norm = rand(H, inter, scale=inter**-0.5), 1 + 0.1 * torch.randn(H, device=DEV).bfloat16()
        block = LlamaMLP(wg, wu, wd, norm)

        def pytorch(x, wg=wg, wu=wu, wd=wd, norm=norm):
            h = x.float()
            xn = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16() * norm
            return x + (torch.nn.functional.silu(xn @ wg.t()) * (xn @ wu.t())) @ wd.t()

        def call(fn, x):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(x)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            return (t1 - t0) * 1e3, (time.perf_counter() - t0) * 1e3

        for m in (low - 2, low - 1):  # Triton's two kinds of row count (2047, 2048), compiled once each
            x = rand(m, H)
            block(x), pytorch(x)
        counts = rng.sample(range(low, high + 1), n)
        xs = {m: rand(m, H) for m in counts}
        got = {"new": [call(block, xs[m]) for m in counts], "seen": [], "torch": []}
        for m in counts:
            for name, fn in (("seen", block), ("torch", pytorch)):
                got[name].append(call(fn, xs[m]))
        x = xs[counts[0]]
        assert (block(x).float() - pytorch(x).float()).abs().max() < 0.1 * pytorch(x).float().abs().max()
        row = {"counts": counts}
        for name, v in got.items():
            host, wall = [h for h, _ in v], [w for _, w in v]
            row[name] = {
                "host_ms_median": statistics.median(host), "host_ms_max": max(host),
                "wall_ms_median": statistics.median(wall), "wall_ms_min": min(wall), "wall_ms_max": max(wall),
            }  # fmt: skip
        for num, den in (("new", "seen"), ("new", "torch"), ("seen", "torch")):
            med, lo, hi = median_ci([a[1] / b[1] for a, b in zip(got[num], got[den])])
            row[f"{num}/{den}"] = {"median": med, "ci95": [lo, hi]}
        out[f"H{H}_I{inter}"] = row
        print(f"prefill H{H}_I{inter}", json.dumps({k: v for k, v in row.items() if k != "counts"}), flush=True)
        del xs
    return out


def new_vs_old():
    sys.path.insert(0, OLD)
    import ctapipelining_old.gemm as og
    import ctapipelining_old.kernels.gemm as okg

    try:  # where the old tree keeps Link (its plan module; in older trees its pipeline module, int32 words)
        from ctapipelining_old.plan import Link as OldLink

        old_dtype = torch.int64
    except ImportError:
        from ctapipelining_old.pipeline import Link as OldLink

        old_dtype = torch.int32

    global OLD_CFG
    OLD_CFG = okg.PIPELINE_CONFIG  # the same tiles, parts and signal step, in the old config's fields

    M = 16384
    x, w, w2 = rand(M, K), rand(K, K, scale=K**-0.5), rand(K, K, scale=K**-0.5)
    h, y = torch.empty(M, K, dtype=torch.bfloat16, device=DEV), torch.empty(M, K, dtype=torch.bfloat16, device=DEV)
    cfg, dev = PIPELINE_CONFIG, torch.device(DEV)
    P = grid_size(M, K, K, cfg, dev)
    grid = deps.TileGrid(M, K, cfg.block_m, cfg.block_n)
    dep = deps.build_dependency(grid, grid, "gemm", consumer_k=K, parts=min(cfg.wait_parts, grid.num_n))
    methods = []
    for name, L, launch, i_dt in (("new", Link, None, torch.int64), ("old", OldLink, og.launch_gemm, old_dtype)):
        link = L.create(dep, dev, dev)
        epoch = torch.ones(1, dtype=i_dt, device=DEV)
        err = torch.zeros(8, dtype=i_dt, device=DEV)
        full = L.create(dep, dev, dev)
        # every counter full for run 1 and run 2: this tree's kernels run the one after the epoch
        # tensor's value (the pipeline bumps it after them), an earlier tree's may run its value
        full.counters.copy_(2 * torch.as_tensor(dep.need, dtype=i_dt))
        if name == "new":
            prod = GemmLaunch(M, K, K, cfg, P, dev, signal=link.signal_hook(False), epoch=epoch, err=err)
            cons = GemmLaunch(M, K, K, cfg, P, dev, wait=full.wait_hook(False), epoch=epoch, err=err, stage=1)
            plain = lambda: matmul(x, w, out=y)  # noqa: E731
            run_p, run_c = (lambda p=prod: p(x, w, h)), (lambda c=cons: c(h, w2, y))
        else:
            plain = lambda: og.matmul(x, w, out=y)  # noqa: E731
            sig, wt = link.signal_hook(False), full.wait_hook(False)
            run_p = lambda s=sig, f=launch, e=epoch, r=err: f(x, w, h, OLD_CFG, P, signal=s, epoch=e, err=r)  # noqa: E731
            run_c = lambda t=wt, f=launch, e=epoch, r=err: f(h, w2, y, OLD_CFG, P, wait=t, epoch=e, err=r, stage=1)  # noqa: E731
        methods += [Method(f"plain_{name}", graphed(plain)), Method(f"producer_{name}", graphed(run_p)),
                    Method(f"consumer_{name}", graphed(run_c))]  # fmt: skip
        assert int(err[0]) == 0
    out = paired(methods, [(f"{k}_new", f"{k}_old") for k in ("plain", "producer", "consumer")])
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
