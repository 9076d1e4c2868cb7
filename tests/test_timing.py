"""The timing harness without a GPU: the order methods take turns in, and what is timed."""

import pytest

from ctapipelining import timing


def _methods(calls):
    return [timing.Method(name, lambda name=name: calls.append(name)) for name in "abcde"]


def test_shuffled_order_runs_every_method_once_per_repetition_in_changing_orders():
    calls, places = [], {}
    times = timing.time_interleaved(_methods(calls), [], reps=12, warmup=2, positions=places)
    assert len(calls) == 14 * 5
    reps = [calls[i : i + 5] for i in range(10, len(calls), 5)]  # after the warm-up
    assert all(sorted(r) == list("abcde") for r in reps)
    assert len({tuple(r) for r in reps}) > 6  # not one fixed order: no method always follows the same one
    assert {name: len(v) for name, v in times.items()} == dict.fromkeys("abcde", 12)
    for i, r in enumerate(reps):  # positions say where each method ran in repetition i
        assert [places[name][i] for name in r] == list(range(5))
    # seeded: the same run again gives the same orders
    again = []
    timing.time_interleaved(_methods(again), [], reps=12, warmup=2)
    assert again == calls


def test_fixed_order_and_rest_before_each_timed_run():
    calls = []
    times = timing.time_interleaved(_methods(calls), [], reps=3, warmup=1, order="fixed", rest_ms=20)
    assert calls == list("abcde") * 4
    assert all(t < 15 for v in times.values() for t in v)  # the rest is not timed
    with pytest.raises(ValueError, match="order"):
        timing.time_interleaved(_methods([]), [], reps=1, warmup=0, order="random")
    with pytest.raises(ValueError, match="rest_ms"):
        timing.time_interleaved(_methods([]), [], reps=1, warmup=0, rest_ms=-1)


def test_each_timed_run_is_synchronised_on_every_device_rested_before_and_timed_to_its_end(monkeypatch):
    """Per timed run: prepare, synchronise every device, rest, run, synchronise every device;
    the time spans the run and the synchronisation after it (the GPU work), not the rest."""
    import torch

    log = []

    def fake_sync(d):  # a device that takes 2 ms to finish its work
        log.append(f"sync{d}")
        real_sleep(0.002)

    real_sleep = timing.time.sleep
    monkeypatch.setattr(torch.cuda, "synchronize", fake_sync)
    monkeypatch.setattr(timing.time, "sleep", lambda s: log.append(f"rest{s:g}"))
    method = timing.Method("m", lambda: log.append("run"), lambda i: log.append("prep"))
    times = timing.time_interleaved([method], [0, 1], reps=2, warmup=0, rest_ms=5)
    assert log == ["prep", "sync0", "sync1", "rest0.005", "run", "sync0", "sync1"] * 2
    assert all(t >= 2 * 2.0 for t in times["m"])  # the two synchronisations after the run are timed


def test_each_warm_up_run_is_prepared_and_synchronised_on_every_device_and_not_timed(monkeypatch):
    """Per warm-up run: prepare (with the warm-up's index), run, synchronise every device; no
    synchronisation before the run and no time recorded."""
    import torch

    log = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d: log.append(f"sync{d}"))
    method = timing.Method("m", lambda: log.append("run"), lambda i: log.append(f"prep{i}"))
    times = timing.time_interleaved([method], [0, 1], reps=0, warmup=2)
    assert log == ["prep0", "run", "sync0", "sync1", "prep1", "run", "sync0", "sync1"]
    assert times == {"m": []}
