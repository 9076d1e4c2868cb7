"""Stages that share one GPU in one chain kernel (:mod:`ctapipelining.kernels.chain`): bitwise
the stages one after another for 2 to 6 stages and ragged shapes, back-to-back calls and graph
replays without reset, no wrap, a clean timeout, an SM budget."""

import dataclasses
import time

import pytest
import torch
from protocol_state import calls_from_two_streams, preset_epoch

from ctapipelining.chain import ChainLaunch
from ctapipelining.kernels.gemm import PIPELINE_CONFIG
from ctapipelining.pipeline import Pipeline, PipelineTimeout

pytestmark = pytest.mark.gpu


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda:0") * scale).bfloat16()


def chain(*dims):
    return [rand(k, n, scale=k**-0.5) for k, n in zip(dims, dims[1:])]


CASES = [  # (widths, rows)
    ((8192, 8192, 8192), 640),  # two waves of tiles a layer: the combined order's three rounds (split tail)
    ((8192, 8192, 8192), 128),  # the table's narrow tiles (Pipeline.plan_configs): two 64-row blocks
    ((8192, 8192, 8192), 256),  # the table's 128 x 128 tiles
    ((5000, 7000, 5000), 3000),  # nothing divides the tiles
    ((4096, 3000, 5000, 4096), 5000),
    ((2048, 4096, 2048, 4096, 2048), 16384),
    ((1024, 2048, 1024, 2048, 1024, 2048), 3000),  # 5 stages: a chain kernel of 4, then one of 1
    ((1024, 2048, 1024, 2048, 1024, 2048, 1024), 3000),  # 6: the second chain kernel waits on the first
]


@pytest.mark.parametrize("policy", ["static", "workqueue"])
@pytest.mark.parametrize("dims,M", CASES)
@pytest.mark.parametrize("wide", [False, True])
def test_chain_kernel_equals_the_stages_one_after_another(policy, dims, M, wide):
    """Each case in the plan's own configuration (``wide=False``: the measured table's row for
    its height; a stage whose producer is another chain kernel waits in ``PIPELINE_CONFIG``'s
    parts) and in ``PIPELINE_CONFIG``'s 128 x 256 tiles where those differ."""
    from ctapipelining.gemm import config_table, pick_config
    from ctapipelining.kernels.gemm import PIPELINE_CONFIG
    from ctapipelining.pipeline import PIPELINE_TABLE

    ws = chain(*dims)
    pipe = Pipeline(ws, policy=policy, always_pipelined=True)
    own = pick_config(config_table(PIPELINE_TABLE), pipe.rows_for(M))
    across = dataclasses.replace(own, wait_parts=PIPELINE_CONFIG.wait_parts)
    if wide and across == PIPELINE_CONFIG:
        pytest.skip("the plan's own tiles are PIPELINE_CONFIG's")
    if wide:
        pipe = Pipeline(ws, policy=policy, config=PIPELINE_CONFIG, always_pipelined=True)
    plan = pipe.plan(M)
    assert isinstance(plan.launches[0].gemm, ChainLaunch)
    firsts = {lc.stages[0] for lc in plan.launches}  # each chain kernel's first stage
    assert plan.configs == [PIPELINE_CONFIG if wide else across if s in firsts and s else own for s in range(len(ws))]
    for _ in range(2):
        x = rand(M, dims[0])
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        out = torch.full((M, dims[-1]), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x))
    assert all(lc.gemm.raw for lc in plan.launches)
    ref = x.float()
    for w in ws:
        ref = (ref @ w.float()).bfloat16().float()
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_chain_200_calls_then_graph_replays_without_reset(policy):
    ws = chain(8192, 8192, 8192)
    pipe = Pipeline(ws, policy=policy, always_pipelined=True)
    x = rand(640, 8192)
    y = torch.empty(640, 8192, dtype=torch.bfloat16, device="cuda:0")
    for _ in range(200):
        pipe(x, out=y)
    pipe.check_errors()
    ref = pipe.sequential(x)
    assert torch.equal(y, ref)
    g = pipe.capture(640)
    for _ in range(50):
        g(x)
    g.check_errors()
    assert torch.equal(g.out, ref)


def test_chain_no_wrap_past_int32():
    ws = chain(2048, 2048, 1024, 2048)
    pipe = Pipeline(ws, always_pipelined=True)
    plan = pipe.plan(3000)
    preset_epoch(plan, 2**31 - 2)
    for _ in range(3):
        x = rand(3000, 2048)
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    assert int(plan.tickets[0]) == (2**31 + 1) * plan.launches[0].gemm.claims_per_run
    g = pipe.capture(3000)  # replays advance the device epochs past what the host counts
    for _ in range(3):
        x = rand(3000, 2048)
        assert torch.equal(g(x), pipe.sequential(x))
    g.check_errors()


def test_chain_timeout_inside_the_kernel_is_clean():
    """A counter between stages 1 and 2 that never fills: PipelineTimeout naming stage 2 soon
    after the deadline, the GPU fine, the next call right."""
    ws = chain(2048, 2048, 2048, 2048)
    pipe = Pipeline(ws, timeout_s=0.2, always_pipelined=True)
    x = rand(4096, 2048)
    plan = pipe.plan(4096)
    plan.links[1].need_consumer[3] += 1
    t0 = time.perf_counter()
    with pytest.raises(PipelineTimeout, match="stage 2 on cuda:0"):
        pipe(x, check=True)
    assert time.perf_counter() - t0 < 5
    plan.links[1].need_consumer[3] -= 1
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_chain_writes_a_padded_out():
    """The last stage stores ordinarily into an ``out`` whose rows are padded; the padding stays."""
    ws = chain(4096, 4096, 3000)
    pipe = Pipeline(ws, always_pipelined=True)
    x = rand(5000, 4096)
    full = torch.full((5000, 3072), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    out = full[:, :3000]
    for _ in range(2):  # compiled, then the raw launch
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x))
    assert full[:, 3000:].isnan().all()


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["static", "workqueue"])
@pytest.mark.parametrize("devices", [[0, 0, 1, 1], [0, 1, 1], [0, 0, 1]])
def test_chain_kernels_linked_across_gpus(policy, devices):
    """Chain kernels on two GPUs: a chain kernel's first stage waiting on a peer's counters or
    ring, its last stage signalling a peer; a delayed producer, NaN-poisoned buffers, graph
    replays; bitwise the stages one after another."""
    dims = [4096, 2048, 4096, 2048, 4096][: len(devices) + 1]
    ws = [w.to(f"cuda:{d}") for w, d in zip(chain(*dims), devices)]
    pipe = Pipeline(ws, policy=policy)
    assert len(pipe.groups) == 2
    M = 5000
    plan = pipe.plan(M)
    for _ in range(2):
        x = rand(M, dims[0])
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        out = torch.full((M, dims[-1]), float("nan"), dtype=torch.bfloat16, device=f"cuda:{devices[-1]}")
        pipe._launch(plan, x, out, delay_cycles={0: 20_000_000})  # ~10 ms before the first GPU's kernel
        pipe.check_errors()
        assert torch.equal(out, pipe.sequential(x))
        assert torch.equal(pipe(x, check=True), out)
    g = pipe.capture(M)
    for _ in range(3):
        x = rand(M, dims[0])
        assert torch.equal(g(x), pipe.sequential(x))
    g.check_errors()


@pytest.mark.parametrize("M", [640, 16384])
def test_chain_split_tail(M):
    """The chain kernel's last partial round split along K (``split_tail``): bitwise the stages
    one after another with the same split, NaN-poisoned output, twice (compiled, then raw)."""
    ws = chain(8192, 8192, 8192)
    pipe = Pipeline(ws, config=dataclasses.replace(PIPELINE_CONFIG, split_tail=True))
    assert pipe.plan(M).launches[0].gemm.split is not None
    for _ in range(2):
        x = rand(M, 8192)
        out = torch.full((M, 8192), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        pipe(x, out=out, check=True)
        assert torch.equal(out, pipe.sequential(x))


def test_chain_sm_budget():
    ws = chain(4096, 4096, 4096)
    pipe = Pipeline(ws, sm_budget=120)
    x = rand(5000, 4096)
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    assert pipe.plan(5000).num_ctas == [120, 120]  # one grid of 120 CTAs runs both stages


def test_the_default_on_one_gpu_runs_our_gemms_one_after_another():
    """The default pipeline on one GPU: a call, its reference and its graph replay are bitwise our
    GEMMs one after another and build no plan; a call from another stream still ends after the
    call before it (which waited behind a ~50 ms sleep), as every call is ordered."""
    from ctapipelining.gemm import matmul

    ws = chain(8192, 8192, 8192)
    pipe = Pipeline(ws)
    assert pipe.one_after_another
    x = rand(2048, 8192)
    want = matmul(matmul(x, ws[0]), ws[1])
    assert torch.equal(pipe(x, check=True), want) and torch.equal(pipe.sequential(x), want)
    g = pipe.capture(2048)
    assert g.plan is None and not pipe._plans
    for _ in range(3):
        x = rand(2048, 8192)
        assert torch.equal(g(x), matmul(matmul(x, ws[0]), ws[1]))
    g.check_errors()
    x1, x2 = rand(2048, 8192), rand(2048, 8192)
    ref1, ref2 = matmul(matmul(x1, ws[0]), ws[1]), matmul(matmul(x2, ws[0]), ws[1])
    out = torch.empty_like(x1)
    out1, out2, ordered = calls_from_two_streams(pipe, x1, x2, out)
    assert ordered  # call 2 ended after call 1, not ~50 ms before it
    assert out2 is out and torch.equal(out1, ref1) and torch.equal(out, ref2)


def test_a_repeated_eager_call_of_the_default_launches_its_bound_gemms(monkeypatch):
    """An eager call of the default pipeline on one GPU on operands with the signatures of an
    earlier checked call's from the same stream launches the GEMMs bound then, with none of the
    checks (here made to fail), bitwise the checked call, into a NaN-poisoned ``out`` or a new
    one, on new contents of ``x``, its arguments built again for each GEMM whose input or output
    lands elsewhere; still ordered after a call from another stream (behind a ~50 ms sleep).
    Other operands, another stream, ``check=True``, a profiler's launch hooks, a capture or a
    weight whose storage or dtype changed go through the checks (or refuse); at most
    ``MAX_BOUND_CALLS`` are kept."""
    from triton import knobs

    from ctapipelining import gemm, pipeline, serial

    ws = chain(2048, 4096, 2048)
    pipe = Pipeline(ws)
    x, x2, other = rand(1024, 2048), rand(1024, 2048), rand(1024, 2048)  # 1024 rows: our GEMMs, not cuBLAS
    assert not serial.runs_cublas(1024)
    want, want2 = pipe.sequential(x), pipe.sequential(x2)
    y = torch.full_like(want, float("nan"))
    assert torch.equal(pipe(x), want) and torch.equal(pipe(x, out=y), want)
    assert len(pipe._bound_calls) == 2
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y_side = pipe(x2, out=torch.empty_like(want))  # bound for the side stream
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(y_side, want2) and len(pipe._bound_calls) == 3
    bound = next(b for k, b in pipe._bound_calls.items() if k[1] is None)  # (x, a new out)

    def refuse(*args, **kw):
        raise AssertionError("a bound call ran the checks")

    with monkeypatch.context() as m:
        for name in ("check_input", "check_output", "_call_one_after_another"):
            m.setattr(Pipeline, name, refuse)
        m.setattr(pipeline, "stage_gemm", refuse)
        built, raw_args = [], gemm.GemmLaunch.raw_args
        m.setattr(gemm.GemmLaunch, "raw_args", lambda *args, **kw: built.append(1) or raw_args(*args, **kw))
        for _ in range(3):
            y.fill_(float("nan"))
            assert pipe(x, out=y) is y and torch.equal(y, want)
            poison = torch.full_like(want, float("nan"))
            del poison  # a new output where the poison was
            assert torch.equal(pipe(x), want)
        # each GEMM's arguments built again where its input or output moved: the last output held
        # and a block of the intermediate's size taken, so both land elsewhere
        kept, blocks, moved = [], [], []
        for _ in range(3):
            before, n = [step.at for step in bound._steps], len(built)
            kept.append(pipe(x))
            after = [step.at for step in bound._steps]
            assert torch.equal(kept[-1], want) and after[1][1] == kept[-1].data_ptr() and after[0][0] == x.data_ptr()
            assert after[0][1] == after[1][0]  # the intermediate, as each GEMM's arguments hold it
            moved.append(sum(b != a for b, a in zip(before, after)))
            assert len(built) - n == moved[-1]
            blocks.append(torch.empty(1024, 4096, dtype=torch.bfloat16, device="cuda:0"))
        assert max(moved) == 2  # both GEMMs' arguments built again at once
        x.copy_(x2)  # new contents, the same signature
        assert torch.equal(pipe(x), want2)
        # ordered: the side stream's bound call waits for the default stream's (behind the sleep)
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)
        first = pipe(x, out=y)
        end1 = torch.cuda.Event(enable_timing=True)
        end1.record()
        with torch.cuda.stream(side):
            pipe(x2, out=y_side)
            end2 = torch.cuda.Event(enable_timing=True)
            end2.record()
        torch.cuda.synchronize()
        assert end1.elapsed_time(end2) > 0 and torch.equal(first, want2) and torch.equal(y_side, want2)

        def on_side():
            with torch.cuda.stream(side):
                pipe(x, out=y)  # (x, y) bound on the default stream only

        def hooked():
            knobs.runtime.launch_enter_hook.add(print)
            try:
                pipe(x, out=y)
            finally:
                knobs.runtime.launch_enter_hook.remove(print)

        for call in (lambda: pipe(other), lambda: pipe(x, check=True), lambda: pipe(x[:320]), on_side, hooked):
            with pytest.raises(AssertionError, match="ran the checks"):
                call()
    torch.cuda.synchronize()
    checked, check_input = [], Pipeline.check_input
    with monkeypatch.context() as m:  # a capture of a bound call's operands takes the checked path
        m.setattr(Pipeline, "check_input", lambda *args: checked.append(1) or check_input(*args))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            pipe(x2, out=y_side)
    y_side.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert checked and torch.equal(y_side, want2) and len(pipe._bound_calls) == 3
    held = [rand(1024, 2048) for _ in range(pipeline.MAX_BOUND_CALLS + 2)]  # held: signatures apart
    for xi in held:
        pipe(xi)
    assert len(pipe._bound_calls) == pipeline.MAX_BOUND_CALLS
    keys = list(pipe._bound_calls)
    assert keys[-1][0][0] == held[-1].data_ptr() and keys[-2][0][0] == held[-2].data_ptr()
    ws[1].data = ws[1].data.view(torch.float16)  # the same address, shape and strides: another dtype
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        pipe(held[-1])  # bound
    ws[1].data = ws[1].data.view(torch.bfloat16)
    assert torch.equal(pipe(held[-1]), pipe.sequential(held[-1]))
    ws[0].data = ws[0].data.clone()
    with pytest.raises(RuntimeError, match="storage or layout changed"):
        pipe(held[-2])  # bound
    pipe.check_errors()


@pytest.mark.parametrize("M", [640, 768, 300])
def test_the_default_runs_cublas_where_it_measured_faster(M, monkeypatch):
    """At the row counts where cuBLAS measured faster than every configuration of ours
    (``runs_cublas``), the default pipeline on one GPU runs its stages as cuBLAS one after
    another: a checked call, bound eager calls (their checks made to fail) into a NaN-poisoned
    ``out`` and into a new one, an ``out`` with padded rows (padding kept) and a graph replay
    into one are bitwise ``torch.mm`` twice and ``sequential``; with weights that require grad
    (no autograd graph), under autocast (bf16 kept), into an ``out`` made under inference mode.
    In deterministic mode, where cuBLAS may refuse, the stages are our GEMMs."""
    from ctapipelining import gemm, operands, pipeline, serial

    assert serial.runs_cublas(M)
    ws = [torch.nn.Parameter(w) for w in chain(8192, 4096, 8192)]  # requires grad
    pipe = Pipeline(ws)
    x = rand(M, 8192)
    with torch.no_grad():
        want = torch.mm(torch.mm(x, ws[0]), ws[1])
    got = pipe(x, check=True)  # checked: bound for (x, a new out)
    assert got.grad_fn is None and torch.equal(got, want) and torch.equal(pipe.sequential(x), want)
    y = torch.full_like(want, float("nan"))
    assert torch.equal(pipe(x, out=y), want)  # checked: bound for (x, y)
    stream = torch.cuda.current_stream().cuda_stream
    for o in (y, None):
        bound = pipe._bound_calls[operands.signature(x), None if o is None else operands.signature(o), stream]
        assert bound._steps == [None, None]  # cuBLAS's steps

    def refuse(*args, **kw):
        raise AssertionError("a bound call ran the checks")

    with monkeypatch.context() as m:
        for name in ("check_input", "check_output", "_call_one_after_another"):
            m.setattr(Pipeline, name, refuse)
        y.fill_(float("nan"))
        assert pipe(x, out=y) is y and torch.equal(y, want) and torch.equal(pipe(x), want)
        with torch.autocast("cuda"):
            assert pipe(x).dtype == torch.bfloat16 and torch.equal(pipe(x, out=y), want)
    with torch.autocast("cuda"):
        assert torch.equal(pipe(x, check=True), want)  # checked
    full = torch.full((M, 8192 + 64), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    assert torch.equal(pipe(x, out=full[:, :8192]), want) and full[:, 8192:].isnan().all()
    with torch.inference_mode():
        made = torch.empty_like(want)
    assert torch.equal(pipe(x, out=made), want)
    g = pipe.capture(M, out=full[:, :8192])
    full.fill_(float("nan"))
    assert torch.equal(g(x), want) and full[:, 8192:].isnan().all()
    torch.use_deterministic_algorithms(True)
    try:
        with monkeypatch.context() as m:
            m.setattr(pipeline, "stage_gemm", lambda a, b, out=None: gemm.matmul(a, b, out=out))
            ours = pipe.sequential(x)  # our GEMMs one after another
        assert not torch.equal(ours, want) and torch.equal(pipe(x), ours) and torch.equal(pipe(x, out=y), ours)
    finally:
        torch.use_deterministic_algorithms(False)
    pipe.check_errors()


@pytest.mark.parametrize("M", [16384])
def test_default_graphs_on_one_gpu_own_their_split_tails(M):
    """Two default pipelines of the same shapes (our GEMMs one after another, whose last partial
    round is split along K at this height): their graphs, replayed at once on two streams, each
    give their own GEMMs one after another (each graph's split tail buffers its own), into a
    padded ``out`` whose padding stays."""
    from ctapipelining.gemm import matmul, num_sms, plain_config, tail_split
    from ctapipelining.serial import runs_cublas

    assert not runs_cublas(M) and tail_split(M, 8192, 8192, plain_config(M), num_sms(torch.device("cuda:0")))

    pipes = [Pipeline(chain(8192, 8192, 8192)) for _ in range(2)]
    graphs = []
    for pipe in pipes:
        full = torch.full((M, 8192 + 64), float("nan"), dtype=torch.bfloat16, device="cuda:0")
        graphs.append((pipe.capture(M, out=full[:, :8192]), full))
    streams = [torch.cuda.Stream() for _ in pipes]
    for _ in range(3):
        xs = [rand(M, 8192) for _ in pipes]
        torch.cuda.synchronize()
        for (g, _), x, st in zip(graphs, xs, streams):
            with torch.cuda.stream(st):
                g.x.copy_(x)
                g.replay()
        torch.cuda.synchronize()
        for pipe, (g, full), x in zip(pipes, graphs, xs):
            ws = pipe.weights
            assert torch.equal(g.out, matmul(matmul(x, ws[0]), ws[1]))
            assert full[:, 8192:].isnan().all()
