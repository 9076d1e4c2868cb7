"""Pipeline variants and GEMM configurations at one shape, all in one interleaved run.

usage: python3 benchmarks/tune_transport.py OUT_DIR [M] [K] [REPS]
       TUNE_ENDS="R,D R,D ..." (optional): the pipelines with these prefill,drain rows instead

Everything that issue 3's speed target compares, replayed from CUDA graphs and timed by the
same interleaved harness as ``ctapipelining bench`` (so only ratios inside this run count):
cuBLAS one layer; our plain GEMM under several configurations (the floor each pipeline
variant is held against); cuBLAS micro-batching at every chunk; Megatron TP; CTA-pipelining
variants (waiting for the input in parts, the second GPU prefilling the first rows, the first GPU
draining the last rows, split tails, policy);
the producer alone. (Earlier versions also timed a copy-engine transport; see the
results README.) Every pipeline is checked bitwise against the sequential Triton GEMMs (eager
and replayed) before it is timed.
Writes OUT_DIR/tune_transport.json and prints a table with ratios.
"""

import dataclasses
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

import torch

from ctapipelining.baselines import MicroBatch, TensorParallel
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import PIPELINE_CONFIG, PLAIN_CONFIG
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, Rotation, capture, environment, time_interleaved

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
M = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
K = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
REPS = int(sys.argv[4]) if len(sys.argv) > 4 else 25
WARM, DEVS, CHUNKS = 5, [0, 1], [512, 1024, 2048]  # 4096 and 8192 never won (tune-a..g)
out_dir.mkdir(parents=True, exist_ok=True)
torch.manual_seed(0)
A = (torch.randn(K, K, device="cuda:0") / K**0.5).bfloat16()
B = (torch.randn(K, K, device="cuda:1") / K**0.5).bfloat16()
rot = Rotation([torch.randn(M, K, device="cuda:0").bfloat16() for _ in range(3)])
x_static = torch.empty_like(rot.xs[0])
c0 = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0")
out = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:1")
feed = lambda i: x_static.copy_(rot.get(i))  # noqa: E731  (untimed: the graph reads x_static)
methods: list[Method] = []
notes: dict[str, str] = {}


def log(msg):
    print(msg, flush=True)


def guarded(name, build):
    """Build one method; a failure is printed and recorded, never fatal."""
    try:
        m = build()
        methods.extend(m if isinstance(m, list) else [m] if m is not None else [])
    except Exception as e:
        notes[name] = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}"
        log(f"{name}: {notes[name]}")
        traceback.print_exc(limit=2)


# -- floors ------------------------------------------------------------------------------------
methods.append(Method("cublas", lambda: torch.matmul(rot.x, A, out=c0), rot.select))
split = lambda cfg, on=True: dataclasses.replace(cfg, split_tail=on)  # noqa: E731
PLAIN = {
    "plain_g8_tma_flatten (PLAIN_CONFIG, split tail)": PLAIN_CONFIG,
    "plain_g8_tma_flatten_whole_tail": split(PLAIN_CONFIG, False),
    "plain_g4_flatten (PIPELINE_CONFIG)": split(PIPELINE_CONFIG, False),
}
for name, cfg in PLAIN.items():

    def build(cfg=cfg, name=name):
        log(f"compiling {name}")
        g = capture(lambda: matmul(x_static, A, out=c0, config=cfg), DEVS)
        return Method(name, g.replay, feed, note=str(dataclasses.asdict(cfg)))

    guarded(name, build)

# -- baselines ---------------------------------------------------------------------------------
ws = [A, B]
for c in CHUNKS:

    def build(c=c):
        mb = MicroBatch(ws, M, c)
        return Method(
            f"microbatch/{c}", mb, lambda i, mb=mb: mb.x.copy_(rot.get(i)), c, "graph" if mb.graphed else "eager"
        )

    guarded(f"microbatch/{c}", build)


def build_tp():
    tp = TensorParallel(A, B.to("cuda:0"), DEVS, M)

    def prep(i):
        for xg in tp.x:
            xg.copy_(rot.get(i))

    return Method("tp", tp, prep)


guarded("tp", build_tp)

# -- CTA-pipelining ----------------------------------------------------------------------------
ends = lambda r, d, **kw: dict(prefill_rows=r, drain_rows=d, **kw)  # noqa: E731
split_pipe = dict(config=split(PIPELINE_CONFIG))
PIPES = {
    f"cta_static (PIPELINE_CONFIG, {PIPELINE_CONFIG.wait_parts} parts)": dict(),
    "cta_static_p768_d512_split": ends(768, 512, **split_pipe),
    "cta_static_p1024_d512_split": ends(1024, 512, **split_pipe),
    "cta_static_p1152_d512_split": ends(1152, 512, **split_pipe),
    "cta_static_p1280_d512_split": ends(1280, 512, **split_pipe),
    "cta_static_p1024_d640_split": ends(1024, 640, **split_pipe),
    "cta_static_p1280_d640_split": ends(1280, 640, **split_pipe),
    "cta_static_p1408_d640_split": ends(1408, 640, **split_pipe),
}
if os.environ.get("TUNE_ENDS"):  # e.g. "768,512 1280,512": these ends (split tails) instead
    pairs = [tuple(map(int, e.split(","))) for e in os.environ["TUNE_ENDS"].split()]
    PIPES = {next(iter(PIPES)): dict()} | {f"cta_static_p{r}_d{d}_split": ends(r, d, **split_pipe) for r, d in pairs}
# each GPU's path alone (on pipelines of their own): stage 0's (the producer's remote writes and
# signals, then a drain) and stage 1's (a prefill, then the consumer, its input already signalled
# by an untimed stage-0 replay just before). The longer one is the chain's critical path.
ALONE = ("cta_static_p768_d512_split", "cta_static_p1152_d512_split", "cta_static_p1280_d640_split")
pipes = {}
for name, kw in PIPES.items():

    def build(name=name, kw=kw):
        log(f"building {name}")
        pipe = Pipeline(ws, **({"policy": "static"} | kw))
        # the same Triton GEMMs one after another, each with its stage's configuration
        refs = [pipe.sequential(x) for x in rot.xs]
        eager_ok = all(torch.equal(pipe(x), r) for x, r in zip(rot.xs, refs))
        g = capture(lambda: pipe(x_static, out=out, check=False), DEVS)
        replay_ok = True
        for i in range(3):
            feed(i)
            out.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)
            replay_ok &= torch.equal(out, refs[i])
        pipe.check_errors()
        notes[name] = f"eager bitwise {'OK' if eager_ok else 'WRONG'}, graph bitwise {'OK' if replay_ok else 'WRONG'}"
        log(f"{name}: {notes[name]}")
        pipes[name] = pipe
        return Method(name, g.replay, feed, note=notes[name])

    guarded(name, build)
    if name in pipes and name in ALONE:

        def build_paths(name=name, kw=PIPES[name]):
            # two pipelines: stage 0 replayed alone advances the epoch without the prefill's signals
            graphs = []
            for side in ("gpu0", "gpu1"):
                pipe = Pipeline(ws, **({"policy": "static"} | kw))
                pipes[f"{name}_{side}_path"] = pipe  # a graph does not keep its pipeline's buffers alive
                plan = pipe.plan(M)
                launch = pipe._launch
                g0 = capture(lambda f=launch, p=plan: f(p, x_static, out, only=[0]), DEVS)
                g1 = capture(lambda f=launch, p=plan: f(p, x_static, out, only=[1], advance_epoch=False), DEVS)
                graphs.append((g0, g1))

            def stage0_first(i, g0=graphs[1][0]):  # untimed: this epoch's producer, so the consumer never waits
                feed(i)
                g0.replay()

            return [
                Method(name + "_gpu0_path", graphs[0][0].replay, feed),
                Method(name + "_gpu1_path", graphs[1][1].replay, stage0_first),
            ]

        guarded(name + "_paths", build_paths)

# -- time everything, interleaved --------------------------------------------------------------
log(f"timing {len(methods)} methods x {REPS} reps, interleaved")
times = time_interleaved(methods, DEVS, REPS, WARM)
for pipe in pipes.values():
    pipe.check_errors()  # (a producer-alone pipeline's consumer never ran: nothing to report)
med = {k: statistics.median(v) for k, v in times.items()}
best_mb = min((k for k in med if k.startswith("microbatch/")), key=med.get)
rows = []
log(f"\n{'method':34s} {'median':>8s} {'min':>8s} {'max':>8s} {'/cublas':>8s} {'/best_mb':>9s} {'/tp':>7s}")
for m in methods:
    v = times[m.name]
    r = dict(
        method=m.name,
        median_ms=round(med[m.name], 4),
        min_ms=round(min(v), 4),
        max_ms=round(max(v), 4),
        ms=[round(t, 4) for t in v],
        note=m.note,
    )
    rows.append(r)
    log(
        f"{m.name:34s} {med[m.name]:8.4f} {min(v):8.4f} {max(v):8.4f} {med[m.name] / med['cublas']:8.3f} "
        f"{med[m.name] / med[best_mb]:9.3f} {med[m.name] / med.get('tp', float('nan')):7.3f}  {m.note[:60]}"
    )
log(f"best micro-batching: {best_mb} {med[best_mb]:.4f} ms")
# paired: the median over repetitions of each method's time over another's in the same repetition
base = next(iter(PIPES))
paired = lambda a, b: statistics.median(x / y for x, y in zip(times[a], times[b]))  # noqa: E731
for r in rows:
    if r["method"].startswith("cta_") and base in times:
        r["paired_over_static"] = round(paired(r["method"], base), 4)
        r["paired_over_best_mb"] = round(paired(r["method"], best_mb), 4)
        r_static, r_mb = r["paired_over_static"], r["paired_over_best_mb"]
        log(f"paired {r['method']:34s} / cta_static {r_static:.4f}  / {best_mb} {r_mb:.4f}")
(out_dir / "tune_transport.json").write_text(
    json.dumps(
        dict(environment=environment(), M=M, K=K, reps=REPS, best_microbatch=best_mb, notes=notes, rows=rows), indent=1
    )
)
