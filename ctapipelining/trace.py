"""Trace mode: per-tile ``%globaltimer`` stamps of every stage, on one time axis.

With ``Pipeline(..., trace=True)`` each stage writes, per tile, when its CTA began waiting,
began computing, had stored the tile, and had finished the epilogue (signal), and which CTA
it was (``TRACE`` is a constexpr: off, the kernel has no stamps at all). This module turns
those rows into the protocol's costs and a timeline in the spirit of the paper's Figures 2
and 3b:

* **T1**, signal cost: producer ``epilogue done - stored`` (the time the epilogue holds the
  SM). The epilogue only notes the tile: it is signalled a quarter into the CTA's next tile,
  inside that tile's K loop, where the cost is hidden;
* **T2**, cross-GPU visibility: one way of a flag ping-pong between the two GPUs, and, from
  the trace, how long after its last input tile's epilogue a consumer tile started (this
  includes the quarter-tile lag before the signal);
* **T3**, fetch cost: consumer ``compute begun - wait begun`` for tiles whose inputs had all
  been signalled before the wait began (the prologue's own cost: pop or poll, fence).

The two GPUs' clocks differ by an offset, estimated from the ping-pong's last round
(:func:`clock_offset`), and GPU ``s``'s stamps are shifted onto GPU 0's axis.

The summaries and the timeline need NumPy only (the simulator draws its predicted timelines
with :func:`plot_timeline`); the functions that run on GPUs import the kernels, the fabric and
the pipeline inside themselves, so importing this module compiles nothing and needs no CUDA.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import deps
from .argtypes import positive_int

WAIT, START, STORED, DONE, CTA = range(5)


@dataclass
class ClockLink:
    offset_ns: float  # GPU b's clock minus GPU a's
    one_way_ns: float  # visibility latency of a release store into the peer, seen by its acquire


def clock_offset(a: int = 0, b: int = 1, rounds: int = 1000, samples: int = 5) -> ClockLink:
    """Ping-pong a flag between GPUs ``a`` and ``b``; median over ``samples`` runs."""
    import torch

    from .fabric import enable_peer_access  # GPU-only: see the module docstring
    from .kernels.probe import pingpong_kernel

    enable_peer_access([a, b])
    enable_peer_access([b, a])
    flags = {d: torch.zeros(1, dtype=torch.int32, device=f"cuda:{d}") for d in (a, b)}
    res = {d: torch.zeros(4, dtype=torch.int64, device=f"cuda:{d}") for d in (a, b)}
    offsets, one_way = [], []
    for _ in range(samples):
        for f in flags.values():
            f.zero_()
        for d in (a, b):
            torch.cuda.synchronize(d)
        with torch.cuda.device(b):
            pingpong_kernel[(1,)](flags[b], flags[a], res[b], rounds, 2_000_000_000, SERVE=False, num_warps=1)
        with torch.cuda.device(a):
            pingpong_kernel[(1,)](flags[a], flags[b], res[a], rounds, 2_000_000_000, SERVE=True, num_warps=1)
        for d in (a, b):
            torch.cuda.synchronize(d)
        ea, eb = res[a].tolist(), res[b].tolist()
        if ea[1] != rounds:
            raise RuntimeError(f"ping-pong cuda:{a} <-> cuda:{b} completed {ea[1]} of {rounds} rounds")
        one_way.append(ea[0] / (2 * rounds))
        offsets.append(eb[3] - (ea[2] + ea[3]) / 2)
    return ClockLink(float(np.median(offsets)), float(np.median(one_way)))


def summarize(traces: list[np.ndarray], links: list[deps.Dependency], offsets_ns: list[float]) -> dict:
    """T1, T2, T3 (microseconds: median, min, max) from stage traces ``[tiles, 5]`` (ns)."""

    def stats(v):
        v = np.asarray(v, dtype=np.float64) / 1e3
        return dict(median_us=round(float(np.median(v)), 3), min_us=round(float(v.min()), 3),
                    max_us=round(float(v.max()), 3), n=int(v.size)) if v.size else None  # fmt: skip

    shifted = [t.astype(np.float64) for t in traces]
    for s, t in enumerate(shifted):
        t[:, WAIT:CTA] -= offsets_ns[s]
    out: dict = {"stages": []}
    for s, t in enumerate(shifted):
        out["stages"].append(
            dict(stage=s, tiles=len(t), span_ms=round((t[:, DONE].max() - t[:, START].min()) / 1e6, 4))
        )
    t1, t2, t3 = [], [], []
    for s, dep in enumerate(links):
        prod, cons = shifted[s], shifted[s + 1]
        t1 += list(prod[:, DONE] - prod[:, STORED])
        last_signal = np.array([prod[list(dep.needs(c)), DONE].max() for c in range(len(cons))])
        t2 += list(cons[:, START] - last_signal)
        ready = last_signal <= cons[:, WAIT]
        t3 += list(cons[ready, START] - cons[ready, WAIT])
    out["T1_signal"] = stats(t1)
    out["T2_signal_to_consumer_start"] = stats(t2)
    out["T3_fetch_when_ready"] = stats(t3)
    return out


def plot_timeline(traces: list[np.ndarray], offsets_ns: list[float], path: Path, title: str = "") -> Path:
    """One panel per stage: a row per CTA, compute (dark), epilogue (red) and waits (grey),
    all on GPU 0's time axis in ms from the first tile's start."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(float(t[:, START].min()) - off for t, off in zip(traces, offsets_ns))
    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 2.2 * len(traces) + 0.6), sharex=True, squeeze=False)
    for s, (t, off) in enumerate(zip(traces, offsets_ns)):
        ax = axes[s][0]
        ms = (t[:, WAIT:CTA].astype(np.float64) - off - t0) / 1e6
        cta = t[:, CTA]
        for lo, hi, color in ((WAIT, START, "0.8"), (START, STORED, "tab:blue"), (STORED, DONE, "tab:red")):
            w = ms[:, hi] - ms[:, lo]
            ax.barh(cta, w, left=ms[:, lo], height=1.0, color=color, linewidth=0)
        ax.set_ylabel(f"stage {s}\nCTA")
        ax.set_ylim(-1, cta.max() + 1)
    axes[-1][0].set_xlabel("ms (GPU 0 clock)")
    axes[0][0].set_title(title or "CTA-pipelining timeline: wait (grey), compute (blue), epilogue/signal (red)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> int:
    """``ctapipelining trace``: one traced call of a 2-stage chain; PNG, JSON and T1/T2/T3."""
    import torch

    from .pipeline import Pipeline  # GPU-only: see the module docstring

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(f"trace needs 2 GPUs with peer access; found {n}. Nothing traced.")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    K = args.k
    A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
    B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
    x = torch.randn(args.seq, K, device="cuda:0").bfloat16()
    link = clock_offset(0, 1)
    pipe = Pipeline([A, B], policy=args.policy, trace=True)
    for _ in range(3):  # warm-up, then the traced call is the last one; each checked (it waits)
        pipe(x, check=True)
    traces = pipe.traces(args.seq)
    offsets = [0.0, link.offset_ns]
    summary = summarize(traces, [lk.dep for lk in pipe.plan(args.seq).links], offsets)
    summary["T2_pingpong_one_way_us"] = round(link.one_way_ns / 1e3, 3)
    summary["clock_offset_ns"] = link.offset_ns
    name = f"timeline_{args.policy}_{args.seq}"
    plot_timeline(traces, offsets, args.out / f"{name}.png", f"X[{args.seq},{K}] @ A @ B, {args.policy}")
    (args.out / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    print("wrote", args.out / f"{name}.png")
    return 0


def add_arguments(p) -> None:
    """The options of ``ctapipelining trace``."""
    p.add_argument("--seq", type=positive_int, default=16384, help="rows of X")
    p.add_argument("--k", type=positive_int, default=8192, help="hidden size: A and B are [k, k]")
    p.add_argument("--policy", choices=["workqueue", "static"], default="workqueue", help="the consumer's policy")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for the timeline PNG and JSON")
