"""The ``ctapipelining`` command: ``demo`` (the main job) and ``bench``."""

from __future__ import annotations

import argparse
import sys

import numpy as np


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken CUDA install counts as no GPU here
        return 0


def _fmt(tiles: list[int], limit: int = 16) -> str:
    s = " ".join(map(str, tiles[:limit]))
    return s + (f" ... (+{len(tiles) - limit})" if len(tiles) > limit else "")


def demo_cpu(args) -> int:
    """The protocol at small size on the CPU: the reference executor, then the Triton kernels
    under the interpreter."""
    from . import refexec

    ch = refexec.Chain(
        M=args.m,
        K0=args.k,
        stages=[
            refexec.Stage("gemm", args.n, args.block_m, args.block_n, num_ctas=args.ctas),
            refexec.Stage("gemm", args.n, args.block_m, args.block_n, num_ctas=args.ctas),
        ],
    )
    dep = ch.links[0]
    print(f"2-stage GEMM chain X[{args.m},{args.k}] @ A[{args.k},{args.n}] @ B[{args.n},{args.n}]")
    print(
        f"  tiles per stage: {ch.grids[0].num_tiles} ({ch.grids[0].num_m} row-blocks x {ch.grids[0].num_n}), "
        f"{dep.num_counters} counters, each needs {sorted(set(dep.need.tolist()))} producer tiles"
    )
    for policy in ("workqueue", "static"):
        r = refexec.run_chain(ch, policy, "random", epochs=args.epochs, seed=args.seed)
        print(f"\n[{policy}] {args.epochs} runs, {r.steps} interleaved protocol steps, no reset between runs")
        print(f"  consumer tiles ready, in order (last run): {_fmt(r.order(1, 'ready', epoch=args.epochs))}")
        print(f"  consumer tiles run,   in order (last run): {_fmt(r.order(1, 'run', epoch=args.epochs))}")
        print(f"  output vs float64 reference: max rel. error {r.max_error:.2e}  OK")
    if not args.no_interpreter:
        from .interpret import run_interpreted_chain

        print("\nTriton kernels under the interpreter (TRITON_INTERPRET=1):")
        for line in run_interpreted_chain(seed=args.seed):
            print("  " + line)
    return 0


def demo(args) -> int:
    ngpu = _gpu_count()
    if ngpu < 2:
        print(f"No GPU pair found ({ngpu} CUDA device(s)): running the protocol on the CPU instead.\n")
        return demo_cpu(args)
    from .demo_gpu import demo_gpu

    return demo_gpu(args, ngpu)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ctapipelining", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="run a 2-stage GEMM chain (GPUs if present, else the CPU protocol)")
    d.add_argument("--m", type=int, default=96)
    d.add_argument("--k", type=int, default=64)
    d.add_argument("--n", type=int, default=64)
    d.add_argument("--block-m", type=int, default=16)
    d.add_argument("--block-n", type=int, default=32)
    d.add_argument("--ctas", type=int, default=4, help="persistent CTAs per stage")
    d.add_argument("--epochs", type=int, default=3, help="back-to-back runs without reset")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-interpreter", action="store_true", help="skip the Triton interpreter part")
    d.add_argument("--gpu-m", type=int, default=8192, help="rows of X on GPUs")
    d.add_argument("--gpu-k", type=int, default=8192, help="hidden size on GPUs")
    d.set_defaults(fn=demo)
    from . import bench

    b = sub.add_parser("bench", help="time every method in one run (2 GPUs), or re-plot recorded results")
    bench.add_arguments(b)
    b.set_defaults(fn=bench.run)
    from . import trace

    t = sub.add_parser("trace", help="one traced call on 2 GPUs: timeline PNG and the costs T1, T2, T3")
    trace.add_arguments(t)
    t.set_defaults(fn=trace.run)
    from . import sim

    m = sub.add_parser("sim", help="the calibrated model: validation, Figures 4 and 7 at 2/4/8 GPUs (CPU)")
    sim.add_arguments(m)
    m.set_defaults(fn=sim.run)
    pl = sub.add_parser("plan", help="fastest layout (stages x TP, policy, or no pipelining) for a chain (CPU)")
    sim.add_arguments(pl, plan_args=True)
    pl.set_defaults(fn=sim.run_plan)
    args = ap.parse_args(argv)
    for name in ("m", "k", "n", "block_m", "block_n", "ctas", "epochs", "gpu_m", "gpu_k", "gpus"):
        v = getattr(args, name, None)
        if v is not None and v < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    np.set_printoptions(linewidth=120)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
