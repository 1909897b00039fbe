"""In-flight publish on the vLLM engines without vLLM (SPEC 3, "Publishing without a drain").

Fleet: fake servers in the pattern of tests/test_vllm_bridge.py (``httpx.MockTransport``)
that also speak ``/openapi.json``, ``POST /pause?mode=keep`` and ``POST /resume``: a paused
server stops producing tokens, each token records the event the server held when it was
produced, so a request that spans the publish visibly holds tokens of both events.
In-process: a fake ``AsyncLLM`` with the pause/resume/RPC surface (generation itself
needs vLLM and is covered by tests/integration/test_vllm_cpu.py when that venv exists).

NOT run here: a real vLLM server or AsyncLLM doing pause "keep" -> load -> resume.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from rollout_bridge.engine.base import GenerationResult, SamplingParams
from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig, VllmInProcessEngine, keeps_requests_on_pause
from rollout_bridge.engine.vllm_weights import publish_folder
from test_vllm_bridge import FakeFleet, FakeServer

STEP_S = 0.01
TOKEN_OF_EVENT = 100  # a token produced under event k is TOKEN_OF_EVENT + k


class KeepPauseServer(FakeServer):
    """A FakeServer that decodes token by token and supports pause "keep" when
    ``keep`` (else its /openapi.json shows the old /pause, which would abort)."""

    def __init__(self, url, keep=True):
        super().__init__(url)
        self.keep = keep
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.log: list[str] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/openapi.json":
            name = "mode" if self.keep else "wait_for_inflight_requests"
            return httpx.Response(200, json={"paths": {"/pause": {"post": {"parameters": [{"name": name}]}}}})
        if path == "/pause":
            assert self.keep and request.url.params["mode"] == "keep", "would abort in-flight requests"
            self.resumed.clear()
            self.log.append("pause")
            return httpx.Response(200, json={"status": "paused"})
        if path == "/resume":
            self.resumed.set()
            self.log.append("resume")
            return httpx.Response(200, json={"status": "resumed"})
        if path == "/collective_rpc" and json.loads(request.content)["method"] == "spopp_load_policy":
            self.log.append("load while paused" if not self.resumed.is_set() else "load")
        if path == "/v1/completions":
            return await self.decode(json.loads(request.content))
        return await super().handle(request)

    async def decode(self, body):
        self.in_flight += 1
        tokens = []
        try:
            for _ in range(body["max_tokens"]):
                await self.resumed.wait()
                await asyncio.sleep(STEP_S)
                tokens.append(TOKEN_OF_EVENT + self.held_event)
        finally:
            self.in_flight -= 1
        self.completions += 1
        return httpx.Response(200, json={"choices": [{
            "token_ids": tokens, "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5] * len(tokens), "tokens": [f"token_id:{t}" for t in tokens]}}]})


async def wait_for(predicate, timeout_s: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


def run_fleet_publish(tmp_path, keep: bool):
    server = KeepPauseServer("http://10.0.0.1:8000", keep=keep)
    fleet = FakeFleet([server])
    folder = publish_folder(tmp_path, 1, lambda tmp: None)

    async def body():
        engine = fleet.engine(tmp_path)
        await engine.start()
        request = asyncio.ensure_future(engine.generate([1], SamplingParams(max_new_tokens=40)))
        await wait_for(lambda: engine.server_states()[0][3] == 1)
        await asyncio.sleep(10 * STEP_S)  # some tokens on the old weights
        await engine.publish_inflight(folder, 1)
        done_at_publish = request.done()
        result = await request
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return result, done_at_publish, states, stats

    return server, folder, asyncio.run(body())


def test_fleet_inflight_publish_keeps_requests_running_across_the_reload(tmp_path):
    server, folder, (result, done_at_publish, states, stats) = run_fleet_publish(tmp_path, keep=True)
    assert not done_at_publish, "publish_inflight must not wait for the request"
    assert server.log == ["pause", "load while paused", "resume"]
    assert server.loads == [(folder, 1)]
    assert result.finish_reason == "length" and len(result.token_ids) == 40
    produced = set(result.token_ids)
    assert produced == {TOKEN_OF_EVENT, TOKEN_OF_EVENT + 1}  # tokens of both events, none aborted
    assert result.policy_event == 0 and result.last_policy_event == 1 and result.event_span == (0, 1)
    assert states[0][1:3] == ("ready", 1)
    assert stats.inflight_updates == 1 and stats.drained_fallbacks == 0 and stats.aborted == 0


def test_fleet_falls_back_to_a_drain_on_vllm_without_keep_pause(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="rollout_bridge.engine.vllm_fleet"):
        server, folder, (result, done_at_publish, states, stats) = run_fleet_publish(tmp_path, keep=False)
    assert done_at_publish, "the drained fallback waits for the old-policy request"
    assert "pause" not in server.log and server.loads == [(folder, 1)]
    assert set(result.token_ids) == {TOKEN_OF_EVENT} and result.event_span == (0, 0)
    assert stats.drained_fallbacks == 1 and stats.inflight_updates == 0
    assert "without /pause?mode=keep" in caplog.text


def test_last_policy_event_is_checked():
    with pytest.raises(ValueError, match="last_policy_event"):
        GenerationResult((1,), (-0.1,), "stop", 3, last_policy_event=2)
    with pytest.raises(ValueError, match="not both"):
        GenerationResult((1,), (-0.1,), "stop", 3, token_policy_events=(3,), last_policy_event=4)


# ------------------------------------------------------------------ in-process engine


class FakeAsyncLLM:
    """The AsyncLLM surface publish uses: collective_rpc, pause/resume, prefix cache."""

    def __init__(self, keep: bool):
        self.event = -1
        self.paused = False
        self.log: list[str] = []
        if keep:
            self.pause_generation = self._pause_keep
        else:
            self.pause_generation = self._pause_old

    async def _pause_keep(self, *, mode: str = "abort", clear_cache: bool = True):
        assert mode == "keep"
        self.paused = True
        self.log.append("pause keep")

    async def _pause_old(self, *, wait_for_inflight_requests: bool = False, clear_cache: bool = True):
        raise AssertionError("an old vLLM pause aborts or drains: must not be called")

    async def resume_generation(self):
        self.paused = False
        self.log.append("resume")

    async def reset_prefix_cache(self):
        return "pause keep" not in self.log  # after a keep-pause, kept requests hold blocks

    async def collective_rpc(self, method, args=()):
        if method == "spopp_load_policy":
            self.log.append("load while paused" if self.paused else "load")
            self.event = int(args[1])
        elif method == "spopp_set_policy_event":
            self.event = int(args[0])
        return [str(self.event)]

    async def abort(self, ids):
        return None


def test_inprocess_inflight_publish_pauses_keep_loads_and_resumes(tmp_path):
    folder = publish_folder(tmp_path, 1, lambda tmp: None)
    llm = FakeAsyncLLM(keep=True)
    engine = VllmInProcessEngine(VllmInProcessConfig(model=str(tmp_path)), llm)
    assert keeps_requests_on_pause(llm) and engine.supports_inflight_publish
    asyncio.run(engine.publish_inflight(folder, 1))
    assert llm.log == ["pause keep", "load while paused", "resume"]
    assert engine.policy_event == 1 and llm.event == 1


def test_inprocess_falls_back_to_a_drained_publish_with_a_warning(tmp_path, caplog):
    folder = publish_folder(tmp_path, 1, lambda tmp: None)
    llm = FakeAsyncLLM(keep=False)
    engine = VllmInProcessEngine(VllmInProcessConfig(model=str(tmp_path)), llm)
    assert not keeps_requests_on_pause(llm) and not engine.supports_inflight_publish
    with caplog.at_level(logging.WARNING, logger="rollout_bridge.engine.vllm_inprocess"):
        asyncio.run(engine.publish_inflight(folder, 1))
    assert "with a drain" in caplog.text
    assert llm.log == ["load"] and engine.policy_event == 1
