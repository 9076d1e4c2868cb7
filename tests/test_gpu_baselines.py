"""The baselines on one GPU (their 2-GPU runs are the bench's): micro-batching on our GEMM and
on cuBLAS, graph-captured; data parallelism with two shares on one GPU, graph-captured; tensor
parallelism's chunked schedule on one shard, graph-captured. Each equal to the chain at once."""

import pytest
import torch

from ctapipelining.baselines import DataParallel, MicroBatch, TensorParallel

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
