"""Environment interface and the synthetic multi-turn environment."""

import asyncio
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_bridge.engine.fake import run_virtual
from rollout_bridge.envs import Environment, StepResult, ThreadedEnvironment, as_async, check_task_id
from rollout_bridge.envs.synthetic import (
    AsyncSyntheticEnv,
    EnvFault,
    SyntheticEnv,
    first_word,
    make_task,
)


def _target(observation: str) -> str:
    return observation.rsplit("say:", 1)[1].strip()


def _play(env, task_id, answers=None):
    """Play with the right answer each round (or the scripted ``answers``)."""
    observation = env.reset(task_id)
    observations, rounds = [observation], 0
    while True:
        reply = answers[rounds] if answers else _target(observation)
        result = env.step(reply)
        rounds += 1
        observations.append(result.observation)
        if result.done:
            return result, rounds, observations
        observation = result.observation


@given(task_id=st.integers(0, 63), seed=st.integers(0, 5), max_turns=st.integers(1, 5))
@settings(max_examples=40, deadline=None)
def test_correct_replies_succeed_after_task_specific_number_of_rounds(task_id, seed, max_turns):
    env = SyntheticEnv(num_tasks=64, seed=seed, max_turns=max_turns)
    result, rounds, _ = _play(env, task_id)
    assert result == StepResult("Correct. Done.", 1.0, True)
    assert rounds == 1 + task_id % max_turns
    assert 1 <= rounds <= max_turns


def test_wrong_reply_ends_with_zero_reward():
    env = SyntheticEnv(num_tasks=8, max_turns=3)
    task = make_task(2, max_turns=3)
    result, rounds, _ = _play(env, 2, answers=[task.words[0], "zebra"])
    assert (result.reward, result.done, rounds) == (0.0, True, 2)


def test_success_rule_is_first_word_case_and_punctuation_insensitive():
    assert first_word("  Apple! and more") == "apple"
    assert first_word("...") == ""
    env = SyntheticEnv(num_tasks=4, max_turns=1)
    word = make_task(0, max_turns=1).words[0]
    env.reset(0)
    assert env.step(f"**{word.upper()}**, I think").reward == 1.0


def test_tasks_are_stable_and_lengths_vary():
    env_a, env_b = SyntheticEnv(num_tasks=32, seed=3), SyntheticEnv(num_tasks=32, seed=3)
    assert [env_a.reset(t) for t in range(32)] == [env_b.reset(t) for t in range(32)]
    rounds = {len(make_task(t, seed=3).words) for t in range(32)}
    sizes = {len(SyntheticEnv(num_tasks=32, seed=3).reset(t)) for t in range(32)}
    assert rounds == {1, 2, 3}
    assert len(sizes) > 5


def test_invalid_task_ids_are_rejected():
    env = SyntheticEnv(num_tasks=4)
    for bad in (-1, 4, 1.5, True):
        with pytest.raises(ValueError, match="task_id"):
            env.reset(bad)
    assert check_task_id(3, 4) == 3
    with pytest.raises(RuntimeError, match="before reset"):
        SyntheticEnv(num_tasks=4).step("apple")


def test_fault_injection_raises_on_the_scripted_call():
    env = SyntheticEnv(num_tasks=8, max_turns=3, fault=lambda task, call: task == 2 and call == 2)
    task = make_task(2, max_turns=3)
    env.reset(2)
    env.step(task.words[0])
    with pytest.raises(EnvFault, match="task 2, call 2"):
        env.step(task.words[1])
    assert _play(env, 1)[0].reward == 1.0  # other tasks unaffected


def test_async_env_latency_is_scripted_in_virtual_time():
    env = AsyncSyntheticEnv(num_tasks=8, max_turns=2, latency=lambda task, call: 10.0 * (call + 1))

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        observation = await env.reset(1)
        await env.step(_target(observation))
        return loop.time() - start

    assert run_virtual(main()) == pytest.approx(10.0 + 20.0)


def test_sync_env_runs_off_the_event_loop_thread():
    threads = []

    class Recording(Environment):
        num_tasks = 2

        def reset(self, task_id):
            threads.append(threading.get_ident())
            return "obs"

        def step(self, action_text):
            threads.append(threading.get_ident())
            return StepResult("end", 1.0, True)

    wrapped = as_async(Recording())
    assert isinstance(wrapped, ThreadedEnvironment) and wrapped.num_tasks == 2

    async def main():
        return await wrapped.reset(0), await wrapped.step("x"), threading.get_ident()

    obs, step, loop_thread = asyncio.run(main())
    assert (obs, step) == ("obs", StepResult("end", 1.0, True))
    assert threads and all(t != loop_thread for t in threads)
    async_env = AsyncSyntheticEnv(num_tasks=2)
    assert as_async(async_env) is async_env
    with pytest.raises(TypeError):
        as_async(object())


class SlowStepEnv(Environment):
    """Records whether ``close`` ever ran while a ``step`` was still inside the env (what
    crashed TextWorld: its interpreter unloaded under a running step)."""

    num_tasks = 1

    def __init__(self):
        self.stepping = threading.Event()
        self.inside_step = False
        self.events: list[str] = []

    def reset(self, task_id):
        return "obs"

    def step(self, action_text):
        self.inside_step = True
        self.stepping.set()
        time.sleep(0.3)
        self.events.append("step done")
        self.inside_step = False
        return StepResult("next", 0.0, False)

    def close(self):
        self.events.append("close during step" if self.inside_step else "close")


def test_a_cancelled_step_finishes_before_the_close_its_cancellation_asks_for():
    raw = SlowStepEnv()
    env = as_async(raw)

    async def main():
        step = asyncio.ensure_future(env.step("x"))
        await asyncio.to_thread(raw.stepping.wait)  # the step is running in its thread
        step.cancel()  # the orchestrator aborts the episode; the thread goes on
        with pytest.raises(asyncio.CancelledError):
            await step
        await env.close()  # what run_episode's cancellation handler does

    asyncio.run(main())
    assert raw.events == ["step done", "close"]
