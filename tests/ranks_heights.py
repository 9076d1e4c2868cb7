"""One process per GPU at several row counts, each plan's heap small (a few MB), then back to
the first: every call checked on every rank and, on the last rank, bitwise equal to the stages
run one after another; a graph captured at the first height, replayed after the others were
built. Run under torchrun, any number of ranks (one rank: two stages on it, through the heap):

    torchrun --nproc-per-node G tests/ranks_heights.py

On GPUs (NCCL, the heaps PyTorch symmetric memory); without a GPU one rank on gloo under the
Triton interpreter, at small sizes, without the graph (the interpreter's waits poll too briefly
for ranks that run at once). Prints one JSON line on the last rank."""

import json
import os

import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from ctapipelining.distributed import DistributedPipeline  # noqa: E402 (after TRITON_INTERPRET)
from ctapipelining.kernels.gemm import GemmConfig  # noqa: E402


def main() -> None:
    gpu = torch.cuda.is_available()
    if gpu:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        dim, heights, config, dtype = 1024, [256, 1024, 256, 3000, 1024, 256], None, torch.bfloat16
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        dim, heights, dtype = 32, [16, 40, 16, 64, 40, 16], torch.float16
        config = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_stages=2, num_warps=4)
    rank, world = dist.get_rank(), dist.get_world_size()
    if not gpu and world > 1:
        raise SystemExit("without a GPU this runs one rank")
    per_rank = 2 if world == 1 else 1
    g = torch.Generator().manual_seed(0)  # every rank draws the same chain and keeps its own layers
    layers = [(torch.randn(dim, dim, generator=g) / dim**0.5).to(dtype) for _ in range(world * per_rank)]
    mine = [w.to(device) for w in layers[rank * per_rank : (rank + 1) * per_rank]]
    pipe = DistributedPipeline(mine, config=config, loopback=world == 1, row_buckets=0)
    xs = {M: torch.randn(M, dim, generator=g).to(dtype).to(device) for M in sorted(set(heights))}
    first = heights[0]
    graphed = pipe.capture(first) if gpu else None
    equal = []
    for M in heights:
        x, rows = (xs[M], None) if rank == 0 else (None, M)
        y = pipe(x, rows=rows, check=True)
        ref = pipe.sequential(x, rows=rows)
        equal.append(y is None or torch.equal(y, ref))
    replayed = None
    if graphed is not None:
        graphed(xs[first]) if rank == 0 else graphed()
        pipe.check_errors()
        x, rows = (xs[first], None) if rank == 0 else (None, first)
        ref = pipe.sequential(x, rows=rows)
        replayed = graphed.out is None or torch.equal(graphed.out, ref)
    if rank == world - 1:
        print(json.dumps({"world": world, "heights": heights, "equal": equal, "graph_replay_equal": replayed,
                          "plans": sorted(pipe._plans)}))  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
