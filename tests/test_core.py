"""The core's guarantees on the CPU (the real kernels under the Triton interpreter): no wrap
for any number of calls, inputs checked before any state changes, a failed launch never leaves
a plan out of step, replicas follow their weights, plans are bounded, host waits are bounded,
errors are asynchronous but never lost, calls from several threads are serialised."""

import dataclasses
import threading
import types

import pytest
import torch
from protocol_state import preset_epoch

from ctapipelining import deps
from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.pipeline import Pipeline, PipelineHung, PipelineTimeout

pytestmark = pytest.mark.interpreter

SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=2, num_warps=4)


def chain(*dims):
    return [(torch.randn(k, n) / k**0.5).half() for k, n in zip(dims, dims[1:])]


@pytest.mark.parametrize("policy", ["workqueue", "static"])
@pytest.mark.parametrize("start", [2**31 - 2, 2**40])
def test_no_wrap_past_int32_or_far_beyond(policy, start):
    """Calls from just below 2^31 calls on (where int32 counters, targets and ring positions
    went negative) and from 2^40: every result bitwise the sequential GEMMs, every counter
    exactly epoch x need, the ring's tail epoch x T."""
    ws = chain(16, 48, 32)
    pipe = Pipeline(ws, policy=policy, config=SMALL)
    plan = pipe.plan(40)
    preset_epoch(plan, start)
    for call in range(1, 3):
        x = torch.randn(40, 16).half()
        plan.inputs[1].fill_(float("nan"))
        y = pipe(x, check=True)
        assert torch.equal(y, pipe.sequential(x))
        link = plan.links[0]
        assert link.counters.tolist() == [(start + call) * int(n) for n in link.dep.need]
        if policy == "workqueue":
            assert int(link.tail) == (start + call) * link.dep.consumer.num_tiles
        assert int(plan.epochs[1]) == start + call


@pytest.mark.parametrize("policy", ["workqueue", "static"])
@pytest.mark.parametrize("start", [2**31 - 2, 2**40])
def test_a_lone_consumer_past_int32_still_waits(policy, start):
    """From just below 2^31 calls on and from 2^40, a consumer launched without its producer
    times out: its wait target (epoch x need, the ring position) did not wrap to something an
    earlier call's counters already reach."""
    pipe = Pipeline(chain(16, 48, 32), policy=policy, config=SMALL, timeout_s=0.05)
    plan = pipe.plan(40)
    preset_epoch(plan, start)
    pipe._launch(plan, torch.randn(40, 16).half(), torch.empty(40, 32).half(), only=[1])
    with pytest.raises(PipelineTimeout):
        pipe.check_errors()


def test_bad_out_is_refused_before_any_state_changes():
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL)
    x = torch.randn(24, 16).half()
    bad = {
        "row-major": torch.empty(16, 24).half().t(),  # transposed: column-major
        "16-byte aligned": torch.empty(24 * 16 + 1).half()[1:].view(24, 16),
        r"must be a \[24, 16\]": torch.empty(24, 32).half()[:, :15],  # wrong shape
        "16 bytes apart": torch.empty(24, 20).half()[:, :16],  # rows 40 bytes apart
    }
    for match, out in bad.items():
        with pytest.raises(ValueError, match=match):
            pipe(x, out=out)
    with pytest.raises(ValueError, match="shares memory with x"):
        pipe(x, out=x)
    assert pipe._plans == {}, "a refused call built or changed state"


def test_out_that_overlaps_x_is_refused():
    ws = chain(16, 16, 16)
    pipe = Pipeline(ws, config=SMALL)
    buf = torch.randn(40, 16).half()
    x = buf[:24]
    pipe(x)  # builds the plan
    epoch = int(pipe.plan(24).epochs[0])
    with pytest.raises(ValueError, match="shares memory with x"):
        pipe(x, out=buf[16:40])  # rows 16..23 are x's too
    assert int(pipe.plan(24).epochs[0]) == epoch, "a refused call advanced the epoch"


def test_an_epilogues_vectors_are_bound_as_the_weights_are():
    """An epilogue's bias (and a LayerNorm's column sums) is read by address, as the weights:
    an ``out`` over it is refused (it would overwrite what the last stage adds), and so is a
    call after its storage was swapped (``bias.data = ...``, here to a vector the constructor
    would refuse: too short); a change of its values in place is read."""
    from ctapipelining.epilogue import Epilogue

    ws = chain(16, 32, 16)
    buf = torch.zeros(48, 16).half()
    bias = buf.view(-1)[:16]
    bias.copy_(torch.randn(16).half())
    pipe = Pipeline(ws, config=SMALL, epilogues=[None, Epilogue(bias=bias)])
    x = torch.randn(48, 16).half()
    want = pipe.sequential(x)
    with pytest.raises(ValueError, match="shares memory with x, a weight or an epilogue's bias"):
        pipe(x, out=buf)
    assert torch.equal(pipe(x, check=True), want)
    bias.add_(1)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x)) and not torch.equal(pipe.sequential(x), want)
    bias.data = torch.randn(4).half()
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        pipe(x)


def test_out_on_a_weight_and_a_weights_new_storage_are_refused():
    """An ``out`` that overlaps a weight is refused; a weight whose values change in place is
    used as it is now; one whose storage was swapped (``w.data = ...``) or whose layout changed
    in place (``w.t_()``) is refused before anything launches (the plans' launches are bound to
    the old storage)."""
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL)
    x = torch.randn(24, 16).half()
    with pytest.raises(ValueError, match="shares memory with x, a weight"):
        pipe(x, out=ws[0].view(-1)[: 24 * 16].view(24, 16))
    pipe(x)
    ws[1].mul_(2)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    epoch = int(pipe.plan(24).epochs[0])
    ws[0].data = ws[0].clone()
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        pipe(x)
    assert int(pipe.plan(24).epochs[0]) == epoch, "a refused call advanced the epoch"
    square = chain(16, 16, 16)  # a transpose in place keeps the address and the shape
    pipe = Pipeline(square, config=SMALL)
    pipe(x)
    square[1].t_()
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        pipe(x)


def test_a_launch_that_fails_part_way_leaves_the_plan_to_be_reset():
    """The consumer's launch fails after the producer's went out: the device epochs are now
    out of step. The plan is marked stale, and the next call resets it first and is right."""
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05)
    x = torch.randn(24, 16).half()
    plan = pipe.plan(24)
    consumer = plan.launches[1]
    real = consumer.run
    consumer.run = lambda *a: (_ for _ in ()).throw(RuntimeError("launch failed"))
    with pytest.raises(RuntimeError, match="launch failed"):
        pipe(x)
    assert plan.stale
    consumer.run = real
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    link = plan.links[0]
    assert not plan.stale and link.counters.tolist() == [int(n) for n in link.dep.need]


def test_replicas_follow_in_place_changes_of_their_weights():
    """With both ends filled, the prefill and drain use replicas of W_0 and W_1: after
    ``W.mul_(2)`` they are refreshed, so every row uses the new weights."""
    ws = chain(16, 48, 32)
    cfg = dataclasses.replace(SMALL, split_tail=True)
    pipe = Pipeline(ws, config=cfg, ends="balanced")
    x = torch.randn(80, 16).half()
    assert pipe.plan(80).prefill_rows and pipe.plan(80).drain_rows
    before = pipe(x, check=True)
    ws[0].mul_(2)
    ws[1].mul_(0.5)
    ws[1].add_(0.01)
    after = pipe(x, check=True)
    assert torch.equal(after, pipe.sequential(x))
    assert not torch.equal(after, before)


def test_a_change_pytorch_does_not_count_needs_refresh_replicas():
    """``w.data.mul_`` does not move ``w``'s version: the replicas keep the old weights until
    ``refresh_replicas()``; then every row uses the new ones."""
    ws = chain(16, 48, 32)
    pipe = Pipeline(ws, config=dataclasses.replace(SMALL, split_tail=True), ends="balanced")
    x = torch.randn(80, 16).half()
    pipe(x, check=True)
    ws[1].data.mul_(0.5)
    assert not torch.equal(pipe(x, check=True), pipe.sequential(x))  # the drain's rows used the old W_1
    pipe.refresh_replicas()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_plans_are_bounded_and_captured_ones_stay():
    """The ``max_plans`` most recently used plans are kept (a plan used again outlives an older
    one), and a pinned (captured) plan is never freed."""
    ws = chain(16, 16, 16)
    pipe = Pipeline(ws, config=SMALL, max_plans=2, row_buckets=0)
    for M in (8, 16, 8, 24):  # 8 used again after 16: 16 is the least recently used
        pipe(torch.randn(M, 16).half())
    assert list(pipe._plans) == [8, 24]
    pipe(torch.randn(16, 16).half())
    assert list(pipe._plans) == [24, 16]
    pipe.plan(16).pinned = True  # as a captured graph pins it
    for M in (32, 40):
        pipe(torch.randn(M, 16).half())
    assert list(pipe._plans) == [16, 40]
    x = torch.randn(16, 16).half()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    with pytest.raises(ValueError, match="max_plans"):
        Pipeline(ws, max_plans=0)


def test_row_counts_share_bucketed_plans_and_write_only_their_rows():
    """Five calls on 150-200 rows (SMALL: 16-row blocks; 4 heights per octave of row-blocks)
    run 3 plans, of 160, 192 and 224 rows, each call bitwise the sequential GEMMs on its rows,
    and leave the output's rows past the call's alone (a bucketed plan computes zeros there)."""
    ws = chain(16, 24, 16)
    pipe = Pipeline(ws, config=SMALL)
    for M in (150, 161, 200, 176, 155):
        x = torch.randn(M, 16).half()
        out = torch.full((M + 40, 16), float("nan")).half()
        y = pipe(x, out=out[:M], check=True)
        assert torch.equal(y, pipe.sequential(x)) and out[M:].isnan().all()
        if M in (150, 200):  # and the plain GEMMs on the call's own rows, in a plan's first and last bucket
            assert torch.equal(y, matmul(matmul(x, ws[0], config=SMALL), ws[1], config=SMALL))
    assert sorted(pipe._plans) == [pipe.rows_for(150), pipe.rows_for(176), pipe.rows_for(200)] == [160, 192, 224]
    assert Pipeline(ws, config=SMALL, row_buckets=0).rows_for(150) == 150
    with pytest.raises(ValueError, match="row_buckets"):
        Pipeline(ws, row_buckets=-1)


@pytest.mark.parametrize("per_octave", [1, 2, 4, 8])
def test_bucket_rows(per_octave):
    sizes = {deps.bucket_rows(M, 128, per_octave) for M in range(2049, 8193)}
    assert len(sizes) == 2 * per_octave
    for M in range(1, 20000, 37):
        B = deps.bucket_rows(M, 128, per_octave)
        assert B >= M and B % 128 == 0
        assert B <= max(-(-M // 128) * 128, M * (1 + 1 / per_octave) + 128)
    assert deps.bucket_rows(3000, 128, 0) == 3000
    # up to 8 row-blocks: whole row-blocks, nothing more, at every bucket count
    assert all(deps.bucket_rows(M, 128, per_octave) == -(-M // 128) * 128 for M in range(1, 1025))
    assert all(deps.bucket_rows(B, 128, per_octave) == B for B in sizes)  # a plan's height is its own bucket
    with pytest.raises(ValueError, match="power of two"):
        deps.bucket_rows(3000, 128, 3)


class _NeverDone:
    def query(self):
        return False


def test_host_waits_are_bounded_and_a_hung_pipeline_refuses_calls():
    """A host wait past ``host_timeout_s`` marks the pipeline unusable; a host bound no longer
    than the devices' own (``timeout_s``) is refused: a wait that ends in time would read as a
    hang."""
    ws = chain(16, 16, 16)
    with pytest.raises(ValueError, match="host_timeout_s=0.5 must exceed timeout_s=0.5"):
        Pipeline(ws, config=SMALL, timeout_s=0.5, host_timeout_s=0.5)
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.01, host_timeout_s=0.05)
    with pytest.raises(PipelineHung, match="stage 1 on cuda:1 did not finish within host_timeout_s=0.05 s"):
        pipe._wait_for([("stage 1", "cuda:1", _NeverDone())])
    with pytest.raises(PipelineHung, match="unusable"):
        pipe(torch.randn(8, 16).half())


class _StageStream:
    """A stage's stream whose recorded events are done or never done."""

    def __init__(self, device, done):
        self.device, self.done = device, done

    def record_event(self):
        return types.SimpleNamespace(query=lambda: self.done)


def test_a_host_wait_names_the_stage_whose_stream_holds_it_up():
    """Past the calls in flight, a host wait (a call's, a reset's) waits for every stage's
    stream in order: the first whose work does not finish is named, with its device, and the
    pipeline refuses calls."""
    for wait in (lambda p: p._wait(callers=False), lambda p: p.reset()):
        pipe = Pipeline(chain(16, 16, 16, 16), config=SMALL, timeout_s=0.01, host_timeout_s=0.05)
        pipe.on_gpu = True  # (its streams' events: the host side only)
        pipe.streams = [_StageStream(d, done) for d, done in (("gpu-a", True), ("gpu-b", False), ("gpu-c", False))]
        with pytest.raises(PipelineHung, match="stage 1 on gpu-b did not finish within host_timeout_s=0.05 s"):
            wait(pipe)
        assert "stage 1 on gpu-b" in pipe._broken


class _FakeEvent:
    """A CUDA event's host side: done once the clock passes the end of the work queued before it
    on its stream; bound to the device it was first recorded on, as a CUDA event is."""

    clock = 0

    def __init__(self):
        self.at, self.device = None, None

    def record(self, stream):
        if self.device not in (None, stream.device):
            raise RuntimeError(f"Event device {self.device} does not match recording stream's device")
        self.device, self.at = stream.device, stream.pop(0)

    def query(self):
        return self.at is not None and self.at <= _FakeEvent.clock


class _FakeStream(list):
    """The times at which the work before each next event on a stream ends."""

    def __init__(self, device, times):
        super().__init__(times)
        self.device = device


def test_a_host_wait_names_whose_work_holds_it_up(monkeypatch):
    """Calls in flight are waited for in the order they were made, start (the caller's work
    queued before the call) then end (the call's kernels): the first that does not finish
    decides. A hung call followed by later calls is the pipeline's (PipelineHung: unusable),
    the caller's work before a call is the caller's (TimeoutError: still usable); finished
    calls but the newest give their events back, each to its own device's pool."""
    from ctapipelining import inflight

    monkeypatch.setattr(inflight.torch.cuda, "Event", _FakeEvent)
    _FakeEvent.clock = 10
    ws = chain(16, 16, 16)
    never = 10**9
    for late, expect in (("end", PipelineHung), ("start", TimeoutError)):
        pipe = Pipeline(ws, config=SMALL, timeout_s=0.01, host_timeout_s=0.05)
        calls = pipe._in_flight
        # three calls on one stream; the second call's end (or the caller's work before it)
        # never comes, so neither does anything queued after it
        times = {"end": [1, 2, 3, never], "start": [1, 2, never, never]}[late]
        stream = _FakeStream("cuda:0", times + [never] * 2)
        for _ in range(3):
            start = calls.record([stream])
            calls.end_on(stream, start)
        with pytest.raises(expect) as e:
            pipe._wait_for(calls.events())
        if late == "end":
            assert "a call of this pipeline on cuda:0 did not finish" in str(e.value) and pipe._broken
        else:
            assert "the work queued before a call on cuda:0 did not finish" in str(e.value)
            assert "the caller's own work" in str(e.value) and pipe._broken is None
    # calls on two devices (a start on each caller stream, an end on each kernel stream): many
    # calls, every event recorded again only on its own device, the finished ones given back
    calls = inflight.InFlight()
    callers = [_FakeStream("cuda:0", range(1, 100)), _FakeStream("cuda:1", range(1, 100))]
    kernels = [_FakeStream("cuda:0", range(1, 100)), _FakeStream("cuda:1", range(1, 100))]
    made = set()
    for _ in range(8):
        starts, ends = calls.record(callers), calls.record(kernels)
        made |= set(map(id, starts + ends))
        calls.add(
            [(st.device, ev) for st, ev in zip(callers, starts)], [(st.device, ev) for st, ev in zip(kernels, ends)]
        )
    assert len(calls._calls) <= 2 and len(made) <= 12  # (the pools refill once they run dry)
    assert [who for who, _, _ in calls.events()][-4:] == [inflight.CALLERS_EARLIER] * 2 + [calls.name] * 2


def test_errors_are_asynchronous_and_never_lost():
    """A call that times out returns; its error is raised by the next call (before it
    launches anything) or by check_errors, and the call after that is right."""
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05)
    x = torch.randn(24, 16).half()
    plan = pipe.plan(24)
    pipe._launch(plan, x, torch.empty(24, 16).half(), only=[1])  # a consumer with no producer
    epochs = [int(e) for e in plan.epochs]
    with pytest.raises(PipelineTimeout, match="a call with the plan for 32 rows failed: stage 1 on cpu"):
        pipe(x)
    assert [int(e) for e in plan.epochs] == [0, 0], "the failed plan was reset, nothing launched"
    assert epochs == [1, 1]
    assert torch.equal(pipe(x), pipe.sequential(x))
    pipe._launch(plan, x, torch.empty(24, 16).half(), only=[1])
    with pytest.raises(PipelineTimeout):
        pipe.check_errors()
    pipe.check_errors()  # read once, reset: nothing left


def test_calls_from_several_threads_are_serialised():
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL)
    xs = [torch.randn(24, 16).half() for _ in range(4)]
    ys = [None] * 4

    def work(i):
        ys[i] = pipe(xs[i], check=True)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for x, y in zip(xs, ys):
        assert torch.equal(y, pipe.sequential(x))
    assert pipe.plan(24).epoch == 4


def test_an_evicted_plan_s_unread_timeout_is_raised_not_lost():
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05, max_plans=1, row_buckets=0)
    x = torch.randn(24, 16).half()
    plan = pipe.plan(24)
    pipe._launch(plan, x, torch.empty(24, 16).half(), only=[1])  # a consumer alone: times out
    with pytest.raises(PipelineTimeout, match="plan for 24 rows failed"):
        pipe.plan(40)  # evicts the plan for 24 rows, whose call nobody checked (on a GPU: still running)
    assert list(pipe._plans) == [40]
    y = pipe(torch.randn(40, 16).half(), check=True)
    assert not y.isnan().any()


def test_plans_evicted_together_raise_each_unread_timeout():
    """Two plans whose calls timed out unread, evicted by one new plan: one error names both."""
    ws = chain(16, 32, 16)
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05, max_plans=2, row_buckets=0)
    for M in (24, 32):  # a consumer alone each: times out
        pipe._launch(pipe.plan(M), torch.randn(M, 16).half(), torch.empty(M, 16).half(), only=[1])
    pipe.max_plans = 1
    with pytest.raises(PipelineTimeout, match="plan for 24 rows failed.*plan for 32 rows failed"):
        pipe.plan(40)
    assert list(pipe._plans) == [40]


def test_operands_with_unaligned_rows_or_empty_weights_are_refused():
    x = torch.empty(1, 24).half().as_strided((1, 16), (3, 1))  # one row: contiguous, rows 6 bytes apart
    with pytest.raises(ValueError, match="16 bytes apart"):
        matmul(x, torch.randn(16, 16).half(), config=SMALL)
    with pytest.raises(ValueError, match="matmul: B"):
        matmul(torch.randn(4, 16).half(), torch.randn(16, 0).half(), config=SMALL)
    with pytest.raises(ValueError, match="stage 0 weight"):
        Pipeline([torch.randn(16, 0).half()])


@pytest.mark.parametrize("bad", [0, -1.0, "1", True, float("nan"), float("inf")])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused(bad):
    with pytest.raises(ValueError, match="^timeout_s must be a positive number of seconds"):
        Pipeline(chain(16, 32), config=SMALL, timeout_s=bad)
    with pytest.raises(ValueError, match="^host_timeout_s must be a positive number of seconds"):
        Pipeline(chain(16, 32), config=SMALL, timeout_s=0.01, host_timeout_s=bad)


def test_a_timeout_under_a_nanosecond_and_a_bool_max_plans_are_refused():
    with pytest.raises(ValueError, match="timeout_s must be at least a nanosecond, got 1e-10"):
        Pipeline(chain(16, 32), config=SMALL, timeout_s=1e-10)
    with pytest.raises(ValueError, match="max_plans must be an int >= 1, got True"):
        Pipeline(chain(16, 32), config=SMALL, max_plans=True)


def test_an_input_without_rows_is_refused_before_any_state_changes():
    pipe = Pipeline(chain(16, 32, 16), config=SMALL)
    with pytest.raises(ValueError, match="x has no rows"):
        pipe(torch.empty(0, 16).half())
    assert not pipe._plans


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_sm_budget_caps_every_stages_grid(budget):
    """Every launch of a plan holds at most ``sm_budget`` CTAs, and the chain still equals its
    stages run one after another (which use the same grids)."""
    ws = chain(16, 48, 32)
    pipe = Pipeline(ws, config=SMALL, sm_budget=budget)
    x = torch.randn(80, 16).half()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    plan = pipe.plan(80)
    assert plan.num_ctas == [budget, budget]
    assert all(lc.gemm.num_ctas <= budget for lc in plan.launches)


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "all"])
def test_bad_sm_budget_is_refused(bad):
    with pytest.raises(ValueError, match="sm_budget"):
        Pipeline(chain(16, 32), config=SMALL, sm_budget=bad)
