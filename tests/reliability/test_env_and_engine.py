"""Malformed environment outputs and engine (vLLM server) responses: each ends as a recorded
failed trajectory, a retry, or a clear error; never a crash of the run.

The agent is driven by the scripted `FakeEngine` under the virtual clock (`run_virtual`);
the server fleet by the in-memory vLLM fake of tests/test_vllm_bridge.py (reused, not
copied)."""

from __future__ import annotations

import asyncio
import json
import math
import sys
from pathlib import Path

import httpx
import pytest
from reliability_table import Row, covers

from rollout_bridge.agent import AgentConfig, ChatFormat, run_episode
from rollout_bridge.engine.base import GenerationResult, SamplingParams
from rollout_bridge.engine.fake import FakeEngine, ScriptedReply, run_virtual
from rollout_bridge.engine.vllm_fleet import FleetUnavailableError
from rollout_bridge.envs.base import AsyncEnvironment, Environment, StepResult
from rollout_bridge.tokenizer import build_tiny_tokenizer
from rollout_bridge.trajectory import DispatchStamp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_envs import SlowStepEnv  # noqa: E402  (a step that takes real time)
from test_vllm_bridge import FakeFleet, FakeServer, _choice  # noqa: E402  (shared fake fleet)

CORPUS = ["the room has a door and a key, open the door, take the key"] * 20
MAX_TOKENS = 256


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    tokenizer = build_tiny_tokenizer(CORPUS, tmp_path_factory.mktemp("tok"), vocab_size=300)
    return ChatFormat.from_tokenizer(tokenizer)


def one_word_engine(chat) -> FakeEngine:
    word = chat.encode("open")
    return FakeEngine(lambda r: ScriptedReply(tuple(word) + (chat.stop_token_ids[0],), latency=1.0))


class ScriptedEnv(Environment):
    """reset -> ``first``; step -> ``steps`` in turn (a callable is called, an exception raised)."""

    num_tasks = 4

    def __init__(self, first, *steps, close_error=None):
        self.first, self.steps, self.close_error = first, list(steps), close_error

    def _out(self, value):
        value = value() if callable(value) else value
        if isinstance(value, BaseException):
            raise value
        return value

    def reset(self, task_id):
        return self._out(self.first)

    def step(self, action_text):
        return self._out(self.steps.pop(0))

    def close(self):
        if self.close_error is not None:
            raise self.close_error


def play(chat, env, engine=None, **config):
    stamp = DispatchStamp(request_id=0, task_id=1, policy_event=0, z=0.5, frozen_baseline=0.5,
                          dispatch_time=0.0)
    config = AgentConfig(max_turns=3, max_total_tokens=MAX_TOKENS, env_timeout_s=30.0,
                         sampling=SamplingParams(max_new_tokens=8), **config)
    return run_virtual(run_episode(engine or one_word_engine(chat), env, chat, stamp, config))


# ------------------------------------------------------------------ environment outputs


@covers(Row("environment output", "env.reset raises (e.g. the game engine crashed)",
            "trajectory `failed`, reward 0, `error` = 'RuntimeError: ...'; the run continues",
            "not trained on (train_on_failed=False), not tracker evidence"))
def test_env_reset_exception_is_a_failed_trajectory(chat):
    traj = play(chat, ScriptedEnv(RuntimeError("game crashed")))
    assert traj.failed and not traj.usable and traj.reward == 0.0
    assert traj.error == "RuntimeError: game crashed"


@covers(Row("environment output", "env.step raises mid-episode",
            "trajectory `failed` with the exception text; the reply so far kept for inspection",
            "reward 0, not usable"))
def test_env_step_exception_is_a_failed_trajectory(chat):
    traj = play(chat, ScriptedEnv("a room", ValueError("bad command parser")))
    assert traj.failed and traj.error == "ValueError: bad command parser"
    assert traj.num_action_tokens > 0


@covers(Row("environment output", "env.step hangs forever",
            "`env_timeout_s` ends the episode `failed`: 'environment timed out after 30.0s'",
            "the hung env is not closed (it may still be busy); the episode returns", kind="fault"))
def test_env_hang_times_out(chat):
    class AsyncHanging(AsyncEnvironment):
        num_tasks = 4

        async def reset(self, task_id):
            return "a room"

        async def step(self, action_text):
            await asyncio.Event().wait()   # never set: hangs forever

    traj = play(chat, AsyncHanging())
    assert traj.failed and traj.error == "environment timed out after 30.0s"
    assert traj.env_latencies[-1] == 30.0


@covers(Row("environment output", "non-string observation from reset (an int)",
            "trajectory `failed`: 'TypeError: observation must be str, got int'",
            "reward 0, nothing trained on"),
        Row("environment output", "non-string observation from step (a dict)",
            "trajectory `failed`: 'TypeError: observation must be str, got dict'",
            "reward 0, nothing trained on"))
@pytest.mark.parametrize("where", ["reset", "step"])
def test_non_string_observation_is_a_failed_trajectory(chat, where):
    if where == "reset":
        env = ScriptedEnv(12345)
    else:
        env = ScriptedEnv("a room", StepResult({"text": "a room"}, 0.0, False))
    traj = play(chat, env)
    assert traj.failed and traj.reward == 0.0
    kind = "int" if where == "reset" else "dict"
    assert traj.error == f"TypeError: observation must be str, got {kind}"


@covers(Row("environment output", "absurdly long observation (1 MB of text) from reset",
            "trajectory `failed`: 'observation of N tokens does not fit max_total_tokens=256'",
            "no over-long row reaches the learner (its [B, T] shape stays fixed)"),
        Row("environment output", "absurdly long observation (1 MB) from a later step",
            "episode `truncated` at the token budget, the long text is never appended",
            "trajectory length <= max_total_tokens"))
@pytest.mark.parametrize("where", ["reset", "step"])
def test_absurdly_long_observation(chat, where):
    huge = "open the door " * 75_000   # ~1 MB
    env = ScriptedEnv(huge) if where == "reset" else ScriptedEnv("a room", StepResult(huge, 0.0, False))
    traj = play(chat, env)
    assert len(traj.token_ids) <= MAX_TOKENS
    if where == "reset":
        assert traj.failed and "does not fit max_total_tokens=256" in traj.error
    else:
        assert traj.truncated and not traj.failed and traj.num_action_tokens > 0


@covers(Row("environment output", "non-binary reward (0.5) on the final step",
            "trajectory `failed`: 'non-binary reward 0.5', reward set to 0",
            "never reaches the tracker as evidence"))
def test_non_binary_reward_is_a_failed_trajectory(chat):
    traj = play(chat, ScriptedEnv("a room", StepResult("done", 0.5, True)))
    assert traj.failed and traj.reward == 0.0 and traj.error == "non-binary reward 0.5"


@covers(Row("environment output", "env.close raises after a won episode",
            "ignored: the trajectory keeps its reward", "reward 1, usable"))
def test_env_close_error_keeps_the_trajectory(chat):
    env = ScriptedEnv("a room", StepResult("won", 1.0, True), close_error=OSError("socket gone"))
    traj = play(chat, env)
    assert traj.usable and traj.reward == 1.0


@covers(Row("environment output", "an episode aborted (lag bound, drain abort, end of RL) while its env.step runs in a worker thread",
            "the close its cancellation asks for waits until the step returns (calls to one env are serialized)",
            "the env is never closed under a running step: a TextWorld game's interpreter unloaded under it crashes the process (segfault)"))
def test_an_aborted_episode_closes_its_env_only_after_the_running_step(chat):
    raw = SlowStepEnv()  # its step takes 0.3 s of real time in its thread

    async def main():
        engine = one_word_engine(chat)
        stamp = DispatchStamp(request_id=0, task_id=0, policy_event=0, z=0.0, frozen_baseline=0.5, dispatch_time=0.0)
        episode = asyncio.ensure_future(run_episode(engine, raw, chat, stamp, AgentConfig(max_total_tokens=MAX_TOKENS)))
        await asyncio.to_thread(raw.stepping.wait)
        episode.cancel()  # the orchestrator aborts it; asyncio cannot stop the step's thread
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(main())
    assert raw.events == ["step done", "close"]


# ------------------------------------------------------------------ engine responses


class ScriptedServer(FakeServer):
    """A fake vLLM server whose /v1/completions answers come from ``replies`` first."""

    def __init__(self, url, replies):
        super().__init__(url)
        self.replies = list(replies)

    async def handle(self, request):
        if request.url.path == "/v1/completions" and self.replies:
            self.completions += 1
            return self.replies.pop(0)
        return await super().handle(request)


def fleet_generate(tmp_path, replies, **overrides):
    server = ScriptedServer("http://10.0.0.1:8000", replies)
    fleet = FakeFleet([server])

    async def run():
        engine = fleet.engine(tmp_path, **overrides)
        try:
            return await engine.generate([1, 2], SamplingParams(max_new_tokens=2)), engine.stats
        finally:
            await engine.close()

    return asyncio.run(run())


GOOD = httpx.Response(200, json=_choice([7, 7], [-0.5, -0.5], "length"))


@covers(Row("engine response", "HTTP 500 from the server",
            "retried after a backoff on a server that passes its health probe",
            "the retry's tokens are returned; stats.retries = 1, no server lost", kind="fault"))
def test_http_500_is_retried(tmp_path):
    result, stats = fleet_generate(tmp_path, [httpx.Response(500, text="internal"), GOOD])
    assert result.token_ids == (7, 7) and stats.retries == 1 and stats.servers_lost == 0


@covers(Row("engine response", "malformed JSON body",
            "retried; after max_attempts FleetUnavailableError naming the JSON error",
            "the agent records a failed trajectory; no tokens invented"))
def test_malformed_json_is_retried_then_named(tmp_path):
    bad = [httpx.Response(200, content=b"{not json") for _ in range(3)]
    with pytest.raises(FleetUnavailableError, match="JSONDecodeError"):
        fleet_generate(tmp_path, bad, max_attempts=3)
    result, stats = fleet_generate(tmp_path, [httpx.Response(200, content=b"{not json"), GOOD])
    assert result.token_ids == (7, 7) and stats.retries == 1


@covers(Row("engine response", "wrong token count (3 token ids, 2 log-probs)",
            "refused: FleetUnavailableError '3 tokens but 2 log-probs' after the retries",
            "no misaligned log-probs reach a trajectory"))
def test_wrong_token_count_is_refused(tmp_path):
    bad = [httpx.Response(200, json=_choice([1, 2, 3], [-0.1, -0.2], "stop")) for _ in range(2)]
    with pytest.raises(FleetUnavailableError, match="3 tokens but 2 log-probs"):
        fleet_generate(tmp_path, bad, max_attempts=2)


@covers(Row("engine response", "NaN / inf log-prob in a completion",
            "refused: 'non-finite log-prob nan at position 1', retried, then FleetUnavailableError",
            "a NaN never enters rollout_logp (and the learner guard would skip it anyway)"))
def test_nan_logprob_is_refused(tmp_path):
    body = json.dumps(_choice([1, 2], [-0.1, 0.0], "stop")).replace("0.0]", "NaN]")
    bad = [httpx.Response(200, content=body.encode()) for _ in range(2)]
    with pytest.raises(FleetUnavailableError, match="non-finite log-prob nan at position 1"):
        fleet_generate(tmp_path, bad, max_attempts=2)


@covers(Row("engine response", "a server confirming another policy event than it was sent",
            "the server never joins (stays dead): no request is served by unknown weights",
            "FleetUnavailableError when it is the only server; results only ever carry the "
            "fleet's event"))
def test_server_reporting_another_policy_event_never_serves(tmp_path):
    class Liar(FakeServer):
        async def handle(self, request):
            if request.url.path == "/collective_rpc":
                return httpx.Response(200, json={"results": ["41"]})
            return await super().handle(request)

    fleet = FakeFleet([Liar("http://10.0.0.1:8000")])

    async def run():
        engine = fleet.engine(tmp_path, dispatch_wait_s=0.2)
        try:
            with pytest.raises(FleetUnavailableError):
                await engine.generate([1], SamplingParams(max_new_tokens=2))
            return engine.server_states()
        finally:
            await engine.close()

    states = asyncio.run(run())
    assert states[0][1] != "ready"


@covers(Row("engine response", "an engine result with unequal token/log-prob lengths or an "
            "unknown finish reason", "ValueError naming both lengths / the reason at construction",
            "checked for every backend by GenerationResult itself"))
def test_generation_result_validates():
    with pytest.raises(ValueError, match="equal length, got 2 and 1"):
        GenerationResult((1, 2), (-0.1,), "stop", 0)
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult((1,), (-0.1,), "eos", 0)
    assert math.isfinite(GenerationResult((1,), (-0.1,), "stop", 0).logprobs[0])


@covers(Row("engine response", "rollout server dies mid-request, comes back later",
            "requests re-dispatched to the live server; the dead one rejoins after it loads "
            "and confirms the current policy",
            "every request answered, no result from stale weights", kind="fault"))
def test_server_dies_and_comes_back(tmp_path):
    first, second = FakeServer("http://10.0.0.1:8000", latency=0.05), FakeServer(
        "http://10.0.0.2:8000", latency=0.05)
    fleet = FakeFleet([first, second])

    async def run():
        engine = fleet.engine(tmp_path)
        await engine.start()
        tasks = [asyncio.ensure_future(engine.generate([1], SamplingParams(max_new_tokens=2)))
                 for _ in range(4)]
        await asyncio.sleep(0.01)
        first.alive = False
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        first.alive = True
        for _ in range(300):
            if engine.server_states()[0][1] == "ready":
                break
            await asyncio.sleep(0.01)
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return results, states, stats

    results, states, stats = asyncio.run(run())
    assert len(results) == 4 and all(r.policy_event == 0 for r in results)
    assert states[0][1] == "ready" and stats.servers_rejoined == 1 and stats.failed == 0
