"""The baselines on one GPU (their 2-GPU runs are the bench's): micro-batching on our GEMM and
on cuBLAS, graph-captured; data parallelism with two shares on one GPU, graph-captured; tensor
parallelism's chunked schedule on one shard, graph-captured; the same for fused Llama blocks
(micro-batched; split Megatron's way), and on two GPUs when there are two. Each equal to the
chain, or the blocks, at once."""

import pytest
import torch

from ctapipelining.baselines import DataParallel, MicroBatch, TensorParallel, TensorParallelBlocks
from ctapipelining.nn import LlamaMLP

pytestmark = pytest.mark.gpu


def rand(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda:0") * scale).bfloat16()


def reference(x, ws):
    y = x
    for w in ws:
        y = y @ w  # cuBLAS, each layer rounded to bf16
    return y.float()


def close(y, ref):
    return float((y.float() - ref).norm() / ref.norm()) < 2e-2


@pytest.mark.parametrize("gemm", ["cublas", "ours"])
def test_microbatch_graph_on_one_gpu(gemm):
    ws = [rand(2048, 2048, scale=2048**-0.5) for _ in range(2)]
    mb = MicroBatch(ws, 3000, 1024, gemm=gemm)
    assert mb.graphed, mb.graph_error
    for _ in range(2):
        mb.x.copy_(rand(3000, 2048))
        assert close(mb(), reference(mb.x, ws))


@pytest.mark.parametrize("gemm", ["cublas", "ours"])
def test_data_parallel_graph_with_two_shares_on_one_gpu(gemm):
    ws = [rand(2048, 2048, scale=2048**-0.5) for _ in range(2)]
    dp = DataParallel(ws, [torch.device("cuda:0")] * 2, 3000, gemm=gemm)
    assert dp.graphed, dp.graph_error
    for _ in range(2):
        dp.x.copy_(rand(3000, 2048))
        dp.out.fill_(float("nan"))
        assert close(dp(), reference(dp.x, ws))


def test_tensor_parallel_chunks_graph_on_one_shard():
    A, B = rand(2048, 4096, scale=2048**-0.5), rand(4096, 2048, scale=4096**-0.5)
    tp = TensorParallel(A, B, [0], 3000, chunks=4, graph=True)
    assert tp.graphed, tp.graph_error
    x = rand(3000, 2048)
    tp.x[0].copy_(x)
    assert close(tp(), reference(x, [A, B]))


def llama_blocks(devices, H=2048, inter=4096):
    def w(rows, cols, d):
        return (torch.randn(rows, cols, device=d) * cols**-0.5).bfloat16()

    return [
        LlamaMLP(w(inter, H, d), w(inter, H, d), w(H, inter, d), (1 + 0.2 * torch.randn(H, device=d)).bfloat16())
        for d in devices
    ]


def blocks_at_once(blocks, x):
    for b in blocks:
        x = b(x.to(b.w_out.device))
    return x.float()


@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], pytest.param(["cuda:0", "cuda:1"], marks=pytest.mark.gpu2)])
def test_microbatch_of_fused_blocks_graph(devices):
    if len(set(devices)) > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    blocks = llama_blocks(devices)
    mb = MicroBatch(blocks, 3000, 1024)
    assert mb.graphed, mb.graph_error
    for _ in range(2):  # the second call on new input: no stale intermediate
        mb.x.copy_(rand(3000, 2048))
        assert close(mb(), blocks_at_once(blocks, mb.x).to(mb.outs[-1].device))


@pytest.mark.parametrize("gpus, chunks", [(1, 4), pytest.param(2, 1, marks=pytest.mark.gpu2),
                                          pytest.param(2, 4, marks=pytest.mark.gpu2)])  # fmt: skip
def test_tensor_parallel_blocks_graph(gpus, chunks):
    if gpus > torch.cuda.device_count():
        pytest.skip("needs 2 GPUs")
    blocks = llama_blocks(["cuda:0", "cuda:0"])
    tp = TensorParallelBlocks(blocks, list(range(gpus)), 3000, chunks=chunks, graph=True)
    assert tp.graphed, tp.graph_error
    for _ in range(2):
        x = rand(3000, 2048)
        for xg in tp.x:
            xg.copy_(x)
        y = tp()
        assert close(y, blocks_at_once(blocks, x))
        for other in tp.ys[-1][1:]:
            assert torch.equal(other.to(y.device), y)
