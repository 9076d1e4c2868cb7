"""CTA-pipelining x TP: shard chains plus all-reduce. CPU (interpreter) and 4-GPU tests."""

import pytest
import torch

from ctapipelining.hybrid import HybridMLP
from ctapipelining.kernels.gemm import GemmConfig

SMALL = GemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=2, num_warps=4)


@pytest.mark.interpreter
@pytest.mark.parametrize(
    "policy,t",
    # one shard (no all-reduce), two (24 columns each: not a multiple of the 16-wide tile), three
    [("static", 1), ("workqueue", 2), ("static", 3)],
)
def test_hybrid_on_cpu_matches_the_mlp(policy, t):
    K, N = 24, 48
    A, B = (torch.randn(K, N) / K**0.5).half(), (torch.randn(N, K) / N**0.5).half()
    mlp = HybridMLP(A, B, ["cpu"] * t, ["cpu"] * t, policy=policy, config=SMALL)
    for _ in range(2):  # back-to-back calls, no reset
        x = torch.randn(37, K).half()
        y = mlp(x)
        assert y.dtype == x.dtype and y.shape == (37, K)
        ref = x.double() @ A.double() @ B.double()
        assert float((y.double() - ref).norm() / ref.norm()) < 5e-3
    parts = mlp(x, all_reduce=False)  # each shard's partial sum: together they are the product
    assert len(parts) == t and all(p.shape == (37, K) for p in parts)
    total = sum(p.double() for p in parts)
    assert float((total - ref).norm() / ref.norm()) < 5e-3
    assert t == 1 or not any(torch.allclose(p.double(), total, rtol=1e-2, atol=1e-2) for p in parts)  # shards' parts
    with pytest.raises(ValueError, match=f"{t + 1} input replicas for {t} stage-1 devices"):
        mlp([x] * (t + 1))


def test_hybrid_rejects_bad_layouts():
    A, B = torch.randn(16, 48).half(), torch.randn(48, 16).half()
    with pytest.raises(ValueError, match="do not split over 5"):
        HybridMLP(A, B, ["cpu"] * 5, ["cpu"] * 5)
    with pytest.raises(ValueError, match="same number"):
        HybridMLP(A, B, ["cpu"] * 2, ["cpu"])
    with pytest.raises(ValueError, match="do not chain"):
        HybridMLP(A, torch.randn(40, 16).half(), ["cpu"], ["cpu"])
    with pytest.raises(ValueError, match="same number \\(>= 1\\) of devices, got \\[\\] and \\[\\]"):
        HybridMLP(A, B, [], [])
    for stage1, stage2 in ((["cuda:0"], ["cuda:0"]), (["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"])):
        with pytest.raises(ValueError, match=f"the {2 * len(stage1)} devices of a hybrid must be distinct GPUs"):
            HybridMLP(A, B, stage1, stage2)


@pytest.mark.gpu2
@pytest.mark.parametrize("t", [1, 2, 4])
def test_hybrid_on_gpus(t):
    if torch.cuda.device_count() < 2 * t:
        pytest.skip(f"needs {2 * t} GPUs, found {torch.cuda.device_count()}")
    K, N = 4096, 8192
    A = (torch.randn(K, N, device="cuda:0") / K**0.5).bfloat16()
    B = (torch.randn(N, K, device="cuda:0") / N**0.5).bfloat16()
    mlp = HybridMLP(A, B, [f"cuda:{j}" for j in range(t)], [f"cuda:{t + j}" for j in range(t)])
    x = torch.randn(4096, K, device="cuda:0").bfloat16()
    y = mlp(x)
    ref = (x.float() @ A.float() @ B.float()).to(y.device)
    assert float((y.float() - ref).norm() / ref.norm()) < 2e-2
