"""Tables, headline ratios and plots from a recorded device run (no GPU needed)."""

import json
from pathlib import Path

import pytest

from ctapipelining import bench, cli

RECORDED = Path(__file__).parent.parent / "benchmarks/results/2026-11-30-h200x2/run1/results.json"


@pytest.fixture(scope="module")
def results():
    return json.loads(RECORDED.read_text())


def test_table_has_every_method_with_ratio_to_floor(results):
    t = bench.table(results["summaries"])
    for method in ("floor_cublas", "floor_triton", "sequential", "microbatch", "tp", "cta_workqueue", "cta_static"):
        assert method in t
    floor_line = next(line for line in t.splitlines() if line.startswith("floor_triton") and " 16384 " in line)
    assert floor_line.rstrip().endswith("1.000")


def test_headline_ratios_are_recomputed_from_medians(results):
    heads = {h["seq"]: h for h in bench.headline(results["summaries"])}
    assert sorted(heads) == [1024, 2048, 4096, 8192, 16384]
    h = heads[16384]
    mb = [s for s in results["summaries"] if s["seq"] == 16384 and s["method"] == "microbatch"]
    assert h["best_microbatch_ms"] == min(s["median_ms"] for s in mb)
    assert h["cta_over_microbatch"] == pytest.approx(h["cta_ms"] / h["best_microbatch_ms"], abs=1e-4)


def test_plots_and_plot_only_cli(results, tmp_path, capsys):
    paths = bench.plot(results, tmp_path)
    assert {p.name for p in paths} == {"fig4_reduction_vs_microbatch.png", "fig5_latency_vs_seq.png"}
    assert all(p.stat().st_size > 10_000 for p in paths)
    assert cli.main(["bench", "--plot-only", str(RECORDED), "--out", str(tmp_path / "again")]) == 0
    assert "cta_workqueue" in capsys.readouterr().out


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


def test_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--seq", "1024,x"])
    assert "comma-separated integers" in capsys.readouterr().err
