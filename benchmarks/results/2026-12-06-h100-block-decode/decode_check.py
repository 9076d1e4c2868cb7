"""A Llama block at decode-sized rows in its few-rows tiles (whole-round split tails) against
the same block in its default tiles, for compute-sanitizer."""
import torch

from ctapipelining.nn import DOWN_CONFIG, GATE_UP_CONFIG, LlamaMLP

torch.manual_seed(0)
H, inter = 1024, 2048
w = lambda *s: (torch.randn(*s, device="cuda") * s[-1] ** -0.5).bfloat16()
ws = (w(inter, H), w(inter, H), w(H, inter), (1 + 0.2 * torch.randn(H, device="cuda")).bfloat16())
few, wide = LlamaMLP(*ws), LlamaMLP(*ws, gate_up_config=GATE_UP_CONFIG, down_config=DOWN_CONFIG)
for M in (1, 16, 64, 100, 200):
    x = torch.randn(M, H, device="cuda").bfloat16()
    for _ in range(3):
        a, b = few(x), wide(x)
    torch.cuda.synchronize()
    err = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
    print(M, few.configs_for(M), "rel err", err, "nan", bool(a.isnan().any()))
    assert err < 2e-2 and not a.isnan().any()
print("decode check ok")
