"""Trace summaries and the timeline on synthetic stamps with known costs (no GPU needed)."""

import numpy as np
import pytest

from ctapipelining import deps, trace


def synthetic(offset_ns=5_000):
    """Producer: 4 row-blocks x 2 tiles; tile i computes [100i, 100i+80) us, signal 3 us.
    Consumer clock runs ``offset_ns`` ahead; each tile starts 2 us after its wait, and waits
    from 10 us after its row-block's last signal."""
    p = deps.TileGrid(8, 4, 2, 2)
    c = deps.TileGrid(8, 4, 2, 2)
    dep = deps.build_dependency(p, c, "gemm")
    us = 1_000
    prod = np.zeros((p.num_tiles, 5), np.int64)
    for i in range(p.num_tiles):
        prod[i] = [100 * i * us, 100 * i * us, (100 * i + 80) * us, (100 * i + 83) * us, i % 2]
    cons = np.zeros((c.num_tiles, 5), np.int64)
    for t in range(c.num_tiles):
        last = prod[list(dep.needs(t)), trace.DONE].max()
        wait = last + 10 * us + offset_ns
        cons[t] = [wait, wait + 2 * us, wait + 50 * us, wait + 51 * us, t % 2]
    return prod, cons, dep


def test_summary_recovers_the_planted_costs():
    prod, cons, dep = synthetic()
    s = trace.summarize([prod, cons], [dep], [0.0, 5_000.0])
    assert s["T1_signal"]["median_us"] == pytest.approx(3.0)
    assert s["T2_signal_to_consumer_start"]["median_us"] == pytest.approx(12.0)
    assert s["T3_fetch_when_ready"]["median_us"] == pytest.approx(2.0)
    assert s["T3_fetch_when_ready"]["n"] == 8


def test_wrong_clock_offset_shows_up():
    prod, cons, dep = synthetic()
    s = trace.summarize([prod, cons], [dep], [0.0, 0.0])
    assert s["T2_signal_to_consumer_start"]["median_us"] == pytest.approx(17.0)


def test_timeline_png(tmp_path):
    prod, cons, _ = synthetic()
    p = trace.plot_timeline([prod, cons], [0.0, 5_000.0], tmp_path / "t.png")
    assert p.stat().st_size > 5_000


def test_trace_needs_a_gpu(capsys, tmp_path):
    from ctapipelining import cli

    assert cli.main(["trace", "--out", str(tmp_path)]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().out
