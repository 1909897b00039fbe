"""scripts/alfworld_check.py: alfworld's own AlfredTWEnv collects generated games and plays
them, following its hand-coded expert and replaying the stored walkthrough."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from rollout_bridge.envs import alfworld_games as games  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "alfworld_check.py"


def _check_module():
    spec = importlib.util.spec_from_file_location("alfworld_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_alfworld_env_collects_and_wins_generated_games(tmp_path):
    check = _check_module()
    spec = games.AlfworldSetSpec("check", 2, 7, ("pick_heat_then_place_in_recep",),
                                 max_distractors=1, max_receptacles=5, floor_plans="test")
    files = games.generate_game_set(spec, tmp_path)
    played = check.play_all(tmp_path / spec.folder_name, max_steps=30)
    assert sorted(played["collected"]) == sorted(str(f.resolve()) for f in files)
    for path in files:
        record = played["games"][str(path.resolve())]
        assert record["walkthrough"]["won"]
        assert record["walkthrough"]["steps"] == len(games.read_game_file(path)["walkthrough"])
        assert record["expert"]["won"] and record["expert"]["error"] is None
