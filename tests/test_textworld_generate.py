"""The fast TextWorld generator makes the very games `tw-make custom` makes: same seed ->
the same game description, walkthrough, Inform 7 source and story file, byte for byte."""

from __future__ import annotations

import filecmp
import json

import pytest

pytest.importorskip("textworld")

from rollout_bridge.envs import textworld_generate as generate  # noqa: E402
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game, walkthrough_wins  # noqa: E402

DEFAULT_SHAPE = (3, 4, 3)   # configs/default.yaml: world_size, nb_objects, quest_length


@pytest.mark.parametrize("seed", [0, 200001])
def test_fast_path_writes_the_files_textworld_writes(tmp_path, seed):
    old = tmp_path / "old" / "game.z8"
    new = tmp_path / "new" / "game.z8"
    old_game = generate.make_and_compile_with_tw(seed, *DEFAULT_SHAPE, old)
    new_game = generate.make_and_compile(seed, *DEFAULT_SHAPE, new)
    assert new_game.metadata["walkthrough"] == old_game.metadata["walkthrough"]
    assert new_game.objective == old_game.objective
    for suffix in (".json", ".ni", ".z8"):   # both compiled today: the .z8's serial date agrees
        assert filecmp.cmp(old.with_suffix(suffix), new.with_suffix(suffix), shallow=False), suffix
    assert walkthrough_wins(new, new_game.metadata["walkthrough"])


def test_a_set_record_is_the_same_as_from_textworlds_path(tmp_path):
    spec = GameSetSpec("same", num_games=1, base_seed=5, world_size=3, nb_objects=4, quest_length=3)
    record = generate_game(5, spec, tmp_path / "game_000005.z8")
    reference = generate.make_and_compile_with_tw(5, *DEFAULT_SHAPE, tmp_path / "tw" / "game.z8")
    assert record == {"file": "game_000005.z8", "seed": 5, "objective": reference.objective,
                      "walkthrough": reference.metadata["walkthrough"]}
    description = json.loads((tmp_path / "game_000005.json").read_text())
    assert description == json.loads((tmp_path / "tw" / "game.json").read_text())


def test_compile_story_refuses_other_formats(tmp_path):
    with pytest.raises(ValueError, match=r"\.z8"):
        generate.compile_story("", tmp_path / "game.ulx")


@pytest.mark.parametrize("seed, wins", [(0, True), (728, False)])   # 728: "Which do you mean, ...?"
def test_the_walkthrough_check_agrees_with_the_game_the_job_plays(tmp_path, seed, wins):
    """`walkthrough_wins` plays without TextWorld's state tracking; the env the job plays
    (admissible commands and all) ends the walkthrough the same way."""
    from rollout_bridge.envs.textworld_env import start_game

    path = tmp_path / "game.z8"
    walkthrough = generate.make_and_compile(seed, *DEFAULT_SHAPE, path).metadata["walkthrough"]
    env = start_game(str(path))
    try:
        env.reset()
        state, done = None, False
        for command in walkthrough:
            state, _, done = env.step(command)
            if done:
                break
        tracked = bool(done and state["won"])
    finally:
        env.close()
    assert walkthrough_wins(path, walkthrough) == tracked == wins
