"""The ctapipelining command: demo (the main job), bench, trace, sim and plan.

Every subcommand's module is imported here to build its options; those modules import Triton
kernels and CUDA code only inside the functions that run them, so ``--help`` stays fast and the
CPU demo can switch the Triton interpreter on before the kernels are first imported.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from . import bench, refexec, sim, trace
from .argtypes import HelpFormatter, UsageError, positive_int
from .demo_gpu import demo_gpu
from .interpret import run_interpreted_chain


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
        print("\nTriton kernels under the interpreter (TRITON_INTERPRET=1):")
        for line in run_interpreted_chain(seed=args.seed):
            print("  " + line)
    return 0


def demo(args) -> int:
    ngpu = _gpu_count()
    if ngpu < 1:
        print("No CUDA device found: running the protocol on the CPU instead.\n")
        return demo_cpu(args)
    return demo_gpu(args, ngpu)


COMMANDS = {
    "demo": "run a 2-stage GEMM chain: on the GPU(s) if present (one is enough), else on the CPU",
    "bench": "time every method in one run (2+ GPUs), or re-plot recorded results",
    "trace": "one traced call on 2 GPUs: timeline PNG and the protocol's costs T1, T2, T3",
    "sim": "the calibrated model: validation, Figures 4 and 7 at 2/4/8 GPUs, more layers than GPUs, Llama blocks "
    "on 2 GPUs (CPU)",
    "plan": "the fastest layout (stages x TP, policy, or no pipelining) of a chain, by the model (CPU)",
}


def parser() -> argparse.ArgumentParser:
    """The command line: a subcommand per entry of :data:`COMMANDS`, each with its options."""
    ap = argparse.ArgumentParser(
        prog="ctapipelining",
        description=__doc__.split("\n")[0],
        epilog="'ctapipelining COMMAND --help' lists a command's options.",
        formatter_class=HelpFormatter,
    )
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def command(name, fn):
        p = sub.add_parser(name, help=COMMANDS[name], description=COMMANDS[name], formatter_class=HelpFormatter)
        p.set_defaults(fn=fn, usage_error=p.error)
        return p

    d = command("demo", demo)
    d.add_argument("--m", type=positive_int, default=96, help="rows of X (CPU)")
    d.add_argument("--k", type=positive_int, default=64, help="width of X (CPU)")
    d.add_argument("--n", type=positive_int, default=64, help="width of both layers' outputs (CPU)")
    d.add_argument("--block-m", type=positive_int, default=16, help="tile rows (CPU)")
    d.add_argument("--block-n", type=positive_int, default=32, help="tile columns (CPU)")
    d.add_argument("--ctas", type=positive_int, default=4, help="persistent CTAs per stage (CPU)")
    d.add_argument("--epochs", type=positive_int, default=3, help="back-to-back runs without reset (CPU)")
    d.add_argument("--seed", type=int, default=0, help="random seed of the inputs and the interleaving")
    d.add_argument("--no-interpreter", action="store_true", help="skip the Triton interpreter part (CPU)")
    d.add_argument("--gpu-m", type=positive_int, default=8192, help="rows of X on GPUs")
    d.add_argument("--gpu-k", type=positive_int, default=8192, help="hidden size on GPUs")
    bench.add_arguments(command("bench", bench.run))
    trace.add_arguments(command("trace", trace.run))
    sim.add_arguments(command("sim", sim.run))
    sim.add_arguments(command("plan", sim.run_plan), plan_args=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    np.set_printoptions(linewidth=120)
    try:
        return args.fn(args)
    except UsageError as e:  # a mistake only the subcommand could see: reported as argparse would
        args.usage_error(str(e))


if __name__ == "__main__":
    sys.exit(main())
