"""Typed config: YAML recipes load, CLI overrides win, bad values fail naming the field."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from draccus.utils import ParsingError

from spopp_jax.config import TrainConfig, format_config_error, load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def _error(args) -> str:
    with pytest.raises(ParsingError) as info:
        load_config(args)
    return format_config_error(info.value)


def test_default_yaml_is_the_embedded_default():
    assert load_config(config_path=CONFIGS / "default.yaml") == TrainConfig()


@pytest.mark.parametrize("name", ["alfworld_qwen35_0p8b", "alfworld_qwen35_2b",
                                  "math_tir_qwen35_0p8b"])
def test_paper_recipes_load_with_spec_hyperparameters(name):
    cfg = load_config(config_path=CONFIGS / f"{name}.yaml")
    # SPEC 6 shared settings
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (1.0, 1.0, -1)
    assert (cfg.loss.clip_low, cfg.loss.clip_high, cfg.loss.is_cap) == (0.2, 0.28, 2.0)
    assert (cfg.optim.learning_rate, cfg.optim.weight_decay) == (1e-6, 0.1)
    assert cfg.tracker.rho == 0.875 and cfg.sampler.floor == 0.05
    assert cfg.rollout.batch_size == 128 and cfg.prior.rollouts_per_task == 8
    assert cfg.prior_mass == pytest.approx(8.0)
    assert cfg.model.path is not None          # a local folder, never a download
    if name.startswith("alfworld"):
        assert cfg.env.num_games == 128 and cfg.env.max_turns == 50
        assert cfg.rollout.publish_every == 1 and cfg.steps == 50
        assert cfg.env.game_dir is not None and not cfg.env.numbered_actions
    else:
        assert cfg.env.kind == "math_tir" and cfg.env.num_games == 1500
        assert cfg.env.max_turns == 8 and cfg.rollout.publish_every == 2
        ws = cfg.warmstart
        assert (ws.epochs, ws.batch_size, ws.learning_rate, ws.max_length) == (2, 8, 1e-5, 40960)
        assert cfg.model.dtype == "bfloat16"


def test_cli_overrides_beat_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nrollout:\n  batch_size: 4\n  max_inflight: 4\n"
                    "tracker:\n  rho: 0.9\n")
    cfg = load_config(["--rollout.batch_size", "8", "--rollout.max_inflight", "8",
                       "--advantage.measure", "trajectory", "--resume"], config_path=path)
    assert cfg.steps == 7 and cfg.tracker.rho == 0.9           # from the file
    assert cfg.rollout.batch_size == 8                          # CLI wins
    assert cfg.advantage.measure == "trajectory" and cfg.resume is True
    # untouched fields keep their defaults
    assert cfg.optim == TrainConfig().optim


def test_resume_flag_forms():
    assert load_config(["--resume"]).resume is True
    assert load_config(["--resume", "--steps", "3"]).steps == 3
    assert load_config(["--resume", "false"]).resume is False
    assert load_config([]).resume is False


@pytest.mark.parametrize("args, field", [
    (["--rollout.batch_size", "-1"], "rollout.batch_size"),
    (["--rollout.batch_size", "0"], "rollout.batch_size"),
    (["--tracker.rho", "1.0"], "tracker.rho"),
    (["--tracker.rho", "0"], "tracker.rho"),
    (["--tracker.rho", "1.5"], "tracker.rho"),
    (["--steps", "0"], "steps"),
    (["--optim.learning_rate=-1e-3"], "optim.learning_rate"),
    (["--optim.logprob_chunk_size", "0"], "optim.logprob_chunk_size"),
    (["--optim.num_mini_batches", "0"], "optim.num_mini_batches"),
    (["--optim.num_mini_batches", "3"], "optim.num_mini_batches"),  # 16 rows
    (["--optim.num_mini_batches", "4", "--optim.num_micro_batches", "8"],
     "optim.num_mini_batches"),
    (["--loss.clip_low", "1.5"], "loss.clip_low"),
    (["--loss.dual_clip", "0.5"], "loss.dual_clip"),
    (["--rollout.top_p", "0"], "rollout.top_p"),
    (["--rollout.max_new_tokens", "600", "--rollout.max_seq_len", "512"],
     "rollout.max_new_tokens"),
    (["--rollout.max_inflight", "64"], "rollout.max_inflight"),
    (["--env.max_turns", "0"], "env.max_turns"),
    (["--prior.mass", "-8"], "prior.mass"),
    (["--warmstart.epochs", "0"], "warmstart.epochs"),
    (["--checkpoint_every", "3", "--rollout.publish_every", "2"], "checkpoint_every"),
    (["--method", "grpo", "--rollout.batch_size", "12", "--rollout.group_size", "8"],
     "rollout.batch_size"),
])
def test_bad_values_name_the_field(args, field):
    message = _error(args)
    assert message.startswith(field + " must"), message


def test_unknown_measure_or_flag_is_rejected(capsys):
    for args in (["--advantage.measure", "sequence"], ["--method", "ppo"],
                 ["--no_such_field", "1"]):
        with pytest.raises(SystemExit) as info:
            load_config(args)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "advantage.measure" in err and "invalid choice" in err


def test_bad_literal_in_yaml_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("advantage:\n  measure: sequence\n")
    with pytest.raises(ParsingError) as info:
        load_config(config_path=path)
    message = format_config_error(info.value)
    assert "advantage.measure" in message and "sequence" in message and "token" in message


def test_sections_validate_directly():
    from spopp_jax.config import RolloutSection, TrackerSection

    with pytest.raises(ValueError, match="tracker.rho"):
        TrackerSection(rho=1.0)
    with pytest.raises(ValueError, match="rollout.drain"):
        RolloutSection(drain="later")
    cfg = TrainConfig()
    assert cfg.prior_mass == pytest.approx(1.0 / (1.0 - 0.875))
    assert dataclasses.replace(cfg.prior, mass=3.0).mass == 3.0


def test_train_py_reports_bad_value_and_exits_2():
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--tracker.rho", "2"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2
    assert "config error: tracker.rho must be in (0, 1), got 2.0" in result.stderr


def test_mini_batches_reach_the_learner_config():
    from train import learner_config

    cfg = load_config(["--optim.num_mini_batches", "4", "--optim.num_micro_batches", "2"])
    assert (cfg.optim.num_mini_batches, cfg.optim.num_micro_batches) == (4, 2)
    assert learner_config(cfg).num_mini_batches == 4
    assert learner_config(TrainConfig()).num_mini_batches == 1
    message = _error(["--optim.num_mini_batches", "3"])
    assert "rollout.batch_size=16" in message and "3 x 1 = 3" in message, message
