"""The chain kernel (stages that share a device, one persistent kernel, tiles claimed from a
ticket in one combined order) under the Triton interpreter: results bitwise equal to the
stages run one after another, the ticket's arithmetic for any number of calls, timeouts that
end clean, links to other kernels through rings or counters."""

import dataclasses

import pytest
import torch
from protocol_state import preset_epoch

from ctapipelining import deps
from ctapipelining.chain import ChainLaunch, ChainStage
from ctapipelining.epilogue import Epilogue, gelu, silu
from ctapipelining.gemm import GemmLaunch
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline, PipelineTimeout
from ctapipelining.plan import Link, i64_zeros

pytestmark = pytest.mark.interpreter

PARTS = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=2, num_warps=4, wait_parts=2)
CPU = torch.device("cpu")


def chain(*dims):
    return [(torch.randn(k, n) / k**0.5).half() for k, n in zip(dims, dims[1:])]


def ticket_of(plan, i=0):
    return int(plan.tickets[i])


@pytest.mark.parametrize("policy", ["static", "workqueue"])
@pytest.mark.parametrize(
    "dims",
    [(16, 40, 24), (24, 16, 40, 32), (16, 24, 40, 24, 16), (16, 24, 16, 32, 24, 16), (16, 24, 16, 32, 24, 16, 40)],
)
def test_chain_kernel_equals_the_stages_one_after_another(policy, dims):
    """2 to 6 stages on one device (5: a chain kernel of 4, then a kernel of its own; 6: two
    chain kernels, the second's first stage waiting on the first's last, by the policy's ring or
    counters), 33 rows (a last row-block of one row), widths that do not divide the tiles;
    NaN-poisoned buffers, two calls without reset."""
    ws = chain(*dims)
    pipe = Pipeline(ws, policy=policy, config=PARTS, loopback=False)
    n = len(ws)
    assert pipe.groups == [list(range(i, min(i + 4, n))) for i in range(0, n, 4)]
    plan = pipe.plan(33)
    first = plan.launches[0].gemm
    assert isinstance(first, ChainLaunch)
    for call in range(1, 3):
        x = torch.randn(33, dims[0]).half()
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        out = torch.full((33, dims[-1]), float("nan"), dtype=torch.float16)
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x))
        assert ticket_of(plan) == call * first.claims_per_run  # every CTA claims its count


@pytest.mark.parametrize("start", [2**31 - 2, 2**40])
def test_chain_ticket_and_counters_do_not_wrap(start):
    """From just below 2^31 calls (a ticket far past 2^32) and from 2^40: results right, the
    ticket and the counters inside the kernel exactly where ``start + calls`` calls put them."""
    ws = chain(16, 40, 24, 16)
    pipe = Pipeline(ws, config=PARTS, loopback=False)
    plan = pipe.plan(40)
    preset_epoch(plan, start)
    ch = plan.launches[0].gemm
    for call in range(1, 3):
        x = torch.randn(40, 16).half()
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
        assert ticket_of(plan) == (start + call) * ch.claims_per_run
        for link in plan.links:
            assert link.counters.tolist() == [(start + call) * int(k) for k in link.dep.need]


@pytest.mark.parametrize("counter", [0, 1])
def test_chain_timeout_inside_the_kernel_is_clean_and_the_next_call_right(counter):
    """A counter inside the kernel that never fills (its consumer needs one signal more than
    its producers send), of a row-block's first part or of its second: the call raises
    PipelineTimeout naming the stage and the counter, and after it the pipeline runs right
    again. (A part waited for inside the K loop: ``test_kernels_interpreter.py``.)"""
    ws = chain(16, 24, 40, 16)
    pipe = Pipeline(ws, config=PARTS, timeout_s=0.05, loopback=False)
    x = torch.randn(40, 16).half()
    plan = pipe.plan(40)
    plan.links[1].need_consumer[counter] += 1
    with pytest.raises(PipelineTimeout, match=f"stage 2 on cpu.*counter {counter}"):
        pipe(x, check=True)
    plan.links[1].need_consumer[counter] -= 1
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


@pytest.mark.parametrize("queue", [False, True])
def test_chain_kernel_between_two_kernels(queue):
    """A chain kernel whose first stage waits on another kernel and whose last signals one, by
    the ring (``queue``) or by counters: GEMM -> [stage 1, stage 2] -> GEMM. Then, with the
    first kernel not run, the chain's first stage times out: every CTA still claims its count,
    so the ticket moves by a run's claims, and the error word names stage 1."""
    cfg = PARTS
    M, dims = 40, (16, 24, 40, 32, 16)
    ws = chain(*dims)
    grids = [deps.TileGrid(M, w.shape[1], cfg.block_m, cfg.block_n) for w in ws]
    links, bufs = [], []
    for s in range(1, 4):
        # the link into the chain's first stage and out of its last follow the policy; inside: counters
        outer = s in (1, 3)
        parts = 1 if queue and outer else cfg.wait_parts
        dep = deps.build_dependency(grids[s - 1], grids[s], "gemm", consumer_k=dims[s], parts=parts)
        links.append(Link.create(dep, CPU, CPU))
        bufs.append(torch.full((M, dims[s]), float("nan"), dtype=torch.float16))
    lq = [None, queue, False, queue]  # the link into stage s waits on a ring
    epochs, errors = [i64_zeros(1, CPU) for _ in range(4)], [i64_zeros(8, CPU) for _ in range(4)]
    ticket = i64_zeros(1, CPU)
    first = GemmLaunch(M, dims[1], dims[0], cfg, 4, CPU, signal=links[0].signal_hook(queue), epoch=epochs[0])
    middle = ChainLaunch(
        M,
        [
            ChainStage(dims[2], dims[1], wait=links[0].wait_hook(lq[1]), signal=links[1].signal_hook(False),
                       err=errors[1], stage=1),
            ChainStage(dims[3], dims[2], wait=links[1].wait_hook(False), signal=links[2].signal_hook(lq[3]),
                       err=errors[2], stage=2),
        ],  # fmt: skip
        cfg, 3, CPU, ticket=ticket, epoch=epochs[1], queue=queue, timeout_ns=50_000_000,
    )  # fmt: skip
    last = GemmLaunch(M, dims[4], dims[3], cfg, 4, CPU, wait=links[2].wait_hook(queue), epoch=epochs[3], err=errors[3])
    x = torch.randn(M, dims[0]).half()
    out = torch.full((M, dims[4]), float("nan"), dtype=torch.float16)
    first(x, ws[0], bufs[0])  # run 1 (each epoch holds the runs before: 0)
    middle([(bufs[0], ws[1], bufs[1]), (bufs[1], ws[2], bufs[2])])
    last(bufs[2], ws[3], out)
    for e in epochs:  # what a pipeline does after its launches
        e.add_(1)
    ref = x
    for w in ws:
        ref = ref.float() @ w.float()
    assert [int(e[0]) for e in errors] == [0, 0, 0, 0]
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-3
    assert int(ticket) == middle.claims_per_run
    # the next run without the first kernel: stage 1 waits for input that never comes
    middle([(bufs[0], ws[1], bufs[1]), (bufs[1], ws[2], bufs[2])])
    assert int(errors[1][0]) == 1 and int(errors[1][1]) == 1  # flag, stage
    assert int(ticket) == 2 * middle.claims_per_run


def test_padded_out_and_any_grid():
    """The last stage writes an ``out`` whose rows are padded (ordinary stores), and the chain
    kernel is right on grids of 1, 2 and 3 CTAs (one CTA: every flush of a held tile matters)."""
    ws = chain(16, 40, 24, 40)
    for budget in (1, 2, 3):
        pipe = Pipeline(ws, config=PARTS, loopback=False, sm_budget=budget)
        x = torch.randn(37, 16).half()
        full = torch.full((37, 48), float("nan"), dtype=torch.float16)
        out = full[:, :40]
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x)), budget
        assert full[:, 40:].isnan().all()  # the padding is not written
        assert pipe.plan(37).num_ctas == [budget] * 3


def test_a_grid_larger_than_the_positions():
    """More CTAs than tiles: the extra CTAs claim past the end and run nothing."""
    M, (k0, n0, n1) = 20, (16, 24, 16)
    ws = chain(k0, n0, n1)
    dep = deps.build_dependency(
        deps.TileGrid(M, n0, 16, 16), deps.TileGrid(M, n1, 16, 16), "gemm", consumer_k=n0, parts=2
    )  # fmt: skip
    link, err, t, e = Link.create(dep, CPU, CPU), i64_zeros(8, CPU), i64_zeros(1, CPU), i64_zeros(1, CPU)
    stages = [
        ChainStage(n0, k0, signal=link.signal_hook(False)),
        ChainStage(n1, n0, wait=link.wait_hook(False), err=err),
    ]
    launch = ChainLaunch(M, stages, PARTS, 40, CPU, ticket=t, epoch=e)
    x, h, y = torch.randn(M, k0).half(), torch.empty(M, n0).half(), torch.full((M, n1), float("nan")).half()
    launch([(x, ws[0], h), (h, ws[1], y)])  # run 1: e holds the runs before it
    assert int(err[0]) == 0 and int(t) == launch.claims_per_run
    ref = (x.float() @ ws[0].float()).half().float() @ ws[1].float()
    assert float((y.float() - ref).norm() / ref.norm()) < 2e-3


def test_a_cta_runs_nothing_after_its_timeout():
    """One CTA, and the first consumer tile's input never completes: the CTA reports it and runs
    none of the later tiles (whose inputs are fine), so no output row is written."""
    ws = chain(16, 40, 24)
    pipe = Pipeline(ws, config=PARTS, loopback=False, sm_budget=1, timeout_s=0.05)
    x = torch.randn(48, 16).half()
    plan = pipe.plan(48)
    plan.links[0].need_consumer[0] += 1
    out = torch.full((48, 24), float("nan"), dtype=torch.float16)
    with pytest.raises(PipelineTimeout, match="stage 1"):
        pipe(x, out=out, check=True)
    assert out.isnan().all()


@pytest.mark.parametrize("offset", [5, -12, 10**6, -(10**6)])
def test_a_ticket_out_of_step_is_reported_and_reset(offset):
    """A ticket out of step with the epoch (as if buffers were overwritten) never gives a silent
    result: claims outside the run's are reported as such, alone when every claim is (the
    positions a small offset skips may time out their consumers first); then the pipeline runs
    right again."""
    ws = chain(16, 24, 16)
    pipe = Pipeline(ws, config=PARTS, loopback=False, timeout_s=0.05)
    x = torch.randn(40, 16).half()
    plan = pipe.plan(40)
    plan.tickets[0].fill_(offset)
    with pytest.raises(PipelineTimeout, match="out of step" if abs(offset) > 100 else "out of step|timed out"):
        pipe(x, check=True)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_a_chain_kernels_stages_launch_together():
    pipe = Pipeline(chain(16, 24, 16), config=PARTS, loopback=False)
    x = torch.randn(40, 16).half()
    with pytest.raises(ValueError, match="launch together"):
        pipe._launch(pipe.plan(40), x, torch.empty(40, 16).half(), only=[1])


def test_chain_launch_refuses_what_it_cannot_run():
    cfg = PARTS
    t, e = i64_zeros(1, CPU), i64_zeros(1, CPU)
    M = 32
    dep = deps.build_dependency(
        deps.TileGrid(M, 24, 16, 16), deps.TileGrid(M, 16, 16, 16), "gemm", consumer_k=24, parts=2
    )  # fmt: skip
    link = Link.create(dep, CPU, CPU)
    err = i64_zeros(8, CPU)
    ok = [ChainStage(24, 16, signal=link.signal_hook(False)), ChainStage(16, 24, wait=link.wait_hook(False), err=err)]
    ChainLaunch(M, ok, cfg, 2, CPU, ticket=t, epoch=e)
    bad = {
        "1 to 4 stages": [ok[0]] * 5,
        "has K=16 but the stage before it outputs 24 columns": [
            ok[0],
            ChainStage(16, 16, wait=link.wait_hook(False), err=err),
        ],
        "needs the partial sums that stage leaves": [
            ok[0],
            ChainStage(16, 24, wait=link.wait_hook(False), err=err, epilogue=Epilogue(rms_eps=1e-5)),
        ],
        "needs its wait": [ok[0], ChainStage(16, 24)],
        "needs its signal": [ChainStage(24, 16), ok[1]],
        "wait on counters": [ok[0], ChainStage(16, 24, wait=link.wait_hook(True), err=err)],
        "not on a ring": [ChainStage(24, 16, signal=link.signal_hook(True)), ok[1]],  # an inner signal on a ring
        "needs its stage's error word": [ok[0], ChainStage(16, 24, wait=link.wait_hook(False))],
    }
    for match, stages in bad.items():
        with pytest.raises(ValueError, match=match):
            ChainLaunch(M, stages, cfg, 2, CPU, ticket=t, epoch=e)
    # the first stage's wait comes from another GPU: it must follow the kernel's queue flag
    for outer_queue in (True, False):
        first = ChainStage(24, 16, wait=link.wait_hook(outer_queue), err=err, signal=link.signal_hook(False))
        with pytest.raises(ValueError, match=f"does not follow queue={not outer_queue}"):
            ChainLaunch(M, [first, ok[1]], cfg, 2, CPU, ticket=t, epoch=e, queue=not outer_queue)
    with pytest.raises(ValueError, match="num_ctas"):
        ChainLaunch(M, ok, cfg, 0, CPU, ticket=t, epoch=e)
    with pytest.raises(ValueError, match="epoch must be"):
        ChainLaunch(M, ok, cfg, 2, CPU, ticket=t, epoch=i64_zeros(2, CPU))
    with pytest.raises(ValueError, match="last stage needs its error word"):
        ChainLaunch(M, [ChainStage(24, 16)], cfg, 2, CPU, ticket=t, epoch=e)
    with pytest.raises(ValueError, match="ticket must be an int64 tensor"):
        ChainLaunch(M, ok, cfg, 2, CPU, ticket=i64_zeros(2, CPU), epoch=e)
    gated = ChainStage(40, 16, err=err, epilogue=Epilogue(silu, gated=True))  # runs of 8 gate, 8 up columns
    with pytest.raises(ValueError, match="halves B's 40 columns"):
        ChainLaunch(M, [gated], cfg, 2, CPU, ticket=t, epoch=e)


def test_loopback_chooses_a_kernel_per_stage_or_one_per_device():
    ws = chain(16, 24, 16, 24)
    assert Pipeline(ws).groups == [[0], [1], [2]]  # CPU tensors: each stage its own kernel by default
    assert Pipeline(ws, loopback=True).groups == [[0], [1], [2]]
    assert Pipeline(ws, loopback=False).groups == [[0, 1, 2]]
    for bad in ("yes", 1, 0):
        with pytest.raises(ValueError, match="loopback must be"):
            Pipeline(ws, loopback=bad)
    with pytest.raises(ValueError, match="need the stages on two GPUs"):
        Pipeline(ws[:2], loopback=False, ends="balanced")
    with pytest.raises(ValueError, match="need the stages on two GPUs"):
        Pipeline(ws[:2], config=PARTS, loopback=False, prefill_rows=16)
    with pytest.raises(ValueError, match="ends='balanced' runs both stages' rows with one configuration"):
        Pipeline(ws[:2], config=[PARTS, dataclasses.replace(PARTS, block_n=32)], ends="balanced")
    from ctapipelining.plan import Segment

    with pytest.raises(ValueError, match="a segment of a longer chain has no prefill or drain rows"):
        Pipeline(ws[:2], ends="balanced", segment=Segment(0, lambda M: (None, None), "rank 0"))


SPLIT = dataclasses.replace(PARTS, split_tail=True)


@pytest.mark.parametrize("M", [48, 33])
def test_chain_split_tail_equals_the_stages_with_the_same_split(M):
    """With ``split_tail``, the combined order's partial last round (within the last stage) runs
    as K-slices claimed from the ticket: bitwise the stages one after another with the same
    split; every tail tile written (NaN-poisoned output), the arrival counters back to zero,
    the ticket moved by a run's claims (slices counted)."""
    ws = chain(16, 48, 48)
    pipe = Pipeline(ws, config=SPLIT, loopback=False)
    plan = pipe.plan(M)
    ch = plan.launches[0].gemm
    assert ch.split is not None and ch.split.splits > 1  # 18 tiles on 4 CTAs: 2 left, 2 slices each
    assert ch.claims_per_run == 4 * (-(-(18 - ch.split.tiles + ch.split.items) // 4) + 1)
    for call in range(1, 3):
        x = torch.randn(M, 16).half()
        out = torch.full((M, 48), float("nan"), dtype=torch.float16)
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x))
        assert ch.tail.counters.tolist() == [0] * ch.split.tiles
        assert int(plan.tickets[0]) == call * ch.claims_per_run


def test_a_chain_kernels_stages_run_whole_tiles_whatever_their_split_k(monkeypatch):
    """A chain kernel's rounds are its combined order's: with ``split_k``, its stages' few tiles
    (2 each, 4 CTAs) run whole, and so do the sequential GEMMs it must equal bitwise (a stage
    run alone would otherwise split its lone round along K; on the interpreter, in fp16, the
    results alone would not show it)."""
    from ctapipelining import pipeline

    ws = chain(16, 32, 32)
    pipe = Pipeline(ws, config=dataclasses.replace(SPLIT, split_k=True), loopback=False)
    plan = pipe.plan(16)
    assert len(plan.launches) == 1 and plan.launches[0].gemm.split is None
    assert not any(pipe.stage_config(s, plan.configs).split_k for s in (0, 1))
    made, real = [], pipeline.GemmLaunch
    monkeypatch.setattr(pipeline, "GemmLaunch", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    for _ in range(2):
        x = torch.randn(16, 16).half()
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    assert len(made) == 4 and all(launch.tail is None for launch in made)  # the sequential GEMMs


def test_chain_split_tail_timeout_is_clean():
    """A tail tile whose input never completes: PipelineTimeout naming the last stage, and the
    pipeline right again after it (its arrival counters reset)."""
    ws = chain(16, 48, 48)
    pipe = Pipeline(ws, config=SPLIT, loopback=False, timeout_s=0.05)
    x = torch.randn(48, 16).half()
    plan = pipe.plan(48)
    ch = plan.launches[0].gemm
    tail_tile = deps.grouped_tile(ch.split.first_pos, 3, 3, SPLIT.group_m)  # the first tail tile's row-block
    plan.links[0].need_consumer[int(plan.links[0].counter_of_tile[tail_tile])] += 1
    with pytest.raises(PipelineTimeout, match="stage 1"):
        pipe(x, check=True)
    plan.links[0].need_consumer[int(plan.links[0].counter_of_tile[tail_tile])] -= 1
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_sequential_runs_the_last_stage_with_the_chain_kernels_split(monkeypatch):
    """The reference splits the last stage's tail as the chain kernel does (fp16 rounding can
    hide a different split's summation order, so the split itself is checked), also when the
    whole last stage is the tail (its first tail position 0)."""
    import ctapipelining.pipeline as pl

    seen = []
    real = pl.GemmLaunch

    def recording(*args, **kw):
        seen.append(kw.get("split"))
        return real(*args, **kw)

    monkeypatch.setattr(pl, "GemmLaunch", recording)
    for dims, M in (((16, 48, 48), 48), ((64, 64, 32), 16)):
        pipe = Pipeline(chain(*dims), config=SPLIT, loopback=False)
        split = pipe.plan(M).launches[0].gemm.split
        assert split is not None
        seen.clear()
        x = torch.randn(M, dims[0]).half()
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
        assert seen == [None, split], (dims, seen)  # the first stage whole, the last with the chain's split


def test_chain_split_tail_counters_are_reset_after_a_timeout():
    """A timed-out tail leaves a tile's arrival counter part way (one slice in, the other
    skipped): the reset after the timeout sets it back, so later calls are right."""
    ws = chain(16, 32, 80)
    pipe = Pipeline(ws, config=SPLIT, loopback=False, timeout_s=0.05)
    plan = pipe.plan(48)
    assert plan.launches[0].gemm.split is not None
    plan.links[0].need_consumer[0] += 1  # row-block 0, part 0 never completes
    with pytest.raises(PipelineTimeout):
        pipe(torch.randn(48, 16).half(), check=True)
    plan.links[0].need_consumer[0] -= 1
    assert all(int(c) == 0 for c in plan.launches[0].gemm.tail.counters)
    for _ in range(2):
        x = torch.randn(48, 16).half()
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_the_kernel_decodes_the_order_as_deps_encodes_it():
    from ctapipelining.kernels import chain as kernel

    assert kernel.STAGE_SHIFT.value == deps.STAGE_SHIFT
    assert kernel.MAX_STAGES == deps.CHAIN_MAX_STAGES  # the simulator splits a GPU's stages as the pipeline does
    assert kernel.POSITION_MASK.value == (1 << deps.STAGE_SHIFT) - 1


@pytest.mark.parametrize("lag", ["bound", None, 0])
def test_any_order_gives_the_same_result(lag):
    """The interleaved combined order bound at plan time (stages take turns from the first
    rounds on), stage after stage, and no lag at all: bitwise the stages one after another."""
    ws = chain(16, 24, 40, 16)
    pipe = Pipeline(ws, config=PARTS, loopback=False)
    plan = pipe.plan(100)  # 7 row-blocks
    ch = plan.launches[0].gemm
    stages = (ch.order >> deps.STAGE_SHIFT).tolist()
    assert stages != sorted(stages), "the bound order does not interleave the stages"
    if lag != "bound":
        ch.set_order(lag)
        stages = (ch.order >> deps.STAGE_SHIFT).tolist()
        assert (stages == sorted(stages)) == (lag is None)
    x = torch.randn(100, 16).half()  # (back-to-back calls: test_chain_kernel_equals_the_stages_one_after_another)
    for buf in plan.inputs[1:]:
        buf.fill_(float("nan"))
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_the_kernel_follows_the_bound_order():
    """An order that puts every consumer tile before its producer's tiles (the first CTA then
    waits for tiles that no CTA has run): the call times out cleanly, so the kernel does read
    the table; rewritten right, the next call is right again."""
    ws = chain(16, 24, 40, 16)
    pipe = Pipeline(ws, config=PARTS, loopback=False, timeout_s=0.05)
    plan = pipe.plan(40)
    ch = plan.launches[0].gemm
    stage = (ch.order >> deps.STAGE_SHIFT).tolist()
    later_first = sorted(range(len(stage)), key=lambda p: -stage[p])  # the last stage's positions first
    ch.order.copy_(ch.order[later_first])
    x = torch.randn(40, 16).half()
    with pytest.raises(PipelineTimeout):
        pipe(x, check=True)
    ch.set_order(ch.num_ctas)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_a_chain_kernels_split_tail_applies_the_last_stages_epilogue():
    """The summing CTA of each tail tile applies the last stage's epilogue (a bias and a GELU) to
    the whole tile; the first stage stores its rows' sums of squares for a norm in the second.
    Bitwise the sequential GEMMs split the same way, and within a rounding of float32."""
    ws = chain(16, 48, 48)
    bias = torch.randn(48).half()
    epilogues = [Epilogue(), Epilogue(gelu, bias=bias, rms_eps=1e-5)]
    pipe = Pipeline(ws, config=SPLIT, loopback=False, epilogues=epilogues)
    chain_launch = pipe.plan(40).launches[0].gemm
    assert isinstance(chain_launch, ChainLaunch) and chain_launch.split is not None  # 18 tiles on 4 CTAs
    x = torch.randn(40, 16).half()
    y = pipe(x, check=True)
    assert torch.equal(y, pipe.sequential(x))
    h = (x.float() @ ws[0].float()).half().float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = torch.nn.functional.gelu(h @ ws[1].float() + bias.float(), approximate="tanh")
    assert float((y.float() - ref).norm() / ref.norm()) < 3e-3


@pytest.mark.parametrize("loopback", [True, False])
def test_a_split_tail_tile_stores_its_rows_sums_for_the_next_stages_norm(loopback):
    """A stage whose next stage normalises, its tail split: the CTA that sums a tail tile stores
    that tile's rows' sums of squares (the next stage's norm reads them) before it signals the
    tile. A GEMM kernel of its own (the loopback), and the last stage of a chain kernel (a third
    stage in another configuration is a kernel of its own). The sums are NaN-poisoned before each
    call; bitwise the sequential GEMMs, and within a rounding of float32."""
    torch.manual_seed(0)
    if loopback:
        ws, configs = chain(48, 48, 48), SPLIT
        epilogues = [Epilogue(gelu), Epilogue(rms_eps=1e-5)]
    else:
        ws, configs = chain(16, 48, 48, 32), [SPLIT, SPLIT, dataclasses.replace(SPLIT, num_stages=3)]
        epilogues = [None, Epilogue(gelu), Epilogue(rms_eps=1e-5)]
    pipe = Pipeline(ws, config=configs, loopback=loopback, epilogues=epilogues)
    plan = pipe.plan(40)
    producer = plan.launches[-2].gemm  # the stage before the norm
    assert isinstance(producer, GemmLaunch if loopback else ChainLaunch)
    assert (producer.tail.split if loopback else producer.split) is not None
    for _ in range(2):
        x = torch.randn(40, ws[0].shape[0]).half()
        plan.sums[-1].fill_(float("nan"))
        y = pipe(x, check=True)
        assert torch.equal(y, pipe.sequential(x))
        h = x.float()
        for w, epi in zip(ws[:-1], epilogues[:-1]):
            h = h @ w.float()
            h = (h if epi is None else torch.nn.functional.gelu(h, approximate="tanh")).half().float()
        ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)) @ ws[-1].float()
        assert float((y.float() - ref).norm() / ref.norm()) < 3e-3


@pytest.mark.parametrize("loopback,policy", [(False, "static"), (True, "static")])  # the ring: other tests
def test_a_plan_takes_the_tables_tiles_for_its_height_and_stays_bitwise(loopback, policy):
    """Built without a configuration, a pipeline's plan of each height runs the measured table's
    row for it (``PIPELINE_TABLE``): 64 x 128 tiles up to 128 rows, 128 x 128 tiles up to 256,
    128 x 256 tiles above; a consumer in its producer's kernel waits as the row says, one whose
    producer is another kernel (the loopback) in ``PIPELINE_CONFIG``'s parts. Each call equals
    its sequential GEMMs (in the plan's configuration) bitwise: in a chain kernel, whose second
    stage waits for its rows in 4 parts inside its K loop at 128 rows (512 wide), and as two
    kernels taking ready tiles from a ring. A configuration given, ends or epilogues fix the
    tiles at every height."""
    from ctapipelining.gemm import config_table, pick_config
    from ctapipelining.kernels.gemm import PIPELINE_CONFIG
    from ctapipelining.pipeline import PIPELINE_TABLE

    table = config_table(PIPELINE_TABLE)
    ws = chain(256, 512, 136)
    pipe = Pipeline(ws, loopback=loopback, policy=policy)

    def expected(height):  # the row, but a consumer in another kernel waits in PIPELINE_CONFIG's parts
        row = pick_config(table, height)
        return [row, dataclasses.replace(row, wait_parts=PIPELINE_CONFIG.wait_parts) if loopback else row]

    assert pipe.rows_for(1) == 128
    for M, height, block_m in ((128, 128, 64), (200, 256, 128)):
        assert pipe.rows_for(M) == height
        plan = pipe.plan(M)
        assert plan.configs == expected(height)
        assert all(lc.gemm.config.block_m == block_m for lc in plan.launches)
        if not loopback or M == 200:  # (the loopback at 128 rows: the chain kernel's tiles, run above)
            x = torch.randn(M, 256).half()
            assert torch.equal(pipe(x, check=True), pipe.sequential(x)), M
    assert plan.configs[0].block_n == 128 and not plan.configs[0].split_tail  # the 256-row height's
    tall = pipe.plan_configs(pipe.rows_for(300))
    assert tall == expected(384) and {(c.block_m, c.block_n) for c in tall} == {(128, 256)}
    assert pick_config(table, 384).wait_parts == 1 and tall[1].wait_parts == (8 if loopback else 1)
    # whole rows in one kernel; across kernels a ring (tiles once ready) or PIPELINE_CONFIG's parts,
    # capped at the producer's 2 column-blocks (512 columns in 128 x 256 tiles)
    assert pipe.plan(pipe.rows_for(300)).links[0].dep.parts == (2 if loopback and policy == "static" else 1)
    if not loopback:
        assert pipe.plan(1).links[0].dep.parts == 4  # one a K-step: waits inside the K loop
    fixed = GemmConfig(16, 32, 32)
    assert Pipeline(ws, config=fixed).plan_configs(64) == [fixed, fixed]
    assert Pipeline(ws, epilogues=[None, Epilogue(bias=None)]).plan_configs(64) == [PIPELINE_CONFIG] * 2


def test_a_chain_kernel_whose_first_stage_waits_on_another_kernel_waits_in_that_links_parts():
    """Six stages on one device without a configuration: two chain kernels (four stages, then
    two), launched with the table's row, whose links inside wait as it says (whole rows at 256
    rows) while the second kernel's first stage waits on the first kernel in PIPELINE_CONFIG's
    parts (capped at its producer's column-blocks): bitwise equal to the stages one after another."""
    from ctapipelining.kernels.gemm import PIPELINE_CONFIG

    torch.manual_seed(3)
    ws = chain(32, 128, 32, 128, 512, 128, 32)
    pipe = Pipeline(ws, loopback=False, always_pipelined=True)
    plan = pipe.plan(200)
    assert [lc.stages for lc in plan.launches] == [(0, 1, 2, 3), (4, 5)]
    assert [c.wait_parts for c in plan.configs] == [1, 1, 1, 1, PIPELINE_CONFIG.wait_parts, 1]
    assert [lk.dep.parts for lk in plan.links] == [1, 1, 1, 4, 1]  # 3 -> 4: capped at stage 3's 4 column-blocks
    x = torch.randn(200, 32).half()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_stages_on_one_device_run_one_after_another_unless_something_asks_for_the_pipeline():
    """A pipeline on one device built without anything that fixes how its stages run: a call is
    our GEMMs one after another (bitwise, into ``out`` too, near float32, no plan built), as is
    its reference, and a bad ``out`` is refused before anything runs; with ``always_pipelined``,
    a configuration, epilogues, loopback, an SM budget or a trace, the call pipelines; a
    segment of a longer chain never runs its stages apart."""
    from ctapipelining.gemm import matmul
    from ctapipelining.plan import Segment

    ws = chain(16, 24, 16)
    pipe = Pipeline(ws, loopback=False)
    assert pipe.one_after_another and pipe.free_on_one_device
    for M in (40, 1):
        x = torch.randn(M, 16).half()
        want = matmul(matmul(x, ws[0]), ws[1])
        assert torch.equal(pipe(x, check=True), want) and torch.equal(pipe.sequential(x), want)
        ref = x.float() @ ws[0].float() @ ws[1].float()
        assert float((want.float() - ref).norm() / ref.norm()) < 2e-3
        out = torch.full((M, 16), float("nan")).half()
        assert pipe(x, out=out) is out and torch.equal(out, want)
    from ctapipelining import pipeline as pipeline_module

    launched = []
    real = pipeline_module.stage_gemm
    pipeline_module.stage_gemm = lambda *a, **k: launched.append(1) or real(*a, **k)
    try:
        with pytest.raises(ValueError, match=r"must be a \[1, 16\]"):
            pipe(x, out=torch.empty(M, 24).half())
        w0 = ws[0].clone()
        for alias in (ws[0].view(-1)[:16].view(1, 16), x):  # a weight's memory, x's own
            with pytest.raises(ValueError, match="shares memory"):
                pipe(x, out=alias)
        assert not launched and torch.equal(ws[0], w0)  # refused before anything ran
    finally:
        pipeline_module.stage_gemm = real
    assert not pipe._plans  # nothing pipelined, nothing built
    fixed = [
        dict(always_pipelined=True), dict(config=PARTS), dict(loopback=True), dict(sm_budget=2),
        dict(epilogues=[None, Epilogue(activation=gelu)]), dict(trace=True),
    ]  # fmt: skip
    for kw in fixed:
        other = Pipeline(ws, **{"loopback": False, **kw})
        assert not other.one_after_another, kw
        if "trace" not in kw:  # (stamps are GPU-only)
            assert torch.equal(other(x, check=True), other.sequential(x)) and other._plans, kw
    segment = Segment(0, lambda M: (None, None), "rank 0")  # a part of a longer chain: its links
    assert not Pipeline(ws, loopback=False, segment=segment).one_after_another
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="always_pipelined must be"):
            Pipeline(ws, always_pipelined=bad)


def test_a_lone_stage_fed_by_a_ring_splits_no_tail():
    """A chain kernel of one stage whose input comes through a ring runs its tiles in the order
    they became ready, so no tile is known to be last: the split tail its configuration asks
    for is dropped (no tail buffers, no slices claimed); the same stage fed by counters splits it."""
    cfg = dataclasses.replace(PARTS, split_tail=True)
    M, K, N, ctas = 48, 64, 80, 7  # 3 x 5 tiles on 7 CTAs: one tile in the last round, 4 K-steps to split
    dep = deps.build_dependency(deps.TileGrid(M, K, 16, 16), deps.TileGrid(M, N, 16, 16), "gemm", consumer_k=K)
    link, err = Link.create(dep, CPU, CPU), i64_zeros(8, CPU)
    for queue in (False, True):
        stage = ChainStage(N, K, wait=link.wait_hook(queue), err=err)
        launch = ChainLaunch(M, [stage], cfg, ctas, CPU, ticket=i64_zeros(1, CPU), epoch=i64_zeros(1, CPU), queue=queue)
        assert (launch.split is None, launch.tail is None) == (queue, queue), queue
        claims = 15 if queue else 15 - 1 + 4  # the last tile as 4 K-slices
        assert launch.claims_per_run == ctas * (-(-claims // ctas) + 1)
