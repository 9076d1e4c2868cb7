"""The fused Llama MLP block on one GPU at real sizes, against ``transformers``' own block."""

import pytest
import torch

from ctapipelining.nn import LlamaMLP

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fused_blocks")]


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def graph_follows_its_source(block, x, change):
    """A captured graph of ``block`` replays what an eager call gives; after ``change()`` (a source
    weight changed in place) a capture refuses, and the next eager call lays the weights out again
    in place, so the graph replays the new ones."""
    static_x = x.clone()
    y = block(static_x)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = block(static_x)
    g.replay()
    assert torch.equal(static_y, y)
    with torch.no_grad():
        change()
    with pytest.raises(RuntimeError, match="outside any CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            block(static_x)
    y2 = block(static_x)
    g.replay()
    assert torch.equal(static_y, y2) and not torch.equal(y2, y)


def small_block(kind: str, H: int = 1024, inter: int = 2048):
    """A Llama (``kind`` "llama") or GPT block of random weights (seeded), hidden ``H``."""
    from ctapipelining.nn import GPTMLP

    torch.manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device="cuda") * shape[-1] ** -0.5).bfloat16()

    if kind == "llama":
        block = LlamaMLP(w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device="cuda")).bfloat16())
    else:
        vec = lambda n: (0.1 * torch.randn(n, device="cuda")).bfloat16()  # noqa: E731
        block = GPTMLP(w(inter, H), vec(inter), w(H, inter), vec(H), 1 + vec(H), vec(H))
    return block


@pytest.mark.parametrize("H,inter,unfused", [(4096, 14336, False), (8192, 28672, False), (4096, 14336, True)])
def test_llama_block_is_as_accurate_as_transformers_in_bf16(H, inter, unfused, monkeypatch):
    """At Llama-8B and -70B sizes, M = 1, 777, 4096: against float32, the fused block's error is
    at most 2x that of ``transformers``' LlamaMLP + LlamaRMSNorm in bf16; graph replay equal
    to the eager call bitwise. ``unfused``: the block unfused up to 1000 rows (``unfused_rows``)."""
    if unfused:
        monkeypatch.setattr(LlamaMLP, "unfused_rows", ((1, 1000),))
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=inter, num_attention_heads=64, rms_norm_eps=1e-5)
    mlp, norm = HFMLP(cfg).cuda().bfloat16(), LlamaRMSNorm(H, eps=1e-5).cuda().bfloat16()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
        for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            lin.weight.normal_(0, lin.weight.shape[1] ** -0.5)
    block = LlamaMLP.from_hf(mlp, norm)
    for M in (1, 777, 4096):
        x = torch.randn(M, H, device="cuda").bfloat16()
        with torch.no_grad():
            xf = x.float()
            xn = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
            g, u = xn @ mlp.gate_proj.weight.float().t(), xn @ mlp.up_proj.weight.float().t()
            ref = xf + (torch.nn.functional.silu(g) * u) @ mlp.down_proj.weight.float().t()
            theirs = x + mlp(norm(x))
        ours = block(x)
        assert not ours.isnan().any() and block.runs_unfused(M) == (unfused and M <= 1000)
        assert rel(ours, ref) <= 2 * rel(theirs, ref), (M, rel(ours, ref), rel(theirs, ref))
        assert torch.equal(block(x), ours)  # launched raw now: the same
    # the 4096-row launch's norm pass: compiled at its first call, a RawLaunch for the later ones
    from ctapipelining.gemm import plain_launch

    stream = torch.cuda.current_stream().cuda_stream
    first = plain_launch(4096, 2 * inter, H, block.in_config, x.device, stream, block._epilogues()[0], 0)
    assert first.stats._compiled and all(raw is not None for raw in first.stats._compiled.values())
    x = torch.randn(4096, H, device="cuda").bfloat16()
    graph_follows_its_source(block, x, lambda: mlp.down_proj.weight.mul_(2))


@pytest.mark.parametrize("H,inter", [(4096, 16384)])
@pytest.mark.parametrize("offset,unfused", [(0.0, False), (30.0, False), (0.0, True), (30.0, True)])
def test_gpt_block_is_as_accurate_as_transformers_in_bf16(H, inter, offset, unfused, monkeypatch):
    """A GPT-style block (LayerNorm folded, biases, GELU-tanh) at M = 1, 100, 200, 300, 350, 777,
    4096: against float32 it errs at most 2x as much as ``transformers``' GPT2MLP + LayerNorm in
    bf16, and so does its first GEMM alone against theirs (norm, ``c_fc``, GELU), also on rows
    whose mean is 30x their spread; a compiled model traces through it (the custom operator) and
    equals the eager block. ``unfused``: the block unfused up to 1000 rows (``unfused_rows``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    from ctapipelining.nn import GPTMLP

    if unfused:
        monkeypatch.setattr(GPTMLP, "unfused_rows", ((1, 1000),))

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=H, n_head=32, activation_function="gelu_new", layer_norm_epsilon=1e-5)
    mlp, norm = GPT2MLP(inter, cfg).cuda().eval(), torch.nn.LayerNorm(H, eps=1e-5).cuda()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
        norm.bias.copy_(0.1 * torch.randn(H))
        for conv in (mlp.c_fc, mlp.c_proj):
            conv.weight.normal_(0, conv.weight.shape[0] ** -0.5)
            conv.bias.normal_(0, 0.1)
    mlp, norm = mlp.bfloat16(), norm.bfloat16()
    block = GPTMLP.from_hf(mlp, norm)
    for M in (1, 100, 200, 300, 350, 777, 4096):  # (GPT_FEW_ROWS_CONFIGS' own rows, and past the table)
        x = (torch.randn(M, H, device="cuda") + offset).bfloat16()
        with torch.no_grad():
            xf = x.float()
            xn = torch.nn.functional.layer_norm(xf, (H,), norm.weight.float(), norm.bias.float(), 1e-5)
            h_ref = torch.nn.functional.gelu(xn @ mlp.c_fc.weight.float() + mlp.c_fc.bias.float(), approximate="tanh")
            ref = xf + h_ref @ mlp.c_proj.weight.float() + mlp.c_proj.bias.float()
            h_theirs = mlp.act(mlp.c_fc(norm(x)))
            theirs = x + mlp(norm(x))
            # the first GEMM alone (LayerNorm folded, bias, GELU), where the fold's subtraction cancels
            h_ours = block.first_gemm(x)
        ours = block(x)
        assert not ours.isnan().any()
        assert rel(ours, ref) <= 2 * rel(theirs, ref), (M, rel(ours, ref), rel(theirs, ref))
        assert rel(h_ours, h_ref) <= 2 * rel(h_theirs, h_ref), (M, rel(h_ours, h_ref), rel(h_theirs, h_ref))
    with torch.no_grad():  # inference: a compiled model traces through the operator
        compiled = torch.compile(lambda t: block(t) * 2, fullgraph=True)
        assert torch.equal(compiled(x), block(x) * 2)
    # the first GEMM's column sums are laid out again in place too
    graph_follows_its_source(block, x, lambda: (mlp.c_fc.weight.mul_(1.5), norm.bias.add_(0.25)))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_block_call_on_its_own_tensors_makes_no_matmul_check_and_equals_the_checked_call(kind, monkeypatch):
    """``forward`` on TMA-ready rows launches the two GEMMs on an intermediate and an output of
    its own without ``matmul`` (whose checks it has nothing left to make), bitwise equal to the
    checked call into NaN-poisoned buffers of the caller's (``run``), at one row, rows that do
    not fill a tile and several waves. Rows it cannot take as they are go through the checks:
    no rows give no rows, rows 2 bytes off alignment are copied first (the
    same output as an aligned copy's)."""
    from ctapipelining import nn

    H = 1024
    block = small_block(kind)
    checked = {}
    for M in (1, 777, 4096):
        x = torch.randn(M, H, device="cuda").bfloat16()
        out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        h = torch.full((M, block.w_out.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        checked[M] = (x, block.run(x, out, h).clone())
    calls = []
    real = nn.matmul
    monkeypatch.setattr(nn, "matmul", lambda *a, **k: calls.append(1) or real(*a, **k))
    for M, (x, want) in checked.items():
        got = block(x)
        assert not calls, f"{M} rows went through matmul's checks"
        assert torch.equal(got, want), M
    assert block(torch.empty(0, H, device="cuda", dtype=torch.bfloat16)).shape == (0, H)
    shifted = torch.randn(777 * H + 1, device="cuda").bfloat16()[1:].view(777, H)  # contiguous, 2 bytes off
    assert torch.equal(block(shifted), block(shifted.clone()))  # copied to an address TMA reads from


def test_a_stack_of_two_llama_blocks_is_right_and_equals_its_gemms_one_after_another():
    """Two Llama-8B blocks as one pipeline on one GPU (each GEMM in its block's configuration;
    and one chain kernel), M = 1, 777, 4096: bitwise the same GEMMs one after another; against
    float32 at most 2x the error of ``transformers``' blocks in bf16; graph replay bitwise the
    eager call. The default stack on one GPU runs the blocks one after another: bitwise each
    block called alone."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ctapipelining.nn import STACK_CONFIG, LlamaStack

    H, inter = 4096, 14336
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=inter, num_attention_heads=32, rms_norm_eps=1e-5)
    mods = []
    for _ in range(2):
        mlp, norm = HFMLP(cfg).cuda().bfloat16(), LlamaRMSNorm(H, eps=1e-5).cuda().bfloat16()
        with torch.no_grad():
            norm.weight.copy_(1 + 0.2 * torch.randn(H))
            for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                lin.weight.normal_(0, lin.weight.shape[1] ** -0.5)
        mods.append((mlp, norm))
    stacks = [
        LlamaStack.from_hf(*zip(*mods), always_pipelined=True),
        LlamaStack.from_hf(*zip(*mods), config=STACK_CONFIG, always_pipelined=True),
        LlamaStack.from_hf(*zip(*mods)),
    ]
    assert len(stacks[0].pipeline.groups) == 4 and stacks[1].pipeline.groups == [[0, 1, 2, 3]]
    assert [s.blocks_apart() for s in stacks] == [False, False, True]
    for M in (1, 777, 4096):
        x = torch.randn(M, H, device="cuda").bfloat16()
        with torch.no_grad():
            ref, theirs = x.float(), x
            for mlp, norm in mods:
                xn = ref * torch.rsqrt(ref.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight.float()
                g, u = xn @ mlp.gate_proj.weight.float().t(), xn @ mlp.up_proj.weight.float().t()
                ref = ref + (torch.nn.functional.silu(g) * u) @ mlp.down_proj.weight.float().t()
                theirs = theirs + mlp(norm(theirs))
        for stack in stacks:
            ours = stack(x)
            assert torch.equal(ours, stack.sequential(x)), M
            assert not ours.isnan().any()
            assert rel(ours, ref) <= 2 * rel(theirs, ref), (M, rel(ours, ref), rel(theirs, ref))
        assert torch.equal(stacks[2](x), stacks[2].blocks[1](stacks[2].blocks[0](x))), M
    graphed = stacks[0].pipeline.capture(4096)
    x = torch.randn(4096, H, device="cuda").bfloat16()
    assert torch.equal(graphed(x), stacks[0](x))
    stacks[0].pipeline.check_errors()


def test_one_plan_called_with_one_row_then_more_stays_right():
    """A bucketed plan serves 1 to 128 rows: called first with 1 row (Triton would compile the
    residual's row count 1 as a constant) and then with 100 and 37, every call equals its GEMMs
    one after another, in each block's configuration and in one chain kernel; and ``matmul``
    with a residual likewise, added onto its output by TMA or (padded rows) loaded."""
    from ctapipelining.epilogue import Epilogue
    from ctapipelining.gemm import matmul
    from ctapipelining.nn import STACK_CONFIG, LlamaMLP, LlamaStack

    torch.manual_seed(1)
    H, inter = 1024, 2048

    def w(rows, cols):
        return (torch.randn(rows, cols, device="cuda") * cols**-0.5).bfloat16()

    blocks = [LlamaMLP(w(inter, H), w(inter, H), w(H, inter), torch.ones(H, device="cuda").bfloat16()) for _ in "ab"]
    for stack in (
        LlamaStack(blocks, always_pipelined=True),
        LlamaStack(blocks, config=STACK_CONFIG, always_pipelined=True),
    ):
        for M in (1, 100, 37):
            x = torch.randn(M, H, device="cuda").bfloat16()
            assert torch.equal(stack(x), stack.sequential(x)), M
    b = w(H, H)
    for M in (1, 100):
        a, res = torch.randn(M, H, device="cuda").bfloat16(), torch.randn(M, H, device="cuda").bfloat16()
        want = (a.float() @ b.float() + res.float()).bfloat16()
        got = matmul(a, b, epilogue=Epilogue(residual=True), residual=res)  # added onto the output by TMA
        assert (got.float() - want.float()).abs().max() < 0.1, M
        padded = torch.full((M, H + 64), float("nan"), device="cuda").bfloat16()[:, :H]  # loaded by the epilogue
        matmul(a, b, out=padded, epilogue=Epilogue(residual=True), residual=res)
        assert (padded.float() - want.float()).abs().max() < 0.1, M


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_a_stack_with_a_block_per_gpu(policy):
    """Two Llama-8B blocks, one per GPU: block 1's gate/up GEMM waits on GPU 1 for block 0's down
    GEMM's rows and the sums of squares it writes there across NVLink; with the first GPU's
    kernel delayed and every plan buffer NaN-poisoned, bitwise its GEMMs one after another, and
    graph replays too."""
    from ctapipelining.nn import LlamaMLP, LlamaStack

    torch.manual_seed(2)
    H, inter = 4096, 14336

    def block(dev):
        def w(rows, cols):
            return (torch.randn(rows, cols, device=dev) * cols**-0.5).bfloat16()

        return LlamaMLP(w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device=dev)).bfloat16())

    stack = LlamaStack([block("cuda:0"), block("cuda:1")], policy=policy)
    pipe = stack.pipeline
    assert [d.index for d in pipe.devices] == [0, 0, 1, 1]
    for M in (4096, 777):
        plan = pipe.plan(M)
        x = torch.randn(M, H, device="cuda:0").bfloat16()
        for t in plan.inputs[1:] + [s for s in plan.sums if s is not None]:
            t.fill_(float("nan"))
        out = torch.empty(M, H, device="cuda:1", dtype=torch.bfloat16)
        pipe._launch(plan, x, out, delay_cycles={0: 20_000_000})
        pipe.check_errors()
        assert torch.equal(out, stack.sequential(x).to("cuda:1")), M
        assert torch.equal(stack(x), out)
    g = pipe.capture(4096)
    x = torch.randn(4096, H, device="cuda:0").bfloat16()
    assert torch.equal(g(x), stack.sequential(x).to("cuda:1"))
    g.check_errors()


def test_a_launch_called_again_on_other_operands_writes_where_each_call_says(monkeypatch):
    """A launch keeps the arguments of the calls it launched raw, by their operands'
    signatures. On one launch that adds a residual and one whose norm pass may copy its rows
    (1100 x 3840 x 1024: 135 tiles on 132 SMs, a split tail), calls taking turns in a shuffled
    order on two streams, each operand chosen apart from the others: two inputs, two weights,
    two outputs (NaN-poisoned before each call), two residuals copied in first or the residual
    already in the output, two copies of the rows or none, and the first 777 rows of an input
    and an output (rows m < M of the same launch: the rows after them stay NaN). Each call
    bitwise its first, which is within a rounding of float32; once every call has been seen, no
    call builds arguments again, on either stream."""
    import random

    from ctapipelining.epilogue import Epilogue
    from ctapipelining.gemm import GemmLaunch, grid_size
    from ctapipelining.kernels.gemm import EPILOGUE_CONFIG

    torch.manual_seed(4)
    M, K, N, cut = 1100, 1024, 3840, 777
    dev = torch.device("cuda", 0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).bfloat16()

    xs, bs = [r(M, K) for _ in range(2)], [r(K, N, scale=K**-0.5) for _ in range(2)]
    res, outs, copies = [r(M, N) for _ in range(2)], [r(M, N) for _ in range(2)], [r(M, K) for _ in range(2)]
    P = grid_size(M, N, K, EPILOGUE_CONFIG, dev)
    add = GemmLaunch(M, N, K, EPILOGUE_CONFIG, P, dev, epilogue=Epilogue(residual=True), add_residual=True)
    norm = GemmLaunch(M, N, K, EPILOGUE_CONFIG, P, dev, epilogue=Epilogue(rms_eps=1e-5))
    cases = []  # (name, launch, x, b, out, residual source or None, residual is out, copy, rows)
    for i in range(2):
        for k in range(2):
            for j in range(2):
                cases.append((f"add {i}{k}{j} copied", add, i, k, j, (i + j + k) % 2, False, None, M))
                cases.append((f"add {i}{k}{j} in place", add, i, k, j, (i + j) % 2, True, None, M))
                cases.append((f"norm {i}{k}{j}", norm, i, k, j, None, False, (i + k) % 2, M))
                cases.append((f"norm {i}{k}{j} " + ("cut" if k else "none"), norm, i, k, j, None, False, None,
                              cut if k else M))  # fmt: skip
    assert len({c[0] for c in cases}) == len(cases) == 32  # 16 calls a launch: as many as it keeps (MAX_CALLS)

    def run(case, stream):
        _, launch, i, k, j, ri, in_place, q, rows = case
        out = outs[j]
        out.fill_(float("nan"))
        if q is not None:
            copies[q].fill_(float("nan"))
        if in_place:
            out.copy_(res[ri])
        stream.wait_stream(torch.cuda.current_stream())
        residual = out if in_place else (None if ri is None else res[ri])
        launch(xs[i][:rows], bs[k], out[:rows], stream.cuda_stream, residual=residual,
               a_copy=None if q is None else copies[q])  # fmt: skip
        stream.synchronize()
        if rows < M:
            assert out[rows:].isnan().all(), case[0]
        return out[:rows].clone(), None if q is None else copies[q].clone()

    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    first = {}
    for case in cases:  # a case's first call (the first of each launch compiles through Triton)
        first[case[0]] = run(case, streams[0])
        got, copied = first[case[0]]
        _, _, i, k, _, ri, _, q, rows = case
        want = xs[i][:rows].float() @ bs[k].float()
        if ri is not None:
            want += res[ri][:rows].float()
        if case[1] is norm:
            x = xs[i][:rows].float()
            want *= torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        assert (got.float() - want).abs().max() < 0.05 * want.abs().max(), case[0]
        assert copied is None or torch.equal(copied, xs[i]), case[0]
    built = []
    real = GemmLaunch.raw_args
    monkeypatch.setattr(GemmLaunch, "raw_args", lambda *a, **kw: built.append(1) or real(*a, **kw))
    rng = random.Random(0)
    for turn in range(4):  # both streams, shuffled: a call seen before builds nothing
        built.clear()
        for case in rng.sample(cases, len(cases)):
            got = run(case, streams[rng.randrange(2)])
            want = first[case[0]]
            assert torch.equal(got[0], want[0]) and (want[1] is None or torch.equal(got[1], want[1])), (turn, case[0])
        if turn:
            assert not built, (turn, len(built))


@pytest.mark.parametrize("M,K,N", [(1, 512, 1000), (300, 776, 264), (4097, 1024, 4104), (1100, 4096, 3840)])
def test_a_residual_added_by_tma_on_any_width_over_a_nan_out(M, K, N):
    """``matmul`` adding its residual by TMA reduce-add, on widths and heights that are not a
    multiple of the tile, into an ``out`` filled with NaN: no element left NaN, the row after
    ``out`` untouched, and within a bf16 rounding of float32 and of the same GEMM with its
    residual loaded by the epilogue (an ``out`` with padded rows). 1100 x 3840: 135 tiles on an
    H200's 132 SMs, a split tail (3 tiles, 4 K-slices each) whose summing CTAs add their tiles."""
    from ctapipelining.epilogue import Epilogue
    from ctapipelining.gemm import matmul

    torch.manual_seed(3)
    a = torch.randn(M, K, device="cuda").bfloat16()
    b = (torch.randn(K, N, device="cuda") * K**-0.5).bfloat16()
    res = torch.randn(M, N, device="cuda").bfloat16()
    guard = torch.full((M + 1, N), float("nan"), device="cuda").bfloat16()  # one row past out stays NaN
    out = guard[:M]
    got = matmul(a, b, out=out, epilogue=Epilogue(residual=True), residual=res)
    assert got.data_ptr() == out.data_ptr() and not out.isnan().any()
    assert guard[M].isnan().all()
    want = a.float() @ b.float() + res.float()
    loaded = torch.full((M, N + 64), float("nan"), device="cuda").bfloat16()[:, :N]  # padded rows: loaded
    matmul(a, b, out=loaded, epilogue=Epilogue(residual=True), residual=res)
    tol = 2 * torch.finfo(torch.bfloat16).eps * want.abs().amax() + 1e-2
    assert (got.float() - want).abs().max() <= tol
    assert (got.float() - loaded.float()).abs().max() <= tol


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_norm_pass_copies_its_rows_into_a_padded_buffer_and_a_residual_adds_in_place(norm):
    """On the GPU, twice (the second call takes the pass's raw launch): the norm's pass stores the
    rows bitwise into a copy, with padded rows (its padding untouched) or not, and the GEMM is
    within a rounding of the one without a copy (the pass that also stores a row may sum it in
    another order: the compiler lays the row out to vectorise the store, which depends on the
    copy's alignment; seen here as 1-2 ulps of a row's statistics); a residual that is ``out``
    is added onto it in place, bitwise the residual given apart, over widths that are not a
    multiple of the tile (8200 columns: two steps of the pass, the last ragged)."""
    from ctapipelining.epilogue import Epilogue
    from ctapipelining.gemm import matmul

    torch.manual_seed(4)
    M, K, N = 300, 8200, 1000
    a = (torch.randn(M, K, device="cuda") + 2).bfloat16()
    b = (torch.randn(K, N, device="cuda") * K**-0.5).bfloat16()
    epi = Epilogue(rms_eps=1e-5) if norm == "rms" else Epilogue(layer_norm_eps=1e-5, col_sum=b.float().sum(0))
    want = matmul(a, b, epilogue=epi)
    tol = 2 * torch.finfo(torch.bfloat16).eps * want.float().abs().amax()
    for width in (K + 56, K, K + 56, K):
        buf = torch.full((M, width), float("nan"), device="cuda").bfloat16()
        y = matmul(a, b, epilogue=epi, a_copy=buf[:, :K])
        assert torch.equal(buf[:, :K], a) and buf[:, K:].isnan().all()
        assert (y.float() - want.float()).abs().max() <= tol, width
    res = torch.randn(M, N, device="cuda").bfloat16()
    apart = matmul(a, b, epilogue=Epilogue(residual=True), residual=res)
    held = res.clone()
    assert matmul(a, b, out=held, epilogue=Epilogue(residual=True), residual=held) is held
    assert torch.equal(held, apart)


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_one_block_split_the_papers_way(policy):
    """One Llama-8B block split over two GPUs (its gate/up GEMM on GPU 0, its down GEMM on GPU 1,
    the residual ``x`` read from GPU 0 as each tile's rows come): with the first GPU's kernel
    delayed and the intermediate NaN-poisoned, bitwise its GEMMs one after another, the block's
    own result within rounding (its down GEMM adds the residual by TMA, on other tiles), and a
    graph replay bitwise the eager call."""
    from ctapipelining.pipeline import Pipeline

    torch.manual_seed(3)
    H, inter = 4096, 14336

    def w(rows, cols):
        return (torch.randn(rows, cols, device="cuda:0") * cols**-0.5).bfloat16()

    block = LlamaMLP(w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device="cuda:0")).bfloat16())
    (w_in, w_out), configs, epilogues = block.pipeline_stages()
    pipe = Pipeline([w_in, w_out.to("cuda:1")], config=configs, epilogues=epilogues, policy=policy)
    for M in (4096, 777):
        plan = pipe.plan(M)
        x = torch.randn(M, H, device="cuda:0").bfloat16()
        plan.inputs[1].fill_(float("nan"))
        out = torch.full((M, H), float("nan"), device="cuda:1", dtype=torch.bfloat16)
        pipe._launch(plan, x, out, delay_cycles={0: 20_000_000})
        pipe.check_errors()
        assert torch.equal(out, pipe.sequential(x)), M
        assert rel(out, block(x).to("cuda:1")) < 1e-2, M
    g = pipe.capture(4096)
    x = torch.randn(4096, H, device="cuda:0").bfloat16()
    assert torch.equal(g(x), pipe(x))
    g.check_errors()


@pytest.mark.gpu2
@pytest.mark.parametrize("policy", ["static", "workqueue"])
def test_a_residual_written_during_the_call_on_the_gpu_before(policy):
    """Three stages, the first two on GPU 0 (one chain kernel), the third on GPU 1 adding the
    second stage's input (written by the first stage during the call) read from GPU 0, its
    input waited for in 8 parts: with the first GPU's kernel delayed and every intermediate
    NaN-poisoned, bitwise the stages one after another, at a height whose tiles do not divide."""
    import dataclasses

    from ctapipelining.epilogue import Epilogue
    from ctapipelining.kernels.gemm import PIPELINE_CONFIG, RESIDUAL_CONFIG
    from ctapipelining.pipeline import Pipeline

    torch.manual_seed(4)
    H = 4096
    ws = [(torch.randn(H, H, device=f"cuda:{d}") * H**-0.5).bfloat16() for d in (0, 0, 1)]
    configs = [PIPELINE_CONFIG, PIPELINE_CONFIG, dataclasses.replace(RESIDUAL_CONFIG, wait_parts=8)]
    pipe = Pipeline(ws, config=configs, epilogues=[None, None, Epilogue(residual=True)], policy=policy)
    assert pipe.groups == [[0, 1], [2]]
    for M in (4096, 1000):
        plan = pipe.plan(M)
        x = torch.randn(M, H, device="cuda:0").bfloat16()
        for t in plan.inputs[1:]:
            t.fill_(float("nan"))
        out = torch.full((M, H), float("nan"), device="cuda:1", dtype=torch.bfloat16)
        pipe._launch(plan, x, out, delay_cycles={0: 20_000_000})
        pipe.check_errors()
        want = pipe.sequential(x)
        assert not want.isnan().any() and torch.equal(out, want), M


def test_a_block_called_from_two_threads_on_one_stream_gives_each_its_own_result(monkeypatch):
    """Two threads call one block at once on the same stream, each on rows of its own: a call's
    norm pass and the GEMM that reads its row statistics (buffers of the launch, shared by the
    stream's calls) are queued under the launch's lock, so the other thread's pass cannot be
    queued between them. Each call is the first on its operands (the pass goes through
    ``NormStats.__call__``), and each pass is followed by a pause that lets the other thread
    run; a second block with the same weights (launches of its own) gives the expected rows."""
    import threading
    import time

    from ctapipelining.gemm import NormStats

    torch.manual_seed(0)
    H, inter = 1024, 2048
    ws = [torch.randn(inter, H, device="cuda").bfloat16() / H**0.5 for _ in range(2)]
    ws.append(torch.randn(H, inter, device="cuda").bfloat16() / inter**0.5)
    norm_w = (1 + 0.2 * torch.randn(H, device="cuda")).bfloat16()
    block, twin = LlamaMLP(*ws, norm_w), LlamaMLP(*ws, norm_w)
    xs = [[(1 + 3 * i) * torch.randn(256, H, device="cuda").bfloat16() for _ in range(4)] for i in (0, 1)]
    want = [[twin(x) for x in row] for row in xs]
    torch.cuda.synchronize()
    real = NormStats.__call__

    def pass_then_pause(self, *args, **kw):
        out = real(self, *args, **kw)
        time.sleep(0.01)
        return out

    monkeypatch.setattr(NormStats, "__call__", pass_then_pause)
    got, errors = [[], []], []

    def calls(i):
        try:
            for x in xs[i]:
                got[i].append(block(x))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=calls, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    torch.cuda.synchronize()
    assert not errors and [len(g) for g in got] == [4, 4], errors
    assert all(torch.equal(y, w) for i in (0, 1) for y, w in zip(got[i], want[i]))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_repeated_block_call_relaunches_what_it_bound_and_follows_its_weights(kind, monkeypatch):
    """A block's common call is bound at its second sighting (the same rows' signature, stream,
    and addresses its intermediate and output land at), its two launches' raw steps captured
    once into a CUDA graph: a later such call replays the graph without ``launch_checked``. A
    caller that keeps its outputs repeats no call and looks up no steps. Every call stays
    bitwise equal to the checked call (``run``): repeated calls (the freed output's memory comes
    back), the rows and a laid-out weight changed in place (the arguments are addresses: the
    new values are read; a GPT block's column sums follow), a weight buffer replaced by another
    tensor allocated beforehand (so the calls' memory lands where it did; the old one
    NaN-poisoned: nothing bound to it is launched), on another stream, and replayed from a
    CUDA graph captured after."""
    from ctapipelining import nn
    from ctapipelining.cugraph import StreamGraph
    from ctapipelining.gemm import GemmLaunch
    from ctapipelining.launcher import bound_stream

    H, M = 1024, 777
    block = small_block(kind)
    x = torch.randn(M, H, device="cuda").bfloat16()
    replacement = block.w_out.clone()

    def checked():
        out = torch.full((M, H), float("nan"), device="cuda", dtype=torch.bfloat16)
        h = torch.full((M, block.w_out.shape[0]), float("nan"), device="cuda", dtype=torch.bfloat16)
        return block.run(x, out, h)

    counts = {"checked": 0, "relaunched": 0, "steps": 0, "replayed": 0, "run": 0}

    def counted(name, real):
        def call(*a, **k):
            counts[name] += 1
            return real(*a, **k)

        return call

    monkeypatch.setattr(nn, "launch_checked", counted("checked", nn.launch_checked))
    monkeypatch.setattr(GemmLaunch, "relaunch", counted("relaunched", GemmLaunch.relaunch))
    monkeypatch.setattr(GemmLaunch, "steps", counted("steps", GemmLaunch.steps))
    monkeypatch.setattr(StreamGraph, "replay", counted("replayed", StreamGraph.replay))
    monkeypatch.setattr(type(block), "_run", counted("run", type(block)._run))  # the checked path

    def calls(n):
        want = checked()
        counts.update(checked=0, relaunched=0, steps=0, replayed=0, run=0)
        for _ in range(n):
            y = block(x)
            assert torch.equal(y, want)
            y.fill_(float("nan"))  # freed poisoned: the next call's output lands here, written or caught
            del y
        return dict(counts)

    # bound at the second call, its launches captured (not run) into the graph the later calls
    # replay, straight from forward (the last bound call: no checked path)
    assert calls(6) == {"checked": 2 * 2, "relaunched": 2, "steps": 2, "replayed": 4, "run": 2}
    # two row counts in turn: once both are bound (three rounds), each call is not the last one
    # bound, and replays its own from the checked path
    x2 = torch.randn(M // 2, H, device="cuda").bfloat16()
    want2 = block.run(x2, torch.full_like(x2, float("nan")))
    want = checked()

    def in_turn(rounds, inputs):
        counts.update(checked=0, relaunched=0, steps=0, replayed=0, run=0)
        for _ in range(rounds):
            for rows, expected in inputs:
                y = block(rows)
                assert y.shape == rows.shape and torch.equal(y.view(expected.shape), expected)
                y.fill_(float("nan"))
                del y
        return dict(counts)

    unchecked = {"checked": 0, "relaunched": 0, "steps": 0}  # (no launch but the graphs')
    in_turn(3, ((x, want), (x2, want2)))
    assert in_turn(2, ((x, want), (x2, want2))) == unchecked | {"replayed": 4, "run": 4}
    # x of more dims whose bytes are the rows: its call becomes the last one, output in x's shape
    in_turn(2, ((x.view(1, M, H), want),))
    assert in_turn(2, ((x.view(1, M, H), want),)) == unchecked | {"replayed": 2, "run": 0}
    # a launch hook set: the calls go through Triton's launch path, which calls it
    from triton import knobs

    hooked = []
    hook = hooked.append
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert in_turn(2, ((x, want),))["replayed"] == 0 and len(hooked) >= 2 * 2
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    want = checked()
    counts.update(checked=0, relaunched=0, steps=0, replayed=0)
    kept = [block(x) for _ in range(4)]  # outputs kept: after the first, no call repeats one
    assert all(torch.equal(y, want) for y in kept) and counts["steps"] == 0 and counts["checked"] >= 2 * 3, counts
    del kept
    again = calls(4)
    assert again["checked"] <= 2 * 2 and again["replayed"] >= 2, again
    with torch.no_grad():
        x.mul_(0.5)  # the rows in place: the graph reads the new values
        block.w_in.mul_(-1)  # in place: same addresses, new values (a GPT block's column sums follow)
    changed = calls(4)
    assert changed["replayed"] >= 2, changed
    old, block.w_out = block.w_out, replacement  # another tensor: the epilogues are rebuilt, the launches dropped
    with torch.no_grad():
        old.fill_(float("nan"))
    replaced = calls(4)
    assert replaced["checked"] >= 2 * 2 and replaced["replayed"] >= 2, replaced
    want = checked()
    counts.update(replayed=0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    on_side = []
    with torch.cuda.stream(side):  # bound and replayed on that stream (the key's)
        for _ in range(4):
            y = block(x)
            on_side.append(torch.equal(y, want))
            y.fill_(float("nan"))
            del y
    torch.cuda.current_stream().wait_stream(side)
    assert all(on_side) and counts["replayed"] >= 2, (on_side, counts)
    # the last call's rows on its stream, now capturing: nothing bound may launch there (the
    # capture's private pool would also put y and h elsewhere), the checked launches are captured
    counts.update(checked=0, relaunched=0, steps=0, replayed=0, run=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        capturing = bound_stream(torch.cuda.current_device())
        static_y = block(x)
    assert capturing is None
    assert counts == {"checked": 2, "relaunched": 0, "steps": 0, "replayed": 0, "run": 1}, counts
    graph.replay()
    assert torch.equal(static_y, want)


def test_a_bound_block_moved_off_the_gpu_frees_its_weights_there():
    """After calls that bound and replayed a graph (the last call holds its weights' memory),
    ``.cpu()`` frees the block's weights on the GPU at once, and the block moved back runs
    bitwise as before."""
    import gc

    block = small_block("llama", H=2048, inter=4096)
    x = torch.randn(640, 2048, device="cuda").bfloat16()
    want = block(x)
    for _ in range(3):
        assert torch.equal(block(x), want)
    assert block._last is not None
    weights = sum(t.numel() * t.element_size() for t in block._buffers.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    block.cpu()
    gc.collect()
    freed = before - torch.cuda.memory_allocated()
    assert freed >= weights, (freed, weights)
    assert torch.equal(block.cuda()(x), want)


def test_a_bound_block_call_whose_graph_capture_fails_launches_its_steps(monkeypatch):
    """Where the driver refuses the capture of a bound call's launches, the call is still bound
    and launches its steps one by one, bitwise equal to the checked call."""
    from ctapipelining import nn
    from ctapipelining.cugraph import CaptureError
    from ctapipelining.gemm import GemmLaunch

    def refused(*a, **k):
        raise CaptureError("cuStreamBeginCapture failed: CUDA error 900 (refused by the test)")

    block, M = small_block("llama"), 640
    x = torch.randn(M, 1024, device="cuda").bfloat16()
    want = block.run(x, torch.empty_like(x))
    relaunched, real = [], GemmLaunch.relaunch

    def counted(launch, steps, stream):
        relaunched.append(steps)
        return real(launch, steps, stream)

    monkeypatch.setattr(nn, "StreamGraph", refused)
    monkeypatch.setattr(GemmLaunch, "relaunch", counted)
    for _ in range(4):
        assert torch.equal(block(x), want)
    assert len(relaunched) == 2 * 2  # calls 3 and 4: both launches' steps, one by one
    bound = [b for b in block._bound.values() if b is not None]
    assert bound and all(b.graph is None for b in bound)


def test_a_stream_graph_replays_its_launches_on_any_stream_and_a_failed_capture_runs_nothing():
    """:class:`~ctapipelining.cugraph.StreamGraph` records what its function launches (nothing
    runs), replays it on the legacy default stream and on a side stream, in their order; a
    function that raises in the capture raises ``CaptureError`` chained to its error, its
    launches never run, and the capture stream takes the next capture."""
    from ctapipelining.cugraph import CaptureError, StreamGraph

    t = torch.zeros(1000, device="cuda")

    def add(stream):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            t.add_(1)

    def fails(stream):
        add(stream)
        raise ValueError("in the launch")

    default = torch.cuda.default_stream().cuda_stream
    with pytest.raises(CaptureError, match="ValueError: in the launch") as raised:
        StreamGraph(fails, default)
    assert isinstance(raised.value.__cause__, ValueError)
    graph = StreamGraph(add, default)
    torch.cuda.synchronize()
    assert t.eq(0).all()  # recorded, not run
    graph.replay(default)
    t.mul_(10)  # after the first replay, before the second: stream order holds
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph.replay(side.cuda_stream)
    torch.cuda.synchronize()
    assert t.eq(11).all()
