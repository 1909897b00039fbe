"""The Math-TIR recipes through train.py: the Qwen3.5 recipe stops at its missing inputs
with a message; the tiny job runs end to end (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_bridge.config import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def test_recipes_load_their_math_tir_env_sections():
    tiny = load_config(config_path=CONFIGS / "math_tir_tiny.yaml")
    assert tiny.env.kind == "math_tir" and tiny.env.source == "arithmetic"
    assert tiny.env.arithmetic.operators == ("*",)
    assert 0 < tiny.env.arithmetic.direct_rate < 1  # the teacher sometimes answers without the tool
    assert tiny.env.heldout_games > 0  # held-out problems evaluated before/after RL
    qwen = load_config(config_path=CONFIGS / "math_tir_qwen35_0p8b.yaml")
    assert (qwen.env.source, qwen.env.tool_format) == ("dapo", "qwen")
    assert qwen.warmstart.loss_on == "final_message"  # SPEC 6
    assert qwen.env.sandbox.preload == ("sympy",)


def test_qwen_recipe_stops_at_the_missing_inputs(tmp_path):
    """Checked before any work: the model folder (train.py's first check, in-process here),
    then, through train.py, the DAPO data folder."""
    import train
    from rollout_bridge.components import check_inputs
    from rollout_bridge.run_errors import UserError

    with pytest.raises(UserError, match=r"^model.path"):
        check_inputs(train.parse_config(["--config_path", str(CONFIGS / "math_tir_qwen35_0p8b.yaml"),
                                         "--output_dir", str(tmp_path / "run")]))
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (model / name).write_text("{}")
    done = subprocess.run([sys.executable, "train.py", "--config_path", str(CONFIGS / "math_tir_qwen35_0p8b.yaml"),
                           "--output_dir", str(tmp_path / "run"), "--model.path", str(model),
                           "--env.data_dir", str(tmp_path / "missing")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "error: env.data_dir=" in done.stdout + done.stderr, done.stdout + done.stderr


@pytest.mark.slow
def test_tiny_job_runs_end_to_end(tmp_path):
    args = ["--config_path", str(CONFIGS / "math_tir_tiny.yaml"), "--output_dir", str(tmp_path / "run"),
            "--env.data_dir", str(tmp_path / "data"), "--model.tiny_dir", str(tmp_path / "tiny"),
            "--steps", "2", "--checkpoint_every", "2", "--env.num_games", "16", "--rollout.max_in_flight", "16",
            "--env.warmstart_games", "64", "--env.heldout_games", "4", "--warmstart.epochs", "1",
            "--prior.rollouts_per_task", "1",
            "--progress", "false", "--tensorboard", "false"]
    done = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("success_before_rl", "success_after_rl", "no_tool_before_rl", "no_tool_after_rl",
                "heldout_before_rl", "heldout_after_rl", "heldout_no_tool_before_rl", "heldout_no_tool_after_rl"):
        assert key in summary
    assert len(summary["heldout_after_rl"]["trials"]) == 4
    assert (tmp_path / "data" / "teacher_train.jsonl").exists()
