"""Orchestrator semantics (SPEC 2-4) with the scripted engine under virtual time.

Every test replays the orchestrator's event log against a hand-maintained model of the
SPEC: visible histories, the event-time formula in float64, one request per task, drains.
"""

import asyncio
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge.agent import AgentConfig, ChatFormat
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply, run_virtual
from rollout_bridge.envs.base import AsyncEnvironment, StepResult
from rollout_bridge.orchestrator import LearnerOutput, Orchestrator, OrchestratorConfig
from rollout_bridge.tokenizer import build_tiny_tokenizer
from spopp_jax.tracker import policy_coordinate

RHO = 0.875


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(["task visit 0123456789 ok"] * 20, tmp_path_factory.mktemp("tok"), 300)
    return ChatFormat.from_tokenizer(tokenizer)


class ScriptedEnv(AsyncEnvironment):
    """One-turn env: observation "task X visit V"; reward, latency and faults scripted."""

    def __init__(self, world):
        self.world, self.num_tasks = world, world.num_tasks

    async def reset(self, task_id):
        visit = self.world.visits.setdefault(task_id, 0)
        self.world.visits[task_id] += 1
        self.task, self.visit = task_id, visit
        delay = self.world.env_latency(task_id, visit)
        if delay:
            await asyncio.sleep(delay)
        if self.world.fault(task_id, visit):
            raise RuntimeError(f"scripted fault task {task_id} visit {visit}")
        return f"task {task_id} visit {visit}"

    async def step(self, action_text):
        return StepResult("done", float(self.world.reward(self.task, self.visit)), True)


class World:
    """Scripted rewards / latencies keyed by (task, visit); builds env + engine."""

    def __init__(self, chat, num_tasks, reward, latency, env_latency=None, fault=None):
        self.chat, self.num_tasks, self.visits = chat, num_tasks, {}
        self.reward, self.latency = reward, latency
        self.env_latency = env_latency or (lambda task, visit: 0.0)
        self.fault = fault or (lambda task, visit: False)
        self.engine = FakeEngine(self.script)

    def script(self, request):
        text = self.chat.tokenizer.decode(list(request.prompt_ids))
        words = text.split("task ", 1)[1].split()
        task, visit = int(words[0]), int(words[2].split("<")[0])
        ok = self.chat.tokenizer.convert_tokens_to_ids("o")
        length = 1 + (task % 3) + (visit % 2)  # L_i varies with task and visit
        return ScriptedReply((ok,) * length + (self.chat.stop_token_ids[0],), latency=self.latency(task, visit))

    def env(self):
        return ScriptedEnv(self)


class FakeLearner:
    """Async learner taking ``latency`` virtual seconds; weights named by update count."""

    def __init__(self, latency=0.0, divergence=None):
        self.latency, self.divergence, self.inputs = latency, divergence, []

    async def __call__(self, learner_input):
        self.inputs.append(learner_input)
        if self.latency:
            await asyncio.sleep(self.latency)
        n = len(self.inputs)
        d = self.divergence(learner_input) if self.divergence else None
        # methods that ask for a divergence also need the learner's log-probs of the batch
        trained = None if learner_input.previous is None else -0.5 * np.asarray(learner_input.batch.action_mask)
        return LearnerOutput(weights=f"w{n}", metrics={"update": float(n)}, divergence=d, trained_logp=trained)


def run_orchestrator(world, config, num_updates, learner=None, prior=None, agent_config=AgentConfig()):
    learner = learner or FakeLearner()
    prior_alpha, prior_beta = prior if prior is not None else (None, None)

    async def main():
        orch = Orchestrator(world.engine, world.env, world.chat, learner, world.num_tasks, config,
                            agent_config, prior_alpha, prior_beta)
        try:
            await orch.run(num_updates)
        finally:
            await orch.close()
        return orch

    return run_virtual(main())


def jeffreys(num_tasks):
    successes = np.arange(num_tasks) % 9
    alpha = 8 * (successes + 0.5) / 9
    beta = 8 * (8 - successes + 0.5) / 9
    return alpha, beta


def spec_baseline(alpha0, beta0, z0, z_q, history):
    """SPEC 2 in float64: α_q = e^{−(z_q−z0)}α0 + Σ e^{−(z_q−z_i)}R_i, same for β."""
    a = math.exp(-(z_q - z0)) * alpha0 + sum(math.exp(-(z_q - z)) * r for z, r in history)
    b = math.exp(-(z_q - z0)) * beta0 + sum(math.exp(-(z_q - z)) * (1 - r) for z, r in history)
    return a / (a + b)


def replay_check_event_time(orch, alpha0, beta0, z0=0.0):
    """Check every dispatch against the visible-history recomputation; return stats."""
    history = {x: [] for x in range(orch.num_tasks)}
    in_flight, publishes, checked_nonempty = set(), 0, 0
    for kind, item in orch.events:
        if kind == "dispatch":
            assert item.task_id not in in_flight, "two in-flight requests for one task"
            in_flight.add(item.task_id)
            assert item.policy_event == publishes
            assert item.z == pytest.approx(z0 + publishes * -math.log(RHO), rel=1e-6)
            assert item.z == float(policy_coordinate(publishes, RHO, z0))  # the tracker's float32, exactly
            expected = spec_baseline(alpha0[item.task_id], beta0[item.task_id], z0, item.z, history[item.task_id])
            assert item.frozen_baseline == pytest.approx(expected, abs=2e-6)
            checked_nonempty += bool(history[item.task_id])
        elif kind == "receive":
            in_flight.discard(item.task_id)
            if item.usable:
                history[item.task_id].append((item.z, item.reward))
        elif kind == "drop":
            in_flight.discard(item.task_id)
        elif kind == "publish":
            publishes += 1
            assert item == publishes
    return checked_nonempty


def uneven_latency(seed):
    rng = np.random.default_rng(seed)
    table = rng.choice([0.5, 1.0, 3.0, 9.0, 27.0], size=(64, 64))
    return lambda task, visit: float(table[task, visit])


def reward_table(seed):
    table = np.random.default_rng(seed + 100).integers(0, 2, size=(64, 64))
    return lambda task, visit: int(table[task, visit])


@pytest.mark.parametrize("drain", ["finish", "abort"])
def test_frozen_baseline_equals_visible_history_formula(chat, drain):
    world = World(chat, 6, reward_table(0), uneven_latency(0))
    prior = jeffreys(6)
    config = OrchestratorConfig(batch_size=4, max_in_flight=5, drain=drain, pad_to_multiple=8)
    orch = run_orchestrator(world, config, num_updates=6, prior=prior)
    assert orch.updates == 6 and orch.policy_event == 6
    assert replay_check_event_time(orch, *prior) > 10
    # Engine side: never two overlapping requests of one task.
    spans = {}
    for rec in world.engine.records:
        task = int(chat.tokenizer.decode(list(rec.request.prompt_ids)).split("task ")[1].split()[0])
        spans.setdefault(task, []).append((rec.start_time, rec.finish_time))
    for task_spans in spans.values():
        task_spans.sort()
        assert all(end <= nxt for (_, end), (nxt, _) in zip(task_spans, task_spans[1:]))


def test_advantages_are_reward_minus_frozen_baseline_then_token_whitened(chat):
    world = World(chat, 6, reward_table(1), uneven_latency(1))
    orch = run_orchestrator(world, OrchestratorConfig(batch_size=5, max_in_flight=6, pad_to_multiple=8,
                                                      drain="finish"), 3,
                            prior=jeffreys(6))
    for record in orch.records:
        rewards = np.array([t.reward for t in record.trajectories])
        frozen = np.array([t.frozen_baseline for t in record.trajectories])
        lengths = np.array([t.num_action_tokens for t in record.trajectories], dtype=np.float64)
        raw = rewards - frozen
        np.testing.assert_allclose(record.raw_advantages, raw, atol=1e-6)
        mu = (lengths * raw).sum() / lengths.sum()
        sigma = math.sqrt((lengths * (raw - mu) ** 2).sum() / (lengths.sum() - 1))
        np.testing.assert_allclose(record.advantages, (raw - mu) / (sigma + 1e-8), atol=1e-4)
        assert abs((lengths * record.advantages).sum() / lengths.sum()) < 1e-5
        cov = np.mean((lengths - lengths.mean()) * (raw - raw.mean()))
        assert record.diagnostics["cov_n_length_advantage"] == pytest.approx(cov, abs=1e-5)


def test_batch_reaches_learner_packed_with_whitened_advantages(chat):
    learner = FakeLearner()
    world = World(chat, 5, reward_table(2), uneven_latency(2))
    orch = run_orchestrator(world, OrchestratorConfig(batch_size=3, max_in_flight=4, pad_to_multiple=16,
                                                      drain="finish"), 2,
                            learner=learner)
    for learner_input, record in zip(learner.inputs, orch.records):
        batch = learner_input.batch
        assert learner_input.trajectories == record.trajectories
        assert batch.input_ids.shape[0] == 3 and batch.input_ids.shape[1] % 16 == 0
        for row, traj in enumerate(record.trajectories):
            n = len(traj.token_ids)
            assert list(np.asarray(batch.input_ids)[row, :n]) == list(traj.token_ids)
            mask = np.asarray(batch.action_mask)[row]
            assert mask.sum() == traj.num_action_tokens
            assert np.allclose(np.asarray(batch.advantages)[row][mask], record.advantages[row])
    assert world.engine.published == [(1, "w1"), (2, "w2")]


def wave_world(chat, permutations):
    """Waves of all tasks; the completion order inside wave v is ``permutations[v]``."""
    def latency(task, visit):
        order = permutations[visit]
        return 1.0 + list(order).index(task)
    return World(chat, len(permutations[0]), reward_table(3), latency)


@settings(max_examples=6, deadline=None)
@given(st.data())
def test_receipt_order_invariance_end_to_end(chat, data):
    # max_buffered_batches=1 with batch = tasks: each wave sees exactly the earlier waves,
    # so visible histories are fixed while completion order within waves is shuffled.
    # Wave w is consumed by update w + 1; wave `waves` is dispatched during the last update
    # and drained before its publish.
    num_tasks, waves = 4, 3
    perms_a = [tuple(data.draw(st.permutations(range(num_tasks)))) for _ in range(waves + 1)]
    perms_b = [tuple(data.draw(st.permutations(range(num_tasks)))) for _ in range(waves + 1)]
    config = OrchestratorConfig(batch_size=4, max_in_flight=4, max_buffered_batches=1, pad_to_multiple=8,
                                drain="finish")
    prior = jeffreys(num_tasks)
    runs = [run_orchestrator(wave_world(chat, p), config, waves, prior=prior) for p in (perms_a, perms_b)]
    baselines = []
    for orch in runs:
        assert orch.failed == 0 and orch.aborted == 0
        replay_check_event_time(orch, *prior)
        stamps = [s for kind, s in orch.events if kind == "dispatch"]
        visit = {}
        keyed = {}
        for s in stamps:
            keyed[(s.task_id, visit.setdefault(s.task_id, 0))] = (s.z, s.frozen_baseline)
            visit[s.task_id] += 1
        baselines.append(keyed)
    assert set(baselines[0]) == set(baselines[1]) == {(x, v) for x in range(num_tasks) for v in range(waves + 1)}
    assert sum(b != 0.5 for _, b in baselines[0].values()) > 0
    for key in baselines[0]:
        assert baselines[0][key][0] == baselines[1][key][0]
        assert baselines[0][key][1] == pytest.approx(baselines[1][key][1], abs=1e-6)
    receipts = [[t.task_id for kind, t in orch.events if kind == "receive"] for orch in runs]
    assert receipts[0] == [x for p in perms_a for x in p] and receipts[1] == [x for p in perms_b for x in p]
    np.testing.assert_allclose(np.asarray(runs[0].tracker.alpha), np.asarray(runs[1].tracker.alpha), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(runs[0].tracker.beta), np.asarray(runs[1].tracker.beta), rtol=1e-6)


def test_finish_drain_lets_old_policy_work_finish_into_the_next_batch(chat):
    # Task 0 is slow on its first visit: it is in flight when update 1 publishes.
    latency = lambda task, visit: 50.0 if (task, visit) == (0, 0) else 1.0 + task
    world = World(chat, 4, reward_table(4), latency)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain="finish", pad_to_multiple=8)
    orch = run_orchestrator(world, config, 3)
    kinds = [(k, item) for k, item in orch.events]
    consume_at = next(i for i, (k, _) in enumerate(kinds) if k == "consume")
    publish_at = next(i for i, (k, _) in enumerate(kinds) if k == "publish")
    between = [k for k, _ in kinds[consume_at:publish_at]]
    assert "dispatch" not in between  # no dispatch while draining
    slow = next(t for k, t in kinds if k == "receive" and t.task_id == 0 and t.policy_event == 0)
    assert kinds.index(("receive", slow)) < publish_at  # it finished before the publish
    later = next(r for r in orch.records if slow in r.trajectories)
    assert later.update >= 2 and later.policy_lag[later.trajectories.index(slow)] >= 1
    assert orch.aborted == 0
    # The engine never served a request across a publish: it stamps the event at start.
    assert all(rec.result.policy_event == rec.request.policy_event for rec in world.engine.records)


def test_abort_drain_drops_in_flight_work_and_frees_tasks(chat):
    latency = lambda task, visit: 50.0 if (task, visit) == (0, 0) else 1.0 + task
    world = World(chat, 4, reward_table(4), latency)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain="abort", pad_to_multiple=8)
    orch = run_orchestrator(world, config, 3, learner=FakeLearner(latency=0.5))
    drops = [s for k, s in orch.events if k == "drop"]
    assert any(s.task_id == 0 and s.policy_event == 0 for s in drops)
    assert orch.aborted >= 1
    consumed = [t for r in orch.records for t in r.trajectories]
    assert all(t.usable for t in consumed)
    assert not any(t.task_id == 0 and t.policy_event == 0 for t in consumed)
    # Task 0 was dispatched again after its drop, under a newer policy.
    later = [s for k, s in orch.events if k == "dispatch" and s.task_id == 0]
    assert len(later) >= 2 and later[1].policy_event >= 1
    assert any(rec.result.finish_reason == "abort" for rec in world.engine.records)
    replay_check_event_time(orch, np.full(4, 0.5), np.full(4, 0.5))


def test_policy_lag_is_event_at_consumption_minus_generating_event(chat):
    world = World(chat, 6, reward_table(5), uneven_latency(5))
    config = OrchestratorConfig(batch_size=3, max_in_flight=6, pad_to_multiple=8, drain="finish")
    orch = run_orchestrator(world, config, 5, learner=FakeLearner(latency=2.0))
    for record in orch.records:
        expected = [record.policy_event - t.policy_event for t in record.trajectories]
        assert record.policy_lag.tolist() == expected
        assert record.diagnostics["policy_lag_max"] == max(expected)
    lags = np.concatenate([r.policy_lag for r in orch.records])
    assert lags.min() >= 0 and lags.max() >= 1
    # The event at consumption is the number of publishes before the batch was consumed.
    publishes = 0
    for kind, item in orch.events:
        if kind == "publish":
            publishes += 1
        elif kind == "consume":
            assert item.policy_event == publishes


def test_env_fault_and_timeout_are_recorded_failures_and_run_continues(chat):
    fault = lambda task, visit: (task, visit) == (2, 0)
    env_latency = lambda task, visit: 500.0 if (task, visit) == (3, 1) else 0.0
    world = World(chat, 5, reward_table(6), uneven_latency(6), env_latency=env_latency, fault=fault)
    config = OrchestratorConfig(batch_size=3, max_in_flight=5, pad_to_multiple=8, drain="finish")
    orch = run_orchestrator(world, config, 5, agent_config=AgentConfig(env_timeout_s=10.0))
    failures = [t for k, t in orch.events if k == "receive" and t.failed]
    assert {(t.task_id, "fault" in t.error, "timed out" in t.error) for t in failures} == {
        (2, True, False), (3, False, True)}
    assert all(t.reward == 0.0 for t in failures) and orch.failed == 2
    assert orch.updates == 5
    consumed = [t for r in orch.records for t in r.trajectories]
    assert not any(t.failed for t in consumed)
    redispatched = [s for k, s in orch.events if k == "dispatch" and s.task_id in (2, 3)]
    assert len(redispatched) >= 4  # both tasks were freed and sampled again
    replay_check_event_time(orch, np.full(5, 0.5), np.full(5, 0.5))  # failures are not evidence


def test_grpo_group_barrier_and_group_relative_advantages(chat):
    # Task-visit (0, 0) has one slow member: its group must wait; other groups go first.
    def latency(task, visit):
        return 40.0 if (task, visit) == (0, 1) else 1.0 + (task + visit) % 3

    world = World(chat, 5, lambda task, visit: (task + visit) % 2, latency)
    config = OrchestratorConfig(method="grpo", group_size=3, batch_size=6, max_in_flight=9, pad_to_multiple=8,
                                drain="finish")
    orch = run_orchestrator(world, config, 4)
    receive_index = {id(t): i for i, (k, t) in enumerate(orch.events) if k == "receive"}
    consume_index = {r.update: i for i, (k, r) in enumerate(orch.events) if k == "consume"}
    for record in orch.records:
        groups = {}
        for t in record.trajectories:
            groups.setdefault(t.stamp.group_id, []).append(t)
        assert all(len(members) == 3 for members in groups.values())
        for members in groups.values():
            assert len({t.task_id for t in members}) == 1
            rewards = np.array([t.reward for t in members])
            for t in members:
                row = record.trajectories.index(t)
                assert record.raw_advantages[row] == pytest.approx(t.reward - rewards.mean(), abs=1e-6)
                assert receive_index[id(t)] < consume_index[record.update]
    # The slow group's fast members finished early but were consumed after later groups.
    slow_group = next(s.group_id for k, s in orch.events if k == "dispatch" and s.task_id == 0)
    first_batch_groups = {t.stamp.group_id for t in orch.records[0].trajectories}
    assert slow_group not in first_batch_groups


def replay_check_whole_groups(orch, group_size):
    """Replay the log: every consumed GRPO group is whole (G members, one batch, all
    received before the consume), a dropped group is never trained on, the diagnostics
    count the drops so far, and every group ends consumed, dropped or still pending."""
    members, outcome, consumed_in, dropped = {}, {}, {}, {}
    for kind, item in orch.events:
        if kind == "dispatch":
            members.setdefault(item.group_id, []).append(item.request_id)
        elif kind == "receive":
            outcome[item.stamp.request_id] = "aborted" if item.aborted else "failed" if item.failed else "ok"
        elif kind == "drop":
            outcome[item.request_id] = "aborted"
        elif kind == "drop_group":
            group = members[item.group_id]
            assert all(r in outcome for r in group), "a group was dropped before all members came back"
            spoilers = {outcome[r] for r in group} - {"ok"}
            assert item.reason in spoilers
            assert {t.stamp.request_id for t in item.finished} == {r for r in group if outcome[r] == "ok"}
            assert item.group_id not in consumed_in and item.group_id not in dropped
            dropped[item.group_id] = item
        elif kind == "consume":
            counts = {}
            for t in item.trajectories:
                counts[t.stamp.group_id] = counts.get(t.stamp.group_id, 0) + 1
                assert outcome.get(t.stamp.request_id) in ("ok", "failed")  # received before the consume
            assert set(counts.values()) == {group_size}, f"update {item.update}: group sizes {counts}"
            for group_id in counts:
                assert group_id not in consumed_in, f"group {group_id} split across updates"
                assert group_id not in dropped, f"dropped group {group_id} trained on"
                consumed_in[group_id] = item.update
            assert item.diagnostics["dropped_groups_total"] == len(dropped)
            assert item.diagnostics["dropped_group_trajectories_total"] == sum(
                len(d.finished) for d in dropped.values())
    assert orch.dropped_groups == len(dropped)
    return consumed_in, dropped


@pytest.mark.parametrize("seed", [13, 14, 15])
def test_grpo_abort_drain_trains_whole_groups_only(chat, seed):
    # Uneven latencies + an abort drain after every update: on the old code, aborted
    # members shrank groups (fragments with A = 0) and batches cut across groups.
    world = World(chat, 6, reward_table(seed), uneven_latency(seed))
    config = OrchestratorConfig(method="grpo", group_size=3, batch_size=6, max_in_flight=9, drain="abort",
                                pad_to_multiple=8)
    orch = run_orchestrator(world, config, 5, learner=FakeLearner(latency=2.0))
    consumed_in, dropped = replay_check_whole_groups(orch, 3)
    assert orch.updates == 5 and len(consumed_in) == 10
    assert dropped and all(d.reason == "aborted" for d in dropped.values())
    assert sum(len(d.finished) for d in dropped.values()) > 0  # finished members were discarded
    for record in orch.records:
        rewards = {}
        for t in record.trajectories:
            rewards.setdefault(t.stamp.group_id, []).append(t.reward)
        expected = [t.reward - np.mean(rewards[t.stamp.group_id]) for t in record.trajectories]
        np.testing.assert_allclose(record.raw_advantages, expected, atol=1e-6)


def test_grpo_finish_drain_drops_nothing(chat):
    world = World(chat, 6, reward_table(16), uneven_latency(16))
    config = OrchestratorConfig(method="grpo", group_size=3, batch_size=6, max_in_flight=9, pad_to_multiple=8,
                                drain="finish")
    orch = run_orchestrator(world, config, 4, learner=FakeLearner(latency=2.0))
    consumed_in, dropped = replay_check_whole_groups(orch, 3)
    assert len(consumed_in) == 8 and not dropped and orch.aborted == 0


@pytest.mark.parametrize("train_on_failed", [False, True])
def test_grpo_failed_member_follows_train_on_failed(chat, train_on_failed):
    # Visit 1 of every task faults: the second member of each task's first group fails.
    fault = lambda task, visit: visit == 1
    world = World(chat, 4, lambda task, visit: (task * 7 + visit) % 3 == 0, lambda task, visit: 1.0 + visit % 2,
                  fault=fault)
    config = OrchestratorConfig(method="grpo", group_size=3, batch_size=3, max_in_flight=6, pad_to_multiple=8,
                                train_on_failed=train_on_failed, drain="finish")
    orch = run_orchestrator(world, config, 4)
    consumed_in, dropped = replay_check_whole_groups(orch, 3)
    failed_groups = {t.stamp.group_id for k, t in orch.events if k == "receive" and t.failed}
    assert failed_groups and orch.failed == len(failed_groups)
    if not train_on_failed:
        # Dropped whole: its two finished members are not trained on.
        assert set(dropped) == failed_groups and all(d.reason == "failed" for d in dropped.values())
        assert all(len(d.finished) == 2 for d in dropped.values())
        assert not failed_groups & set(consumed_in)
        return
    assert not dropped and failed_groups & set(consumed_in)
    # GRPO with R = 0 for the failed member: A_i = R_i − (1/G) Σ_group R_j, scripted rewards.
    def scripted_reward(t):
        if t.failed:  # the env raised at reset: no observation, R = 0
            return 0.0
        text = chat.tokenizer.decode(list(t.token_ids[:t.prompt_length]))
        visit = int(text.split("visit ", 1)[1].split()[0].split("<")[0])
        return float((t.task_id * 7 + visit) % 3 == 0)

    for record in orch.records:
        for row, t in enumerate(record.trajectories):
            group = [u for u in record.trajectories if u.stamp.group_id == t.stamp.group_id]
            expected = scripted_reward(t) - sum(scripted_reward(u) for u in group) / 3
            assert record.raw_advantages[row] == pytest.approx(expected, abs=1e-6)


def test_spo_tracker_updates_in_arrival_order_after_the_actor_update(chat):
    def divergence(learner_input):
        return [None if prev is None else 0.03 * (1 + t.task_id % 3)
                for t, prev in zip(learner_input.trajectories, learner_input.previous)]

    learner = FakeLearner(divergence=divergence)
    world = World(chat, 5, reward_table(7), uneven_latency(7))
    prior = jeffreys(5)
    config = OrchestratorConfig(method="spo", batch_size=3, max_in_flight=4, pad_to_multiple=8, drain="finish")
    orch = run_orchestrator(world, config, 5, learner=learner, prior=prior)
    alpha, beta = [float(a) for a in prior[0]], [float(b) for b in prior[1]]
    last_seen = {}
    for kind, item in orch.events:
        if kind == "dispatch":
            expected = alpha[item.task_id] / (alpha[item.task_id] + beta[item.task_id])
            assert item.frozen_baseline == pytest.approx(expected, abs=2e-6)
        elif kind == "consume":
            inp = learner.inputs[item.update - 1]
            for row, (t, prev) in enumerate(zip(item.trajectories, inp.previous)):  # arrival order
                seen = last_seen.get(t.task_id)
                assert (prev is None) == (seen is None)
                if prev is not None:  # y′ = the task's previous consumed response
                    assert prev.task_id == t.task_id and np.array_equal(prev.token_ids, seen.token_ids)
                    if prev.batch_row >= 0:  # earlier in this batch: π_then from this update
                        assert item.trajectories[prev.batch_row] is seen and prev.logp_then is None
                    else:  # π_then = the learner's log-probs when y′ was trained (-0.5 here)
                        np.testing.assert_array_equal(prev.logp_then, np.where(seen.action_mask, -0.5, 0.0))
                d = 0.03 * (1 + t.task_id % 3) if t.task_id in last_seen else 0.0
                rho = min(max(2.0 ** (-d / 0.06), 0.875), 0.96)
                alpha[t.task_id] = rho * alpha[t.task_id] + t.reward
                beta[t.task_id] = rho * beta[t.task_id] + 1 - t.reward
                last_seen[t.task_id] = t
    np.testing.assert_allclose(np.asarray(orch.tracker.alpha), alpha, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(orch.tracker.beta), beta, rtol=1e-5)


def test_learning_overlaps_rollouts(chat):
    world = World(chat, 6, reward_table(8), lambda task, visit: 1.0 + task % 3)
    config = OrchestratorConfig(batch_size=3, max_in_flight=6, pad_to_multiple=8, drain="finish")
    orch = run_orchestrator(world, config, 3, learner=FakeLearner(latency=5.0))
    record = orch.records[0]
    during = [t for k, t in orch.events if k == "receive" and record.start_time < t.finish_time < record.end_time]
    assert during, "no rollout finished while the learner was training"


def test_sync_learner_runs_in_a_thread_on_a_real_loop(chat):
    import threading

    threads = []

    def learner(learner_input):
        threads.append(threading.get_ident())
        return LearnerOutput(weights="w", metrics={})

    world = World(chat, 4, reward_table(9), lambda task, visit: 0.001 * (1 + task))
    config = OrchestratorConfig(batch_size=2, max_in_flight=3, pad_to_multiple=8, drain="finish")

    async def main():
        orch = Orchestrator(world.engine, world.env, chat, learner, 4, config)
        try:
            await orch.run(2)
        finally:
            await orch.close()
        return orch, threading.get_ident()

    orch, loop_thread = asyncio.run(main())
    assert orch.updates == 2 and len(threads) == 2 and loop_thread not in threads


def test_state_dict_round_trip_restores_tracker_key_and_counters(chat):
    world = World(chat, 5, reward_table(10), uneven_latency(10))
    orch = run_orchestrator(world, OrchestratorConfig(batch_size=3, max_in_flight=4, pad_to_multiple=8,
                                                      drain="finish"), 2)
    state = orch.state_dict()
    fresh_world = World(chat, 5, reward_table(10), uneven_latency(10))
    fresh = Orchestrator(fresh_world.engine, fresh_world.env, chat, FakeLearner(), 5,
                         OrchestratorConfig(batch_size=3, seed=99, max_in_flight=128, drain="finish",
                                            pad_to_multiple=64))
    fresh.load_state_dict(state)
    for name in ("policy_event", "updates", "dispatched", "consumed", "failed", "aborted"):
        assert getattr(fresh, name) == getattr(orch, name)
    np.testing.assert_array_equal(np.asarray(fresh.tracker.alpha), np.asarray(orch.tracker.alpha))
    np.testing.assert_array_equal(np.asarray(fresh.tracker.z_ref), np.asarray(orch.tracker.z_ref))
    np.testing.assert_array_equal(jax.random.key_data(fresh._next_key()), jax.random.key_data(orch._next_key()))
    assert orch.policy_event == 2 and orch.dispatched >= orch.consumed == 6


def test_config_validation():
    with pytest.raises(ValueError, match="method"):
        OrchestratorConfig(method="ppo")
    with pytest.raises(ValueError, match="drain"):
        OrchestratorConfig(drain="later")
    with pytest.raises(ValueError, match=r"batch_size \(10\) must be a multiple of group_size \(3\)"):
        OrchestratorConfig(method="grpo", batch_size=10, group_size=3)


def test_packed_rows_need_a_row_width_in_steps_of_pad_to_multiple(chat):
    world = World(chat, 4, reward_table(4), lambda task, visit: 0.0)
    with pytest.raises(ValueError, match="pack_rows: rows of max_total_tokens=40"):
        Orchestrator(world.engine, world.env, world.chat, FakeLearner(), 4,
                     OrchestratorConfig(batch_size=3, max_in_flight=4, pad_to_multiple=16, pack_rows=True,
                                        drain="finish"),
                     AgentConfig(max_total_tokens=40))
    with pytest.raises(ValueError, match="pack_row_multiple"):
        OrchestratorConfig(pack_rows=True, pack_row_multiple=0)


def test_a_broken_environment_stops_the_run_instead_of_spinning(chat):
    world = World(chat, 4, reward_table(11), uneven_latency(11), fault=lambda task, visit: True)
    config = OrchestratorConfig(batch_size=2, max_in_flight=3, max_consecutive_failures=12, pad_to_multiple=8,
                                drain="finish")
    with pytest.raises(RuntimeError, match="12 consecutive failed trajectories; last error: RuntimeError: scripted"):
        run_orchestrator(world, config, 1)


def _bare(task_id, reward, n_actions, group_id=-1, frozen=0.5):
    from rollout_bridge.trajectory import DispatchStamp, Trajectory

    stamp = DispatchStamp(0, task_id, 0, 0.0, frozen, 0.0, group_id)
    ids = tuple(range(1, n_actions + 2))
    mask = (False,) + (True,) * n_actions
    return Trajectory(stamp, ids, mask, (0.0,) * len(ids), 1, reward, 0.0)


def test_group_relative_advantages_hand_numbers():
    from rollout_bridge.baselines import frozen_baseline_advantages, group_relative_advantages

    trajs = [_bare(0, 1.0, 2, group_id=5), _bare(1, 0.0, 3, group_id=7), _bare(0, 0.0, 1, group_id=5),
             _bare(0, 0.0, 4, group_id=5), _bare(1, 0.0, 2, group_id=7)]
    # group 5: rewards (1, 0, 0), mean 1/3; group 7: (0, 0), mean 0.
    np.testing.assert_allclose(group_relative_advantages(trajs), [2 / 3, 0, -1 / 3, -1 / 3, 0], atol=1e-7)
    np.testing.assert_allclose(frozen_baseline_advantages([_bare(0, 1.0, 1, frozen=0.3)]), [0.7], atol=1e-7)
    with pytest.raises(ValueError, match="group_id"):
        group_relative_advantages([_bare(0, 1.0, 1)])
    # Whole groups of G only: a split / shrunken group (old abort behaviour) is refused.
    with pytest.raises(ValueError, match=r"whole groups of group_size=3; group_id -> members in batch: \{7: 2\}$"):
        group_relative_advantages(trajs, group_size=3)
    np.testing.assert_allclose(group_relative_advantages(trajs[:1] + trajs[2:4], group_size=3), [2 / 3, -1 / 3, -1 / 3],
                               atol=1e-7)
    with pytest.raises(ValueError, match="frozen_baseline"):
        frozen_baseline_advantages([_bare(0, 1.0, 1, frozen=float("nan"))])


def test_spo_divergence_hand_numbers():
    from rollout_bridge.baselines import spo_divergences, token_mean_abs_log_ratio

    mask = [False, True, True, False, True]
    then = [0.0, -1.0, -2.0, 5.0, -0.5]
    now = [9.0, -1.5, -1.0, -5.0, -0.5]
    assert token_mean_abs_log_ratio(mask, then, now) == pytest.approx((0.5 + 1.0 + 0.0) / 3)
    assert token_mean_abs_log_ratio([False, False], [1.0, 2.0], [3.0, 4.0]) == 0.0
    np.testing.assert_allclose(spo_divergences(3, [None, 0.2, 0.0]), [0.0, 0.2, 0.0])
    np.testing.assert_allclose(spo_divergences(2, None), [0.0, 0.0])
    with pytest.raises(ValueError, match="entries"):
        spo_divergences(2, [0.1])
    with pytest.raises(TypeError, match="aligned"):
        spo_divergences(2, {3: 0.1, 4: 0.2})


def test_learner_side_spo_divergence_helpers():
    from rollout_bridge.baselines import divergences_from_logprobs, pack_previous_responses
    from rollout_bridge.methods import PreviousResponse

    def response(logps, batch_row=-1):
        n = len(logps)
        return PreviousResponse(0, np.arange(1, n + 2), np.array((False,) + (True,) * n),
                                None if batch_row >= 0 else np.array((0.0,) + tuple(logps), np.float32), batch_row)

    # π_then from the stored learner log-probs, or from this batch's row (batch_row >= 0)
    logp_batch = np.zeros((3, 4), np.float32)
    logp_batch[2, 1] = -0.5
    previous = [None, response([-1.0, -2.0]), None, response([9.0], batch_row=2)]
    arrays, rows = pack_previous_responses(previous, logp_batch, pad_to_multiple=4)
    assert rows.tolist() == [-1, 0, -1, 1] and arrays["input_ids"].shape == (2, 4)
    np.testing.assert_array_equal(arrays["logp_then"][1], [0.0, -0.5, 0.0, 0.0])
    logp_now = np.zeros((2, 4), np.float32)
    logp_now[0, 1:3] = [-1.5, -1.0]  # |−1 − (−1.5)| = 0.5, |−2 − (−1)| = 1.0 -> D = 0.75
    logp_now[1, 1] = -0.25  # |−0.5 − (−0.25)| = 0.25
    logp_now[:, 3] = 100.0  # padding / non-actions never count
    assert divergences_from_logprobs(rows, arrays, logp_now) == [None, pytest.approx(0.75), None,
                                                                 pytest.approx(0.25)]
    assert pack_previous_responses([None, None])[0] is None
    assert divergences_from_logprobs(np.array([-1, -1]), None, None) == [None, None]
    padded, _ = pack_previous_responses(previous, logp_batch, pad_to_multiple=4, num_rows=4)
    assert padded["input_ids"].shape == (4, 4) and not padded["attention_mask"][2:].any()
    with pytest.raises(ValueError, match="logp_batch"):
        pack_previous_responses(previous)


def test_state_survives_an_orbax_checkpoint_and_the_run_resumes(chat, tmp_path):
    from spopp_jax.checkpoint import Checkpointer

    world = World(chat, 5, reward_table(12), uneven_latency(12))
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, pad_to_multiple=8, drain="finish")
    orch = run_orchestrator(world, config, 2, prior=jeffreys(5))
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(2, {"dummy": np.zeros(2, np.float32)}, extras={"orchestrator": orch.state_dict()})
        checkpointer.wait_until_finished()
    resumed_world = World(chat, 5, reward_table(12), uneven_latency(12))
    resumed_world.engine.policy_event = orch.policy_event  # the engine serves the restored weights
    resumed = Orchestrator(resumed_world.engine, resumed_world.env, chat, FakeLearner(), 5, config)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        restored = checkpointer.restore({"dummy": np.zeros(2, np.float32)})  # extras as saved
    resumed.load_state_dict(restored.extras["orchestrator"])
    np.testing.assert_array_equal(np.asarray(resumed.tracker.alpha), np.asarray(orch.tracker.alpha))
    np.testing.assert_array_equal(np.asarray(resumed.tracker.beta), np.asarray(orch.tracker.beta))
    assert (resumed.updates, resumed.policy_event, resumed.dispatched) == (2, 2, orch.dispatched)

    async def resume():
        try:
            await resumed.run(2)
        finally:
            await resumed.close()

    run_virtual(resume())
    assert resumed.updates == 4 and resumed.policy_event == 4
    first = next(s for k, s in resumed.events if k == "dispatch")
    assert first.policy_event == 2 and first.request_id == orch.dispatched
    # Baselines continue from the restored evidence (not from the prior).
    np.testing.assert_allclose(first.frozen_baseline, float(orch.tracker.alpha[first.task_id] /
                               (orch.tracker.alpha[first.task_id] + orch.tracker.beta[first.task_id])), atol=1e-6)
