"""Bounded memory: with ``keep_history=False`` the orchestrator keeps only what the next
update and the checkpoint need, however long the run (a long simulated run, fake engine)."""

from __future__ import annotations

import gc

from rollout_bridge.engine.fake import FakeEngine, run_virtual
from rollout_bridge.orchestrator import Orchestrator, OrchestratorConfig
from rollout_bridge.trajectory import Trajectory
from test_orchestrator import FakeLearner, World, chat  # noqa: F401

UPDATES, BATCH, SLOTS, TASKS = 450, 4, 6, 8


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))


def _live_trajectories() -> int:
    gc.collect()
    return sum(isinstance(obj, Trajectory) for obj in gc.get_objects())


def test_a_long_run_keeps_a_bounded_number_of_trajectories(chat):
    world = World(chat, TASKS, lambda task, visit: (task * 3 + visit * visit) % 2,
                  lambda task, visit: 1.0 + (task * 7 + visit) % 5)
    world.engine = FakeEngine(world.script, keep_records=False)
    config = OrchestratorConfig(method="spo", batch_size=BATCH, max_in_flight=SLOTS, max_buffered_batches=2,
                                pad_to_multiple=8, keep_history=False, drain="finish")
    learner = _ForgetfulLearner()
    orch = Orchestrator(world.engine, world.env, chat, learner, TASKS, config)
    counts = []

    async def main():
        try:
            for _ in range(3):
                await orch.run(UPDATES // 3)
                counts.append((_live_trajectories(), _rss_mib()))
        finally:
            await orch.close()

    baseline = _live_trajectories()
    run_virtual(main())
    assert orch.updates == UPDATES and orch.events == [] and orch.records == []
    assert world.engine.num_requests >= UPDATES * BATCH
    # what may live: the ready buffer (< 2 batches) and nothing else (SPO keeps arrays of y′)
    bound = baseline + config.max_buffered_batches * BATCH
    assert all(live <= bound for live, _ in counts), (counts, bound)
    assert len(orch.method.previous) <= TASKS
    (_, rss_first), (_, rss_last) = counts[0], counts[-1]
    assert rss_last - rss_first < 32, f"RSS grew {rss_last - rss_first:.1f} MiB over {2 * UPDATES // 3} updates"


class _ForgetfulLearner(FakeLearner):
    """FakeLearner that does not keep its inputs (they hold every trajectory)."""

    async def __call__(self, learner_input):
        output = await super().__call__(learner_input)
        self.inputs.clear()
        return output


def test_garbage_collector_tuning_follows_tune_gc(chat, monkeypatch):
    """The process-wide gc.freeze + threshold is applied at run() unless tune_gc=False
    (a program embedding the orchestrator keeps its own collector settings)."""
    import rollout_bridge.orchestrator as orchestrator_module

    for tune_gc in (False, True):
        calls = []
        monkeypatch.setattr(orchestrator_module, "_tune_garbage_collector", lambda: calls.append(1))
        world = World(chat, TASKS, lambda task, visit: task % 2, lambda task, visit: 1.0)
        config = OrchestratorConfig(method="spopp", batch_size=BATCH, max_in_flight=SLOTS,
                                    pad_to_multiple=8, tune_gc=tune_gc, drain="finish")
        orch = Orchestrator(world.engine, world.env, chat, FakeLearner(), TASKS, config)

        async def main():
            try:
                await orch.run(1)
            finally:
                await orch.close()

        run_virtual(main())
        assert orch.updates == 1 and len(calls) == (1 if tune_gc else 0)
