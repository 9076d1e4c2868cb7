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
    # each stage's tiles and span (first compute begun to last epilogue done), on the producer's clock:
    # the producer's 0 to 783 us, the consumer's first tile starts 195 us in and its last is done at 844 us
    assert s["stages"] == [dict(stage=0, tiles=8, span_ms=0.783), dict(stage=1, tiles=8, span_ms=0.649)]


def test_fetch_time_counts_only_tiles_whose_input_was_ready_when_they_began_to_wait():
    """T3 (a consumer's cost to take a ready tile) leaves out tiles that began waiting before
    their input's last signal (their wait includes the producer's lateness): half the tiles
    here, whose waits begin 20 us earlier; T2 does not depend on when the wait began."""
    prod, cons, dep = synthetic()
    cons[1::2, trace.WAIT] -= 20_000
    s = trace.summarize([prod, cons], [dep], [0.0, 5_000.0])
    assert s["T3_fetch_when_ready"]["n"] == 4 and s["T3_fetch_when_ready"]["max_us"] == pytest.approx(2.0)
    assert s["T2_signal_to_consumer_start"]["median_us"] == pytest.approx(12.0)


def test_wrong_clock_offset_shows_up():
    prod, cons, dep = synthetic()
    s = trace.summarize([prod, cons], [dep], [0.0, 0.0])
    assert s["T2_signal_to_consumer_start"]["median_us"] == pytest.approx(17.0)


def test_timeline_png(tmp_path):
    """The PNG shows the tiles: computing (blue) covers most of the drawn bars, waiting (grey)
    some; with the stages' compute times swapped between runs, the blue area follows. A stage's
    clock offset is subtracted: its stamps shifted by 1 ms and drawn with an offset of 1 ms give
    the same picture."""
    import matplotlib.image as mpimg

    def image(stamps, offsets):
        return mpimg.imread(trace.plot_timeline(stamps, offsets, tmp_path / "t.png"))[..., :3]

    def blue_and_grey(stamps):
        img = image(stamps, [0.0, 5_000.0])
        blue = np.isclose(img, (0x1F / 255, 0x77 / 255, 0xB4 / 255), atol=0.02).all(-1)  # tab:blue
        grey = np.isclose(img, (0.8, 0.8, 0.8), atol=0.02).all(-1)
        return int(blue.sum()), int(grey.sum())

    prod, cons, _ = synthetic()
    blue, grey = blue_and_grey([prod, cons])
    assert blue > 1000 and grey > 0
    short = prod.copy()
    short[:, trace.STORED] = short[:, trace.START] + 20_000  # the producer computes a quarter as long
    assert blue_and_grey([short, cons])[0] < 0.8 * blue
    late = cons.copy()
    late[:, trace.WAIT : trace.CTA] += 1_000_000
    assert np.array_equal(image([prod, late], [0.0, 1_005_000.0]), image([prod, cons], [0.0, 5_000.0]))


def test_trace_needs_a_gpu(capsys, tmp_path, monkeypatch):
    import torch

    from ctapipelining import cli

    assert cli.main(["trace", "--out", str(tmp_path)]) == 2
    assert "needs 2 GPUs" in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU: still too few
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.main(["trace", "--out", str(tmp_path)]) == 2
    assert "needs 2 GPUs with peer access; found 1" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())  # nothing traced, nothing written
