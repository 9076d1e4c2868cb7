"""The GPT block at 320 and 384 rows: its table's tiles against the first GEMM pinned to 128 x 256 (the table before), paired."""
import json, statistics, sys
import torch, transformers
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from ctapipelining import nn
from ctapipelining.nn import GPTMLP
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved
out = {"environment": environment(), "command": " ".join(sys.argv)}
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_embd=4096, n_head=32, activation_function="gelu_new")
mlp, norm = GPT2MLP(16384, cfg).cuda().bfloat16().eval(), torch.nn.LayerNorm(4096).cuda().bfloat16()
for p in list(mlp.parameters()) + list(norm.parameters()):
    p.requires_grad_(False)
new, old = GPTMLP.from_hf(mlp, norm), GPTMLP.from_hf(mlp, norm, up_config=nn.UP_CONFIG)
w_in, w_out = mlp.c_fc.weight.contiguous(), mlp.c_proj.weight.contiguous()
with torch.no_grad():
    for M in (320, 384):
        x = torch.randn(M, 4096, device="cuda").bfloat16()
        assert new.configs_for(M)[0].block_m == 64 and old.configs_for(M)[0] == nn.UP_CONFIG
        a, b = new(x), old(x)
        err = float((a.float() - b.float()).abs().max()); scale = float(b.float().abs().max())
        assert err < 0.02 * scale, (err, scale)
        h = new.first_gemm(x); g = torch.empty(M, 16384, device="cuda", dtype=x.dtype); y = torch.empty_like(x)
        ms = [Method("new", capture(lambda: new(x), [0]).replay), Method("old", capture(lambda: old(x), [0]).replay),
              Method("cublas", capture(lambda: (torch.mm(x, w_in, out=g), torch.mm(h, w_out, out=y)), [0]).replay)]
        t = time_interleaved(ms, [0], int(sys.argv[2]), 3)
        row = {"median_ms": {k: statistics.median(v) for k, v in t.items()}, "max_abs_diff": err, "scale": scale}
        for n, d in (("new", "old"), ("new", "cublas"), ("old", "cublas")):
            row[f"{n}/{d}"] = median_ci([p / q for p, q in zip(t[n], t[d])])
        out[f"M{M}"] = row
        print(M, json.dumps(row), flush=True)
open(sys.argv[1], "w").write(json.dumps(out, indent=1))
