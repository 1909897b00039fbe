"""The wall-clock benchmark's latency model and accounting (benchmarks/_latency.py,
benchmarks/wallclock_async_vs_group.py).

Accounting helpers are checked on hand-computed schedules and against a brute-force
NumPy reference (a fine time grid); the end-to-end simulation through the real
orchestrator is checked on a constant-length schedule whose timeline is derived by hand
below, and on a heavy-tailed one against the orchestrator's own stamps.
"""

import math
import os
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import _latency  # noqa: E402
import wallclock_async_vs_group as bench  # noqa: E402
from _latency import LatencyModel, Workload  # noqa: E402


# ----------------------------------------------------------------------------- accounting
def test_accounting_hand_numbers():
    # Two slots, wall 10: [0, 4] and [2, 6] overlap on [2, 4]; [8, 12] is cut at 10.
    episodes = [(0.0, 4.0), (2.0, 6.0), (8.0, 12.0)]
    assert _latency.clipped_busy_time(episodes, 0.0, 10.0) == pytest.approx(4 + 4 + 2)
    assert _latency.slot_utilisation(episodes, 2, 10.0) == pytest.approx(10 / 20)
    assert _latency.union_length(episodes) == pytest.approx(6 + 4)  # [0, 6] and [8, 12]
    assert _latency.max_concurrency(episodes) == 2
    assert _latency.max_concurrency([(0.0, 1.0), (1.0, 2.0)]) == 1  # end frees before start
    # Learner busy [1, 3] and [2, 5] (union 4) and [9, 11] (cut to 1): idle 1 − 5/10.
    assert _latency.learner_idle_fraction([(1.0, 3.0), (2.0, 5.0), (9.0, 11.0)], 10.0) == pytest.approx(0.5)
    assert _latency.learner_idle_fraction([], 10.0) == pytest.approx(1.0)
    # Updates end at 3 and 6; publishes at 4 and 8 -> waits 1 + 2.
    assert _latency.drain_wait([3.0, 6.0], [8.0, 4.0]) == pytest.approx(3.0)
    assert _latency.drain_wait([3.0], [3.0]) == 0.0
    # Publishing every 2nd update: ends 1, 2, 5, 6; publishes 3, 7 -> (3 − 2) + (7 − 6).
    assert _latency.drain_wait([1.0, 2.0, 5.0, 6.0], [3.0, 7.0]) == pytest.approx(2.0)
    # Aborted work, wall 10: [0, 4] done, [2, 6] aborted (4 s), [8, 12] not done but still
    # running at the horizon (2 s busy, not aborted).
    assert _latency.aborted_slot_time(episodes, [True, False, False], 10.0) == pytest.approx((4.0, 10.0))
    with pytest.raises(ValueError, match="one flag per episode"):
        _latency.aborted_slot_time(episodes, [True], 10.0)
    grid = np.array([0.0, 0.99, 1.0, 2.5, 3.0, 7.0])
    np.testing.assert_allclose(_latency.step_values([1.0, 3.0], [0.2, 0.3], 0.1, grid),
                               [0.1, 0.1, 0.2, 0.2, 0.3, 0.3])


def test_accounting_rejects_bad_input():
    with pytest.raises(ValueError, match="intervals"):
        _latency.union_length([(2.0, 1.0)])
    with pytest.raises(ValueError, match="num_slots"):
        _latency.slot_utilisation([(0.0, 1.0)], 0, 1.0)
    with pytest.raises(ValueError, match="wall"):
        _latency.learner_idle_fraction([(0.0, 1.0)], 0.0)
    with pytest.raises(ValueError, match="publish"):
        _latency.drain_wait([5.0], [4.0])
    with pytest.raises(ValueError, match="change_times"):
        _latency.step_values([2.0, 1.0], [0.0, 1.0], 0.0, np.zeros(1))


interval_lists = st.lists(
    st.tuples(st.integers(0, 40), st.integers(0, 15)).map(lambda p: (float(p[0]), float(p[0] + p[1]))),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(interval_lists, st.integers(1, 50))
def test_accounting_matches_a_brute_force_grid(intervals, wall):
    # Integer endpoints: on a grid of step 1/4, midpoints of cells are never endpoints.
    centres = np.arange(0.0, 60.0, 0.25) + 0.125
    inside = np.array([(s < centres) & (centres < e) for s, e in intervals]).reshape(-1, centres.size)
    covered = inside.any(axis=0)
    assert _latency.union_length(intervals) == pytest.approx(0.25 * covered.sum())
    in_wall = centres < wall
    busy = 0.25 * inside[:, in_wall].sum()
    assert _latency.clipped_busy_time(intervals, 0.0, float(wall)) == pytest.approx(busy)
    level = inside.sum(axis=0)
    assert _latency.max_concurrency(intervals) == (level.max() if intervals else 0)
    idle = 1.0 - 0.25 * covered[in_wall].sum() / wall
    assert _latency.learner_idle_fraction(intervals, float(wall)) == pytest.approx(idle)
    slots = max(int(level.max()) if intervals else 1, 1)
    assert 0.0 <= _latency.slot_utilisation(intervals, slots, float(wall)) <= 1.0 + 1e-12


# ----------------------------------------------------------------------------- workload
@settings(max_examples=80, deadline=None)
@given(st.integers(1, 20000), st.integers(1, 600), st.integers(1, 12))
def test_split_turns_preserves_tokens_and_balances(num_tokens, per_turn, max_turns):
    turns = _latency.split_turns(num_tokens, per_turn, max_turns)
    assert sum(turns) == num_tokens
    assert len(turns) == min(max_turns, math.ceil(num_tokens / per_turn))
    assert max(turns) - min(turns) <= 1 and list(turns) == sorted(turns, reverse=True)


def test_lengths_have_the_configured_mean_and_log_std():
    # Unclipped lognormal: ln L = ln(512) − σ²/2 + σ·Z, so E[L] = 512 and std(ln L) = σ.
    sigma = 0.8
    model = LatencyModel(sigma=sigma, min_tokens=1, max_tokens=10**9)
    workload = Workload(model, num_tasks=4000, seed=3)
    lengths = np.array([workload.plan(x, 0).num_tokens for x in range(4000)], dtype=np.float64)
    standard_error = 512 * math.sqrt(math.exp(sigma**2) - 1) / math.sqrt(lengths.size)
    assert abs(lengths.mean() - 512) < 4 * standard_error
    assert np.log(lengths).std() == pytest.approx(sigma, abs=0.04)
    # Plans are deterministic in (seed, task, visit) and split by tokens_per_turn.
    again = Workload(model, num_tasks=4000, seed=3)
    assert again.plan(17, 0) == workload.plan(17, 0)
    plan = workload.plan(5, 2)
    assert len(plan.turn_tokens) == min(model.max_turns, math.ceil(plan.num_tokens / model.tokens_per_turn))
    assert Workload(LatencyModel(sigma=0.0), 3, 0).plan(1, 4).num_tokens == 512


def test_task_share_correlates_visits_of_one_task():
    # corr(ln L_xv, ln L_xv') = w for two visits of one task (same task effect ξ_x).
    model = LatencyModel(sigma=1.0, task_share=0.5, min_tokens=1, max_tokens=10**9)
    workload = Workload(model, num_tasks=3000, seed=1)
    logs = np.log([[workload.plan(x, v).num_tokens for v in range(2)] for x in range(3000)])
    assert np.corrcoef(logs[:, 0], logs[:, 1])[0, 1] == pytest.approx(0.5, abs=0.06)


def test_success_rule_is_sigmoid_of_logit_plus_eta_k():
    model = LatencyModel(eta=0.5)
    workload = Workload(model, num_tasks=8, seed=2)
    k = 3
    expected = 1.0 / (1.0 + np.exp(-(workload.logit0 + 0.5 * k)))
    np.testing.assert_allclose(workload.success_probability(k), expected, rtol=1e-12)
    assert workload.expected_success(k) == pytest.approx(expected.mean())
    draws = [workload.succeeds(workload.plan(x, v), k) for x in range(8) for v in range(800)]
    assert np.mean(draws) == pytest.approx(expected.mean(), abs=0.02)
    assert workload.learner_seconds(1000) == pytest.approx(model.learner_base_s + 1000 * model.learner_s_per_token)


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    return bench.build_chat(str(tmp_path_factory.mktemp("tok")))


CONSTANT = LatencyModel(sigma=0.0, mean_tokens=100, tokens_per_turn=100, decode_s_per_token=0.01,
                        env_reset_s=0.2, env_step_s=0.5, learner_base_s=2.0, learner_s_per_token=0.0,
                        publish_s=1.0)


@pytest.mark.parametrize("method", ["spopp", "grpo"])
def test_constant_schedule_hand_timeline(chat, method):
    # Every episode: reset 0.2 + one 100-token turn at 0.01 s/token + step 0.5 = 1.7 s.
    # S = N = 4, one buffered batch (ready + in flight <= 4), K = 2, drain "finish",
    # updates take 2 s, publishes 1 s (GRPO: two groups of 2 per batch):
    #   t=0    4 episodes start (event 0)          t=1.7  they finish; update 1 starts; 4 start
    #   t=3.4  they finish (ready, no room)        t=3.7  update 1 ends, nothing in flight
    #   t=4.7  publish 1; update 2 starts on the 4 ready (lag 1); 4 start (event 1)
    #   t=6.4  they finish                         t=6.7  update 2 ends
    #   t=7.7  publish 2; run returns.
    spec = bench.RunSpec(method, CONSTANT, seed=0, slots=4, batch=4, group=2, updates=2, tasks=8,
                         buffered_batches=1)
    result = bench.run_once(spec, chat)
    wall = 7.7
    assert result["wall"] == pytest.approx(wall)
    assert result["publish_times"] == pytest.approx([4.7, 7.7])
    assert (result["t_half"], result["t_full"]) == pytest.approx((3.7, 6.7))
    assert result["dispatched"] == result["completed"] == 12 and result["consumed"] == 8
    assert result["slot_utilisation"] == pytest.approx(12 * 1.7 / (4 * wall))
    assert result["useful_utilisation"] == pytest.approx(result["slot_utilisation"])
    assert result["peak_slots"] == 4
    assert result["learner_idle"] == pytest.approx(1 - 4.0 / wall)
    assert result["drain_share"] == pytest.approx(2.0 / wall)
    assert result["traj_per_s"] == pytest.approx(12 / wall)
    assert result["consumed_per_s"] == pytest.approx(8 / wall)
    assert result["barrier_wait"] == pytest.approx(0.0)
    # Batch 1 finished at 1.7 and trained at 1.7; batch 2 finished at 3.4, trained at 4.7.
    assert result["finish_to_train"] == pytest.approx((4 * 0.0 + 4 * 1.3) / 8)
    assert result["lag_mean"] == pytest.approx(0.5)
    assert result["consumed_tokens"] == 100
    assert result["expected_success"] == pytest.approx(
        [Workload(CONSTANT, 8, 0).expected_success(k) for k in (1, 2)])


@pytest.mark.parametrize("method,drain,publish_every",
                         [("spopp", "finish", 1), ("grpo", "finish", 2), ("spopp", "abort", 1)])
def test_heavy_tail_timeline_agrees_with_the_orchestrator_stamps(chat, method, drain, publish_every):
    model = LatencyModel(sigma=1.5, mean_tokens=200, max_tokens=3000, tokens_per_turn=100, max_turns=4)
    spec = bench.RunSpec(method, model, seed=1, slots=8, batch=8, group=4, updates=4, tasks=24, drain=drain,
                         publish_every=publish_every)
    world, orch, wall, _, _ = bench.run_virtual(bench._simulate(spec, chat))
    timeline = world.timeline
    # Slot occupancy seen by the environment == dispatch -> finish in the orchestrator's log.
    received = [t for kind, t in orch.events if kind == "receive"]
    dropped = [s for kind, s in orch.events if kind == "drop"]
    intervals = timeline.episode_intervals(wall)
    assert len(intervals) == orch.dispatched == len(received) + len(dropped)
    stamped = sum(t.finish_time - t.dispatch_time for t in received)
    stamped += sum(min(a for a in timeline.aborts if a >= s.dispatch_time) - s.dispatch_time for s in dropped)
    assert _latency.clipped_busy_time(intervals, 0.0, wall) == pytest.approx(stamped)
    assert _latency.max_concurrency(intervals) <= spec.slots
    # Learner intervals are the orchestrator's update records; action tokens follow the plan.
    np.testing.assert_allclose([(s, e) for s, e, _ in timeline.learner],
                               [(r.start_time, r.end_time) for r in orch.records], rtol=1e-12)
    for record in orch.records:
        for t in record.trajectories:
            visit = [s for kind, s in orch.events if kind == "dispatch" and s.task_id == t.task_id].index(t.stamp)
            plan = world.workload.plan(t.task_id, visit)
            assert t.num_action_tokens == plan.num_tokens
            # Success uses the updates inside the generating weights (publish k = update k·P).
            assert t.reward == float(world.workload.succeeds(plan, t.policy_event * publish_every))
    assert [k for _, k in timeline.publishes] == list(range(publish_every, spec.updates + 1, publish_every))
    update_ends = [e for _, e, _ in timeline.learner]
    for p, k in timeline.publishes:  # a publish follows the end of the update it carries
        assert p >= update_ends[k - 1] + model.publish_s - 1e-9
    if drain == "abort":
        assert orch.aborted > 0 and timeline.aborts


def test_drain_none_timeline_publishes_in_flight(chat):
    """Drain "none": publishes follow their updates in order, no abort_all before close(),
    slots never oversubscribed (a lag-aborted episode releases its slot and env), and some
    trained trajectories hold tokens of two policies."""
    model = LatencyModel(sigma=1.5, mean_tokens=200, max_tokens=3000, tokens_per_turn=100, max_turns=4)
    spec = bench.RunSpec("spopp", model, seed=1, slots=8, batch=8, group=4, updates=6, tasks=24, drain="none")
    world, orch, wall, _, _ = bench.run_virtual(bench._simulate(spec, chat))
    timeline = world.timeline
    assert [k for _, k in timeline.publishes] == list(range(1, spec.updates + 1))
    update_ends = [e for _, e, _ in timeline.learner]
    for p, k in timeline.publishes:
        assert p >= update_ends[k - 1] + model.publish_s - 1e-9
    assert len(timeline.aborts) == 1 and timeline.aborts[0] >= wall  # only close() aborts
    intervals = timeline.episode_intervals(wall)
    assert _latency.max_concurrency(intervals) <= spec.slots
    assert _latency.slot_utilisation(intervals, spec.slots, wall) <= 1.0 + 1e-9
    spans = [t.event_span for r in orch.records for t in r.trajectories]
    assert any(last > first for first, last in spans)
    # update 2 started before publish 1 landed: the learner did not wait for the install
    assert orch.records[1].start_time < timeline.publishes[0][0]
