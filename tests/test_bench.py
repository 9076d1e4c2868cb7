"""Tables, headline ratios and plots from a recorded device run (no GPU needed)."""

import json
import statistics
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


def test_bad_arguments(capsys, tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--seq", "1024,x"])
    assert "comma-separated integers" in capsys.readouterr().err
    # checked before anything looks for GPUs
    with pytest.raises(SystemExit, match="--ends takes .balanced. or two row counts"):
        cli.main(["bench", "--ends", "512", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="got 'auto'"):
        cli.main(["bench", "--ends", "auto", "--out", str(tmp_path)])
    assert bench._ends_arg("balanced") == "balanced" and bench._ends_arg("1408,512") == (1408, 512)
    with pytest.raises(SystemExit, match="--reps must be >= 3"):
        cli.main(["bench", "--reps", "2", "--out", str(tmp_path)])


def _methods(calls):
    return [bench.Method(name, lambda name=name: calls.append(name)) for name in "abcde"]


def test_shuffled_order_runs_every_method_once_per_repetition_in_changing_orders():
    calls, places = [], {}
    times = bench.time_interleaved(_methods(calls), [], reps=12, warmup=2, positions=places)
    assert len(calls) == 14 * 5
    reps = [calls[i : i + 5] for i in range(10, len(calls), 5)]  # after the warm-up
    assert all(sorted(r) == list("abcde") for r in reps)
    assert len({tuple(r) for r in reps}) > 6  # not one fixed order: no method always follows the same one
    assert {name: len(v) for name, v in times.items()} == dict.fromkeys("abcde", 12)
    for i, r in enumerate(reps):  # positions say where each method ran in repetition i
        assert [places[name][i] for name in r] == list(range(5))
    # seeded: the same run again gives the same orders
    again = []
    bench.time_interleaved(_methods(again), [], reps=12, warmup=2)
    assert again == calls


def test_fixed_order_and_rest_before_each_timed_run():
    calls = []
    times = bench.time_interleaved(_methods(calls), [], reps=3, warmup=1, order="fixed", rest_ms=20)
    assert calls == list("abcde") * 4
    assert all(t < 15 for v in times.values() for t in v)  # the rest is not timed
    with pytest.raises(ValueError, match="order"):
        bench.time_interleaved(_methods([]), [], reps=1, warmup=0, order="random")
    with pytest.raises(ValueError, match="rest_ms"):
        bench.time_interleaved(_methods([]), [], reps=1, warmup=0, rest_ms=-1)


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


def test_parse_smi_keeps_numbers_masks_and_skips_other_lines():
    text = (
        "0, 1425, 691.19, 62, 0x0000000000000004\n"
        "1, 1980, 141.85, 48, 0x0000000000000000\n"
        "WARNING: infoROM is corrupted at gpu 0000:00:05.0\n"
        "0, [N/A], 690.00, 61, 0x0000000000000004\n"
        "1, 1980, 14"  # cut off when nvidia-smi was stopped
    )
    rows = bench.parse_smi(text, 4)
    assert rows[0] == [[1425.0, 691.19, 62.0, "0x0000000000000004"], ["[N/A]", 690.0, 61.0, "0x0000000000000004"]]
    assert rows[1] == [[1980.0, 141.85, 48.0, "0x0000000000000000"]]
    assert bench.parse_smi("", 3) == {}
