"""The GPT block at 320 rows: each GEMM's candidate tiles (block_tiles.one), then the whole block in
the best pair against its table's tiles, paired. usage: python3 benchmarks/_t320.py OUT.json REPS M"""

import json
import statistics
import sys

out_path, reps, M = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.argv = ["block_tiles.py", "/tmp", str(reps)]
sys.path.insert(0, "benchmarks")
import block_tiles  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP  # noqa: E402

from ctapipelining.nn import GPTMLP  # noqa: E402
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved  # noqa: E402

report = {"environment": environment(), "command": f"_t320.py {out_path} {reps} {M}"}
print(f"gpt M={M}", flush=True)
report["tiles"] = tiles = block_tiles.one(4096, 16384, M, gpt=True)
best = {g: block_tiles.CANDIDATES[tiles[g]["best"]] for g in ("up", "down")}
torch.manual_seed(0)
cfg = transformers.GPT2Config(n_embd=4096, n_head=32, activation_function="gelu_new")
mlp, norm = GPT2MLP(16384, cfg).cuda().bfloat16().eval(), torch.nn.LayerNorm(4096).cuda().bfloat16()
for p in list(mlp.parameters()) + list(norm.parameters()):
    p.requires_grad_(False)
table, cand = GPTMLP.from_hf(mlp, norm), GPTMLP.from_hf(mlp, norm, up_config=best["up"], down_config=best["down"])
report["table_configs"] = [str(c) for c in table.configs_for(M)]
report["candidate_configs"] = [str(c) for c in cand.configs_for(M)]
w_in, w_out = mlp.c_fc.weight.contiguous(), mlp.c_proj.weight.contiguous()
with torch.no_grad():
    x = torch.randn(M, 4096, device="cuda").bfloat16()
    a, b = table(x), cand(x)
    report["max_abs_diff"], report["scale"] = float((a.float() - b.float()).abs().max()), float(a.float().abs().max())
    h = table.first_gemm(x)
    g, y = torch.empty(M, 16384, device="cuda", dtype=x.dtype), torch.empty_like(x)
    methods = [
        Method("table", capture(lambda: table(x), [0]).replay),
        Method("candidate", capture(lambda: cand(x), [0]).replay),
        Method("cublas", capture(lambda: (torch.mm(x, w_in, out=g), torch.mm(h, w_out, out=y)), [0]).replay),
    ]
    t = time_interleaved(methods, [0], reps, 3)
report["median_ms"] = {k: statistics.median(v) for k, v in t.items()}
for n, d in (("candidate", "table"), ("table", "cublas"), ("candidate", "cublas")):
    report[f"{n}/{d}"] = median_ci([p / q for p, q in zip(t[n], t[d])])
print(json.dumps({k: v for k, v in report.items() if k not in ("tiles", "environment")}), flush=True)
open(out_path, "w").write(json.dumps(report, indent=1))
