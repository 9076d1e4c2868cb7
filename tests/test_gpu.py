"""GPU tests (outcomes recorded under benchmarks/results/).

``gpu``: one GPU: the plain GEMM, and every pipeline test whose stages can share a GPU (with
one GPU, stage 1 runs on cuda:0 beside stage 0: a loopback through the same system-scope code
path; with two, on cuda:1). ``gpu2``: two GPUs with peer access (prefill and drain, which fill
a second GPU's idle time, and placement across GPUs).
"""

import dataclasses
import gc
import time
import weakref

import pytest
import torch
import triton
import triton.language as tl

from ctapipelining.deps import grouped_tile
from ctapipelining.gemm import matmul, num_sms, tail_split
from ctapipelining.kernels.gemm import PIPELINE_CONFIG, PLAIN_CONFIG
from ctapipelining.pipeline import TUNE_MARGIN, Pipeline, PipelineTimeout, faster_by

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
D1 = "cuda:1" if NGPU >= 2 else "cuda:0"  # stage 1's GPU (loopback on one GPU)
BF16_TOL = 2e-2  # relative Frobenius error of a bf16 chain vs an fp32 reference


def rel_err(y, ref):
    return float((y.float() - ref).norm() / ref.norm())


def rand(*shape, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).bfloat16()


def weights(dims, devices):
    return [rand(k, n, device=d, scale=k**-0.5) for (k, n), d in zip(zip(dims, dims[1:]), devices)]


def fp32_chain(x, ws):
    y = x.float()
    for w in ws:
        y = y.to(w.device) @ w.float()
    return y


def sequential_triton(x, ws, config):
    """The same Triton GEMMs run one after another (no pipelining). ``config``: one for
    every stage, or a pipeline (each stage's own: a workqueue consumer splits no tail)."""
    if isinstance(config, Pipeline):
        return config.sequential(x)
    y = x
    for w in ws:
        y = matmul(y.to(w.device), w, config=config)
    return y


def assert_calls_right(pipe, M, delays=(0, 0, 100_000_000)):
    """Eager calls of ``pipe`` on ``M`` rows, one per entry of ``delays`` (cycles the producer
    sleeps before it starts, ~0.05 s at 100M), each on a fresh input with NaN-poisoned buffers:
    each result bitwise the sequential GEMMs, and the first link's counters epoch x need."""
    K, N = pipe.weights[0].shape[0], pipe.weights[-1].shape[1]
    plan = pipe.plan(M)
    for delay in delays:
        x = rand(M, K, device="cuda:0")
        plan.inputs[1].fill_(float("nan"))
        out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device=D1)
        pipe._launch(plan, x, out, delay_cycles={0: delay} if delay else None)
        pipe.check_errors(plan)
        assert torch.equal(out, sequential_triton(x, pipe.weights, pipe))
    link = plan.links[0]
    assert torch.equal(link.counters.cpu(), plan.epoch * torch.as_tensor(link.dep.need))


def assert_replays_right(pipe, M, reps):
    """Capture one call of ``pipe`` on ``M`` rows in a CUDA graph, replay it ``reps`` times on
    fresh inputs into a NaN-poisoned output: each result bitwise the sequential GEMMs."""
    K, N = pipe.weights[0].shape[0], pipe.weights[-1].shape[1]
    x = rand(M, K, device="cuda:0")
    out = torch.empty(M, N, dtype=torch.bfloat16, device=D1)
    pipe(x, out=out)  # warm-up: compile and build the plan outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        pipe(x, out=out, check=False)
    for _ in range(reps):
        x.copy_(rand(M, K, device="cuda:0"))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, pipe.sequential(x))
    pipe.check_errors()


@triton.jit
def _activation_kernel(x_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.arange(0, BLOCK)
    tl.store(out_ptr + p, FN(tl.load(x_ptr + p, mask=p < n)), mask=p < n)


@pytest.mark.gpu
def test_the_epilogues_activations_keep_within_the_sfus_tanh_error():
    """SiLU and GELU on the GPU go through ``tanh.approx.f32`` (relative error below 2^-10.9):
    ``x * (1 + tanh) / 2`` then errs by at most ``|x| * 2^-11.9`` (absolute), far below the bf16
    rounding of an output near 1, a larger share of a SiLU output only where x is very negative
    and the output is near 0. Against float64 over [-30, 30] and at +-inf and NaN."""
    from ctapipelining.kernels.epilogue import gelu, silu, tanh

    x = torch.cat([torch.linspace(-30, 30, 4001), torch.tensor([float("inf"), float("nan"), -float("inf")])]).cuda()
    refs = {
        silu: torch.nn.functional.silu(x.double()),
        gelu: torch.nn.functional.gelu(x.double(), approximate="tanh"),
        tanh: torch.tanh(x.double()),
    }
    finite = x.isfinite()
    for fn, ref in refs.items():
        out = torch.empty_like(x)
        _activation_kernel[(1,)](x, out, x.numel(), FN=fn, BLOCK=triton.next_power_of_2(x.numel()))
        bound = (2.0**-10.9 if fn is tanh else 2.0**-11.9 * x[finite].double().abs()) + 1e-6
        assert ((out[finite].double() - ref[finite]).abs() <= bound).all(), fn.__name__
        assert torch.equal(out[~finite].isnan(), ref[~finite].isnan()), fn.__name__
        assert torch.equal(out[~finite].nan_to_num(), ref[~finite].float().nan_to_num()), fn.__name__


@pytest.mark.gpu
@pytest.mark.parametrize(
    "M,K,N",
    [
        (4096, 4096, 4096), (3000, 5000, 7000), (128, 8192, 8192), (1, 64, 64), (100, 8192, 1000), (150, 8192, 8192),
        (250, 776, 8200), (300, 776, 8192),
    ],
)  # fmt: skip
def test_plain_matmul(M, K, N):
    """Each row count in its measured configuration (:func:`~ctapipelining.gemm.plain_config`:
    narrower tiles than 128 x 256 for a few hundred rows or fewer: 250 rows take 128 x 128 tiles
    on a 6-stage load pipeline), into a NaN-filled ``out``."""
    from ctapipelining.gemm import plain_config

    cfg = plain_config(M)
    assert (cfg.block_m * cfg.block_n < 128 * 256) == (M <= 384), cfg
    a, b = rand(M, K, device="cuda:0"), rand(K, N, device="cuda:0", scale=K**-0.5)
    out = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda:0")
    matmul(a, b, out=out)
    assert not out.isnan().any()
    assert rel_err(out, a.float() @ b.float()) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
@pytest.mark.parametrize(
    "M,dims",
    [(4096, [4096, 4096, 4096]), (3000, [5000, 7000, 5000]), (128, [8192, 8192, 8192]), (16384, [8192, 8192, 8192])],
)
def test_pipeline_matches_sequential_bitwise(policy, M, dims):
    ws = weights(dims, ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    plan = pipe.plan(M)
    for _ in range(2):
        x = rand(M, dims[0], device="cuda:0")
        plan.inputs[1].fill_(float("nan"))
        out = torch.full((M, dims[-1]), float("nan"), dtype=torch.bfloat16, device=D1)
        y = pipe(x, out=out)
        assert not y.isnan().any()
        assert torch.equal(y, sequential_triton(x, ws, pipe))
        assert rel_err(y, fp32_chain(x, ws)) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_signals_bitwise(policy):
    """Producers signal each tile a quarter into their next one and their last after the loop:
    NaN-poisoned input, full size and ragged, three calls each, and every counter exactly
    epoch x need after them (a tile signalled twice runs a counter ahead of its data, which the
    first call may not show)."""
    ws = weights([8192, 8192, 8192], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    for M in (16384, 3000):
        assert_calls_right(pipe, M, delays=(0, 0, 0))


@pytest.mark.gpu
def test_only_plain_strided_cuda_tensors_take_a_bound_launch():
    """``bindable``: a bound launch signs its operands by address, so a sparse or nested tensor,
    or a subclass that may dispatch elsewhere, goes through the checks, which refuse the first
    two by name, in ``matmul`` and in a pipeline (its bound calls included)."""
    from ctapipelining.operands import bindable

    class Sub(torch.Tensor):
        pass

    a, b = rand(256, 512, device="cuda:0"), rand(512, 512, device="cuda:0", scale=512**-0.5)
    assert bindable(a) and bindable(torch.nn.Parameter(b))
    nested = torch.nested.nested_tensor([a[0]] * 256)  # 2-D and strided, but no address to sign
    bad = [a.to_sparse(), a.to_sparse_csr(), nested]
    assert not any(bindable(t) for t in bad) and not bindable(a.as_subclass(Sub))
    y = matmul(a, b)
    matmul(a, b, out=y)  # the signatures bound
    pipe = Pipeline([b, b])
    pipe(a, out=torch.empty_like(a))
    for t in bad:
        with pytest.raises(TypeError, match="dense"):
            matmul(t, b)
        with pytest.raises(TypeError, match="dense"):
            matmul(a, b, out=t)
        with pytest.raises(TypeError, match="dense"):
            pipe(t)
    torch.testing.assert_close(matmul(a.as_subclass(Sub), b).as_subclass(torch.Tensor), y, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("M,K,N", [(16384, 8192, 8192), (3000, 5000, 7000), (640, 8192, 8192)])
def test_plain_split_tail(M, K, N, padded):
    """The partial last round split along K: right, NaN-free, the same on every call (the
    partials are summed in slice order, whichever CTA arrives last), the arrival counters rearmed, and different from
    the unsplit GEMM only in the tail tiles (rounding of the partial sums). ``padded``: the
    output's rows are padded, so tiles are written with ordinary stores."""
    from ctapipelining.gemm import plain_launch

    cfg = dataclasses.replace(PLAIN_CONFIG, split_tail=True)
    split = tail_split(M, N, K, cfg, num_sms(torch.device("cuda:0")))
    assert split is not None
    a, b = rand(M, K, device="cuda:0"), rand(K, N, device="cuda:0", scale=K**-0.5)
    out = torch.full((M, N + 8 * padded), float("nan"), dtype=torch.bfloat16, device="cuda:0")[:, :N]
    matmul(a, b, out=out, config=cfg)
    assert not out.isnan().any()
    assert rel_err(out, a.float() @ b.float()) < BF16_TOL
    for _ in range(20):
        assert torch.equal(matmul(a, b, config=cfg), out)
    stream = torch.cuda.current_stream().cuda_stream
    launch = plain_launch(M, N, K, cfg, a.device, stream, None, 0)
    assert launch.tail.split == split and int(launch.tail.counters.abs().sum()) == 0
    whole = matmul(a, b, config=dataclasses.replace(cfg, split_tail=False))
    differs = (whole != out).nonzero()[:, 0].unique()  # rows with a difference
    tail_rows = set()
    for pos in range(split.first_pos, split.first_pos + split.tiles):
        pm = grouped_tile(pos, -(-M // cfg.block_m), -(-N // cfg.block_n), cfg.group_m) // -(-N // cfg.block_n)
        tail_rows.update(range(pm * cfg.block_m, min(M, (pm + 1) * cfg.block_m)))
    assert set(differs.tolist()) <= tail_rows


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
@pytest.mark.parametrize("padded", [False, True])
def test_split_tail_pipeline_bitwise(policy, padded):
    """Split tails in producers (both policies) and static consumers:
    NaN-poisoned buffers, full size and ragged, eager and replayed from a CUDA graph, counters
    rearmed. ``padded``: the output's rows are padded (the last stage writes them with ordinary
    stores)."""
    ws = weights([8192, 8192, 8192], ["cuda:0", D1])
    cfg = dataclasses.replace(PIPELINE_CONFIG, split_tail=True)
    pipe = Pipeline(ws, loopback=True, policy=policy, config=cfg, row_buckets=0)  # plans of exactly 3100 rows: ragged
    for M in (16384, 3100):  # 4096 tiles on 132 CTAs: 4 left over; ragged 3100: 800 tiles, 8 left over
        plan = pipe.plan(M)
        assert plan.tails[0] is not None and (plan.tails[1] is None) == (policy == "workqueue")
        for _ in range(2):
            x = rand(M, 8192, device="cuda:0")
            plan.inputs[1].fill_(float("nan"))
            out = torch.full((M, 8192 + 8 * padded), float("nan"), dtype=torch.bfloat16, device=D1)[:, :8192]
            assert torch.equal(pipe(x, out=out), sequential_triton(x, ws, pipe))
        assert all(int(t.counters.abs().sum()) == 0 for t in plan.tails if t is not None)
    assert_replays_right(pipe, 16384, 3)


@pytest.mark.gpu
def test_split_tail_lone_consumer_times_out_and_recovers():
    cfg = dataclasses.replace(PIPELINE_CONFIG, split_tail=True)
    ws = weights([2048, 2048, 2048], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy="static", config=cfg, timeout_s=0.2)
    M = 3000 if NGPU >= 2 else 1152  # a partial last round that splits: 132 CTAs, or 66 in loopback
    x = rand(M, 2048, device="cuda:0")
    plan = pipe.plan(M)
    assert plan.tails[1] is not None
    pipe._launch(plan, x, torch.empty(M, 2048, dtype=torch.bfloat16, device=D1), only=[1])
    with pytest.raises(PipelineTimeout, match=f"stage 1 on {D1}"):
        pipe.check_errors(plan)
    assert torch.equal(pipe(x), sequential_triton(x, ws, pipe))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_delayed_producer(policy):
    ws = weights([4096, 4096, 4096], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    x = rand(4096, 4096, device="cuda:0")
    plan = pipe.plan(4096)
    plan.inputs[1].fill_(float("nan"))
    out = torch.empty(4096, 4096, dtype=torch.bfloat16, device=D1)
    pipe._launch(plan, x, out, delay_cycles={0: 200_000_000})  # ~0.1 s before the producer starts
    pipe.check_errors(plan)
    assert torch.equal(out, sequential_triton(x, ws, pipe))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_200_back_to_back_calls(policy):
    ws = weights([2048, 2048, 1024], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    xs = [rand(2048, 2048, device="cuda:0") for _ in range(200)]
    ys = [pipe(x, check=False) for x in xs]
    pipe.check_errors()
    assert pipe.plan(2048).epoch == 200
    for x, y in zip(xs, ys):
        assert torch.equal(y, sequential_triton(x, ws, pipe))
    link = pipe.plan(2048).links[0]
    assert torch.equal(link.counters.cpu(), 200 * torch.as_tensor(link.dep.need))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_lone_consumer_times_out_within_deadline(policy):
    ws = weights([2048, 2048, 2048], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy, timeout_s=0.2)
    x = rand(2048, 2048, device="cuda:0")
    plan = pipe.plan(2048)
    out = torch.empty(2048, 2048, dtype=torch.bfloat16, device=D1)
    t0 = time.perf_counter()
    pipe._launch(plan, x, out, only=[1])
    with pytest.raises(PipelineTimeout, match=f"stage 1 on {D1}: CTA .* timed out"):
        pipe.check_errors(plan)
    assert time.perf_counter() - t0 < 2.0
    y = pipe(x)  # the next call works
    assert torch.equal(y, sequential_triton(x, ws, pipe))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_result_is_ordered_on_every_device_current_stream(policy):
    """No synchronisation by the caller: work it queues on cuda:1's current stream right after
    the call (reading the result, reusing freed memory) must see the finished result."""
    ws = weights([4096, 4096, 4096], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    x = rand(4096, 4096, device="cuda:0")
    ref = sequential_triton(x, ws, pipe)
    plan = pipe.plan(4096)
    out = torch.full((4096, 4096), float("nan"), dtype=torch.bfloat16, device=D1)
    pipe._launch(plan, x, out, delay_cycles={0: 200_000_000})  # a slow producer: ~0.1 s
    snapshot = out.clone()  # queued on cuda:1's current stream, no sync in between
    for _ in range(5):
        y = pipe(x, check=False)
        again = y.clone()
        del y  # freed on cuda:1's current stream: the next call may reuse the block
        assert torch.equal(again, ref)
    pipe.check_errors()
    assert torch.equal(snapshot, ref)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_cuda_graph_capture_and_replay(policy):
    ws = weights([4096, 4096, 4096], ["cuda:0", D1])
    assert_replays_right(Pipeline(ws, loopback=True, policy=policy), 4096, 5)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_capture_returns_a_call_that_keeps_what_its_graph_needs(policy):
    """``Pipeline.capture``: the graphed call keeps the pipeline alive on its own, its replays
    on fresh inputs are bitwise right and ordered with the caller's streams (``out`` poisoned
    and read on cuda:1's current stream with no explicit synchronisation), a wrong input is
    refused."""
    ws = weights([4096, 4096, 4096], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    graphed, alive = pipe.capture(3000), weakref.ref(pipe)
    del pipe
    gc.collect()
    assert alive() is graphed.pipeline
    for _ in range(3):
        x = rand(3000, 4096, device="cuda:0")
        graphed.out.fill_(float("nan"))
        y = graphed(x)
        assert y is graphed.out
        assert torch.equal(y, sequential_triton(x, ws, graphed.pipeline))
    graphed.check_errors()
    with pytest.raises(ValueError, match="captured for x"):
        graphed(rand(2999, 4096, device="cuda:0"))
    if NGPU >= 2:
        with pytest.raises(ValueError, match="x is on cuda:1"):
            graphed(rand(3000, 4096, device=D1))


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_trace_mode(policy):
    from ctapipelining import trace

    ws = weights([4096, 4096, 4096], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, loopback=True, policy=policy, trace=True)
    x = rand(4096, 4096, device="cuda:0")
    assert torch.equal(pipe(x), sequential_triton(x, ws, pipe))
    stamps = pipe.traces(4096)
    for t in stamps:
        assert (t[:, :4] > 0).all(), "a tile was not stamped"
        assert (t[:, 0] <= t[:, 1]).all() and (t[:, 1] <= t[:, 2]).all() and (t[:, 2] <= t[:, 3]).all()
    link = trace.clock_offset(0, 1, rounds=200)
    s = trace.summarize(stamps, [lk.dep for lk in pipe.plan(4096).links], [0.0, link.offset_ns])
    assert 0 <= s["T1_signal"]["median_us"] < 100  # in-loop signalling: the epilogue only notes the tile
    assert 0 < link.one_way_ns < 20_000


@pytest.mark.gpu2
@pytest.mark.parametrize("n", [3, 4, 8])
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_chain_of_n_stages_on_n_gpus(n, policy):
    """Middle stages both wait and signal; one stage per GPU (skipped with fewer GPUs)."""
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs, found {torch.cuda.device_count()}")
    ws = weights([2048] * (n + 1), [f"cuda:{i}" for i in range(n)])
    pipe = Pipeline(ws, loopback=True, policy=policy)
    for _ in range(3):
        x = rand(3000, 2048, device="cuda:0")
        for buf in pipe.plan(3000).inputs[1:]:
            buf.fill_(float("nan"))
        y = pipe(x)
        assert torch.equal(y, sequential_triton(x, ws, pipe))
        assert rel_err(y, fp32_chain(x, ws)) < BF16_TOL * n


@pytest.mark.gpu
def test_single_stage_is_the_plain_gemm():
    """A one-stage pipeline is the plain GEMM in its plan's configuration, whole tiles or (32
    tiles of 128 x 256 on 132 SMs, ``split_k``) split along K, on the grid ``matmul`` gives it."""
    (w,) = weights([2048, 1024], ["cuda:0"])
    x = rand(1000, 2048, device="cuda:0")
    for split in (False, True):
        pipe = Pipeline([w], always_pipelined=True, config=dataclasses.replace(PLAIN_CONFIG, split_k=split))
        assert (pipe.plan(1000).launches[0].gemm.tail is not None) == split
        assert torch.equal(pipe(x), matmul(x, w, config=pipe.plan(1000).configs[0]))


@pytest.mark.gpu2
def test_bad_placement_raises_before_launch():
    a, b = rand(256, 256, device="cuda:0"), rand(256, 256, device="cuda:0")
    with pytest.raises(ValueError, match="contiguous range of stages"):
        Pipeline([a, b.to("cuda:1"), b])
    with pytest.raises(ValueError, match="need the stages on two GPUs"):
        Pipeline([a, b], ends="balanced")
    pipe = Pipeline([a, b.to("cuda:1")])
    with pytest.raises(ValueError, match="x is on cuda:1; stage 0 runs on cuda:0"):
        pipe(rand(64, 256, device="cuda:1"))
    with pytest.raises(TypeError, match="float32"):
        pipe(torch.randn(64, 256, device="cuda:0"))
    n = torch.cuda.device_count()
    with pytest.raises(RuntimeError, match=f"needs {n + 1} GPUs; found {n}"):
        Pipeline.on_devices([a.cpu()] * (n + 1))
    assert pipe._plans == {}


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("parts", [2, 4, 8])
def test_wait_in_parts_bitwise(parts, split):
    """A static consumer waiting for its input rows part by part inside its K loop: NaN-poisoned
    input, full size and ragged, three calls each, every part's counter exactly epoch x need,
    then replayed from a CUDA graph."""
    ws = weights([8192, 8192, 8192], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, config=dataclasses.replace(PIPELINE_CONFIG, wait_parts=parts, split_tail=split))
    for M in (16384, 3000):
        assert pipe.plan(M).links[0].dep.parts == parts
        assert_calls_right(pipe, M, delays=(0, 0, 0))
    assert_replays_right(pipe, 16384, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("parts", [2, 8])
def test_wait_in_parts_behind_a_slow_producer(parts):
    """The producer's tiles take 4x the consumer's (K 16384 vs 4096, fewer columns), so the
    consumer catches up and its in-loop waits really wait: a TMA load issued before its part's
    wait would read NaN or stale rows. Also with the producer delayed before it starts."""
    ws = weights([16384, 4096, 8192], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, config=dataclasses.replace(PIPELINE_CONFIG, wait_parts=parts))
    assert_calls_right(pipe, 8192)
    assert_replays_right(pipe, 8192, 3)


@pytest.mark.gpu
def test_wait_in_parts_missing_part_times_out_and_recovers():
    """Only part 0 of every row-block is there: the consumer starts its tiles, times out inside
    the K loop within its deadline naming part 1's counter, stores nothing; the next call works."""
    ws = weights([2048, 2048, 2048], ["cuda:0", D1])
    pipe = Pipeline(ws, loopback=True, config=dataclasses.replace(PIPELINE_CONFIG, wait_parts=2), timeout_s=0.2)
    x = rand(2048, 2048, device="cuda:0")
    plan = pipe.plan(2048)
    link = plan.links[0]
    link.counters[0::2] = torch.as_tensor(link.dep.need[0::2], device=D1)  # epoch 1, part 0 only
    out = torch.full((2048, 2048), float("nan"), dtype=torch.bfloat16, device=D1)
    t0 = time.perf_counter()
    pipe._launch(plan, x, out, only=[1])
    with pytest.raises(
        PipelineTimeout, match=rf"stage 1 on {D1}: CTA \d+ timed out waiting for tile \d+ \(counter \d*[13579] was 0"
    ):
        pipe.check_errors(plan)
    assert time.perf_counter() - t0 < 2.0
    assert out.isnan().all()
    assert torch.equal(pipe(x), sequential_triton(x, ws, pipe))


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_prefill_bitwise(policy):
    """GPU 1 computes the first rows of layer 1 itself, from a copy of x's rows and a replica of
    A, and signals them locally: NaN-poisoned input, full size and ragged, three calls each,
    counters exactly epoch x need, a delayed producer, then replayed from a CUDA graph."""
    ws = weights([8192, 8192, 8192], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, loopback=True, policy=policy, prefill_rows=1024)
    for M in (16384, 3000):
        assert pipe.plan(M).prefill_rows == 1024
        assert_calls_right(pipe, M)
    assert_replays_right(pipe, 16384, 3)


@pytest.mark.gpu2
def test_prefill_runs_while_the_producer_still_runs():
    """The prefill (its copy of x, then its GEMM on GPU 1) does not queue behind the producer
    on GPU 0: with the producer held back ~0.2 s, the prefill's rows of layer 1 land long
    before the producer ends (a copy issued on GPU 0's stage stream would wait for it)."""
    ws = weights([8192, 8192, 8192], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, prefill_rows=1024, timeout_s=5.0)
    M = 4096
    plan = pipe.plan(M)
    x = rand(M, 8192, device="cuda:0")
    expect = (x[:1024] @ ws[0]).to("cuda:1")  # only the timing matters here; bitwise: the tests above
    pipe(x)  # compiled and warm: the launch below returns at once
    plan.inputs[1].fill_(float("nan"))
    torch.cuda.synchronize("cuda:0"), torch.cuda.synchronize("cuda:1")
    pipe._launch(plan, x, torch.empty(M, 8192, dtype=torch.bfloat16, device="cuda:1"), delay_cycles={0: 400_000_000})
    time.sleep(0.05)
    side = torch.cuda.Stream("cuda:1")
    with torch.cuda.stream(side):
        landed = plan.inputs[1][:1024].clone()
    side.synchronize()
    producer_busy = not pipe.streams[0].query()
    pipe.check_errors(plan)
    assert producer_busy, "the producer ended within 0.05 s: the delay did not hold it back"
    assert not landed.isnan().any(), "the prefill's rows had not landed while the producer was held back"
    torch.testing.assert_close(landed.float(), expect.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_drain_bitwise(policy):
    """GPU 0 computes the last rows of both layers itself after its producer (a replica of B),
    writing them into the output on GPU 1, while GPU 1 prefills the first rows: NaN-poisoned
    input and output, full size and ragged, three calls each, counters exactly epoch x need,
    a delayed producer, then replayed from a CUDA graph."""
    ws = weights([8192, 8192, 8192], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, loopback=True, policy=policy, prefill_rows=512, drain_rows=512)
    for M in (16384, 3000):
        assert (pipe.plan(M).prefill_rows, pipe.plan(M).drain_rows) == (512, 512)
        assert_calls_right(pipe, M)
    assert_replays_right(pipe, 16384, 3)


@pytest.mark.gpu2
def test_balanced_ends_bitwise():
    """``ends="balanced"`` sizes both ends per input height (768 + 512 rows at 16384, cut for
    small inputs): NaN-poisoned buffers, three calls each, a delayed producer, then replayed."""
    ws = weights([8192, 8192, 8192], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, loopback=True, ends="balanced")
    for M, ends in ((16384, (768, 512)), (3000, (512, 512)), (640, (0, 512))):
        plan = pipe.plan(M)
        assert (plan.prefill_rows, plan.drain_rows) == ends
        assert_calls_right(pipe, M)
    assert_replays_right(pipe, 16384, 3)


@pytest.mark.gpu2
def test_tune_ends_keeps_the_fastest_candidate():
    """``tune_ends`` times every candidate on this machine, keeps the rule's ends (768 + 512
    rows) unless another is more than 2% faster (its plan is the one later calls use, bitwise
    right), records each median, and refuses a second time (a graph may point at that plan)."""
    ws = weights([8192, 8192, 8192], ["cuda:0", "cuda:1"])
    pipe = Pipeline(ws, loopback=True, ends="balanced")
    rule = pipe.ends_for(16384)
    best = pipe.tune_ends(16384, reps=5)
    medians = pipe.tuning[16384]
    assert set(medians) == set(pipe.end_candidates(16384)) and rule == (768, 512)
    assert best == faster_by(medians, rule, TUNE_MARGIN)
    assert all(1.0 < ms < 10.0 for ms in medians.values())  # a 16384-row chain takes ~3.3 ms here
    plan = pipe.plan(16384)
    assert (plan.prefill_rows, plan.drain_rows) == best == pipe.tuned_ends[16384]
    assert_calls_right(pipe, 16384, delays=(0, 0))
    with pytest.raises(RuntimeError, match="must come before the first call"):
        pipe.tune_ends(16384)
