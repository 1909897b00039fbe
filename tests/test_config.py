"""Typed config: YAML recipes load, CLI overrides win, bad values fail naming the field."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from draccus.utils import ParsingError

from rollout_bridge.config import (ChoiceError, EvaluationSection, FlagError, TrainConfig, format_config_error,
                                   load_config)
from rollout_bridge.engine.choice import EngineConfig
from rollout_bridge.envs.kinds.base import EnvConfig
from rollout_bridge.methods.base import MethodConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def smoke(*args: str) -> TrainConfig:
    return load_config(list(args), config_path=CONFIGS / "smoke.yaml")


def _error(args) -> str:
    with pytest.raises(ParsingError) as info:
        load_config(args)
    return format_config_error(info.value)


def test_default_yaml_is_the_embedded_default():
    """One default: `python train.py` (no file) runs TrainConfig(), which configs/default.yaml
    writes out field for field; the smoke job differs from it only by what smoke.yaml sets."""
    import train

    assert load_config(config_path=CONFIGS / "default.yaml") == TrainConfig() == train.parse_config([])
    smoke = load_config(config_path=CONFIGS / "smoke.yaml")
    assert (smoke.env.max_turns, smoke.model.path, smoke.steps) == (2, None, 160)


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
    # bf16 compute on float32 master weights: AdamW at lr 1e-6 must move bf16-computed weights
    assert (cfg.model.compute_dtype, cfg.model.param_dtype) == ("bfloat16", "float32")
    assert cfg.model.remat == "block"


def test_cli_overrides_beat_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 7\nrollout:\n  batch_size: 16\n  max_in_flight: 4\n"
                    "tracker:\n  rho: 0.9\n")
    cfg = load_config(["--rollout.batch_size", "32", "--rollout.max_in_flight", "8",
                       "--method.measure", "trajectory", "--resume"], config_path=path)
    assert cfg.steps == 7 and cfg.tracker.rho == 0.9           # from the file
    assert cfg.rollout.batch_size == 32                         # CLI wins
    assert cfg.method.measure == "trajectory" and cfg.resume is True
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
    (["--optim.length_bucket", "0"], "optim.length_bucket"),
    (["--optim.num_mini_batches", "0"], "optim.num_mini_batches"),
    (["--optim.num_mini_batches", "3"], "optim.num_mini_batches x optim.num_micro_batches"),  # 16 rows
    (["--optim.num_mini_batches", "4", "--optim.num_micro_batches", "8"],
     "optim.num_mini_batches x optim.num_micro_batches"),
    (["--loss.clip_low", "1.5"], "loss.clip_low"),
    (["--method.dual_clip", "0.5"], "method.dual_clip"),
    (["--method", "spo", "--method.rho_min", "0.99"], "method.rho_min"),
    (["--method", "rloo", "--method.group_size", "1"], "method.group_size"),
    (["--rollout.top_p", "0"], "rollout.top_p"),
    (["--rollout.max_new_tokens", "600", "--rollout.max_total_tokens", "512"],
     "rollout.max_new_tokens"),
    (["--rollout.max_in_flight", "64", "--env.num_games", "16"], "rollout.max_in_flight"),
    (["--rollout.pad_to_multiple", "0"], "rollout.pad_to_multiple"),
    (["--rollout.pad_to_multiple", "100", "--rollout.max_total_tokens", "320"], "rollout.pad_to_multiple"),
    (["--env.max_turns", "0"], "env.max_turns"),
    (["--env.warmstart_rename", "1.5"], "env.warmstart_rename"),
    (["--env.warmstart_rename=-0.1"], "env.warmstart_rename"),
    (["--env.rename_episodes", "1.5"], "env.rename_episodes"),
    (["--prior.mass", "-8"], "prior.mass"),
    (["--evaluation.train_rollouts", "0"], "evaluation.train_rollouts"),
    (["--evaluation.heldout_rollouts=-2"], "evaluation.heldout_rollouts"),
    (["--evaluation.train_games", "0"], "evaluation.train_games"),
    (["--optim.action_logits_fraction", "0"], "optim.action_logits_fraction"),
    (["--optim.action_logits_fraction", "1.5"], "optim.action_logits_fraction"),
    (["--warmstart.epochs", "0"], "warmstart.epochs"),
    (["--optim.learning_rate", "inf"], "optim.learning_rate"),
    (["--warmstart.learning_rate", "inf"], "warmstart.learning_rate"),
    (["--rollout.temperature", "inf"], "rollout.temperature"),
    (["--advantage.whiten_eps", "inf"], "advantage.whiten_eps"),
    (["--advantage.whiten_eps", "nan"], "advantage.whiten_eps"),
    (["--advantage.whiten_eps", "0.5"], "advantage.whiten_eps"),     # every advantage shrunk toward 0
    (["--env", "math_tir", "--env.sandbox.wall_s", "inf"], "env.sandbox.wall_s"),
    (["--method", "spo", "--method.d_half", "inf"], "method.d_half"),
    (["--optim.num_micro_batches", "3"], "optim.num_mini_batches x optim.num_micro_batches"),
    (["--checkpoint_every", "3", "--rollout.publish_every", "2"], "checkpoint_every"),
    (["--method", "grpo", "--rollout.batch_size", "12", "--method.group_size", "8"],
     "rollout.batch_size"),
    (["--method", "grpo", "--rollout.max_in_flight", "4"], "rollout.max_in_flight"),
])
def test_bad_values_name_the_field(args, field):
    message = _error(args)
    assert message.startswith(field + " must"), message


@pytest.mark.parametrize("args, message", [
    (["--no_such_field", "1"], "--no_such_field: no such setting (python train.py --help lists them)"),
    (["--rollout.batchsize", "32", "--tracker.roh=0.5"],
     "--rollout.batchsize: no such setting (closest: --rollout.batch_size); --tracker.roh: no such setting "
     "(closest: --tracker.rho) (python train.py --help lists them)"),
    (["--stage", "later"], "argument --stage: invalid choice: 'later' (choose from 'all', 'warmstart', 'prior', 'rl')"),
    (["--steps"], "argument --steps: expected one argument"),
    (["stray"], "unexpected arguments 'stray': settings are given as --section.field value"),
])
def test_a_flag_argparse_refuses_is_one_line(args, message):
    """Not argparse's usage (over a hundred lines) and exit: the flag, and the closest flags."""
    with pytest.raises(FlagError) as info:
        load_config(args)
    assert str(info.value) == message


def _registered(section: str) -> list[str]:
    """The choices registered for a choice section, sorted."""
    registry = {"method": MethodConfig, "env": EnvConfig, "rollout.engine": EngineConfig}[section]
    return sorted(registry.get_known_choices())


@pytest.mark.parametrize("args, section", [
    (["--method", "nosuch"], "method"), (["--method=nosuch"], "method"), (["--method.type", "nosuch"], "method"),
    (["--env", "nosuch"], "env"), (["--env.type=nosuch"], "env"),
    (["--rollout.engine", "nosuch"], "rollout.engine"),
])
def test_an_unknown_choice_on_the_command_line_is_one_line_naming_the_choices(args, section):
    with pytest.raises(ChoiceError) as info:
        load_config(args)
    assert str(info.value) == f"{section} must be one of {_registered(section)}, got 'nosuch'"
    assert {"grpo", "rloo", "spo", "spopp"} <= set(_registered("method"))
    assert {"textworld", "alfworld", "math_tir"} <= set(_registered("env"))


@pytest.mark.parametrize("yaml_text, section", [
    ("method: nosuch\n", "method"), ("method:\n  type: nosuch\n", "method"),
    ("env: nosuch\n", "env"), ("env: {type: nosuch, num_games: 4}\n", "env"),
    ("rollout:\n  engine: nosuch\n", "rollout.engine"),
])
def test_an_unknown_choice_in_a_config_file_names_the_file(tmp_path, yaml_text, section):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml_text)
    for args in ([], ["--steps", "3"]):
        with pytest.raises(ChoiceError) as info:
            load_config(args, config_path=path)
        assert str(info.value) == (f"config file {path}: {section} must be one of {_registered(section)}, "
                                   "got 'nosuch'")


def test_train_py_states_an_unknown_choice_or_flag_in_one_line(tmp_path):
    """No argparse usage, no draccus chain: one line, exit status 2, from the command line
    and from a config file."""
    path = tmp_path / "recipe.yaml"
    path.write_text("env: {type: nosuch}\n")
    for args, line in ((["--method", "nosuch"], f"config error: method must be one of {_registered('method')}, "
                                                "got 'nosuch'"),
                       (["--rollout.batchsize", "32"], "config error: --rollout.batchsize: no such setting (closest: "
                                                       "--rollout.batch_size) (python train.py --help lists them)"),
                       (["--config_path", str(path)], f"config error: config file {path}: env must be one of "
                                                      f"{_registered('env')}, got 'nosuch'")):
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--output_dir", str(tmp_path / "run"), *args],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
        lines = [text for text in result.stderr.splitlines() if text.strip()]
        assert result.returncode == 2 and lines == [line], result.stderr[-3000:]


def test_help_lists_only_flags_that_set_something(capsys):
    """No flag of a nested section's bare name (``--launch``, rollout.engine's server launch)
    and no section-file flag (``--rollout str  Config file for rollout``, which takes no file):
    every flag listed is a setting, the config file or a choice."""
    with pytest.raises(SystemExit) as info:
        load_config(["--help"])
    text = capsys.readouterr().out
    assert info.value.code == 0
    listed = re.findall(r"^ +(--[\w.]+)", text, re.M)   # the option lines (the usage lines start with "[")
    assert not re.search(r"(?<![\w.])--launch\b", text) and "Config file for" not in text
    top = {f"--{f.name}" for f in dataclasses.fields(TrainConfig)}
    assert {flag for flag in listed if "." not in flag} <= top | {"--help", "--config_path"}
    assert {"--method", "--env", "--rollout.engine", "--rollout.engine.type", "--rollout.engine.launch.count",
            "--rollout.engine.dtype", "--rollout.batch_size", "--env.num_games"} <= set(listed)
    for name in ("method", "env", "rollout.engine"):   # a choice flag names its choices
        assert re.search(rf"^  --{re.escape(name)} str +one of \[", text, re.M), name


def test_bad_literal_in_yaml_names_the_field(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("method:\n  measure: sequence\n")
    with pytest.raises(ParsingError) as info:
        load_config(config_path=path)
    message = format_config_error(info.value)
    assert "method.measure" in message and "sequence" in message and "token" in message


def test_sections_validate_directly():
    from rollout_bridge.config import RolloutSection
    from rollout_bridge.orchestrator import TrackerConfig

    with pytest.raises(ValueError, match="tracker.rho"):
        TrackerConfig(rho=1.0)
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


def test_pad_to_multiple_reaches_the_orchestrator_and_defaults_to_one_width():
    from rollout_bridge.agent import AgentConfig
    from rollout_bridge.components import build_orchestrator_config

    agent = AgentConfig(max_turns=2, max_total_tokens=320)
    assert build_orchestrator_config(smoke(), agent, 0).pad_to_multiple == 320
    cfg = load_config(["--rollout.pad_to_multiple", "64"])
    assert build_orchestrator_config(cfg, agent, 0).pad_to_multiple == 64


def test_mini_batches_reach_the_learner_config():
    from rollout_bridge.components import build_learner_config as learner_config

    cfg = load_config(["--optim.num_mini_batches", "4", "--optim.num_micro_batches", "2"])
    assert (cfg.optim.num_mini_batches, cfg.optim.num_micro_batches) == (4, 2)
    assert learner_config(cfg).num_mini_batches == 4
    assert learner_config(smoke()).num_mini_batches == 1
    message = _error(["--optim.num_mini_batches", "3"])
    assert "rollout.batch_size=16" in message and "3 x 1 = 3" in message, message


# ------------------------------------------------------------------ every field read once
# (the component sections: tests/test_config_layer.py)


def test_section_owners_really_read_each_field_of_their_section():
    """The owners of whole sections mention every field (a field nothing reads fails)."""
    import inspect

    from rollout_bridge import components, prior_stage, warmstart_stage

    owners = {"model": [components.model_folder, components.tiny_model_shape, components.load_policy,
                        components.check_inputs],
              "mesh": [components.build_mesh],
              "warmstart": [warmstart_stage.run_warmstart], "prior": [prior_stage.run_prior],
              "evaluation": [EvaluationSection.rollouts, EvaluationSection.train_task_ids]}
    hints = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    for section, functions in owners.items():
        source = "".join(inspect.getsource(f) for f in functions)
        section_class = type(getattr(TrainConfig(), section))
        for f in dataclasses.fields(section_class):
            assert f".{f.name}" in source, f"{section}.{f.name} is read by nothing ({hints[section]})"


def test_every_env_kind_reads_each_of_its_fields():
    """Each env kind's module (and the builder it hands its section to) mentions every field
    of its config, the shared ones included (a field nothing reads fails)."""
    import inspect
    import sys

    from rollout_bridge.envs.kinds import EnvConfig, env_kinds
    from rollout_bridge.envs.math_tir import env as math_tir_builder

    delegates = {"math_tir": [math_tir_builder]}
    assert {"textworld", "alfworld", "math_tir"} <= set(env_kinds())
    for kind in env_kinds():
        config = EnvConfig.get_choice_class(kind)
        source = "".join(inspect.getsource(m) for m in [sys.modules[config.__module__], *delegates.get(kind, [])])
        for f in dataclasses.fields(config):
            assert f".{f.name}" in source, f"env.{f.name} of kind {kind} is read by nothing"


def test_library_knobs_are_reachable_from_the_command_line():
    from rollout_bridge import components as c

    cfg = load_config(["--loss.old_logp_source", "rollout", "--rollout.train_on_failed", "true",
                       "--rollout.max_in_flight_per_task", "2", "--rollout.sibling_rule", "proportional",
                       "--rollout.env_timeout_s", "5", "--rollout.max_in_flight", "32",
                       "--advantage.whiten_eps", "1e-6", "--method", "spo"])
    assert c.build_learner_config(cfg).old_logp_source == "rollout"
    agent = c.build_agent_config(cfg, max_turns=3)
    assert agent.env_timeout_s == 5.0 and agent.max_turns == 3
    orch = c.build_orchestrator_config(cfg, agent, seed=1)
    assert (orch.train_on_failed, orch.max_in_flight_per_task, orch.sibling_rule) == (True, 2, "proportional")
    assert orch.method == "spo" and orch.max_in_flight == 32
    assert orch.advantage.whiten_eps == 1e-6 and orch.keep_history is False
    assert orch.pad_to_multiple == (cfg.rollout.pad_to_multiple or agent.max_total_tokens)
    rloo = load_config(["--method", "rloo", "--method.group_size", "4"])
    assert c.build_orchestrator_config(rloo, c.build_agent_config(rloo, 2), seed=0).method == "rloo"
    message = _error(["--method", "grpo", "--rollout.batch_size", "16", "--rollout.max_in_flight_per_task", "2"])
    assert message.startswith("rollout.max_in_flight_per_task must be 1 for grpo"), message
    assert orch.spo_d_half == 0.06 and orch.measure == "trajectory"   # spo's recipe
    assert c.build_learner_config(cfg).dual_clip == 10.0


def test_argv_preprocessors_run_before_parsing(monkeypatch):
    import train
    from rollout_bridge import components as c

    monkeypatch.setattr(c, "ARGV_PREPROCESSORS", [lambda argv: [a.replace("--lr", "--optim.learning_rate")
                                                                for a in argv]])
    assert train.parse_config(["--lr", "0.5"]).optim.learning_rate == 0.5


def test_evaluation_rollouts_default_to_the_priors():
    cfg = smoke("--prior.rollouts_per_task", "3")
    assert cfg.evaluation.rollouts(cfg.prior, "train") == cfg.evaluation.rollouts(cfg.prior, "heldout") == 3
    cfg = smoke("--prior.rollouts_per_task", "1", "--evaluation.heldout_rollouts", "4")
    assert cfg.evaluation.rollouts(cfg.prior, "train") == 1
    assert cfg.evaluation.rollouts(cfg.prior, "heldout") == 4


def test_booleans_are_not_numbers(tmp_path):
    assert "expected a number (int), got the boolean true" in _error(["--steps", "true"])
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  learning_rate: false\n")
    with pytest.raises(ParsingError) as info:
        load_config(config_path=path)
    assert "optim.learning_rate" in format_config_error(info.value)
    assert load_config(["--resume", "true"]).resume is True        # a boolean field still takes one


@pytest.mark.parametrize("text, fragment", [
    ("", "got an empty file"),
    ("# only a comment\n", "got an empty file"),
    ("- 1\n- 2\n", "got a list"),
    ("just a string\n", "got a str"),
    ("steps: 3\nseed: 1\nsteps: 4\n", "line 3: the key 'steps' is given twice in one mapping (first on line 1)"),
    ("optim:\n  learning_rate: 1e-3\n   weight_decay: 0.1\n", "line 3, column"),
    ("steps: [1\n", "not valid YAML"),
])
def test_config_file_must_be_one_yaml_mapping(tmp_path, text, fragment):
    from rollout_bridge.config import ConfigFileError

    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    with pytest.raises(ConfigFileError) as info:
        load_config(config_path=path)
    message = str(info.value)
    assert message.startswith(str(path)) and fragment in message and "\n" not in message, message
