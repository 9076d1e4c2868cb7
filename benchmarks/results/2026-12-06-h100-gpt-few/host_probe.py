"""Host time of a block's eager call (Llama-8B and GPT blocks built from ``transformers``' modules, at 16 and 1024
rows): whether the call binds (``_last``), its median host time per call (synchronised before,
not after: the time until ``forward`` returns) and a profile of 200 calls.

usage: python3 host_probe.py OUT_DIR"""

import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from ctapipelining.nn import GPTMLP, LlamaMLP

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)
dev = "cuda:0"
torch.manual_seed(0)
H = 4096
report = {}


def hf_block(kind: str):
    """A block from ``transformers``' modules (as ``benchmarks/mlp_block.py`` builds it)."""
    import transformers

    if kind == "llama8b":
        from transformers.models.llama.modeling_llama import LlamaMLP as HFMLP
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=14336, num_attention_heads=64)
        mlp, norm = HFMLP(cfg).cuda().bfloat16().eval(), LlamaRMSNorm(H, eps=1e-5).cuda().bfloat16()
        make = LlamaMLP.from_hf
    else:
        from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

        cfg = transformers.GPT2Config(n_embd=H, n_head=32, activation_function="gelu_new")
        mlp, norm = GPT2MLP(16384, cfg).cuda().bfloat16().eval(), torch.nn.LayerNorm(H).cuda().bfloat16()
        make = GPTMLP.from_hf
    for p in list(mlp.parameters()) + list(norm.parameters()):
        p.requires_grad_(False)
    return make(mlp, norm)


blocks = {"llama8b": hf_block("llama8b"), "gpt": hf_block("gpt")}
with torch.no_grad():
    for name, block in blocks.items():
        for M in (16, 1024):
            x = torch.randn(M, H, device=dev).bfloat16()
            for _ in range(5):
                block(x)
            torch.cuda.synchronize()
            host, gpu = [], []
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                block(x)
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                host.append((t1 - t0) * 1e6)
                gpu.append((time.perf_counter() - t0) * 1e6)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                block(x)
            prof.disable()
            torch.cuda.synchronize()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            key = f"{name}_M{M}"
            report[key] = {
                "bound_last": block._last is not None,
                "bound_calls": sum(v is not None for v in block._bound.values()),
                "graphed": block._last is not None and block._last.call.graph is not None,
                "host_us_median": statistics.median(host),
                "call_us_median": statistics.median(gpu),
                "configs": [str(c) for c in block.configs_for(M)],
            }
            print(key, json.dumps(report[key]), flush=True)
            (OUT / f"profile-{key}.txt").write_text(s.getvalue())
(OUT / "host_probe.json").write_text(json.dumps(report, indent=1))
