"""Tables, headline ratios and plots from a recorded device run (no GPU needed)."""

import json
import statistics
from pathlib import Path

import pytest

from ctapipelining import bench, cli, timing

RECORDED = Path(__file__).parent.parent / "benchmarks/results/2026-11-30-h200x2-sim-inputs/run1/results.json"


@pytest.fixture(scope="module")
def results():
    return json.loads(RECORDED.read_text())


def test_table_has_every_method_with_ratio_to_floor(results):
    """A line per summary, each median over its row count's Triton floor: the graph-replayed
    floor where the run has one, else the eager one."""
    summaries = results["summaries"]
    rows = [line.split() for line in bench.table(summaries).splitlines()[1:]]
    assert [r[0] for r in rows] == [s["method"] for s in summaries]
    for method in ("floor_cublas", "floor_triton", "sequential", "microbatch", "tp", "cta_workqueue", "cta_static"):
        assert method in {r[0] for r in rows}
    floor = {s["seq"]: s["median_ms"] for s in summaries if s["method"] == "floor_triton"}
    for r, s in zip(rows, summaries):
        assert float(r[-1]) == pytest.approx(s["median_ms"] / floor[s["seq"]], abs=6e-4), r
    assert next(r for r in rows if r[0] == "floor_triton" and r[1] == "16384")[-1] == "1.000"
    graph = [dict(s, method="floor_triton_graph", median_ms=s["median_ms"] / 2) for s in summaries
             if s["method"] == "floor_triton"]  # fmt: skip
    rows = [line.split() for line in bench.table(summaries + graph).splitlines()[1:]]
    assert next(r for r in rows if r[0] == "floor_triton" and r[1] == "16384")[-1] == "2.000"  # over the graph's


def test_headline_ratios_are_recomputed_from_medians(results):
    heads = {h["seq"]: h for h in bench.headline(results["summaries"])}
    assert sorted(heads) == [1024, 2048, 4096, 8192, 16384]
    h = heads[16384]
    mb = [s for s in results["summaries"] if s["seq"] == 16384 and s["method"] == "microbatch"]
    assert h["best_microbatch_ms"] == min(s["median_ms"] for s in mb)
    assert h["cta_over_microbatch"] == pytest.approx(h["cta_ms"] / h["best_microbatch_ms"], abs=1e-4)


def test_plots_and_plot_only_cli(results, tmp_path, capsys, monkeypatch):
    """``bench --plot-only``: the table, then both figures (drawn by :func:`bench.plot`); Figure
    5's lines are the medians per height: sequential, the fastest floor, the fastest chain."""
    import matplotlib.axes

    lines = {}
    real_plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "plot",
        lambda ax, x, y, *a, **k: lines.__setitem__(k.get("label"), (list(x), list(y))) or real_plot(ax, x, y, *a, **k),
    )
    assert cli.main(["bench", "--plot-only", str(RECORDED), "--out", str(tmp_path / "again")]) == 0
    out = capsys.readouterr().out
    assert "cta_workqueue" in out and out.count("wrote") == 2
    paths = sorted((tmp_path / "again").iterdir())
    assert [p.name for p in paths] == ["fig4_reduction_vs_microbatch.png", "fig5_latency_vs_seq.png"]
    assert all(p.stat().st_size > 10_000 for p in paths)
    sums, seqs = results["summaries"], [1024, 2048, 4096, 8192, 16384]

    def fastest(seq, pred):
        return min(s["median_ms"] for s in sums if s["seq"] == seq and pred(s["method"]))

    want = {
        "sequential": [fastest(q, lambda m: m == "sequential") for q in seqs],
        "one layer (floor)": [fastest(q, lambda m: m in ("floor_cublas", "floor_triton")) for q in seqs],
        "CTA-pipelining": [fastest(q, lambda m: m.startswith("cta_")) for q in seqs],
    }
    assert {label: lines[label] for label in want} == {label: (seqs, ys) for label, ys in want.items()}


def test_figure_4_draws_the_reduction_against_each_chunk(results, tmp_path, monkeypatch):
    """Figure 4's bars: per micro-batching chunk at the largest height, ``100 (1 - cta /
    microbatch)`` with the fastest chain line, in chunk order."""
    import matplotlib.axes

    drawn = []
    real_bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(
        matplotlib.axes.Axes,
        "bar",
        lambda ax, x, h, *a, **k: drawn.append((list(x), list(h))) or real_bar(ax, x, h, *a, **k),
    )
    bench.plot(results, tmp_path)
    sums = results["summaries"]
    seq = max(s["seq"] for s in sums if s["method"] == "microbatch")
    cta = min(s["median_ms"] for s in sums if s["seq"] == seq and s["method"].startswith("cta_"))
    mb = sorted((s for s in sums if s["seq"] == seq and s["method"] == "microbatch"), key=lambda s: s["chunk"])
    (x, heights), *_ = drawn
    assert x == [str(s["chunk"]) for s in mb]
    assert heights == pytest.approx([100 * (1 - cta / s["median_ms"]) for s in mb])


def test_plots_without_a_tp_line(results, tmp_path):
    """Chains of more than 2 GPUs have no TP baseline: the plots must still be drawn."""
    no_tp = dict(results, gpus=4, summaries=[s for s in results["summaries"] if not s["method"].startswith("tp")])
    assert all(h["tp_ms"] is None for h in bench.headline(no_tp["summaries"]))
    assert len(bench.plot(no_tp, tmp_path)) == 2


def test_bench_without_gpus_says_so_and_shows_the_model(tmp_path, capsys):
    assert cli.main(["bench", "--seq", "2048", "--out", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "needs 2 GPUs" in out and "Nothing timed" in out
    assert "NOT measured" in out and "\n  2048 " in out


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--seq", "1024,x"], "argument --seq: expected comma-separated integers, got '1024,x'"),
        (["--ends", "512"], "argument --ends: takes 'balanced' or two row counts >= 0 (prefill,drain), got '512'"),
        (["--ends", "auto"], "got 'auto'"),
        (["--reps", "2"], "argument --reps: must be >= 3, got 2"),
        (["--rest-ms", "-1"], "argument --rest-ms: must be >= 0, got -1"),
        (["--plot-only", "missing.json"], "argument --plot-only: no such file: missing.json"),
    ],
)
def test_bad_arguments_end_in_one_line_and_status_2(argv, message, capsys, tmp_path):
    """Checked while parsing, before anything looks for GPUs."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv, "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("ctapipelining bench: error: ") and message in err
    assert not (tmp_path / "results.json").exists()


def test_ends_argument():
    assert bench.ends_arg("balanced") == "balanced" and bench.ends_arg("1408,512") == (1408, 512)
    assert bench.ends_arg("0,0") == (0, 0)


def test_plot_only_rejects_a_file_that_is_not_a_results_file(tmp_path, capsys):
    (tmp_path / "trace.json").write_text('{"T1_signal": {}}')
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--plot-only", str(tmp_path / "trace.json"), "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "not a bench results file (KeyError: 'summaries')" in capsys.readouterr().err


def test_paired_ratio_in_the_headline(results):
    raw = [dict(r) for r in results["raw"]]
    heads = {h["seq"]: h for h in bench.headline(results["summaries"], raw)}
    h = heads[16384]
    cta = next(r["ms"] for r in raw if r["method"] == h["cta_method"] and r["seq"] == 16384)
    mb = next(
        r["ms"] for r in raw if r["method"] == "microbatch" and r["seq"] == 16384 and r["chunk"] == h["best_chunk"]
    )
    ratios = [a / b for a, b in zip(cta, mb)]  # repetition i of one against repetition i of the other
    assert h["cta_over_microbatch_paired"] == pytest.approx(statistics.median(ratios), abs=1e-4)
    assert "cta_over_microbatch_paired" not in bench.headline(results["summaries"])[0]


def test_headline_takes_the_strongest_baselines_and_keeps_replicas_apart():
    """Micro-batching is the best of cuBLAS and our GEMM chunks, TP the fastest of its lines, and
    a chain with weight replicas (ends) is set against data parallelism with the same replicas."""
    rows = [
        dict(method="floor_cublas", seq=4096, chunk=None, median_ms=1.0),
        dict(method="microbatch", seq=4096, chunk=1024, median_ms=1.30),
        dict(method="microbatch_ours", seq=4096, chunk=1024, median_ms=1.25),
        dict(method="tp", seq=4096, chunk=None, median_ms=1.6),
        dict(method="tp_overlap", seq=4096, chunk=None, median_ms=1.4),
        dict(method="cta_static_graph", seq=4096, chunk=None, median_ms=1.2),
        dict(method="cta_static_ends_graph", seq=4096, chunk=None, median_ms=1.1),
        dict(method="dp_replicas", seq=4096, chunk=None, median_ms=1.05),
    ]
    (h,) = bench.headline(rows)
    assert h["floor_ms"] == 1.0 and h["cta_over_floor"] == 1.1
    (h,) = bench.headline(rows + [dict(method="floor_triton_graph", seq=4096, chunk=None, median_ms=0.9)])
    assert h["floor_ms"] == 0.9 and h["cta_over_floor"] == round(1.1 / 0.9, 4)  # the faster floor
    assert h["best_microbatch"] == "microbatch_ours" and h["best_microbatch_ms"] == 1.25
    assert h["tp_method"] == "tp_overlap" and h["cta_over_tp"] == round(1.1 / 1.4, 4)
    assert h["cta_weights_placed_once_ms"] == 1.2 and h["cta_replicated_ms"] == 1.1
    assert h["cta_replicated_over_dp"] == round(1.1 / 1.05, 4)


def test_a_rows_summary_gives_its_spread():
    """``Row.summary`` (what results.json keeps per line): median, min, max, the 10th and 90th
    percentiles (exclusive method) and the count; one sample gives that sample throughout."""
    s = bench.Row("m", 1, [float(i) for i in range(1, 11)]).summary()
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["p10_ms"], s["p90_ms"], s["n"]) == (
        5.5,
        1.0,
        10.0,
        1.1,
        9.9,
        10,
    )
    s = bench.Row("m", 1, [3.0]).summary()
    assert (s["median_ms"], s["min_ms"], s["max_ms"], s["p10_ms"], s["p90_ms"], s["n"]) == (3.0, 3.0, 3.0, 3.0, 3.0, 1)


def test_median_ci_takes_the_binomial_order_statistics():
    v = list(range(1, 31))  # n = 30: the 10th and 21st smallest at 95%
    assert timing.median_ci([float(x) for x in reversed(v)]) == (15.5, 10.0, 21.0)
    med, lo, hi = timing.median_ci([1.0, 2.0, 3.0, 4.0, 5.0])  # too few for a 95% interval
    assert med == 3.0 and lo != lo and hi != hi
    assert timing.median_ci([1.0] * 6) == (1.0, 1.0, 1.0)  # n = 6: the 1st and 6th (1/64 < 2.5%)
    assert timing.median_ci([9.0, 1.0, 16.0, 4.0, 36.0, 25.0]) == (12.5, 1.0, 36.0)  # the same, distinct
    # n = 10 at 80%: P(Binom < 3) = 56/1024 <= 10% < P(Binom < 4) = 176/1024, so the 3rd and 8th
    v = [float(x * x) for x in (3, 10, 1, 7, 5, 2, 9, 4, 8, 6)]
    assert timing.median_ci(v, level=0.8) == (30.5, 9.0, 64.0)
    assert timing.median_ci(v) == (30.5, 4.0, 81.0)  # at 95%: P(Binom < 2) = 11/1024 <= 2.5%, the 2nd and 9th
    with pytest.raises(ValueError):
        timing.median_ci([])


def test_decision_pairs_each_setting_with_its_strongest_baselines():
    """Per repetition: the chain without replicas against micro-batching, TP and the floor, the
    chain with ends also against data parallelism; each baseline its fastest line by median."""
    n = 30

    def line(method, ms, chunk=None):
        return dict(method=method, seq=2048, chunk=chunk, ms=list(ms))

    noise = [1 + 0.001 * ((7 * i) % 11) for i in range(n)]  # shared by a repetition's runs
    raw = [
        line("floor_triton_graph", [1.0 * z for z in noise]),
        line("microbatch", [2.0 * z for z in noise], 512),
        line("microbatch_ours", [1.6 * z for z in noise], 1024),  # the best micro-batching
        line("microbatch_ours", [1.9 * z for z in noise], 512),
        line("tp_graph", [2.0 * z for z in noise]),
        line("tp_overlap", [1.8 * z for z in noise]),
        line("dp_replicas", [1.5 * z for z in noise]),
        line("cta_static_graph", [1.44 * z for z in noise]),
        line("cta_workqueue_graph", [1.7 * z for z in noise]),
        line("cta_static_ends_graph", [1.2 * z for z in noise]),
    ]
    rows = {r["setting"]: r for r in bench.decision(raw)}
    placed, repl = rows["placed_once"], rows["replicated"]
    assert placed["method"] == "cta_static_graph" and repl["method"] == "cta_static_ends_graph"
    assert placed["microbatch"] == dict(line="microbatch_ours/1024", ratio=0.9, ci95=[0.9, 0.9])
    assert placed["tp"]["line"] == "tp_overlap" and placed["tp"]["ratio"] == 0.8
    assert "dp_replicas" not in placed  # no replicas in this setting
    assert repl["dp_replicas"]["ratio"] == 0.8 and repl["floor"]["ratio"] == 1.2
    text = bench.decision_table(bench.decision(raw))
    assert "microbatch 0.900 [0.900, 0.900] (microbatch_ours/1024)" in text


def test_decision_ratios_pair_the_runs_of_each_repetition():
    """A baseline whose time varies a lot between repetitions, and a chain at 0.85x or 0.95x of
    it in alternate repetitions: the paired ratios are 0.85 and 0.95 (median 0.9, interval
    [0.85, 0.95]); runs matched in any other way would give other ratios."""
    base = [1 + 0.05 * ((7 * i) % 30) for i in range(30)]
    chain = [b * (0.85 if i % 2 == 0 else 0.95) for i, b in enumerate(base)]
    raw = [
        dict(method="microbatch_ours", seq=2048, chunk=512, ms=base),
        dict(method="cta_static_graph", seq=2048, chunk=None, ms=chain),
    ]
    (row,) = bench.decision(raw)
    assert row["microbatch"] == dict(line="microbatch_ours/512", ratio=0.9, ci95=[0.85, 0.95])


def test_fewer_layers_than_gpus_is_refused_before_looking_for_gpus(tmp_path, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # also on a GPU host: nothing is timed
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--gpus", "2", "--layers", "1", "--out", str(tmp_path)])
    assert e.value.code == 2
    assert "--layers 1: fewer than the 2 GPUs" in capsys.readouterr().err
    assert cli.main(["bench", "--gpus", "2", "--layers", "2", "--out", str(tmp_path)]) == 2  # not refused: 1 GPU
    assert "needs 2 GPUs with peer access; found 1" in capsys.readouterr().out


def test_a_chain_on_more_gpus_than_there_are_is_not_timed(tmp_path, capsys, monkeypatch):
    """Two GPUs, and a chain asked for on four: the message names the four it needs, and nothing is timed."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.main(["bench", "--gpus", "4", "--out", str(tmp_path / "out")]) == 2
    assert "bench needs 4 GPUs with peer access; found 2. Nothing timed." in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_the_device_script_run_twice_in_one_call_keeps_both_runs_files(tmp_path):
    """``benchmarks/device_run.sh`` packs what a run wrote into a tarball; run again into the
    same folder (two runs in one device call), it packs the second run's files into a tarball of
    their own and leaves the first's as it was."""
    import subprocess
    import tarfile

    root, out = Path(__file__).parent.parent, tmp_path / "out"
    for i in (1, 2):
        (out / "sub").mkdir(parents=True, exist_ok=True)
        (out / f"run{i}.log").write_text(f"run {i}")
        (out / "sub" / f"part{i}.json").write_text("{}")
        env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "STEPS": "none"}
        subprocess.run(
            ["bash", str(root / "benchmarks/device_run.sh")], cwd=root, env=env, check=True, capture_output=True
        )
    packed = {p.name: sorted(tarfile.open(p).getnames()) for p in out.glob("*.tar.gz")}
    assert packed == {"all.tar.gz": ["run1.log", "sub/part1.json"], "all-2.tar.gz": ["run2.log", "sub/part2.json"]}
    assert sorted(p.name for p in out.iterdir()) == ["all-2.tar.gz", "all.tar.gz"]
