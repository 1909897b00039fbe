"""Drain "none" (SPEC 3, "Publishing without a drain") in the orchestrator, with the
scripted engine under virtual time: a publish never stops dispatch and never waits for or
aborts old-policy work; stamps stay the dispatch stamps; ``max_policy_lag`` aborts stale
requests; GRPO keeps whole groups."""

import asyncio

import numpy as np
import pytest

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply, run_virtual
from rollout_bridge.orchestrator import (Orchestrator, OrchestratorConfig, learner_wait_diagnostics, policy_lag_histogram,
                                        result_delay)
from rollout_bridge.config import RolloutSection
from test_orchestrator import (  # noqa: F401  (chat is a fixture)
    FakeLearner, World, chat, replay_check_event_time, replay_check_whole_groups, reward_table,
    run_orchestrator, uneven_latency)

SLOW_FIRST_VISIT = 12.0


def slow_task0(task, visit):
    """Task 0's first visit outlives several updates; every other reply is quick."""
    return SLOW_FIRST_VISIT if (task, visit) == (0, 0) else 1.0 + task


def run_without_close(world, config, num_updates, learner=None):
    """The orchestrator and its event log as ``run`` left it (before ``close`` aborts leftovers)."""
    async def main():
        orch = Orchestrator(world.engine, world.env, world.chat, learner or FakeLearner(), world.num_tasks, config)
        try:
            await orch.run(num_updates)
            return orch, list(orch.events)
        finally:
            await orch.close()

    return run_virtual(main())


def test_fake_engine_attributes_tokens_to_the_event_installed_when_sampled():
    engine = FakeEngine(lambda request: ScriptedReply((5, 6, 7, 8), latency=4.0))

    async def main():
        request = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_new_tokens=8)))
        await asyncio.sleep(1.5)  # tokens at t = 1, 2, 3, 4: the first under event 0
        await engine.publish_inflight("w1", 1)
        await asyncio.sleep(1.0)
        await engine.publish_inflight("w2", 2)  # at t = 2.5: tokens 3 and 4 under event 2
        return await request, await engine.generate([1], SamplingParams(max_new_tokens=8))

    spanning, later = run_virtual(main())
    assert spanning.token_policy_events == (0, 1, 2, 2) and spanning.event_span == (0, 2)
    assert spanning.finish_reason == "stop" and engine.policy_event == 2
    assert later.token_policy_events is None and later.policy_event == 2  # no install during it


def test_drain_none_keeps_dispatching_and_never_aborts_old_policy_work(chat):
    world = World(chat, 4, reward_table(4), slow_task0)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain="none", max_policy_lag=100, pad_to_multiple=8)
    orch = run_orchestrator(world, config, 6)
    events = orch.events
    last_consume = max(i for i, (k, _) in enumerate(events) if k == "consume")
    assert not any(k == "drop" for k, _ in events[:last_consume])  # only close() aborts leftovers
    assert orch.lag_aborted == 0
    slow = next(t for k, t in events if k == "receive" and t.task_id == 0 and t.policy_event == 0)
    first_publish = events.index(("publish", 1))
    # dispatch went on after the publish while the old-policy request was still running
    assert any(k == "dispatch" for k, _ in events[first_publish:events.index(("receive", slow))])
    # it kept its dispatch stamp and recorded the span of events its tokens came from
    assert slow.stamp.policy_event == 0 and slow.z == 0.0
    # (its tokens were sampled by newer weights: the fake spreads them over the 12 s)
    first, last = slow.event_span
    assert 0 <= first <= last and last >= 1 and last > slow.stamp.policy_event
    record = next(r for r in orch.records if slow in r.trajectories)
    assert record.policy_lag[record.trajectories.index(slow)] >= 1
    spans = [t.event_span for t in record.trajectories]
    assert record.diagnostics["event_span_mean"] == pytest.approx(np.mean([b - a for a, b in spans]))
    assert record.diagnostics["mixed_policy_fraction"] == pytest.approx(np.mean([b > a for a, b in spans]))
    assert any(b > a for r in orch.records for a, b in (t.event_span for t in r.trajectories))
    assert [event for event, _ in world.engine.published] == list(range(1, orch.policy_event + 1))
    replay_check_event_time(orch, np.full(4, 0.5), np.full(4, 0.5))  # v̂ frozen at dispatch, SPEC 2


def test_drain_finish_records_single_event_spans(chat):
    world = World(chat, 4, reward_table(4), slow_task0)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain="finish", pad_to_multiple=8)
    orch = run_orchestrator(world, config, 3)
    assert all(r.diagnostics["mixed_policy_fraction"] == 0.0 for r in orch.records)
    assert all(t.event_span == (t.policy_event, t.policy_event) for r in orch.records for t in r.trajectories)


def replayed_event_order(events) -> tuple[int, int]:
    """(received, out of event order) recounted from the log: a finished result is out of
    event order when a result of a newer policy event was received before it."""
    received = [t.stamp.policy_event for kind, t in events if kind == "receive" and not t.aborted]
    late = sum(event < max(received[:i], default=-1) for i, event in enumerate(received))
    return len(received), late


@pytest.mark.parametrize("drain", ["none", "finish"])
def test_results_out_of_event_order_are_counted(chat, drain):
    world = World(chat, 4, reward_table(4), slow_task0)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain=drain, max_policy_lag=100, pad_to_multiple=8)
    orch = run_orchestrator(world, config, 6)
    received, late = replayed_event_order(orch.events)
    assert (orch.received, orch.out_of_event_order) == (received, late)
    if drain == "none":  # task 0's slow event-0 result comes back after newer events' results
        assert late >= 1
    else:  # a drained publish receives every old-policy result before any newer one
        assert late == 0
    counted = [(r.diagnostics["received_total"], r.diagnostics["out_of_event_order_total"]) for r in orch.records]
    assert counted == sorted(counted) and counted[-1][0] <= received


def test_max_policy_lag_aborts_stale_requests_and_frees_their_tasks(chat):
    world = World(chat, 4, reward_table(4), lambda task, visit: 500.0 if (task, visit) == (0, 0) else 1.0 + task)
    config = OrchestratorConfig(batch_size=3, max_in_flight=4, drain="none", max_policy_lag=1, pad_to_multiple=8)
    orch, events = run_without_close(world, config, 5)
    drops, event_now = [], 0  # with the policy event current at each
    for kind, item in events:
        event_now = item if kind == "publish" else event_now
        if kind == "drop":
            drops.append((item, event_now))
    assert drops and all(now - stamp.policy_event > 1 for stamp, now in drops)  # only over-lag requests
    assert orch.lag_aborted == len(drops)
    counted = [r.diagnostics["lag_aborted_total"] for r in orch.records]  # as of each update's start
    assert counted == sorted(counted) and 0 < counted[-1] <= len(drops)
    slow = next(stamp for stamp, _ in drops if stamp.task_id == 0 and stamp.policy_event == 0)
    assert dict(drops)[slow] == 2  # aborted at the publish where its lag became 2 > 1
    drop_at = events.index(("drop", slow))
    later = [s for k, s in events[drop_at:] if k == "dispatch" and s.task_id == 0]
    assert later and later[0].policy_event >= 2  # the task was free again
    assert world.engine.records[slow.request_id].result is None  # its generate was cancelled
    assert world.engine.num_in_flight == 0  # and the engine freed the request
    consumed = {t.stamp.request_id for r in orch.records for t in r.trajectories}
    assert not consumed & {stamp.request_id for stamp, _ in drops}


def test_policy_lag_histogram_counts_every_trained_trajectory(chat):
    world = World(chat, 6, reward_table(5), uneven_latency(5))
    config = OrchestratorConfig(batch_size=3, max_in_flight=6, drain="none", max_policy_lag=2, pad_to_multiple=8)
    orch = run_orchestrator(world, config, 6, learner=FakeLearner(latency=2.0))
    for record in orch.records:
        counts = [record.diagnostics[f"policy_lag_count_{k}"] for k in range(3)]
        assert sum(counts) == 3
        assert counts == np.bincount(np.minimum(record.policy_lag, 2), minlength=3).tolist()
    assert policy_lag_histogram(np.array([0, 0, 1, 7]), 2) == {
        "policy_lag_count_0": 2.0, "policy_lag_count_1": 1.0, "policy_lag_count_2": 1.0}


@pytest.mark.parametrize("seed", [13, 14])
def test_grpo_under_drain_none_keeps_its_group_barrier(chat, seed):
    world = World(chat, 6, reward_table(seed), uneven_latency(seed))
    config = OrchestratorConfig(method="grpo", group_size=3, batch_size=6, max_in_flight=9, drain="none",
                                max_policy_lag=100, pad_to_multiple=8)
    orch, events = run_without_close(world, config, 4, learner=FakeLearner(latency=2.0))
    consumed_in, dropped = replay_check_whole_groups(orch, 3)
    assert len(consumed_in) == 8
    assert not any(k in ("drop", "drop_group") for k, _ in events)  # close() aborts only the leftovers


@pytest.mark.parametrize("drain", ["finish", "none"])
def test_learner_waits_on_a_slow_publish_only_when_draining(chat, drain):
    world = World(chat, 6, reward_table(7), lambda task, visit: 1.0)
    world.engine.publish_latency = 5.0
    config = OrchestratorConfig(batch_size=3, max_in_flight=6, max_buffered_batches=3, drain=drain,
                                pad_to_multiple=8)
    orch = run_orchestrator(world, config, 4, learner=FakeLearner(latency=0.5))
    idle = [r.diagnostics["learner_idle_s"] for r in orch.records[1:]]
    on_publish = [r.diagnostics["learner_publish_wait_s"] for r in orch.records[1:]]
    on_batch = [r.diagnostics["learner_batch_wait_s"] for r in orch.records[1:]]
    assert on_publish == pytest.approx(np.subtract(idle, on_batch).tolist())
    if drain == "finish":
        assert min(idle) >= 5.0  # each update waited for the previous install
        assert min(on_publish) >= 5.0  # with its batch ready all along (3 batches may be buffered)
    else:
        assert max(idle) < 5.0  # the next update trained while the install ran
        assert any(r.start_time < orch.records[i].end_time + 5.0 for i, r in enumerate(orch.records[1:]))
        # the update after that one waits for the install (5 s) less the 0.5 s update it overlapped
        assert max(on_publish) == pytest.approx(4.5)
        assert on_publish[0] == 0.0


def test_learner_wait_diagnostics_split_idle_time():
    assert learner_wait_diagnostics(None, None, 3.0) == {
        "learner_idle_s": 0.0, "learner_publish_wait_s": 0.0, "learner_batch_wait_s": 0.0}
    split = learner_wait_diagnostics(10.0, 12.5, 14.0)  # 2.5 s for rollouts, then 1.5 s for a publish
    assert split == {"learner_idle_s": 4.0, "learner_publish_wait_s": 1.5, "learner_batch_wait_s": 2.5}
    # a batch ready before the previous update ended: all the idle time is the publish's
    assert learner_wait_diagnostics(10.0, 9.0, 11.0)["learner_publish_wait_s"] == 1.0


def test_drain_none_needs_an_inflight_engine(chat):
    world = World(chat, 4, reward_table(4), slow_task0)
    world.engine.supports_inflight_publish = False
    with pytest.raises(ValueError, match="rollout.drain"):
        Orchestrator(world.engine, world.env, world.chat, FakeLearner(), 4,
                     OrchestratorConfig(batch_size=3, max_in_flight=4, drain="none", pad_to_multiple=64))
    assert RolloutSection(drain="none").drain == "none"
    with pytest.raises(ValueError, match="rollout.max_policy_lag"):
        RolloutSection(max_policy_lag=-1)


def test_a_cancelled_episode_closes_its_environment(chat):
    """A lag abort cancels the episode task: the environment must still be released."""
    from rollout_bridge.agent import run_episode
    from rollout_bridge.trajectory import DispatchStamp
    from test_orchestrator import ScriptedEnv

    world = World(chat, 2, reward_table(1), lambda task, visit: 100.0)
    closed = []

    class ClosingEnv(ScriptedEnv):
        async def close(self):
            closed.append(self.task)

    async def main():
        stamp = DispatchStamp(0, 1, 0, 0.0, 0.5, 0.0)
        episode = asyncio.ensure_future(run_episode(world.engine, ClosingEnv(world), chat, stamp))
        await asyncio.sleep(1.0)  # now inside engine.generate
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode
        return world.engine.num_in_flight

    assert run_virtual(main()) == 0 and closed == [1]


def test_result_delay_holds_each_result_its_seeded_draw_and_reorders_receipts(chat):
    """``result_delay_s``: every result reaches the orchestrator U(0, d) seconds after its
    episode finished (the draw a function of seed and request id only), so with equal
    latencies, where receipts otherwise follow event order, some come back out of event
    order; the event-time baselines frozen at dispatch still follow SPEC 2."""
    def run(delay, seed=0):
        world = World(chat, 6, reward_table(5), lambda task, visit: 1.0)
        config = OrchestratorConfig(batch_size=3, max_in_flight=6, drain="none", max_policy_lag=100,
                                    pad_to_multiple=8, result_delay_s=delay, seed=seed)
        orch, events = run_without_close(world, config, 8)
        return orch, [t for kind, t in events if kind == "receive"]

    plain, plain_receipts = run(0.0)
    assert plain.out_of_event_order == 0 and plain.received == len(plain_receipts) > 10
    held, receipts = run(6.0)
    received, late = replayed_event_order([("receive", t) for t in receipts])
    assert (held.received, held.out_of_event_order) == (received, late) and late >= 1
    for t in receipts:  # one 1-second turn, then the held time
        expected = t.stamp.dispatch_time + 1.0 + result_delay(0, t.stamp.request_id, 6.0)
        assert t.finish_time == pytest.approx(expected, abs=1e-9)
    replay_check_event_time(held, np.full(6, 0.5), np.full(6, 0.5))
    again = [t.stamp.request_id for t in run(6.0)[1]]
    assert again == [t.stamp.request_id for t in receipts]  # seeded: a rerun draws the same delays
    assert [t.stamp.request_id for t in run(6.0, seed=1)[1]] != again


def test_result_delay_draws_are_uniform_and_checked():
    draws = np.array([result_delay(3, request, 2.0) for request in range(4000)])
    assert draws.min() >= 0.0 and draws.max() <= 2.0
    assert abs(draws.mean() - 1.0) < 0.05 and abs(draws.var() - 4.0 / 12) < 0.03  # U(0, 2)
    assert result_delay(3, 7, 2.0) == result_delay(3, 7, 2.0) != result_delay(4, 7, 2.0)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="result_delay_s"):
            OrchestratorConfig(result_delay_s=bad)
        with pytest.raises(ValueError, match="rollout.result_delay_s"):
            RolloutSection(result_delay_s=bad)
