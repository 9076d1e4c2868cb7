"""One process per GPU (:mod:`ctapipelining.distributed`) on the CPU: the placement and heap
layout in plain Python; the real kernels under the interpreter with gloo, in one process (world
size 1, a segment per stage: every link through the heap) and in two processes (a rank per
stage, the heap in shared memory)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctapipelining import deps
from ctapipelining.distributed import ALIGN, DistributedPipeline, Placement, heap_layout
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline, PipelineTimeout

CFG = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=1, num_stages=2, num_warps=4)


# -- placement and layout (plain Python) -------------------------------------------------------
def test_placement_puts_each_ranks_stages_end_to_end():
    p = Placement.of([[(32, 48), (48, 64)], [(64, 16)]])
    assert p.rank_of == (0, 0, 1)
    assert p.segments == ((0, 1), (2,))
    assert p.cross_links() == [2]
    assert p.segments_of(0) == [0] and p.segments_of(1) == [1]
    loop = Placement.of([[(32, 48), (48, 64)], [(64, 16)]], loopback=True)
    assert loop.segments == ((0,), (1,), (2,))
    assert loop.cross_links() == [1, 2] and loop.segments_of(0) == [0, 1]


def test_placement_refuses_a_rank_without_stages_and_shapes_that_do_not_chain():
    with pytest.raises(ValueError, match=r"world size 3 does not match the placement: rank\(s\) \[2\]"):
        Placement.of([[(32, 48)], [(48, 16)], []])
    with pytest.raises(ValueError, match="rank 1's first weight is \\[40, 16\\] but the stage before it"):
        Placement.of([[(32, 48)], [(40, 16)]])


@pytest.mark.parametrize("queue", [False, True])
@pytest.mark.parametrize("rows", [16, 40, 100])
def test_heap_layout_regions_fit_do_not_overlap_and_match_the_links(rows, queue):
    p = Placement.of([[(32, 48)], [(48, 64), (64, 16)], [(16, 32)]], loopback=True)
    lay = heap_layout(p, rows, CFG, torch.float16, queue)
    spans = {}
    for (name, s), r in lay.regions.items():
        size = r.dtype.itemsize * int(torch.tensor(r.shape).prod())
        assert r.offset % ALIGN == 0 and r.offset + size <= lay.nbytes
        spans.setdefault(r.rank, []).append((r.offset, r.offset + size))
        owner = p.rank_of[s - 1] if name == "consumed" else p.rank_of[s]
        assert r.rank == owner, (name, s)
    for ranges in spans.values():
        ranges.sort()
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    for s in p.cross_links():
        dep = lay.deps[s]
        assert lay.regions[("counters", s)].shape == (dep.num_counters,)
        assert lay.regions[("input", s)].shape == (rows, p.shapes[s][0])
        assert dep.parts == (1 if queue else min(CFG.wait_parts, deps.TileGrid(rows, p.shapes[s - 1][1], 16, 16).num_n))


# -- world size 1 under the interpreter --------------------------------------------------------
@pytest.fixture
def world1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _weights(dims, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(k, n, generator=g) / k**0.5).half() for k, n in zip(dims, dims[1:])]


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_world_size_one_through_the_heap_equals_the_pipeline(world1, policy):
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, policy=policy, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    assert len(pipe.segments) == 2 and pipe.is_first and pipe.is_last
    ref_pipe = Pipeline(ws, policy=policy, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    g = torch.Generator().manual_seed(1)
    for M in (40, 40, 17, 40):  # back to back, and a second plan in between
        x = torch.randn(M, 32, generator=g).half()
        y = pipe(x)
        assert torch.equal(y, pipe.sequential(x))
        assert torch.equal(y, ref_pipe(x))
    pipe.check_errors()
    dp = pipe.plan(40)
    link = dp.links[1]
    # three calls on the 40-row plan: the heap's counters hold 3 x need, the gates counted 3 calls each
    assert link.counters.tolist() == (3 * link.dep.need).tolist()
    assert [int(c) for c in dp.calls] == [3, 3]
    assert int(dp.started_in[1]) == 3 and int(dp.consumed_out[0]) == 3
    # the links are views into the heap
    base = dp.heap.local.data_ptr()
    assert base <= link.counters.data_ptr() < base + dp.heap.nbytes


@pytest.mark.interpreter
def test_a_consumer_whose_producer_never_starts_times_out_on_every_rank_then_recovers(world1):
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    x = torch.randn(40, 32).half()
    pipe(x)
    dp = pipe.plan(40)
    pipe._run(dp, x, torch.empty(40, 32).half(), only=[1])  # the second segment alone
    with pytest.raises(PipelineTimeout, match=r"stage 1 on rank 0, cpu: the previous segment had started 1 calls"):
        pipe.check_errors()
    assert [int(c) for c in dp.calls] == [0, 0] and int(dp.heap.local.abs().sum()) == 0
    y = pipe(x)
    assert torch.equal(y, pipe.sequential(x))
    pipe.check_errors()


def test_bad_input_is_refused_before_anything_runs(world1):
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True)
    with pytest.raises(ValueError, match="pass the input x"):
        pipe(rows=40)
    with pytest.raises(ValueError, match="rows=41 but x has 40 rows"):
        pipe(torch.randn(40, 32).half(), rows=41)
    with pytest.raises(ValueError, match=r"x is \(40, 16\)"):
        pipe(torch.randn(40, 16).half())
    with pytest.raises(ValueError, match="out shares memory"):
        x = torch.randn(40, 32).half()
        pipe(x, out=x)
    assert not pipe._plans
    with pytest.raises(ValueError, match="a rank runs on one GPU"):
        DistributedPipeline([ws[0], ws[1].to("meta")])


def test_it_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedPipeline(_weights([32, 48]))


# -- two ranks under the interpreter (two processes, gloo, the heap in shared memory) -----------
def _two_ranks(rank, store, result):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        ws = _weights([32, 48, 32, 16])  # rank 0: stages 0-1, rank 1: stage 2
        mine = ws[:2] if rank == 0 else ws[2:]
        pipe = DistributedPipeline(mine, config=CFG, timeout_s=0.1, row_buckets=0)
        g = torch.Generator().manual_seed(5)
        x = torch.randn(40, 32, generator=g).half()
        pipe.plan(40)
        lines = []
        # under the interpreter a kernel's waits poll only briefly: the producer's call runs
        # first, then the consumer's (on GPUs the calls overlap)
        for _ in range(3):
            if rank == 0:
                pipe(x)
            dist.barrier()
            if rank == 1:
                y = pipe(rows=40)
            dist.barrier()
        pipe.check_errors()
        ref = pipe.sequential(x if rank == 0 else None, rows=None if rank == 0 else 40)
        if rank == 1:
            single = Pipeline(ws, config=CFG, row_buckets=0)(x)
            lines.append(f"equal {torch.equal(y, ref)} {torch.equal(y, single)}")
        # rank 1 alone: its gate times out; both ranks raise, naming rank 1
        if rank == 1:
            pipe(rows=40)
        try:
            pipe.check_errors()
            lines.append("no timeout")
        except PipelineTimeout as e:
            lines.append("timeout " + str(e))
        if rank == 0:
            pipe(x)
        dist.barrier()
        if rank == 1:
            lines.append(f"after {torch.equal(pipe(rows=40), ref)}")
        dist.barrier()
        pipe.check_errors()
        result[rank] = lines
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_two_ranks_in_two_processes_equal_the_single_process_pipeline(tmp_path):
    result = mp.Manager().dict()
    mp.spawn(_two_ranks, args=(str(tmp_path / "store"), result), nprocs=2, join=True)
    assert result[1][0] == "equal True True"
    for rank in (0, 1):
        kind = result[rank][-1 if rank == 0 else 1]
        assert kind.startswith("timeout") and "stage 2 on rank 1, cpu: the previous segment had started" in kind
    assert result[1][2] == "after True"
