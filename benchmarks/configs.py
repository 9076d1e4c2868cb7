"""Tile configurations per row count: every candidate against the fastest alternative, the
tables ``ctapipelining.gemm.plain_config`` and ``ctapipelining.pipeline.Pipeline.plan_configs`` read.

usage: python3 benchmarks/configs.py OUT_DIR [REPS] [ROWS] [plain|chain]
       python3 benchmarks/configs.py package RUN_DIR RESULTS_FOLDER [ROWS]

``plain`` (default): ``X[M, 8192] @ W[8192, 8192]`` on cuda:0, bf16, at each M of ROWS (default
128, 640, 768, 1024, 2048, 4096, 16384): cuBLAS (``torch.mm``) and
:func:`~ctapipelining.gemm.matmul` under each candidate of :data:`CANDIDATES` (those that fit
shared memory), each candidate first checked against cuBLAS. Writes OUT_DIR/configs.json
(medians, each candidate over cuBLAS with its 95% CI, and per M the fastest candidate by median,
``best``) and OUT_DIR/gemm_configs.json (per M that candidate's configuration). If the environment
variable ``OLD_PACKAGE_PARENT`` names a folder holding an older tree's package as
``ctapipelining_old`` (``mkdir old && git archive COMMIT ctapipelining | tar -x -C old && mv
old/ctapipelining old/ctapipelining_old``), its
:func:`matmul` in its own default configuration is timed in the same turns (``old``), and each
row gives ``best`` over it: a kernel change judged against the kernel before it, paired.

``chain``: ``X[M, 8192] @ A[8192, 8192] @ B[8192, 8192]``, both stages on cuda:0 in one chain
kernel (a :class:`~ctapipelining.pipeline.Pipeline` built with each candidate of
:data:`CHAIN_CANDIDATES`, each checked bitwise against its ``sequential``), against the floor: the
faster of cuBLAS twice and our plain GEMM twice (each in its measured configuration). Writes
OUT_DIR/configs.json (the same fields, each candidate over the floor) and
OUT_DIR/pipeline_configs.json. Its ``best`` is the fastest by median, a split last round counted
:data:`SPLIT_MARGIN` slower (so it is chosen only where it beats every other candidate by more:
within that, split and unsplit tiles differ by noise, and the split holds the last stage's body
twice).

``package``: write RUN_DIR's rows (``gemm_configs.json`` or ``pipeline_configs.json``; ROWS: only
those row counts) into the table of that name in ``ctapipelining/data/``, each naming
RESULTS_FOLDER (where RUN_DIR's files are kept) and the GPU it was measured on; the table's rows
at other row counts stay (a table may gather several runs).

Every line is graph-replayed and timed by the bench's harness (shuffled turns, paired).
``ctapipelining/data/{gemm,pipeline}_configs.json`` gather these rows, each naming its results
folder (a CPU test checks that each row is that folder's ``best``).
"""

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from ctapipelining.gemm import matmul
from ctapipelining.kernels.gemm import SMEM_LIMIT, GemmConfig
from ctapipelining.tables import cublas_faster
from ctapipelining.timing import Method, capture, environment, median_ci, time_interleaved

USAGE = __doc__.split("\n\n")[1]
if sys.argv[1:2] == ["package"] and len(sys.argv) not in (4, 5) or len(sys.argv) > 5 and sys.argv[1] != "package":
    sys.exit(USAGE)
ARGS = [] if sys.argv[1:2] == ["package"] else sys.argv[1:]  # package: its own arguments
OUT = Path(ARGS[0]) if len(ARGS) > 0 else Path(".")
REPS = int(ARGS[1]) if len(ARGS) > 1 else 20
KIND = ARGS[3] if len(ARGS) > 3 else "plain"
SPLIT_MARGIN = 0.01  # chain mode: a split last round must be faster than unsplit by more than this
DEFAULT_ROWS = {
    "plain": [128, 640, 768, 1024, 2048, 4096, 16384],
    "chain": [128, 256, 384, 512, 640, 768, 1024, 1536, 2048, 4096, 16384],  # plan heights
}
if KIND not in DEFAULT_ROWS:
    sys.exit(USAGE)
ROWS = [int(m) for m in ARGS[2].split(",")] if len(ARGS) > 2 and ARGS[2] else DEFAULT_ROWS[KIND]
K = N = 8192
OLD = None  # an older tree's gemm module, to time beside (module docstring)
if os.environ.get("OLD_PACKAGE_PARENT"):
    sys.path.insert(0, os.environ["OLD_PACKAGE_PARENT"])
    import ctapipelining_old.gemm as OLD


TAILS = {"_split": dict(split_tail=True), "": dict(split_tail=False)}  # name suffix: the tail's fields


def candidates(tiles: list[tuple], group_m: int, variants=({},), tails=TAILS, **fixed) -> dict[str, GemmConfig]:
    """``name: config`` for each ``(block_m, block_n, block_k, num_stages, num_warps)`` of
    ``tiles``, with each of ``tails`` (name suffix ``_split``: the partial round split; none:
    whole tiles), in each of ``variants`` (other fields: a ``wait_parts`` of 1
    adds ``_wp1`` to the name, a variant's ``group_m`` of 8 ``_g8``; ``group_m`` itself names
    nothing)."""
    out = {}
    for bm, bn, bk, st, wp in tiles:
        for var in variants:
            fields = {"group_m": group_m, **fixed, **var}
            tag = ("_wp1" if fields.get("wait_parts") == 1 else "") + ("_g8" if var.get("group_m") == 8 else "")
            for suffix, tail in tails.items():
                name = f"{bm}x{bn}x{bk}_s{st}_w{wp}{tag}{suffix}"
                out[name] = GemmConfig(bm, bn, bk, num_stages=st, num_warps=wp, **tail, **fields)
    return out


CANDIDATES = candidates(  # group_m 8: the plain GEMM's grouped order
    [(128, 256, 64, 3, 8), (128, 128, 64, 4, 8), (128, 128, 64, 4, 4), (128, 128, 128, 3, 8), (64, 256, 64, 4, 4),
     (64, 128, 64, 5, 4), (64, 128, 128, 4, 4),
     # deeper load pipelines, for a few hundred rows, whose one round of tiles waits on its loads
     (128, 128, 64, 5, 8), (128, 128, 64, 6, 8), (64, 256, 32, 8, 4)],
    group_m=8,
)  # fmt: skip
# group_m 4 and wait_parts 8 (PIPELINE_CONFIG's), each also waiting for whole rows (the combined
# order places a tile's input rows about a round before it: its parts are then mostly written),
# and the widest tiles also in groups of 8 row-blocks
WHOLE_ROWS = ({}, {"wait_parts": 1})
GROUPS_OF_8 = ({"group_m": 8}, {"group_m": 8, "wait_parts": 1})
CHAIN_CANDIDATES = candidates(
    [(128, 256, 64, 3, 8)], group_m=4, wait_parts=8, variants=WHOLE_ROWS + GROUPS_OF_8
) | candidates(
    [(128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (64, 128, 128, 4, 4)], group_m=4, wait_parts=8, variants=WHOLE_ROWS
)  # fmt: skip


def new_report(fits: dict[str, GemmConfig]) -> dict:
    """The run's record: environment, command, sizes and the candidates that fit."""
    report = {"environment": environment(), "reps": REPS, "command": " ".join(sys.argv), "N": N, "K": K}
    report["candidates"] = {k: dataclasses.asdict(c) for k, c in fits.items()}
    report["rows"] = {}
    return report


def ratio(times: dict, a: str, b: str) -> dict:
    """``a`` over ``b`` per repetition: median and 95% CI."""
    med, lo, hi = median_ci([p / q for p, q in zip(times[a], times[b])])
    return {"median": med, "ci95": [lo, hi]}


def rank(times: dict, fits: dict[str, GemmConfig], base: str, label: str, split_margin: float = 0.0) -> dict:
    """One row count's record: median times, each candidate over ``base`` per repetition
    (median, 95% CI) as ``NAME/label``, and ``best``: the fastest by median, a split tail counted
    ``split_margin`` slower."""
    ms = {k: statistics.median(v) for k, v in times.items()}
    row = {"median_ms": ms}
    for name in fits:
        row[f"{name}/{label}"] = ratio(times, name, base)
    row["best"] = min(fits, key=lambda k: ms[k] / (1 - split_margin) if k.endswith("_split") else ms[k])
    return row


def plain():
    torch.manual_seed(0)
    w = (torch.randn(K, N, device="cuda:0") * K**-0.5).bfloat16()
    fits = {k: c for k, c in CANDIDATES.items() if c.smem_bytes() <= SMEM_LIMIT}
    report, table = new_report(fits), []
    for M in ROWS:
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda:0")
        want = torch.mm(x, w)
        methods = [Method("cublas", capture(lambda x=x, y=y: torch.mm(x, w, out=y), [0]).replay)]
        if OLD is not None:
            assert float((OLD.matmul(x, w).float() - want.float()).abs().max()) < 0.05
            methods.append(Method("old", capture(lambda x=x, y=y: OLD.matmul(x, w, out=y), [0]).replay))
        for name, cfg in list(fits.items()):
            try:
                got = matmul(x, w, config=cfg)
            except Exception as e:  # Triton found it does not fit after all (out of resource)
                print(M, name, "refused:", str(e).splitlines()[0][:200], flush=True)
                del fits[name]
                continue
            err = float((got.float() - want.float()).abs().max())
            assert err < 0.05, (M, name, err)
            methods.append(Method(name, capture(lambda x=x, y=y, c=cfg: matmul(x, w, out=y, config=c), [0]).replay))
        times = time_interleaved(methods, [0], REPS, 3)
        row = rank(times, fits, "cublas", "cublas")
        best = row["best"]
        if OLD is not None:
            row |= {"old/cublas": ratio(times, "old", "cublas"), "best/old": ratio(times, best, "old")}
        report["rows"][M] = row
        over = row[f"{best}/cublas"]
        cfg = dataclasses.asdict(fits[best])
        table.append({"M": M, "config": cfg, "over_cublas": over, "cublas": cublas_faster(over)})
        print(M, best, json.dumps(row[f"{best}/cublas"]), flush=True)
        write(report, table, "gemm_configs.json")


def chain():
    from ctapipelining.pipeline import Pipeline

    torch.manual_seed(0)
    a, b = ((torch.randn(K, N, device="cuda:0") * K**-0.5).bfloat16() for _ in range(2))
    fits = {k: c for k, c in CHAIN_CANDIDATES.items() if c.smem_bytes() <= SMEM_LIMIT}
    pipes = {k: Pipeline([a, b], config=c, row_buckets=0) for k, c in fits.items()}
    report, table = new_report(fits), []
    for M in ROWS:
        x = torch.randn(M, K, device="cuda:0").bfloat16()
        h, y = (torch.empty(M, N, dtype=torch.bfloat16, device="cuda:0") for _ in range(2))
        twice = {  # the floor's candidates: each GEMM in turn
            "cublas_seq": lambda x=x, h=h, y=y: (torch.mm(x, a, out=h), torch.mm(h, b, out=y)),
            "ours_seq": lambda x=x, h=h, y=y: (matmul(x, a, out=h), matmul(h, b, out=y)),
        }
        methods = [Method(k, capture(fn, [0]).replay) for k, fn in twice.items()]
        for name, pipe in list(pipes.items()):
            try:
                got = pipe(x, check=True)
            except Exception as e:  # Triton found it does not fit after all (out of resource)
                print(M, name, "refused:", str(e).splitlines()[0][:200], flush=True)
                del pipes[name], fits[name]
                continue
            assert torch.equal(got, pipe.sequential(x)), (M, name)
            methods.append(Method(name, capture(lambda x=x, y=y, p=pipe: p(x, out=y), [0]).replay))
        times = time_interleaved(methods, [0], REPS, 3)
        floor = min(("cublas_seq", "ours_seq"), key=lambda k: statistics.median(times[k]))
        row = rank(times, fits, floor, "floor", SPLIT_MARGIN) | {"floor": floor}
        best = row["best"]
        report["rows"][M] = row
        table.append({"M": M, "config": dataclasses.asdict(fits[best]), "over_floor": row[f"{best}/floor"]})
        print(M, best, json.dumps(row[f"{best}/floor"]), flush=True)
        for pipe in pipes.values():
            pipe.check_errors()
        write(report, table, "pipeline_configs.json")  # after each row: a run cut short keeps its rows


def package(run: Path, folder: str, only: list[int] | None = None) -> None:
    """Write ``run``'s table (``only``: its rows at these row counts) into ``ctapipelining/data/``
    (module docstring)."""
    name = "pipeline_configs.json" if (run / "pipeline_configs.json").exists() else "gemm_configs.json"
    env = json.loads((run / "configs.json").read_text())["environment"]
    table = json.loads((run / name).read_text())
    over = "over_floor" if name == "pipeline_configs.json" else "over_cublas"
    what = {
        "gemm_configs.json": "the plain GEMM's tile configuration per row count: for M rows, the row of the smallest "
        "M >= it (the last row's beyond it); each row the fastest candidate of benchmarks/configs.py at that M, and "
        "cublas: whether cuBLAS was faster than it with the whole 95% CI above 1.02 (a pipeline's stages run one "
        "after another then run cuBLAS)",
        "pipeline_configs.json": "a pipeline's tile configuration per plan height (Pipeline.plan_configs, built "
        "without a configuration): for a plan of M rows, the row of the smallest M >= it (the last row's beyond "
        "it); each row the best candidate of benchmarks/configs.py's chain mode at that M (two 8192-wide stages in "
        "one chain kernel on one GPU; a split last round only where it is faster by more than 1%)",
    }[name]
    data = Path(__file__).parents[1] / "ctapipelining" / "data" / name
    rows = {r["M"]: r for r in json.loads(data.read_text())["rows"]} if data.exists() else {}
    taken = [r for r in table["rows"] if only is None or r["M"] in only]
    if only is not None and {r["M"] for r in taken} != set(only):
        sys.exit(f"{run} has no rows at {sorted(set(only) - {r['M'] for r in taken})}")
    for r in taken:
        rows[r["M"]] = {
            "M": r["M"], "config": r["config"], over: round(r[over]["median"], 3), "results": folder,
            "device": env["gpus"][0],
        }  # fmt: skip
        if name == "gemm_configs.json":  # whether cuBLAS runs in our place at this row count
            rows[r["M"]]["cublas"] = cublas_faster(r[over])
    measured = {"N": N, "K": K, "dtype": "bfloat16"}  # each row's GPU, date and versions: its results folder's
    out = {"what": what, "measured": measured, "rows": [rows[m] for m in sorted(rows)]}
    data.write_text(json.dumps(out, indent=1) + "\n")


def write(report: dict, table: list, name: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "configs.json").write_text(json.dumps(report, indent=1))
    source = {"device": torch.cuda.get_device_name(0), "N": N, "K": K, "command": report["command"]}
    (OUT / name).write_text(json.dumps({"measured": source, "rows": table}, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["package"]:
        only = sys.argv[4] if len(sys.argv) > 4 else ""  # row counts, comma-separated (none: all)
        package(Path(sys.argv[2]), sys.argv[3], [int(m) for m in only.split(",")] if only else None)
    else:
        {"plain": plain, "chain": chain}[KIND]()
