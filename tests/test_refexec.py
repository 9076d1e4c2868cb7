"""The reference executor: fixed cases, fault injection, and hypothesis fuzzing."""

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ctapipelining import deps, refexec
from ctapipelining.refexec import Chain, Stage


def two_gemms(policy_ctas=3):
    return Chain(M=50, K0=20, stages=[Stage("gemm", 30, 16, 8, 4), Stage("gemm", 12, 8, 8, policy_ctas)])


@pytest.mark.parametrize("policy", ["workqueue", "static"])
@pytest.mark.parametrize("schedule", refexec.SCHEDULES)
def test_two_gemm_chain(policy, schedule):
    r = refexec.run_chain(two_gemms(), policy, schedule, epochs=3, seed=7)
    assert r.max_error < 1e-5
    assert len(r.outputs) == 3


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_stall_one_holds_back_one_producer_cta_while_anything_else_can_run(policy):
    """``stall_one``: producer CTA 0 runs only when no other CTA can, so its first tile comes
    after every other producer CTA's last (and the chain is still right)."""
    r = refexec.run_chain(two_gemms(), policy, "stall_one", seed=5)
    runs = [e for e in r.events if e.stage == 0 and e.kind == "run"]
    first_of_cta0 = min(e.step for e in runs if e.cta == 0)
    assert first_of_cta0 > max(e.step for e in runs if e.cta != 0)


def test_consumers_first_runs_in_readiness_order():
    """Under the workqueue policy, consumer tiles run in the order they became ready."""
    ch = two_gemms(policy_ctas=1)
    r = refexec.run_chain(ch, "workqueue", "consumers_first", seed=3)
    assert r.order(1, "run") == r.order(1, "ready")


def _steps(r, stage, kind):
    """``{(epoch, tile): step}`` of ``stage``'s ``kind`` events."""
    return {(e.epoch, e.tile): e.step for e in r.events if e.stage == stage and e.kind == kind}


def _latest_run_after_ready(r):
    """The most steps a consumer tile ran after the step its readiness was logged."""
    run, ready = _steps(r, 1, "run"), _steps(r, 1, "ready")
    return max(run[k] - ready[k] for k in run)


def test_static_consumers_first_runs_each_consumer_tile_no_later_than_it_is_logged_ready():
    """Under the static policy with three consumer CTAs, ``consumers_first`` runs each consumer
    tile as soon as its counter fills: no later than the producer's step that logs it ready. A
    random schedule of the same chain runs some tiles later."""
    r = refexec.run_chain(two_gemms(), "static", "consumers_first", epochs=2, seed=3)
    assert _latest_run_after_ready(r) <= 0
    assert _latest_run_after_ready(refexec.run_chain(two_gemms(), "static", "random", epochs=2, seed=3)) > 0


@pytest.mark.parametrize("policy", ["workqueue", "static"])
def test_producers_first_runs_every_producer_tile_before_any_consumer_tile(policy):
    """``producers_first``: producer CTAs never wait and run whenever one can, so in each run
    every tile of stage 0 runs before any tile of stage 1."""
    r = refexec.run_chain(two_gemms(), policy, "producers_first", epochs=2, seed=11)
    producer, consumer = _steps(r, 0, "run"), _steps(r, 1, "run")
    for epoch in (1, 2):
        last = max(step for (e, _), step in producer.items() if e == epoch)
        assert last < min(step for (e, _), step in consumer.items() if e == epoch), epoch


def test_static_policy_runs_each_stage_in_its_grouped_tile_order():
    """Under the static policy CTA ``p`` of ``n`` runs positions ``p, p + n, ...`` of its
    stage's tile order, here grouped by 2 and 3 row-blocks (not row-major): one consumer CTA runs
    the whole order."""
    ch = Chain(M=50, K0=20, stages=[Stage("gemm", 30, 16, 8, 4, group_m=2), Stage("gemm", 12, 8, 8, 1, group_m=3)])
    assert all(o.tolist() != sorted(o.tolist()) for o in ch.orders)
    r = refexec.run_chain(ch, "static", "random", seed=3)
    assert r.order(1, "run") == ch.orders[1].tolist()
    for pid in range(4):
        mine = [e.tile for e in r.events if e.stage == 0 and e.kind == "run" and e.cta == pid]
        assert mine == ch.orders[0][pid::4].tolist(), pid


def test_schedules_interleave_differently():
    ch = two_gemms()
    orders = {s: refexec.run_chain(ch, "workqueue", s, seed=11).order(1, "run") for s in refexec.SCHEDULES}
    assert len({tuple(v) for v in orders.values()}) > 1


def test_early_push_is_caught(monkeypatch):
    """A protocol bug (pushing before a counter is full) must be detected."""
    monkeypatch.setattr(deps, "fills", lambda dep, c, old, epoch: old + 2 == epoch * int(dep.need[c]))
    with pytest.raises(refexec.ProtocolViolation):
        for seed in range(20):
            refexec.run_chain(two_gemms(), "workqueue", "consumers_first", seed=seed)


def test_wrong_wait_target_is_caught(monkeypatch):
    monkeypatch.setattr(deps, "wait_target", lambda dep, t, e: (int(dep.counter_of_tile[t]), 0))
    with pytest.raises(refexec.ProtocolViolation, match="read producer tiles .* before they were written"):
        refexec.run_chain(two_gemms(), "static", "consumers_first", seed=0)


def test_missing_signal_deadlocks_and_says_so(monkeypatch):
    monkeypatch.setattr(deps.Dependency, "signals", lambda self, p: self.signal_counters[:0])
    with pytest.raises(refexec.DeadlockError, match="none can run"):
        refexec.run_chain(two_gemms(), "static", "random", seed=0)


def test_a_cta_that_never_finishes_is_stopped_after_a_bounded_number_of_steps(monkeypatch):
    """A livelock (a CTA that always runs and never completes, as a wait that spins without
    end would) stops the run with a DeadlockError after ``max_steps`` steps, not never."""

    def spins(self, s, p, bufs, weights, written):
        while True:
            yield None  # runnable again at once: no wait

    monkeypatch.setattr(refexec.Executor, "_cta", spins)
    ex = refexec.Executor(two_gemms())
    x = np.zeros((ex.chain.M, ex.chain.K0), np.float32)
    with pytest.raises(refexec.DeadlockError, match="no completion after 500 steps"):
        ex.run(x, two_gemms().make_weights(np.random.default_rng(0)), max_steps=500)
    assert 500 < ex.steps <= 502


def test_bad_input_shape():
    ex = refexec.Executor(two_gemms())
    with pytest.raises(ValueError, match="shape"):
        ex.run(np.zeros((3, 3), np.float32), two_gemms().make_weights(np.random.default_rng(0)))
    with pytest.raises(ValueError, match="schedule"):
        refexec.Executor(two_gemms(), schedule="lifo")
    with pytest.raises(ValueError, match="elementwise"):
        Chain(M=4, K0=5, stages=[Stage("elementwise", 6, 2, 2, 1)])


@st.composite
def chains(draw):
    m = draw(st.integers(1, 40))
    k0 = k = draw(st.integers(1, 24))
    stages = []
    for i in range(draw(st.integers(1, 8))):
        kind = "gemm" if i == 0 or draw(st.booleans()) else "elementwise"
        n = draw(st.integers(1, 24)) if kind == "gemm" else k
        stages.append(
            Stage(
                kind,
                n,
                block_m=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
                block_n=draw(st.sampled_from([1, 3, 4, 8, 16])),
                num_ctas=draw(st.integers(1, 5)),
                group_m=draw(st.integers(1, 3)),
            )
        )
        k = n
    return Chain(M=m, K0=k0, stages=stages, wait_parts=draw(st.integers(1, 4)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    chain=chains(),
    policy=st.sampled_from(["workqueue", "static"]),
    schedule=st.sampled_from(refexec.SCHEDULES),
    epochs=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_fuzz_protocol(chain, policy, schedule, epochs, seed):
    if policy == "workqueue":
        chain = dataclasses.replace(chain, wait_parts=1)  # it runs whole tiles once ready
    r = refexec.run_chain(chain, policy, schedule, epochs=epochs, seed=seed)
    # run_chain checks exactly-once, never-early, output, no deadlock and counters == E x need
    assert sum(e.kind == "run" for e in r.events) == epochs * sum(g.num_tiles for g in chain.grids)
    assert r.max_error < 1e-4


def parted(parts):
    return Chain(M=50, K0=20, stages=[Stage("gemm", 40, 16, 8, 4), Stage("gemm", 12, 8, 8, 3)], wait_parts=parts)


@pytest.mark.parametrize("schedule", refexec.SCHEDULES)
def test_waiting_in_parts_starts_tiles_before_their_rows_are_complete(schedule):
    """With parts a consumer tile starts once the first piece of its rows is written and
    reads each later piece only after its own wait; with one part it never starts early."""
    r = refexec.run_chain(parted(3), "static", schedule, epochs=2, seed=5)
    assert r.max_error < 1e-5

    def early(report, chain):
        step = {(e.epoch, e.stage, e.tile): e.step for e in report.events if e.kind == "run"}
        dep = chain.links[0]
        return [(e, t) for (e, s, t), at in step.items() if s == 1 and any(step[(e, 0, p)] > at for p in dep.needs(t))]

    ch3, ch1 = parted(3), parted(1)
    assert early(refexec.run_chain(ch3, "static", "consumers_first", seed=1), ch3)
    assert not early(refexec.run_chain(ch1, "static", "consumers_first", seed=1), ch1)


def test_a_part_read_before_its_wait_is_caught(monkeypatch):
    real = deps.wait_target
    monkeypatch.setattr(deps, "wait_target", lambda dep, t, e, part=0: real(dep, t, e) if part == 0 else (0, 0))
    with pytest.raises(refexec.ProtocolViolation, match="read producer tiles .* before they were written"):
        refexec.run_chain(parted(3), "static", "consumers_first", seed=0)


def test_parts_need_the_static_policy():
    with pytest.raises(ValueError, match="workqueue consumer runs whole tiles"):
        refexec.Executor(parted(2), "workqueue")
    assert parted(3).links[0].parts == 3 and parted(9).links[0].parts == 5  # 40 columns in blocks of 8


# -- the executor's own checks fire (each one a bug it must not let through) --------------------
def test_a_tile_run_twice_is_caught(monkeypatch):
    """Every CTA but the first also runs the order's first tile: caught as it runs again."""
    static = deps.POLICIES["static"]
    order_of = type(static).tiles_of_cta
    monkeypatch.setattr(
        type(static), "tiles_of_cta",
        lambda self, order, pid, n: np.concatenate([order_of(self, order, pid, n), order[:1]]) if pid else
        order_of(self, order, pid, n),
    )  # fmt: skip
    with pytest.raises(refexec.ProtocolViolation, match="ran twice in epoch"):
        refexec.run_chain(two_gemms(), "static", "random", seed=0)


def test_a_tile_that_never_runs_is_caught(monkeypatch):
    """The first CTA skips its last tile of the last stage (no stage waits for it): caught
    when the run ends."""
    static = deps.POLICIES["static"]
    order_of = type(static).tiles_of_cta
    last = len(two_gemms().stages) - 1

    def skip_one(self, order, pid, n):
        tiles = order_of(self, order, pid, n)
        return tiles[:-1] if pid == 0 and len(order) == two_gemms().grids[last].num_tiles else tiles

    monkeypatch.setattr(type(static), "tiles_of_cta", skip_one)
    with pytest.raises(refexec.ProtocolViolation, match=f"stage {last}: tiles .* never ran"):
        refexec.run_chain(two_gemms(), "static", "random", seed=0)


def test_counters_off_their_epoch_target_are_caught():
    """After a clean run, a counter one signal over (or a ring tail one slot over) fails the
    executor's end-of-run check."""
    for policy in ("static", "workqueue"):
        ex = refexec.Executor(two_gemms(), policy, "random", seed=1)
        ch = ex.chain
        rng = np.random.default_rng(1)
        ex.run(rng.standard_normal((ch.M, ch.K0)).astype(np.float32), ch.make_weights(rng))
        ex._check_counters()  # clean
        (ex.state[0].counters.__setitem__(0, ex.state[0].counters[0] + 1) if policy == "static"
         else setattr(ex.state[0], "tail", ex.state[0].tail + 1))  # fmt: skip
        with pytest.raises(refexec.ProtocolViolation, match="counters|tail"):
            ex._check_counters()


def test_a_ring_slot_of_another_lap_is_caught(monkeypatch):
    """A producer that tags its ring slots one lap ahead: the consumer's wait is met, and the
    tile it reads back is not one of this epoch's: caught as it reads it."""
    real = deps.slot_value
    monkeypatch.setattr(deps, "slot_value", lambda pos, T, tile: real(pos, T, tile) + T)
    with pytest.raises(refexec.ProtocolViolation, match="not a tile of epoch 1"):
        refexec.run_chain(two_gemms(), "workqueue", "random", seed=0)


def test_an_unwritten_input_read_shows_as_nan_and_a_wrong_output_as_an_error(monkeypatch):
    """With the per-tile read check off, a wait that is met too early reads the NaN-poisoned
    input, which the run's output check finds; an output off the float64 reference is refused."""
    with monkeypatch.context() as m:
        m.setattr(deps, "wait_target", lambda dep, t, e: (int(dep.counter_of_tile[t]), 0))
        m.setattr(refexec.Executor, "_check_written", lambda *a: None)
        with pytest.raises(refexec.ProtocolViolation, match="NaN in the output"):
            refexec.run_chain(two_gemms(), "static", "consumers_first", seed=0)
    real = Chain.reference
    monkeypatch.setattr(Chain, "reference", lambda self, x, w: real(self, x, w) * (1 + 1e-3))
    with pytest.raises(refexec.ProtocolViolation, match="output differs from the float64 reference"):
        refexec.run_chain(two_gemms(), "static", "random", seed=0)
