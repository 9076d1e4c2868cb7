"""One process per GPU (:mod:`ctapipelining.distributed`) on the CPU: the placement and heap
layout in plain Python; the real kernels under the interpreter with gloo, in one process (world
size 1, a segment per stage: every link through the heap) and in two processes (a rank per
stage, the heap in shared memory)."""

import gc
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ctapipelining import deps, hostgroup
from ctapipelining.distributed import ALIGN, DistributedPipeline, Placement, heap_layout
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline, PipelineHung, PipelineTimeout

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


def check_regions(p: Placement, lay) -> None:
    """Every region of the layout inside the heap, aligned, on the rank that owns it (the
    producer's for ``consumed``, else the consumer's), none overlapping another on its rank."""
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


@pytest.mark.parametrize("queue", [False, True])
@pytest.mark.parametrize("rows", [16, 40, 100])
def test_heap_layout_regions_fit_do_not_overlap_and_match_the_links(rows, queue):
    p = Placement.of([[(32, 48)], [(48, 64), (64, 16)], [(16, 32)]], loopback=True)
    lay = heap_layout(p, rows, CFG, torch.float16, queue)
    check_regions(p, lay)
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
    gc.collect()  # what still holds the group (a refused pipeline in a traceback) goes before a later test forks


def _ranks():
    """The context the ranks and their manager start in: forks of a server process that imported
    torch and the package once (a rank starts in a tenth of a second, not the seconds of an
    import), not of this process, which pytest-xdist runs threads in. (The server finds modules
    on ``PYTHONPATH``, not on this process's ``sys.path``: the ranks import this module
    themselves.)"""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch.distributed", "pytest", "ctapipelining.distributed", "ctapipelining.nn"])
    return ctx


def _results():
    """A dict the ranks of :func:`_spawn` fill, held by a manager process."""
    return _ranks().Manager().dict()


def _spawn(worker, args, nprocs=2):
    """``worker(rank, *args)`` in ``nprocs`` processes (joined): a rank's exception fails the
    test; a rank that returns leaves at once (:func:`_rank`). The ranks take this process's
    environment as it is now, not the fork server's."""
    _ranks()
    env = dict(os.environ)
    mp.start_processes(_rank, args=(env, worker, *args), nprocs=nprocs, join=True, start_method="forkserver")


def _rank(rank, env, worker, *args):
    """Run ``worker`` as rank ``rank`` in the environment ``env`` (the test process's), then
    exit without the interpreter's finalization. A gloo worker thread that releases a finished
    collective's tensors after finalization has begun takes the GIL and aborts the process
    ("terminate called without an active exception", pytorch/pytorch#190489), failing a test
    whose ranks all returned; the rank's results are in the manager's dict by then."""
    os.environ.clear()
    os.environ.update(env)
    import conftest  # noqa: F401  (as in the test process: the interpreter's faster device function calls)

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
def test_a_segment_whose_producer_never_starts_times_out_in_its_gate_then_recovers(world1):
    """One rank, two segments (loopback): the second launched alone waits in its gate for the
    first's start, times out naming the call count, and after the reset (counts and heap at
    zero) a call is right. (Two ranks: test_two_ranks_in_two_processes.)"""
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    x = torch.randn(40, 32).half()
    pipe(x)
    dp = pipe.plan(40)
    pipe._run(dp, x, torch.empty(40, 32).half(), 40, only=[1])  # the second segment alone
    with pytest.raises(PipelineTimeout, match=r"stage 1 \(rank 0\) on cpu: the previous segment had started 1 calls"):
        pipe.check_errors()
    assert [int(c) for c in dp.calls] == [0, 0] and int(dp.heap.local.abs().sum()) == 0
    y = pipe(x)
    assert torch.equal(y, pipe.sequential(x))
    pipe.check_errors()


@pytest.mark.interpreter
def test_a_producer_whose_consumer_never_finished_the_call_before_reports_it_then_recovers(world1):
    """The first segment launched twice alone: its second gate waits for the second segment to
    finish the first call (it still reads the buffer the second call overwrites), which never
    happened; the check names it, resets, and a call is right after it."""
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    x = torch.randn(40, 32).half()
    dp = pipe.plan(40)
    for _ in range(2):
        pipe._run(dp, x, torch.empty(40, 32).half(), 40, only=[0])
    with pytest.raises(
        PipelineTimeout, match=r"stage 0 \(rank 0\) on cpu: the next segment had finished 0 calls on this plan, "
        r"this call needs 1 .*every call since the last check is suspect",
    ):  # fmt: skip
        pipe.check_errors()
    assert torch.equal(pipe(x), pipe.sequential(x))
    pipe.check_errors()


@pytest.mark.interpreter
def test_a_refused_call_puts_the_rank_out_of_step_until_every_rank_checks(world1):
    """Bad input (or a weight whose storage was swapped) is refused before anything runs on this
    rank, but the other ranks made the call: the rank refuses further calls until the collective
    check reports it and resets."""
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1)
    x = torch.randn(40, 32).half()
    for bad, match in (
        (dict(rows=40), "pass the input x"),
        (dict(x=x, rows=41), "rows=41 but x has 40 rows"),
        (dict(x=torch.randn(40, 16).half()), r"x is \(40, 16\)"),
        (dict(x=x, out=x), "out shares memory"),
        ("new storage", "storage or layout changed"),
    ):
        if bad == "new storage":  # a weight swapped for another tensor: refused, then put back
            old = ws[1].data
            ws[1].data = old.clone()
            with pytest.raises(RuntimeError, match=match):
                pipe(x)
            ws[1].data = old
        else:
            with pytest.raises(ValueError, match=match):
                pipe(**bad)
        with pytest.raises(RuntimeError, match="call check_errors"):
            pipe(x)
        with pytest.raises(PipelineTimeout, match="rank 0 refused or failed a call"):
            pipe.check_errors()
    assert not pipe._plans
    assert torch.equal(pipe(x), pipe.sequential(x))
    pipe.check_errors()


@pytest.mark.interpreter
def test_a_reset_that_fails_keeps_the_rank_out_of_step_until_one_works(world1, monkeypatch):
    """A reset whose zeroing fails raises on every rank and leaves the rank refusing calls (its
    heap may hold the failed call's counts); the next check reports the timeout again, resets,
    and calls are right after it."""
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    x = torch.randn(40, 32).half()
    pipe(x)
    pipe._run(pipe.plan(40), x, torch.empty(40, 32).half(), 40, only=[1])  # times out
    seg = pipe.segments[1]
    monkeypatch.setattr(seg, "reset", lambda plan: (_ for _ in ()).throw(RuntimeError("the zeroing failed")))
    with pytest.raises(RuntimeError, match="rank 0: RuntimeError: the zeroing failed"):
        pipe.check_errors()
    with pytest.raises(RuntimeError, match="a reset failed .*the zeroing failed.*check_errors"):
        pipe(x)
    monkeypatch.undo()
    with pytest.raises(PipelineTimeout, match=r"stage 1 \(rank 0\) on cpu.*a reset failed"):
        pipe.check_errors()
    assert torch.equal(pipe(x), pipe.sequential(x))
    pipe.check_errors()


@pytest.mark.interpreter
def test_an_nccl_groups_host_collectives_run_on_a_gloo_group_of_its_ranks(world1, monkeypatch):
    """With a group of another backend (NCCL on GPUs) the errors, plans and resets are
    exchanged on a gloo group of the same ranks, so a stuck GPU cannot hold them."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    assert isinstance(pipe._host_group, dist.ProcessGroupGloo) and pipe._host_group is not pipe.group
    assert (pipe._host_group.rank(), pipe._host_group.size()) == (0, 1)
    x = torch.randn(40, 32).half()
    assert torch.equal(pipe(x), pipe.sequential(x))
    pipe.check_errors()


@pytest.mark.interpreter
def test_the_meets_of_an_nccl_groups_ranks_take_meet_timeout_s(world1, monkeypatch):
    """The gloo group made for the host collectives of a group of another backend has
    ``meet_timeout_s`` as its timeout; it must exceed ``host_timeout_s``, and a gloo group keeps
    its own (the argument is refused there)."""
    import datetime

    real_gloo_group, made = hostgroup.gloo_group, []
    ws = _weights([32, 48, 32])
    with pytest.raises(ValueError, match="a gloo group's own timeout bounds its meets"):
        DistributedPipeline(ws, config=CFG, loopback=True, meet_timeout_s=60.0)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(hostgroup, "gloo_group", lambda *a: made.append(real_gloo_group(*a)) or made[-1])
    for bad in (20.0, -1.0, "60", True):
        with pytest.raises(ValueError, match=r"meet_timeout_s must be a number of seconds above host_timeout_s \(20"):
            DistributedPipeline(ws, config=CFG, loopback=True, host_timeout_s=20.0, meet_timeout_s=bad)
    # a number of seconds is the group's timeout (then refused: not above host_timeout_s); what is
    # not one, PyTorch's default
    minutes = [g.options._timeout.total_seconds() / 60 for g in made]
    assert minutes == [20 / 60, 30, 30, 30]
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, meet_timeout_s=60.0)
    assert pipe._host_group is made[-1] and made[-1].options._timeout == datetime.timedelta(seconds=60)
    DistributedPipeline(ws, config=CFG, loopback=True)
    assert made[-1].options._timeout == datetime.timedelta(minutes=30)  # PyTorch's default for a new group


@pytest.mark.interpreter
def test_a_freed_plans_errors_are_not_lost(world1):
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True, timeout_s=0.1, max_plans=1, row_buckets=0)
    x = torch.randn(40, 32).half()
    pipe(x)
    pipe._run(pipe.plan(40), x, torch.empty(40, 32).half(), 40, only=[1])  # times out
    pipe(x[:17])  # frees the 40-row plan
    assert list(pipe._plans) == [17]
    with pytest.raises(PipelineTimeout, match=r"plan of 40 rows.*stage 1 \(rank 0\)"):
        pipe.check_errors()
    pipe.check_errors()


@pytest.mark.interpreter
def test_settings_are_checked_before_anything_is_built(world1):
    ws = _weights([32, 48, 32])
    with pytest.raises(ValueError, match="rank 0: ValueError: rank 0's weights are on"):
        DistributedPipeline([ws[0], ws[1].to("meta")])
    with pytest.raises(ValueError, match="host_timeout_s=2 must exceed"):
        DistributedPipeline(ws, config=CFG, timeout_s=0.5, host_timeout_s=2.0, start_timeout_s=0.5)
    with pytest.raises(ValueError, match="non-empty list"):
        DistributedPipeline([])


def test_it_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedPipeline(_weights([32, 48]))


# -- two ranks under the interpreter (two processes, gloo, the heap in shared memory) -----------
# Under the interpreter a kernel's waits poll only briefly, so each scenario runs the producer
# rank's call first and the consumer's after a barrier (on GPUs the calls overlap).
def _scenarios(rank, store, result):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    lines = []

    def pair(pipe, x, rows=40, out=None):
        """One call: rank 0's part, then rank 1's; rank 1's result. (The plan is built first,
        together: building it is collective.)"""
        pipe.plan(rows)
        if rank == 0:
            pipe(x)
        dist.barrier()
        y = pipe(rows=rows, out=out) if rank == 1 else None
        dist.barrier()
        return y

    def check(pipe):
        try:
            pipe.check_errors()
            return "clean"
        except PipelineTimeout as e:
            return "timeout " + str(e)

    try:
        ws = _weights([32, 48, 32, 16])  # rank 0: stages 0-1, rank 1: stage 2
        mine = ws[:2] if rank == 0 else ws[2:]
        g = torch.Generator().manual_seed(5)
        x = torch.randn(40, 32, generator=g).half()
        for policy in ("static", "workqueue"):
            pipe = DistributedPipeline(mine, policy=policy, config=CFG, timeout_s=0.1, row_buckets=4)
            ys = [pair(pipe, x) for _ in range(3)]
            lines.append(check(pipe))
            ref = pipe.sequential(x if rank == 0 else None, rows=None if rank == 0 else 40)
            if rank == 1:
                single = Pipeline(ws, policy=policy, config=CFG, row_buckets=0)(x)
                lines.append(f"{policy} equal {all(torch.equal(y, ref) for y in ys)} {torch.equal(ys[0], single)}")
        # rank 1 alone: its gate times out; both ranks raise, naming rank 1; then right again
        pipe.plan(40)
        if rank == 1:
            pipe(rows=40)
        lines.append(check(pipe))
        y = pair(pipe, x)
        lines.append(f"after timeout {rank == 0 or torch.equal(y, ref)}")
        # rank 1 refuses a call (a float32 out) that rank 0 made: out of step, reported on both
        pipe.plan(40)
        if rank == 0:
            pipe(x)
        dist.barrier()
        if rank == 1:
            try:
                pipe(rows=40, out=torch.empty(40, 16))
            except ValueError:
                pass
        lines.append(check(pipe))
        y = pair(pipe, x)
        lines.append(f"after refusal {rank == 0 or torch.equal(y, ref)}")
        # rows that differ but share a plan height (40 and 41 rows: 48): the gate compares them
        pair(pipe, x, rows=41)
        lines.append(check(pipe))
        # rank 1 refuses a call that needs a new plan: rank 0 waits in the plan's collective, rank
        # 1's check meets it there; both learn they are out of step, check again, and go on
        try:
            if rank == 0:
                pipe(x[:17])
            else:
                try:
                    pipe(rows=17, out=torch.empty(17, 16))
                except ValueError:
                    pass
                pipe.check_errors()
            lines.append("no error")
        except RuntimeError as e:
            lines.append("met out of step" if "out of step" in str(e) else "other " + str(e))
        lines.append(check(pipe))
        y = pair(pipe, x)
        lines.append(f"after a refused new plan {rank == 0 or torch.equal(y, ref)}")
        # settings that differ: every rank raises
        try:
            DistributedPipeline(mine, config=CFG, timeout_s=0.1, max_plans=3 if rank else 4)
            lines.append("built")
        except ValueError as e:
            lines.append("refused " + str(e))
        result[rank] = lines
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_two_ranks_in_two_processes(tmp_path):
    """Both policies bitwise equal to the stages one after another and to the one-process
    pipeline; a consumer whose producer never comes, a call one rank refuses, and rows that
    differ between ranks are each reported on both ranks, after which calls are right; settings
    that differ are refused on both ranks."""
    result = _results()
    _spawn(_scenarios, (str(tmp_path / "store"), result))
    r0, r1 = result[0], result[1]
    assert r1[1] == "static equal True True" and r1[3] == "workqueue equal True True"
    assert r0[0] == r0[1] == r1[0] == r1[2] == "clean"
    for lines in (r0[2:], r1[4:]):
        timeout, after, refusal, after_refusal, rows, met, check_met, after_met, settings = lines
        assert timeout.startswith("timeout") and "stage 2 (rank 1) on cpu: the previous segment had started" in timeout
        assert after == "after timeout True" and after_refusal == "after refusal True"
        assert "rank 1 refused or failed a call (ValueError: out must be" in refusal
        assert "the previous segment's call had 40 rows, this one 41" in rows
        assert met == "met out of step" and "met the others in a different step" in check_met
        assert "rank 1 refused or failed a call (ValueError" in check_met  # the first reason, not nested ones
        assert after_met == "after a refused new plan True"
        assert settings.startswith("refused rank 1 was built with") and "must pass the same" in settings


def _two_cpu_ranks(rank, store):
    """Join a two-rank gloo group under the interpreter; ranks that meet in different
    collectives fail in a minute rather than hang."""
    import datetime

    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60)
    )


def _eviction(rank, store, result):
    _two_cpu_ranks(rank, store)
    try:
        ws = _weights([32, 48, 32])
        pipe = DistributedPipeline([ws[rank]], config=CFG, timeout_s=0.1, max_plans=2, row_buckets=0)
        x = torch.randn(48, 32, generator=torch.Generator().manual_seed(4)).half()

        def call(M, refuse=False):
            if not refuse:  # (a refusing rank refuses before it looks up the plan)
                pipe.plan(M)
            if rank == 0:
                pipe(x[:M])
            dist.barrier()
            y = None
            if rank == 1:
                try:
                    y = pipe(rows=M, out=torch.empty(M, 32) if refuse else None)
                except ValueError:
                    pass
            dist.barrier()
            return y

        call(16), call(32)
        pipe.check_errors()
        call(16, refuse=True)  # rank 0 used plan 16 last, rank 1 plan 32: their orders now differ
        with pytest.raises(PipelineTimeout, match="rank 1 refused or failed a call"):
            pipe.check_errors()
        pipe.plan(48)  # frees one plan: the same on both ranks
        kept = list(pipe._plans)
        y = call(16)
        pipe.check_errors()
        ref = pipe.sequential(x[:16] if rank == 0 else None, rows=None if rank == 0 else 16)
        right = rank == 0 or torch.equal(y, ref)
        try:  # rank 1 refuses (a float32 out) a call both make with check=True
            pipe(x[:16], check=True) if rank == 0 else pipe(rows=16, out=torch.empty(16, 32), check=True)
            refusal = "returned"
        except (ValueError, PipelineTimeout) as e:
            refusal = f"{type(e).__name__}: {e}"
        y = call(16)
        pipe.check_errors()
        right_after = rank == 0 or torch.equal(y, ref)
        # the same at a height with no plan yet: rank 1's check meets rank 0 building the plan;
        # both learn they are out of step (rank 1 raises its own error) and check by hand
        try:
            pipe(x[:8], check=True) if rank == 0 else pipe(rows=8, out=torch.empty(8, 32), check=True)
            unbuilt = "returned"
        except (ValueError, RuntimeError) as e:
            unbuilt = f"{type(e).__name__}: {e}"
        try:
            pipe.check_errors()
            checked = "clean"
        except PipelineTimeout as e:
            checked = f"PipelineTimeout: {e}"
        y = call(16)
        pipe.check_errors()
        result[rank] = (kept, right, refusal, right_after, unbuilt, checked, rank == 0 or torch.equal(y, ref))
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_ranks_free_the_same_plans_when_their_orders_of_use_differ(tmp_path):
    """A call one rank refused leaves the ranks' orders of use apart; the next plan built frees
    the same plan on both (rank 0's order), and a call on the freed height builds it again on
    both and is right. Then a rank refuses a call both make with ``check=True``: the other
    checks it collectively, and the refusing rank makes that check too (instead of leaving it
    waiting): rank 0 raises the refusal, rank 1 its own error, both reset, and the next call is
    right. At a height with no plan yet the refusing rank's check meets the other building the
    plan: both raise (out of step, and its own error), a check by hand on each reports the
    refusal and resets, and the next call is right."""
    result = _results()
    _spawn(_eviction, (str(tmp_path / "store"), result))
    (kept0, _, refusal0, _, unbuilt0, checked0, _), (kept1, right, refusal1, right_after, unbuilt1, checked1, last) = (
        result[0],
        result[1],
    )
    assert sorted(kept0) == sorted(kept1) and len(kept0) == 2 and right, dict(result)
    assert refusal0.startswith("PipelineTimeout")
    assert "rank 1 refused or failed a call (ValueError: out must" in refusal0
    assert refusal1.startswith("ValueError: out must") and right_after
    assert unbuilt0.startswith("RuntimeError: the ranks are out of step (rank 0: build a plan, rank 1: check errors)")
    assert unbuilt1.startswith("ValueError: out must")
    for checked in (checked0, checked1):
        assert checked.startswith("PipelineTimeout") and "rank 1 refused or failed a call (ValueError" in checked
    assert last


def _two_pipelines(rank, store, result):
    _two_cpu_ranks(rank, store)
    try:
        a, b = _weights([32, 48, 32], seed=1), _weights([32, 48, 32], seed=2)  # same shapes, other values
        pipes = [DistributedPipeline([w[rank]], config=CFG, timeout_s=0.1) for w in (a, b)]
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(5)).half()
        try:  # the ranks plan different pipelines: found out, not wired to each other
            pipes[rank].plan(16)
            crossed = "returned"
        except RuntimeError as e:
            crossed = str(e)
        checks = []
        for pipe in pipes:  # every rank checks both, in one order: reported and reset
            try:
                pipe.check_errors()
                checks.append("clean")
            except PipelineTimeout as e:
                checks.append(f"PipelineTimeout: {e}")
        ys = []
        for pipe in pipes:  # (the producer's rank first: the interpreter's CTAs would miss a 0.1 s deadline)
            pipe.plan(16)
            if rank == 0:
                pipe(x)
            dist.barrier()
            ys.append(pipe(rows=16) if rank == 1 else None)
            dist.barrier()
            pipe.check_errors()
        refs = [pipe.sequential(x if rank == 0 else None, rows=None if rank == 0 else 16) for pipe in pipes]
        want = [x.float() @ w[0].float() @ w[1].float() for w in (a, b)]
        right = rank == 0 or all(
            torch.equal(y, r) and (y.float() - w).abs().max() < 0.05 for y, r, w in zip(ys, refs, want)
        )
        result[rank] = (crossed, checks, right, [p._serial for p in pipes])
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_a_plans_rows_and_row_buckets_are_refused_by_name(world1):
    """``plan(M)`` takes an int number of rows (numpy's too), not a float, None or a bool, and
    nothing below 1; ``row_buckets`` is named as ``Pipeline`` names it. Nothing is built. Neither
    pipeline can be pickled or copied (they hold GPU memory and streams): said by name."""
    import copy as copy_module
    import pickle

    import numpy as np

    ws = _weights([32, 48, 32])
    with pytest.raises(ValueError, match="row_buckets must be 0 or a power of two, got -1"):
        DistributedPipeline(ws, config=CFG, loopback=True, row_buckets=-1)
    pipe = DistributedPipeline(ws, config=CFG, loopback=True)
    single = Pipeline(ws, config=CFG)
    for p in (pipe, single):
        for bad, error, match in (
            (2.5, TypeError, "M must be an int number of rows, got float"),
            (None, TypeError, "got NoneType"),
            (True, TypeError, "got bool"),
            (0, ValueError, "M must be at least 1 row, got 0"),
            (torch.tensor(True), TypeError, "got Tensor"),
            (torch.tensor([16]), TypeError, "got Tensor"),
            (torch.tensor(16.0), TypeError, "got Tensor"),
        ):
            with pytest.raises(error, match=match):
                p.plan(bad)
        assert not p._plans
        assert p.plan(np.int64(16)) is p.plan(16) is p.plan(torch.tensor(16))
        for copy in (pickle.dumps, copy_module.copy, copy_module.deepcopy):  # refused by name
            with pytest.raises(TypeError, match=f"a {type(p).__name__} holds .*: it cannot be pickled or copied"):
                copy(p)


def _building_while_another_meets(rank, store, result):
    _two_cpu_ranks(rank, store)
    try:
        ws = _weights([32, 48, 32])
        pipe = DistributedPipeline([ws[rank]], config=CFG, timeout_s=0.1)
        try:  # rank 0 builds a second pipeline while rank 1 plans the first: both find out
            DistributedPipeline([ws[rank]], config=CFG) if rank == 0 else pipe.plan(16)
            met = "returned"
        except RuntimeError as e:
            met = str(e)
        try:
            pipe.check_errors()
            checked = "clean"
        except PipelineTimeout as e:
            checked = f"PipelineTimeout: {e}"
        second = DistributedPipeline([ws[rank]], config=CFG)  # numbered alike on both ranks
        result[rank] = (met, checked, second._serial)
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_a_rank_building_a_pipeline_while_another_meets_in_one_finds_out(tmp_path):
    """A rank that builds a pipeline while the others meet in one built before: the builder
    raises that the others are not building, the others that the ranks are out of step; the
    failed build takes no number, so the next pipeline built is numbered alike on both."""
    result = _results()
    _spawn(_building_while_another_meets, (str(tmp_path / "store"), result))
    (met0, _, second0), (met1, checked1, second1) = result[0], result[1]
    assert met0.startswith("the ranks are out of step: rank 1 is not building a DistributedPipeline"), met0
    assert met1.startswith("the ranks are out of step (rank 0: another collective, rank 1: build a plan)"), met1
    assert checked1.startswith("PipelineTimeout") and second0 == second1 == 2


@pytest.mark.interpreter
def test_ranks_that_call_different_pipelines_of_one_group_find_out(tmp_path):
    """Two pipelines of the same shapes on one group: ranks that build a plan of different ones
    meet with each other's steps. Each pipeline's meets name it (the order it was built in on the
    group), so both ranks raise that they are out of step, naming the pipelines, instead of
    wiring one's memory to the other's; checked on every rank, both reset, and then each
    pipeline computes its own weights' chain."""
    result = _results()
    _spawn(_two_pipelines, (str(tmp_path / "store"), result))
    for rank in (0, 1):
        crossed, checks, right, serials = result[rank]
        assert crossed.startswith(
            "the ranks are out of step (rank 0: build a plan of pipeline 1, rank 1: build a plan of pipeline 2); "
            "the ranks called different pipelines"
        ), crossed
        assert serials == [1, 2]
        assert any(c.startswith("PipelineTimeout") for c in checks), checks
        assert right


class _Unreadable(list):
    def __iter__(self):
        raise RuntimeError("this config cannot be read")


def _a_rank_hung(rank, store, result):
    _two_cpu_ranks(rank, store)
    try:
        ws = _weights([32, 48, 32])
        try:  # an error of neither ValueError's nor TypeError's type, on one rank only: raised on both
            DistributedPipeline([ws[rank]], config=_Unreadable() if rank == 1 else CFG)
            refused = "built"
        except ValueError as e:
            refused = str(e)
        pipe = DistributedPipeline([ws[rank]], config=CFG, timeout_s=0.1, row_buckets=0)
        pipe.plan(16)
        if rank == 1:  # its GPU did not finish at an earlier wait (as a PipelineHung leaves it)
            pipe.segments[0]._broken = "stage 1 (rank 1) on cpu did not finish within host_timeout_s=1 s"
        lines = []
        for step in ("check", "call"):
            try:
                if step == "check":
                    pipe.check_errors()
                else:
                    pipe(torch.randn(16, 32).half()) if rank == 0 else pipe(rows=16)
                lines.append("no error")
            except PipelineHung as e:
                lines.append("hung: " + str(e))
        result[rank] = [refused] + lines
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_a_rank_whose_gpu_hung_makes_every_rank_raise_and_refuse(tmp_path):
    """A rank whose GPU did not finish: the next check raises PipelineHung on every rank, naming
    that rank (none zeroes its state under that GPU's kernels), and every rank then refuses
    calls (the chain cannot run without it). Before that, a construction one rank refuses with
    an error of any type is refused on both ranks, naming the rank and the error."""
    result = _results()
    _spawn(_a_rank_hung, (str(tmp_path / "store"), result))
    for rank in (0, 1):
        refused, check, call = result[rank]
        assert refused == "rank 1: RuntimeError: this config cannot be read", (rank, refused)
        assert check.startswith("hung: ") and "rank 1 is unusable" in check, (rank, check)
        assert call.startswith("hung: ") and "unusable" in call, (rank, call)


def _three_ranks(rank, store, result):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    try:
        ws = _weights([32, 48, 32, 16])
        pipe = DistributedPipeline([ws[rank]], config=CFG, timeout_s=0.1, row_buckets=4)
        x = torch.randn(40, 32, generator=torch.Generator().manual_seed(3)).half()
        pipe.plan(40)  # 48 rows: calls on 40 are bucketed
        for r in range(3):  # one rank after the other (the interpreter's waits poll briefly)
            if rank == r:
                y = pipe(x) if r == 0 else pipe(rows=40)
            dist.barrier()
        pipe.check_errors()
        ref = pipe.sequential(x if rank == 0 else None, rows=None if rank == 0 else 40)
        result[rank] = rank != 2 or (torch.equal(y, ref) and y.shape == (40, 16))
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
def test_three_ranks_on_a_bucketed_height(tmp_path):
    """The middle rank runs the call on the call's rows, not its plan's height."""
    result = _results()
    _spawn(_three_ranks, (str(tmp_path / "store"), result), nprocs=3)
    assert dict(result) == {0: True, 1: True, 2: True}


def _pair_then_three(rank, store, result):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3)
    dist.get_backend = lambda group=None: "nccl"  # (this process's own module) each pipeline makes its gloo group
    try:
        pair = dist.new_group([0, 1])
        ws = _weights([32, 48, 32, 16])
        x = torch.randn(24, 32, generator=torch.Generator().manual_seed(5)).half()
        if rank < 2:  # a pipeline on two of the three ranks: rank 2 makes no group for it
            two = DistributedPipeline([ws[rank]], group=pair, config=CFG, row_buckets=0, meet_timeout_s=30.0)
            two.plan(24)
        three = DistributedPipeline([ws[rank]], config=CFG, timeout_s=0.1, row_buckets=0, meet_timeout_s=30.0)
        three.plan(24)
        for r in range(3):
            if rank == r:
                y = three(x) if r == 0 else three(rows=24)
            dist.barrier()
        three.check_errors()
        ref = three.sequential(x if rank == 0 else None, rows=None if rank == 0 else 24)
        result[rank] = rank != 2 or torch.equal(y, ref)
    finally:
        dist.destroy_process_group()


def _host_groups(rank, store, result):
    import datetime

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=30)
    )
    try:
        pair = dist.new_group([0, 1])
        try:  # (torch 2.13; torch 2.11's new_group sorts the ranks always)
            turned = dist.new_group([2, 0, 1], sort_ranks=False)  # group rank 0 is global rank 2
        except TypeError:
            turned = dist.new_group([0, 1, 2])
        if rank < 2:  # rank 2 makes one group fewer
            hostgroup.gather_objects(hostgroup.gloo_group(pair), rank)
        every = hostgroup.gloo_group(dist.group.WORLD, datetime.timedelta(seconds=30))
        with torch.device("meta"):  # the exchange stays on the CPU
            seen = hostgroup.gather_objects(every, {"rank": rank, "pad": "x" * 100 * rank})
        order = hostgroup.gather_objects(hostgroup.gloo_group(turned), (dist.get_rank(turned), rank))
        assert [r for _, r in order] == dist.get_process_group_ranks(turned)
        result[rank] = ([s["rank"] for s in seen], order)
    finally:
        dist.destroy_process_group()


def test_host_groups_are_named_alike_on_every_rank_and_gather_in_group_order(tmp_path):
    """A group made for all three ranks after one that rank 2 did not make (as a pipeline on
    two of them makes) meets on every rank; objects of different sizes come back in the group's
    rank order, which for a group made with ``sort_ranks=False`` is not the global one."""
    result = _results()
    _spawn(_host_groups, (str(tmp_path / "store"), result), nprocs=3)
    for rank in range(3):
        seen, order = result[rank]
        assert seen == [0, 1, 2] and [g for g, _ in order] == [0, 1, 2], (rank, result[rank])


@pytest.mark.interpreter
def test_a_rank_outside_an_earlier_pipeline_meets_its_peers_in_the_next(tmp_path):
    """On a group of another backend each pipeline makes a gloo group for its meets. A rank that
    was not in an earlier pipeline (two of three ranks) made one group fewer; the next pipeline's
    group is still named alike on all three (``hostgroup``), so they meet and compute the chain
    rather than wait for each other until ``meet_timeout_s``."""
    result = _results()
    _spawn(_pair_then_three, (str(tmp_path / "store"), result), nprocs=3)
    assert dict(result) == {0: True, 1: True, 2: True}


@pytest.mark.interpreter
def test_default_timeouts_admit_many_stages_on_a_rank(world1):
    """The defaults (docs/api.md): ``start_timeout_s = max(2.5, 2.5 * timeout_s)`` and
    ``host_timeout_s = max(10, 10 * timeout_s, 2 * start + (stages + 2) * timeout_s)``, which
    admits five stages on a rank (the bound ``2 * start + (stages + 1) * timeout_s`` is 11 s)."""
    ws = _weights([32, 48, 32, 48, 32, 48])
    pipe = DistributedPipeline(ws, config=CFG, timeout_s=1.0)
    assert pipe.start_timeout_ns == 2_500_000_000 and pipe.host_timeout_s == 12.0
    assert pipe.segments[0].host_timeout_s == 12.0
    assert DistributedPipeline(ws[:1], config=CFG, timeout_s=0.5).host_timeout_s == 10.0


def test_a_neighbours_gpu_is_checked_for_peer_access_and_native_atomics_both_ways(monkeypatch):
    """Each rank checks the GPUs of its neighbouring ranks that its process sees (by UUID): the
    same GPU twice, no peer access either way, or peer access without native atomics either way
    (a producer's signals are atomics on the consumer's memory) is named; a GPU it cannot see
    is left to its own rank."""
    import types

    from ctapipelining import distributed, fabric

    uuids = ["gpu-a", "gpu-b", "gpu-c"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # gpu-c is another process's only
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    access, atomics = set(), set()
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: (i, j) not in access)
    monkeypatch.setattr(fabric, "native_peer_atomics", lambda i, j: (i, j) not in atomics)
    every = [{"uuid": u} for u in uuids]
    cuda0, cuda1 = torch.device("cuda", 0), torch.device("cuda", 1)
    assert distributed._peer_error(every, 0, cuda0) is None and distributed._peer_error(every, 1, cuda1) is None
    atomics.add((1, 0))  # rank 1 cannot signal rank 0's GPU: both ranks say so
    for rank, device in ((0, cuda0), (1, cuda1)):
        assert "cuda:1 cannot make atomic operations on cuda:0's memory" in distributed._peer_error(every, rank, device)
    atomics.clear()
    for one_way in ((0, 1), (1, 0)):  # either way, from either rank
        access.add(one_way)
        for rank, device in ((0, cuda0), (1, cuda1)):
            assert "cannot access each other's memory" in distributed._peer_error(every, rank, device), one_way
        access.clear()
    assert "same GPU (gpu-a)" in distributed._peer_error([{"uuid": "gpu-a"}] * 2, 1, cuda0)


def test_a_torch_without_symmetric_memory_is_named(monkeypatch):
    import sys

    from ctapipelining import fabric

    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)  # import fails
    monkeypatch.delattr(torch.distributed, "_symmetric_memory", raising=False)
    with pytest.raises(fabric.SymmetricMemoryError, match=r"needs PyTorch symmetric memory \(torch >= 2.6"):
        fabric.symmetric_memory()


@pytest.mark.interpreter
def test_a_segment_is_called_through_its_pipeline_and_sequential_refuses_bad_input(world1):
    ws = _weights([32, 48, 32])
    pipe = DistributedPipeline(ws, config=CFG, loopback=True)
    x = torch.randn(40, 32).half()
    with pytest.raises(RuntimeError, match="call its DistributedPipeline"):
        pipe.segments[0](x)
    with pytest.raises(RuntimeError, match="run the stages one after another failed: rank 0: ValueError"):
        pipe.sequential(rows=40)  # rank 0 gives x: refused on every rank, nobody left in a recv
    assert torch.equal(pipe(x), pipe.sequential(x))


# -- fused MLP blocks, a block per rank ---------------------------------------------------------
SMALL = GemmConfig(16, 32, 16, group_m=2, num_stages=2, num_warps=4)  # a gated tile holds 16 columns
DOWN = GemmConfig(16, 16, 16, group_m=1, num_stages=2, num_warps=4)
HID, INTER = 48, 80


def _blocks(kind: str):
    """Two small fused blocks (fp16: the interpreter), different weights."""
    from ctapipelining.nn import GPTMLP, LlamaMLP

    g = torch.Generator().manual_seed(11)

    def w(*shape, scale=None):
        return (torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)).half()

    def one():
        norm = (1 + 0.2 * torch.randn(HID, generator=g)).half()
        if kind == "llama":
            return LlamaMLP(w(INTER, HID), w(INTER, HID), w(HID, INTER), norm, gate_up_config=SMALL, down_config=DOWN)
        return GPTMLP(w(INTER, HID), w(INTER, scale=0.1), w(HID, INTER), w(HID, scale=0.1), norm, w(HID, scale=0.1),
                      up_config=SMALL, down_config=DOWN)  # fmt: skip

    return [one(), one()]


@pytest.mark.parametrize("queue", [False, True])
@pytest.mark.parametrize("rows", [16, 40, 100])
def test_heap_layout_of_fused_stages_fits_and_matches_the_producers(rows, queue):
    """Gated stages, RMSNorms and LayerNorms over four ranks, a segment per stage: every region
    (the sums included) inside the heap, aligned, on the consumer's rank, none overlapping; each
    link's dependency on the producer's stored tiles; the sums one per row and producer tile."""
    from ctapipelining.distributed import stage_spec
    from ctapipelining.epilogue import Epilogue, silu

    w = lambda k, n: torch.zeros(k, n).half()  # noqa: E731
    rms, gated = Epilogue(rms_eps=1e-5), Epilogue(silu, gated=True, rms_eps=1e-5)
    layer = lambda n: Epilogue(layer_norm_eps=1e-5, col_sum=torch.zeros(n))  # noqa: E731
    ranks = [
        [stage_spec(w(32, 96), SMALL, gated)],
        [stage_spec(w(48, 64), SMALL, layer(64))],
        [stage_spec(w(64, 32), SMALL, rms), stage_spec(w(32, 16), SMALL, None)],
        [stage_spec(w(16, 48), SMALL, layer(48))],
    ]
    p = Placement.of(ranks, loopback=True)
    lay = heap_layout(p, rows, None, torch.float16, queue)
    check_regions(p, lay)
    for s in p.cross_links():
        dep, (_, N) = lay.deps[s], p.shapes[s - 1]
        assert dep.producer.N == p.cols(s - 1) and dep.producer.block_n == SMALL.block_n * p.cols(s - 1) // N
        parts = -(-N // SMALL.block_n)
        names = {"rms": ["sumsq"], "layer": ["sumsq", "sums"], None: []}[p.norm(s)]
        assert [n for n in ("sumsq", "sums") if (n, s) in lay.regions] == names, s
        assert all(lay.regions[(n, s)].shape == (rows, parts) for n in names)
    with pytest.raises(ValueError, match="configurations"):
        heap_layout(Placement.of([[(32, 48)], [(48, 16)]]), rows, None, torch.float16, queue)


def test_placement_and_heap_of_fused_stages():
    """A gated stage chains by its halved columns and its tiles are half as wide in the link's
    dependency; a stage that normalises its input has its producer's partial sums in the heap:
    sums of squares for an RMSNorm, and sums beside them for a LayerNorm, one per row and
    producer tile."""
    from ctapipelining.distributed import stage_spec
    from ctapipelining.epilogue import Epilogue, silu

    rms, layer = Epilogue(rms_eps=1e-5), Epilogue(layer_norm_eps=1e-5, col_sum=torch.zeros(64))
    gated = Epilogue(silu, gated=True)
    w = lambda k, n: torch.zeros(k, n).half()  # noqa: E731
    ranks = [[stage_spec(w(32, 64), SMALL, gated), stage_spec(w(32, 48), SMALL, None)],
             [stage_spec(w(48, 64), SMALL, rms)], [stage_spec(w(64, 16), SMALL, layer)]]  # fmt: skip
    p = Placement.of(ranks)
    assert p.cols(0) == 32 and p.norms == (None, None, "rms", "layer") and p.residuals == (False,) * 4
    lay = heap_layout(p, 40, CFG, torch.float16, False)
    assert lay.regions[("sumsq", 2)].shape == (40, 2) and ("sums", 2) not in lay.regions  # 48 wide: 2 tiles of 32
    assert lay.regions[("sumsq", 3)].shape == lay.regions[("sums", 3)].shape == (40, 2)
    assert lay.regions[("sumsq", 3)].dtype == torch.float32 and lay.regions[("sumsq", 3)].rank == 2
    with pytest.raises(ValueError, match="outputs 32 columns"):
        Placement.of([[stage_spec(w(32, 64), SMALL, gated)], [stage_spec(w(64, 16), SMALL, None)]])
    inner = Placement.of([[stage_spec(w(32, 64), SMALL, gated)], [stage_spec(w(32, 16), SMALL, None)]])
    dep = heap_layout(inner, 40, CFG, torch.float16, False).deps[1]
    assert dep.producer.block_n == 16 and dep.producer.num_n == 2  # the gated GEMM's stored tiles


@pytest.mark.interpreter
def test_blocks_on_one_rank_and_what_cannot_be_split(world1):
    """A rank with two Llama blocks runs them as one segment, bitwise the one-process stack; a
    block split over segments (loopback: a segment per stage) is refused, since the down GEMM's
    residual would be another segment's input; per-stage configurations are checked."""
    from ctapipelining.nn import LlamaStack

    blocks = _blocks("llama")
    ws, cfgs, epis = (sum(parts, []) for parts in zip(*(b.pipeline_stages() for b in blocks)))
    pipe = DistributedPipeline(ws, config=cfgs, epilogues=epis, timeout_s=0.1)
    x = torch.randn(40, HID).half()
    y = pipe(x, check=True)
    assert torch.equal(y, pipe.sequential(x)) and torch.equal(y, LlamaStack(blocks)(x))
    with pytest.raises(ValueError, match="keep a block's GEMMs on one rank"):
        DistributedPipeline(ws, config=cfgs, epilogues=epis, loopback=True)
    with pytest.raises(ValueError, match="a list of one per stage"):
        DistributedPipeline(ws, config=cfgs[:3], epilogues=epis)
    with pytest.raises(ValueError, match="one Epilogue or None per stage"):
        DistributedPipeline(ws, config=cfgs, epilogues=epis[:3])


@pytest.mark.interpreter
@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_norms_across_segments_take_the_sums_through_the_heap(world1, policy):
    """A segment per stage (world size 1, loopback): stage 1's RMSNorm and stage 2's LayerNorm
    take their rows' partial sums from the stage before through the heap, and a gated SiLU halves
    stage 1's columns; with the heap's sums NaN-poisoned first, bitwise the one-process pipeline
    and the stages one after another."""
    from ctapipelining.epilogue import Epilogue, silu

    ws = _weights([32, 48, 64], seed=3) + _weights([32, 16], seed=4)
    epis = [None, Epilogue(silu, gated=True, rms_eps=1e-5),
            Epilogue(layer_norm_eps=1e-5, col_sum=ws[2].float().sum(0).contiguous())]  # fmt: skip
    pipe = DistributedPipeline(ws, config=SMALL, epilogues=epis, loopback=True, policy=policy, timeout_s=0.1)
    assert len(pipe.segments) == 3
    x = torch.randn(37, 32).half()
    plan = pipe.plan(37)
    for link in plan.links.values():
        for u in link.sums if isinstance(link.sums, tuple) else (link.sums,):
            u.fill_(float("nan"))
    y = pipe(x, check=True)
    one = Pipeline(ws, config=SMALL, epilogues=epis, policy=policy, row_buckets=0)
    assert torch.equal(y, one(x)) and torch.equal(y, pipe.sequential(x)) and not y.isnan().any()
    assert isinstance(plan.links[2].sums, tuple) and plan.links[1].sums.shape == (48, 2)
    # stage 2's LayerNorm reads them: scaled between its producer's segment and its own, the output moves
    out = torch.empty_like(y)
    pipe._run(plan, x, out, 37, only=[0, 1])
    for u in plan.links[2].sums:
        u.mul_(4)
    pipe._run(plan, x, out, 37, only=[2])
    pipe.check_errors()
    assert not torch.equal(out, y)


def _block_per_rank(rank, store, result, kind):
    os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        from ctapipelining.nn import GPTStack, LlamaStack

        blocks = _blocks(kind)
        ws, cfgs, epis = blocks[rank].pipeline_stages()
        x = torch.randn(37, HID, generator=torch.Generator().manual_seed(2)).half()
        lines = []
        if kind == "llama":  # a refusal only rank 1's segment finds is raised on both ranks
            from ctapipelining.epilogue import Epilogue

            bad = (
                [torch.zeros(HID, HID).half()]
                if rank == 0
                else [torch.zeros(HID, 32).half(), torch.zeros(32, 16).half()]
            )
            try:
                DistributedPipeline(bad, config=DOWN, epilogues=None if rank == 0 else [None, Epilogue(residual=True)])
                lines.append("built")
            except ValueError as e:
                lines.append("refused" if "rank 1: ValueError: stage 2's residual" in str(e) else str(e))
        for policy in ("static",) if kind == "llama" else ("workqueue",):  # (both policies: world1's tests)
            pipe = DistributedPipeline(ws, config=cfgs, epilogues=epis, policy=policy, timeout_s=0.1)
            pipe.plan(37)
            plan = pipe.plan(37)
            for seg_plan in plan.plans:  # every intermediate and sums buffer poisoned, the heap's too
                for t in seg_plan.inputs[1:] + [s for s in seg_plan.sums if s is not None]:
                    for u in t if isinstance(t, tuple) else (t,):
                        u.fill_(float("nan"))
            for link in plan.links.values():
                for u in link.sums if isinstance(link.sums, tuple) else (link.sums,):
                    if u is not None and rank == 1:
                        u.fill_(float("nan"))
            dist.barrier()
            if rank == 0:  # the producer's rank first (the interpreter's waits poll briefly)
                pipe(x)
            dist.barrier()
            y = pipe(rows=37) if rank == 1 else None
            dist.barrier()
            pipe.check_errors()
            received = []  # what rank 1's segment gets from rank 0 for its norm in the reference
            if rank == 1:
                inner = pipe.segments[0]._sequential
                pipe.segments[0]._sequential = lambda h, sums, got=received, run=inner: got.append(sums) or run(h, sums)
            ref = pipe.sequential(x if rank == 0 else None, rows=None if rank == 0 else 37)
            if rank == 1:
                del pipe.segments[0]._sequential
                sent = received[0] if kind == "gpt" else (received[0],)
                heap = plan.links[2].sums if kind == "gpt" else (plan.links[2].sums,)
                lines.append(all(torch.equal(a[:37], b[:37]) for a, b in zip(sent, heap)))
                stack = (LlamaStack if kind == "llama" else GPTStack)(blocks)
                lines.append((torch.equal(y, ref), torch.equal(y, stack(x)), bool(y.isnan().any())))
                # the sums block 0's down GEMM left in this rank's heap: per row and 16 columns of
                # its output (block 1's input), a LayerNorm's centred on each part's mean
                h = plan.plans[0].inputs[0] if plan.plans[0].inputs[0] is not None else plan.inputs[0]
                parts = h[:37].float().view(37, -1, 16)
                sums = plan.links[2].sums
                if kind == "llama":
                    lines.append(torch.allclose(sums[:37], parts.pow(2).sum(-1), rtol=1e-4))
                else:
                    centred = (parts - parts.mean(-1, keepdim=True)).pow(2).sum(-1)
                    lines.append(torch.allclose(sums[0][:37], centred, rtol=1e-3, atol=1e-3)
                                 and torch.allclose(sums[1][:37], parts.sum(-1), rtol=1e-4, atol=1e-4))  # fmt: skip
                # and its reference takes them as sent: scaled, its result changes
                seg, got = pipe.segments[0], tuple(t[:37] for t in sums) if kind == "gpt" else sums[:37]
                scaled = tuple(4 * t for t in got) if kind == "gpt" else 4 * got
                again = seg._sequential(h[:37], got)[0]
                lines.append(torch.equal(again, y) and not torch.equal(seg._sequential(h[:37], scaled)[0], again))
            dist.barrier()  # rank 1 has read its heap before rank 0 writes into it again
            # block 1's norm reads those sums: scaled, its output changes
            pipe.plan(37)
            if rank == 0:
                pipe(x)
            dist.barrier()
            if rank == 1:
                for u in plan.links[2].sums if isinstance(plan.links[2].sums, tuple) else (plan.links[2].sums,):
                    u.mul_(4)
                lines.append(not torch.equal(pipe(rows=37, check=False), ref))
            dist.barrier()
            pipe.check_errors()
        result[rank] = lines
    finally:
        dist.destroy_process_group()


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_block_per_rank_in_two_processes(tmp_path, kind):
    """Two fused blocks, one per rank: block 1's norm takes its rows' partial sums (a LayerNorm's
    sums too) that block 0's down GEMM writes into rank 1's heap with its tiles. With every
    buffer NaN-poisoned first, bitwise the stages one after another (the sums sent along) and
    the one-process stack: the Llama blocks under the static policy, the GPT blocks under the
    work queue (both policies through one rank's heap: ``test_norms_across_segments_...``)."""
    result = _results()
    _spawn(_block_per_rank, (str(tmp_path / "store"), result, kind))
    lines = result[1]
    if kind == "llama":
        assert result[0][0] == lines[0] == "refused", (result[0][0], lines[0])
        lines = lines[1:]
    assert lines == [True, (True, True, False), True, True, True]


@pytest.mark.interpreter
def test_one_rank_at_several_heights_and_back_under_torchrun(tmp_path):
    """``tests/ranks_heights.py`` (which the GPU tests run on one and two GPUs) under torchrun with
    one CPU rank: six checked calls at three heights, returning to earlier ones, each bitwise equal
    to the stages one after another, and every height's plan kept."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent / "ranks_heights.py"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["world"] == 1 and res["equal"] == [True] * 6 and res["plans"] == [16, 40, 64]


def test_a_ranks_own_bad_arguments_are_refused_by_name(world1, monkeypatch):
    """What a rank checks alone, refused by name before anything is built: weights of two dtypes
    (in loopback each segment holds one, and none would see both), timeouts that are not
    numbers of seconds (checked before any default is derived from them), a start timeout under
    a nanosecond (a gate that looks once), a ``loopback`` that is not a bool."""
    from ctapipelining import operands

    real = operands.check_tensor  # (bf16 is refused under the interpreter alone: let it through here)
    monkeypatch.setattr(operands, "check_tensor", lambda t, name: t.dtype == torch.bfloat16 or real(t, name))
    w0, w1 = _weights([32, 48, 32])
    with pytest.raises(ValueError, match=r"TypeError: rank 0's weights are \['torch.bfloat16', 'torch.float16'\]"):
        DistributedPipeline([w0, w1.bfloat16()], config=CFG, loopback=True)
    ws = [w0, w1]
    with pytest.raises(ValueError, match="host_timeout_s must be a positive number of seconds, got '10'"):
        DistributedPipeline(ws, config=CFG, loopback=True, host_timeout_s="10")
    with pytest.raises(ValueError, match="start_timeout_s must be a positive number of seconds, got '1'"):
        DistributedPipeline(ws, config=CFG, loopback=True, start_timeout_s="1")
    with pytest.raises(ValueError, match="start_timeout_s must be at least a nanosecond"):
        DistributedPipeline(ws, config=CFG, loopback=True, start_timeout_s=1e-12)
    with pytest.raises(ValueError, match="loopback must be True or False, got 'no'"):
        DistributedPipeline(ws, config=CFG, loopback="no")


def test_plan_waits_for_the_pipelines_lock_and_a_refused_capture_puts_the_rank_out_of_step(world1, monkeypatch):
    """``plan`` (collective where it builds) holds the lock a call holds, so it cannot meet the
    other ranks in the middle of another thread's call. A capture this rank refuses on its own
    (a bad ``M``) marks it out of step and meets the others' warm-up check, as a refused call
    with ``check=True`` does; ``M`` may be numpy's int, as for ``plan``."""
    import threading

    import numpy as np

    pipe = DistributedPipeline(_weights([32, 48, 32]), config=CFG, loopback=True, timeout_s=0.1, row_buckets=0)
    held, release = threading.Event(), threading.Event()
    built, errors = [], []  # whether the lock was free when the plan was built; the thread's errors
    real_build = pipe._build_plan
    monkeypatch.setattr(pipe, "_build_plan", lambda B: built.append(release.is_set()) or real_build(B))

    def hold():
        with pipe._lock:
            held.set()
            release.wait(30)

    def build():
        try:
            pipe.plan(40)
        except BaseException as e:  # noqa: BLE001 (raised below, in the test's thread)
            errors.append(e)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    builder = threading.Thread(target=build)
    builder.start()
    builder.join(0.5)  # (a plan() that took no lock would have built it by now)
    release.set()
    holder.join()
    builder.join(30)
    assert not errors and built == [True], (errors, built)  # built only once the lock was free
    assert pipe.plan(np.int64(40)) is pipe.plan(40)
    monkeypatch.setattr(pipe, "on_gpu", True)  # (past the CPU's refusal: the M check comes next)
    monkeypatch.setattr(pipe, "_capturing", lambda: False)
    for bad, error, match in ((0, ValueError, "M must be at least 1 row"),
                              (1 << 40, RuntimeError, None)):  # fmt: skip  (its warm-up input cannot be allocated)
        checked = []
        pipe._out_of_step = None
        monkeypatch.setattr(pipe, "check_errors", lambda checked=checked: checked.append(1))
        with pytest.raises(error, match=match):
            pipe.capture(bad)
        assert pipe._out_of_step is not None and "refused a capture" in pipe._out_of_step and checked == [1], bad


def test_a_heap_view_refuses_a_negative_offset_or_rank():
    from ctapipelining.fabric import Heap

    h = Heap(0, 1024, [torch.zeros(1024, dtype=torch.uint8), torch.ones(1024, dtype=torch.uint8)])
    assert h.view(1, 1016, (1,), torch.int64).item() == 0x0101010101010101
    with pytest.raises(ValueError, match="does not fit"):
        h.view(0, -256, (4,), torch.int64)
    with pytest.raises(ValueError, match="rank -1 has no heap here"):
        h.view(-1, 0, (4,), torch.int64)
    with pytest.raises(ValueError, match="rank 2 has no heap here"):
        h.view(2, 0, (4,), torch.int64)
    with pytest.raises(ValueError, match="does not fit"):
        h.view(0, 0, (-2, -4), torch.int64)
