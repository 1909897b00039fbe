"""The ALFWorld recipes load as env kind `alfworld` and reach the task-set builder."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_bridge.config import load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_tiny_recipe_is_generated_alfworld_with_heldout_and_warm_start():
    cfg = load_config(config_path=CONFIGS / "alfworld_tiny.yaml")
    assert cfg.env.kind == "alfworld" and cfg.env.game_dir is None
    assert cfg.env.num_games == 128 and cfg.env.heldout_games > 0
    assert cfg.warmstart.enabled and cfg.env.warmstart_games > 0
    assert cfg.prior.enabled and cfg.model.path is None


@pytest.mark.parametrize("name", ["alfworld_qwen35_0p8b", "alfworld_qwen35_2b"])
def test_paper_recipes_take_downloaded_or_generated_games(name):
    downloaded = load_config(config_path=CONFIGS / f"{name}.yaml")
    assert downloaded.env.kind == "alfworld" and downloaded.env.max_turns == 50
    generated = load_config(["--env.game_dir", "null"], config_path=CONFIGS / f"{name}.yaml")
    assert generated.env.game_dir is None and generated.env.num_games == 128
    assert generated.env.max_receptacles is None      # whole floor plans, as released


@pytest.mark.parametrize("args, field", [
    (["--env", "alfworld", "--env.max_receptacles", "2"], "env.max_receptacles"),
    (["--env", "alfworld", "--env.heldout_games", "-1"], "env.heldout_games"),
])
def test_bad_alfworld_fields_named(args, field):
    from draccus.utils import ParsingError

    from rollout_bridge.config import format_config_error

    with pytest.raises(ParsingError) as info:
        load_config(args)
    assert field in format_config_error(info.value)


def _alfworld_cfg(*args: str):
    return load_config(["--config_path", str(CONFIGS / "alfworld_tiny.yaml"), *args])


def test_missing_alfworld_packages_are_named(monkeypatch):
    import importlib.util

    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.run_errors import UserError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "fast_downward" else real(name, *a))
    with pytest.raises(UserError, match=r"needs fast_downward: pip install 'alfworld==0.4.2'"):
        build_env(_alfworld_cfg(), False)


def test_missing_heldout_dir_is_named(tmp_path):
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.run_errors import UserError

    with pytest.raises(UserError, match=r"env.heldout_dir=.*does not exist"):
        build_env(_alfworld_cfg("--env.heldout_dir", str(tmp_path / "nope")), False)


@pytest.mark.parametrize("field", ["warmstart_rename", "rename_episodes", "blind_observations", "blind_control"])
def test_textworld_only_observation_fields_are_refused_naming_their_kind(field):
    """ALFWorld observations have their own format: TextWorld's observation fields are not
    fields of the alfworld kind, and the error says whose they are."""
    import train
    from rollout_bridge.run_errors import UserError

    with pytest.raises(UserError, match=rf"env.{field} is a setting of --env textworld only"):
        train.parse_config(["--config_path", str(CONFIGS / "alfworld_tiny.yaml"), f"--env.{field}", "0.5"])


def test_unknown_alfworld_task_type_is_named():
    from rollout_bridge.envs.kinds import build_env
    from rollout_bridge.run_errors import UserError

    with pytest.raises(UserError, match=r"env.alfworld_task_types: unknown \['pick_banana'\]"):
        build_env(_alfworld_cfg("--env.alfworld_task_types", "[pick_and_place_simple,pick_banana]"), False)


def test_task_types_and_command_numbers_reach_the_task_sets(monkeypatch):
    from rollout_bridge.envs import alfworld_tasks
    from rollout_bridge.envs.kinds import build_env

    seen = {}

    def fake_build(config, progress=None):
        seen["config"] = config
        raise RuntimeError("stop after the config")
    monkeypatch.setattr(alfworld_tasks, "build_task_sets", fake_build)
    with pytest.raises(RuntimeError, match="stop after the config"):
        build_env(_alfworld_cfg("--env.alfworld_task_types", "[look_at_obj_in_light]",
                                "--env.reply_format", "command_number", "--env.actions_per_line", "true"), False)
    assert seen["config"].task_types == ("look_at_obj_in_light",)
    assert seen["config"].command_numbers and seen["config"].style.max_feedback_chars == 240
    assert seen["config"].style.actions_per_line
    assert seen["config"].alfred_filter and seen["config"].alfred_floor_plans    # the defaults
    with pytest.raises(RuntimeError, match="stop after the config"):
        build_env(_alfworld_cfg("--env.alfred_filter", "false", "--env.alfred_floor_plans", "false"), False)
    assert not seen["config"].alfred_filter and not seen["config"].alfred_floor_plans


def test_shipped_alfworld_warm_start_is_the_recorded_one_of_this_recipe_and_loads():
    """assets/alfworld_text_warmstart: the bytes its README records, made by this recipe's
    warm-start settings (the record's key), the recipe's model shape, and it reads a prompt."""
    import json

    from test_default_job import check_shipped_warm_start

    asset = CONFIGS.parent / "assets" / "alfworld_text_warmstart"
    record = check_shipped_warm_start(asset, CONFIGS / "alfworld_tiny.yaml",
                                      "Your task is to: put a apple in fridge.\ngo to fridge 1\nopen fridge 1\n")
    assert len(record["losses"]) == 6144 and record["losses"][-1] < 0.05 * record["losses"][0]
    cfg = load_config(config_path=CONFIGS / "alfworld_tiny.yaml")
    made_by = record["key"]
    for field in ("numbered_actions", "actions_per_line", "reply_format", "max_feedback_chars", "max_turns",
                  "warmstart_games", "warmstart_seed", "max_receptacles", "max_distractors"):
        assert made_by["env"][field] == getattr(cfg.env, field), field
    for field in ("epochs", "batch_size", "learning_rate", "loss_on"):
        assert made_by["warmstart"][field] == getattr(cfg.warmstart, field), field
    shape = json.loads((asset / "config.json").read_text())
    assert (shape["hidden_size"], shape["num_hidden_layers"]) == (cfg.model.tiny_hidden_size, cfg.model.tiny_num_layers)
    assert shape["vocab_size"] <= cfg.model.tiny_vocab_size   # BPE stops when the game texts have no more merges


def test_alfred_fields_are_keyed_only_where_they_change_the_games():
    """Priors, warm starts and checkpoints of TextWorld runs, of downloaded ALFWorld games and
    of generated ALFWorld games made with both fields off stay reusable; the new sets are
    keyed."""
    from rollout_bridge.run_folder import stage_key

    textworld = load_config([])
    assert not {"alfred_filter", "alfred_floor_plans"} & set(stage_key(textworld, "env")["env"])
    generated = _alfworld_cfg()
    assert stage_key(generated, "env")["env"]["alfred_filter"] is True
    assert stage_key(generated, "env")["env"]["alfred_floor_plans"] is True
    plain = stage_key(_alfworld_cfg("--env.alfred_filter", "false", "--env.alfred_floor_plans", "false"), "env")
    assert not {"alfred_filter", "alfred_floor_plans"} & set(plain["env"])
    downloaded = _alfworld_cfg("--env.game_dir", "/some/json_2.1.1/train")
    assert "alfred_filter" not in stage_key(downloaded, "env")["env"]
