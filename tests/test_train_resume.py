"""`python train.py` end to end on a tiny SPO job, `kill -9` mid-run, then `--resume`: the
run continues from the last checkpoint with the same method state (tracker and SPO's
per-task previous responses with their learner log-probs), buffered trajectories, step,
policy event and counters, and the metrics file holds every step exactly once."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tiny_run import tiny_train_args

ROOT = Path(__file__).resolve().parents[1]


def _tiny_job(tmp: Path, steps: int) -> list[str]:
    return [
        sys.executable, str(ROOT / "train.py"), *tiny_train_args(tmp, steps),
        "--progress", "false", "--tensorboard", "false",
        "--optim.learning_rate", "1e-3", "--method", "spo",
        # two batches may be buffered: trajectories finished during a drain wait in the
        # checkpoint for the next update
        "--rollout.max_buffered_batches", "2",
        "--env.heldout_games", "2",
    ]


def _digest(method_state) -> str:
    from rollout_bridge.run_folder import state_digest

    return state_digest(method_state)


def _checkpoint(run: Path, step: int) -> tuple[dict, dict]:
    """(train_state, orchestrator extras) of checkpoint `step`, read as saved (no targets)."""
    import orbax.checkpoint as ocp

    manager = ocp.CheckpointManager(str(run / "checkpoints"))
    try:
        items = manager.restore(step, args=ocp.args.Composite(
            train_state=ocp.args.StandardRestore(),
            extra_orchestrator=ocp.args.StandardRestore()))
    finally:
        manager.close()
    return items["train_state"], items["extra_orchestrator"]["tree"]


@pytest.mark.timeout(900)
def test_kill_9_then_resume_continues_exactly(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    run = tmp_path / "run"
    log_path = tmp_path / "first.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(_tiny_job(tmp_path, steps=6), stdout=log,
                                   stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        deadline = time.time() + 800
        # kill -9 as soon as the step-2 checkpoint is complete (orbax renames it into place)
        while time.time() < deadline and process.poll() is None:
            done = [p for p in (run / "checkpoints").glob("[0-9]*") if p.is_dir()]
            if any(p.name == "2" for p in done):
                break
            time.sleep(0.05)
        assert process.poll() is None, log_path.read_text()[-3000:]
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    first_rows = [json.loads(line) for line in open(run / "metrics.jsonl")
                  if line.strip().endswith("}")]
    assert [r["step"] for r in first_rows][:2] == [1, 2]

    saved_state, saved_extras = _checkpoint(run, 2)
    assert int(saved_state["step"]) == 2
    saved_event = int(saved_state["policy_event"])
    assert saved_event == 2            # publish every update: event k after k updates
    saved_digest = _digest(saved_extras["method"])
    assert int(saved_extras["counters"]["updates"]) == 2
    saved_ready = len(saved_extras["ready"]["token_ids"]["offsets"]) - 1
    saved_previous = len(saved_extras["method"]["previous"]["token_ids"]["offsets"]) - 1
    assert saved_previous >= 1  # SPO's y′ of the tasks trained so far are in the checkpoint

    # no --resume on a run folder with checkpoints: refused, nothing overwritten
    refused = subprocess.run(_tiny_job(tmp_path, steps=6), capture_output=True, text=True,
                             cwd=ROOT, env=env, timeout=600)
    assert "holds checkpoints up to step 2" in refused.stderr
    assert refused.returncode != 0 and "--resume" in refused.stderr

    # the evaluation section is not part of the checkpoint key: it may change on resume
    evaluation = ["--evaluation.train_rollouts", "2", "--evaluation.heldout_rollouts", "3",
                  "--evaluation.train_games", "3"]
    resumed = subprocess.run(_tiny_job(tmp_path, steps=3) + ["--resume", *evaluation], capture_output=True,
                             text=True, cwd=ROOT, env=env, timeout=800)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    line = re.search(r"resume: step (\d+), policy event (\d+), method state sha1 ([0-9a-f]+), "
                     r"(\d+) buffered trajectories", resumed.stdout)
    assert line is not None, resumed.stdout[-2000:]
    # resumed from the checkpoint written before the kill, tracker exactly as saved
    assert int(line.group(1)) == 2 and int(line.group(2)) == saved_event
    assert line.group(3) == saved_digest and int(line.group(4)) == saved_ready
    final_state, final_extras = _checkpoint(run, 3)
    assert int(final_state["step"]) == 3 and int(final_state["policy_event"]) == 3
    assert int(final_extras["counters"]["updates"]) == 3
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[:2] == first_rows[:2]   # work before the checkpoint is kept, not redone
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["success_after_rl"] <= 1.0
    assert len(summary["success_per_step"]) == 3
    assert summary["total_wall_s"] >= summary["rl_stage_wall_s"] > summary["evaluation_wall_s"] > 0
    # RL time is the updates' own (both parts of the run); the evaluations are apart
    assert summary["rl_wall_s"] == pytest.approx(sum(r["update_wall_s"] for r in rows))
    assert summary["evaluation_wall_s"] == pytest.approx(summary["rl_stage_wall_s"] - rows[-1]["wall_s"])
    assert re.search(r"done in \d+s: success on training tasks \(3 games, 3 episodes before RL, 6 after\): "
                     r"\d\.\d{3} before RL -> \d\.\d{3} after RL; held-out games \(2 games, 6 episodes\)",
                     resumed.stdout), resumed.stdout[-2000:]
    assert 0.0 <= summary["event_order"]["fraction"] <= 1.0 and summary["event_order"]["received"] > 0
    assert summary["env"]["prompt_blind"] is False and summary["env"]["train_games"]  # what env.blind_control checks
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    # evaluation.*_rollouts, not prior.rollouts_per_task (1), per training / held-out game;
    # evaluation.train_games: training tasks 0-2 only, compared with the prior on those 3
    assert json.loads((run / "eval_after.json").read_text())["trials"] == [2, 2, 2, 0]
    assert summary["train_before_rl_estimate"]["games"] == summary["train_after_rl_estimate"]["games"] == 3
    for when in ("before", "after"):
        assert summary[f"heldout_{when}_rl"]["trials"] == [3, 3]
    assert np.isfinite([r["learner/loss"] for r in rows]).all()
