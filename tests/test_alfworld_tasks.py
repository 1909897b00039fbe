"""The ALFWorld env kind's entry point: train / held-out / warm-start sets with disjoint
tasks, sized scenes, training and warm-start games on ALFRED's training floor plans and
held-out games on its test floor plans, and an env factory that plays them."""

from __future__ import annotations

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from rollout_bridge.envs import alfworld_games as games  # noqa: E402
from rollout_bridge.envs.alfworld_tasks import (  # noqa: E402
    AlfworldTaskConfig,
    build_task_sets,
    env_factory,
)
from rollout_bridge.envs.base import Environment  # noqa: E402


def test_sets_are_disjoint_sized_and_playable(tmp_path):
    config = AlfworldTaskConfig(data_dir=str(tmp_path), num_games=3, heldout_games=2,
                                warmstart_games=2, max_distractors=1, max_receptacles=5,
                                max_turns=20, numbered_actions=True, workers=1)
    calls = []
    sets = build_task_sets(config, progress=lambda name: lambda d, t: calls.append((name, d, t)))
    try:
        assert (sets.train.num_tasks, sets.heldout.num_tasks, sets.warm.num_tasks) == (3, 2, 2)
        assert {name for name, _, _ in calls} == {"train", "heldout", "warmstart"}
        train = games.task_names(sets.train.game_files)
        heldout = games.task_names(sets.heldout.game_files)
        warm = games.task_names(sets.warm.game_files)
        assert not train & heldout and not warm & (train | heldout)
        for path in sets.train.game_files:
            problem = games.read_game_file(path)["pddl_problem"].split("(:goal")[0]
            assert problem.count(" - receptacle\n") <= 5
        env = env_factory(sets.train)()
        assert isinstance(env, Environment) and env.num_tasks == 3
        episode_text = env.reset(2)
        assert episode_text.startswith("Goal: ") and "Actions: 1 " in episode_text
        env.close()
        pairs = sets.warm.demonstration(0)                 # SFT data: replies are numbers
        assert pairs and all(reply.isdigit() for _, reply in pairs)
        again = build_task_sets(config)                    # cached: same files
        assert again.train.game_files == sets.train.game_files
        again.close()
    finally:
        sets.close()


def _floor_plans(files) -> set[int]:
    return {games.game_start_state(path)[0].scene for path in files}


def test_no_training_game_uses_a_test_floor_plan_and_heldout_games_use_only_test_ones(tmp_path):
    from alfworld.gen import constants

    config = AlfworldTaskConfig(data_dir=str(tmp_path), num_games=6, heldout_games=3,
                                warmstart_games=2, max_distractors=1, max_receptacles=5,
                                workers=1)
    sets = build_task_sets(config)
    try:
        trained_on = _floor_plans(sets.train.game_files) | _floor_plans(sets.warm.game_files)
        assert trained_on <= set(constants.TRAIN_SCENE_NUMBERS)
        assert _floor_plans(sets.heldout.game_files) <= set(constants.TEST_SCENE_NUMBERS)
        for tasks in (sets.train, sets.heldout, sets.warm):
            for path in tasks.game_files:
                assert games.alfred_exclusions(*games.game_start_state(path)) == ()
    finally:
        sets.close()


def test_bad_fields_are_named():
    with pytest.raises(ValueError, match="env.num_games"):
        AlfworldTaskConfig(num_games=0)
    with pytest.raises(ValueError, match="env.max_turns"):
        AlfworldTaskConfig(max_turns=0)
    with pytest.raises(ValueError, match="max_receptacles"):
        AlfworldTaskConfig(max_receptacles=2).spec("x", 1, 0)
