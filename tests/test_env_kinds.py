"""The ``env`` section is a choice of env kinds: each kind carries only its own fields and
builds its task sets; a kind added in one file is selectable with no other edit; and the
records keyed by the env section before it became a choice (priors, evaluation caches,
warm starts, checkpoints) keep their keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

import train
from rollout_bridge.config import TrainConfig, load_config
from rollout_bridge.envs import kinds
from rollout_bridge.envs.kinds import EnvConfig, build_env, env_kinds
from rollout_bridge.run_errors import UserError
from rollout_bridge.run_folder import stage_key

ROOT = Path(__file__).resolve().parents[1]
BEFORE = json.loads((ROOT / "tests" / "data" / "env_keys_before_kinds.json").read_text())


def _digest(key: dict) -> str:
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# ------------------------------------------------------------------ each kind its own fields


def test_each_kind_has_only_its_own_fields():
    fields = {kind: {f.name for f in dataclasses.fields(EnvConfig.get_choice_class(kind))} for kind in env_kinds()}
    shared = {f.name for f in dataclasses.fields(EnvConfig)}
    assert shared <= fields["textworld"] & fields["alfworld"] & fields["math_tir"]
    assert {"world_size", "shuffle_actions", "blind_control", "rename_episodes"} <= fields["textworld"] - fields["alfworld"]
    assert {"heldout_dir", "max_receptacles", "alfworld_task_types"} <= fields["alfworld"] - fields["textworld"]
    assert {"source", "arithmetic", "sandbox", "verifier"} <= fields["math_tir"] - fields["textworld"] - fields["alfworld"]
    assert not {"world_size", "game_dir", "numbered_actions"} & fields["math_tir"]


def test_kind_chosen_by_flag_by_type_and_in_yaml(tmp_path):
    assert type(TrainConfig().env).__name__ == "TextWorldConfig" and TrainConfig().env.kind == "textworld"
    assert load_config(["--env", "alfworld"]).env.kind == "alfworld"
    assert load_config(["--env=math_tir", "--env.arithmetic.direct_rate", "0.2"]).env.arithmetic.direct_rate == 0.2
    assert load_config(["--env.type", "alfworld", "--env.max_receptacles", "5"]).env.max_receptacles == 5
    recipe = tmp_path / "r.yaml"
    recipe.write_text("env:\n  type: math_tir\n  num_games: 32\n  sandbox:\n    num_workers: 2\n")
    cfg = load_config(config_path=recipe)
    assert (cfg.env.kind, cfg.env.num_games, cfg.env.sandbox.num_workers) == ("math_tir", 32, 2)
    recipe.write_text("env: alfworld\n")
    assert load_config(config_path=recipe).env.kind == "alfworld"


@pytest.mark.parametrize("argv, hint", [
    (["--env.kind", "alfworld"], "--env.kind was renamed to --env.type"),
    (["--math_tir.source", "dapo"], "--math_tir.source was renamed to --env.source (with --env math_tir)"),
    (["--math_tir.sandbox.wall_s", "3"], "--math_tir.sandbox.wall_s was renamed to --env.sandbox.wall_s"),
    (["--env", "math_tir", "--env.world_size", "2"], "env.world_size is a setting of --env textworld only"),
])
def test_old_and_other_kinds_flags_are_named(argv, hint):
    with pytest.raises(UserError) as info:
        train.parse_config(argv)
    assert hint in str(info.value), str(info.value)


@pytest.mark.parametrize("text, hint", ids=["env.kind", "math_tir section"], argvalues=[
    ("env:\n  kind: alfworld\n", "env.kind was renamed to env.type"),
    ("math_tir:\n  source: dapo\n", "math_tir was renamed to env (with --env math_tir)"),
])
def test_an_old_recipe_file_names_the_renamed_keys(tmp_path, text, hint):
    recipe = tmp_path / "old.yaml"
    recipe.write_text(text)
    with pytest.raises(UserError) as info:
        train.parse_config(["--config_path", str(recipe)])
    assert hint in str(info.value), str(info.value)


# ------------------------------------------------------------------ a kind added in one file

NEW_KIND_FILE = '''
"""Synthetic word tasks as an env kind: one file, nothing else edited."""
import dataclasses

from rollout_bridge.envs.kinds.base import EnvBundle, EnvConfig, check
from rollout_bridge.envs.synthetic import SyntheticEnv


@EnvConfig.register_subclass("words")
@dataclasses.dataclass
class WordsConfig(EnvConfig):
    max_filler: int = 12

    def __post_init__(self):
        super().__post_init__()
        check(self.max_filler >= 0, "env.max_filler", ">= 0", self.max_filler)

    def build(self, seed, with_demonstrations, log=print, progress=False):
        make = lambda: SyntheticEnv(self.num_games, seed, self.max_turns, self.max_filler)
        return EnvBundle(train=make(), env_factory=make, max_turns=self.max_turns, corpus=lambda: ["say: apple"])
'''


def test_a_kind_added_in_one_file_is_selectable_from_the_command_line(monkeypatch, tmp_path):
    """One new file in the kinds package (here a folder added to its search path) makes
    ``--env words`` parse, check its own field, build its tasks and key its records."""
    (tmp_path / "words_kind.py").write_text(textwrap.dedent(NEW_KIND_FILE))
    monkeypatch.setattr(kinds, "__path__", [*kinds.__path__, str(tmp_path)])
    monkeypatch.setattr(EnvConfig, "_choice_registry", dict(EnvConfig._choice_registry))
    monkeypatch.setattr(EnvConfig, "_did_discover_packages", False)
    try:
        cfg = train.parse_config(["--env", "words", "--env.num_games", "5", "--env.max_filler", "3",
                                  "--rollout.max_in_flight", "4"])
        with pytest.raises(UserError, match="env.max_filler must be >= 0"):
            train.parse_config(["--env", "words", "--env.max_filler=-1"])
    finally:
        sys.modules.pop("rollout_bridge.envs.kinds.words_kind", None)
    assert cfg.env.kind == "words" and "words" in env_kinds() and cfg.env.max_filler == 3
    bundle = build_env(cfg, False)
    assert bundle.num_tasks == 5 and bundle.env_factory().max_filler == 3
    key = stage_key(cfg, "env")["env"]
    assert key["kind"] == "words" and key["max_filler"] == 3 and key["num_games"] == 5


# ------------------------------------------------------------------ the keys records were written with


def test_the_main_jobs_key_is_the_one_its_records_were_written_with():
    """configs/default.yaml = TrainConfig(): the env section and the model+env key (priors,
    evaluation caches, warm starts and checkpoints all start with it) as before the env
    section became a choice."""
    for cfg in (TrainConfig(), train.parse_config(["--config_path", str(ROOT / "configs" / "default.yaml")])):
        assert _digest(stage_key(cfg, "env")) == "f00411e80bd139b3"
        assert _digest(stage_key(cfg, "model", "env")) == "ca86850c42a7fc88"


MATH_TIR_OWN = ("source", "tool_format", "tools_enabled", "teacher_file", "teacher_samples_per_task",
                "held_out_fraction", "arithmetic", "sandbox", "verifier")


def _without_math_tir_own(key: dict) -> dict:
    return {name: value for name, value in key.items() if name not in MATH_TIR_OWN}


@pytest.mark.parametrize("name", sorted(BEFORE["configs"]))
def test_every_recipes_env_key_is_unchanged(name):
    """The env key of every recipe is the one records were written under; Math-TIR's adds
    its own settings, which no key held before (so no earlier record is served to it)."""
    cfg = train.parse_config(["--config_path", str(ROOT / "configs" / name)])
    key = stage_key(cfg, "env")["env"]
    if cfg.env.kind == "math_tir":
        assert set(key) - set(BEFORE["configs"][name]) == set(MATH_TIR_OWN)
        key = _without_math_tir_own(key)
    assert key == BEFORE["configs"][name]


def test_a_math_tir_run_folder_written_before_is_refused_naming_its_unrecorded_settings():
    """A configs/math_tir_tiny.yaml run folder made before Math-TIR's settings were keyed does
    not --resume (its problems and teacher are unrecorded); the refusal names those settings,
    and the rest of its env key equals this version's."""
    from spopp_jax.checkpoint import config_differences

    saved = BEFORE["math_tir_tiny_run_folder"]
    cfg = train.parse_config(["--config_path", str(ROOT / "configs" / "math_tir_tiny.yaml"), *saved["flags"]])
    key = stage_key(cfg, "env")["env"]
    assert _without_math_tir_own(key) == saved["env"]
    differing = {line.split(":")[0].split(".")[0] for line in config_differences(saved["env"], key)}
    assert differing == set(MATH_TIR_OWN)


def test_kind_own_settings_are_keyed():
    """A TextWorld, ALFWorld or Math-TIR setting changes the key, except the sandbox's worker
    count (how many tool calls run at once, not what they return)."""
    base = stage_key(TrainConfig(), "env")["env"]
    assert stage_key(load_config(["--env.world_size", "4"]), "env")["env"] != base
    alf = stage_key(load_config(["--env", "alfworld"]), "env")["env"]
    assert stage_key(load_config(["--env", "alfworld", "--env.max_distractors", "2"]), "env")["env"] != alf
    math = stage_key(load_config(["--env", "math_tir"]), "env")["env"]
    assert math["kind"] == "math_tir" and math["source"] == "arithmetic"
    for flag, value in (("--env.arithmetic.max_operand", "500"), ("--env.tool_format", "qwen"),
                        ("--env.sandbox.wall_s", "2.0")):
        assert stage_key(load_config(["--env", "math_tir", flag, value]), "env")["env"] != math, flag
    assert stage_key(load_config(["--env", "math_tir", "--env.sandbox.num_workers", "2"]), "env")["env"] == math


@pytest.mark.parametrize("argv, refused", [
    (["--env", "textworld"], True), (["--env", "alfworld"], True), (["--env", "math_tir"], True),
    (["--env", "textworld", "--env.game_dir", "games"], False),   # your own games: counted once built
])
def test_single_stream_in_flight_bound_uses_the_kinds_known_task_count(argv, refused):
    """SPEC 2 (one request in flight per task): 16 in flight need >= 16 tasks, checked at
    parse time wherever the config alone decides the task count."""
    argv = [*argv, "--env.num_games", "8", "--rollout.max_in_flight", "16"]
    if refused:
        with pytest.raises(UserError, match=r"rollout.max_in_flight must be <= .* env.num_games=8"):
            train.parse_config(argv)
    else:
        assert train.parse_config(argv).env.known_num_tasks() is None
