"""A CTA-pipelined chain with one process per GPU.

    torchrun --nproc-per-node N examples/torchrun_chain.py [--rows 4096] [--dim 8192] [--stages-per-rank 1]

Each rank holds ``--stages-per-rank`` layers of ``x @ W_0 @ W_1 @ ...`` (``dim`` x ``dim``, bf16).
It checks the result (bitwise) against the same stages run one after another and against the
one-process :class:`~ctapipelining.pipeline.Pipeline` over the same GPUs. Rank 0 then starts
three calls ``--late`` seconds after the others (longer than the kernels' timeout): the calls
must be right and nothing may time out. Last it times both
pipelines graph-replayed, taking turns, and prints the median of each and their paired ratio.
With one GPU, ``--loopback`` puts a segment per stage on it, so the links go through symmetric
memory. ``--blocks``: each rank holds ``--stages-per-rank`` fused Llama MLP blocks (hidden
``dim``, intermediate ``--inter``; :meth:`ctapipelining.nn.FusedMLP.pipeline_stages`) instead of
bare layers, against the one-process :class:`~ctapipelining.pipeline.Pipeline` of the blocks'
stages (not with
``--loopback``: a block's two GEMMs stay in one segment).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ctapipelining.distributed import DistributedPipeline
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout
from ctapipelining.timing import environment, median_ci


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096, help="input rows M (default 4096)")
    p.add_argument("--dim", type=int, default=8192, help="every layer is dim x dim (default 8192)")
    p.add_argument("--stages-per-rank", type=int, default=1, help="layers per rank (default 1)")
    p.add_argument("--loopback", action="store_true", help="a segment per stage (links through the heap on one GPU)")
    p.add_argument("--blocks", action="store_true", help="fused Llama MLP blocks instead of bare layers")
    p.add_argument("--inter", type=int, default=28672, help="the blocks' intermediate size (default 28672)")
    p.add_argument("--reps", type=int, default=30, help="timed graph replays of each (default 30)")
    p.add_argument(
        "--late", type=float, default=2.0,
        help="seconds rank 0 sleeps before each of 3 eager calls while the others have launched theirs: more than "
        "the kernels' 1 s timeout, less than the 2.5 s start timeout; the calls must be right (default 2; 0: skip)",
    )  # fmt: skip
    p.add_argument("--out", default=None, help="write the result as JSON here (rank 0)")
    args = p.parse_args()

    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    n = world * args.stages_per_rank
    g = torch.Generator().manual_seed(0)  # every rank draws the same chain and keeps its own layers
    gpu_of = lambda s: f"cuda:{s // args.stages_per_rank}"  # noqa: E731 (stage s's GPU, as one process sees them)
    if args.blocks:
        from ctapipelining.nn import LlamaMLP

        def w(rows, cols):
            return (torch.randn(rows, cols, generator=g) * cols**-0.5).bfloat16()

        H, inter = args.dim, args.inter
        drawn = [
            (w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, generator=g)).bfloat16())
            for _ in range(n)
        ]

        def stages(bs, devices):
            """Blocks bs' stages (weights, configurations, epilogues), each block built on its device."""
            parts = [LlamaMLP(*(t.to(d) for t in drawn[b])).pipeline_stages() for b, d in zip(bs, devices)]
            return [sum((part[i] for part in parts), []) for i in range(3)]

        first = rank * args.stages_per_rank
        ws, configs, epilogues = stages(range(first, first + args.stages_per_rank), [device] * args.stages_per_rank)
        pipe = DistributedPipeline(ws, config=configs, epilogues=epilogues, loopback=args.loopback)
    else:
        layers = [(torch.randn(args.dim, args.dim, generator=g) / args.dim**0.5).bfloat16() for _ in range(n)]
        mine = [w.to(device) for w in layers[rank * args.stages_per_rank : (rank + 1) * args.stages_per_rank]]
        pipe = DistributedPipeline(mine, loopback=args.loopback)
    x = torch.randn(args.rows, args.dim, generator=g).bfloat16().to(device) if rank == 0 else None
    rows = None if rank == 0 else args.rows

    y = pipe(x, rows=rows, check=True)
    ref = pipe.sequential(x, rows=rows)
    same_sequential = torch.equal(y, ref) if y is not None else None
    # the one-process pipeline over the same GPUs, on rank 0 (the others wait)
    if rank == world - 1 and world > 1:
        dist.send(y, dst=0)
    single = None
    if rank == 0:
        if args.blocks:  # the blocks' own configurations, on the GPUs of their ranks
            placed, configs, epilogues = stages(range(n), [gpu_of(b) for b in range(n)])
            single = Pipeline(placed, config=configs, epilogues=epilogues, loopback=args.loopback)
        else:
            placed = [w.to(gpu_of(s)) for s, w in enumerate(layers)]
            single = Pipeline(placed, loopback=args.loopback, config=PIPELINE_CONFIG)  # the distributed default
        y_last = y if world == 1 else torch.empty(args.rows, args.dim, dtype=torch.bfloat16, device=device)
        if world > 1:
            dist.recv(y_last, src=world - 1)
        same_single = torch.equal(single(x, check=True).to(device), y_last)
    dist.barrier()

    # a late first rank: the others' consumers wait in their gates, not in their kernels' deadlines
    late_right, late_timeout = None, None
    if args.late > 0:  # (with one rank nobody waits for it, but the calls run the same way)
        late_right = True
        for _ in range(3):
            dist.barrier()
            if rank == 0:
                time.sleep(args.late)
            got = pipe(x, rows=rows)
            late_right = late_right and (got is None or torch.equal(got, ref))
        try:
            pipe.check_errors()  # raises on every rank if anything timed out (and resets them all)
        except PipelineTimeout as e:
            late_timeout = str(e)
    dist.barrier()

    graphed = pipe.capture(args.rows)
    single_graph = single.capture(args.rows) if rank == 0 else None
    times = {"distributed": [], "one_process": []}
    for i in range(args.reps + 5):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graphed.replay()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        stamps = [None] * world
        dist.all_gather_object(stamps, (t0, t1))
        if rank == 0:  # from the first rank's start to the last rank's end (one host: one clock)
            wall = max(b for _, b in stamps) - min(a for a, _ in stamps)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            single_graph.replay()
            for d in range(min(world, torch.cuda.device_count())):
                torch.cuda.synchronize(d)
            one = time.perf_counter() - t0
            if i >= 5:
                times["distributed"].append(wall * 1e3)
                times["one_process"].append(one * 1e3)
    pipe.check_errors()
    if rank == 0:
        single.check_errors()
        ratios = [a / b for a, b in zip(times["distributed"], times["one_process"])]
        med, lo, hi = median_ci(ratios)
        result = {
            "world": world, "rows": args.rows, "dim": args.dim, "stages": n, "loopback": args.loopback,
            "blocks": {"intermediate": args.inter} if args.blocks else None,
            "bitwise_equal_sequential": same_sequential if world == 1 else "on the last rank",
            "bitwise_equal_one_process": same_single,
            "late_first_rank": None if late_right is None else {
                "seconds": args.late, "calls": 3, "no_timeout": late_timeout is None, "timeout": late_timeout,
            },
            "median_ms": {k: statistics.median(v) for k, v in times.items()},
            "distributed_over_one_process": {"median": med, "ci95": [lo, hi]},
            "times_ms": times, "env": environment(),
        }  # fmt: skip
        print(json.dumps({k: v for k, v in result.items() if k not in ("times_ms", "env")}))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    if rank == world - 1 and world > 1:
        print(json.dumps({"rank": rank, "bitwise_equal_sequential": same_sequential, "late_calls_right": late_right}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
