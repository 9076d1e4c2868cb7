"""The core's guarantees on one GPU (stages sharing it: the loopback through the system-scope
code path): waits that decide as one CTA, no wrap, calls from two streams ordered, host waits
bounded, the cached launcher equal to Triton's own launch path."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from protocol_state import calls_from_two_streams, preset_epoch

from ctapipelining.gemm import GemmLaunch, grid_size, matmul, plain_config, plain_launch
from ctapipelining.kernels.gemm import PLAIN_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineHung

pytestmark = pytest.mark.gpu
NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
D1 = "cuda:1" if NGPU >= 2 else "cuda:0"


def rand(*shape, device="cuda:0", scale=1.0):
    return (torch.randn(*shape, device=device) * scale).bfloat16()


def test_release_at_the_deadline_ends_right_or_in_a_clean_timeout():
    """500 trials per mode (1,500 in all) whose counters or ring slots land within microseconds
    of the consumer's deadline (both policies; and only the last part of the input, raced by a
    wait inside the K loop), in a subprocess with a watchdog: every trial is right or a clean
    PipelineTimeout, the process neither hangs nor dies. (Decided per thread, this hung the GPU
    or faulted in 5 of 5 processes.)"""
    assert_deadline_race(int(os.environ.get("DEADLINE_TRIALS", "500")), "deadline_race.json")


@pytest.mark.gpu2
def test_release_across_gpus_at_the_deadline_ends_right_or_in_a_clean_timeout():
    """The same on a cross-GPU link: the consumer on cuda:1, its counters or ring released by
    peer writes from cuda:0 about its deadline."""
    assert_deadline_race(int(os.environ.get("DEADLINE_TRIALS", "500")), "deadline_race_cross.json", "cross")


def test_the_cuda_runtime_is_found_to_ask_for_native_peer_atomics():
    """The check that refuses GPUs without native peer atomics asks PyTorch's CUDA runtime: it
    must be found, or the check would pass everything unasked. With two GPUs, the pair's answer
    is the hardware's (NVLink: native)."""
    from ctapipelining import fabric

    assert fabric._cudart() is not None
    assert fabric.native_peer_atomics(0, 0) is True
    if NGPU >= 2:  # the GPU machines' pairs are NVLink
        assert fabric.native_peer_atomics(0, 1) is True and fabric.native_peer_atomics(1, 0) is True


def assert_deadline_race(trials: int, name: str, *mode: str):
    out = Path(os.environ.get("OUT", "/tmp")) / name
    r = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "deadline_race.py"), str(trials), str(out), *mode],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(report))
    for policy in ("static", "workqueue", "static_late_part"):
        c = report[policy]["counts"]
        assert c["WRONG"] == 0 and c["right"] + c["timeout"] == trials, (policy, c)
        near = report[policy]["within_5us_of_edge"]
        assert near["right"] > 0 and near["timeout"] > 0, (policy, near)  # both sides of the deadline hit


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_no_wrap_past_int32(policy):
    ws = [rand(k, n, device=d, scale=k**-0.5) for (k, n), d in zip([(2048, 2048), (2048, 1024)], ["cuda:0", D1])]
    pipe = Pipeline(ws, loopback=True, policy=policy)
    plan = pipe.plan(3000)
    preset_epoch(plan, 2**31 - 2)
    for _ in range(3):
        x = rand(3000, 2048)
        plan.inputs[1].fill_(float("nan"))
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    link = plan.links[0]
    assert torch.equal(link.counters.cpu(), (2**31 + 1) * torch.as_tensor(link.dep.need, dtype=torch.int64))
    g = pipe.capture(3000)  # replays advance the device epochs past what the host counts
    for _ in range(3):
        x = rand(3000, 2048)
        assert torch.equal(g(x), pipe.sequential(x))
    g.check_errors()


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_calls_from_two_streams_are_ordered(policy):
    """Call 1's consumer starts late; call 2 comes from another stream. Its producer must not
    overwrite the intermediate buffer (or ring) that call 1's consumer has yet to read."""
    ws = [rand(4096, 4096, device=d, scale=4096**-0.5) for d in ["cuda:0", D1]]
    pipe = Pipeline(ws, loopback=True, policy=policy)
    plan = pipe.plan(4096)
    x1, x2 = rand(4096, 4096), rand(4096, 4096)
    out1 = torch.empty(4096, 4096, dtype=torch.bfloat16, device=D1)
    torch.cuda.synchronize()
    other = torch.cuda.Stream("cuda:0")
    other.wait_stream(torch.cuda.current_stream("cuda:0"))  # x2 is ready; waited before call 1, so that
    # only the pipeline orders call 2 after it (the current stream waits for call 1 from here on)
    pipe._launch(plan, x1, out1, delay_cycles={1: 100_000_000})  # ~50 ms before call 1's consumer
    with torch.cuda.stream(other):
        out2 = pipe(x2)
    torch.cuda.synchronize()
    pipe.check_errors()
    assert torch.equal(out1, pipe.sequential(x1))
    assert torch.equal(out2, pipe.sequential(x2))


def test_a_launch_given_the_default_streams_handle_runs_on_it():
    """A launch given the null handle (the default stream) that takes Triton's own path (a
    profiler's launch hooks are set; so does a first, compiling launch) runs on the default
    stream, after the caller's work there (``torch.cuda.ExternalStream(0)`` would be a stream
    from PyTorch's pool, which does not wait for it): a copy behind a ~100 ms sleep is read."""
    from triton import knobs

    from ctapipelining.kernels.gemm import PLAIN_CONFIG

    dev = torch.device("cuda:0")
    real, b = rand(4096, 4096), rand(4096, 4096, scale=4096**-0.5)
    want = matmul(real, b, config=PLAIN_CONFIG)
    gemm = GemmLaunch(4096, 4096, 4096, PLAIN_CONFIG, grid_size(4096, 4096, 4096, PLAIN_CONFIG, dev), dev)

    def hook(*args):
        return None

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for _ in range(2):  # compiling, then compiled: each through Triton's path under the hook
            a, c = torch.zeros_like(real), torch.full_like(want, float("nan"))
            torch.cuda.synchronize()
            torch.cuda._sleep(200_000_000)
            a.copy_(real)  # after the sleep, on the default stream
            gemm(a, b, c, 0)
            torch.cuda.synchronize()
            assert torch.equal(c, want)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)


def test_eager_calls_on_one_gpu_queue_on_the_callers_stream_in_order(monkeypatch):
    """Both stages on one GPU, no loopback: an eager call queues its work on the caller's
    stream itself (``Pipeline._launch_direct``). Call 1 waits behind a ~50 ms sleep on the
    default stream; call 2 comes from another stream that did not wait for it, and must still
    end after call 1 (it waits for call 1's end). Both equal their sequential stages."""
    ws = [rand(4096, 4096, scale=4096**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, always_pipelined=True)
    x1, x2 = rand(4096, 4096), rand(4096, 4096)
    ref1, ref2 = pipe.sequential(x1), pipe.sequential(x2)
    pipe(x1, check=True)  # compiled, plan built
    direct = []
    launch_direct = pipe._launch_direct
    monkeypatch.setattr(pipe, "_launch_direct", lambda *a: direct.append(1) or launch_direct(*a))
    out1, out2, ordered = calls_from_two_streams(pipe, x1, x2)
    pipe.check_errors()
    assert len(direct) == 2
    assert ordered  # call 2 ended after call 1, not ~50 ms before it
    assert torch.equal(out1, ref1) and torch.equal(out2, ref2)


def test_bound_launches_follow_each_calls_x_and_out():
    """Eager calls on one GPU launch the chain kernel bound per ``x``/``out`` (``Launch.run``):
    calls alternating between two inputs and outputs, then with one of the pair changed alone, an
    input changed in place, and one buffer's first rows (same addresses, fewer rows) each equal
    their sequential stages, and the chain's launch holds a bound entry per pair it saw
    (``tests/test_launcher.py`` checks the key part by part on the CPU)."""
    ws = [rand(4096, 4096, scale=4096**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, always_pipelined=True)
    x1, x2 = rand(2048, 4096), rand(2048, 4096)
    o1, o2 = torch.empty_like(x1), torch.empty_like(x2)
    for _ in range(3):
        for x, o in ((x1, o1), (x2, o2)):
            o.fill_(float("nan"))
            assert torch.equal(pipe(x, out=o, check=True), pipe.sequential(x))
    for x, o in ((x1, o2), (x2, o1), (x1, o1)):  # one of the pair changed alone
        o.fill_(float("nan"))
        assert torch.equal(pipe(x, out=o, check=True), pipe.sequential(x))
    x1.mul_(-1)  # same address, new values
    assert torch.equal(pipe(x1, out=o1, check=True), pipe.sequential(x1))
    for m in (1900, 2048, 1900):  # one buffer's rows: same addresses, the rows alone change
        o1.fill_(float("nan"))
        assert torch.equal(pipe(x1[:m], out=o1[:m], check=True), pipe.sequential(x1[:m]))
    (launch,) = [lc for lc in pipe.plan(2048).launches if lc.stages]
    keys = {(k[0], k[3]) for k in launch._bound}
    assert {(x1.data_ptr(), o1.data_ptr()), (x2.data_ptr(), o2.data_ptr())} <= keys


def test_host_wait_is_bounded_and_a_hung_pipeline_refuses_calls():
    """A consumer that starts ~1 s late (a sleep queued before it on its stream, as a kernel that
    runs on and on would): the host gives up after 0.3 s with a clear error, and the pipeline
    refuses further calls; the GPU ends the work by itself."""
    ws = [rand(2048, 2048, device=d, scale=2048**-0.5) for d in ["cuda:0", D1]]
    pipe = Pipeline(ws, loopback=True, timeout_s=0.1, host_timeout_s=0.3)
    x = rand(2048, 2048)
    plan = pipe.plan(2048)
    pipe(x, check=True)
    out = torch.empty(2048, 2048, dtype=torch.bfloat16, device=D1)
    pipe._launch(plan, x, out, delay_cycles={1: 2_000_000_000})
    t0 = time.perf_counter()
    with pytest.raises(PipelineHung, match=f"a call of this pipeline on {D1} did not finish within host_timeout_s=0.3"):
        pipe.check_errors()
    assert time.perf_counter() - t0 < 1.5
    with pytest.raises(PipelineHung, match="unusable"):
        pipe(x)
    for d in range(NGPU):  # the sleep ends, the consumer runs (before this test's buffers are freed)
        torch.cuda.synchronize(d)


def test_host_waits_do_not_wait_for_the_callers_later_work():
    """A call, then ~1 s of the caller's own work queued after it on the same stream: checking
    the call waits for the call only (well within a 0.3 s host bound), and the pipeline stays
    usable; both on the direct path (one GPU) and through the stage streams (loopback)."""
    for loopback in (False, True):
        ws = [rand(1024, 1024, scale=1024**-0.5) for _ in range(2)]
        pipe = Pipeline(ws, timeout_s=0.1, host_timeout_s=0.3, loopback=loopback, always_pipelined=True)
        x = rand(1024, 1024)
        pipe(x, check=True)
        y = pipe(x)
        torch.cuda._sleep(2_000_000_000)  # the caller's own work, after the call
        t0 = time.perf_counter()
        pipe.check_errors()
        assert time.perf_counter() - t0 < 0.3, loopback
        torch.cuda.synchronize()
        assert torch.equal(y, pipe.sequential(x)) and torch.equal(pipe(x, check=True), y)


def test_the_callers_earlier_work_is_not_read_as_a_hang():
    """~1 s of the caller's own work queued before a call (eager on the direct path, eager
    through the stage streams, a graph replay), checked within a 0.3 s host bound: the check
    raises TimeoutError naming the work queued before the call, the pipeline stays usable, and
    once that work is done the check passes and the call was right."""
    for kind in ("direct", "loopback", "replay"):
        ws = [rand(1024, 1024, scale=1024**-0.5) for _ in range(2)]
        pipe = Pipeline(ws, timeout_s=0.1, host_timeout_s=0.3, loopback=kind == "loopback", always_pipelined=True)
        x = rand(1024, 1024)
        graphed = pipe.capture(1024) if kind == "replay" else None
        pipe(x, check=True)
        torch.cuda._sleep(2_000_000_000)  # the caller's own work, before the call
        y = graphed(x) if graphed else pipe(x)
        with pytest.raises(TimeoutError, match="the work queued before a call"):
            pipe.check_errors()
        assert pipe._broken is None, kind
        torch.cuda.synchronize()
        pipe.check_errors()
        assert torch.equal(y, pipe.sequential(x)) and torch.equal(pipe(x, check=True), y), kind
    # a call of the pipeline's own that does not finish (a stage delayed ~1 s), with a later call
    # queued behind it: the pipeline's (PipelineHung), not the caller's work before the later call
    pipe = Pipeline(ws, timeout_s=0.1, host_timeout_s=0.3, always_pipelined=True)
    pipe(x, check=True)
    pipe._launch(pipe.plan(1024), x, torch.empty_like(y), delay_cycles={0: 2_000_000_000})
    pipe(x)
    with pytest.raises(PipelineHung, match="a call of this pipeline on cuda:0 did not finish"):
        pipe.check_errors()
    torch.cuda.synchronize()


def test_a_graph_refuses_a_replay_after_a_weights_storage_swap():
    """A replay after ``w.data = ...`` would read the freed storage: refused, as a call is."""
    ws = [rand(1024, 1024, scale=1024**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, always_pipelined=True)
    graphed = pipe.capture(512)
    x = rand(512, 1024)
    assert torch.equal(graphed(x), pipe.sequential(x))
    assert not pipe._in_callers_graphs  # capture()'s replays record their end
    ws[1].data = ws[1].clone()
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        graphed(x)


def test_a_call_captured_before_its_plan_exists_is_refused():
    """Under a capture of the caller's own, a call on a height without a plan would build one
    (host copies inside the capture): refused with what to do; after one call outside, the
    captured call replays right, and checking it waits for the replay (which records no end of
    its own: the host waits then cover the caller's current streams)."""
    ws = [rand(1024, 1024, scale=1024**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, always_pipelined=True)
    x, out = rand(384, 1024), torch.empty(384, 1024, dtype=torch.bfloat16, device="cuda:0")
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="call the pipeline once on 384 rows outside the capture"):
        with torch.cuda.graph(graph):
            pipe(x, out=out)
    assert not pipe._in_callers_graphs  # (nothing was captured)
    pipe(x, out=out, check=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pipe(x, out=out)
    assert pipe._in_callers_graphs  # host waits now wait for the caller's streams too
    out.fill_(float("nan"))
    torch.cuda._sleep(400_000_000)  # ~0.2 s before the replay starts
    graph.replay()
    end = torch.cuda.current_stream().record_event()
    pipe.check_errors()  # waits for the replay on the current stream
    assert end.query(), "check_errors returned before the replay it checks had run"
    assert torch.equal(out, pipe.sequential(x))


@pytest.mark.parametrize("M", [2048, 2000, 37, 1])
def test_cached_launch_equals_tritons_launch_path(M):
    """The plain GEMM's later calls go through the raw launch (tensor maps kept per tensor,
    no per-call driver queries): bitwise the first call (Triton's path), for sizes with and
    without the integer specialisations, for new tensors and for a padded output."""
    a, b = rand(M, 4096), rand(4096, 3072, scale=4096**-0.5)
    first = matmul(a, b)
    cfg = plain_config(M)  # what matmul runs (narrow tiles for few rows)
    launch = plain_launch(M, 3072, 4096, cfg, a.device, torch.cuda.current_stream().cuda_stream, None, 0)
    assert launch.raw, "Triton's launcher is not the one ctapipelining.launcher knows: launches take the slow path"
    for _ in range(2):
        again = torch.full_like(first, float("nan"))
        matmul(a.clone(), b, out=again)  # a new A (a new tensor map) and a new output
        assert torch.equal(again, first)
    padded = torch.full((M, 3072 + 64), float("nan"), dtype=torch.bfloat16, device="cuda:0")[:, :3072]
    for _ in range(2):  # ordinary stores: compiled once, then raw
        matmul(a, b, out=padded)
        assert torch.equal(padded, first)
    assert float((first.float() - a.float() @ b.float()).norm() / (a.float() @ b.float()).norm()) < 2e-2


def test_a_repeated_matmul_skips_to_its_bound_launch_and_still_refuses_what_it_must(monkeypatch):
    """A call whose operands have the signature of an earlier checked call launches its bound
    arguments (``gemm._BOUND``) without running the checks again, bitwise the first call, with
    ``out`` given or new; an operand whose signature differs in any field (strides, shape,
    dtype) goes through the checks and is refused. A call captured in a CUDA graph goes through
    them too and binds a launch of its own (its buffers are the graph's alone)."""
    from ctapipelining import gemm

    gemm._BOUND.clear()
    a, b = rand(2048, 1024), rand(1024, 512, scale=1024**-0.5)
    first = matmul(a, b)
    y = torch.full_like(first, float("nan"))
    matmul(a, b, out=y)  # checked: bound for (a, b, y) and (a, b, new)
    assert len(gemm._BOUND) == 2 and {k[2] is None for k in gemm._BOUND} == {True, False}

    def refuse(*args, **kw):
        raise AssertionError("a bound call ran the checks")

    with monkeypatch.context() as m:  # from here on a call that runs the checks fails
        for name in ("check_operands", "check_out", "overlaps", "plain_launch"):
            m.setattr(gemm, name, refuse)
        for _ in range(3):
            y.fill_(float("nan"))
            matmul(a, b, out=y)
            assert torch.equal(y, first)
            poison = torch.full_like(first, float("nan"))
            del poison  # the allocator's next block of this size: a new output written over NaN
            assert torch.equal(matmul(a, b), first)
        # a new out reuses the arguments built for the last one where it lands at its address, and
        # builds them again where it does not (here: while the last one is held)
        built, raw_args = [], gemm.GemmLaunch.raw_args
        m.setattr(gemm.GemmLaunch, "raw_args", lambda *args, **kw: built.append(1) or raw_args(*args, **kw))
        key = next(k for k in gemm._BOUND if k[2] is None)
        held, moved = [], []
        for keep in (True, True, False, False, False):
            before, n = gemm._BOUND[key][2][0][0], len(built)
            poison = torch.full_like(first, float("nan"))
            del poison
            new = matmul(a, b)
            assert torch.equal(new, first)
            moved.append(new.data_ptr() != before)
            assert len(built) - n == moved[-1]
            if keep:
                held.append(new)
            del new
        assert moved[1] and not all(moved)  # both cases ran
    # captured: not a bound call, a launch whose split tail's buffers are apart from eager calls'
    # (640 rows: 160 tiles, a last round of 28 split in two); two graphs captured on one stream
    # share it, and each zeroes its arrival counters (the second may be replayed first: here
    # after they were left non-zero, as the first graph's unreplayed zero-fill may leave them)
    a2, b2 = rand(640, 2048), rand(2048, 8192, scale=2048**-0.5)
    eager = matmul(a2, b2, config=PLAIN_CONFIG)
    y2 = torch.full_like(eager, float("nan"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graphs = [torch.cuda.CUDAGraph() for _ in range(2)]
    for graph in graphs:
        with torch.cuda.graph(graph, stream=side):
            matmul(a, b, out=y)
            matmul(a2, b2, out=y2, config=PLAIN_CONFIG)
    captured = gemm.plain_launch(
        640, 8192, 2048, PLAIN_CONFIG, a.device, side.cuda_stream, None, gemm._CAPTURE_OWNER.get()
    )
    stream = torch.cuda.current_stream().cuda_stream
    own = gemm.plain_launch(640, 8192, 2048, PLAIN_CONFIG, a.device, stream, None, 0)
    assert captured in gemm._CAPTURED and not any(captured is gemm._BOUND[k][0]() for k in gemm._BOUND)
    assert captured.tail is not None and captured.tail.shared is None and own.tail.shared is not None
    captured.tail.counters.fill_(3)
    for graph in graphs[::-1]:
        y.fill_(float("nan"))
        y2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, first) and torch.equal(y2, eager)
    with pytest.raises(ValueError, match="row-major"):  # y's address and shape, other strides
        matmul(a, b, out=y.view(512, 2048).t())
    with pytest.raises(ValueError, match=r"must be a \[2048, 512\]"):  # y's address, another shape
        matmul(a, b, out=y.view(512, 2048))
    with pytest.raises(ValueError, match="torch.bfloat16 tensor, got .* torch.float16"):  # another dtype
        matmul(a, b, out=y.view(torch.float16))
    with pytest.raises(ValueError, match="overlaps"):  # a's own memory as out
        matmul(a, b, out=a[:, :512])


def test_a_launch_compiled_for_one_dtype_is_not_reused_for_another():
    """Same shape, bf16 then fp16 then bf16: each dtype gets its own compiled kernel."""
    a, b = rand(512, 1024), rand(1024, 512, scale=1024**-0.5)
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16, torch.float16):
        x, w = a.to(dtype), b.to(dtype)
        ref = (x.float() @ w.float()).to(dtype)
        y = matmul(x, w)
        assert y.dtype == dtype
        assert float((y.float() - ref.float()).norm() / ref.float().norm()) < 1e-2, dtype


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_one_bucketed_plan_serves_several_row_counts(policy):
    """Row counts of one bucket share a plan and its raw launches (tensor maps per height):
    each call bitwise equal to the stages one after another, in any order."""
    ws = [rand(2048, 2048, device=d, scale=2048**-0.5) for d in ["cuda:0", D1]]
    pipe = Pipeline(ws, loopback=True, policy=policy)
    rows = [1900, 2048, 1793, 2048, 1900]
    assert len({pipe.rows_for(m) for m in rows}) == 1
    for m in rows:
        x = rand(m, 2048)
        assert torch.equal(pipe(x, check=True), pipe.sequential(x)), m
    plan = pipe.plan(rows[0])
    assert all(lc.gemm.raw for lc in plan.launches)


def test_sm_budget_on_a_shared_gpu():
    """Two stages sharing a GPU under a budget of 120 SMs: 60 CTAs each, bitwise equal to the
    stages one after another; a budget below one SM per stage is refused."""
    ws = [rand(4096, 4096, scale=4096**-0.5) for _ in range(2)]
    pipe = Pipeline(ws, loopback=True, sm_budget=120)
    x = rand(5000, 4096)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    assert pipe.plan(5000).num_ctas == [60, 60]
    with pytest.raises(ValueError, match="sm_budget"):
        Pipeline(ws, loopback=True, sm_budget=1)
