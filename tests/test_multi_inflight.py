"""Several in-flight requests per task (``max_in_flight_per_task = m``), orchestrator module
docstring. Replays the event log against a hand-kept model of the semantics: H_q(x) = the
results of x received before q's dispatch, v̂_q by the SPEC-2 formula in float64, at most m
in flight per task, siblings with the same H share v̂, and the two sibling rules.
"""

import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge.orchestrator import OrchestratorConfig, free_slot_mask, sample_dispatch_tasks
from spopp_jax import sampling
from test_orchestrator import (  # noqa: F401  (chat is a fixture)
    RHO, FakeLearner, World, chat, jeffreys, reward_table, run_orchestrator, spec_baseline, uneven_latency,
)


def replay(orch, alpha0, beta0, per_task, z0=0.0):
    """Check every dispatch of ``orch.events``; return counts of what was exercised."""
    history = {x: [] for x in range(orch.num_tasks)}
    in_flight = np.zeros(orch.num_tasks, dtype=np.int64)
    last = {}  # task -> (len(history) at its last dispatch, v̂ frozen then)
    publishes = 0
    stats = dict(max_in_flight=0, siblings=0, shared_history=0, below_min_tier=0, nonempty=0)
    for kind, item in orch.events:
        if kind == "dispatch":
            x = item.task_id
            assert in_flight[x] < per_task, f"task {x} exceeds {per_task} in flight"
            stats["siblings"] += bool(in_flight[x])
            stats["below_min_tier"] += in_flight[x] > in_flight.min()  # balanced forbids this
            in_flight[x] += 1
            stats["max_in_flight"] = max(stats["max_in_flight"], int(in_flight[x]))
            assert item.policy_event == publishes
            assert item.z == pytest.approx(z0 + publishes * -math.log(RHO), rel=1e-6)
            expected = spec_baseline(alpha0[x], beta0[x], z0, item.z, history[x])
            assert item.frozen_baseline == pytest.approx(expected, abs=2e-6)
            stats["nonempty"] += bool(history[x])
            if x in last and last[x][0] == len(history[x]):  # same H (z_q cancels in v̂)
                assert item.frozen_baseline == last[x][1]
                stats["shared_history"] += 1
            last[x] = (len(history[x]), item.frozen_baseline)
        elif kind in ("receive", "drop"):
            stamp = item.stamp if kind == "receive" else item
            in_flight[stamp.task_id] -= 1
            assert in_flight[stamp.task_id] >= 0
            if kind == "receive" and item.usable:
                history[item.task_id].append((item.z, item.reward))
        elif kind == "publish":
            publishes += 1
    assert not in_flight.any()  # close() drops what was left: every dispatch is accounted for
    return stats


def engine_overlap(world, chat):
    """Most requests of one task served at once by the engine (sweep over start/finish).
    Only for runs without aborts (a request cancelled by an abort has no finish time)."""
    points = {}
    for rec in world.engine.records:
        assert rec.finish_time is not None
        task = int(chat.tokenizer.decode(list(rec.request.prompt_ids)).split("task ")[1].split()[0])
        points.setdefault(task, []).extend([(rec.start_time, 1), (rec.finish_time, -1)])
    best = 0
    for events in points.values():
        level = 0
        for _, delta in sorted(events, key=lambda e: (e[0], e[1])):  # a finish frees before a start
            level += delta
            best = max(best, level)
    return best


def test_free_slot_mask_hand_numbers():
    # 3 tasks with 0, 2, 1 in flight, m = 3: tier 0 -> task 0 free; tier 1 -> 0, 2; tier 2 -> all.
    mask = free_slot_mask(np.array([0, 2, 1]), 3)
    assert mask.tolist() == [False, True, True, False, True, False, False, False, False]
    assert free_slot_mask(np.array([0, 1, 0]), 1).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="in_flight_count"):
        free_slot_mask(np.array([0.0, 1.0]), 2)
    with pytest.raises(ValueError, match="max_in_flight_per_task"):
        free_slot_mask(np.array([0, 1]), 0)


@settings(max_examples=20, deadline=None)
@given(st.sampled_from([3, 7]), st.integers(0, 2**31 - 1), st.sampled_from(["balanced", "proportional"]))
def test_m1_sampler_is_the_spec_idle_sampler(num_tasks, seed, rule):
    rng = np.random.default_rng(seed)
    v_hat = rng.uniform(0, 1, num_tasks).astype(np.float32)
    busy = rng.integers(0, 2, num_tasks)
    count = int(rng.integers(0, (busy == 0).sum() + 1))
    key = jax.random.key(seed)
    spec = np.asarray(jax.jit(sampling.sample_idle_tasks, static_argnames="k")(key, v_hat, busy > 0, k=num_tasks))
    spec = spec[:count]  # the first `count` of a full Gumbel top-k draw (SPEC 3 idle sampler)
    got = sample_dispatch_tasks(key, v_hat, busy, 1, count, rule=rule)
    assert got.tolist() == spec.tolist()


@pytest.mark.parametrize("drain", ["finish", "abort"])
def test_m1_dispatches_are_identical_for_both_rules_and_the_default(chat, drain):
    logs = []
    for kwargs in ({}, dict(max_in_flight_per_task=1, sibling_rule="balanced"),
                   dict(max_in_flight_per_task=1, sibling_rule="proportional")):
        world = World(chat, 6, reward_table(20), uneven_latency(20))
        config = OrchestratorConfig(batch_size=4, max_in_flight=5, drain=drain, pad_to_multiple=8, seed=3, **kwargs)
        orch = run_orchestrator(world, config, 5, learner=FakeLearner(latency=1.5), prior=jeffreys(6))
        logs.append([(s.request_id, s.task_id, s.policy_event, s.z, s.frozen_baseline, s.dispatch_time)
                     for k, s in orch.events if k == "dispatch"])
        assert replay(orch, *jeffreys(6), per_task=1)["max_in_flight"] == 1
    assert logs[0] == logs[1] == logs[2] and len(logs[0]) > 20


def test_sampler_first_draw_law(chat):
    # v̂ = (0.5, 0.1, 0.9, 0.3) -> u = sqrt(v(1-v) + 0.05); in flight (1, 0, 2, 0), m = 3.
    v_hat = np.array([0.5, 0.1, 0.9, 0.3], np.float32)
    busy = np.array([1, 0, 2, 0])
    u = np.sqrt(v_hat.astype(np.float64) * (1 - v_hat) + 0.05)
    laws = {"proportional": u * (3 - busy) / (u * (3 - busy)).sum(),  # ∝ u · free slots
            "balanced": np.where(busy == 0, u, 0) / np.where(busy == 0, u, 0).sum()}  # idle tier only
    draws = 1500
    for rule, law in laws.items():
        first = np.array([sample_dispatch_tasks(jax.random.key(i), v_hat, busy, 3, 1, rule=rule)[0]
                          for i in range(draws)])
        freq = np.bincount(first, minlength=4) / draws
        tolerance = 4.5 * np.sqrt(law * (1 - law) / draws) + 1e-9
        assert np.all(np.abs(freq - law) <= tolerance), (rule, freq, law)


def test_balanced_fills_tiers_in_order_and_never_exceeds_m():
    v_hat = np.array([0.5, 0.1, 0.9, 0.3, 0.6], np.float32)
    busy = np.array([2, 0, 1, 0, 1])
    for seed in range(20):
        chosen = sample_dispatch_tasks(jax.random.key(seed), v_hat, busy, 3, 7, rule="balanced")
        counts = busy.copy()
        for x in chosen:
            assert counts[x] == counts.min() and counts[x] < 3
            counts[x] += 1
        assert sorted(counts.tolist()) == [2, 2, 2, 2, 3]  # tiers 0 (2 draws), 1 (4), 2 (1)
    for rule in ("balanced", "proportional"):
        full = sample_dispatch_tasks(jax.random.key(0), v_hat, busy, 3, 11, rule=rule)  # every free slot
        assert np.bincount(full, minlength=5).tolist() == (3 - busy).tolist()
        with pytest.raises(ValueError, match="count"):
            sample_dispatch_tasks(jax.random.key(0), v_hat, busy, 3, 12, rule=rule)


@settings(max_examples=5, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 4), st.sampled_from(["balanced", "proportional"]),
       st.sampled_from(["finish", "abort"]))
def test_multi_inflight_baselines_follow_the_received_history(chat, seed, per_task, rule, drain):
    num_tasks = 4
    world = World(chat, num_tasks, reward_table(seed % 50), uneven_latency(seed % 50))
    prior = jeffreys(num_tasks)
    config = OrchestratorConfig(batch_size=5, max_in_flight=3 * per_task, max_in_flight_per_task=per_task,
                                sibling_rule=rule, drain=drain, pad_to_multiple=8, seed=seed)
    orch = run_orchestrator(world, config, 5, learner=FakeLearner(latency=1.0), prior=prior)
    assert orch.updates == 5
    stats = replay(orch, *prior, per_task=per_task)
    assert stats["siblings"] > 0 and stats["shared_history"] > 0 and stats["nonempty"] > 5
    assert stats["max_in_flight"] <= per_task
    if drain == "finish":
        assert engine_overlap(world, chat) <= per_task
    if rule == "balanced":
        assert stats["below_min_tier"] == 0


def test_m_is_reached_and_proportional_stacks_siblings_while_tasks_idle(chat):
    stats = {}
    for rule in ("balanced", "proportional"):
        world = World(chat, 6, reward_table(21), uneven_latency(21))
        config = OrchestratorConfig(batch_size=6, max_in_flight=9, max_in_flight_per_task=3, sibling_rule=rule,
                                    pad_to_multiple=8, drain="finish")
        orch = run_orchestrator(world, config, 6, prior=jeffreys(6))
        stats[rule] = replay(orch, *jeffreys(6), per_task=3)
        assert engine_overlap(world, chat) == stats[rule]["max_in_flight"]
    assert stats["balanced"]["below_min_tier"] == 0 and stats["balanced"]["siblings"] > 0
    assert stats["proportional"]["below_min_tier"] > 0 and stats["proportional"]["max_in_flight"] == 3


def sibling_wave_world(chat, per_task, permutations):
    """Waves of m requests per task; completion order in wave w is ``permutations[w]`` over
    the items task * m + sibling (visit v of a task is wave v // m, sibling v % m)."""
    def latency(task, visit):
        wave, sibling = divmod(visit, per_task)
        return 1.0 + list(permutations[wave]).index(task * per_task + sibling)

    return World(chat, len(permutations[0]) // per_task, reward_table(3), latency)


@settings(max_examples=5, deadline=None)
@given(st.data())
def test_receipt_order_invariance_per_request_with_siblings(chat, data):
    # Batch = all m·n slots and one buffered batch: wave w sees exactly waves < w. Shuffling
    # completions inside waves changes receipt order, not any H_q, so no v̂_q may change.
    num_tasks, per_task, waves = 3, 2, 3
    items = num_tasks * per_task
    perms = [[tuple(data.draw(st.permutations(range(items)))) for _ in range(waves + 1)] for _ in range(2)]
    config = OrchestratorConfig(batch_size=items, max_in_flight=items, max_buffered_batches=1,
                                max_in_flight_per_task=per_task, pad_to_multiple=8, drain="finish")
    prior = jeffreys(num_tasks)
    keyed = []
    for run_perms in perms:
        orch = run_orchestrator(sibling_wave_world(chat, per_task, run_perms), config, waves, prior=prior)
        assert orch.failed == 0 and orch.aborted == 0
        stats = replay(orch, *prior, per_task=per_task)
        assert stats["max_in_flight"] == per_task
        receipts = [t.task_id for kind, t in orch.events if kind == "receive"]
        assert receipts == [item // per_task for p in run_perms for item in p]
        visit, baselines = {}, {}
        for kind, s in orch.events:
            if kind == "dispatch":
                baselines[(s.task_id, visit.setdefault(s.task_id, 0))] = (s.z, s.frozen_baseline)
                visit[s.task_id] += 1
        keyed.append(baselines)
    assert set(keyed[0]) == set(keyed[1]) == {(x, v) for x in range(num_tasks) for v in range(per_task * (waves + 1))}
    assert sum(b != 0.5 for _, b in keyed[0].values()) > 0
    for key, (z, v_hat) in keyed[0].items():
        assert keyed[1][key][0] == z and keyed[1][key][1] == pytest.approx(v_hat, abs=1e-6)
        sibling = (key[0], key[1] ^ 1)  # the other request of the same wave: same H, same v̂
        assert keyed[0][sibling][1] == v_hat


def test_config_validation():
    with pytest.raises(ValueError, match="max_in_flight_per_task"):
        OrchestratorConfig(max_in_flight_per_task=0)
    with pytest.raises(ValueError, match="sibling_rule"):
        OrchestratorConfig(max_in_flight_per_task=2, sibling_rule="greedy")
    with pytest.raises(ValueError, match="GRPO"):
        OrchestratorConfig(method="grpo", batch_size=8, group_size=4, max_in_flight_per_task=2)
    assert OrchestratorConfig().max_in_flight_per_task == 1


# ----------------------------------------------------------------------------- benchmark
def _bench_module():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import multi_inflight

    return multi_inflight


def test_bench_accounting_hand_numbers():
    from types import SimpleNamespace as NS

    bench = _bench_module()
    d = lambda x: ("dispatch", NS(task_id=x))  # noqa: E731
    r = lambda x: ("receive", NS(task_id=x, usable=True))  # noqa: E731
    # task 0: dispatch, sibling (same H), receipt, sibling (H changed), task 1 alone.
    log = NS(num_tasks=2, events=[d(0), d(0), r(0), d(0), d(1), r(0), r(0), r(1)])
    assert bench.sibling_shares(log) == (2 / 4, 1 / 4)
    points = [(0.0, 0.3), (5.0, 0.4), (9.0, 0.6)]
    assert [bench.step_value(points, t) for t in (4.9, 5.0, 100.0)] == [0.3, 0.4, 0.6]
    assert bench.time_to(points, 0.35) == 5.0 and bench.time_to(points, 0.7) == float("inf")


def test_bench_bandit_learner_follows_its_formula(chat):
    bench = _bench_module()
    spec = bench.Bench(per_task=2, seed=0, tasks=4, slots=8, batch=4, updates=3, latency_s=5.0, learner_s=1.0)
    world, engine, orch = run_virtual_bench(bench, spec, chat)
    assert engine.max_concurrent <= 8 and replay(orch, np.full(4, 0.5), np.full(4, 0.5), per_task=2)["siblings"] > 0
    theta = world.thetas[0].copy()
    for record in orch.records:  # θ_x += lr Σ Ã_i (R_i − sigmoid(θ_x(k_i))), from the orchestrator's record
        for traj, whitened in zip(record.trajectories, record.advantages):
            p_then = 1 / (1 + math.exp(-world.thetas[traj.policy_event][traj.task_id]))
            theta[traj.task_id] += spec.lr * whitened * (traj.reward - p_then)
        np.testing.assert_allclose(world.thetas[record.update], theta, rtol=1e-6)
    result = bench.run_once(spec, chat)
    assert 0 < result["useful"] <= result["utilisation"] <= 1 and result["peak"] <= 8


def run_virtual_bench(bench, spec, chat):
    from rollout_bridge.engine.fake import run_virtual

    return run_virtual(bench._simulate(spec, chat))
