"""`python train.py` with --env alfworld end to end on generated games: warm start,
prior, SPO++ updates, success after RL on the training and held-out games (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_alfworld_job_runs_end_to_end(tmp_path):
    run = tmp_path / "run"
    command = [
        sys.executable, str(ROOT / "train.py"),
        "--config_path", str(ROOT / "configs" / "alfworld_tiny.yaml"),
        "--output_dir", str(run), "--steps", "2", "--checkpoint_every", "2",
        "--progress", "false", "--env.data_dir", str(tmp_path / "games"),
        "--env.num_games", "4", "--env.heldout_games", "2", "--env.warmstart_games", "4",
        "--env.max_receptacles", "4", "--env.max_distractors", "0", "--env.max_turns", "12",
        "--model.tiny_dir", str(tmp_path / "tiny"), "--model.tiny_vocab_size", "400",
        "--warmstart.epochs", "1", "--warmstart.batch_size", "4",
        "--prior.rollouts_per_task", "1",
        "--rollout.batch_size", "4", "--rollout.max_in_flight", "4",
        "--rollout.max_total_tokens", "1024",
    ]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["success_before_rl"] <= 1.0
    assert 0.0 <= summary["success_after_rl"] <= 1.0
    for key in ("heldout_before_rl", "heldout_after_rl"):
        record = summary[key]
        assert len(record["trials"]) == 2 and sum(record["trials"]) == 2
    assert "ALFWorld tasks: 4 train, 2 held-out, 4 warm-start" in done.stdout
