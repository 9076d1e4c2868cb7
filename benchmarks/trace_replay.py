"""Where a graph-replayed chain spends its time: traced pipelines, captured and replayed.

usage: python3 benchmarks/trace_replay.py OUT_DIR [M] [REPLAYS] [REST_MS]

``ctapipelining trace`` traces one *eager* call, whose consumer starts when the host gets to
launching it. This replays each variant's traced pipeline ``REPLAYS`` times from a CUDA graph
(as the benchmark does) and reads the stamps of the last replay, all on GPU 0's clock:
when each stage's first tile started and last tile ended (GPU 1's stamps placed by the clock
offset measured right after that variant's replays), when the full rounds were done,
and, per consumer round, how long after the producer's same round the consumer round
started. The single-stage "pipeline" is the plain GEMM with stamps (the floor's rounds).
With ``REST_MS`` > 0, the plain GEMM and the default chain are traced a second time
("..._rested"), their traced replay coming after ``REST_MS`` of idle GPUs (the bench's
``--rest-ms``): where a call from rest loses its time.
Writes OUT_DIR/trace_replay.json, the raw stamps (``trace_replay_stamps.npz``: per variant and
stage ``[tiles, 5]`` ns, GPU-own clocks, and the offset) and a timeline PNG per variant.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ctapipelining import deps, trace
from ctapipelining.bench import chain_operands
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import capture

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
REPLAYS = int(sys.argv[3]) if len(sys.argv) > 3 else 10
REST_MS = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
K = 8192
out_dir.mkdir(parents=True, exist_ok=True)
x, A, B = chain_operands(M, K)
link = trace.clock_offset(0, 1, rounds=200)
VARIANTS = {
    "plain": ([A], dataclasses.replace(PIPELINE_CONFIG, split_tail=False)),
    "static_parts1": ([A, B], dataclasses.replace(PIPELINE_CONFIG, wait_parts=1)),
    "static_parts4": ([A, B], dataclasses.replace(PIPELINE_CONFIG, wait_parts=4)),
    "static_parts8": ([A, B], dataclasses.replace(PIPELINE_CONFIG, wait_parts=8)),
}
if REST_MS > 0:
    VARIANTS |= {"plain_rested": VARIANTS["plain"], "static_parts8_rested": VARIANTS["static_parts8"]}


def analyse(pipe: Pipeline, stamps: list[np.ndarray], offset_ns: float) -> dict:
    cfg = pipe.config
    ms = lambda t: round(float(t) / 1e6, 4)  # noqa: E731
    shifted = [t[:, :4].astype(np.float64) - (0.0 if s == 0 else offset_ns) for s, t in enumerate(stamps)]
    t0 = shifted[0][:, trace.START].min()
    out = dict(chain_ms=ms(shifted[-1][:, trace.DONE].max() - t0), stages=[])
    round_ends = []
    for s, t in enumerate(shifted):
        grid = deps.TileGrid(M, pipe.weights[s].shape[1], cfg.block_m, cfg.block_n)
        order = deps.tile_order(grid, cfg.group_m)  # order[pos] = tile
        P = pipe.plan(M).num_ctas[s]
        full = (grid.num_tiles // P) * P
        start, done = t[order, trace.START] - t0, t[order, trace.DONE] - t0  # by position
        rounds = [slice(r, min(r + P, grid.num_tiles)) for r in range(0, grid.num_tiles, P)]
        round_ends.append([done[r].max() for r in rounds])
        stage = dict(
            first_start_ms=ms(start.min()),
            full_rounds_done_ms=ms(done[:full].max()),
            last_done_ms=ms(done.max()),
            tile_us_median=round(float(np.median(t[:, trace.STORED] - t[:, trace.START]) / 1e3), 2),
            waited_ms_per_cta=ms((t[:, trace.START] - t[:, trace.WAIT]).sum() / P),
        )
        tile_ns = t[order, trace.STORED] - t[order, trace.START]  # by position
        stage["round_tile_us"] = [round(float(np.median(tile_ns[r])) / 1e3, 1) for r in rounds]
        if s > 0:  # consumer round r began (median tile) this long after producer round r ended
            lag = [(np.median(start[r]) - round_ends[s - 1][i]) / 1e3 for i, r in enumerate(rounds)]
            stage["round_lag_us"] = [round(float(v), 1) for v in lag]
        out["stages"].append(stage)
    return out


report = dict(M=M, K=K, replays=REPLAYS, rest_ms=REST_MS, offset_ns=link.offset_ns, one_way_ns=link.one_way_ns)
report["variants"] = {}
raw = {}  # every stage's stamps, for analyses not thought of yet
pipes = []  # a CUDA graph keeps addresses, not buffers: keep every pipeline alive
for name, (ws, cfg) in VARIANTS.items():
    pipe = Pipeline(ws, config=cfg, trace=True)
    pipes.append(pipe)
    out = torch.empty(M, ws[-1].shape[1], dtype=torch.bfloat16, device=ws[-1].device)
    g = capture(lambda pipe=pipe, out=out: pipe(x, out=out, check=False), [0, 1])
    for _ in range(REPLAYS):
        g.replay()
    if name.endswith("_rested"):  # the traced (last) replay starts from idle GPUs
        for d in (0, 1):
            torch.cuda.synchronize(d)
        time.sleep(REST_MS / 1e3)
        g.replay()
    for d in (0, 1):
        torch.cuda.synchronize(d)
    pipe.check_errors()
    stamps = pipe.traces(M)
    # the two GPUs' %globaltimer drift apart (~40 us/s in s4/bench): the offset measured right
    # after this variant's replays, not the one of the run's start, places GPU 1's stamps
    after = trace.clock_offset(0, 1, rounds=200)
    report.setdefault("offset_after_ns", {})[name] = after.offset_ns
    raw.update({f"{name}_stage{s}": t for s, t in enumerate(stamps)})
    raw[f"{name}_offset_ns"] = np.array(after.offset_ns)
    report["variants"][name] = r = analyse(pipe, stamps, after.offset_ns)
    offsets = [0.0, after.offset_ns][: len(ws)]
    trace.plot_timeline(stamps, offsets, out_dir / f"replay_{name}.png", f"X[{M},{K}] replayed, {name}")
    brief = {k: v for k, v in r.items() if k != "stages"} | {
        f"stage{s}": {k: v for k, v in st.items() if k not in ("round_lag_us", "round_tile_us")}
        for s, st in enumerate(r["stages"])
    }
    print(name, json.dumps(brief), flush=True)
    for s, st in enumerate(r["stages"]):
        print(f"  stage {s} median tile per round (us):", st["round_tile_us"], flush=True)
    if len(r["stages"]) > 1:
        print("  consumer round lag (us):", r["stages"][1]["round_lag_us"], flush=True)
(out_dir / "trace_replay.json").write_text(json.dumps(report, indent=1))
np.savez_compressed(out_dir / "trace_replay_stamps.npz", offset_ns=link.offset_ns, **raw)
