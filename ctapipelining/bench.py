"""One benchmark harness for every method: ``ctapipelining bench``.

Every method is timed by :func:`ctapipelining.timing.time_interleaved` in the same process
and run: an untimed ``prepare`` (a fresh input set, rotated so caches do not flatter), then all
devices synchronised, host clock, the method, all devices synchronised again; the methods take
turns. Warm-up first; median, min, max and the 10th/90th percentiles of ``reps`` runs. Results
go to JSON (raw times, device, versions, the exact command) and CSV; :func:`plot` draws the
paper's Figures 4 and 5 from a results file, so tables and plots are reproducible (and tested)
without a GPU.

The GPU measurements import the kernels, pipelines and baselines inside their functions: those
modules compile Triton kernels and need CUDA, and this module is also imported on CPU-only
machines (the CLI's parser, ``--plot-only``, the model's predictions).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import sim
from .argtypes import UsageError, at_least, existing_file, non_negative_float, positive_int, positive_ints
from .timing import Method, Rotation, capture, environment, median_ci, time_interleaved, time_method
from .trace import clock_offset

METHODS = ("floor_cublas", "floor_triton", "sequential", "microbatch", "tp", "cta_workqueue", "cta_static")
MICROBATCH = ("microbatch", "microbatch_ours")  # chunks of cuBLAS or of our GEMM: the best of both counts
TP = ("tp", "tp_graph", "tp_overlap")  # eager, graph-replayed, all-reduce overlapped: the fastest counts
FLOORS = ("floor_cublas", "floor_triton", "floor_triton_graph")  # one layer on one GPU: the fastest counts


@dataclass
class Row:
    method: str
    seq: int
    ms: list[float] = field(repr=False)
    chunk: int | None = None
    note: str = ""
    positions: list[int] = field(default_factory=list, repr=False)  # place in each repetition's order

    @property
    def median(self) -> float:
        return statistics.median(self.ms)

    def summary(self) -> dict:
        q = statistics.quantiles(self.ms, n=10) if len(self.ms) > 1 else [self.ms[0]] * 9
        return dict(
            method=self.method,
            seq=self.seq,
            chunk=self.chunk,
            median_ms=round(self.median, 4),
            min_ms=round(min(self.ms), 4),
            max_ms=round(max(self.ms), 4),
            p10_ms=round(q[0], 4),
            p90_ms=round(q[-1], 4),
            n=len(self.ms),
            note=self.note,
        )


# --------------------------------------------------------------------------- GPU measurements


def _bench_seq(
    M: int,
    K: int,
    chunks: list[int],
    reps: int,
    warmup: int,
    nsets: int,
    progress,
    gpus: int = 2,
    protocol: dict | None = None,
    ends: str | tuple[int, int] = "balanced",
    layers: int | None = None,
) -> list[Row]:
    """Every method on ``X[M, K]`` through ``layers`` (default ``gpus``) layers ``[K, K]`` on
    ``gpus`` GPUs, each GPU a contiguous range of them (one each: the paper's Figure 4 setup;
    with 2 GPUs, the 2-layer MLP of Figure 5, plus TP). The floor lines run one GPU's share of
    the layers (the most any GPU holds) back to back on cuda:0.
    ``ends``: the ``cta_static_ends`` line's ``Pipeline(ends="balanced")`` (then also
    ``cta_static_ends_tuned``: the same after :meth:`Pipeline.tune_ends`), or its prefill and
    drain rows ((0, 0): no such line)."""
    import torch

    from .baselines import DataParallel, MicroBatch, Sequential, TensorParallel
    from .gemm import matmul
    from .kernels.gemm import ENDS_CONFIG, PIPELINE_CONFIG
    from .pipeline import Pipeline

    devs = list(range(gpus))
    layers = layers or gpus
    last = f"cuda:{gpus - 1}"
    torch.manual_seed(M)
    ws = [(torch.randn(K, K, device=f"cuda:{s * gpus // layers}") / K**0.5).bfloat16() for s in range(layers)]
    A = ws[0]
    share = -(-layers // gpus)  # the most layers one GPU holds
    xs = [torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(nsets)]
    rot = Rotation(xs)
    c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
    c1 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
    peer = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
    out = torch.empty(M, K, dtype=torch.bfloat16, device=last)
    seq = Sequential(ws, M)

    def floor(mm, x):
        """One GPU's share of the layers back to back: ``x @ A`` ``share`` times."""
        for i in range(share):
            mm(x if i == 0 else (c0, c1)[(i - 1) % 2], A, out=(c0, c1)[i % 2])

    methods = [
        Method("floor_cublas", lambda: floor(torch.matmul, rot.x), rot.select),
        Method("floor_triton", lambda: floor(matmul, rot.x), rot.select),
        Method("triton_remote_write", lambda: matmul(rot.x, A, out=peer), rot.select),
    ]
    # our GEMM captured in a CUDA graph, as the pipelines' and micro-batching's lines are: the
    # floor without Python's launch cost (the eager line above includes it)
    x_floor = torch.empty_like(xs[0])
    floor_graph = capture(lambda: floor(matmul, x_floor), [0])
    methods += [
        Method("floor_triton_graph", floor_graph.replay, lambda i: x_floor.copy_(rot.get(i))),
        Method("sequential", seq, lambda i: seq.x.copy_(rot.get(i))),
    ]
    if gpus == 2 == layers:  # Megatron TP of the 2-layer MLP
        tp = TensorParallel(A, ws[1].to("cuda:0"), devs, M)

        def tp_prep(i):
            for xg in tp.x:
                xg.copy_(rot.get(i))

        methods += [Method("tp", tp, tp_prep), Method("tp_compute", lambda: tp(all_reduce=False), tp_prep)]
        # the same graph-captured, plainly and with its all-reduce overlapped chunk by chunk
        for name, tp_chunks in (("tp_graph", 1), ("tp_overlap", 4)):
            tpg = TensorParallel(A, ws[1].to("cuda:0"), devs, M, chunks=tp_chunks, graph=True)
            note = "cuda graph" if tpg.graphed else f"eager ({tpg.graph_error[:80]})"
            methods.append(Method(name, tpg, lambda i, tpg=tpg: [xg.copy_(rot.get(i)) for xg in tpg.x], note=note))
        # data parallelism over rows with a replica of each weight on each GPU (what the ends'
        # replicas could buy instead)
        dp = DataParallel(ws, [torch.device(f"cuda:{d}") for d in devs], M)
        note = "cuda graph" if dp.graphed else f"eager ({dp.graph_error[:80]})"
        methods.append(Method("dp_replicas", dp, lambda i: dp.x.copy_(rot.get(i)), note=note))
    for c in [c for c in chunks if c <= M]:
        for name, gemm in (("microbatch", "cublas"), ("microbatch_ours", "ours")):
            mb = MicroBatch(ws, M, c, gemm=gemm)
            note = "cuda graph" if mb.graphed else f"eager ({mb.graph_error[:80]})"
            methods.append(Method(f"{name}/{c}", mb, lambda i, mb=mb: mb.x.copy_(rot.get(i)), c, note))
    # always pipelined: on one GPU a Pipeline's default runs the stages one after another (one_after_another)
    pipes = {policy: Pipeline(ws, policy=policy, always_pipelined=True) for policy in ("workqueue", "static")}
    for policy, pipe in pipes.items():
        methods.append(Method(f"cta_{policy}", lambda pipe=pipe: pipe(rot.x, out=out, check=False), rot.select))
    # the same calls captured in CUDA graphs (as micro-batching is): GPU time without Python launch cost;
    # plus the static pipeline waiting for whole row-blocks before each tile (what waiting in parts
    # gains) and the static pipeline with both ends filled (ends: "balanced", or explicit rows with split tails)
    x_static = torch.empty_like(xs[0])
    pipes["static_whole_rows"] = Pipeline(ws, config=dataclasses.replace(PIPELINE_CONFIG, wait_parts=1))
    if len(ws) == 2 == gpus and ends == "balanced":
        pipes["static_ends"] = Pipeline(ws, ends="balanced")
        pipes["static_ends_tuned"] = tuned = Pipeline(ws, ends="balanced")
        tuned.tune_ends(M)
    elif len(ws) == 2 == gpus and any(ends):
        pipes["static_ends"] = Pipeline(ws, config=ENDS_CONFIG, prefill_rows=ends[0], drain_rows=ends[1])
    if layers > gpus:  # chain kernels: their interleaved order against stage after stage
        pipes["static_stage_major"] = stage_major = Pipeline(ws, always_pipelined=True)
        for launch in stage_major.plan(M).launches:
            if hasattr(launch.gemm, "set_order"):
                launch.gemm.set_order(None)
    names = ("workqueue", "static", "static_whole_rows", "static_ends", "static_ends_tuned", "static_stage_major")
    for name in [k for k in names if k in pipes]:
        pipe = pipes[name]
        graph = capture(lambda pipe=pipe: pipe(x_static, out=out, check=False), devs)
        R, D = pipe.ends_for(M)
        note = f"prefill {R}, drain {D} rows" if R or D else ""
        if M in pipe.tuning:  # what tune_ends measured: median ms per (prefill, drain)
            note += "; tuned from " + ", ".join(f"{r},{d}: {ms:.4f}" for (r, d), ms in pipe.tuning[M].items())
        methods.append(Method(f"cta_{name}_graph", graph.replay, lambda i: x_static.copy_(rot.get(i)), note=note))
    progress(f"M={M}: {len(methods)} methods, interleaved")
    places: dict[str, list[int]] = {}
    times = time_interleaved(methods, devs, reps, warmup, positions=places, **(protocol or {}))
    for name, pipe in pipes.items():
        pipe.check_errors()
        if not torch.equal(pipe(xs[0]), pipe.sequential(xs[0])):
            raise AssertionError(f"cta_{name}: output differs from the sequential Triton GEMMs at M={M}")
    return [Row(m.name.split("/")[0], M, times[m.name], m.chunk, m.note, places[m.name]) for m in methods]


def _bench_fig7(M: int, K: int, gpus: int, reps: int, warmup: int, nsets: int, progress) -> list[Row]:
    """The 2-layer MLP ``X[M, K] @ A[K, K] @ B[K, K]`` on ``gpus`` GPUs, Figure 7 and the
    referee's ablation: TP over all GPUs, TP over half of them, and 2 stages x TP over half
    (CTA-pipelined shard chains + all-reduce in stage 2), each also without its all-reduce."""
    import torch

    from .baselines import TensorParallel
    from .hybrid import HybridMLP

    devs, half = list(range(gpus)), max(1, gpus // 2)
    torch.manual_seed(M + 7)
    A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
    B = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
    xs = [torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(nsets)]
    methods = []
    for name, group in ((f"fig7_tp{gpus}", devs), (f"fig7_tp{half}", devs[:half])):
        tp = TensorParallel(A, B, group, M)

        def prep(i, tp=tp):
            for xg in tp.x:
                xg.copy_(xs[i % nsets])

        methods += [Method(name, tp, prep), Method(name + "_compute", lambda tp=tp: tp(all_reduce=False), prep)]
    if gpus >= 2:
        for policy in ("static", "workqueue"):
            mlp = HybridMLP(A, B, devs[:half], devs[half : 2 * half], policy=policy)
            reps_x = [[x.to(d) for d in mlp.stage1] for x in xs]
            cur = {"x": reps_x[0]}
            pick = lambda i, cur=cur, reps_x=reps_x: cur.update(x=reps_x[i % nsets])  # noqa: E731
            name = f"fig7_hybrid2x{half}_{policy}"
            methods += [
                Method(name, lambda m=mlp, c=cur: m(c["x"], check=False), pick),
                Method(name + "_compute", lambda m=mlp, c=cur: m(c["x"], all_reduce=False, check=False), pick),
            ]
    progress(f"fig7 M={M}: {len(methods)} methods, interleaved")
    times = time_interleaved(methods, devs, reps, warmup)
    return [Row(m.name, M, times[m.name]) for m in methods]


def _bench_hooks(M: int, K: int, reps: int, warmup: int, progress) -> list[Row]:
    """Each hook in isolation (Triton GEMM at [M, K] x [K, K]): signal cost, prologue cost
    (static: waiting in parts, and for whole row-blocks), cross-GPU visibility latency."""
    import torch

    from .gemm import matmul
    from .kernels.gemm import PIPELINE_CONFIG
    from .pipeline import Pipeline

    devs = [0, 1]
    A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
    B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
    x = torch.randn(M, K, device="cuda:0").bfloat16()
    rows: list[Row] = []
    out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
    whole_rows = dataclasses.replace(PIPELINE_CONFIG, wait_parts=1)
    for policy, name, cfg in [
        ("workqueue", "workqueue", None),
        ("static", "static", None),
        ("static", "static_whole_rows", whole_rows),
    ]:
        pipe = Pipeline([A, B], policy=policy, config=cfg)
        plan = pipe.plan(M)
        pipe(x)
        progress(f"hooks {name}: producer with signal")
        # producer alone (the consumer never runs): the remote writes plus the signal epilogue
        producer = lambda pipe=pipe, plan=plan: pipe._launch(plan, x, out, only=[0])  # noqa: E731
        ms = time_method(producer, lambda i: None, devs, reps, warmup)
        rows.append(Row(f"producer_signal_{name}", M, ms))
        pipe.reset()
        # consumer alone with its whole input already signalled: the prologue (wait/pop) cost (its
        # launch against the producer's epoch queues two one-element epoch updates around it)
        progress(f"hooks {name}: consumer prologue")
        consumer_ms = time_method(
            lambda pipe=pipe, plan=plan: pipe._launch(plan, x, out, only=[1], advance_epoch=False),
            lambda i, pipe=pipe, plan=plan: pipe._launch(plan, x, out, only=[0]),  # untimed: the producer's run
            devs,
            reps,
            warmup,
        )
        pipe.check_errors(plan)
        rows.append(Row(f"consumer_prologue_{name}", M, consumer_ms))
        pipe.reset()
    progress("hooks: plain consumer GEMM on GPU1")
    x1 = x.to("cuda:1")
    rows.append(
        Row("floor_triton_gpu1", M, time_method(lambda: matmul(x1, B, out=out), lambda i: None, devs, reps, warmup))
    )
    # cross-GPU visibility: flag ping-pong (one way), five samples
    progress("hooks: cross-GPU ping-pong")
    links = [clock_offset(0, 1, rounds=2000, samples=1) for _ in range(5)]
    rows.append(Row("visibility_one_way", M, [lk.one_way_ns / 1e6 for lk in links], note="2000 round trips per sample"))
    return rows


# --------------------------------------------------------------------------- tables and plots


def table(summaries: list[dict]) -> str:
    """Fixed-width table with each method's median as a ratio to the Triton floor (our GEMM
    replayed from a CUDA graph where the run has that line, else called eagerly)."""
    floors = {s["seq"]: s["median_ms"] for s in summaries if s["method"] == "floor_triton"}
    floors |= {s["seq"]: s["median_ms"] for s in summaries if s["method"] == "floor_triton_graph"}
    lines = [f"{'method':28s} {'seq':>6s} {'chunk':>6s} {'median':>9s} {'min':>8s} {'max':>8s} {'/floor':>7s}"]
    for s in summaries:
        f = floors.get(s["seq"])
        ratio = f"{s['median_ms'] / f:7.3f}" if f else " " * 7
        chunk = str(s["chunk"]) if s["chunk"] else "-"
        lines.append(
            f"{s['method']:28s} {s['seq']:6d} {chunk:>6s} "
            f"{s['median_ms']:9.4f} {s['min_ms']:8.4f} {s['max_ms']:8.4f} {ratio}"
        )
    return "\n".join(lines)


def headline(summaries: list[dict], raw: list[dict] | None = None) -> list[dict]:
    """Per sequence length: the best CTA-pipelining line over best micro-batching, TP and the
    floor (the fastest of cuBLAS and our Triton GEMM). With ``raw`` (the results' raw rows,
    times in repetition order), also the paired ratio to the best micro-batching: the median of
    the per-repetition ratios, each repetition's two runs taken a second apart at most."""
    ms = {(r["method"], r["seq"], r["chunk"]): r["ms"] for r in raw or []}
    out = []
    for seq in sorted({s["seq"] for s in summaries}):
        rows = [s for s in summaries if s["seq"] == seq]
        cta = [s for s in rows if s["method"].startswith("cta_")]
        mb = [s for s in rows if s["method"] in MICROBATCH]
        tp = sorted((s for s in rows if s["method"] in TP), key=lambda s: s["median_ms"])[:1]  # the fastest TP
        floors = [s for s in rows if s["method"] in FLOORS]
        if not (cta and mb and floors):
            continue
        best = min(cta, key=lambda s: s["median_ms"])
        best_mb = min(mb, key=lambda s: s["median_ms"])
        floor = min(s["median_ms"] for s in floors)
        h = dict(
            seq=seq,
            cta_method=best["method"],
            cta_ms=best["median_ms"],
            best_microbatch_ms=best_mb["median_ms"],
            best_chunk=best_mb["chunk"],
            best_microbatch=best_mb["method"],
            tp_method=tp[0]["method"] if tp else None,
            tp_ms=tp[0]["median_ms"] if tp else None,
            floor_ms=floor,
            cta_over_microbatch=round(best["median_ms"] / best_mb["median_ms"], 4),
            cta_over_tp=round(best["median_ms"] / tp[0]["median_ms"], 4) if tp else None,
            cta_over_floor=round(best["median_ms"] / floor, 4),
        )
        # with weight replicas (the ends), the fair comparison includes data parallelism over rows
        # with the same replicas: the two settings apart
        placed = [s for s in cta if "ends" not in s["method"]]
        ends = [s for s in cta if "ends" in s["method"]]
        dp = [s for s in rows if s["method"] == "dp_replicas"]
        if placed:
            h["cta_weights_placed_once_ms"] = min(s["median_ms"] for s in placed)
        if ends and dp:
            h["cta_replicated_ms"] = min(s["median_ms"] for s in ends)
            h["dp_replicas_ms"] = dp[0]["median_ms"]
            h["cta_replicated_over_dp"] = round(h["cta_replicated_ms"] / dp[0]["median_ms"], 4)
        if raw is not None:
            a, b = ms.get((best["method"], seq, None)), ms.get((best_mb["method"], seq, best_mb["chunk"]))
            if a and b and len(a) == len(b):
                h["cta_over_microbatch_paired"] = round(statistics.median(x / y for x, y in zip(a, b)), 4)
        out.append(h)
    return out


def _fastest(lines: dict[tuple, list[float]], pred) -> tuple | None:
    """The ``(method, chunk)`` of ``lines`` whose method passes ``pred`` with the lowest median."""
    keys = [k for k in lines if pred(k[0])]
    return min(keys, key=lambda k: statistics.median(lines[k])) if keys else None


def decision(raw: list[dict]) -> list[dict]:
    """Per input height: against the strongest fair baseline of each setting, how fast is
    CTA-pipelining? Two settings: weights placed once (the chain without
    weight replicas) and with replicas (the chain with ``ends``; data parallelism over rows
    with the same replicas is then also fair). Each baseline is its fastest line by median (the
    best chunk of cuBLAS or our GEMM for micro-batching, the fastest TP); each ratio is paired:
    the median of per-repetition ratios (the two runs of a repetition taken together), with its
    95% confidence interval (:func:`median_ci`). Below 1: CTA-pipelining is faster."""
    by: dict[int, dict[tuple, list[float]]] = {}
    for r in raw:
        by.setdefault(r["seq"], {})[(r["method"], r["chunk"])] = r["ms"]
    out = []
    for seq, lines in sorted(by.items()):
        settings = {
            "placed_once": _fastest(lines, lambda m: m.startswith("cta_") and "ends" not in m),
            "replicated": _fastest(lines, lambda m: m.startswith("cta_") and "ends" in m),
        }
        baselines = {
            "microbatch": _fastest(lines, lambda m: m in MICROBATCH),
            "tp": _fastest(lines, lambda m: m in TP),
            "dp_replicas": _fastest(lines, lambda m: m == "dp_replicas"),
            "floor": _fastest(lines, lambda m: m in FLOORS),
        }
        for setting, mine in settings.items():
            if mine is None:
                continue
            row = dict(seq=seq, setting=setting, method=mine[0], ms=round(statistics.median(lines[mine]), 4))
            for name, base in baselines.items():
                if base is None or (name == "dp_replicas" and setting == "placed_once"):
                    continue  # data parallelism needs the replicas that only the second setting has
                a, b = lines[mine], lines[base]
                if len(a) != len(b):
                    continue
                med, lo, hi = median_ci([x / y for x, y in zip(a, b)])
                label = base[0] if base[1] is None else f"{base[0]}/{base[1]}"
                row[name] = dict(line=label, ratio=round(med, 4), ci95=[round(lo, 4), round(hi, 4)])
            out.append(row)
    return out


def decision_table(rows: list[dict]) -> str:
    """:func:`decision` as text: ratio [95% CI] against each baseline (its line in brackets)."""
    lines = []
    for r in rows:
        cells = [f"{r['seq']:6d} {r['setting']:12s} {r['method']:28s} {r['ms']:8.4f} ms"]
        for name in ("microbatch", "tp", "dp_replicas", "floor"):
            if name in r:
                c = r[name]
                cells.append(f"{name} {c['ratio']:.3f} [{c['ci95'][0]:.3f}, {c['ci95'][1]:.3f}] ({c['line']})")
        lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(results: dict, out_dir: Path) -> list[Path]:
    """Figure 4 (reduction vs micro-batching per chunk) and Figure 5 (latency vs sequence)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sums = results["summaries"]
    paths = []
    seqs = sorted({s["seq"] for s in sums if s["method"] == "microbatch"})
    if seqs:
        seq = max(seqs)
        cta = min(s["median_ms"] for s in sums if s["seq"] == seq and s["method"].startswith("cta_"))
        mb = sorted((s for s in sums if s["seq"] == seq and s["method"] == "microbatch"), key=lambda s: s["chunk"])
        fig, ax = plt.subplots(figsize=(6, 3.5))
        red = [100 * (1 - cta / s["median_ms"]) for s in mb]
        ax.bar([str(s["chunk"]) for s in mb], red, color="tab:blue")
        ax.axhline(0, color="k", lw=0.8)
        ax.set_xlabel("micro-batching chunk size (rows)")
        ax.set_ylabel("latency reduction of CTA-pipelining (%)")
        g = results.get("gpus", 2)
        ax.set_title(f"Fig. 4: {g} GPUs, X[{seq},K] through {results.get('layers', g)} layers")
        for i, r in enumerate(red):
            ax.text(i, r, f"{r:.1f}", ha="center", va="bottom" if r >= 0 else "top", fontsize=8)
        fig.tight_layout()
        p = out_dir / "fig4_reduction_vs_microbatch.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    heads = headline(sums)
    if heads:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        xs = [h["seq"] for h in heads]
        for key, label in (
            ("cta_ms", "CTA-pipelining"),
            ("best_microbatch_ms", "micro-batching (best chunk)"),
            ("tp_ms", "tensor parallel (NCCL)"),
        ):
            if all(h[key] is not None for h in heads):  # no TP line for chains of more than 2 GPUs
                ax.plot(xs, [h[key] for h in heads], marker="o", label=label)
        seq_ms = [next(s["median_ms"] for s in sums if s["seq"] == x and s["method"] == "sequential") for x in xs]
        ax.plot(xs, seq_ms, marker="o", label="sequential")
        ax.plot(xs, [h["floor_ms"] for h in heads], ls="--", color="gray", label="one layer (floor)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length (rows of X)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"Fig. 5: {results.get('gpus', 2)}-layer chain on {results.get('gpus', 2)} GPUs")
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / "fig5_latency_vs_seq.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


# --------------------------------------------------------------------------- CLI


def ends_arg(s: str) -> str | tuple[int, int]:
    """``--ends``: ``"balanced"`` or two row counts ``R,D`` >= 0."""
    if s == "balanced":
        return s
    try:
        rows = tuple(int(v) for v in s.split(","))
    except ValueError:
        rows = ()
    if len(rows) != 2 or min(rows) < 0:
        raise argparse.ArgumentTypeError(f"takes 'balanced' or two row counts >= 0 (prefill,drain), got {s!r}")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``ctapipelining bench``."""
    p.add_argument("--seq", type=positive_ints, default="1024,2048,4096,8192,16384", help="rows of X (comma-separated)")
    p.add_argument("--k", type=positive_int, default=8192, help="hidden size: A and B are [k, k]")
    p.add_argument("--chunks", type=positive_ints, default="512,1024,2048,4096,8192", help="micro-batching chunk sizes")
    p.add_argument("--gpus", type=at_least(2), default=2, help="N: the chain on N GPUs (TP only for N = 2 layers)")
    p.add_argument(
        "--layers", type=positive_int, default=None,
        help="layers of the chain (default: one per GPU; more: each GPU a contiguous range, run as one chain kernel)",
    )  # fmt: skip
    p.add_argument("--reps", type=at_least(3), default=30, help="timed repetitions of every method")
    p.add_argument("--warmup", type=at_least(0), default=5, help="untimed repetitions first")
    p.add_argument("--sets", type=positive_int, default=3, help="input sets rotated between runs")
    p.add_argument(
        "--order", choices=("shuffled", "fixed"), default="shuffled",
        help="methods' order within a repetition: a fresh random one each time (seeded), or as listed",
    )  # fmt: skip
    p.add_argument("--rest-ms", type=non_negative_float, default=0.0, help="idle milliseconds before each timed run")
    p.add_argument(
        "--ends", type=ends_arg, default="balanced",
        help="the cta_static_ends line: 'balanced' (Pipeline(ends='balanced')) or prefill,drain rows (0,0: no line)",
    )  # fmt: skip
    p.add_argument("--hooks-seq", type=at_least(0), default=16384, help="M of the hook-cost measurements (0: skip)")
    p.add_argument("--fig7-seq", type=at_least(0), default=0, help="M of the TP vs CTA x TP comparison (0: skip)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for JSON, CSV, PNG")
    p.add_argument(
        "--plot-only", type=existing_file, default=None, metavar="RESULTS",
        help="re-draw tables and plots from a results JSON instead of timing",
    )  # fmt: skip


def _print_predictions(seqs: list[int], K: int) -> None:
    """What the calibrated model (:mod:`ctapipelining.sim`) predicts for this bench: no GPU needed."""
    cal = sim.Calibration.default()
    print(f"\nModel predictions instead (NOT measured; model calibrated on {cal.label}), ms:")
    keys = ("floor_cublas", "sequential", "tp", "microbatch_best", "cta_static_graph", "cta_workqueue_graph")
    print(f"{'seq':>6s} " + " ".join(f"{k:>20s}" for k in keys))
    for M in seqs:
        p = sim.predict_2gpu(M, K, cal)
        print(f"{M:6d} " + " ".join(f"{p[k]:20.3f}" for k in keys))


def _read_results(path: Path) -> dict:
    try:
        results = json.loads(path.read_text())
        results["summaries"][0]["median_ms"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UsageError(f"--plot-only {path}: not a bench results file ({type(e).__name__}: {e})") from None
    return results


def run(args) -> int:
    """``ctapipelining bench``: time every method (2+ GPUs), or re-draw recorded results."""
    if args.plot_only:
        results = _read_results(args.plot_only)
        args.out.mkdir(parents=True, exist_ok=True)
        print(table(results["summaries"]))
        if results.get("raw"):
            print("\ndecision (paired ratios, 95% CI):\n" + decision_table(decision(results["raw"])))
        for p in plot(results, args.out):
            print("wrote", p)
        return 0
    ends = args.ends
    if args.layers is not None and args.layers < args.gpus:
        raise UsageError(f"--layers {args.layers}: fewer than the {args.gpus} GPUs (each GPU holds at least one)")
    import torch  # here: the parser and --plot-only do without it

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < max(2, args.gpus):
        print(f"bench needs {max(2, args.gpus)} GPUs with peer access; found {n}. Nothing timed.")
        if args.gpus == 2:
            _print_predictions(args.seq, args.k)
        print("\n`ctapipelining demo` runs the protocol on the CPU; `--plot-only FILE` re-draws recorded results.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # progress is optional
        tqdm = None
    total = len(args.seq) + (6 if args.hooks_seq else 0) + (1 if args.fig7_seq else 0)
    bar = tqdm(total=total, file=sys.stderr, mininterval=2) if tqdm else None

    def progress(msg):
        if bar:
            bar.set_description(msg[:40])
            bar.update(1)
        else:
            print(msg, file=sys.stderr, flush=True)

    protocol = dict(order=args.order, rest_ms=args.rest_ms, seed=0)
    env = environment()

    def save(rows: list[Row]) -> tuple[list[dict], dict]:
        """Write what is measured so far (after each size: a run cut short keeps its sizes)."""
        sums = [r.summary() for r in rows]
        raw = [dict(asdict(r)) for r in rows]
        results = dict(
            gpus=args.gpus,
            layers=args.layers or args.gpus,
            environment=env,
            k=args.k,
            summaries=sums,
            protocol=protocol,
            ends=ends if ends == "balanced" else dict(prefill_rows=ends[0], drain_rows=ends[1]),
            headline=headline(sums, raw),
            decision=decision(raw),
            raw=raw,
        )
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        with open(args.out / "results.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(sums[0]))
            w.writeheader()
            w.writerows(sums)
        return sums, results

    rows: list[Row] = []
    for M in args.seq:
        rows += _bench_seq(
            M, args.k, args.chunks, args.reps, args.warmup, args.sets, progress, args.gpus, protocol, ends, args.layers
        )
        save(rows)
        torch.cuda.empty_cache()
    if args.hooks_seq:
        rows += _bench_hooks(args.hooks_seq, args.k, args.reps, args.warmup, progress)
    if args.fig7_seq:
        rows += _bench_fig7(args.fig7_seq, args.k, args.gpus, args.reps, args.warmup, args.sets, progress)
    if bar:
        bar.close()
    sums, results = save(rows)
    print(table(sums))
    print("\ndecision (paired ratios, 95% CI):\n" + decision_table(results["decision"]))
    print("\nheadline (CTA-pipelining = best of both policies):")
    for h in results["headline"]:
        print("  " + json.dumps(h))
    for p in plot(results, args.out):
        print("wrote", p)
    return 0
