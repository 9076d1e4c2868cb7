"""The real Triton kernels on the CPU under TRITON_INTERPRET=1 (fp16: the interpreter's
bf16 tl.dot is wrong). Grid programs run one after another there, so stages run in order."""

import dataclasses

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from ctapipelining import deps
from ctapipelining.gemm import matmul, tail_split
from ctapipelining.kernels.gemm import ENDS_CONFIG, GemmConfig, get_configs, tile_of_position
from ctapipelining.pipeline import Pipeline, PipelineTimeout, faster_by

pytestmark = pytest.mark.interpreter

SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=2, num_warps=4)
TOLERANCES = {torch.float16: 2e-3}
SPLIT = dataclasses.replace(SMALL, split_tail=True)  # the interpreter runs 4 CTAs
SPLIT_K = dataclasses.replace(SPLIT, split_k=True)  # fewer tiles than CTAs split too


def rel_err(y, ref):
    return float((y.double() - ref).norm() / ref.norm())


def chain_ref(x, ws):
    y = x.double()
    for w in ws:
        y = y @ w.double()
    return y


@triton.jit
def _positions_kernel(out, num_m, num_n, total, GROUP_M: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.arange(0, BLOCK)
    q = tl.minimum(p, total - 1)  # positions past the grid are masked; keep them valid anyway
    tl.store(out + p, tile_of_position(q, num_m, num_n, GROUP_M), mask=p < total)


@triton.jit
def _activation_kernel(x_ptr, out_ptr, n, FN: tl.constexpr, BLOCK: tl.constexpr):
    p = tl.arange(0, BLOCK)
    tl.store(out_ptr + p, FN(tl.load(x_ptr + p, mask=p < n)), mask=p < n)


def test_the_epilogues_activations_match_torchs():
    """SiLU, GELU's tanh form and tanh as the kernels compute them under the interpreter, over
    [-30, 30] and at the extremes, against float64 (``tests/test_gpu.py`` holds the GPU's
    ``tanh.approx`` to the bound its docstring gives)."""
    from ctapipelining.kernels.epilogue import gelu, silu, tanh

    x = torch.cat([torch.linspace(-30, 30, 1001), torch.tensor([0.0, 1e-3, -1e-3, 88.0, -88.0])])
    refs = {
        silu: torch.nn.functional.silu(x.double()),
        gelu: torch.nn.functional.gelu(x.double(), approximate="tanh"),
        tanh: torch.tanh(x.double()),
    }
    for fn, ref in refs.items():
        out = torch.empty_like(x)
        _activation_kernel[(1,)](x, out, x.numel(), FN=fn, BLOCK=triton.next_power_of_2(x.numel()))
        assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6), fn.__name__
    out = torch.empty(3)
    _activation_kernel[(1,)](torch.tensor([float("inf"), float("nan"), -float("inf")]), out, 3, FN=silu, BLOCK=4)
    assert out[0] == float("inf") and out[1:].isnan().all()  # silu(-inf) = -inf * 0, as torch's


@pytest.mark.parametrize("num_m,num_n,group_m", [(5, 3, 1), (5, 3, 2), (7, 4, 3), (1, 6, 8)])
def test_kernel_tile_order_matches_deps(num_m, num_n, group_m):
    total = num_m * num_n
    out = torch.full((total,), -1, dtype=torch.int32)
    _positions_kernel[(1,)](out, num_m, num_n, total, GROUP_M=group_m, BLOCK=triton.next_power_of_2(total))
    grid = deps.TileGrid(num_m * 4, num_n * 4, 4, 4)
    assert out.tolist() == deps.tile_order(grid, group_m).tolist()


@pytest.mark.parametrize("M,K,N", [(32, 32, 32), (37, 24, 40), (1, 16, 8), (50, 72, 24)])
def test_matmul(M, K, N):
    a, b = torch.randn(M, K).half(), torch.randn(K, N).half()
    out = torch.full((M, N), float("nan"), dtype=torch.float16)
    matmul(a, b, out=out, config=SMALL)
    assert not out.isnan().any()
    assert rel_err(out, a.double() @ b.double()) < TOLERANCES[torch.float16]


# Each policy runs a 3- and a 4-stage chain on M=33 (3 row-blocks, the last of 1 row) and a
# 2-stage one on M=8 (one partial row-block, fewer tiles than CTAs), ordinary and TMA stores
# alternating so that every policy has both, and both heights have both. A 2-stage chain on
# 33 rows is the first link of the longer ones; a 1-stage chain has no link, so the policy
# plays no part in it (once).
@pytest.mark.parametrize(
    "policy,M,dims,padded",
    [
        ("workqueue", 33, [24, 40, 16], True),
        ("workqueue", 33, [16, 24, 32, 8], False),
        ("workqueue", 8, [24, 32], True),
        ("static", 33, [24, 40, 16], False),
        ("static", 33, [16, 24, 32, 8], True),
        ("static", 8, [24, 32], False),
        ("static", 33, [24], True),
    ],
)
def test_pipeline_epochs_poisoned(policy, dims, M, padded):
    """``padded``: the output's rows are 8 elements apart more than its width, so the last
    stage writes them with ordinary stores (else TMA stores)."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in zip([16] + dims, dims)]
    pipe = Pipeline(ws, policy=policy, config=SMALL)
    for epoch in range(1, 3):  # the second epoch runs on grown counters; later ones add nothing
        x = torch.randn(M, 16).half()
        plan = pipe.plan(M)
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        out = torch.full((M, dims[-1] + 8 * padded), float("nan")).half()[:, : dims[-1]]
        y = pipe(x, out=out, check=True)
        assert y is out
        assert not y.isnan().any()
        assert rel_err(y, chain_ref(x, ws)) < TOLERANCES[torch.float16] * len(ws)
        for link in plan.links:
            assert link.counters.tolist() == (epoch * link.dep.need).tolist()
            if policy == "workqueue":
                assert int(link.tail) == epoch * link.dep.consumer.num_tiles


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_in_loop_signal_with_pending_tiles(policy):
    """A producer signals each stored tile a quarter into its next tile's K loop and its last
    tile after the loop: the right chain, epoch after epoch (K of 64 = 4 K-steps: the signal
    lands at step 1 of the CTA's next tile; M=20, 2 row-blocks: CTAs run up to 2 tiles, so a
    signal is left pending to the next one)."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 40), (40, 64), (64, 24)]]
    pipe = Pipeline(ws, policy=policy, config=SMALL)
    for epoch in range(1, 3):
        x = torch.randn(20, 64).half()
        for buf in pipe.plan(20).inputs[1:]:
            buf.fill_(float("nan"))
        y = pipe(x, check=True)
        assert not y.isnan().any()
        assert rel_err(y, chain_ref(x, ws)) < TOLERANCES[torch.float16] * len(ws)
        for link in pipe.plan(20).links:
            assert link.counters.tolist() == (epoch * link.dep.need).tolist()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(block_m=0), "block_m must be an int >= 1"),
        (dict(block_n=48), "block_n must be a power of two"),
        (dict(block_k=4), "block_k must be at least 16"),
        (dict(block_n=8), "block_n must be at least 16"),
        (dict(block_m=8), "block_m must be at least 16"),
        (dict(wait_parts=0), "wait_parts must be an int >= 1"),
        (dict(num_stages=2.0), "num_stages must be an int"),
        (dict(group_m=True), "group_m must be an int"),
        (dict(split_k=1), "split_k must be a bool"),
        (dict(split_tail="yes"), "split_tail must be a bool"),
    ],
)
def test_config_is_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        GemmConfig(**kw)


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_lone_consumer_times_out_and_recovers(policy):
    ws = [torch.randn(16, 32).half(), torch.randn(32, 16).half()]
    pipe = Pipeline(ws, policy=policy, config=SMALL, timeout_s=0.05)
    x = torch.randn(20, 16).half()
    pipe(x)
    plan = pipe.plan(20)
    pipe._launch(plan, x, torch.empty(20, 16).half(), only=[1])
    with pytest.raises(PipelineTimeout, match="stage 1 on cpu: CTA 0 timed out waiting"):
        pipe.check_errors(plan)
    assert plan.epoch == 0 and all(int(e.abs().sum()) == 0 for e in plan.errors)
    y = pipe(x)
    assert rel_err(y, chain_ref(x, ws)) < 2 * TOLERANCES[torch.float16]


def test_a_consumer_takes_nothing_its_producer_left_in_an_earlier_run():
    """After a clean run, a consumer launched alone finds the ring's slots and the counters
    full to the last run's level, one short of this run's: it waits for this run's and times
    out, writes nothing, and (``workqueue``) claims one position per CTA (a slot or counter
    accepted a run early would let it compute from last run's input)."""
    ws = [torch.randn(16, 64).half(), torch.randn(64, 48).half()]
    for policy in ("workqueue", "static"):
        pipe = Pipeline(ws, policy=policy, config=SMALL, timeout_s=0.05, row_buckets=0)
        x = torch.randn(40, 16).half()
        pipe(x, check=True)
        plan = pipe.plan(40)
        link = plan.links[0]
        head = int(link.head.sum())
        out = torch.full((40, 48), float("nan")).half()
        pipe._launch(plan, x, out, only=[1])
        claimed = int(link.head.sum()) - head  # (before the error's reset zeroes the ring)
        with pytest.raises(PipelineTimeout, match="stage 1 on cpu"):
            pipe.check_errors(plan)
        assert out.isnan().all(), policy
        if policy == "workqueue":
            assert claimed == 4  # the interpreter's 4 CTAs, one claim each


def test_a_counter_one_short_of_its_target_is_waited_for():
    """A static consumer whose counter holds one signal fewer than this run needs: it times
    out reporting the counter's value, and writes nothing."""
    ws = [torch.randn(16, 64).half(), torch.randn(64, 48).half()]
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05, row_buckets=0)
    x = torch.randn(40, 16).half()
    plan = pipe.plan(40)
    link = plan.links[0]
    link.counters.copy_(link.need_consumer.to(link.counters.dtype) - 1)  # this run (epoch 1) needs need
    out = torch.full((40, 48), float("nan")).half()
    pipe._launch(plan, x, out, only=[1])
    with pytest.raises(PipelineTimeout, match=r"counter \d+ was \d+"):
        pipe.check_errors(plan)
    assert out.isnan().all()


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_a_consumer_launched_alone_runs_the_epoch_its_producer_ran(policy):
    """The producer launched alone (``only=[0]``: every stage's epoch advances), then the
    consumer with ``advance_epoch=False`` (as the bench times a consumer's prologue): it runs
    the producer's run, whose counters are full, so it writes the chain's result, and the
    epochs stay where the producer's launch left them."""
    torch.manual_seed(3)
    ws = [(torch.randn(32, 48) / 32**0.5).half(), (torch.randn(48, 40) / 48**0.5).half()]
    pipe = Pipeline(ws, policy=policy, config=SMALL, timeout_s=0.1)
    x = torch.randn(40, 32).half()
    pipe(x, check=True)
    plan = pipe.plan(40)
    assert [int(e) for e in plan.epochs] == [1, 1]
    out = torch.full((40, 40), float("nan"), dtype=torch.float16)
    pipe._launch(plan, x, out, only=[0])
    assert [int(e) for e in plan.epochs] == [2, 2] and out.isnan().all()
    pipe._launch(plan, x, out, only=[1], advance_epoch=False)
    pipe.check_errors(plan)
    assert [int(e) for e in plan.epochs] == [2, 2]
    assert torch.equal(out, pipe.sequential(x))


def test_workqueue_head_behind_its_epoch_is_reported_not_read():
    """A call launched without its consumer leaves the ring's head a run behind: the next
    consumer claims positions before its run's first. It must report that (never index the
    ring with them), and the reset makes the following call right."""
    ws = [torch.randn(16, 32).half(), torch.randn(32, 16).half()]
    pipe = Pipeline(ws, policy="workqueue", config=SMALL, timeout_s=0.05)
    x = torch.randn(20, 16).half()
    plan = pipe.plan(20)
    pipe._launch(plan, x, torch.empty(20, 16).half(), only=[0])  # producer alone: head stays behind
    pipe(x)  # errors are asynchronous: this call's surfaces at the next one, before it launches
    with pytest.raises(PipelineTimeout, match="claimed work-queue position -.* head is behind its epoch"):
        pipe(x)
    assert rel_err(pipe(x, check=True), chain_ref(x, ws)) < 2 * TOLERANCES[torch.float16]


def test_a_gpu_older_than_hopper_is_refused_by_name(monkeypatch):
    """``check_arch`` (where every launch is built, and a pipeline's devices at construction):
    an sm_80 GPU is refused, naming it and what the kernels need; sm_90 and later pass; a CPU
    tensor (the interpreter) is not a GPU to check."""
    from ctapipelining import operands

    caps = {0: (8, 0), 1: (9, 0), 2: (10, 0)}
    monkeypatch.setattr(operands, "_capability", lambda i: caps[i])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100")
    with pytest.raises(RuntimeError, match=r"cuda:0 \(NVIDIA A100\) is sm_80; .* need sm_90 or later"):
        operands.check_arch(torch.device("cuda:0"))
    operands.check_arch(torch.device("cuda:1"))
    operands.check_arch(torch.device("cuda:2"))
    operands.check_arch(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    with pytest.raises(RuntimeError, match=r"cuda:0 \(NVIDIA A100\) is sm_80"):  # no index: the current device
        operands.check_arch(torch.device("cuda"))


def test_launches_are_refused_on_a_gpu_older_than_hopper_before_anything_else(monkeypatch):
    """Where a launch is built (a GEMM's, a chain kernel's), an sm_80 device is refused first,
    before any of the launch's own checks or allocations."""
    from ctapipelining import operands
    from ctapipelining.chain import ChainLaunch
    from ctapipelining.gemm import GemmLaunch

    monkeypatch.setattr(operands, "_capability", lambda i: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "NVIDIA A100")
    gpu = torch.device("cuda:0")
    with pytest.raises(RuntimeError, match="is sm_80"):
        GemmLaunch(64, 64, 64, SMALL, 4, gpu)
    with pytest.raises(RuntimeError, match="is sm_80"):
        ChainLaunch(64, [], SMALL, 4, gpu, ticket=None, epoch=None)


def test_the_interpreter_with_a_numpy_it_cannot_run_on_is_refused_by_name(monkeypatch):
    """Triton 3.6's interpreter fails inside every kernel with NumPy 2.4 or later (it converts
    1-element arrays to ints): the library says so, before anything is launched."""
    from ctapipelining import operands

    a, b = torch.randn(16, 32).half(), torch.randn(32, 16).half()
    monkeypatch.setattr(operands, "_NUMPY_REFUSED", True)
    with pytest.raises(RuntimeError, match=r"cannot run the kernels with NumPy .*install 'numpy<2.4'"):
        matmul(a, b)
    with pytest.raises(RuntimeError, match="install 'numpy<2.4'"):
        Pipeline([a, b])
    monkeypatch.setattr(operands, "_NUMPY_REFUSED", False)
    assert torch.allclose(matmul(a, b, config=SMALL).float(), a.float() @ b.float(), atol=1e-2, rtol=1e-2)


def test_bad_inputs_raise_before_launch():
    a, b = torch.randn(16, 32).half(), torch.randn(32, 16).half()
    with pytest.raises(ValueError, match="stage 1 weight is"):
        Pipeline([a, torch.randn(24, 16).half()])
    with pytest.raises(TypeError, match="float32"):
        Pipeline([a.float(), b.float()])
    with pytest.raises(TypeError, match="stage 1 weight is bfloat16, which Triton's CPU interpreter"):
        Pipeline([a, b.bfloat16()])
    with pytest.raises(ValueError, match="16 bytes"):
        Pipeline([torch.randn(16, 12).half()])
    with pytest.raises(ValueError, match="non-empty"):
        Pipeline([])
    with pytest.raises(ValueError, match="policy"):
        Pipeline([a, b], policy="fifo")
    pipe = Pipeline([a, b], config=SMALL)
    with pytest.raises(TypeError, match="float32"):
        pipe(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x is \(8, 24\)"):
        pipe(torch.randn(8, 24).half())
    with pytest.raises(ValueError, match="2-D"):
        pipe(torch.randn(8).half())
    nested = torch.nested.nested_tensor([torch.randn(16).half()] * 8)  # 2-D, strided, one "row" each
    for bad in (torch.randn(8, 16).half().to_sparse(), torch.randn(8, 16).half().to_sparse_csr(), nested):
        with pytest.raises(TypeError, match="dense"):
            pipe(bad)
        with pytest.raises(TypeError, match="dense"):
            pipe(torch.randn(8, 16).half(), out=bad)
        with pytest.raises(TypeError, match="dense"):
            matmul(bad, torch.randn(16, 16).half())
        with pytest.raises(TypeError, match="dense"):
            matmul(torch.randn(8, 16).half(), torch.randn(16, 16).half(), out=bad)
    with pytest.raises(ValueError, match="out must be"):
        pipe(torch.randn(8, 16).half(), out=torch.empty(8, 17).half())
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul(a, a)
    with pytest.raises(RuntimeError, match="CUDA devices"):
        pipe.capture(8)
    assert pipe._plans == {}  # nothing was built or launched for the bad calls


def test_graphed_call_refuses_an_input_it_was_not_captured_for():
    """The input checks of ``GraphedCall`` (its graph needs CUDA; the checks run before it)."""
    from ctapipelining.pipeline import GraphedCall

    a, b = torch.randn(16, 32).half(), torch.randn(32, 16).half()
    pipe = Pipeline([a, b], config=SMALL)
    graphed = GraphedCall(pipe, plan=None, graph=None, x=torch.zeros(8, 16).half(), out=torch.zeros(8, 16).half())
    assert repr(graphed) == "GraphedCall(x=[8, 16] -> out=[8, 16], torch.float16, on cpu, cpu)"
    with pytest.raises(ValueError, match=r"captured for x \(8, 16\) torch.float16, got torch.Size\(\[9, 16\]\)"):
        graphed(torch.zeros(9, 16).half())
    with pytest.raises(ValueError, match="captured for x"):
        graphed(torch.zeros(8, 16))
    with pytest.raises(ValueError, match="captured for x"):
        graphed([[0.0] * 16] * 8)
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="x is on cuda:0"):
            graphed(torch.zeros(8, 16, device="cuda:0").half())


def test_configs_fit_shared_memory():
    assert get_configs() and all(c.smem_bytes() <= 227 * 1024 for c in get_configs())
    assert np.all([c.block_m % 16 == 0 for c in get_configs()])


@pytest.mark.parametrize("table", ["gemm_configs.json", "pipeline_configs.json"])
def test_the_config_table_is_what_its_results_measured(table):
    """Every row of a packaged table (the plain GEMM's, a pipeline's per plan height) is a valid
    configuration that fits shared memory and is the fastest candidate its results folder
    recorded at that row count (not edited by hand), on the GPU the row names."""
    import json
    from pathlib import Path

    from ctapipelining.gemm import config_table
    from ctapipelining.tables import GEMM_TABLE, PIPELINE_TABLE, cublas_faster

    assert table in (GEMM_TABLE, PIPELINE_TABLE)
    root = Path(__file__).parent.parent
    packaged = json.loads((root / "ctapipelining" / "data" / table).read_text())
    rows, over = packaged["rows"], "over_cublas" if table == GEMM_TABLE else "over_floor"
    assert rows and [r for r, _ in config_table(table)] == sorted(r["M"] for r in rows)
    for row in rows:
        cfg = GemmConfig(**row["config"])
        assert cfg.smem_bytes() <= 227 * 1024
        measured = json.loads((root / row["results"] / "configs.json").read_text())
        assert (measured["N"], measured["K"]) == (packaged["measured"]["N"], packaged["measured"]["K"]), row["M"]
        best = measured["rows"][str(row["M"])]["best"]
        assert measured["candidates"][best] == row["config"], (row["M"], best)
        assert row["device"] == measured["environment"]["gpus"][0], row["M"]
        label = "cublas" if table == GEMM_TABLE else "floor"
        assert row[over] == round(measured["rows"][str(row["M"])][f"{best}/{label}"]["median"], 3), row["M"]
        if table == GEMM_TABLE:  # whether cuBLAS runs in our place: what the same measurement says
            assert row["cublas"] == cublas_faster(measured["rows"][str(row["M"])][f"{best}/cublas"]), row["M"]
        else:
            assert "cublas" not in row


def test_cublas_faster_needs_the_whole_interval_above_the_margin():
    from ctapipelining.tables import CUBLAS_MARGIN, cublas_faster

    assert cublas_faster({"median": 1.11, "ci95": [1.10, 1.13]})
    assert not cublas_faster({"median": 1.075, "ci95": [0.93, 1.11]})  # a wide interval: not shown
    assert not cublas_faster({"median": 1.03, "ci95": [1 + CUBLAS_MARGIN, 1.05]})  # at the margin: ours


def test_only_cuda_tensors_take_a_bound_launch():
    """``bindable`` (what a bound launch may skip the checks for) refuses whatever is not a CUDA
    tensor; its type and layout tests run on a GPU (``test_gpu.py``)."""
    from ctapipelining.operands import bindable

    meta = torch.empty(8, 8, device="meta")
    assert not bindable(torch.empty(8, 8)) and not bindable(torch.nn.Parameter(torch.empty(8, 8)))
    assert not bindable(meta) and not bindable(torch.nn.Parameter(meta))
    assert not bindable(None) and not bindable(3)


def test_mm_into_runs_as_a_launch_of_ours():
    """``mm_into`` (a stage's cuBLAS GEMM): no autograd graph from weights that require grad, no
    autocast, an ``out`` made under inference mode written; an ``out`` with padded rows or an
    address off the alignment a fresh tensor has takes the product through a fresh tensor, so
    every ``out`` holds the bits of ``torch.mm`` into a new tensor, and padding stays."""
    from ctapipelining.serial import CUBLAS_OUT_ALIGN, mm_into

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(40, 32, generator=g), torch.nn.Parameter(torch.randn(32, 24, generator=g))
    want = torch.mm(a, b.detach())
    y = mm_into(a, b)
    assert y.grad_fn is None and not y.requires_grad and torch.equal(y, want)
    with torch.inference_mode():
        made = torch.empty(40, 24)
    assert mm_into(a, b, made) is made and torch.equal(made, want)
    full = torch.full((40, 24 + 8), float("nan"))
    assert torch.equal(mm_into(a, b, full[:, :24]), want) and full[:, 24:].isnan().all()
    flat = torch.full((40 * 24 + 1,), float("nan"))
    off = flat[1:].view(40, 24)  # 4 bytes past an aligned address
    assert off.data_ptr() % CUBLAS_OUT_ALIGN and torch.equal(mm_into(a, b, off), want)
    with torch.autocast("cpu"):
        assert mm_into(a, b).dtype == torch.float32


def test_stages_one_after_another_run_cublas_at_the_tables_row_counts(monkeypatch):
    """runs_cublas follows the plain GEMM's table as plain_config does (the row of the smallest
    tabled row count at or above M), and never under the interpreter."""
    from ctapipelining import serial
    from ctapipelining.tables import GEMM_TABLE, table_flags

    assert not any(serial.runs_cublas(m) for m in (1, 200, 640, 768, 10**6))  # the interpreter
    monkeypatch.setattr(serial, "interpreting", lambda: False)
    flags = table_flags(GEMM_TABLE, "cublas")
    assert any(f for _, f in flags) and not all(f for _, f in flags)
    for (lo, _), (hi, flag) in zip(flags, flags[1:]):
        assert serial.runs_cublas(lo + 1) == serial.runs_cublas(hi) == flag
    assert serial.runs_cublas(flags[0][0]) == flags[0][1] and serial.runs_cublas(10**6) == flags[-1][1]
    assert serial.runs_cublas(640) and serial.runs_cublas(768) and not serial.runs_cublas(1024)


def test_plain_config_takes_the_smallest_tabled_row_count_at_or_above():
    from ctapipelining.gemm import PLAIN_CONFIG, config_table, pick_config, plain_config

    table = config_table()
    (first_m, first), (last_m, last) = table[0], table[-1]
    assert pick_config(table, 1) == pick_config(table, first_m) == first
    for (lo, _), (hi, cfg) in zip(table, table[1:]):
        assert pick_config(table, lo + 1) == pick_config(table, hi) == cfg
    assert pick_config(table, last_m + 1) == pick_config(table, 10**9) == last
    assert pick_config(table, 100).block_m == 64 and last.block_n == 256  # narrow tiles for few rows
    assert plain_config(100) == PLAIN_CONFIG  # the interpreter's sizes are small: one configuration


@pytest.mark.parametrize("split", [False, True])
def test_matmul_on_the_tables_narrow_tiles(split):
    """The few-rows configuration (64 x 128 tiles, K-steps of 128, 4 warps), split tail or not,
    on shapes that divide none of its tiles."""
    from ctapipelining.gemm import config_table

    cfg = dataclasses.replace(config_table()[0][1], split_tail=split)
    assert cfg.block_m == 64
    a, b = torch.randn(70, 328).half(), (torch.randn(328, 136) * 328**-0.5).half()
    out = torch.full((70, 136), float("nan"), dtype=torch.float16)
    matmul(a, b, out=out, config=cfg)
    assert not out.isnan().any()
    assert (out.float() - a.float() @ b.float()).abs().max() < 2e-2


@pytest.mark.parametrize("M,K,N", [(48, 64, 32), (37, 80, 40)], ids=["2x2", "1x4"])
def test_split_tail_matmul(M, K, N):
    """The tail in whole slices (2 tiles x 2, 1 x 4): every tile written, near float64, bitwise
    repeatable."""
    split = tail_split(M, N, K, SPLIT, 4)
    assert split is not None and split.items == 4
    a, b = torch.randn(M, K).half(), torch.randn(K, N).half()
    out = torch.full((M, N), float("nan"), dtype=torch.float16)
    matmul(a, b, out=out, config=SPLIT)
    assert not out.isnan().any()
    assert rel_err(out, a.double() @ b.double()) < TOLERANCES[torch.float16]
    assert torch.equal(matmul(a, b, config=SPLIT), out)  # partials summed in a fixed order


def test_a_lone_partial_round_is_split_whole_on_a_cta_per_slice():
    """Fewer tiles than CTAs (2 on the interpreter's 4) are one partial round: with ``split_k``
    every tile runs as K-slices, a CTA each (split-K), into a NaN-poisoned output wholly
    written, near float64, bitwise repeatable, the arrival counters back at zero; a split tail
    alone leaves such a round whole. A one-stage pipeline in that configuration runs the same
    split: bitwise ``matmul``."""
    from ctapipelining import gemm

    cpu = torch.device("cpu")
    M, K, N = 16, 64, 32  # 2 tiles, 4 K-steps: 2 slices a tile
    assert gemm.grid_size(M, N, K, SPLIT_K, cpu) == 4 and gemm.grid_size(M, N, K, SPLIT, cpu) == 2
    assert gemm.plain_launch(M, N, K, SPLIT, cpu, 0, None, 0).tail is None
    launch = gemm.plain_launch(M, N, K, SPLIT_K, cpu, 0, None, 0)
    assert launch.num_ctas == 4 and launch.tail.split == deps.TailSplit(0, 2, 2)
    torch.manual_seed(0)
    a, b = torch.randn(M, K).half(), (torch.randn(K, N) * K**-0.5).half()
    out = torch.full((M, N), float("nan"), dtype=torch.float16)
    matmul(a, b, out=out, config=SPLIT_K)
    assert not out.isnan().any()
    assert rel_err(out, a.double() @ b.double()) < TOLERANCES[torch.float16]
    assert torch.equal(matmul(a, b, config=SPLIT_K), out)
    assert int(launch.tail.counters.abs().sum()) == 0
    pipe = Pipeline([b], config=SPLIT_K, always_pipelined=True)
    stage = pipe.plan(M).launches[0].gemm
    assert stage.num_ctas == 4 and stage.tail.split == deps.TailSplit(0, 2, 2)
    assert torch.equal(pipe(a), out)


@pytest.mark.parametrize("policy,parts", [("static", 1), ("static", 2), ("workqueue", 1)])
def test_a_consumer_of_few_tiles_splits_them_whole_and_waits_for_each_tiles_rows(policy, parts):
    """Two stages of 2 tiles each with ``split_k``: the producer and a static consumer (whose
    slices wait for every part of their tile's rows) each on a CTA per slice; a workqueue
    consumer runs whole tiles in readiness order. Three epochs bitwise the stages one after
    another, the arrival counters back at zero."""
    torch.manual_seed(0)
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 32), (32, 32)]]
    pipe = Pipeline(ws, policy=policy, config=dataclasses.replace(SPLIT_K, wait_parts=parts))
    plan = pipe.plan(16)
    producer, consumer = (launch.gemm for launch in plan.launches)
    assert producer.num_ctas == 4 and producer.tail.split == deps.TailSplit(0, 2, 2)
    if policy == "static":
        assert consumer.num_ctas == 4 and consumer.tail.split == deps.TailSplit(0, 2, 2)
    else:
        assert consumer.num_ctas == 2 and consumer.tail is None
    assert_epochs_right(pipe, 16, epochs=3)
    assert all(int(t.counters.abs().sum()) == 0 for t in plan.tails if t is not None)


def test_a_consumer_of_few_tiles_split_whole_times_out_cleanly():
    """A split-K consumer whose producer never runs: it times out naming its stage, its arrival
    counters (left part-filled) are zeroed with the plan's state, and the next calls are right."""
    torch.manual_seed(0)
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 32), (32, 32)]]
    pipe = Pipeline(ws, config=dataclasses.replace(SPLIT_K, wait_parts=2), timeout_s=0.05)
    plan = pipe.plan(16)
    assert plan.tails[1] is not None and plan.tails[1].split.first_pos == 0
    pipe._launch(plan, torch.randn(16, 64).half(), torch.empty(16, 32).half(), only=[1])
    plan.tails[1].counters.fill_(1)
    with pytest.raises(PipelineTimeout, match="stage 1 on cpu"):
        pipe.check_errors(plan)
    assert int(plan.tails[1].counters.abs().sum()) == 0
    for _ in range(2):
        x = torch.randn(16, 64).half()
        assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_split_k_alone_leaves_a_partial_round_after_full_ones_whole():
    """``split_k`` without ``split_tail``: a lone partial round splits, one after full rounds
    does not (that is ``split_tail``'s)."""
    from ctapipelining import gemm

    cfg, cpu = dataclasses.replace(SMALL, split_k=True), torch.device("cpu")
    assert gemm.plain_launch(16, 32, 64, cfg, cpu, 0, None, 0).tail is not None  # 2 tiles on 4 CTAs
    assert gemm.plain_launch(16, 80, 64, cfg, cpu, 0, None, 0).tail is None  # 5 tiles on 4: 1 left
    assert gemm.plain_launch(16, 80, 64, dataclasses.replace(cfg, split_tail=True), cpu, 0, None, 0).tail is not None


def test_a_prefill_runs_in_its_own_configuration_as_its_sequential_gemm_does():
    """The prefill (stage 0's rows on stage 1's GPU) runs stage 0's configuration: its grid, and
    so whether its few tiles split, follow that configuration, as the sequential GEMMs' do,
    where the stages' tiles differ."""
    torch.manual_seed(0)
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(128, 32), (32, 16)]]
    c0, c1 = dataclasses.replace(SPLIT_K, block_n=32), SMALL
    pipe = Pipeline(ws, config=[c0, c1], prefill_rows=16)
    (prefill,) = [launch.gemm for launch in pipe.plan(48).launches if launch.stream == 1 and not launch.stages]
    assert prefill.num_ctas == 4 and prefill.tail.split == deps.TailSplit(0, 1, 4)  # c0's: 1 tile, 8 K-steps
    for _ in range(3):
        x = torch.randn(48, 128).half()
        assert torch.equal(pipe(x), pipe.sequential(x))


def test_plain_launches_on_one_stream_share_its_split_tail_buffers():
    """Plain launches on one stream share its split-tail buffers (launches there run one after
    another, and each rearms its arrival counters): calls of three shapes, alternated, stay
    right and bitwise repeatable; a larger tail grows the buffers while a launch bound before
    keeps its own; a launch bound for a CUDA-graph capture has buffers of its own."""
    from ctapipelining import gemm

    gemm.plain_launch.cache_clear()
    gemm._STREAM_TAILS.clear()
    cpu = torch.device("cpu")
    shapes = [(40, 48, 48), (48, 64, 32), (37, 80, 40)]  # tails of 1 x 3, 2 x 2 and 1 x 4 slices
    first = {}
    for M, K, N in shapes:
        a, b = torch.randn(M, K).half(), (torch.randn(K, N) * K**-0.5).half()
        first[M] = (a, b, matmul(a, b, config=SPLIT))
    launches = [gemm.plain_launch(M, N, K, SPLIT, cpu, 0, None, 0) for M, K, N in shapes]
    small, grown, shared = (lc.tail.shared for lc in launches)
    assert small is not None and grown is not small and shared is grown
    assert small.workspace.numel() == 3 * 16 * 16 and grown.counters.numel() == 2
    for _ in range(2):
        for M, _K, N in shapes + shapes[::-1]:
            a, b, y = first[M]
            out = torch.full((M, N), float("nan"), dtype=torch.float16)
            matmul(a, b, out=out, config=SPLIT)
            assert torch.equal(out, y)
            assert rel_err(out, a.double() @ b.double()) < TOLERANCES[torch.float16]
            assert int(small.counters.abs().sum()) == int(grown.counters.abs().sum()) == 0
    captured = gemm.plain_launch(48, 32, 64, SPLIT, cpu, 0, None, gemm._CAPTURE_OWNER.get())
    assert captured.tail.shared is None and captured.tail.workspace.data_ptr() not in (
        small.workspace.data_ptr(),
        grown.workspace.data_ptr(),
    )


def test_a_launch_refuses_another_stream_and_a_stopped_kernel_leaves_no_count(monkeypatch):
    """A launch bound to a stream's buffers refuses a call on another stream before launching;
    an interpreted kernel stopped midway (here: made to raise after counting) leaves the
    stream's shared arrival counters at zero for the next launch."""
    from ctapipelining import gemm

    cpu = torch.device("cpu")
    a, b, c = torch.randn(16, 32).half(), torch.randn(32, 48).half(), torch.empty(16, 48).half()
    with pytest.raises(ValueError, match="buffers are CUDA stream 5's; called on 6"):
        gemm.GemmLaunch(16, 48, 32, SMALL, 4, cpu, stream=5)(a, b, c, 6)

    def stopped(self, *args, **kw):
        self.tail.counters.fill_(1)
        raise RuntimeError("stopped midway")

    a, b = torch.randn(48, 64).half(), torch.randn(64, 32).half()
    matmul(a, b, config=SPLIT)  # binds the launch (a split tail of 2 x 2 slices)
    counters = gemm.plain_launch(48, 32, 64, SPLIT, cpu, 0, None, 0).tail.counters
    monkeypatch.setattr(gemm.GemmLaunch, "__call__", stopped)
    with pytest.raises(RuntimeError, match="stopped midway"):
        matmul(a, b, config=SPLIT)
    assert int(counters.abs().sum()) == 0


def test_a_given_split_tail_and_its_buffers_are_checked():
    """A split that is not the partial round of this grid (another first tile: tiles left
    unwritten), more slices than CTAs, more slices a tile than K-steps (empty slices: work for
    nothing), or buffers of another size than the split's slices and tiles, are refused before
    anything is launched."""
    from ctapipelining.gemm import GemmLaunch, TailBuffers

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="more slices a tile than its 2 K-steps"):  # 1 tile of 2 K-steps in 3 slices
        GemmLaunch(16, 16, 32, SPLIT, 8, cpu, split=deps.TailSplit(0, 1, 3))
    with pytest.raises(ValueError, match="6 slices for 4 CTAs"):  # 3 tiles on 4 CTAs: 6 slices
        GemmLaunch(16, 48, 32, SPLIT, 4, cpu, split=deps.TailSplit(0, 3, 2))
    split = deps.TailSplit(0, 3, 2)  # 3 tiles of 2 K-steps, 2 slices each, on 8 CTAs
    good = TailBuffers.create(split, SMALL, cpu)
    assert tuple(good.workspace.shape) == (6, 16 * 16)
    GemmLaunch(16, 48, 32, SPLIT, 8, cpu, split=split, tail=good)
    with pytest.raises(ValueError, match="are not the last"):  # its tile is the middle one of 3, not the last
        GemmLaunch(16, 48, 32, SPLIT, 8, cpu, split=deps.TailSplit(1, 1, 2))
    small = TailBuffers(split, good.workspace[:4], good.counters)
    with pytest.raises(ValueError, match=r"must be fp32 \[6, 256\]"):
        GemmLaunch(16, 48, 32, SPLIT, 8, cpu, split=split, tail=small)
    for counters in (good.counters[:2], good.counters.long()):
        with pytest.raises(ValueError, match=r"and int32 \[3\]"):
            GemmLaunch(16, 48, 32, SPLIT, 8, cpu, split=split, tail=TailBuffers(split, good.workspace, counters))


def test_each_slice_s_partial_has_a_workspace_slot_of_its_own():
    """After a launch, workspace slot ``i`` holds slice ``i``'s fp32 partial tile (its rows and
    columns over its K-steps), so no two slices share a slot (a shared slot would be
    overwritten before the tile is summed, whatever order the CTAs run in)."""
    from ctapipelining import gemm

    M, K, N = 48, 64, 32  # 3 x 2 tiles of 16 x 16 on 4 CTAs: 2 tail tiles in 2 slices of 2 K-steps
    a, b = torch.randn(M, K).half(), (torch.randn(K, N) / K**0.5).half()
    matmul(a, b, config=SPLIT)
    launch = gemm.plain_launch(M, N, K, SPLIT, torch.device("cpu"), 0, None, 0)
    split, bm, bn, bk = launch.tail.split, SPLIT.block_m, SPLIT.block_n, SPLIT.block_k
    assert split.items == 4
    num_m, num_n = -(-M // bm), -(-N // bn)
    for i in range(split.items):
        pos, k0, k1 = split.slice_of(i, -(-K // bk))
        tile = deps.grouped_tile(pos, num_m, num_n, SPLIT.group_m)
        pm, pn = divmod(tile, num_n)
        rows, cols, ks = slice(pm * bm, (pm + 1) * bm), slice(pn * bn, (pn + 1) * bn), slice(k0 * bk, k1 * bk)
        want = a[rows, ks].float() @ b[ks, cols].float()  # (the tiles divide the shape: no padding)
        got = launch.tail.workspace[i].view(bm, bn)
        assert (got - want).abs().max() < 1e-2, i


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_split_tail_pipeline_matches_sequential(policy, padded):
    """Producers split their tails under both policies, a static consumer too (a workqueue
    consumer runs whole tiles in readiness order); arrival counters are rearmed every run.
    M=20: 2 row-blocks; stages 0 and 2 have 2 x 3 tiles on 4 CTAs, a 2-tile tail (K=64: 2
    slices)."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 48), (48, 64), (64, 48)]]
    pipe = Pipeline(ws, policy=policy, config=SPLIT)
    plan = pipe.plan(20)
    assert plan.tails[0] is not None and plan.tails[1] is None  # stage 1: 8 tiles on 4 CTAs, no tail
    assert (plan.tails[2] is None) == (policy == "workqueue") == (not pipe.stage_config(2).split_tail)
    for _ in range(2):  # the second run finds the arrival counters rearmed by the first
        x = torch.randn(20, 64).half()
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        y = pipe(x, out=torch.empty(20, 48 + 8 * padded).half()[:, :48], check=True)
        assert torch.equal(y, pipe.sequential(x))
        assert all(int(t.counters.abs().sum()) == 0 for t in plan.tails if t is not None)


def test_split_tail_consumer_times_out_and_recovers():
    ws = [torch.randn(16, 64).half(), (torch.randn(64, 32) / 8).half()]
    pipe = Pipeline(ws, policy="static", config=SPLIT, timeout_s=0.05)
    x = torch.randn(48, 16).half()
    plan = pipe.plan(48)
    assert plan.tails[1] is not None and any(t is plan.tails[1].counters for t in plan.state())
    pipe._launch(plan, x, torch.empty(48, 32).half(), only=[1])
    # the interpreter's CTAs time out one after another, each before its slice, so none
    # arrives; on a GPU some slices of a tile may have arrived before another timed out
    plan.tails[1].counters.fill_(1)
    with pytest.raises(PipelineTimeout, match="stage 1 on cpu"):
        pipe.check_errors(plan)
    assert int(plan.tails[1].counters.abs().sum()) == 0  # the reset rearms them
    y = pipe(x)
    assert torch.equal(y, matmul(matmul(x, ws[0], config=SPLIT), ws[1], config=SPLIT))


PARTS = SMALL


def assert_epochs_right(pipe, M, epochs=2):
    """``epochs`` calls on fresh inputs with NaN-poisoned buffers: each bitwise the sequential
    GEMMs (and near the float64 chain), every counter epoch x need, the ring's tail epoch x T.
    Two: the second runs on the counters the first grew (a third would run the same code)."""
    plan, ws = pipe.plan(M), pipe.weights
    for epoch in range(1, epochs + 1):
        x = torch.randn(M, ws[0].shape[0]).half()
        for buf in plan.inputs[1:]:
            buf.fill_(float("nan"))
        y = pipe(x, check=True)
        assert torch.equal(y, pipe.sequential(x))
        assert rel_err(y, chain_ref(x, ws)) < TOLERANCES[torch.float16] * len(ws)
        for link in plan.links:
            assert link.counters.tolist() == (epoch * link.dep.need).tolist()
            if pipe.policy.uses_queue:
                assert int(link.tail) == epoch * link.dep.consumer.num_tiles


# 4 parts (waits at K-steps 0, 2, 4; capped at 3 for K=40) without a split tail, 8 parts (one
# per producer column-block) with one, whose slices wait for every part before they start.
# wait_parts=2 ran nothing more: its in-loop wait at K-step 2 is one of 4 parts' waits, and its
# 2 parts of K=40, both waited for before the tile, are like the prefill test's stage 2 (2 parts
# of K=24, both waited for before the tile).
@pytest.mark.parametrize("wait_parts,split", [(4, False), (16, True)])
def test_wait_in_parts_matches_sequential(wait_parts, split):
    """A static consumer that waits for its input rows part by part inside its K loop gives
    bitwise the sequential chain, epoch after epoch, with every part's counter full. K=128 in
    steps of 16 with a 2-deep pipeline: parts start at K-steps 2, 4, 6, ... and are waited for
    2 steps earlier (the first part after the first step before the tile); K=40 has 3
    producer column-blocks, so its parts are capped at 3 and the later ones are waited for
    before the tile; the middle stage both waits in parts and signals. M=20: 2 row-blocks, the
    middle stage's 6 tiles leave a 2-tile tail on 4 CTAs (split in 2 when ``split``)."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(32, 128), (128, 40), (40, 24)]]
    cfg = dataclasses.replace(SPLIT if split else PARTS, wait_parts=wait_parts)
    pipe = Pipeline(ws, policy="static", config=cfg)
    plan = pipe.plan(20)
    assert [lk.dep.parts for lk in plan.links] == [min(wait_parts, 8), min(wait_parts, 3)]
    assert (plan.tails[1] is not None) == split
    assert_epochs_right(pipe, 20)


@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul")  # the K loop runs on over unwritten rows
def test_a_missing_later_part_times_out_inside_the_k_loop_and_recovers():
    """Part 0 of every row-block is there, part 1 never comes: the consumer starts its tiles,
    waits inside the K loop, records part 1's counter, stores nothing, and the next call works."""
    ws = [(torch.randn(16, 128) / 4).half(), (torch.randn(128, 16) / 11).half()]
    pipe = Pipeline(ws, config=dataclasses.replace(PARTS, wait_parts=2), timeout_s=0.05)
    x = torch.randn(20, 16).half()
    plan = pipe.plan(20)
    link = plan.links[0]
    out = torch.full((20, 16), float("nan")).half()
    link.counters[0::2] = torch.as_tensor(link.dep.need[0::2])  # epoch 1: part 0 of each row-block full
    pipe._launch(plan, x, out, only=[1])
    with pytest.raises(
        PipelineTimeout, match=r"stage 1 on cpu: CTA \d timed out waiting for tile \d+ \(counter 1 was 0"
    ):
        pipe.check_errors(plan)
    assert out.isnan().all()  # no tile whose part timed out was stored
    assert torch.equal(pipe(x), pipe.sequential(x))


def test_wait_in_parts_is_checked():
    with pytest.raises(ValueError, match="wait_parts must be an int >= 1"):
        GemmConfig(wait_parts=0)
    ws = [torch.randn(16, 64).half(), torch.randn(64, 16).half()]
    cfg = dataclasses.replace(SMALL, wait_parts=2)
    assert Pipeline(ws, config=cfg).plan(8).links[0].dep.parts == 2
    wq = Pipeline(ws, policy="workqueue", config=cfg)  # runs whole tiles once ready: one part
    assert wq.plan(8).links[0].dep.parts == 1
    x = torch.randn(8, 16).half()
    assert torch.equal(wq(x), wq.sequential(x))


# A workqueue pipeline gives its consumers one part whatever wait_parts says (asserted in
# test_wait_in_parts_is_checked), so parts=4 under workqueue ran parts=1's kernels again. A
# static consumer waiting for whole row-blocks (parts=1) with a prefill: the ends="balanced"
# tests (split tails) and test_prefill_leaves_the_producer_a_row_block_and_is_checked. A
# workqueue prefill without split tails: test_drain_matches_sequential[workqueue-False-16].
@pytest.mark.parametrize("policy,split,parts", [("workqueue", True, 1), ("static", False, 4), ("static", True, 4)])
def test_prefill_matches_sequential(policy, split, parts):
    """Stage 1 computes the first rows of stage 0 itself (a copy of x's rows, a replica of
    W_0) and both GEMMs signal the same counters: NaN-poisoned buffers, two epochs, every
    counter epoch x need, bitwise the sequential GEMMs split the same way; a 3-stage chain."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 80), (80, 24), (24, 16)]]
    cfg = dataclasses.replace(SPLIT if split else PARTS, wait_parts=parts)
    pipe = Pipeline(ws, policy=policy, config=cfg, prefill_rows=16)
    plan = pipe.plan(33)
    assert plan.prefill_rows == 16 and plan.prefill_x.shape == (16, 64)
    # 4 parts of the producer's 5 column-blocks, capped at stage 1's 2 (static)
    assert [lk.dep.parts for lk in plan.links] == [min(parts, 5), min(parts, 2)]
    # the prefill 1 x 5 tiles and the producer (rows 16-33) 2 x 5 on 4 CTAs: both split a tail
    (prefill,) = plan.ends(1)
    assert (prefill.tail is not None) == (plan.tails[0] is not None) == split
    assert_epochs_right(pipe, 33)
    assert all(int(t.counters.abs().sum()) == 0 for t in plan.tails if t is not None)


def test_a_call_records_no_autograd_graph():
    """Inference only: with the weights and ``x`` requiring grad, a call with prefill and drain
    rows (their replicas of the weights and the copy of ``x``'s rows are the pipeline's own
    buffers) returns an output without a ``grad_fn`` and leaves none on those buffers, also
    after a weight changed in place (its replica copied again) and on a call with ``out``."""
    torch.manual_seed(0)
    ws = [(torch.randn(16, 32) / 4).half().requires_grad_(), (torch.randn(32, 16) / 6).half().requires_grad_()]
    pipe = Pipeline(ws, config=SMALL, prefill_rows=16, drain_rows=16)
    x = torch.randn(48, 16).half().requires_grad_()
    y = pipe(x)
    buffers = [pipe.prefill_weight, pipe.drain_weight, pipe.plan(48).prefill_x]
    assert not y.requires_grad and all(not t.requires_grad and t.grad_fn is None for t in buffers)
    with torch.no_grad():
        ws[0].mul_(2)  # its replica is refreshed at the next call
    out = torch.full((48, 16), float("nan")).half()
    assert pipe(x, out=out) is out and not out.requires_grad
    assert all(not t.requires_grad for t in buffers)
    with torch.no_grad():
        assert torch.equal(out, pipe.sequential(x)) and torch.equal(pipe.prefill_weight, ws[0])


def test_prefill_leaves_the_producer_a_row_block_and_is_checked():
    ws = [torch.randn(16, 32).half(), torch.randn(32, 16).half()]
    pipe = Pipeline(ws, config=SMALL, prefill_rows=64)
    assert [pipe.plan(M).prefill_rows for M in (100, 64, 20, 16, 8)] == [64, 48, 16, 0, 0]
    x = torch.randn(20, 16).half()
    assert torch.equal(pipe(x), pipe.sequential(x))
    with pytest.raises(ValueError, match="multiple of block_m=16"):
        Pipeline(ws, config=SMALL, prefill_rows=24)
    with pytest.raises(ValueError, match="second stage"):
        Pipeline(ws[:1], config=SMALL, prefill_rows=16)
    with pytest.raises(ValueError, match="trace mode"):
        Pipeline(ws, config=SMALL, prefill_rows=16, trace=True)


def test_prefilled_consumer_without_producer_times_out_past_the_prefill():
    """The consumer launched alone still gets its prefilled rows (the prefill is launched with
    it), then times out on the first row-block the producer owns; the next call is right."""
    ws = [torch.randn(16, 32).half(), torch.randn(32, 16).half()]
    pipe = Pipeline(ws, config=SMALL, timeout_s=0.05, prefill_rows=16)
    x = torch.randn(40, 16).half()
    plan = pipe.plan(40)
    pipe._launch(plan, x, torch.empty(40, 16).half(), only=[1])
    with pytest.raises(
        PipelineTimeout, match=r"stage 1 on cpu: CTA \d timed out waiting for tile \d+ \(counter [12] was 0"
    ):
        pipe.check_errors(plan)
    assert torch.equal(pipe(x), pipe.sequential(x))


# workqueue: one case with a prefill, the other with split tails; static: both (its consumer
# waits in parts, and its split tail waits for every part). A static drain without split tails,
# with and without a prefill: test_drain_leaves_the_pipeline_a_row_block_and_is_checked; static
# split drains with a prefill: the ends="balanced" tests.
@pytest.mark.parametrize(
    "policy,split,prefill", [("workqueue", False, 16), ("workqueue", True, 0), ("static", True, 16)]
)
def test_drain_matches_sequential(policy, split, prefill):
    """Stage 0's device computes the last rows of both layers itself (a replica of W_1) after
    its producer, and the consumer runs only the rows before them: NaN-poisoned buffers, two
    epochs, every counter epoch x need over the pipelined rows only, bitwise the sequential
    GEMMs cut the same way, with and without a prefill at the other end."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 80), (80, 40)]]
    cfg = dataclasses.replace(SPLIT if split else PARTS, wait_parts=4)
    pipe = Pipeline(ws, policy=policy, config=cfg, prefill_rows=prefill, drain_rows=32)
    plan = pipe.plan(58)
    assert (plan.prefill_rows, plan.drain_rows) == (prefill, 32)
    assert plan.inputs[1].shape == (26, 80) and plan.drain_h.shape == (32, 80)
    assert plan.links[0].dep.consumer.M == 26  # the consumer's rows end where the drain's begin
    # the drain's GEMMs: 2 x 5 and 2 x 3 tiles on 4 CTAs, a 2-tile tail each when split
    assert [g.num_ctas for g in plan.ends(0)] == [4, 4] and all((g.tail is not None) == split for g in plan.ends(0))
    assert pipe.drain_weight.shape == ws[1].shape
    assert_epochs_right(pipe, 58)
    assert all(int(t.counters.abs().sum()) == 0 for t in plan.tails if t is not None)


def test_balanced_ends_size_both_ends_per_input_height():
    """``ends="balanced"``: prefill and drain rows from :func:`deps.balanced_ends` for each
    ``M`` (the interpreter's 4 CTAs and 4 tiles per row-block: a one-row-block drain, a prefill
    of that + M / 64 rows), cut for small inputs, split tails by default, bitwise the
    sequential GEMMs; it refuses explicit rows, other chain lengths and trace mode."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 64), (64, 48)]]
    pipe = Pipeline(ws, config=SPLIT, ends="balanced")
    assert Pipeline(ws, ends="balanced").config.split_tail  # ENDS_CONFIG
    assert Pipeline(ws, prefill_rows=128).configs == Pipeline(ws, drain_rows=128).configs == [ENDS_CONFIG] * 2
    assert pipe.prefill_weight.shape == ws[0].shape and pipe.drain_weight.shape == ws[1].shape
    assert pipe.ends_for(1024) == (32, 16)
    got = {M: (pipe.plan(M).prefill_rows, pipe.plan(M).drain_rows) for M in (256, 100, 40, 16)}
    assert got == {256: (16, 16), 100: (16, 16), 40: (16, 16), 16: (0, 0)}
    # on 40 rows: both ends, the producer's row-block (rows 16-24), the consumer's 2 x 3 tiles
    # (a split 2-tile tail); on 100 rows (not 256: the same kernels on 2.3x the tiles) the
    # producer's 20 tiles and the consumer's 18 (a split tail again) run in several rounds
    assert_epochs_right(pipe, 40)
    x = torch.randn(100, 64).half()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))
    with pytest.raises(ValueError, match="pass one or the other"):
        Pipeline(ws, ends="balanced", drain_rows=16)
    with pytest.raises(ValueError, match="exactly two stages, got 3"):
        Pipeline([*ws, torch.randn(48, 16).half()], ends="balanced")
    with pytest.raises(ValueError, match="trace mode"):
        Pipeline(ws, ends="balanced", trace=True)
    with pytest.raises(ValueError, match="ends must be None or 'balanced'"):
        Pipeline(ws, ends="auto")


def test_end_candidates_and_what_tune_ends_refuses():
    """``tune_ends`` tries no ends, and the rule's drain with 0.5 / 1 / 1.5 / 2 times the rule's
    prefill (row-blocks, cut as a call cuts them, no repeats). It times CUDA graphs, so on the
    CPU it refuses, as it does for a pipeline without ``ends="balanced"``."""
    ws = [(torch.randn(k, n) / k**0.5).half() for k, n in [(64, 64), (64, 48)]]
    pipe = Pipeline(ws, config=SPLIT, ends="balanced")
    # the rule at M=1024: 32 + 16 rows (see test_balanced_ends_size_both_ends_per_input_height)
    assert pipe.end_candidates(1024) == [(0, 0), (16, 16), (32, 16), (48, 16), (64, 16)]
    # at 40 rows half a row-block of prefill rounds to none, and every larger one is cut to one
    assert pipe.end_candidates(40) == [(0, 0), (0, 16), (16, 16)]
    # the rule's ends (what a candidate must beat) are tried whatever the factors
    assert pipe.end_candidates(1024, factors=(0.5, 2.0)) == [(0, 0), (16, 16), (64, 16), (32, 16)]
    assert pipe.end_candidates(1024, factors=()) == [(0, 0), (32, 16)]
    assert pipe.end_candidates(1024, factors=np.array([0.5, 2.0])) == [(0, 0), (16, 16), (64, 16), (32, 16)]
    with pytest.raises(RuntimeError, match="needs the stages on GPUs"):
        pipe.tune_ends(256)
    # bad arguments are refused before anything is built or timed
    for kw, msg in (
        (dict(reps=0), "reps must be an int >= 1"), (dict(warmup=-1), "warmup must be an int >= 0"),
        (dict(reps=True), "reps must be"), (dict(margin=1.0), "margin must be a fraction"),
        (dict(margin=float("nan")), "margin must be"), (dict(factors=(1.0, -0.5)), "factors must be"),
        (dict(factors=1.0), "factors must be"),
    ):  # fmt: skip
        with pytest.raises(ValueError, match=msg):
            pipe.tune_ends(256, **kw)
    with pytest.raises(ValueError, match="M must be at least 1 row"):
        pipe.end_candidates(0)
    assert not pipe._plans
    with pytest.raises(ValueError, match="ends='balanced'"):
        Pipeline(ws, config=SPLIT).tune_ends(256)
    with pytest.raises(ValueError, match="ends='balanced'"):
        Pipeline(ws, config=SPLIT).end_candidates(256)
    # what it chose is what a call on those rows uses (on 64 rows the rule's ends are (16, 16))
    assert pipe.ends_for(64) == (16, 16)
    pipe.tuned_ends[64] = (32, 16)
    assert (pipe.plan(64).prefill_rows, pipe.plan(64).drain_rows) == (32, 16)
    x = torch.randn(64, 64).half()
    assert torch.equal(pipe(x, check=True), pipe.sequential(x))


def test_tuning_leaves_the_rule_only_for_a_clear_win():
    ms = {(0, 0): 3.50, (384, 512): 3.40, (768, 512): 3.41, (1152, 512): 3.30}
    assert faster_by(ms, (768, 512), 0.02) == (1152, 512)  # 3.2% faster
    assert faster_by({**ms, (1152, 512): 3.36}, (768, 512), 0.02) == (768, 512)  # 1.5%: noise
    assert faster_by(ms, (1152, 512), 0.0) == (1152, 512)  # the default is the fastest


def test_drain_leaves_the_pipeline_a_row_block_and_is_checked():
    ws = [torch.randn(16, 32).half(), torch.randn(32, 16).half()]
    pipe = Pipeline(ws, config=SMALL, prefill_rows=32, drain_rows=32)
    # the drain is cut first, then the prefill, so the producer keeps at least one row
    ends = {M: (pipe.plan(M).prefill_rows, pipe.plan(M).drain_rows) for M in (100, 64, 40, 20, 16)}
    assert ends == {100: (32, 32), 64: (16, 32), 40: (0, 32), 20: (0, 16), 16: (0, 0)}
    for M in (100, 40, 20, 16):
        x = torch.randn(M, 16).half()
        assert torch.equal(pipe(x), pipe.sequential(x))
    with pytest.raises(ValueError, match="drain_rows must be a multiple of block_m=16"):
        Pipeline(ws, config=SMALL, drain_rows=8)
    with pytest.raises(ValueError, match="exactly two stages, got 1"):
        Pipeline(ws[:1], config=SMALL, drain_rows=16)
    with pytest.raises(ValueError, match="exactly two stages, got 3"):
        Pipeline([*ws, torch.randn(16, 16).half()], config=SMALL, drain_rows=16)
    with pytest.raises(ValueError, match="trace mode does not stamp the drain GEMMs"):
        Pipeline(ws, config=SMALL, drain_rows=16, trace=True)


def test_a_launch_without_hooks_passes_none_for_every_hook(monkeypatch):
    """The kernel's hooks are argument bundles that are None when off (their code then
    vanishes at compile time): a plain launch passes None for each, a waiting one its bundle."""
    import ctapipelining.gemm as host

    seen, names = [], host.gemm_kernel.arg_names

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: seen.append(dict(zip(names, args)))

    monkeypatch.setattr(host, "gemm_kernel", Recorder())
    a, b, c = torch.randn(32, 16).half(), torch.randn(16, 32).half(), torch.empty(32, 32).half()
    one = torch.zeros(1, dtype=torch.int64)
    host.launch_gemm(a, b, c, SMALL, 4)
    host.launch_gemm(a, b, c, SMALL, 4, wait=host.WaitHook(one, one, one, one, one, False), epoch=one, err=one)
    hooks = ("wait", "signal", "tail", "epoch_ptr", "err_ptr", "trace_ptr")
    assert all(seen[0][h] is None for h in hooks) and seen[0]["c_ptr"] is None  # contiguous c: a TMA store
    assert seen[1]["wait"].counters is one and seen[1]["epoch_ptr"] is one and seen[1]["signal"] is None
