"""Long-run stability: a simulated day of single-stream RL (scripted engine, one-turn env,
trivial learner, virtual clock) with thousands of updates; RSS, open files, threads and
event-loop tasks sampled every `SAMPLE_EVERY` updates must stay flat after a warm-up.

The virtual clock (`run_virtual`) jumps to the next timer, so a 24-hour schedule runs in
seconds to minutes of wall time; the loop, the agent, the tracker, the sampler and the
advantage code run for real."""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from reliability_table import Row, covers

from rollout_bridge.agent import AgentConfig, ChatFormat
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply, run_virtual
from rollout_bridge.envs.base import AsyncEnvironment, StepResult
from rollout_bridge.orchestrator import LearnerOutput, Orchestrator, OrchestratorConfig
from rollout_bridge.tokenizer import build_tiny_tokenizer

NUM_TASKS, BATCH, IN_FLIGHT = 32, 8, 16
LATENCY_S = 55.0            # virtual seconds per generation: 16 in flight -> ~27 s per update
SAMPLE_EVERY = 250
DAY_S = 24 * 3600.0
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


def resources() -> dict:
    return {"rss_mib": rss_mib(), "open_files": len(os.listdir("/proc/self/fd")),
            "threads": threading.active_count(), "tasks": len(asyncio.all_tasks())}


class OneTurnEnv(AsyncEnvironment):
    num_tasks = NUM_TASKS

    def __init__(self, rng):
        self.rng = rng

    async def reset(self, task_id):
        self.task = task_id
        return f"task {task_id}"

    async def step(self, action_text):
        success = self.rng.random() < (self.task + 1) / (NUM_TASKS + 1)
        return StepResult("done", float(success), True)


class BoundedEngine(FakeEngine):
    """The scripted engine without its per-request log (a test aid that grows by design)."""

    async def generate(self, prompt_ids, params):
        result = await super().generate(prompt_ids, params)
        self.records.clear()
        return result


def simulate(chat, num_updates: int, keep_records: bool):
    rng = np.random.default_rng(0)
    stop = chat.stop_token_ids[0]
    ok = chat.tokenizer.convert_tokens_to_ids("o")
    engine = BoundedEngine(lambda r: ScriptedReply((ok, ok, stop), latency=LATENCY_S * (0.5 + (r.index % 7) / 7)))
    samples, loop_times = [], []

    def on_update(record):
        if record.update % SAMPLE_EVERY == 0:
            samples.append((record.update, resources()))
            loop_times.append(asyncio.get_running_loop().time())

    def learner(learner_input):
        return LearnerOutput(weights=None, metrics={"loss": 0.0})

    config = OrchestratorConfig(batch_size=BATCH, max_in_flight=IN_FLIGHT, seed=0, keep_history=keep_records,
                                drain="finish", pad_to_multiple=64)
    agent = AgentConfig(max_turns=1, max_total_tokens=64, sampling=SamplingParams(max_new_tokens=4))
    orchestrator = Orchestrator(engine, lambda: OneTurnEnv(rng), chat, learner, NUM_TASKS, config,
                                agent, on_update=on_update)

    async def main():
        try:
            await orchestrator.run(num_updates)
        finally:
            await orchestrator.close()

    run_virtual(main())
    return orchestrator, samples, loop_times


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(["task 0123456789 done o"] * 20, tmp_path_factory.mktemp("tok"), 300)
    return ChatFormat.from_tokenizer(tokenizer)


def check_flat(samples, rss_slack_mib: float) -> dict:
    warm = [s for update, s in samples[1:]]      # the first sample is the warm-up
    spread = {k: max(s[k] for s in warm) - min(s[k] for s in warm) for k in warm[0]}
    assert spread["open_files"] == 0, samples
    assert spread["threads"] == 0, samples
    assert spread["tasks"] <= IN_FLIGHT, samples   # in-flight episodes come and go
    assert spread["rss_mib"] <= rss_slack_mib, samples
    return spread


@covers(Row("long run", "a simulated 24-hour run: 3,500 updates (virtual clock, scripted engine, "
            "real orchestrator / agent / tracker)", "runs to the end",
            "RSS, open files, threads, event-loop tasks flat after warm-up (RSS within 40 MiB) "
            "with `keep_history=False` (what train.py sets)",
            kind="fault"))
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_simulated_day_is_flat(chat, capsys):
    orchestrator, samples, loop_times = simulate(chat, 3500, keep_records=False)
    assert orchestrator.updates == 3500
    assert loop_times[-1] >= DAY_S, f"simulated {loop_times[-1] / 3600:.1f} h, wanted >= 24 h"
    spread = check_flat(samples, rss_slack_mib=40.0)
    with capsys.disabled():
        print(f"\nsimulated {loop_times[-1] / 3600:.1f} h, {orchestrator.updates} updates; "
              f"spread after warm-up {spread}; samples {samples}; "
              f"load average {os.getloadavg()}")


@covers(Row("long run", "the orchestrator's `records` and `events` lists over a long run",
            "kept only with `keep_history=True` (the library default, for tests and analysis); "
            "train.py sets False and records stream to the metric sinks (orchestrator v2)",
            "with keep_history=False both stay empty over the run; with True they hold one "
            "record per update and >= 2 events per consumed trajectory", kind="fault"))
def test_update_records_are_bounded_when_history_is_off(chat):
    orchestrator, _, _ = simulate(chat, 20, keep_records=False)
    assert orchestrator.updates == 20
    assert len(orchestrator.records) == 0 and len(orchestrator.events) == 0
    orchestrator, _, _ = simulate(chat, 20, keep_records=True)
    assert len(orchestrator.records) == orchestrator.updates == 20
    assert len(orchestrator.events) >= 2 * 20 * BATCH
