"""The simulator and planner: properties, calibration, and validation against the committed
2x H200 runs (every method within 10% at 2048, 8192 and 16384)."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ctapipelining import deps, sim

CAL = sim.Calibration.default()
RESULTS = Path(__file__).parent.parent / "benchmarks/results"
FINAL = RESULTS / "2026-11-30-h200x2-protocol/final"  # the runs the packaged calibration was fitted on
TUNE = RESULTS / "2026-11-30-h200x2-sim-inputs/tune1.json"
# runs of kernels that signalled each tile right after its store (no lag, T1 3.8 us)
OLD = RESULTS / "2026-11-30-h200x2-sim-inputs"
needs_results = pytest.mark.skipif(not FINAL.is_dir() or not OLD.is_dir(), reason="benchmarks/results not here")


@pytest.fixture(scope="module")
def old_cal():
    cal = sim.Calibration.from_results(OLD / "run3/results.json", OLD / "trace/timeline_static_16384.json")
    return replace(cal, signal_lag=0.0)


def test_a_split_round_of_few_rows_is_no_faster_than_its_operands_stream():
    """Few rows: a GEMM split along K on a CTA per slice is bound by streaming its weights from
    HBM once, and by no less; unsplit it keeps its narrow round's tile time."""
    for M, K, N in [(1, 28672, 8192), (64, 28672, 8192), (128, 57344, 8192), (16, 14336, 4096)]:  # down GEMMs
        stream = 2 * (M * K + K * N) / CAL.hbm_gbps + CAL.launch_ns
        split = sim.simulate_gemm(M, K, N, CAL, split_tail=True, split_k=True)
        assert split >= stream, (M, K, N)
        assert split <= sim.simulate_gemm(M, K, N, CAL, split_tail=True, split_k=False), (M, K, N)


def test_packaged_calibration_names_its_source_and_device():
    assert "protocol/final/results.json" in CAL.source and "timeline_static_16384.json" in CAL.source
    assert "tune1.json" in CAL.source
    assert CAL.device == "2x NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0)"
    assert CAL.label.startswith(CAL.device) and CAL.label.endswith("2026-11-30-h200x2-protocol/final")
    assert CAL.t1_ns == pytest.approx(256.0) and CAL.t3_ns == pytest.approx(768.0)
    assert CAL.signal_lag == sim.SIGNAL_LAG == 0.25  # the kernels signal a quarter into the next tile
    assert 1.0 < CAL.remote_factor < 1.2 and 100 < CAL.p2p_gbps < 1000
    assert CAL.tile_shapes[0][:2] == (128, 128) and 1.0 < CAL.tile_shapes[0][2] < 1.3  # from the tuning run
    assert sim.plan(2048, [1024, 1024, 1024], 2)[0].predicted_ms > 0  # the planner's default calibration


@needs_results
def test_packaged_calibration_is_the_one_fitted_on_its_results_folder():
    fitted = sim.Calibration.from_results(FINAL, tune=TUNE)
    # every parameter (a fitted one to a rounding: its last bit depends on the BLAS), the source and the device
    packaged, fitted_fields = vars(sim.Calibration.default()), vars(fitted)
    assert packaged.keys() == fitted_fields.keys()
    for name, value in packaged.items():
        want = fitted_fields[name]
        assert value == (pytest.approx(want, rel=1e-12) if isinstance(want, float) else want), name
    assert fitted.source.split(" + ")[0].endswith("protocol/final/results.json")  # a folder means its results.json


def test_save_and_load_round_trip(tmp_path):
    p = CAL.save(tmp_path / "cal.json", environment=dict(torch="2.11", gpus=["H200"], other="dropped"))
    data = json.loads(p.read_text())
    assert data["source"]["environment"] == dict(torch="2.11", gpus=["H200"])
    assert data["source"]["files"] == CAL.source.split(" + ")
    assert sim.Calibration.load(p) == CAL
    bare = replace(sim.Calibration(), tile_shapes=((64, 64, 1.5),))
    assert sim.Calibration.load(bare.save(tmp_path / "bare.json")) == bare


@needs_results
def test_old_calibration_reads_its_trace(old_cal):
    assert old_cal.t1_ns == pytest.approx(3840.0)
    assert "run3/results.json" in old_cal.source and old_cal.device.startswith("2x NVIDIA H200")


@needs_results
@pytest.mark.parametrize("run", ["final-protocol", "run2", "run3"])
def test_predictions_within_10_percent_of_measured(run, old_cal):
    cal, results = {
        "final-protocol": (CAL, FINAL / "results.json"),
        "run2": (old_cal, OLD / "run2/results.json"),
        "run3": (old_cal, OLD / "run3/results.json"),
    }[run]
    rows = sim.validate(cal, results)
    want = {"floor_triton", "sequential", "tp", "microbatch_best"}
    if run != "run2":  # (run2 has no chain lines)
        want |= {"cta_static_graph", "cta_workqueue_graph"}
    assert {r["method"] for r in rows} >= want
    bad = [r for r in rows if abs(r["error_pct"]) > 10]
    assert not bad, bad


@pytest.mark.parametrize("M", [512, 2048, 8192])
def test_single_stage_is_one_kernel(M):
    """One stage is one persistent GEMM: its rounds of tiles (the last one partial) at the
    calibrated tile time, and a launch."""
    tiles = -(-M // CAL.block_m) * -(-4096 // CAL.block_n)
    rounds = -(-tiles // CAL.num_sms)
    want = rounds * CAL.tile_ns(4096) + CAL.launch_ns
    assert sim.simulate_cta(M, [4096, 4096], CAL).total_ns == pytest.approx(want)
    assert sim.simulate_gemm(M, 4096, 4096, CAL) == pytest.approx(want)


@pytest.mark.parametrize("policy", ["static", "workqueue"])
@pytest.mark.parametrize("M", [128, 1024, 4096, 16384])
def test_pipelining_never_beats_one_kernel_nor_loses_to_sequential(policy, M):
    dims = [8192, 8192, 8192]
    t = sim.simulate_cta(M, dims, CAL, policy).total_ns
    assert t >= sim.simulate_gemm(M, 8192, 8192, CAL)
    one_after_other = 2 * sim.simulate_gemm(M, 8192, 8192, CAL) + CAL.copy_ns(M * 8192 * 2)
    assert t <= one_after_other * CAL.remote_factor + 2 * CAL.t1_ns * 40


def test_workqueue_runs_tiles_in_the_order_they_became_ready_and_static_in_its_tile_order():
    """A ``workqueue`` consumer starts tiles in readiness order (the last tile, ready first, starts
    first); a ``static`` one walks the fixed tile order, each CTA's tiles one after another."""
    grid = deps.TileGrid(4096, 4096, 128, 256)  # 512 tiles on 132 CTAs
    T = grid.num_tiles
    ready = np.arange(T)[::-1] * 1000.0  # the last tile's input first
    rows = sim._gemm_stage(grid, 4096, CAL, ready, "workqueue", 0.0, False, False)
    starts = rows[np.argsort(ready, kind="stable"), 1]
    assert np.all(np.diff(starts) >= 0) and np.argmin(rows[:, 1]) == T - 1
    rows = sim._gemm_stage(grid, 4096, CAL, ready, "static", 0.0, False, False)
    order = deps.tile_order(grid, CAL.group_m)
    P = min(CAL.num_sms, T)
    for pid in range(P):  # each CTA's tiles in the order's stride, one after another
        mine = order[pid::P]
        assert np.all(rows[mine, 4] == pid) and np.all(np.diff(rows[mine, 1]) > 0)


def test_monotonic_in_work():
    for f in (
        lambda m: sim.simulate_gemm(m, 4096, 4096, CAL),
        lambda m: sim.simulate_cta(m, [4096, 4096, 4096], CAL).total_ns,
        lambda m: sim.best_microbatch(m, [4096, 4096, 4096], CAL)[0],
        lambda m: sim.simulate_tp(m, 4096, 4096, 2, CAL)["total_ns"],
    ):
        ts = [f(m) for m in (256, 1024, 4096, 8192)]
        assert ts == sorted(ts)


def test_microbatch_with_one_chunk_is_sequential_plus_launches():
    dims = [4096, 4096, 4096]
    one = sim.simulate_microbatch(4096, dims, 4096, CAL)
    assert one == pytest.approx(sim.simulate_sequential(4096, dims, CAL, eager=False) + CAL.launch_ns, rel=1e-6)


def test_timeline_has_trace_format():
    r = sim.simulate_cta(1024, [2048, 2048, 2048], CAL, "workqueue")
    for rows in r.trace:
        assert rows.shape[1] == 5
        assert (np.diff(rows[:, :4], axis=1) >= 0).all()
    assert r.total_ns >= max(r.producer_end_ns)


def test_planner_ranks_layouts_and_knows_when_not_to_pipeline():
    tiny = sim.plan(128, [1024, 1024, 1024], 2, CAL)
    assert tiny[0].method in ("single", "sequential", "tp")  # one wave: nothing to pipeline
    big = sim.plan(16384, [8192, 8192, 8192], 4, CAL)
    assert [lay.predicted_ms for lay in big] == sorted(lay.predicted_ms for lay in big)
    assert {lay.method for lay in big} >= {"single", "microbatch", "cta", "tp", "cta+tp"}
    assert "sequential" not in {lay.method for lay in big}
    assert any("tile 128x128" in lay.detail for lay in big)  # tile shape is part of the choice
    assert any("policy workqueue" in lay.detail for lay in big)  # and the policy
    assert all(lay.stages * lay.tp <= 4 for lay in big)
    refusal = "plan needs M >= 1, at least one layer \\(two dims\\) and at least one GPU"
    for M, dims, gpus in [(0, [8, 8], 1), (8, [8, 8], 0), (8, [8], 1)]:
        with pytest.raises(ValueError, match=refusal):
            sim.plan(M, dims, gpus, CAL)


def test_figures_shapes():
    """Figure 4's line per GPU count: the faster policy's chain, the best chunk's
    micro-batching, the reduction between them (the paper's headline number, beside its own)."""
    f4 = sim.figure4(CAL, M=2048, K=2048, gpus=(2, 4))
    assert [f["gpus"] for f in f4] == [2, 4] and f4[0]["paper_reduction_pct"] == 31.8
    for f in f4:
        dims = [2048] * (f["gpus"] + 1)
        cta = min(sim.simulate_cta(2048, dims, CAL, p).total_ns for p in ("static", "workqueue")) / 1e6
        best = min(sim.simulate_microbatch(2048, dims, c, CAL) for c in (512, 1024, 2048)) / 1e6
        assert f["cta_ms"] == pytest.approx(cta, abs=1e-4) and min(f["microbatch_ms"].values()) == pytest.approx(
            best, abs=1e-4
        )
        assert f["reduction_vs_best_pct"] == pytest.approx(100 * (1 - cta / best), abs=0.01)
    f7 = sim.figure7(CAL, M=2048, K=2048, gpus=(4,))
    assert f7[0]["hybrid"]["comm_ns"] == pytest.approx(f7[0]["tp_half"]["comm_ns"])


@pytest.mark.parametrize("g", [2, 4, 8])
def test_tp_all_reduces_the_blocks_output_in_a_ring_over_all_its_gpus(g):
    """TP's communication: one ring all-reduce of the ``[M, K]`` bf16 output over its ``g``
    GPUs, ``alpha + 2 (g - 1) / g * bytes / busbw``; one GPU has none."""
    M, K = 4096, 8192
    want = CAL.allreduce_alpha_ns + 2 * (g - 1) / g * (M * K * 2) / CAL.allreduce_busbw_gbps
    assert sim.simulate_tp(M, K, 2 * K, g, CAL)["comm_ns"] == pytest.approx(want, rel=1e-12)
    assert sim.simulate_tp(M, K, 2 * K, 1, CAL)["comm_ns"] == 0.0


def test_tp_compute_is_two_eager_shard_gemms_scaled_by_the_fitted_factor():
    """TP's compute: its two shard GEMMs (``[M, K] @ [K, N/g]``, ``[M, N/g] @ [N/g, K]``) in the
    cuBLAS model, eagerly, times ``tp_factor`` (the measured ratio of TP's half-width GEMMs to the
    model); a calibration with twice the factor predicts twice the compute and the same
    all-reduce."""
    M, K, N, g = 2048, 8192, 28672, 2  # (N / g != K: a model that did not shard would differ)
    want = CAL.tp_factor * (CAL.cublas_ns(M, K, N // g, True) + CAL.cublas_ns(M, N // g, K, True))
    one = sim.simulate_tp(M, K, N, g, CAL)
    assert one["compute_ns"] == pytest.approx(want, rel=1e-12) and CAL.tp_factor != 1.0
    two = sim.simulate_tp(M, K, N, g, replace(CAL, tp_factor=2 * CAL.tp_factor))
    assert two["compute_ns"] == pytest.approx(2 * one["compute_ns"], rel=1e-12)
    assert two["comm_ns"] == one["comm_ns"] and one["total_ns"] == one["compute_ns"] + one["comm_ns"]


def test_hybrid_shards_compute_their_share_of_the_width():
    """Figure 7's ``cta+tp``: at TP 2 each of a stage's GPUs computes half the first GEMM's
    columns (and half the second's K), so the pipelined compute takes about half as long."""
    h = {t: sim.simulate_hybrid(16384, 8192, 8192, t, CAL)["compute_ns"] for t in (1, 2)}
    assert 0.45 * h[1] < h[2] < 0.6 * h[1]


def test_prefill_waits_for_its_copy_and_the_drain_writes_into_the_peer():
    """``prefill_rows``: the second GPU's prefill tiles start once ``x[:R]`` has been copied
    over; ``drain_rows``: the first GPU's drain (one round of each layer's last rows, the
    second writing into the peer at ``remote_factor``) ends stage 0 after its producer."""
    r = sim.simulate_cta(16384, [8192] * 3, CAL, "static", 8, prefill_rows=1024, drain_rows=512)
    prefill = r.trace[0][: 1024 // CAL.block_m * (8192 // CAL.block_n)]
    assert prefill[:, 1].min() == pytest.approx(CAL.copy_ns(1024 * 8192 * 2))
    drain = 2 * CAL.launch_ns + CAL.tile_ns(8192) * (1 + CAL.remote_factor)
    assert r.producer_end_ns[0] == pytest.approx(r.trace[0][:, 3].max() + drain)


def test_loopback_stages_share_the_gpus_hbm():
    """The loopback's stages, each on half the SMs, also share HBM: on 64 x 128 tiles at 128 rows
    (bound by HBM) they take about 1.5x the same stages given the whole bandwidth each."""
    narrow = CAL.with_config(sim.table_config(sim.GEMM_TABLE, 128))
    alone = replace(narrow, num_sms=narrow.num_sms // 2, remote_factor=1.0)
    ratio = (
        sim.simulate_loopback(128, [8192] * 3, narrow) / sim.simulate_cta(128, [8192] * 3, alone, wait_parts=8).total_ns
    )
    assert ratio > 1.3, ratio


def test_microbatching_copies_each_chunk_in_order_on_the_copy_engine():
    """Two stages on two GPUs, chunks of 1024 rows: each chunk's GEMMs and its copy, the copies
    queued one after another on the copy engine; with a slow link the copies dominate, and a
    gated stage's (half its GEMM's columns) take half as long."""
    c = replace(CAL, p2p_gbps=10)
    want = 2 * (c.cublas_ns(1024, 4096, 4096) + c.launch_ns) + 4 * c.copy_ns(1024 * 4096 * 2)
    assert sim.simulate_microbatch(4096, [4096] * 3, 1024, c) == pytest.approx(want)
    slow, dims = replace(CAL, p2p_gbps=1.0), [8192, 2 * 28672, 8192]
    gated = sim.simulate_microbatch(4096, dims, 512, slow, devices=[0, 1], gated=[True, False])
    assert gated < 0.55 * sim.simulate_microbatch(4096, dims, 512, slow, devices=[0, 1])


def test_signal_lag_moves_each_signal_into_the_next_tile():
    """``signal_lag``: a tile is signalled that fraction into its CTA's next tile, the CTA's last
    tile at its end; without lag every tile is signalled when it ends (plus T1)."""
    grid_dims = [4096, 4096, 4096]
    lagged = sim.simulate_cta(4096, grid_dims, CAL, "static").trace[0]
    now = sim.simulate_cta(4096, grid_dims, replace(CAL, signal_lag=0.0), "static").trace[0]
    t_tile = CAL.tile_ns(4096) * CAL.remote_factor
    for pid in (0, 7):
        mine = np.flatnonzero(lagged[:, 4] == pid)
        mine = mine[np.argsort(lagged[mine, 1])]
        np.testing.assert_allclose(lagged[mine[:-1], 3], lagged[mine[1:], 1] + 0.25 * t_tile)
        assert lagged[mine[-1], 3] == pytest.approx(lagged[mine[-1], 2] + CAL.t1_ns)
    assert now[:, 3] == pytest.approx(now[:, 2] + CAL.t1_ns)


def test_waiting_in_parts_helps_only_a_consumer_with_slack():
    """A consumer that waits for its input rows part by part starts its tiles before their
    right-hand columns are written. That shortens the chain when the consumer's tiles are
    faster than the producer's (here the producer writes into the peer 7% slower, a little more
    than the 4-6% the replayed traces of 2026-11-30-h200x2-tails measured), and it can never lengthen it: one
    part is the whole row-block, and the K-fractions only let a tile start earlier."""
    dims = [8192, 8192, 8192]
    slow = replace(CAL, remote_factor=1.07)
    t = {P: sim.simulate_cta(16384, dims, slow, "static", wait_parts=P).total_ns for P in (1, 2, 4, 8)}
    assert t[1] > t[2] > t[4] > t[8] > sim.simulate_gemm(16384, 8192, 8192, slow)
    assert t[4] < 0.985 * t[1]
    even = replace(CAL, remote_factor=1.0)
    t1, t4 = (sim.simulate_cta(16384, dims, even, "static", wait_parts=P).total_ns for P in (1, 4))
    assert t4 <= t1 and t4 > 0.995 * t1
    with pytest.raises(ValueError, match="static"):
        sim.simulate_cta(2048, dims, CAL, "workqueue", wait_parts=2)


def test_prefill_pays_only_when_the_producer_is_the_slower_side():
    """The second GPU computing the first rows of layer 1 itself (``prefill_rows``) starts its
    consumer later but takes work off a producer slowed by writing into the peer. The model
    says it pays only when that slowdown is large, and only for a small prefill: its GPU has
    two rounds of layer 1 more to do, then all of layer 2."""
    dims = [8192, 8192, 8192]
    runs = {}

    def t(cal, R):
        runs[cal, R] = sim.simulate_cta(16384, dims, cal, "static", wait_parts=8, prefill_rows=R)
        return runs[cal, R].total_ns

    even, slow = replace(CAL, remote_factor=1.0), replace(CAL, remote_factor=1.07)
    assert t(slow, 512) < 0.98 * t(slow, 0)
    assert t(even, 1024) > t(even, 0) and t(slow, 2048) > t(slow, 0)
    assert t(even, 0) == sim.simulate_cta(16384, dims, even, "static", wait_parts=8).total_ns
    two = runs[even, 1024].trace[0]
    assert len(two) == 16384 // CAL.block_m * (8192 // CAL.block_n)  # prefill and producer tiles, one row each


def test_both_ends_filled_pay_where_either_alone_does_not():
    """The model of ``Pipeline(prefill_rows=R, drain_rows=D)``: a prefill alone lengthens the
    second GPU's path (it still does all of layer 2 after it), a drain alone the first GPU's
    (it still does all of layer 1 before it); with both, each GPU's path is about half the
    chain's work, and one round (4 row-blocks of 128, 128 tiles) each way is the right size."""
    dims = [8192, 8192, 8192]
    t = lambda R, D: sim.simulate_cta(16384, dims, CAL, "static", wait_parts=8, prefill_rows=R, drain_rows=D)  # noqa: E731
    filled = t(512, 512)
    none, both = t(0, 0).total_ns, filled.total_ns
    assert both < 0.98 * none
    assert t(512, 0).total_ns > 0.99 * none and t(0, 512).total_ns > 0.99 * none
    assert t(1024, 512).total_ns > 1.02 * both  # the second GPU prefills a round too many
    ends = filled.producer_end_ns  # the first GPU's end includes its drain: the two ends meet
    assert abs(ends[0] - ends[1]) < 0.01 * both
    assert len(filled.trace[1]) == (16384 - 512) // CAL.block_m * (8192 // CAL.block_n)  # the consumer's tiles


SHARED = Path(__file__).parents[1] / "benchmarks/results/2026-12-01-h200-chain"


@pytest.mark.skipif(not SHARED.exists(), reason="needs the committed one-GPU results")
@pytest.mark.parametrize("run", ["shared_gpu-956d730.json", "shared_gpu-fcd43a4.json", "shared_gpu-ef5dd46.json"])
def test_shared_gpu_model_predicts_the_chain_kernel_against_sequential(run):
    """Two stages on one H200, six row counts, three runs on different machines (among the five
    ``Calibration.tail_slice_ns`` is fitted on, at 640 and 768 rows): the chain kernel over our
    GEMMs one after another within 3% from 640 rows on (2.3% the largest), within 3.5% at 128
    rows (2.5-3.3%); over the loopback within 8% (7.7% at 128 rows: the model has no clocks,
    and a loopback's idle SMs let the others clock up)."""
    rows = sim.validate_shared(CAL, SHARED / run, tile_ns=sim.traced_tile_ns(SHARED / "trace_640.npz"))
    assert {r["seq"] for r in rows} == {128, 640, 768, 1024, 2048, 16384}
    seq = [r for r in rows if r["ratio"] == "chain/ours_seq"]
    assert all(abs(r["error_pct"]) < (3.5 if r["seq"] == 128 else 3) for r in seq), seq
    loop = [r for r in rows if r["ratio"] == "chain/loopback"]
    assert all(abs(r["error_pct"]) < 8 for r in loop), loop


RESULTS = Path(__file__).parents[1] / "benchmarks/results"


@pytest.mark.parametrize("run", ["2026-12-01-h200-configs/run11-parts", "2026-12-05-h200-default"])
def test_shared_gpu_model_predicts_the_chain_in_the_tables_configurations(run):
    """Two runs of the current configuration tables on two machines (``chain`` in its table's
    tiles per plan height, our GEMMs one after another in the plain GEMM's table, ``chain_wide``
    on 128 x 256 tiles at every height), with the traced tile time of another H200: from 640 rows
    on, either chain over our GEMMs one after another, ``chain_wide`` over the loopback and a
    split last round over none within 3% (the largest, 2.8%, at 768 rows). At 128 rows, where a round of
    64 x 128 tiles streams the whole weight matrix (``Calibration.hbm_gbps``; each part a
    consumer checks mid-loop stalls it, ``Calibration.part_check_ns``), the chain over our GEMMs
    within 3% (1.4-2.0%); ``chain_wide``'s 32 busy SMs clock up beyond the model, which predicts
    it slower (16-19%), within 25%."""
    rows = sim.validate_shared(
        CAL, RESULTS / run / "shared_gpu.json", tile_ns=sim.traced_tile_ns(SHARED / "trace_640.npz"), tables=True
    )
    by = {(r["seq"], r["ratio"]): r["error_pct"] for r in rows}
    for M in (640, 768, 1024, 2048, 16384):
        assert abs(by[M, "chain/ours_seq"]) < 3 and abs(by[M, "chain_wide/ours_seq"]) < 3, M
        assert abs(by[M, "chain_wide/loopback"]) < 3 and abs(by[M, "chain_split/chain_wide"]) < 3, M
    assert abs(by[128, "chain/ours_seq"]) < 3, by[128, "chain/ours_seq"]
    assert by[128, "chain_wide/ours_seq"] < 25, by[128, "chain_wide/ours_seq"]


def test_a_run_that_recorded_its_configurations_is_modelled_in_them(tmp_path):
    """``benchmarks/shared_gpu.py`` records, per row count, the configurations its ``ours_seq``
    and ``chain`` lines ran; ``validate_shared`` models those lines in them: the last run with
    the current tables written into it predicts as ``tables=True`` does, and with 128 x 256
    tiles written in at 128 rows instead, our GEMMs one after another are modelled on them (2x
    slower than on the narrow tiles)."""
    import json

    src = RESULTS / "2026-12-05-h200-default/shared_gpu.json"
    run = json.loads(src.read_text())
    for M, row in run["rows"].items():
        row["configs"] = {
            "ours_seq": sim.table_config(sim.GEMM_TABLE, int(M)),
            "chain": sim.table_config(sim.PIPELINE_TABLE, int(M)),
        }
    (tmp_path / "recorded.json").write_text(json.dumps(run))
    assert sim.validate_shared(CAL, tmp_path / "recorded.json") == sim.validate_shared(CAL, src, tables=True)
    wide = dict(sim.table_config(sim.GEMM_TABLE, 16384))
    run["rows"]["128"]["configs"]["ours_seq"] = wide
    (tmp_path / "wide.json").write_text(json.dumps(run))
    by = {(r["seq"], r["ratio"]): r["predicted"] for r in sim.validate_shared(CAL, tmp_path / "wide.json")}
    narrow = {(r["seq"], r["ratio"]): r["predicted"] for r in sim.validate_shared(CAL, src, tables=True)}
    assert by[128, "chain/ours_seq"] < 0.6 * narrow[128, "chain/ours_seq"]
    # our GEMMs recorded with split_k: at 128 rows the 32 wide tiles split along K, so our GEMMs
    # one after another are modelled faster
    for row in run["rows"].values():
        row["configs"]["ours_seq"] = {**row["configs"]["ours_seq"], "split_k": True}
    (tmp_path / "whole.json").write_text(json.dumps(run))
    whole = {(r["seq"], r["ratio"]): r["predicted"] for r in sim.validate_shared(CAL, tmp_path / "whole.json")}
    assert whole[128, "chain/ours_seq"] > 1.5 * by[128, "chain/ours_seq"]
    assert whole[2048, "chain/ours_seq"] == by[2048, "chain/ours_seq"]  # whole rounds there: no change


def test_shared_gpu_model_on_the_calibrated_tiles_in_an_earlier_run_with_the_pipeline_table():
    """``run6-table`` (an earlier pipeline table; ``chain_wide`` on 128 x 256 tiles at every
    height): from 640 rows on, ``chain_wide`` over our GEMMs one after another and over the
    loopback within 3%, and a split last round over none within 1.5%
    (``Calibration.chain_tail_slice_ns`` is fitted there, at 640 rows)."""
    run = RESULTS / "2026-12-01-h200-configs/run6-table/shared_gpu.json"
    rows = sim.validate_shared(CAL, run, tile_ns=sim.traced_tile_ns(SHARED / "trace_640.npz"))
    by = {(r["seq"], r["ratio"]): r["error_pct"] for r in rows}
    for M in (640, 768, 1024, 2048, 16384):
        assert abs(by[M, "chain_wide/ours_seq"]) < 3 and abs(by[M, "chain_wide/loopback"]) < 3, M
        assert abs(by[M, "chain_split/chain_wide"]) < 1.5, M


def test_a_gemm_takes_at_least_its_operands_streaming_time():
    """``Calibration.for_gemm``: X[128, 8192] @ W[8192, 57344] (a Llama-70B gate/up GEMM on
    128 x 256 tiles, two rounds) takes the time the weight takes to stream from HBM, and so
    does X[128, 8192] @ W[8192, 8192] on the 64 x 128 tiles the plain GEMM's table gives 128
    rows; 16384 rows against 256 columns (one round of 128 row-blocks sharing all of W), 640 and
    16384 rows on 8192 columns compute longer than they read: the calibration unchanged."""
    stream = (2 * 8192 * 57344 + 2 * 128 * 8192) / CAL.hbm_gbps + CAL.launch_ns
    assert sim.simulate_gemm(128, 8192, 57344, CAL) == pytest.approx(stream, rel=0.01)
    narrow = CAL.with_config(sim.table_config(sim.GEMM_TABLE, 128))
    assert (narrow.block_m, narrow.block_n, narrow.block_k) == (64, 128, 128)
    stream = (2 * 8192 * 8192 + 2 * 128 * 8192) / CAL.hbm_gbps + CAL.launch_ns
    assert sim.simulate_gemm(128, 8192, 8192, narrow) == pytest.approx(stream, rel=0.01)
    for M, N in ((16384, 256), (640, 8192), (16384, 8192)):
        assert CAL.for_gemm(M, 8192, N) is CAL, (M, N)


def test_a_part_checked_mid_loop_stalls_only_a_tile_that_hbm_bounds():
    """``Calibration.part_check_ns``: on the 64 x 128 tiles at 128 rows (bound by HBM) each
    later part of a consumer tile's input costs ``t3_ns`` (the loads it holds back are what the
    tile waits on); on 128 x 256 tiles at 2048 rows the K-steps in flight hide it. In the chain
    kernel at 128 rows, whose consumer tiles run one round after the producer's, waiting in 8
    parts costs 8 ``t3_ns`` over the same model with ``t3_ns`` zero (the first part's fetch and
    seven checks)."""
    narrow = CAL.with_config(sim.table_config(sim.PIPELINE_TABLE, 128))
    assert narrow.part_check_ns(128, 8192, 8192) == CAL.t3_ns
    assert CAL.part_check_ns(2048, 8192, 8192) == 0.0 and CAL.part_check_ns(128, 8192, 8192) == 0.0
    free = replace(narrow, t3_ns=0.0)
    cost = sim.simulate_chain_kernel(128, [8192] * 3, narrow) - sim.simulate_chain_kernel(128, [8192] * 3, free)
    assert cost == pytest.approx(8 * CAL.t3_ns, rel=0.05), cost / CAL.t3_ns


def test_chain_kernel_model_runs_the_combined_order():
    """One stage: the GEMM's rounds at the chain kernel's tile factor, plus its fixed cost. Two
    stages at 640 rows (160 tiles a layer on 132 SMs): three rounds (and up to a quarter tile
    more where a part of a consumer's input was signalled late), where the GEMMs one after the
    other without split tails take four."""
    t = CAL.tile_ns(8192)
    one = sim.simulate_chain_kernel(640, [8192, 8192], CAL)
    assert one == pytest.approx(2 * t * CAL.chain_tile_factor + CAL.chain_fixed_ns + CAL.launch_ns, rel=1e-6)
    two = sim.simulate_chain_kernel(640, [8192, 8192, 8192], CAL) - CAL.chain_fixed_ns - CAL.launch_ns
    assert 3 * t * CAL.chain_tile_factor < two < 3.35 * t * CAL.chain_tile_factor
    plain = 2 * sim.simulate_gemm(640, 8192, 8192, CAL)
    assert plain > 4 * t and sim.simulate_ours_sequential(640, [8192] * 3, CAL) < plain  # split tails pay


def test_chain_kernel_model_refuses_a_part_that_no_producer_signals(monkeypatch):
    """A link whose counter no producer tile bumps (dependency arrays the library never builds)
    is refused by name, rather than modelled as visible before the kernel starts."""
    real = sim._gemm_dependency

    def broken(*args):
        d = real(*args)  # counter 0's producers moved to counter 1
        return replace(d, signal_counters=np.where(d.signal_counters == 0, 1, d.signal_counters))

    monkeypatch.setattr(sim, "_gemm_dependency", broken)
    with pytest.raises(AssertionError, match="stage 1's tile 0 has no producers in part 0"):
        sim.simulate_chain_kernel(640, [8192] * 3, CAL)


def test_split_tail_model():
    """4096 tiles on 132 SMs: 31 rounds and 4 tail tiles in 8 slices (slices of at least 16 of
    the 128 K-steps) of an eighth of a tile each."""
    t = CAL.tile_ns(8192)
    split = deps.split_tail(4096, 132, 8192 // 64, deps.TAIL_MIN_SLICE_K)  # what the kernel runs
    assert (split.first_pos, split.tiles, split.splits) == (31 * 132, 4, 8)
    got = sim.simulate_gemm(16384, 8192, 8192, CAL, split_tail=True)
    assert got == pytest.approx(31 * t + t / 8 + 8 * CAL.tail_slice_ns + CAL.launch_ns, rel=1e-6)
    assert got < sim.simulate_gemm(16384, 8192, 8192, CAL)


def test_chain_kernel_model_with_a_split_tail():
    """At 640 rows (320 positions on 132 SMs: a third round of 56 tiles in the last stage, split
    in two) the split tail saves half a tile round less its slices' cost (a fifth of a round left);
    at 2048 rows (100 tiles left: no room to split) it changes nothing."""
    t = CAL.tile_ns(8192)
    whole = sim.simulate_chain_kernel(640, [8192] * 3, CAL)
    split = sim.simulate_chain_kernel(640, [8192] * 3, CAL, split_tail=True)
    assert whole - split == pytest.approx(t / 2 - 2 * CAL.chain_tail_slice_ns, abs=0.1 * t)
    assert 0.1 * t < whole - split < 0.35 * t
    assert sim.simulate_chain_kernel(2048, [8192] * 3, CAL, split_tail=True) == sim.simulate_chain_kernel(
        2048, [8192] * 3, CAL
    )


def test_chain_kernel_model_against_the_recorded_one_gpu_run():
    """The chain kernel's model (the kernel's own interleaved order, ``deps.chain_order``) against
    a recorded run on one H200 (``benchmarks/shared_gpu.py``, 128-16384 rows): the chain over our
    GEMMs one after another within 3% of the measured ratio at every height, and stage after
    stage against interleaved within 1.5% (on one GPU the order changes little)."""
    from pathlib import Path

    run = Path(__file__).parent.parent / "benchmarks/results/2026-12-01-h200x2-decision/depth/shared_gpu.json"
    rows = sim.validate_shared(sim.Calibration.default(), run)
    seq = [r for r in rows if r["ratio"] == "chain/ours_seq"]
    order = [r for r in rows if r["ratio"] == "chain_stage_major/chain"]
    assert len(seq) == len(order) == 6
    assert all(abs(r["error_pct"]) < 3 for r in seq), seq
    assert all(abs(r["error_pct"]) < 1.5 for r in order), order


@pytest.mark.parametrize("M", [640, 2048, 16384])
def test_placed_model_is_the_one_stage_per_gpu_model_and_the_chain_kernel_model(M):
    """Stages on GPUs of their own: :func:`sim.simulate_placed` is :func:`sim.simulate_cta`'s
    static pipeline; every stage on one GPU: the chain kernel's model."""
    dims = [8192] * 4
    one_each = sim.simulate_cta(M, dims, CAL, "static", wait_parts=8).total_ns
    assert sim.simulate_placed(M, dims, [0, 1, 2], CAL) == one_each
    assert sim.simulate_placed(M, dims, [0, 0, 0], CAL) == sim.simulate_chain_kernel(M, dims, CAL)
    with pytest.raises(ValueError, match="contiguous"):
        sim.simulate_placed(M, dims, [0, 1, 0], CAL)
    with pytest.raises(ValueError, match="3 stages but 2 devices"):
        sim.simulate_placed(M, dims, [0, 1], CAL)


def test_placed_model_waits_for_the_gpu_before():
    """4 layers on 2 GPUs: the second GPU ends after its last input rows came and went through
    its two layers (at least two tiles one after the other); the interleaved order sends the
    first GPU's second layer out early, so stage after stage is slower. More than
    ``CHAIN_MAX_STAGES`` stages on a GPU run as kernels one after another, as the pipeline runs
    them: the GPU after waits for the second kernel's rows."""
    M, dims = 8192, [8192] * 5
    chain = sim.simulate_placed(M, dims, [0, 0, 1, 1], CAL)
    first, sent = sim._chain_kernel(M, dims[:3], CAL, outbound=True)
    assert first < chain and chain > float(sent.max()) + 2 * CAL.tile_ns(8192)
    assert sim.simulate_placed(M, dims, [0, 0, 1, 1], CAL, interleave=False) > 1.2 * chain
    five = sim.simulate_placed(M, [8192] * 11, sim.placement(10, 2), CAL)
    four = sim.simulate_placed(M, [8192] * 9, sim.placement(8, 2), CAL)
    assert five > 1.7 * four  # GPU 1 starts after GPU 0's four-stage kernel: not 1.25x as long


def test_microbatch_model_shares_a_gpu_between_its_stages():
    """One stage per GPU: the chunk-by-chunk model as before (each GPU its stage's chunks in
    order). Two stages on one GPU take turns chunk by chunk, so the GPU after them starts on the
    first chunk early: about one GPU's work plus a chunk's way through the rest, not the two
    GPUs' work one after the other."""
    M, dims = 16384, [8192] * 5
    t = lambda rows: CAL.cublas_ns(rows, 8192, 8192)  # noqa: E731
    one_each = sim.simulate_microbatch(M, dims[:3], 1024, CAL)
    chunks = M // 1024
    assert one_each == pytest.approx(chunks * (t(1024) + CAL.launch_ns) + t(1024) + CAL.launch_ns
                                     + CAL.copy_ns(1024 * 8192 * 2), rel=1e-9)  # fmt: skip
    shared = sim.simulate_microbatch(M, dims, 1024, CAL, devices=[0, 0, 1, 1])
    gpu_work = 2 * chunks * (t(1024) + CAL.launch_ns)
    assert gpu_work < shared < gpu_work + 3 * (t(1024) + CAL.launch_ns) + CAL.copy_ns(1024 * 8192 * 2)
    with pytest.raises(ValueError, match="devices"):
        sim.simulate_microbatch(M, dims, 1024, CAL, devices=[0, 1])


def test_placement_spreads_layers_in_contiguous_ranges():
    with pytest.raises(ValueError, match="ints"):
        sim.placement(4.0, 2)
    assert sim.placement(4, 2) == [0, 0, 1, 1]
    assert sim.placement(3, 2) == [0, 0, 1]
    assert sim.placement(2, 4) == [0, 1]
    assert sim.placement(16, 8) == [s // 2 for s in range(16)]


def test_depth_model_against_the_recorded_four_layers_on_two_gpus():
    """4 layers on 2 H200s (``bench --gpus 2 --layers 4``, 2048-16384 rows), the tile time and the
    remote write's cost taken from the run: the interleaved order against stage after stage and
    waiting in parts against whole row-blocks within 3.5%; the chain against the best cuBLAS
    micro-batching within 2.5%; against the floor the model is optimistic, by 3-5.5%."""
    run = Path(__file__).parents[1] / "benchmarks/results/2026-12-01-h200x2-decision/depth/depth/results.json"
    rows = sim.validate_depth(CAL, run)
    by = {(r["seq"], r["ratio"]): r["error_pct"] for r in rows}
    assert len(rows) == 12
    for M in (2048, 8192, 16384):
        assert abs(by[M, "cta_static_stage_major_graph/cta_static_graph"]) < 3.5, M
        assert abs(by[M, "cta_static_whole_rows_graph/cta_static_graph"]) < 3.5, M
        assert abs(by[M, "cta_static_graph/microbatch"]) < 2.5, M
        assert -5.5 < by[M, "cta_static_graph/floor_triton_graph"] < -3, M
    two = run.parents[2] / "decision/decision/results.json"  # 2 layers on 2 GPUs
    with pytest.raises(ValueError, match="more layers than GPUs"):
        sim.validate_depth(CAL, two)


def test_planner_lays_more_layers_than_gpus_out_in_ranges():
    """4 layers on 2 GPUs: the chain (two layers a GPU in a chain kernel) and micro-batching over
    the same placement, besides the whole chain on one GPU."""
    layouts = sim.plan(16384, [8192] * 5, 2, CAL)
    kinds = {lay.method: lay for lay in layouts}
    assert set(kinds) == {"single", "microbatch", "cta"}
    assert "2 layers a GPU" in kinds["cta"].detail
    assert kinds["cta"].predicted_ms == pytest.approx(sim.simulate_placed(16384, [8192] * 5, [0, 0, 1, 1], CAL) / 1e6)
    assert kinds["single"].predicted_ms > 1.8 * kinds["cta"].predicted_ms


def test_blocks_model_halves_the_work_after_a_gated_stage():
    """A Llama block's gate/up GEMM is gated: the down GEMM computes over half its columns, and
    micro-batching copies half of them. Split the paper's way (gate/up on one GPU, down on the
    other) a block takes at least the gate/up GEMM's two thirds of its work, and less than the
    whole block on one GPU; two blocks, a block per GPU, take longer than one block on one GPU."""
    H, inter = 8192, 28672
    assert sim._work_k([H, 2 * inter, H], [True, False]) == [H, inter]
    with pytest.raises(ValueError, match="gated flags"):
        sim._work_k([H, 2 * inter, H], [True])
    plain = sim.simulate_microbatch(4096, [H, 2 * inter, H], 512, CAL, devices=[0, 1])
    assert sim.simulate_microbatch(4096, [H, 2 * inter, H], 512, CAL, devices=[0, 1], gated=[True, False]) < plain
    one = sim.simulate_placed(4096, [H, 2 * inter, H], [0, 1], CAL, gated=[True, False])
    two_k = sim.simulate_placed(4096, [H, 2 * inter, H], [0, 1], CAL)  # the down GEMM over twice the K
    assert one < two_k
    for row in sim.figure_blocks(CAL):
        assert 2 / 3 < row["split_over_floor"] < 0.8 and row["stack_over_floor"] > 1.0, row
        # a GPU's GEMMs one kernel after the other: the second GPU waits for the first's gate/up GEMM
        assert row["stack_kernels_apart_over_floor"] > 1 + 0.6 * (row["stack_over_floor"] - 1) + 0.5, row


def test_placed_model_runs_kernels_apart_one_after_another():
    """``chain=False``: a GPU's stages as kernels of their own in turn. On one GPU that is our
    GEMMs one after another (without split tails); across two, the second GPU's kernel waits on
    the first GPU's second stage, which starts only after its first."""
    M, dims = 4096, [8192] * 3
    apart = sim.simulate_placed(M, dims, [0, 0], CAL, chain=False)
    t = sum(sim.simulate_gemm(M, 8192, 8192, CAL) for _ in range(2))
    assert apart == pytest.approx(t, rel=0.01)
    four = [8192] * 5
    assert sim.simulate_placed(M, four, [0, 0, 1, 1], CAL, chain=False) > 1.2 * sim.simulate_placed(
        M, four, [0, 0, 1, 1], CAL
    )


def test_planner_lays_out_gated_blocks():
    """A Llama block (gate/up gated) on two GPUs: the chain one GEMM per GPU (the split block, as
    :func:`sim.figure_blocks` has it), micro-batching one GEMM per GPU, and the block on one GPU
    (its down GEMM over half the gate/up columns); no TP layout (the TP model has no gated stage).
    The CLI takes the gated stages by number and refuses one past the chain."""
    H, inter, M = 8192, 28672, 4096
    layouts = {lay.method: lay for lay in sim.plan(M, [H, 2 * inter, H], 2, CAL, gated=[True, False])}
    assert set(layouts) == {"single", "microbatch", "cta"}
    split = sim.simulate_placed(M, [H, 2 * inter, H], [0, 1], CAL, gated=[True, False]) / 1e6
    assert layouts["cta"].predicted_ms == pytest.approx(split)
    one = (sim.simulate_gemm(M, H, 2 * inter, CAL) + sim.simulate_gemm(M, inter, H, CAL)) / 1e6
    assert layouts["single"].predicted_ms == pytest.approx(one)
    assert "tp" in {lay.method for lay in sim.plan(M, [H, 2 * inter, H], 2, CAL)}  # ungated: TP offered


def test_a_validation_names_the_gpu_it_was_measured_on_and_a_calibration_of_another(tmp_path):
    """The report's header names the run's GPU, and says so where the calibration (of H200s)
    is of another GPU; a file that names none adds nothing, and built-in defaults claim no GPU."""
    h200 = RESULTS / "2026-12-05-h200-default/shared_gpu.json"
    h100 = RESULTS / "2026-12-06-h100-verify-dd27f5f/shared_gpu.json"
    assert sim.measured_on(CAL, h200) == " (measured on NVIDIA H200)"
    scaled = "; its HBM rate is scaled to this GPU's (3.35 TB/s peak))"
    assert sim.measured_on(CAL, h100) == (
        " (measured on NVIDIA H100 80GB HBM3; the model is calibrated on another GPU" + scaled
    )
    bare = tmp_path / "bare.json"
    for data in ({"rows": {}}, {"environment": None}, {"environment": {"gpus": []}}, []):
        bare.write_text(json.dumps(data))
        assert sim.measured_on(CAL, bare) == ""
    assert sim.measured_on(replace(CAL, source="defaults"), h100) == " (measured on NVIDIA H100 80GB HBM3" + scaled
    assert sim.measured_on(replace(CAL, source="defaults"), h200) == " (measured on NVIDIA H200)"


def test_a_calibration_on_another_gpu_takes_that_gpus_memory_bandwidth(tmp_path):
    """The packaged calibration (its HBM rate an H200's) on an H100 SXM streams at 3.35 / 4.8 of
    that rate, once however often it is asked, and back on an H200 at its own; on a GPU whose SMs
    differ (an H100 PCIe or NVL, a GH200) or one it does not know, it is itself. A calibration
    saved and loaded keeps the GPU its rate is of."""
    names = ("NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
             "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", None)  # fmt: skip
    assert [sim.hbm_peak_tbps(n) for n in names] == [4.8, 4.8, 3.35, None, None, None, None, None]
    h100 = CAL.on_gpu("NVIDIA H100 80GB HBM3")
    assert h100.hbm_gbps == pytest.approx(CAL.hbm_gbps * 3.35 / 4.8)
    assert h100.tile_ns_per_k == CAL.tile_ns_per_k
    assert h100.on_gpu("NVIDIA H100 80GB HBM3") is h100
    assert h100.on_gpu("NVIDIA H200").hbm_gbps == pytest.approx(CAL.hbm_gbps)
    for name in ("NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA GH200 480GB", None):
        assert CAL.on_gpu(name) is CAL
    assert sim.Calibration.load(h100.save(tmp_path / "h100.json")) == h100


def test_a_validation_models_the_gpu_its_run_names(tmp_path):
    """``validate_shared`` models a run on the GPU it names: an H100's run as the same run on an
    H200 whose calibration streams at the H100's rate; at 128 rows, where HBM bounds the GEMMs,
    that changes the prediction."""
    data = json.loads((RESULTS / "2026-12-06-h100-verify-dd27f5f/shared_gpu.json").read_text())
    as_h200 = tmp_path / "h200.json"
    as_h200.write_text(json.dumps({**data, "environment": {**data["environment"], "gpus": ["NVIDIA H200"]}}))
    slower = replace(CAL, hbm_gbps=CAL.hbm_gbps * 3.35 / 4.8)

    def predicted(cal, path):
        return {(r["seq"], r["ratio"]): r["predicted"] for r in sim.validate_shared(cal, path, tables=True)}

    on_h100 = predicted(CAL, RESULTS / "2026-12-06-h100-verify-dd27f5f/shared_gpu.json")
    assert on_h100 == predicted(slower, as_h200)
    assert on_h100[128, "chain/ours_seq"] != pytest.approx(predicted(CAL, as_h200)[128, "chain/ours_seq"], rel=1e-3)
