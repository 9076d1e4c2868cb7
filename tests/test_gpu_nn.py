"""The fused Llama MLP block on one GPU at real sizes, against ``transformers``' own block."""

import pytest
import torch

from ctapipelining.nn import LlamaMLP

pytestmark = pytest.mark.gpu


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("H,inter", [(4096, 14336), (8192, 28672)])
def test_llama_block_is_as_accurate_as_transformers_in_bf16(H, inter):
    """At Llama-8B and -70B sizes, M = 1, 777, 4096: against float32, the fused block's error is
    at most 2x that of ``transformers``' LlamaMLP + LlamaRMSNorm in bf16; graph replay equal
    to the eager call bitwise."""
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
        assert not ours.isnan().any()
        assert rel(ours, ref) <= 2 * rel(theirs, ref), (M, rel(ours, ref), rel(theirs, ref))
    x = torch.randn(4096, H, device="cuda").bfloat16()
    y = block(x)
    g = torch.cuda.CUDAGraph()
    static_x = x.clone()
    with torch.cuda.graph(g):
        static_y = block(static_x)
    g.replay()
    assert torch.equal(static_y, y)
