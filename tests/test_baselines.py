"""The baselines' logic on the CPU (the GPU runs are the 2-GPU bench's): micro-batching on our
GEMM (the Triton interpreter) and on torch's, tensor parallelism with its all-reduce in chunks,
data parallelism over rows; each equal to the chain computed at once."""

import pytest
import torch

from ctapipelining.baselines import DataParallel, MicroBatch, TensorParallel, TensorParallelBlocks

pytestmark = pytest.mark.interpreter


def chain(*dims):
    return [(torch.randn(k, n) / k**0.5).half() for k, n in zip(dims, dims[1:])]


def gemm_calls(monkeypatch) -> list[int]:
    """The row counts of the calls of our GEMM (``ctapipelining.gemm.matmul``) from now on."""
    from ctapipelining import gemm

    calls, real = [], gemm.matmul

    def counted(a, *args, **kwargs):
        calls.append(a.shape[0])
        return real(a, *args, **kwargs)

    monkeypatch.setattr(gemm, "matmul", counted)
    return calls


def reference(x, ws):
    y = x.float()
    for w in ws:
        y = (y @ w.float()).half().float()  # each layer rounded as the GEMMs round it
    return y


@pytest.mark.parametrize("gemm", ["cublas", "ours"])
@pytest.mark.parametrize("chunk", [16, 24, 100])
def test_microbatch_equals_the_chain(gemm, chunk, monkeypatch):
    """Each chunk through each layer, on the GEMM named (ours: one call per chunk and layer)."""
    ws = chain(32, 48, 16)
    calls = gemm_calls(monkeypatch)
    mb = MicroBatch(ws, 40, chunk, gemm=gemm)
    assert [(r.start, r.stop) for r in mb.rows] == [(i, min(i + chunk, 40)) for i in range(0, 40, chunk)]
    mb.x.copy_(torch.randn(40, 32).half())
    calls.clear()
    y = mb()
    assert calls == ([r.stop - r.start for r in mb.rows for _ in ws] if gemm == "ours" else []), calls
    assert y is mb.outs[-1] and y.shape == (40, 16)
    assert float((y.float() - reference(mb.x, ws)).abs().max()) < 2e-2


def llama_blocks(n, H=32, inter=48):
    """``n`` small fused Llama blocks (fp16: the interpreter multiplies it right) in 16 x 32 tiles."""
    from ctapipelining.kernels.gemm import GemmConfig
    from ctapipelining.nn import LlamaMLP

    cfg = GemmConfig(16, 32, 16, group_m=2, num_stages=2, num_warps=4)
    return [
        LlamaMLP(
            *((torch.randn(*s) / s[-1] ** 0.5).half() for s in ((inter, H), (inter, H), (H, inter))),
            (1 + torch.randn(H) / 8).half(),
            gate_up_config=cfg,
            down_config=cfg,
        )
        for _ in range(n)
    ]


def test_microbatch_of_fused_blocks_equals_the_blocks_one_after_another():
    """A stack of fused MLP blocks micro-batched (each block on each chunk into its slice of the
    output, then copied on): each chunk's rows as the blocks give them on the whole input."""
    blocks = llama_blocks(2)
    mb = MicroBatch(blocks, 40, 16)
    x = torch.randn(40, 32).half()
    mb.x.copy_(x)
    y = mb()
    ref = blocks[1](blocks[0](x))
    assert y.shape == (40, 32) and float((y.float() - ref.float()).abs().max()) < 2e-2
    assert float((mb.outs[0].float() - blocks[0](x).float()).abs().max()) < 2e-2  # the first block's output


def test_microbatch_refuses_bad_arguments():
    ws = chain(16, 16)
    with pytest.raises(ValueError, match="chunk"):
        MicroBatch(ws, 32, 0)
    with pytest.raises(ValueError, match="gemm"):
        MicroBatch(ws, 32, 16, gemm="cutlass")
    with pytest.raises(ValueError, match="stage 1 takes 32"):
        MicroBatch(chain(16, 16) + chain(32, 16), 32, 16)
    with pytest.raises(TypeError, match="all weights"):
        MicroBatch([chain(32, 32)[0], *llama_blocks(1)], 32, 16)
    with pytest.raises(TypeError, match="all weights"):
        MicroBatch([torch.nn.Linear(32, 32)], 32, 16)
    with pytest.raises(ValueError, match="leave gemm"):
        MicroBatch(llama_blocks(1), 32, 16, gemm="ours")
    with pytest.raises(ValueError, match="at least one stage"):
        MicroBatch([], 32, 16)
    with pytest.raises(ValueError, match="M must be an int >= 1, got -1"):
        MicroBatch(ws, -1, 16)
    with pytest.raises(ValueError, match="stage 0 must be a 2-D tensor"):
        MicroBatch([torch.randn(16).half()], 32, 16)
    with pytest.raises(TypeError, match="stage 1 is torch.float32; stage 0 is torch.float16"):
        MicroBatch([ws[0], ws[0].float()], 32, 16)


@pytest.mark.parametrize("g, chunks", [(1, 1), (2, 1), (2, 3)])
def test_tensor_parallel_blocks_equal_the_blocks_one_after_another(g, chunks):
    """Two fused Llama blocks, each split over ``g`` shards (gate/up runs by columns, down by
    rows, the residual added by the first shard), the partial outputs summed after each block
    (in chunks of rows): the stack's output on every shard, within the rounding of summing
    partial products in fp16."""
    blocks = llama_blocks(2, H=32, inter=64)
    tp = TensorParallelBlocks(blocks, ["cpu"] * g, 24, chunks=chunks)
    x = torch.randn(24, 32).half()
    for xg in tp.x:
        xg.copy_(x)
    y = tp()
    ref = blocks[1](blocks[0](x))
    assert y is tp.ys[-1][0] and float((y.float() - ref.float()).abs().max()) < 3e-2
    for other in tp.ys[-1][1:]:
        assert torch.equal(other, y)


def test_tensor_parallel_blocks_shard_what_the_blocks_source_holds_now():
    """A block built from ``transformers`` whose source changed since its last call is laid out
    again before its shards are copied: the shards run what the block's next call runs."""
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from ctapipelining.kernels.gemm import GemmConfig
    from ctapipelining.nn import LlamaMLP

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    mlp, norm = HFMLP(cfg).half().eval(), LlamaRMSNorm(32).half()
    tiles = GemmConfig(16, 32, 16, group_m=2, num_stages=2, num_warps=4)
    block = LlamaMLP.from_hf(mlp, norm, gate_up_config=tiles, down_config=tiles)
    x = torch.randn(16, 32).half()
    block(x)
    with torch.no_grad():
        mlp.down_proj.weight.mul_(3)
    tp = TensorParallelBlocks([block], ["cpu"], 16)
    tp.x[0].copy_(x)
    assert torch.equal(tp(), block(x))


def test_tensor_parallel_blocks_refuse_what_they_cannot_split():
    with pytest.raises(ValueError, match="cannot be split over 4 GPUs"):
        TensorParallelBlocks(llama_blocks(1, H=32, inter=48), ["cpu"] * 4, 16)  # 12 intermediate columns each
    with pytest.raises(TypeError, match="LlamaMLP"):
        TensorParallelBlocks(chain(32, 32), ["cpu"], 16)
    with pytest.raises(ValueError, match="chunks"):
        TensorParallelBlocks(llama_blocks(1), ["cpu"], 16, chunks=0)
    with pytest.raises(ValueError, match="devices must be a non-empty list"):
        TensorParallelBlocks(llama_blocks(1), [], 16)
    with pytest.raises(ValueError, match="distinct GPUs"):
        TensorParallelBlocks(llama_blocks(1), ["cuda:0", "cuda:0"], 16)
    fp16, bf16 = llama_blocks(2)
    bf16.to(torch.bfloat16)
    with pytest.raises(ValueError, match="one dtype"):
        TensorParallelBlocks([fp16, bf16], ["cpu"], 16)


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("g", [1, 2, 4])
def test_tensor_parallel_split_and_chunked_all_reduce(g, chunks):
    """A by columns, B by rows over ``g`` shards; the all-reduce per chunk of rows sums the
    shards' partial outputs into every shard's output; without it each shard holds its part."""
    A, B = (torch.randn(32, 64) / 6).half(), (torch.randn(64, 16) / 8).half()
    tp = TensorParallel(A, B, ["cpu"] * g, 30, chunks=chunks)
    x = torch.randn(30, 32).half()
    for xg in tp.x:
        xg.copy_(x)
    y = tp()
    ref = x.float() @ A.float() @ B.float()
    assert float((y.float() - ref).abs().max()) < 5e-2
    for o in tp.out:
        assert torch.equal(o, y)
    tp(all_reduce=False)
    if g > 1:
        part = (x.float() @ A[:, : 64 // g].float()).half().float() @ B[: 64 // g].float()
        assert float((tp.out[0].float() - part).abs().max()) < 5e-2
    with pytest.raises(ValueError, match="cannot be split"):
        TensorParallel(A, B, ["cpu"] * 3, 30)
    with pytest.raises(ValueError, match="chunks"):
        TensorParallel(A, B, ["cpu"] * g, 30, chunks=0)
    with pytest.raises(ValueError, match="chunks"):
        TensorParallel(A, B, ["cpu"] * g, 30, chunks=True)
    with pytest.raises(ValueError, match="devices must be a non-empty list"):
        TensorParallel(A, B, [], 30)
    with pytest.raises(ValueError, match="distinct GPUs"):
        TensorParallel(A, B, ["cuda:0", "cuda:0"], 30)
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="distinct GPUs"):  # "cuda" is the current GPU (cuda:0 without CUDA)
        TensorParallel(A, B, ["cuda", torch.device("cuda", current)], 30)
    with pytest.raises(ValueError, match="distinct GPUs"):
        TensorParallel(A, B, [0, "cuda:0"], 30)
    with pytest.raises(TypeError, match="weight 1 is torch.float32"):
        TensorParallel(A, B.float(), ["cpu"] * g, 30)


@pytest.mark.parametrize("gemm", ["cublas", "ours"])
@pytest.mark.parametrize(
    "g,M,shares",
    [(1, 40, [40]), (2, 40, [16, 24]), (3, 40, [16, 16, 8]), (2, 100, [48, 52]), (4, 20, [0, 16, 0, 4])],
)
def test_data_parallel_rows_and_gather(gemm, g, M, shares, monkeypatch):
    """Rows split in whole 16-row blocks as evenly as they allow (the blocks per share differ by
    at most one; the last share takes the rest; a share may be empty), each share through the
    whole chain on the GEMM named, gathered into one output."""
    ws = chain(32, 48, 16)
    calls = gemm_calls(monkeypatch)
    dp = DataParallel(ws, ["cpu"] * g, M, gemm=gemm, row_align=16)
    cuts = [r.start for r in dp.rows] + [dp.rows[-1].stop]
    assert cuts[0] == 0 and cuts[-1] == M and all(c % 16 == 0 for c in cuts[:-1])
    got = [r.stop - r.start for r in dp.rows]
    assert got == shares
    blocks = [-(-n // 16) for n in got]
    assert max(blocks) - min(blocks) <= 1
    dp.x.copy_(torch.randn(M, 32).half())
    dp.out.fill_(float("nan"))
    calls.clear()
    y = dp()
    assert sorted(calls) == (sorted(n for n in got if n for _ in ws) if gemm == "ours" else []), calls
    assert not y.isnan().any()
    assert float((y.float() - reference(dp.x, ws)).abs().max()) < 2e-2
    with pytest.raises(ValueError, match="weight 1"):
        DataParallel([ws[0], ws[0]], ["cpu"], M)
    with pytest.raises(ValueError, match="row_align must be an int >= 1, got 0"):
        DataParallel(ws, ["cpu"], M, row_align=0)
    with pytest.raises(ValueError, match="weight 0 must be a 2-D tensor"):
        DataParallel([torch.randn(32).half()], ["cpu"], M)
    with pytest.raises(ValueError, match="gemm must be one of"):  # (not cuBLAS timed under another name)
        DataParallel(ws, ["cpu"], M, gemm="our")


def test_devices_resolve_to_indices_and_repeat_only_where_allowed():
    """``cuda``, an int and ``cuda:i`` name GPUs by index (``cuda`` the current one), so a GPU
    named two ways is one GPU: refused twice where the GPUs must be distinct (tensor
    parallelism), kept where a GPU may hold several shares (data parallelism on one GPU)."""
    from ctapipelining.baselines.checks import check_devices

    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    same = ["cuda", current, f"cuda:{current}"]
    assert check_devices(same, distinct=False) == [torch.device("cuda", current)] * 3
    assert check_devices(["cpu", "cpu"]) == [torch.device("cpu")] * 2
    with pytest.raises(ValueError, match="distinct GPUs"):
        check_devices(same)
    with pytest.raises(ValueError, match="non-empty list"):
        check_devices("cuda:0", distinct=False)
