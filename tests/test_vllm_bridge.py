"""vLLM bridge logic without vLLM: request mapping, dispatch, failover, publish, folders.

The servers are simulated with ``httpx.MockTransport`` (an in-memory fake of the vLLM
endpoints the fleet uses); the real-vLLM checks live in tests/integration/test_vllm_cpu.py.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.vllm_fleet import (
    FleetUnavailableError,
    VllmFleetConfig,
    VllmFleetEngine,
    VllmRequestError,
    VllmServerSpec,
    backoff_delay,
    completion_body,
    least_loaded,
    parse_completion,
    rpc_agreed_int,
)
from rollout_bridge.engine.vllm_inprocess import (
    check_prompt_ids,
    check_vllm_logprob_semantics,
    sampled_logprobs,
    vllm_sampling_kwargs,
    vllm_top_k,
)
from rollout_bridge.engine.vllm_weights import (
    folder_policy_event,
    policy_folder_name,
    prune_policy_folders,
    publish_folder,
    published_events,
)
from rollout_bridge.engine.vllm_worker_ext import POLICY_MARKER, SpoppWorkerExtension

# ------------------------------------------------------------------ pure helpers


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 16)), min_size=1, max_size=8))
def test_least_loaded_picks_the_smallest_load_ratio(loads):
    chosen = least_loaded(loads)
    ratios = [f / c for f, c in loads]
    assert ratios[chosen] == min(ratios)
    assert chosen == ratios.index(min(ratios))  # first on ties


def test_least_loaded_prefers_free_capacity_over_raw_count():
    # 3 of 8 busy (0.375) beats 1 of 2 busy (0.5): bigger GPUs take more work.
    assert least_loaded([(1, 2), (3, 8)]) == 1
    assert least_loaded([]) is None
    with pytest.raises(ValueError, match="capacity"):
        least_loaded([(0, 0)])


def test_backoff_doubles_and_caps():
    assert [backoff_delay(a, 0.25, 1.0) for a in (1, 2, 3, 4)] == [0.25, 0.5, 1.0, 1.0]
    with pytest.raises(ValueError, match="attempt"):
        backoff_delay(0, 0.25, 1.0)


def test_completion_body_maps_sampling_exactly():
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=7, stop_token_ids=(5, 9))
    body = completion_body([3, 1, 4], params, "policy", "req-1")
    assert body["prompt"] == [3, 1, 4]  # token ids, never text
    assert (body["temperature"], body["top_p"], body["top_k"], body["max_tokens"]) == (1.0, 1.0, 0, 7)
    assert body["stop_token_ids"] == [5, 9] and body["ignore_eos"] is True
    assert body["logprobs"] == 0 and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert (body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"], body["min_p"]) == (
        1.0, 0.0, 0.0, 0.0)
    assert body["request_id"] == "req-1" and body["n"] == 1
    assert "seed" not in body  # unseeded: the server draws


def test_a_seeded_request_passes_its_seed_to_vllm():
    params = SamplingParams(seed=2**40 + 3)
    assert completion_body([1], params, "m", "r")["seed"] == 2**40 + 3
    assert vllm_sampling_kwargs(params)["seed"] == 2**40 + 3
    assert vllm_sampling_kwargs(SamplingParams())["seed"] is None
    for bad in (-1, 2**63, 1.5, True):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=bad)


def test_vllm_sampling_kwargs_match_the_http_mapping():
    params = SamplingParams(top_k=20, top_p=0.9, max_new_tokens=3, stop_token_ids=(2,))
    kwargs = vllm_sampling_kwargs(params)
    body = completion_body([1], params, "m", "r")
    for key, http_key in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                          ("max_tokens", "max_tokens"), ("stop_token_ids", "stop_token_ids"),
                          ("ignore_eos", "ignore_eos"), ("logprobs", "logprobs")):
        assert kwargs[key] == body[http_key]
    assert vllm_top_k(-1) == 0 and vllm_top_k(5) == 5
    with pytest.raises(ValueError, match="top_k"):
        vllm_top_k(0)


def test_logprob_semantics_guard():
    check_vllm_logprob_semantics(SamplingParams(), "raw_logprobs")
    with pytest.raises(ValueError, match="temperature"):
        check_vllm_logprob_semantics(SamplingParams(temperature=0.7), "raw_logprobs")
    check_vllm_logprob_semantics(SamplingParams(temperature=0.7), "processed_logprobs")
    with pytest.raises(ValueError, match="top-k/top-p"):
        check_vllm_logprob_semantics(SamplingParams(temperature=0.7, top_p=0.9), "processed_logprobs")
    with pytest.raises(ValueError, match="logprobs_mode"):
        check_vllm_logprob_semantics(SamplingParams(), "raw_logits")


def test_prompt_ids_must_be_token_ids():
    check_prompt_ids([0, 5, 7])
    for bad, match in (("hello", "not text"), ([], "empty"), ([1, -2], ">= 0"), ([1.5], ">= 0")):
        with pytest.raises(ValueError, match=match):
            check_prompt_ids(bad)


def _choice(token_ids, logprobs, finish="length"):
    return {"choices": [{"token_ids": token_ids, "finish_reason": finish,
                         "logprobs": {"token_logprobs": logprobs, "tokens": [f"token_id:{t}" for t in token_ids]}}]}


def test_parse_completion_reads_ids_logprobs_and_reason():
    assert parse_completion(_choice([4, 2], [-0.5, -1.25], "stop")) == ((4, 2), (-0.5, -1.25), "stop")
    with pytest.raises(ValueError, match="log-probs"):
        parse_completion(_choice([4, 2], [-0.5]))
    bad = _choice([4, 2], [-0.5, -1.0])
    bad["choices"][0]["logprobs"]["tokens"] = ["token_id:4", "token_id:3"]
    with pytest.raises(ValueError, match="disagree"):
        parse_completion(bad)
    with pytest.raises(ValueError, match="finish_reason"):
        parse_completion(_choice([1], [-1.0], "eos"))


def test_rpc_results_must_agree():
    assert rpc_agreed_int({"results": ["3", "3"]}) == 3
    with pytest.raises(ValueError, match="disagree"):
        rpc_agreed_int({"results": ["3", "4"]})
    with pytest.raises(ValueError, match="no results"):
        rpc_agreed_int({"results": []})


def test_sampled_logprobs_picks_each_sampled_token():
    class Logprob:
        def __init__(self, value):
            self.logprob = value

    steps = [{4: Logprob(-0.1), 9: Logprob(-3.0)}, {2: Logprob(-0.7)}]
    assert sampled_logprobs([9, 2], steps) == (-3.0, -0.7)
    with pytest.raises(ValueError):
        sampled_logprobs([9], steps)


# ------------------------------------------------------------------ published folders


def test_publish_folder_is_atomic_and_marked(tmp_path):
    def write(tmp):
        with open(os.path.join(tmp, "model.safetensors"), "wb") as f:
            f.write(b"x")

    folder = publish_folder(tmp_path, 3, write)
    assert os.path.basename(folder) == policy_folder_name(3) == "policy-00000003"
    assert folder_policy_event(folder) == 3 and published_events(tmp_path) == [3]
    with pytest.raises(FileExistsError):
        publish_folder(tmp_path, 3, write)

    def crash(tmp):
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        publish_folder(tmp_path, 4, crash)
    assert sorted(os.listdir(tmp_path)) == ["policy-00000003"]  # no half-written folder left


def test_prune_keeps_newest_and_protected(tmp_path):
    for k in range(6):
        publish_folder(tmp_path, k, lambda tmp: None)
    assert prune_policy_folders(tmp_path, keep=2, protect=[1]) == [0, 2, 3]
    assert published_events(tmp_path) == [1, 4, 5]


def test_worker_extension_refuses_a_mismatched_folder(tmp_path):
    class FakeWorker(SpoppWorkerExtension):
        def __init__(self):
            self.loaded = []

        def reload_weights(self, weights_path, is_checkpoint_format):
            self.loaded.append(weights_path)

    folder = publish_folder(tmp_path, 2, lambda tmp: None)
    worker = FakeWorker()
    assert worker.spopp_policy_event() == -1
    with pytest.raises(ValueError, match="holds policy event 2"):
        worker.spopp_load_policy(folder, "5")
    assert worker.loaded == [] and worker.spopp_policy_event() == -1
    assert worker.spopp_load_policy(folder, "2") == 2
    assert worker.loaded == [folder] and worker.spopp_policy_event() == 2


# ------------------------------------------------------------------ fleet over fake servers


class FakeServer:
    """In-memory stand-in for one vLLM server's endpoints used by the fleet."""

    def __init__(self, url, latency=0.01, token=1):
        self.url, self.latency, self.token = url, latency, token
        self.alive = True
        self.held_event = -1
        self.loads: list[tuple[str, int]] = []
        self.completions = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.prefix_resets = 0
        self.resets_left = 0  # completions that fail with a connection reset while alive

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if not self.alive:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        body = json.loads(request.content) if request.content else {}
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"root": "/nowhere"}]})
        if path == "/collective_rpc":
            method, args = body["method"], body.get("args", [])
            if method == "spopp_policy_event":
                return httpx.Response(200, json={"results": [str(self.held_event)]})
            if method == "spopp_set_policy_event":
                self.held_event = int(args[0])
            elif method == "spopp_load_policy":
                self.loads.append((args[0], int(args[1])))
                self.held_event = int(args[1])
            return httpx.Response(200, json={"results": [str(self.held_event)]})
        if path == "/reset_prefix_cache":
            self.prefix_resets += 1
            return httpx.Response(200, json={"success": True})
        if path in ("/update_weight_version", "/abort_requests"):
            return httpx.Response(200, json={})
        if path == "/v1/completions":
            if max(body["prompt"]) >= 1000:
                return httpx.Response(400, json={"error": "token id out of vocabulary"})
            if self.resets_left:
                self.resets_left -= 1
                raise httpx.ReadError("stale keep-alive connection", request=request)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(self.latency)
                if not self.alive:  # died while the request was running
                    raise httpx.ReadError("connection reset", request=request)
            finally:
                self.in_flight -= 1
            self.completions += 1
            n = body["max_tokens"]
            return httpx.Response(200, json=_choice([self.token] * n, [-0.5] * n, "length"))
        return httpx.Response(404)


class FakeFleet:
    def __init__(self, servers):
        self.servers = {s.url: s for s in servers}

    async def handler(self, request):
        return await self.servers[f"{request.url.scheme}://{request.url.host}:{request.url.port}"].handle(request)

    def engine(self, tmp_path, capacities=None, **overrides):
        urls = list(self.servers)
        capacities = capacities or [4] * len(urls)
        settings = dict(servers=tuple(VllmServerSpec(u, c) for u, c in zip(urls, capacities)),
                        weights_root=str(tmp_path), health_interval_s=0.05, backoff_s=0.001,
                        dispatch_wait_s=5.0)
        settings.update(overrides)
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler))
        return VllmFleetEngine(VllmFleetConfig(**settings), client=client)


def _servers(n, **kwargs):
    return [FakeServer(f"http://10.0.0.{i}:8000", token=i, **kwargs) for i in range(1, n + 1)]


def test_fleet_spreads_requests_by_free_capacity(tmp_path):
    small, big = _servers(2, latency=0.05)
    fleet = FakeFleet([small, big])

    async def run():
        engine = fleet.engine(tmp_path, capacities=[1, 3])
        results = await asyncio.gather(*(engine.generate([1, 2], SamplingParams(max_new_tokens=2)) for _ in range(8)))
        await engine.close()
        return results

    results = asyncio.run(run())
    assert all(r.policy_event == 0 and r.finish_reason == "length" for r in results)
    assert (small.completions, big.completions) == (2, 6)  # in proportion to capacity 1 : 3
    assert small.held_event == big.held_event == 0  # confirmed at start-up


def test_dead_server_requests_are_redispatched(tmp_path):
    first, second = _servers(2, latency=0.05)
    fleet = FakeFleet([first, second])

    async def run():
        engine = fleet.engine(tmp_path)
        await engine.start()
        tasks = [asyncio.ensure_future(engine.generate([1], SamplingParams(max_new_tokens=3))) for _ in range(6)]
        while engine.server_states()[0][3] < 3:
            await asyncio.sleep(0.001)
        first.alive = False  # dies with requests in flight
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return results, states, stats

    results, states, stats = asyncio.run(run())
    assert all(r.token_ids == (2, 2, 2) for r in results)  # all finished on the live server
    assert states[0][1] == "dead" and states[1][1] == "ready"
    assert stats.servers_lost == 1 and stats.retries == 3 and stats.failed == 0


def test_connection_reset_on_a_healthy_server_keeps_it_in_rotation(tmp_path):
    (only,) = _servers(1)
    only.resets_left = 1
    fleet = FakeFleet([only])

    async def run():
        engine = fleet.engine(tmp_path)
        result = await engine.generate([1], SamplingParams(max_new_tokens=2))
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return result, states, stats

    result, states, stats = asyncio.run(run())
    assert result.token_ids == (1, 1) and states[0][1] == "ready"
    assert stats.retries == 1 and stats.servers_lost == 0 and stats.failed == 0


def test_no_live_server_fails_fast_and_client_errors_surface(tmp_path):
    (only,) = _servers(1)
    fleet = FakeFleet([only])

    async def run():
        engine = fleet.engine(tmp_path)
        await engine.start()
        with pytest.raises(VllmRequestError, match="400"):  # our bug, not an outage: no retry
            await engine.generate([5000], SamplingParams())
        assert engine.stats.retries == 0 and engine.server_states()[0][1] == "ready"
        only.alive = False
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(FleetUnavailableError):
            await engine.generate([1], SamplingParams(max_new_tokens=2))
        elapsed = loop.time() - start
        stats = engine.stats
        await engine.close()
        return elapsed, stats

    elapsed, stats = asyncio.run(run())
    assert elapsed < 1.0 and stats.failed == 1 and stats.servers_lost == 1


def test_publish_drains_reloads_confirms_and_stamps_results(tmp_path):
    first, second = _servers(2, latency=0.05)
    fleet = FakeFleet([first, second])
    folder = publish_folder(tmp_path, 1, lambda tmp: None)

    async def run():
        engine = fleet.engine(tmp_path)
        await engine.start()
        old = [asyncio.ensure_future(engine.generate([1], SamplingParams(max_new_tokens=2))) for _ in range(4)]
        while sum(s[3] for s in engine.server_states()) < 4:  # all four dispatched
            await asyncio.sleep(0.001)
        await engine.publish(folder, 1)
        assert all(t.done() for t in old)  # drain "finish": old requests ended before the reload
        new = await engine.generate([1], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="holds policy event 1"):
            await engine.publish(folder, 2)
        await engine.close()
        return [t.result() for t in old], new, engine.server_states()

    old, new, states = asyncio.run(run())
    assert [r.policy_event for r in old] == [0, 0, 0, 0] and new.policy_event == 1
    assert first.loads == [(folder, 1)] and second.loads == [(folder, 1)]
    assert first.prefix_resets == second.prefix_resets == 1
    assert [s[1:3] for s in states] == [("ready", 1), ("ready", 1)]


def test_abort_drain_and_abort_all_return_abort_results(tmp_path):
    (only,) = _servers(1, latency=5.0)
    fleet = FakeFleet([only])
    folder = publish_folder(tmp_path, 1, lambda tmp: None)

    async def run():
        engine = fleet.engine(tmp_path, drain="abort")
        await engine.start()
        loop = asyncio.get_running_loop()

        async def submit_two():
            tasks = [asyncio.ensure_future(engine.generate([1], SamplingParams())) for _ in range(2)]
            while engine.server_states()[0][3] < 2:
                await asyncio.sleep(0.001)
            return tasks

        tasks = await submit_two()
        start = loop.time()
        await engine.publish(folder, 1)  # aborts the old-policy requests instead of waiting 5 s
        aborted = await asyncio.gather(*tasks)
        tasks = await submit_two()
        await engine.abort_all()
        aborted += await asyncio.gather(*tasks)
        elapsed = loop.time() - start
        await engine.close()
        return aborted, elapsed

    aborted, elapsed = asyncio.run(run())
    assert [(r.finish_reason, r.policy_event) for r in aborted] == [("abort", 0)] * 2 + [("abort", 1)] * 2
    assert elapsed < 2.0


def test_dead_server_rejoins_only_at_the_current_policy(tmp_path):
    first, second = _servers(2)
    second.alive = False
    fleet = FakeFleet([first, second])
    folder = publish_folder(tmp_path, 1, lambda tmp: None)

    async def run():
        engine = fleet.engine(tmp_path)
        await engine.start()
        await engine.publish(folder, 1)
        assert [s[1] for s in engine.server_states()] == ["ready", "dead"]
        second.alive = True  # restarted from old weights (held_event -1)
        for _ in range(200):
            if engine.server_states()[1][1] == "ready":
                break
            await asyncio.sleep(0.01)
        states, stats = engine.server_states(), engine.stats
        await engine.close()
        return states, stats

    states, stats = asyncio.run(run())
    assert states[1][1:3] == ("ready", 1)
    assert second.loads == [(folder, 1)] and stats.servers_rejoined == 1


def test_fleet_config_validates():
    with pytest.raises(ValueError, match="servers"):
        VllmFleetConfig(servers=())
    with pytest.raises(ValueError, match="drain"):
        VllmFleetConfig(servers=(VllmServerSpec("http://a:1"),), drain="later")
    with pytest.raises(ValueError, match="url"):
        VllmServerSpec("a:1")
    with pytest.raises(ValueError, match="capacity"):
        VllmServerSpec("http://a:1", capacity=0)


def test_marker_file_name_is_shared(tmp_path):
    folder = publish_folder(tmp_path, 0, lambda tmp: None)
    with open(os.path.join(folder, POLICY_MARKER)) as f:
        assert json.load(f) == {"policy_event": 0}
