"""Fused epilogues and the Llama MLP block, under the Triton interpreter on the CPU (fp16: the
interpreter computes bf16 dots wrongly); the GPU tests run the same at full size."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter looks it up in a jit function's module)

from ctapipelining import nn
from ctapipelining.epilogue import Epilogue, fold_layer_norm, fold_rms_weight, gelu, interleave, silu
from ctapipelining.gemm import GemmLaunch, matmul, tail_split
from ctapipelining.kernels.gemm import GemmConfig
from ctapipelining.nn import GPTMLP, GPTStack, LlamaMLP, LlamaStack, MLPStack
from ctapipelining.pipeline import Pipeline
from ctapipelining.plan import Segment

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("fused_blocks")]
SMALL = GemmConfig(16, 32, 16, group_m=2, num_stages=2, num_warps=4)
H, INTER = 48, 80  # the gate/up GEMM is 160 wide: 5 tiles of 32


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def hf_block(seed=0, dtype=torch.float16, inter=INTER, eps=1e-5):
    import transformers  # a dev dependency: its absence fails the test, not skips it
    from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        hidden_size=H, intermediate_size=inter, hidden_act="silu", rms_norm_eps=eps, num_attention_heads=4,
        num_key_value_heads=4,
    )  # fmt: skip
    mlp, norm = HFMLP(cfg), LlamaRMSNorm(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
    return mlp.to(dtype), norm.to(dtype)


def reference(mlp, norm, x):
    """The block in float32: ``x + mlp(norm(x))``."""
    x = x.float()
    var = x.pow(2).mean(-1, keepdim=True)
    xn = x * torch.rsqrt(var + norm.variance_epsilon) * norm.weight.float()
    g, u = xn @ mlp.gate_proj.weight.float().t(), xn @ mlp.up_proj.weight.float().t()
    return x + (torch.nn.functional.silu(g) * u) @ mlp.down_proj.weight.float().t()


@pytest.mark.parametrize("M", [1, 37, 100])
def test_llama_block_is_as_accurate_as_transformers(M):
    """Against float32: the fused block's error is at most 2x that of ``transformers``' own
    LlamaMLP + LlamaRMSNorm in the same precision (fp16 here), and the output has no NaN."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(M, H).half() * 3
    ref = reference(mlp, norm, x)
    with torch.no_grad():
        theirs = x + mlp(norm(x))
    ours = block(x)
    assert ours.shape == x.shape and ours.dtype == x.dtype and not ours.isnan().any()
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(ours, ref), rel(theirs, ref))


def test_a_block_without_configurations_takes_narrow_tiles_at_few_rows(monkeypatch):
    """Built without configurations, each GEMM runs ``FEW_ROWS_CONFIGS``' tiles up to 768 rows
    and its default above; a GEMM given a configuration (the default's too) at construction, or
    another one later, runs it at every row count. A call at few rows, and its first GEMM alone,
    launch in those tiles (each a multiple of 16 wide, as a gated epilogue needs), as accurate
    as the Llama test asks."""
    from ctapipelining import deps, nn

    few = nn.FEW_ROWS_CONFIGS
    assert all(c.block_n % 16 == 0 for row in few for c in row[1:])
    # at decode a Llama-8B block's down GEMM (K = 14336, N = 4096: 64 tiles) splits along K on 132 SMs
    assert tail_split(1, 4096, 14336, few[0][2], 132) == deps.TailSplit(0, 64, 2)
    assert tail_split(1, 4096, 14336, nn.DOWN_CONFIG, 132) is None  # (16 tiles, whole)
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm)
    assert block.configs_for(1) == block.configs_for(64) == (few[0][1], few[0][2])
    assert block.configs_for(65) == (nn.GATE_UP_CONFIG, few[1][2])
    assert block.configs_for(129) == block.configs_for(512) == (nn.GATE_UP_CONFIG, few[2][2])
    assert block.configs_for(768) == (nn.GATE_UP_CONFIG, few[3][2])
    assert block.configs_for(769) == block.configs_for(16384) == (nn.GATE_UP_CONFIG, nn.DOWN_CONFIG)
    pinned = LlamaMLP.from_hf(mlp, norm, gate_up_config=nn.GATE_UP_CONFIG, down_config=nn.DOWN_CONFIG)
    assert pinned.configs_for(1) == (nn.GATE_UP_CONFIG, nn.DOWN_CONFIG)
    given = LlamaMLP.from_hf(mlp, norm, down_config=SMALL)
    assert given.configs_for(1) == (few[0][1], SMALL) and given.configs_for(300) == (nn.GATE_UP_CONFIG, SMALL)
    given.in_config = SMALL
    assert given.configs_for(1) == (SMALL, SMALL)
    gpt, few_gpt = GPTMLP.from_hf(*gpt_block()), nn.GPT_FEW_ROWS_CONFIGS  # (its own table: a narrower first GEMM)
    assert all(c.block_n % 16 == 0 for row in few_gpt for c in row[1:])
    assert gpt.configs_for(16) == (few_gpt[0][1], few_gpt[0][2]) and not few_gpt[0][1].split_k
    assert [row[0] for row in few_gpt[:5]] == [64, 128, 256, 320, 384]  # each row's last height
    assert gpt.configs_for(65) == gpt.configs_for(128) == (few_gpt[1][1], few_gpt[1][2])
    assert gpt.configs_for(129) == gpt.configs_for(256) == (nn.EPILOGUE_CONFIG, few_gpt[2][2])
    # 257-320 rows: both GEMMs in the 64 x 128 x 128 tiles of its down GEMM at 129-256
    assert few_gpt[3][0] == 320 and few_gpt[3][1] == few_gpt[3][2] == few_gpt[2][2]
    assert gpt.configs_for(257) == gpt.configs_for(320) == (few_gpt[2][2], few_gpt[2][2])
    # 321-384 rows: the first GEMM in 64 x 256 whole tiles again, past them the Llama table's 128-row ones
    assert few_gpt[4][0] == 384 and few_gpt[4][1] == few_gpt[1][1] and not few_gpt[4][1].split_k
    assert gpt.configs_for(321) == gpt.configs_for(384) == (few_gpt[4][1], few[2][2])
    assert gpt.configs_for(385) == gpt.configs_for(512) == (nn.UP_CONFIG, few[2][2])
    assert gpt.configs_for(4096) == (nn.UP_CONFIG, nn.DOWN_CONFIG)
    launched = []
    for name in ("matmul", "launch_checked"):
        real = getattr(nn, name)
        monkeypatch.setattr(nn, name, lambda *a, real=real, **k: launched.append(a[3] if len(a) > 3 else k["config"])
                            or real(*a, **k))  # fmt: skip
    x = torch.randn(3, H).half() * 3
    ours = block(x)
    assert launched == [few[0][1], few[0][2]]
    block.first_gemm(x)
    assert launched[2:] == [few[0][1]]
    ref = reference(mlp, norm, x)
    with torch.no_grad():
        theirs = x + mlp(norm(x))
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(ours, ref), rel(theirs, ref))
    # a GPT block at few rows launches its own table's tiles (its first GEMM whole, not split along
    # K), and at 257-320 and 321-384 rows (64 x 128 x 128 tiles, then whole 64 x 256 ones), as accurate
    g_mlp, g_norm = gpt_block()
    for xm, row in ((x, few_gpt[0]), (torch.randn(300, H).half() * 3, few_gpt[3]),
                    (torch.randn(350, H).half() * 3, few_gpt[4])):  # fmt: skip
        M = xm.shape[0]
        del launched[:]
        ours = gpt(xm)
        assert launched == [row[1], row[2]]
        with torch.no_grad():
            theirs = xm + g_mlp(g_norm(xm))
        ref = gpt_reference(g_mlp, g_norm, xm)
        assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (M, rel(ours, ref), rel(theirs, ref))


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_block_runs_unfused_at_its_tables_rows_and_only_there(kind, monkeypatch):
    """At the row counts of its class's ``unfused_rows`` (here 2-40), a block whose GEMMs are
    left to their defaults runs ``unfused``: no kernel of ours launched, eagerly, through the
    custom operator, and as a stack's block alike, as accurate as ``transformers``' block (GPT:
    also on rows whose mean is 30x their spread), within a rounding of the fused block. Outside
    them, or with a GEMM given a configuration, it runs fused. ``unfused`` checks its input."""
    cls, make, ref_of = (LlamaMLP, hf_block, reference) if kind == "llama" else (GPTMLP, gpt_block, gpt_reference)
    monkeypatch.setattr(cls, "unfused_rows", ((2, 40),))
    mlp, norm = make()
    block = cls.from_hf(mlp, norm)
    launched = []
    for name in ("matmul", "launch_checked"):
        real = getattr(nn, name)
        monkeypatch.setattr(nn, name, lambda *a, real=real, name=name, **k: launched.append(name) or real(*a, **k))
    for offset in (0.0, 30.0) if kind == "gpt" else (0.0,):
        x = (torch.randn(5, H) * 3 + offset).half()
        ours = block(x)
        assert launched == [] and block.runs_unfused(5)
        assert torch.equal(ours, block.unfused(x))
        assert torch.equal(ours, torch.ops.ctapipelining.mlp_block(x, block.w_in, block.w_out, block._key))
        assert torch.equal(block(x.view(1, 5, H)), ours.view(1, 5, H))
        ref = ref_of(mlp, norm, x)
        with torch.no_grad():
            theirs = x + mlp(norm(x))
        assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (offset, rel(ours, ref), rel(theirs, ref))
    fused = cls.from_hf(mlp, norm, **{k: SMALL for k in block_configs(kind)})
    assert not fused.runs_unfused(5) and rel(fused(x), ours) < 3e-3
    assert len(launched) == 2  # (the fused block's two GEMMs)
    del launched[:]
    block(torch.randn(41, H).half())  # past the table's rows
    assert len(launched) == 2 and not block.runs_unfused(41) and not block.runs_unfused(1)
    assert block.runs_unfused(2) and block.runs_unfused(40)  # (its ends included)
    del launched[:]
    assert block.unfused(torch.zeros(0, H).half()).shape == (0, H)
    with torch.no_grad():  # a source changed in place: followed (laid out again) first
        mlp.c_fc.weight.mul_(-1) if kind == "gpt" else mlp.up_proj.weight.mul_(-1)
    want = cls.from_hf(mlp, norm).unfused(x)
    assert torch.equal(block.unfused(x), want) and torch.equal(block(x), want) and launched == []
    stack = (LlamaStack if kind == "llama" else GPTStack)([block, cls.from_hf(*make(1))], loopback=False)
    assert stack.blocks_apart()  # (on the CPU a pipeline is a loopback unless told otherwise)
    assert torch.equal(stack(x), stack.blocks[1].unfused(block.unfused(x))) and launched == []
    assert torch.equal(stack.sequential(x), stack(x))
    for name in ("in_config", "out_config"):  # a GEMM given a configuration: fused at every row count
        setattr(block, name, SMALL)
        assert not block.runs_unfused(5)
        block(x)
        assert len(launched) == 2
        del launched[:]
        setattr(block, name, None)
    assert block.runs_unfused(5)
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 48\]"):
        block.unfused(torch.zeros(5, H + 1).half())
    with pytest.raises(ValueError, match="the block is torch.float16"):
        block.unfused(torch.zeros(5, H))
    block.unfused_rows = ()  # this block's own ranges: none, fused at every row count
    assert not block.runs_unfused(5) and cls.unfused_rows == ((2, 40),)
    block(x)
    assert len(launched) == 2
    for bad in (((40, 2),), ((0, 3),), ((1, 5), (5, 9)), ((1.0, 5),), (1, 5), "x"):
        with pytest.raises(ValueError, match="unfused_rows must be"):
            block.unfused_rows = bad
    block.unfused_rows = [(3, 9)]
    assert block.unfused_rows == ((3, 9),) and block.runs_unfused(5)


def test_the_calls_a_block_bound_go_when_a_table_that_chose_them_is_replaced(monkeypatch):
    """A block's bound calls (and its last call, which ``forward`` replays before any check)
    were chosen under its tables: replacing the class's ``unfused_rows`` or ``few_rows_configs``
    (or setting the block's own ranges) drops them at the next lookup, so the call runs where
    the tables now say. Left alone, they stay."""
    block = LlamaMLP.from_hf(*hf_block())

    def bound_then(change):
        block._bound, block._last = {"a call": None}, "bound"  # (as a GPU call leaves them)
        change()
        return block._bound_calls(), block._last

    assert bound_then(lambda: None) == ({"a call": None}, "bound")
    assert bound_then(lambda: monkeypatch.setattr(LlamaMLP, "unfused_rows", ((2, 40),))) == ({}, None)
    assert bound_then(lambda: None) == ({"a call": None}, "bound")
    assert bound_then(lambda: monkeypatch.setattr(LlamaMLP, "few_rows_configs", nn.GPT_FEW_ROWS_CONFIGS)) == ({}, None)
    assert bound_then(lambda: setattr(block, "unfused_rows", ((3, 9),))) == ({}, None)
    assert bound_then(lambda: monkeypatch.setattr(LlamaMLP, "unfused_rows", ())) == ({"a call": None}, "bound")
    x = torch.randn(5, H).half()
    block._last = "bound"  # forward's replay looks first: a last call chosen under the old table is not run
    monkeypatch.setattr(LlamaMLP, "few_rows_configs", nn.FEW_ROWS_CONFIGS)
    assert block._replay(x) is None and block._last is None


def test_a_block_class_without_an_unfused_form_runs_fused_and_refuses_unfused_rows():
    """A ``FusedMLP`` subclass that defines no unfused form has no unfused rows, and refuses them."""

    class Plain(LlamaMLP):
        _unfused_first = nn.FusedMLP._unfused_first
        unfused_rows = nn.FusedMLP.unfused_rows

    block = Plain.from_hf(*hf_block())
    assert not block.runs_unfused(300) and nn.FusedMLP.unfused_rows == ()
    with pytest.raises(ValueError, match="has no unfused form"):
        block.unfused_rows = ((1, 2),)
    with pytest.raises(NotImplementedError, match="has no unfused form"):
        block.unfused(torch.zeros(2, H).half())


def block_configs(kind: str) -> tuple[str, str]:
    """A block class's configuration keywords."""
    return ("gate_up_config", "down_config") if kind == "llama" else ("up_config", "down_config")


def test_the_unfused_tables_are_ordered_ranges_of_rows():
    """Each class's ``unfused_rows``: ranges ``lo <= hi`` of positive row counts, in order, apart."""
    for ranges in (nn.LLAMA_UNFUSED_ROWS, nn.GPT_UNFUSED_ROWS):
        assert nn._checked_ranges(ranges) == ranges
        assert all(0 < lo <= hi for lo, hi in ranges), ranges
        assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:])), ranges


def test_a_gated_block_whose_last_output_tile_is_ragged():
    """An intermediate size whose gate/up GEMM (80 columns: tiles of 32, 32 and 16) ends in a
    partial tile, as real models' do (DeepSeek-V2-Lite's 10944 on 256-wide tiles): as accurate
    as the Llama test asks."""
    mlp, norm = hf_block(inter=40)
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(37, H).half() * 3
    ref = reference(mlp, norm, x)
    with torch.no_grad():
        theirs = x + mlp(norm(x))
    ours = block(x)
    assert not ours.isnan().any() and rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), rel(ours, ref)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_the_norms_epsilon_weighs_on_tiny_rows_and_a_zero_row_stays_finite(kind):
    """A norm with a distinctive epsilon (1e-2), rows of tiny magnitude (where it weighs: a block
    that dropped or misread it errs there by orders of magnitude) and a zero row: each row's
    error against float32 at most 2x that of ``transformers``' block in fp16 (or 1e-3 of the
    row), and the zero row finite (a Llama block's exactly zero)."""
    if kind == "llama":
        mlp, norm = hf_block(eps=1e-2)
        block, ref_of = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL), reference
    else:
        mlp, norm = gpt_block(eps=1e-2)
        block, ref_of = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL), gpt_reference
    scale = torch.tensor([3.0, 1.0, 3e-2, 1e-2, 3e-3, 1e-3, 0.0])[:, None]
    x = (torch.randn(7, H) * scale).half()
    ref = ref_of(mlp, norm, x)
    with torch.no_grad():
        theirs = (x + mlp(norm(x))).float()
    ours = block(x).float()
    assert torch.isfinite(ours).all()
    if kind == "llama":
        assert torch.equal(ours[-1], torch.zeros(H))
    err, their_err = (ours - ref).norm(dim=-1), (theirs - ref).norm(dim=-1)
    assert (err <= torch.maximum(2 * their_err, 1e-3 * ref.norm(dim=-1))).all(), (err, their_err)


class OnePlus(torch.nn.Module):
    """An RMSNorm ``x_hat * (offset + weight)`` (Gemma's and Qwen3-Next's: offset 1), its
    epsilon kept under ``eps_name``."""

    def __init__(self, eps_name, eps, offset):
        super().__init__()
        self.weight, self.offset, self.e = torch.nn.Parameter(0.1 * torch.randn(H).half()), offset, eps
        setattr(self, eps_name, eps)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.e)
        return (xf * (self.offset + self.weight.float())).half()


def test_a_norm_of_another_form_is_refused_when_building_from_transformers():
    """A norm the fold would get wrong: a Gemma/Qwen3-Next-style RMSNorm (``x_hat * (1 +
    weight)``), one a tenth as far off (``x_hat * (0.01 + weight)`` with weights near 0.1: about
    10%, well past the probe's 2% bound) and one whose epsilon is kept under a name the block
    does not read (1e-2 in ``epsilon``, read as 1e-6): refused, naming what it does not compute."""
    mlp, _ = hf_block()

    near_miss = OnePlus("variance_epsilon", 1e-6, 0.01)
    for norm in (OnePlus("variance_epsilon", 1e-6, 1.0), near_miss, OnePlus("epsilon", 1e-2, 0.0)):
        with pytest.raises(ValueError, match="does not compute x \\* rsqrt"):
            LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    LlamaMLP.from_hf(mlp, OnePlus("variance_epsilon", 1e-2, 0.0), gate_up_config=SMALL, down_config=SMALL)


def test_a_transformers_mlp_the_block_does_not_compute_is_refused():
    """A Llama MLP with another activation (GELU) or with biases, and a GPT-2 MLP whose
    activation is not GELU's tanh form (ReLU): refused when built, naming what differs."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
    from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def llama(**kw):
        cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=INTER, num_attention_heads=4, **kw)
        return HFMLP(cfg).half(), LlamaRMSNorm(H).half()

    with pytest.raises(ValueError, match="only a SiLU-gated MLP fuses here, got GELUActivation"):
        LlamaMLP.from_hf(*llama(hidden_act="gelu"), gate_up_config=SMALL, down_config=SMALL)
    with pytest.raises(ValueError, match="gate_proj has a bias: a Llama MLP has none"):
        LlamaMLP.from_hf(*llama(hidden_act="silu", mlp_bias=True), gate_up_config=SMALL, down_config=SMALL)
    relu = GPT2MLP(INTER, transformers.GPT2Config(n_embd=H, n_head=4, activation_function="relu")).half()
    with pytest.raises(ValueError, match="only GELU's tanh form \\(gelu_new\\) fuses here, got ReLU"):
        GPTMLP.from_hf(relu, torch.nn.LayerNorm(H).half(), up_config=SMALL, down_config=SMALL)


def test_a_norm_built_on_the_meta_device_is_probed_once_it_is_real():
    """Deferred initialisation: a block built from modules on the meta device builds (nothing
    to probe yet); once the modules (and the block, ``to_empty``) hold real memory, laying the
    weights out again probes the norm, and a norm of another form is refused then."""
    real_mlp, real_norm = hf_block()
    for kind in ("one plus", "llama"):
        with torch.device("meta"):
            mlp, norm = hf_block()
            norm = OnePlus("variance_epsilon", 1e-5, 1.0) if kind == "one plus" else norm
        block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
        mlp.to_empty(device="cpu").load_state_dict(real_mlp.state_dict())
        norm.to_empty(device="cpu")
        block.to_empty(device="cpu")
        with torch.no_grad():
            norm.weight.copy_(real_norm.weight)
        if kind == "one plus":
            with pytest.raises(ValueError, match="does not compute"):
                block.refresh()
            continue
        block.refresh()
        x = torch.randn(5, H).half()
        assert rel(block(x), reference(mlp, norm, x)) < 5e-3


def test_the_operator_writes_none_of_its_inputs_and_a_moved_source_is_followed_outside_it():
    """``mlp_block``'s schema mutates nothing: with its source changed in place, the operator
    refuses (laying the weights out again would write its inputs) and leaves them as they
    were; an eager call lays them out again and is right. Keys are unique (uuid), so a program
    traced in another process finds no block rather than another one."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    block(x)
    w_in = block.w_in.clone()
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)
    with pytest.raises(RuntimeError, match="changed since it was laid out"):
        torch.ops.ctapipelining.mlp_block(x, block.w_in, block.w_out, block._key)
    assert torch.equal(block.w_in, w_in)
    assert rel(block(x), reference(mlp, norm, x)) < 5e-3
    other = LlamaMLP.from_hf(*hf_block(seed=1), gate_up_config=SMALL, down_config=SMALL)
    assert len({block._key, other._key}) == 2 and len(block._key) > 32
    with pytest.raises(RuntimeError, match="another process"):
        torch.ops.ctapipelining.mlp_block(x, block.w_in, block.w_out, "mlp_block_0")


def test_a_source_storage_freed_and_replaced_at_its_address_is_seen():
    """A source weight's storage held weakly: a replacement at the same address with the same
    version (what a caching allocator hands back) still counts as a change."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    assert not block._source_moved()
    ref, ptr, version = block._source_versions[0]
    dead = torch.empty(4).untyped_storage()
    from torch.multiprocessing.reductions import StorageWeakRef

    stale = StorageWeakRef(dead)
    del dead  # its weak reference expires: the storage it named is gone
    block._source_versions = ((stale, ptr, version), *block._source_versions[1:])
    assert block._source_moved()


@pytest.mark.parametrize("stacked", [False, True])
def test_a_gpt_blocks_column_sums_follow_its_laid_out_weight_changed_in_place(stacked):
    """The column sums the LayerNorm fold subtracts are derived from the laid-out first weight:
    after an in-place change of ``block.w_in`` the next call (of the block, or of a pipelined
    stack of it) equals a copy of the block made after the change, whose epilogues are built
    afresh (rows whose mean is 30x their spread: stale sums would be far off)."""
    import copy

    blocks = [GPTMLP.from_hf(*gpt_block(seed), up_config=SMALL, down_config=SMALL) for seed in (0, 1)]
    x = (torch.randn(9, H) + 30).half()
    run = GPTStack(blocks, config=SMALL, always_pipelined=True) if stacked else blocks[0]
    run(x)
    with torch.no_grad():
        blocks[0].w_in.mul_(1.5)
    fresh = [copy.deepcopy(b) for b in blocks]
    want = fresh[1](fresh[0](x)) if stacked else fresh[0](x)
    assert rel(run(x), want) < (2e-3 if stacked else 1e-6)


def test_a_refused_refresh_changes_nothing_and_run_checks_out_before_writing():
    """A refresh whose source changed in two ways, one refused (a bias gone), leaves every
    laid-out buffer as it was; ``run`` with an ``out`` the second GEMM would refuse (padded
    rows, or its own weight) refuses before the first GEMM writes anything."""
    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    before = {k: v.clone() for k, v in block._buffers.items() if v is not None}
    with torch.no_grad():
        mlp.c_fc.weight.mul_(1.5)
    mlp.c_proj.bias = None
    with pytest.raises(ValueError, match="changed shape, dtype or device"):
        block.refresh()
    assert all(torch.equal(block._buffers[k], v) for k, v in before.items())
    llama = LlamaMLP.from_hf(*hf_block(), gate_up_config=SMALL, down_config=SMALL)
    rows = torch.randn(8, H).half()
    out = torch.full((8, H + 8), float("nan")).half()[:, :H]
    h = torch.full((8, INTER), float("nan")).half()
    with pytest.raises(ValueError, match="out must be a contiguous"):
        llama.run(rows, out, h)
    assert out.isnan().all() and h.isnan().all()
    out = torch.full((8, H), float("nan")).half()
    for bad_h, match in (
        (torch.full((8, 2 * INTER), float("nan")).half()[:, :INTER], "h must be contiguous"),  # padded rows
        (torch.full((8, INTER + 8), float("nan")).half(), r"h must be a \[8, 80\]"),
    ):  # (what the second GEMM would refuse as its input: refused before the first writes out or h)
        with pytest.raises(ValueError, match=match):
            llama.run(rows, out, bad_h)
        assert out.isnan().all() and bad_h.isnan().all()
    w_out = llama.w_out.clone()
    with pytest.raises(ValueError, match="out shares memory"):
        llama.run(rows, llama.w_out[:8])  # the second GEMM's own weight: refused before the first writes it
    assert torch.equal(llama.w_out, w_out)
    gpt = GPTMLP.from_hf(*gpt_block(), up_config=SMALL, down_config=SMALL)
    b_out = gpt.b_out.clone()
    with pytest.raises(ValueError, match="out shares memory"):
        gpt.run(rows[:1], gpt.b_out.view(1, H))  # the second GEMM's bias
    assert torch.equal(gpt.b_out, b_out)


def test_block_takes_any_leading_shape_and_refreshes_from_its_source():
    mlp, norm = hf_block(1)
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(2, 5, H).half()
    y = block(x)
    assert y.shape == (2, 5, H)
    assert torch.equal(y.reshape(10, H), block(x.reshape(10, H)))
    # rows with a wider stride, or columns apart: the block reads them as rows of H, contiguous
    wide, cols = torch.randn(10, H + 8).half(), torch.randn(H, 10).half()
    for strided in (wide[:, :H], cols.t()):
        before = strided.clone()
        assert torch.equal(block(strided), block(strided.contiguous())) and torch.equal(strided, before)
    with torch.no_grad():
        mlp.down_proj.weight.mul_(2)  # an in-place change PyTorch counts: the next call lays it out again
    doubled = block(x)
    assert rel(doubled - x, 2 * (y - x)) < 1e-2
    mlp.down_proj.weight.data.mul_(0.5)  # one it does not count: the block keeps its layout until refresh()
    assert torch.equal(block(x), doubled)
    block.refresh()
    assert torch.equal(block(x), y)


def test_epilogues_on_a_plain_gemm():
    """Each step of an epilogue alone and together, against float32: RMSNorm rows, a GELU with
    a bias, a gated SiLU (half-width output), a residual."""
    torch.manual_seed(0)
    M, K, N = 40, 48, 64
    a, w = torch.randn(M, K).half(), (torch.randn(K, N) / K**0.5).half()
    af, wf = a.float(), w.float()
    bias = torch.randn(N).half()
    y = matmul(a, w, config=SMALL, epilogue=Epilogue(gelu, bias=bias))
    assert rel(y, torch.nn.functional.gelu(af @ wf + bias.float(), approximate="tanh")) < 5e-4  # (fp16: ~2e-4)
    g = (1 + 0.1 * torch.randn(K)).half()
    y = matmul(a, fold_rms_weight(g, w), config=SMALL, epilogue=Epilogue(rms_eps=1e-6))
    ref = (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + 1e-6) * g.float()) @ wf
    assert rel(y, ref) < 2e-3
    up = (torch.randn(K, N) / K**0.5).half()
    y = matmul(a, interleave(w, up), config=SMALL, epilogue=Epilogue(silu, gated=True))
    assert y.shape == (M, N)
    assert rel(y, torch.nn.functional.silu(af @ wf) * (af @ up.float())) < 2e-3
    res = torch.randn(M, N).half()
    y = matmul(a, w, config=SMALL, epilogue=Epilogue(residual=True), residual=res)
    assert rel(y, af @ wf + res.float()) < 2e-3


def test_a_split_tail_applies_the_epilogue_to_each_summed_tile():
    """A gated SiLU with an RMSNorm on a GEMM whose partial last round is split along K: the CTA
    that sums a tail tile's slices applies the epilogue to the whole tile (against float32, and
    within a rounding of the same GEMM on whole tiles); a bias, a GELU and a residual too."""
    torch.manual_seed(1)
    M, K, inter = 40, 48, 32
    a = torch.randn(M, K).half()
    gate, up = ((torch.randn(K, inter) / K**0.5).half() for _ in range(2))
    split = dataclasses.replace(SMALL, split_tail=True)
    assert tail_split(M, 2 * inter, K, split, 4) is not None  # 6 tiles on the interpreter's 4 CTAs
    epi = Epilogue(silu, gated=True, rms_eps=1e-5)
    y = matmul(a, interleave(gate, up), config=split, epilogue=epi)
    af = a.float() * torch.rsqrt(a.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    ref = torch.nn.functional.silu(af @ gate.float()) * (af @ up.float())
    assert rel(y, ref) < 2e-3
    assert (y.float() - matmul(a, interleave(gate, up), config=SMALL, epilogue=epi).float()).abs().max() < 2e-3
    # a bias, a GELU and a residual, each added once to a tail tile (after its slices are summed)
    w, bias, res = (torch.randn(K, 64) / K**0.5).half(), torch.randn(64).half(), torch.randn(M, 64).half()
    y = matmul(a, w, config=split, epilogue=Epilogue(gelu, bias=bias, residual=True), residual=res)
    ref = torch.nn.functional.gelu(a.float() @ w.float() + bias.float(), approximate="tanh") + res.float()
    assert rel(y, ref) < 2e-3


def test_bad_epilogues_are_refused_before_launch():
    a, w = torch.randn(32, 48).half(), torch.randn(48, 64).half()
    with pytest.raises(TypeError, match="@triton.jit"):
        Epilogue(torch.nn.functional.silu)
    with pytest.raises(ValueError, match="needs its activation"):
        Epilogue(gated=True)
    with pytest.raises(ValueError, match="rms_eps"):
        Epilogue(rms_eps=0.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        matmul(a, torch.randn(48, 72).half(), config=SMALL, epilogue=Epilogue(silu, gated=True))
    with pytest.raises(ValueError, match="multiple of 8"):  # gate and up columns in runs of 8
        interleave(torch.zeros(48, 12).half(), torch.zeros(48, 12).half())
    with pytest.raises(ValueError, match="block_n must be at least 16"):  # narrower than a run of gate and of up
        GemmConfig(16, 8, 16)
    with pytest.raises(ValueError, match="halves B's 40 columns"):  # the launch a pipeline binds
        GemmLaunch(32, 40, 48, SMALL, 4, a.device, epilogue=Epilogue(silu, gated=True))
    with pytest.raises(ValueError, match="bias must be a \\[64\\]"):
        matmul(a, w, config=SMALL, epilogue=Epilogue(silu, gated=True, bias=torch.zeros(32).half()))
    with pytest.raises(ValueError, match="pass residual exactly"):
        matmul(a, w, config=SMALL, epilogue=Epilogue(residual=True))
    with pytest.raises(ValueError, match="pass residual exactly"):
        matmul(a, w, config=SMALL, residual=torch.zeros(32, 64).half())
    with pytest.raises(ValueError, match="residual must be a \\[32, 64\\]"):
        matmul(a, w, config=SMALL, epilogue=Epilogue(residual=True), residual=torch.zeros(32, 32).half())
    with pytest.raises(ValueError, match="shapes do not make a block"):
        LlamaMLP(torch.zeros(80, 48), torch.zeros(80, 48), torch.zeros(80, 48), torch.zeros(48))
    gate, down, g = torch.zeros(80, 48).half(), torch.zeros(48, 80).half(), torch.ones(48).half()
    for bad in (gate.to_sparse(), torch.nested.nested_tensor(list(gate))):  # refused by name, not by torch
        with pytest.raises(TypeError, match="w_gate must be a dense"):
            LlamaMLP(bad, gate, down, g)
        with pytest.raises(TypeError, match="w_1 must be a dense"):
            GPTMLP(bad, None, down, None, g, None)
    with pytest.raises(TypeError, match="norm_bias must be a dense"):
        GPTMLP(gate, None, down, None, g, g.to_sparse())
    block = LlamaMLP(*(torch.zeros(s).half() for s in ((80, 48), (80, 48), (48, 80), (48,))), 1e-5)
    with pytest.raises(ValueError, match="x must be"):
        block(torch.zeros(4, 40).half())
    with pytest.raises(ValueError, match="x is torch.float32"):
        block(torch.zeros(4, 48))
    rows = torch.zeros(4, 48).half()
    for module in (block, LlamaStack([block, block])):  # inputs refused by name, not by torch
        for bad, what in ((rows.to_sparse(), "torch.sparse_coo"), (torch.nested.nested_tensor(list(rows)), "nested")):
            with pytest.raises(TypeError, match=f"x must be a dense \\(strided\\) tensor, got one .*{what}"):
                module(bad)


def test_blocks_and_stacks_the_kernels_cannot_take_are_refused_when_built():
    """Sizes that are not multiples of 8 (TMA rows), an epsilon that is not a float > 0, and a
    stack whose blocks differ in hidden size or dtype: refused when built, naming what is wrong."""
    g = torch.ones(H).half()

    def llama(inter=INTER, hidden=H, **kw):
        ws = (torch.zeros(inter, hidden), torch.zeros(inter, hidden), torch.zeros(hidden, inter), torch.ones(hidden))
        return LlamaMLP(*(w.half() for w in ws), **kw)

    for inter, hidden in ((84, H), (INTER, 44)):
        with pytest.raises(ValueError, match=f"hidden \\({hidden}\\) and intermediate \\({inter}\\) sizes"):
            llama(inter, hidden)
    with pytest.raises(ValueError, match="multiples of 8"):
        GPTMLP(torch.zeros(84, H).half(), None, torch.zeros(H, 84).half(), None, g, None)
    for eps in (0.0, -1e-5, 1):
        with pytest.raises(ValueError, match=f"eps must be a float > 0, got {eps!r}"):
            llama(eps=eps)
        with pytest.raises(ValueError, match="eps must be a float > 0"):
            GPTMLP(torch.zeros(INTER, H).half(), None, torch.zeros(H, INTER).half(), None, g, None, eps)
    with pytest.raises(ValueError, match="block 1 is hidden=48 torch.bfloat16; block 0 is hidden=48 torch.float16"):
        LlamaStack([llama(), llama().to(torch.bfloat16)])
    with pytest.raises(ValueError, match="block 1 is hidden=56 torch.float16; block 0 is hidden=48"):
        LlamaStack([llama(), llama(hidden=56)])
    with pytest.raises(TypeError, match="w_up must be a torch.Tensor, got list"):
        LlamaMLP(torch.zeros(INTER, H).half(), [0.0] * H, torch.zeros(H, INTER).half(), g)
    with pytest.raises(ValueError, match="the block's weights must share one dtype and one device"):
        LlamaMLP(torch.zeros(INTER, H).half(), torch.zeros(INTER, H).float(), torch.zeros(H, INTER).half(), g)
    with pytest.raises(RuntimeError, match="this block was built from tensors"):
        llama().refresh()
    with pytest.raises(ValueError, match="2 MLPs but 1 norms"):
        LlamaStack.from_hf([hf_block()[0]] * 2, [hf_block()[1]])


def test_weights_put_in_after_construction_are_checked_before_the_next_call(monkeypatch):
    """A block checks its weights and epilogues again whenever a buffer's signature or a
    configuration changes (what its own call skips ``matmul``'s checks on): a replaced weight of
    the wrong shape, dtype or layout is refused with a clear error before anything runs; put
    back, the block runs; a configuration put in runs at the next call."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    want = block(x)
    good = block.w_in
    for bad, match in (
        (torch.zeros(H + 8, 2 * INTER).half(), "do not make a block"),
        (good.float(), "do not make a block|dtype"),
        (good.t().contiguous().t(), "contiguous"),
        (good[:, : 2 * INTER - 16].contiguous(), "do not make a block"),
        (good.to_sparse(), "dense"),
    ):
        block.w_in = bad
        with pytest.raises((ValueError, TypeError), match=match):
            block(x)
    block.w_in = good
    block.in_config = GemmConfig(16, 16, 16, group_m=1, num_stages=2, num_warps=4)  # runs at the next call
    ran = []
    monkeypatch.setattr(nn, "matmul", lambda *a, **kw: ran.append(kw["config"]) or matmul(*a, **kw))
    assert torch.equal(block(x), want)  # (the interpreter rounds both tiles alike)
    assert ran == [block.in_config, SMALL]
    block.in_config = SMALL
    assert torch.equal(block(x), want) and ran[2:] == [SMALL, SMALL]


def test_the_block_is_an_operator_torch_compile_traces_without_a_graph_break():
    """``forward`` calls ``torch.ops.ctapipelining.mlp_block``: its schema and fake (shape)
    implementation pass PyTorch's checks, and a compiled model around the block traces as one
    graph (``fullgraph=True`` raises on a graph break) and computes what the eager block does."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(2, 5, H).half()
    rows = x.reshape(-1, H).contiguous()
    torch.library.opcheck(
        torch.ops.ctapipelining.mlp_block.default, (rows, block.gate_up, block.down, block._key),
        test_utils=("test_schema", "test_faketensor"),
    )  # fmt: skip

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block(x * 2) + 1

    compiled = torch.compile(Model(), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), block(x * 2) + 1)


def test_a_source_changed_before_the_block_was_built_is_not_taken_for_moved_inside_a_compiled_graph():
    """A GPT block keeps its ``Conv1D`` weights' transposes; a compiled graph's runtime runs the
    operator below autograd's view tracking, where a view made of a weight does not share its
    version counter. A source changed in place before the block was built (version 1) then
    still reads as unchanged there, and a change after it still reads as a change."""
    mlp, norm = gpt_block()
    with torch.no_grad():
        mlp.c_fc.weight.mul_(1.5)  # its version moves to 1
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = torch.randn(3, H).half()
    want = block(x)
    with torch._C._AutoDispatchBelowADInplaceOrView():  # as Inductor's runtime calls the operator
        assert not block._source_moved()
        assert torch.equal(block(x), want)
    with torch.no_grad():
        mlp.c_proj.weight.mul_(2)
    with torch._C._AutoDispatchBelowADInplaceOrView():
        assert block._source_moved()


def test_an_eager_call_runs_the_kernels_without_the_operator_and_a_traced_one_through_it(monkeypatch):
    """An eager call on a plain tensor skips the operator's dispatch (host time before the first
    kernel) and equals the operator's result; a fake tensor (what a compiler traces with) and an
    input that asks for a gradient go through the operator (its fake, its refusal); so does a
    stack's. A source changed in place is followed before such a call reaches the operator."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import ctapipelining.nn as cnn

    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    stack = LlamaStack([block, block])
    dispatched = []
    for name in ("mlp_block", "mlp_stack"):
        op = getattr(cnn, name)
        monkeypatch.setattr(cnn, name, lambda *a, op=op, name=name: dispatched.append(name) or op(*a))
    x = torch.randn(4, H).half()
    y, ys = block(x), stack(x)
    assert dispatched == []
    assert torch.equal(y, torch.ops.ctapipelining.mlp_block(x, block.w_in, block.w_out, block._key))
    assert torch.equal(ys, torch.ops.ctapipelining.mlp_stack(x, stack._weights(), stack._key))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:  # the weights stay real
        fake = mode.from_tensor(x)
        assert block(fake).shape == x.shape and stack(fake).shape == x.shape
    assert dispatched == ["mlp_block", "mlp_stack"]
    block(x.clone().requires_grad_())
    assert dispatched[-1] == "mlp_block"
    # what records or transforms the call sees the operator, and still gets the block's result
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen():
        assert torch.equal(block(x), y)
    assert "ctapipelining.mlp_block.default" in Seen.ops
    traced = torch.jit.trace(block, x, check_trace=False)
    x2 = torch.randn(4, H).half()
    assert "ctapipelining::mlp_block" in str(traced.graph) and torch.equal(traced(x2), block(x2))
    assert torch.equal(torch.vmap(block)(torch.stack([x, x2])), torch.stack([y, block(x2)]))
    assert dispatched[-3:] == ["mlp_block"] * 3  # the dispatch mode, the trace, vmap
    with torch.no_grad():
        mlp.down_proj.weight.mul_(2)  # followed before the operator (which writes none of its inputs) is called
    assert torch.equal(block(x.clone().requires_grad_()), LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL,
                       down_config=SMALL)(x))  # fmt: skip


def test_a_copied_block_runs_its_own_weights():
    """A deep copy runs its own laid-out weights (changing them leaves the original's as they
    were) and outlives the original; a copy of a block whose source changed in place since its
    last call starts in step with that source (deep-copied or pickled)."""
    import copy
    import pickle

    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    twin = copy.deepcopy(block)
    with torch.no_grad():
        twin.down.mul_(2)
    x = torch.randn(7, H).half()
    assert not torch.equal(twin(x), block(x))
    del block
    assert twin(x).shape == x.shape
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    for clone in (copy.deepcopy, lambda b: pickle.loads(pickle.dumps(b))):
        with torch.no_grad():
            mlp.down_proj.weight.mul_(2)
        assert torch.equal(clone(block)(x), LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)(x))


def gpt_block(seed=0, dtype=torch.float16, eps=1e-5):
    import transformers  # a dev dependency: its absence fails the test, not skips it
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=H, n_head=4, activation_function="gelu_new", layer_norm_epsilon=eps)
    mlp, norm = GPT2MLP(INTER, cfg).eval(), torch.nn.LayerNorm(H, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
        norm.bias.copy_(0.1 * torch.randn(H))
        mlp.c_fc.bias.copy_(0.1 * torch.randn(INTER))
        mlp.c_proj.bias.copy_(0.1 * torch.randn(H))
    return mlp.to(dtype), norm.to(dtype)


def gpt_reference(mlp, norm, x):
    """The GPT block in float32: ``x + mlp(layernorm(x))``."""
    x = x.float()
    xn = torch.nn.functional.layer_norm(x, (H,), norm.weight.float(), norm.bias.float(), norm.eps)
    h = torch.nn.functional.gelu(xn @ mlp.c_fc.weight.float() + mlp.c_fc.bias.float(), approximate="tanh")
    return x + h @ mlp.c_proj.weight.float() + mlp.c_proj.bias.float()


@pytest.mark.parametrize("M", [1, 100])  # 37 rows: the Llama test covers a ragged height
@pytest.mark.parametrize("offset", [0.0, 30.0])
def test_gpt_block_is_as_accurate_as_transformers(M, offset):
    """Against float32: the fused GPT block (LayerNorm folded into the first GEMM, bias and GELU
    in its epilogue; bias and residual in the second's) errs at most 2x as much as
    ``transformers``' GPT2MLP + LayerNorm in fp16, and so does its first GEMM alone (where the
    fold's subtraction cancels), also on rows whose mean (``offset``) is 30x their spread."""
    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = (torch.randn(M, H) + offset).half()
    ref = gpt_reference(mlp, norm, x)
    with torch.no_grad():
        theirs = x + mlp(norm(x))
        xn = torch.nn.functional.layer_norm(x.float(), (H,), norm.weight.float(), norm.bias.float(), norm.eps)
        h_ref = torch.nn.functional.gelu(xn @ mlp.c_fc.weight.float() + mlp.c_fc.bias.float(), approximate="tanh")
        # transformers' first half in fp16, its norm computed in fp32 (as on GPUs) and rounded once
        h_theirs = mlp.act(mlp.c_fc(xn.half()))
    ours = block(x)
    h_ours = block.first_gemm(x)
    assert ours.shape == x.shape and ours.dtype == x.dtype and not ours.isnan().any()
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(ours, ref), rel(theirs, ref))
    assert rel(h_ours, h_ref) <= 2 * rel(h_theirs, h_ref), (rel(h_ours, h_ref), rel(h_theirs, h_ref))


def test_layer_norm_epilogue_and_its_statistics_on_a_plain_gemm():
    torch.manual_seed(1)
    M, K, N = 40, 48, 64
    a = (torch.randn(M, K) * 2 + torch.linspace(-20, 20, M)[:, None]).half()
    w, b = (torch.randn(K, N) / K**0.5).half(), (0.1 * torch.randn(N)).half()
    g, beta = (1 + 0.1 * torch.randn(K)).half(), (0.1 * torch.randn(K)).half()
    folded, col_sum, bias = fold_layer_norm(g, beta, w, b)
    assert torch.allclose(col_sum.double(), folded.double().sum(0))
    y = matmul(a, folded, config=SMALL, epilogue=Epilogue(layer_norm_eps=1e-5, col_sum=col_sum, bias=bias))
    xn = torch.nn.functional.layer_norm(a.float(), (K,), g.float(), beta.float(), 1e-5)
    assert rel(y, xn @ w.float() + b.float()) < 3e-3
    with pytest.raises(ValueError, match="col_sum together"):
        Epilogue(layer_norm_eps=1e-5)
    with pytest.raises(ValueError, match="not both"):
        Epilogue(rms_eps=1e-5, layer_norm_eps=1e-5, col_sum=col_sum)
    with pytest.raises(ValueError, match="col_sum must be B's \\[32\\]"):
        matmul(a, folded[:, :32].contiguous(), config=SMALL, epilogue=Epilogue(layer_norm_eps=1e-5, col_sum=col_sum))


@pytest.mark.parametrize("norm", ["rms", "layer"])
def test_a_norms_pass_copies_the_rows_and_a_residual_in_the_output_is_added_in_place(norm, monkeypatch):
    """``a_copy``: the norm's pass stores ``a`` there bitwise, on rows wider than its widest
    step (two steps, the last ragged) and on narrow ones, and the GEMM is bitwise the one
    without it; ``residual=out``: the tiles are added onto what ``out`` holds, bitwise the
    residual given apart; the pass in a GPU's one row a program gives the same. A copy without
    a norm, or one that overlaps an operand, and a residual that overlaps ``out`` without being
    it are refused before anything runs."""
    from ctapipelining.gemm import NormStats
    from ctapipelining.kernels.epilogue import NORM_MAX_COLS

    torch.manual_seed(2)
    for M, K, N in ((3, NORM_MAX_COLS + 40, 32), (37, 48, 64)):
        cfg = SMALL if K < 64 else dataclasses.replace(SMALL, block_k=128)  # few K-steps under the interpreter
        a, w = (torch.randn(M, K) + 3).half(), (torch.randn(K, N) / K**0.5).half()
        epi = Epilogue(rms_eps=1e-5) if norm == "rms" else Epilogue(layer_norm_eps=1e-5, col_sum=w.float().sum(0))
        padded = torch.full((M, K + 8), float("nan")).half()  # a row stride other than a's
        for copy in (torch.full_like(a, float("nan")), padded[:, :K]):
            y = matmul(a, w, config=cfg, epilogue=epi, a_copy=copy)
            assert torch.equal(copy, a) and torch.equal(y, matmul(a, w, config=cfg, epilogue=epi))
        assert padded[:, K:].isnan().all()  # the padding untouched
        with monkeypatch.context() as m:  # a GPU's one row a program
            m.setattr(NormStats, "_rows_per_program", staticmethod(lambda: 1))
            one_row = torch.full_like(a, float("nan"))
            assert torch.equal(matmul(a, w, config=cfg, epilogue=epi, a_copy=one_row), y)
            assert torch.equal(one_row, a)
        xn = a.float() - a.float().mean(-1, keepdim=True) if norm == "layer" else a.float()
        ref = xn * torch.rsqrt(xn.pow(2).mean(-1, keepdim=True) + 1e-5) @ w.float()
        assert rel(y, ref) < 3e-3, (M, K)
    res = torch.randn(M, N).half()
    held = res.clone()
    apart = matmul(a, w, config=SMALL, epilogue=Epilogue(residual=True), residual=res)
    same = matmul(a, w, out=held, config=SMALL, epilogue=Epilogue(residual=True), residual=held)
    assert same is held and torch.equal(held, apart)
    sentinel, out = torch.full_like(a, float("nan")), torch.full((M, N), float("nan")).half()
    with pytest.raises(ValueError, match="norm epilogue"):
        matmul(a, w, out=out, config=SMALL, a_copy=sentinel)
    with pytest.raises(ValueError, match="a_copy overlaps"):
        matmul(a, w, out=out, config=SMALL, epilogue=epi, a_copy=a)
    with pytest.raises(ValueError, match="a_copy must be"):
        matmul(a, w, out=out, config=SMALL, epilogue=epi, a_copy=torch.empty(M, K + 8).half())
    with pytest.raises(ValueError, match="a_copy overlaps"):
        matmul(a, w, out=out, config=SMALL, epilogue=epi, a_copy=out[:, :K])  # the output's first K columns
    assert sentinel.isnan().all() and out.isnan().all()  # refused before anything ran
    buf = torch.randn(M * N + 8).half()  # the residual 8 elements past out: overlapping, not the same
    with pytest.raises(ValueError, match="out overlaps"):
        matmul(a, w, out=buf[: M * N].view(M, N), config=SMALL, epilogue=Epilogue(residual=True),
               residual=buf[8:].view(M, N))  # fmt: skip


def test_a_backward_through_a_block_says_it_is_inference_only():
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(3, H).half().requires_grad_()
    with pytest.raises(RuntimeError, match="inference only"):
        block(x).sum().backward()


def test_a_moved_or_cast_block_drops_what_it_built_on_its_old_buffers():
    """``.to()``, ``.half()`` and the like replace the buffers: the epilogues, the bound calls
    and the last call (which holds the old weights' memory) go at once, not at the next call
    (on the CPU nothing binds: a stand-in last call and bound entry)."""
    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    y = block(x)
    for move in (lambda b: b.half(), lambda b: b.to("cpu"), lambda b: b.float()):
        assert block._epi is not None
        block._last, block._bound = object(), {"key": None}
        move(block)
        assert (block._epi, block._last, block._bound) == (None, None, {})
        block.half()
        assert torch.equal(block(x), y)


def test_a_moved_or_cast_stack_drops_the_pipeline_built_on_its_old_weights():
    """A stack's pipeline holds the weights it was built on: ``.to()`` and the like drop it at
    once (the old weights' memory goes), and the next call builds it on the new ones."""
    import gc
    import weakref

    mlp, norm = hf_block()
    stack = LlamaStack([LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)] * 2)
    x = torch.randn(7, H).half()
    y = stack(x)
    assert stack._built is not None
    old = weakref.ref(stack.blocks[0].w_in)
    stack.float()
    gc.collect()
    assert stack._built is None and old() is None
    assert torch.equal(stack.half()(x), y)


def test_a_stack_follows_its_blocks_epilogues_and_its_own_configuration():
    """A stack's pipeline runs its blocks' epilogues as they are now: a block that built new ones
    at the same addresses (``.half()`` on an fp16 block, a configuration set) rebuilds it, so a
    later change of a source weight reaches the column sums the stack subtracts (rows whose mean
    dwarfs their spread show a stale one). ``config`` set later is checked, and the next call's
    pipeline runs it."""
    src = [gpt_block(seed) for seed in (0, 1)]

    def build():
        blocks = [GPTMLP.from_hf(m, n, up_config=SMALL, down_config=SMALL) for m, n in src]
        return GPTStack(blocks, config=SMALL, loopback=False)

    x = (torch.randn(9, H) + 30).half()
    for touch in (lambda b: b.half(), lambda b: setattr(b, "in_config", SMALL)):
        stack = build()
        stack(x)
        touch(stack.blocks[0])  # same addresses, new epilogues
        stack(x)
        with torch.no_grad():
            src[0][0].c_fc.weight.mul_(2)
        assert torch.equal(stack(x), build()(x))
    other = GemmConfig(16, 16, 16, group_m=2, num_stages=2, num_warps=4)
    with pytest.raises(ValueError, match="config must be None"):
        stack.config = "16x16"
    assert stack.config == SMALL
    stack.config = other
    assert stack.pipeline.configs == [other] * 4 and torch.equal(stack(x), stack.sequential(x))


def test_a_stack_refreshes_the_blocks_built_from_modules_and_a_block_its_reassigned_weights():
    """``MLPStack.refresh`` re-reads each block built from a module (a block built from tensors
    has nothing to re-read; a stack of such blocks refuses); a block whose laid-out weight was
    reassigned as a parameter lays the source out into it, and a GPT block's column sums follow
    such a weight changed in place."""
    mlp, norm = hf_block()
    sourced = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    plain = LlamaMLP(*(torch.randn(*s).half() * 0.1 for s in ((INTER, H), (INTER, H), (H, INTER))),
                     torch.ones(H).half(), gate_up_config=SMALL, down_config=SMALL)  # fmt: skip
    stack = LlamaStack([sourced, plain])
    x = torch.randn(7, H).half()
    mlp.down_proj.weight.data.mul_(2)  # a change PyTorch does not count
    stack.refresh()
    fresh = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    assert torch.equal(stack(x), plain(fresh(x)))
    with pytest.raises(RuntimeError, match="every block of this stack was built from tensors"):
        LlamaStack([plain]).refresh()
    # every block's checks before any block changes: block 1's source of another shape (or on
    # two devices) refuses the stack's refresh, and block 0, whose source changed too, keeps its layout
    mlp1, norm1 = hf_block()
    stack = LlamaStack([sourced, LlamaMLP.from_hf(mlp1, norm1, gate_up_config=SMALL, down_config=SMALL)])
    laid_out = [b.w_in.clone() for b in stack.blocks]
    mlp.gate_proj.weight.data.mul_(2)
    mlp1.up_proj.weight = torch.nn.Parameter(mlp1.up_proj.weight[:-8].clone())
    with pytest.raises(ValueError, match="does not match|must be \\[K, I\\] of one shape"):
        stack.refresh()
    mlp1.up_proj.weight = torch.nn.Parameter(torch.empty(INTER, H, dtype=torch.half, device="meta"))
    with pytest.raises(ValueError, match="the source's weights lie on 2 devices"):
        stack.refresh()
    mlp1.up_proj.weight = torch.nn.Parameter(mlp1.gate_proj.weight.clone())
    down = mlp1.down_proj.weight
    mlp1.down_proj.weight = torch.nn.Parameter(down.float())  # laid out, a w_out of another dtype
    with pytest.raises(ValueError, match="the source's w_out changed shape, dtype or device"):
        stack.refresh()
    mlp1.down_proj.weight = down
    mlp1.gate_proj.bias = torch.nn.Parameter(torch.zeros(INTER).half())
    with pytest.raises(ValueError, match="gate_proj has a bias: a Llama MLP has none"):
        stack.refresh()
    mlp1.gate_proj.bias = None
    assert all(torch.equal(b.w_in, w) for b, w in zip(stack.blocks, laid_out))
    stack.refresh()
    assert not torch.equal(stack.blocks[0].w_in, laid_out[0]) and not torch.equal(stack.blocks[1].w_in, laid_out[1])
    gpt = GPTMLP.from_hf(*gpt_block(), up_config=SMALL, down_config=SMALL)
    gpt.w_in = torch.nn.Parameter(gpt.w_in.clone(), requires_grad=False)
    rows = (torch.randn(5, H) + 30).half()  # a mean that dwarfs the spread: stale column sums show
    gpt(rows)
    with torch.no_grad():
        gpt.w_in.mul_(2)  # the column sums follow the reassigned weight
    got = gpt(rows)
    gpt._epi = None  # (rebuilt from scratch)
    assert torch.equal(got, gpt(rows))
    # epilogues built in inference mode (inference tensors): a refresh outside it writes them too
    g_mlp, g_norm = gpt_block()
    gpt = GPTMLP.from_hf(g_mlp, g_norm, up_config=SMALL, down_config=SMALL)
    with torch.inference_mode():
        gpt(rows)
    g_mlp.c_fc.weight.data.mul_(2)
    gpt.refresh()
    assert torch.equal(gpt(rows), GPTMLP.from_hf(g_mlp, g_norm, up_config=SMALL, down_config=SMALL)(rows))
    sourced.w_out = torch.nn.Parameter(sourced.w_out.clone(), requires_grad=False)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)
    assert torch.equal(sourced(x), LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)(x))
    assert isinstance(sourced.w_out, torch.nn.Parameter)


def test_a_block_moves_copies_pickles_and_refreshes_in_place():
    """The epilogues' vectors are buffers (``.to()`` moves them, and the epilogues follow); a
    pickled or copied block runs; ``refresh`` writes the new weights into the same buffers (a
    captured graph reads them), and refuses a source that changed shape."""
    import copy
    import pickle

    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    y = block(x)
    assert torch.equal(pickle.loads(pickle.dumps(block))(x), y)
    assert torch.equal(copy.deepcopy(block).float().half()(x), y)  # new buffers: the epilogues follow them
    assert torch.equal(block.half()(x), y)
    assert {block.to("meta")._buffers[n].device.type for n in ("w_in", "w_out", "b_in", "b_out")} == {"meta"}
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    where = {n: t.data_ptr() for n, t in block._buffers.items()}
    with torch.no_grad():
        mlp.c_fc.bias.add_(1)
    block.refresh()
    assert {n: t.data_ptr() for n, t in block._buffers.items()} == where
    assert not torch.equal(block(x), y)
    assert torch.equal(block(x), GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)(x))
    mlp.c_proj.bias = None  # the second bias gone: b_out would change
    with pytest.raises(ValueError, match="changed shape, dtype or device; build a new block"):
        block.refresh()
    mlp.c_proj.bias, act = torch.nn.Parameter(torch.zeros(H).half()), mlp.act
    mlp.act = torch.nn.ReLU()  # an activation the block does not compute: refused as from_hf does
    with pytest.raises(ValueError, match="only GELU's tanh form"):
        block.refresh()
    mlp.act = act
    block.refresh()


def hf_stack(layers=2, dtype=torch.float16):
    """``layers`` transformers Llama MLPs with their norms (different weights)."""
    return [hf_block(seed, dtype) for seed in range(layers)]


def stack_reference(blocks, x):
    for mlp, norm in blocks:
        x = reference(mlp, norm, x)
    return x


@pytest.mark.parametrize("mode,M", [("chain", 100), ("loopback", 37), ("blocks", 64)])
def test_a_pipelined_stack_equals_its_stages_one_after_another_and_transformers(mode, M):
    """Two Llama blocks as one pipeline (four stages: one chain kernel in one configuration; a
    kernel per stage through the cross-device path; or each GEMM in its block's configuration,
    a kernel each): bitwise its GEMMs one after another; against float32 at most 2x the error
    of transformers' blocks in fp16; and close to the blocks run alone (which round the second
    norm's sums in another order)."""
    blocks = hf_stack()
    if mode == "blocks":
        down = GemmConfig(16, 16, 16, group_m=1, num_stages=2, num_warps=4)
        fused = [LlamaMLP.from_hf(m, n, gate_up_config=SMALL, down_config=down) for m, n in blocks]
        stack = LlamaStack(fused, loopback=False, always_pipelined=True)
    else:
        stack = LlamaStack.from_hf(*zip(*blocks), config=SMALL, loopback=mode == "loopback", always_pipelined=True)
    assert stack.pipeline.groups == ([[0, 1, 2, 3]] if mode == "chain" else [[0], [1], [2], [3]])
    x = torch.randn(M, H).half() * 3
    ours = stack(x)
    assert torch.equal(ours, stack.sequential(x))
    ref = stack_reference(blocks, x)
    with torch.no_grad():
        theirs = x
        for mlp, norm in blocks:
            theirs = theirs + mlp(norm(theirs))
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(ours, ref), rel(theirs, ref))
    alone = x
    for b in stack.blocks:
        alone = b(alone)
    assert rel(ours, alone) < 2e-3


def test_a_stack_survives_poisoned_buffers_and_follows_its_blocks_weights():
    """NaN in every plan buffer (intermediates, sums of squares) before a call changes nothing; a
    source weight changed in place changes the stack's next call and its sequential reference
    (each block lays it out again, in place, into the weights the pipeline reads); the stack is
    an operator torch.compile traces through; a block's laid-out weight replaced by another
    tensor is the one the next call reads (as a stack built afresh on the blocks does)."""
    blocks = hf_stack()
    stack = LlamaStack.from_hf(*zip(*blocks), config=SMALL)
    x = torch.randn(64, H).half()
    first = stack(x)
    plan = stack.pipeline.plan(64)
    for t in plan.inputs[1:] + [s for s in plan.sums if s is not None]:
        t.fill_(float("nan"))
    assert torch.equal(stack(x), first)
    with torch.no_grad():
        blocks[1][0].down_proj.weight.mul_(2)  # followed at the next call, in place
    reference = stack.sequential(x)  # which follows it too
    again = stack(x)
    assert not torch.equal(again, first) and torch.equal(again, reference)
    # forward is the operator torch.ops.ctapipelining.mlp_stack: its fake gives the output's shape,
    # dtype and device, and a compiled model around it traces as one graph
    rows = x.reshape(-1, H).contiguous()
    with torch._subclasses.FakeTensorMode() as mode:
        fake = torch.ops.ctapipelining.mlp_stack(
            mode.from_tensor(rows), [mode.from_tensor(w) for w in stack._weights()], stack._key
        )
    assert (fake.shape, fake.dtype, fake.device) == (rows.shape, rows.dtype, stack.blocks[-1].w_out.device)
    compiled = torch.compile(lambda t: stack(t) * 2, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), again * 2)
    with pytest.raises(ValueError, match="the stack's first block is"):
        stack(x.float())
    stack.blocks[1].w_out = 2 * stack.blocks[1].w_out  # a new tensor: the pipeline is built again on it
    replaced = stack(x)
    assert not torch.equal(replaced, again) and torch.equal(replaced, LlamaStack(list(stack.blocks), config=SMALL)(x))


def test_pipeline_epilogues_are_checked_before_anything_runs():
    w = [torch.randn(H, H).half() for _ in range(3)]
    bad = {
        "stage 0 has none": [Epilogue(residual=True), None, None],
        "one Epilogue or None per stage": [None, None],
    }
    for match, epis in bad.items():
        with pytest.raises(ValueError, match=match):
            Pipeline(w, config=SMALL, epilogues=epis)
    with pytest.raises(ValueError, match="outputs 24 columns"):  # a gated stage halves its columns
        Pipeline(
            [torch.randn(H, H).half(), torch.randn(H, H).half()], config=SMALL,
            epilogues=[Epilogue(silu, gated=True), None],
        )  # fmt: skip
    with pytest.raises(ValueError, match="prefill or drain"):
        Pipeline(w[:2], config=SMALL, epilogues=[None, Epilogue(residual=True)], ends="balanced")
    with pytest.raises(ValueError, match="share block_m"):
        Pipeline(w[:2], config=[SMALL, GemmConfig(32, 32, 16)])
    with pytest.raises(ValueError, match="a list of one per stage"):
        Pipeline(w[:2], config=[SMALL])
    with pytest.raises(ValueError, match="does not match its"):  # a residual of another width
        Pipeline([w[0], torch.randn(H, 2 * H).half()], config=SMALL, epilogues=[None, Epilogue(residual=True)])
    with pytest.raises(ValueError, match="keep a block's GEMMs in one segment"):  # its input is another rank's
        Pipeline(
            w[:2], config=SMALL, epilogues=[Epilogue(residual=True), None], segment=Segment(1, lambda M: (None, None))
        )
    with pytest.raises(ValueError, match="add_residual needs a plain GEMM on the GPU"):  # the interpreter loads it
        GemmLaunch(32, H, H, SMALL, 2, torch.device("cpu"), epilogue=Epilogue(residual=True), add_residual=True)
    with pytest.raises(ValueError, match="norm_sums feed a norm epilogue"):
        GemmLaunch(32, H, H, SMALL, 2, torch.device("cpu"), epilogue=Epilogue(), norm_sums=torch.zeros(32, 2))
    mlp, norm = hf_block()
    with pytest.raises(TypeError, match="LlamaMLP blocks"):
        LlamaStack([LlamaMLP.from_hf(mlp, norm), "block"])
    gpt_w = [torch.randn(INTER, H).half(), None, torch.randn(H, INTER).half(), None, torch.ones(H).half(), None]
    with pytest.raises(TypeError, match="LlamaMLP blocks"):
        LlamaStack([GPTMLP(*gpt_w)])
    with pytest.raises(ValueError, match="norm_sums of a LayerNorm are"):  # a LayerNorm reads sums too
        GemmLaunch(32, H, H, SMALL, 2, torch.device("cpu"), epilogue=Epilogue(layer_norm_eps=1e-5,
                   col_sum=torch.zeros(H)), norm_sums=torch.zeros(32, 2))  # fmt: skip


@triton.jit
def _plus_one(x):
    return x + 1.0


def test_a_norm_in_a_chain_reads_the_sums_of_the_rows_as_stored():
    """Stage 1's RMSNorm from the sums of squares stage 0 stores: stage 0's activation is 1 at 0
    and its 40 columns end inside a 32-wide tile, so the padding columns must add nothing; against
    the same computed with torch (both stage orders: chain kernel and a kernel per stage)."""
    torch.manual_seed(3)
    x, w0, w1 = torch.randn(37, 24).half(), (torch.randn(24, 40) / 5).half(), (torch.randn(40, 16) / 6).half()
    epis = [Epilogue(_plus_one), Epilogue(rms_eps=1e-5)]
    y0 = (x.float() @ w0.float() + 1).half().float()
    ref = y0 * torch.rsqrt(y0.pow(2).mean(-1, keepdim=True) + 1e-5) @ w1.float()
    for loopback in (False, True):
        p = Pipeline([w0, w1], config=SMALL, epilogues=epis, loopback=loopback)
        assert rel(p(x), ref) < 2e-3, loopback


def test_blocks_follow_a_replaced_or_changed_source_and_take_inference_tensors():
    """A GPT block follows an in-place change of its source: its epilogue (and the column sums
    its LayerNorm fold derives, which a captured graph holds) is updated in place, not replaced;
    a Llama block follows a weight replaced by another tensor, and one built from inference-mode
    tensors runs (versions untracked: replacements only)."""
    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    block(x)
    first, col_sum = block._epilogues()[0], block._epilogues()[0].col_sum.clone()
    with torch.no_grad():
        mlp.c_fc.weight.mul_(1.5)
    y = block(x)
    assert block._epilogues()[0] is first and not torch.equal(first.col_sum, col_sum)
    assert rel(y, gpt_reference(mlp, norm, x)) < 2e-3
    llama, lnorm = hf_block(4)
    lblock = LlamaMLP.from_hf(llama, lnorm, gate_up_config=SMALL, down_config=SMALL)
    before = lblock(x)
    llama.down_proj.weight = torch.nn.Parameter(2 * llama.down_proj.weight.detach())
    assert rel(lblock(x) - x, 2 * (before - x)) < 1e-2
    with torch.inference_mode():
        inf_mlp, inf_norm = hf_block(5)
        inf_block = LlamaMLP.from_hf(inf_mlp, inf_norm, gate_up_config=SMALL, down_config=SMALL)
        assert rel(inf_block(x), reference(inf_mlp, inf_norm, x)) < 2e-3


@pytest.mark.parametrize("offset,config", [(0.0, SMALL), (30.0, None)])
def test_a_gpt_stack_normalises_from_the_sums_the_stage_before_stores(offset, config):
    """Two GPT blocks as one pipeline (one chain kernel; or, each GEMM in its block's
    configuration, a kernel each): block 1's LayerNorm takes its rows' means and variances from
    the sums and sums of squares block 0's second GEMM stores. Bitwise its GEMMs one after
    another; block 1's part (its output less its input) close to block 1 run alone on the same
    input, which centres the rows first; against float32 at most 2x the error of transformers'
    blocks in fp16, also where the rows' mean is 30x their spread."""
    blocks = [gpt_block(seed) for seed in (0, 1)]
    if config is None:
        down = GemmConfig(16, 16, 16, group_m=1, num_stages=2, num_warps=4)
        fused = [GPTMLP.from_hf(m, n, up_config=SMALL, down_config=down) for m, n in blocks]
        stack = GPTStack(fused, loopback=False, always_pipelined=True)
        assert stack.pipeline.groups == [[0], [1], [2], [3]]
    else:
        stack = GPTStack.from_hf(*zip(*blocks), config=config, loopback=False, always_pipelined=True)
        assert stack.pipeline.groups == [[0, 1, 2, 3]]
    x = (torch.randn(37, H) + offset).half()
    ours = stack(x)
    assert torch.equal(ours, stack.sequential(x))
    h = stack.pipeline.plan(37).inputs[2][:37]  # block 1's input, as the stack computed it
    alone = stack.blocks[1](h)
    assert rel(ours - h, alone - h) < (2e-3 if offset == 0 else 2e-2), rel(ours - h, alone - h)
    ref, theirs = x, x
    with torch.no_grad():
        for mlp, norm in blocks:
            ref = gpt_reference(mlp, norm, ref)
            theirs = theirs + mlp(norm(theirs))
    assert rel(ours, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(ours, ref), rel(theirs, ref))
    with pytest.raises(TypeError, match="does not know the blocks' kind"):
        MLPStack.from_hf([], [])


@pytest.mark.parametrize("loopback", [False, True])
def test_a_layer_norm_from_sums_keeps_its_precision_where_the_mean_dwarfs_the_spread(loopback):
    """Stage 1's LayerNorm from the parts' sums and centred sums of squares stage 0 stores: rows
    whose mean (1000) is 500x their spread, 40 columns in parts of 32 and 8; against float64 on
    the rows as stored (``E[x^2] - mean^2`` in fp32 would err by about 2% here)."""
    torch.manual_seed(5)
    x, w0, w1 = torch.randn(37, 24).half(), (torch.randn(24, 40) * 0.4).half(), (torch.randn(40, 16) / 6).half()
    folded, col_sum, b1 = fold_layer_norm(torch.ones(40).half(), None, w1, None)
    epis = [Epilogue(bias=torch.full((40,), 1000.0).half()), Epilogue(layer_norm_eps=1e-5, col_sum=col_sum, bias=b1)]
    p = Pipeline([w0, folded], config=SMALL, epilogues=epis, loopback=loopback)
    out = p(x)
    y = p.plan(37).inputs[1][:37].double()  # stage 1's input, as stored
    ref = torch.nn.functional.layer_norm(y, (40,), eps=1e-5) @ w1.double()
    assert rel(out, ref) < 5e-3, rel(out, ref)


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_stack_on_one_device_runs_its_blocks_one_after_another(kind):
    """Every block on one device and nothing that asks for the pipeline: a call is the blocks
    called alone one after another, bitwise, and so is its reference; no plan is built, and it is
    right against float32. ``always_pipelined``, loopback, one ``config``, an SM budget keep the
    pipeline, whose later norms round their sums in another order."""
    if kind == "llama":
        blocks = hf_stack()
        fused = [LlamaMLP.from_hf(m, n, gate_up_config=SMALL, down_config=SMALL) for m, n in blocks]
        stack_type, block_reference = LlamaStack, reference
    else:
        blocks = [gpt_block(seed) for seed in (0, 1)]
        fused = [GPTMLP.from_hf(m, n, up_config=SMALL, down_config=SMALL) for m, n in blocks]
        stack_type, block_reference = GPTStack, gpt_reference
    x = torch.randn(21, H).half()  # two row-blocks, the second partial
    want = fused[1](fused[0](x))
    stack = stack_type(fused, loopback=False)
    assert stack.blocks_apart()
    assert torch.equal(stack(x), want) and torch.equal(stack.sequential(x), want)
    assert not stack.pipeline._plans
    ref, theirs = x, x
    with torch.no_grad():
        for mlp, norm in blocks:
            ref = block_reference(mlp, norm, ref)
            theirs = theirs + mlp(norm(theirs))
    assert rel(want, ref) <= 2 * max(rel(theirs, ref), 1e-4), (rel(want, ref), rel(theirs, ref))
    # (an SM budget of the interpreter's 4 "SMs" runs as always_pipelined does: only its choice is checked)
    assert not stack_type(fused, loopback=False, sm_budget=4).blocks_apart()
    for kw in [dict(loopback=False, always_pipelined=True), dict(loopback=True), dict(loopback=False, config=SMALL)]:
        piped = stack_type(fused, **kw)
        assert not piped.blocks_apart(), kw
        y = piped(x)
        assert piped.pipeline._plans and torch.equal(y, piped.sequential(x)), kw
        assert rel(y, want) < 2e-3, kw


def test_a_blocks_bound_calls_make_room_from_the_oldest_seen_once_then_the_oldest_bound():
    """``_room_for``: a key already held, or room left, keeps the dict itself (updated in
    place); a full dict without the key is copied without its oldest call seen once (None),
    else without its oldest bound call, so callers whose calls never repeat do not push bound
    calls (and their CUDA graphs) out."""
    from ctapipelining.nn import _room_for

    bound = {"a": "A", "b": None, "c": "C", "d": None}
    assert _room_for(bound, "e", limit=5) is bound
    assert _room_for(bound, "b", limit=4) is bound
    assert list(_room_for(bound, "e", limit=4)) == ["a", "c", "d"]
    assert bound == {"a": "A", "b": None, "c": "C", "d": None}  # the caller's dict untouched
    full = {"a": "A", "c": "C"}
    assert _room_for(full, "e", limit=2) == {"c": "C"}
    for n in range(40):  # a caller that never repeats: the bound ones stay
        full = _room_for(full, n, limit=2 + 3)
        full[n] = None
    assert full["a"] == "A" and full["c"] == "C" and len(full) == 5


def test_what_a_block_refuses_before_it_writes_anything():
    """A block's ``run`` refuses an ``h`` over its second GEMM's weight (the first GEMM would
    write the weight the second then reads) and inputs that are not matrices; a stack's
    ``sequential``, the bitwise reference, refuses an ``x`` of another width as its call does;
    configurations that are not :class:`GemmConfig` are refused by name, at construction and
    by ``matmul``."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    x = torch.randn(8, H).half()
    weight = block.w_out.clone()
    h = block.w_out.view(-1)[: 8 * INTER].view(8, INTER)
    with pytest.raises(ValueError, match="h shares memory with the second GEMM's weight"):
        block.run(x, torch.empty(8, H).half(), h)
    assert torch.equal(block.w_out, weight)
    with pytest.raises(ValueError, match="rows must be 2-D"):
        block.run(x.view(2, 4, H), torch.empty(2, 4, H).half())
    assert torch.equal(block.run(x, torch.empty(8, H).half()), block(x))
    stack = LlamaStack([block, block])
    for bad in (torch.randn(8, 2 * H).half(), torch.randn(2 * H).half(), torch.randn(8, H // 2).half()):
        with pytest.raises(ValueError, match=f"x must be \\[..., {H}\\]"):
            stack.sequential(bad)
    with pytest.raises(ValueError, match="x is torch.float32"):
        stack.sequential(x.float())
    with pytest.raises(TypeError, match="down_config must be a ctapipelining.kernels.gemm.GemmConfig or None, got str"):
        LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config="128x256")
    with pytest.raises(TypeError, match="h must be a torch.Tensor, got str"):
        block.run(x, torch.empty(8, H).half(), "h")
    with pytest.raises(TypeError, match="h must be a dense"):
        block.run(x, torch.empty(8, H).half(), torch.zeros(8, INTER).half().to_sparse())
    with pytest.raises(TypeError, match="config must be a ctapipelining.kernels.gemm.GemmConfig or None, got str"):
        matmul(x, block.w_in, config="small")
    with pytest.raises(TypeError, match="got dict"):
        matmul(x, block.w_in, config=dataclasses.asdict(SMALL))


def test_norms_of_torch_nn_fold_or_are_refused_by_name():
    """``torch.nn.RMSNorm`` without an epsilon folds with the one it normalises with (float32's),
    as the same norm with that epsilon given; a LayerNorm without a weight is refused by name, and
    a source norm whose weight is gone by a block's refresh or call (nothing changed)."""
    mlp, _ = hf_block()
    norm = torch.nn.RMSNorm(H).half()  # eps=None
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(H))
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    eps = torch.finfo(torch.float32).eps
    assert block.eps == eps
    given = torch.nn.RMSNorm(H, eps=eps).half()
    with torch.no_grad():
        given.weight.copy_(norm.weight)
    x = torch.randn(9, H).half()
    assert torch.equal(block(x), LlamaMLP.from_hf(mlp, given, gate_up_config=SMALL, down_config=SMALL)(x))
    gmlp, _ = gpt_block()
    with pytest.raises(ValueError, match="LayerNorm has no weight"):
        GPTMLP.from_hf(gmlp, torch.nn.LayerNorm(H, elementwise_affine=False).half(), up_config=SMALL, down_config=SMALL)
    laid_out = block.w_in.clone()
    norm.weight = None
    for run in (block.refresh, lambda: block(x)):
        with pytest.raises(ValueError, match="RMSNorm has no weight"):
            run()
    assert torch.equal(block.w_in, laid_out)


def test_a_stack_takes_no_rows_as_a_block_does():
    """An ``x`` without rows gives an output without rows, from a block and from a pipelined
    stack alike (its pipeline, which refuses them, is not called)."""
    mlp, norm = hf_block()
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=SMALL, down_config=SMALL)
    stack = LlamaStack([block, block], config=SMALL, always_pipelined=True)
    assert not stack.blocks_apart()
    for x in (torch.empty(0, H).half(), torch.empty(2, 0, H).half()):
        for module in (block, stack, stack.sequential):
            y = module(x)
            assert y.shape == x.shape and y.dtype == x.dtype, module


@pytest.mark.parametrize("kind", ["llama", "gpt"])
def test_a_blocks_epsilon_set_or_changed_in_its_source_takes_effect_at_the_next_call(kind):
    """A block's ``eps`` set directly runs at the next call (as a block built with it); a block
    built from ``transformers`` follows its norm's epsilon changed there, at the next call and
    through ``refresh``, and refuses one set on it that differs (the norm's wins); a stack of
    such blocks follows it too; a bad epsilon is refused when set, a bad one in the source by
    ``refresh`` before anything changes."""
    x = torch.randn(9, H).half() * 0.05  # small rows: the epsilon weighs
    mlp, norm = hf_block() if kind == "llama" else gpt_block()
    cls, configs = (LlamaMLP, dict(gate_up_config=SMALL, down_config=SMALL)) if kind == "llama" else (
        GPTMLP, dict(up_config=SMALL, down_config=SMALL))  # fmt: skip
    block = cls.from_hf(mlp, norm, **configs)
    before = block(x)
    with pytest.raises(ValueError, match="follows its source norm's epsilon"):
        block.eps = 0.5
    assert block.eps == 1e-5 and torch.equal(block(x), before)
    block._source = None  # as if built from tensors
    block.eps = 0.5
    changed = block(x)
    assert not torch.equal(changed, before)
    attr = "variance_epsilon" if kind == "llama" else "eps"
    setattr(norm, attr, 0.5)
    assert torch.equal(cls.from_hf(mlp, norm, **configs)(x), changed)
    setattr(norm, attr, 1e-5)
    followed = cls.from_hf(mlp, norm, **configs)
    Stack = LlamaStack if kind == "llama" else GPTStack
    stack = Stack([followed], always_pipelined=True)
    stacked = stack(x)
    assert torch.equal(followed(x), before)
    setattr(norm, attr, 0.5)  # no tensor changes: only the epsilon; the stack's call sees it first
    fresh = Stack([cls.from_hf(mlp, norm, **configs)], always_pipelined=True)(x)
    assert torch.equal(stack(x), fresh) and not torch.equal(fresh, stacked)
    assert torch.equal(followed(x), changed) and followed.eps == 0.5
    setattr(norm, attr, 1e-5)
    followed.refresh()
    assert followed.eps == 1e-5 and torch.equal(followed(x), before)
    setattr(norm, attr, 0.25)
    with torch.no_grad():
        weight = norm.weight
        norm.weight = torch.nn.Parameter(weight[:-8].clone())  # and a weight of another shape: refused
    laid_out = {k: v.clone() for k, v in followed._buffers.items() if v is not None}
    with pytest.raises(ValueError, match=r"does not match|got weight \(40,\)"):
        followed.refresh()
    assert followed.eps == 1e-5  # a refused refresh changes nothing
    assert all(torch.equal(followed._buffers[k], v) for k, v in laid_out.items())
    with pytest.raises(ValueError, match="eps must be a float > 0, got -1.0"):
        block.eps = -1.0
    with pytest.raises(ValueError, match="eps must be a float > 0, got 1"):
        block.eps = 1  # (an int: as the constructor refuses it)
    assert block.eps == 0.5 and torch.equal(block(x), changed)
    norm.weight = torch.nn.Parameter(weight)
    setattr(norm, attr, 0.0)
    with torch.no_grad():  # with a weight changed too, which a refused refresh does not lay out
        next(mlp.parameters()).mul_(2)
    with pytest.raises(ValueError, match="the source norm's epsilon must be a float > 0, got 0.0"):
        followed.refresh()
    assert followed.eps == 1e-5 and all(torch.equal(followed._buffers[k], v) for k, v in laid_out.items())


def test_misaligned_rows_run_and_an_empty_inner_dimension_is_named():
    """A contiguous ``x`` at an address TMA cannot read from (not 16-byte aligned) runs, through
    a copy, in a block and in a stack, as the same rows aligned do; a GEMM over an empty inner
    dimension says so."""
    block = LlamaMLP.from_hf(*hf_block(), gate_up_config=SMALL, down_config=SMALL)
    buf = torch.randn(10 * H + 1).half()
    x = buf[1:].view(10, H)  # 2 bytes past an aligned address
    assert x.data_ptr() % 16 and x.is_contiguous()
    want = block(x.clone())
    assert torch.equal(block(x), want) and torch.equal(block(x.view(2, 5, H)), want.view(2, 5, H))
    from torch.utils._python_dispatch import TorchDispatchMode

    stack = LlamaStack([block], always_pipelined=True)
    assert torch.equal(stack(x), stack(x.clone())) and torch.equal(stack.sequential(x), stack(x))

    class Passing(TorchDispatchMode):  # a dispatch mode: the calls go through the operators
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passing():
        assert torch.equal(block(x), want) and torch.equal(stack(x), stack.sequential(x.clone()))
    with pytest.raises(ValueError, match="the inner dimension is empty"):
        matmul(torch.zeros(20, 0).half(), torch.zeros(0, 32).half())
    with pytest.raises(ValueError, match=r"B is empty: \(0, 32\)"):  # (not empty on both sides: B is)
        matmul(torch.zeros(20, 8).half(), torch.zeros(0, 32).half())


def test_a_configuration_set_to_none_is_the_default_again_and_a_bad_one_is_refused():
    """``in_config`` / ``out_config`` set after construction take what the constructor takes:
    None is the GEMM's default again (its few-rows tiles too), a configuration runs at every row
    count (the default's too), anything but a GemmConfig is refused by name, at once. Either
    change drops the launches bound to the old choice."""
    block = LlamaMLP(*(torch.randn(*s).half() for s in ((INTER, H), (INTER, H), (H, INTER))), torch.ones(H).half())
    few = block.configs_for(1)
    block.in_config = SMALL
    assert block.configs_for(1)[0] == SMALL
    block.in_config = None
    assert block.in_config == nn.GATE_UP_CONFIG and block.configs_for(1) == few
    block.in_config = nn.GATE_UP_CONFIG  # set: run at every row count
    assert block.configs_for(1)[0] == nn.GATE_UP_CONFIG
    block._epilogues()
    block._bound, block._last = {"a call": None}, "bound"  # (as a GPU call leaves them)
    block.in_config = None  # the same configuration, now left to its default: what was bound goes
    block._epilogues()
    assert block.configs_for(1) == few and block._bound == {} and block._last is None
    gpt = GPTMLP(torch.randn(INTER, H).half(), None, torch.randn(H, INTER).half(), None, torch.ones(H).half(), None,
                 up_config=SMALL, down_config=SMALL)  # fmt: skip
    gpt.out_config = None
    assert gpt.out_config == nn.DOWN_CONFIG and gpt.configs_for(200)[1] == nn.GPT_FEW_ROWS_CONFIGS[2][2]
    assert nn.GPT_FEW_ROWS_CONFIGS[2][2] != nn.FEW_ROWS_CONFIGS[2][2]  # (the tables differ there)
    with pytest.raises(AttributeError, match="the block class's measured table"):
        gpt.few_rows_configs = nn.FEW_ROWS_CONFIGS
    assert gpt.configs_for(1)[0] == SMALL  # built with it: no few-rows tiles
    with pytest.raises(TypeError, match="in_config must be a ctapipelining.kernels.gemm.GemmConfig or None, got str"):
        block.in_config = "128x256"
    assert block.in_config == nn.GATE_UP_CONFIG


def test_a_gpt_block_follows_its_source_layer_replaced_by_another():
    """A block built from modules reads them again at each call (it keeps no layer of theirs):
    a GPT block whose source's down layer is replaced by another computes with the new one."""
    mlp, norm = gpt_block()
    block = GPTMLP.from_hf(mlp, norm, up_config=SMALL, down_config=SMALL)
    x = torch.randn(5, H).half()
    block(x)
    other, _ = gpt_block(seed=1)
    mlp.c_proj = other.c_proj
    assert rel(block(x), gpt_reference(mlp, norm, x)) < 2e-3


def test_a_source_modules_attributes_read_fast_are_the_ones_getattr_finds():
    """``nn._attr`` reads a module's parameter, buffer or submodule from its dicts only where
    ``getattr`` would find it there: a class-level property or an instance attribute over a
    registered parameter, a class with its own ``__getattribute__``, a parametrized weight, a
    weight kept in the instance's ``__dict__``, a class whose ``__getattr__`` gives another
    layer's (as adapter wrappers do), a replaced submodule and a parameter set to None all read
    as ``getattr`` reads them."""
    from torch.nn.utils import parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    class Forwarding(torch.nn.Module):  # its own weight, but its __getattr__ gives its inner layer's
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self._parameters["weight"] = torch.nn.Parameter(torch.zeros(2, 3))

        def __getattr__(self, name):
            return self.inner.weight if name == "weight" else super().__getattr__(name)

    class Property(torch.nn.Module):  # a class-level weight over a registered parameter
        @property
        def weight(self):
            return self._parameters["weight"] * 3

    class Looked(torch.nn.Module):  # its own attribute lookup
        def __getattribute__(self, name):
            return torch.zeros(1) if name == "weight" else super().__getattribute__(name)

    shadowed, looked = Property(), Looked()
    for module in shadowed, looked:
        module._parameters["weight"] = torch.nn.Parameter(torch.ones(2, 3))
    inst = torch.nn.Linear(3, 2)
    object.__setattr__(inst, "weight", torch.zeros(2, 3))  # in __dict__, the parameter still registered
    for module in shadowed, inst, looked:
        assert nn._attr(module, "weight") is not module._parameters["weight"]
        assert torch.equal(nn._attr(module, "weight"), module.weight)
    plain, linear = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    parametrize.register_parametrization(linear, "weight", Double())
    kept = torch.nn.Linear(3, 2)
    del kept.weight
    kept.weight = torch.ones(2, 3)  # a plain tensor: in the instance's __dict__
    holder = torch.nn.Module()
    holder.layer = plain
    wrapped = Forwarding(torch.nn.Linear(3, 2))
    for module, name in (plain, "weight"), (plain, "bias"), (kept, "weight"), (holder, "layer"), (wrapped, "weight"):
        assert nn._attr(module, name) is getattr(module, name), (module, name)
    assert nn._attr(wrapped, "weight") is wrapped.inner.weight
    assert torch.equal(nn._attr(linear, "weight"), 2 * linear.parametrizations.weight.original)
    holder.layer = torch.nn.Linear(3, 2)  # replaced: the new one
    assert nn._attr(holder, "layer") is holder.layer
    plain.bias = None
    assert nn._attr(plain, "bias") is None
    with pytest.raises(AttributeError):
        nn._attr(plain, "missing")
