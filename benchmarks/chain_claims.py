"""What the chain kernel's ticket costs: two 8192-wide layers sharing one GPU, graph-replayed,
paired, in one run: this tree's chain kernel (each CTA claims its next position during its
current tile), an earlier tree's (``ctapipelining_old`` in OLD_PARENT: each claim before its
tile), that kernel with positions assigned statically (CTA ``i`` runs positions ``i, i + grid,
...``: no claim at all; deadlock-free only because every CTA of the grid is resident), and our
GEMMs one after another.

usage: python3 benchmarks/chain_claims.py OUT_DIR REPS [OLD_PARENT]

Without OLD_PARENT, this tree is the earlier one (its claim must then be before its tile). The
static variant is the earlier package copied to a temporary folder as ``ctapipelining_static``,
its claim replaced (a diagnostic, not the library's; under the interpreter, which runs CTAs one
at a time, it would deadlock). Writes chain_claims.json in OUT_DIR and prints a table.
"""

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.pipeline import Pipeline
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

OUT = Path(sys.argv[1])
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 30
OLD = sys.argv[3] if len(sys.argv) > 3 else None
K = 8192
ROWS = (640, 1024, 2048, 16384)


def graphed(fn):
    return capture(fn, [0]).replay


CLAIM = (  # the earlier tree's claim, before each tile
    "    for _ in tl.range(0, trips, flatten=True):\n"
    '        pos = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu") - base  # one thread; the CTA shares it\n'
)
STATIC = "    for it in tl.range(0, trips, flatten=True):\n        pos = (tl.program_id(0) + it * grid).to(tl.int64)\n"


def static_package() -> str:
    """A folder holding ``ctapipelining_static``: the earlier package, its chain kernel's claim static."""
    parent = tempfile.mkdtemp()
    root = Path(parent) / "ctapipelining_static"
    source = Path(OLD) / "ctapipelining_old" if OLD else Path(__file__).resolve().parents[1] / "ctapipelining"
    shutil.copytree(source, root,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    chain = root / "kernels" / "chain.py"
    text = chain.read_text()
    assert text.count(CLAIM) == 1, "the chain kernel's claim is not where this script expects it"
    chain.write_text(text.replace(CLAIM, STATIC))
    return parent


def main():
    sys.path.insert(0, static_package())
    from ctapipelining_static.pipeline import Pipeline as StaticPipeline

    torch.manual_seed(0)
    a, b = ((torch.randn(K, K, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
    pipes = {"ticket": Pipeline([a, b], always_pipelined=True), "static": StaticPipeline([a, b], always_pipelined=True)}
    if OLD:
        sys.path.insert(0, OLD)
        from ctapipelining_old.pipeline import Pipeline as OldPipeline

        pipes["ticket_before"] = OldPipeline([a, b], always_pipelined=True)
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "rows": {}}
    OUT.mkdir(parents=True, exist_ok=True)
    for M in ROWS:
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        h, y = torch.empty(M, K, dtype=torch.bfloat16, device="cuda:0"), torch.empty_like(x)
        want = pipes["ticket"].sequential(x)
        same = {name: bool(torch.equal(pipe(x, check=True), want)) for name, pipe in pipes.items()}
        assert all(same.values()), (M, same)
        methods = [Method("ours_seq", graphed(lambda x=x, h=h, y=y: (matmul(x, a, out=h), matmul(h, b, out=y))))]
        methods += [Method(name, graphed(lambda pipe=pipe, x=x, y=y: pipe(x, out=y))) for name, pipe in pipes.items()]
        times = time_interleaved(methods, [0], REPS, 5)
        for name, pipe in pipes.items():  # still right after the timed replays
            assert torch.equal(pipe(x, check=True), want), (M, name)
        row = {"median_ms": {k: statistics.median(v) for k, v in times.items()}, "bitwise_equal": same}
        ratios = [("static", "ticket"), ("ticket", "ours_seq"), ("static", "ours_seq")]
        if OLD:
            ratios += [("ticket", "ticket_before"), ("static", "ticket_before"), ("ticket_before", "ours_seq")]
        for num, den in ratios:
            med, lo, hi = median_ci([p / q for p, q in zip(times[num], times[den])])
            row[f"{num}/{den}"] = {"median": med, "ci95": [lo, hi]}
        report["rows"][M] = row
        print(M, {k: round(v, 4) for k, v in row["median_ms"].items()},
              {k: [round(v["median"], 4), [round(c, 4) for c in v["ci95"]]] for k, v in row.items() if "/" in k},
              flush=True)  # fmt: skip
    (OUT / "chain_claims.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
