"""TextWorld environment: generated games are played to a win by their walkthrough, any text
a model might type is an observation (never an exception), ids are stable, sets disjoint."""

from __future__ import annotations

import json

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from rollout_bridge.envs.base import Environment, StepResult
from rollout_bridge.envs.textworld_env import (
    MAX_COMMAND_CHARS,
    ObservationStyle,
    TextWorldEnv,
    TextWorldEpisode,
    TextWorldTasks,
    clean_feedback,
    sanitize_command,
)
from rollout_bridge.envs.textworld_games import (
    GameSetSpec,
    game_signature,
    generate_disjoint_game_set,
    generate_game_set,
    list_game_files,
)

TRAIN = GameSetSpec("train", num_games=2, base_seed=0, world_size=2, nb_objects=3, quest_length=1)
TWO_STEP = GameSetSpec("twostep", num_games=1, base_seed=5, world_size=3, nb_objects=3,
                       quest_length=2)
WARM = GameSetSpec("warm", num_games=2, base_seed=0, world_size=2, nb_objects=3, quest_length=1)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tw_games")


@pytest.fixture(scope="module")
def train_files(data_dir):
    return generate_game_set(TRAIN, data_dir)


@pytest.fixture(scope="module")
def tasks(train_files):
    return TextWorldTasks(train_files, train_files[0].parent, max_turns=4)


def test_generated_set_is_cached_and_listed(data_dir, train_files):
    assert len(train_files) == TRAIN.num_games
    assert all(p.suffix == ".z8" and p.exists() for p in train_files)
    mtimes = [p.stat().st_mtime_ns for p in train_files]
    again = generate_game_set(TRAIN, data_dir)          # reuse, no regeneration
    assert again == train_files
    assert [p.stat().st_mtime_ns for p in again] == mtimes
    assert list_game_files(train_files[0].parent) == sorted(train_files)


def test_task_ids_are_stable_sorted_names(train_files, tasks):
    reversed_tasks = TextWorldTasks(list(reversed(train_files)), train_files[0].parent)
    assert reversed_tasks.task_names == tasks.task_names == sorted(tasks.task_names)
    assert tasks.num_tasks == TRAIN.num_games


def test_walkthrough_wins_with_reward_one(tasks):
    env = TextWorldEnv(tasks)
    assert isinstance(env, Environment)
    for task_id in range(tasks.num_tasks):
        observation = env.reset(task_id)
        episode = env.last_episode
        assert observation.startswith("Goal: ")
        assert "Actions: " in observation
        walkthrough = episode.walkthrough
        assert walkthrough, "generated games carry a walkthrough"
        rewards = []
        for i, command in enumerate(walkthrough):
            # ALFWorld-style: every walkthrough command is admissible when it is due
            assert command in episode.admissible
            result = env.step(command)
            assert isinstance(result, StepResult)
            rewards.append(result.reward)
            assert result.done == (i == len(walkthrough) - 1)
        assert rewards == [0.0] * (len(walkthrough) - 1) + [1.0]
        env.close()


def test_two_step_quest_and_demonstration(data_dir):
    files = generate_game_set(TWO_STEP, data_dir)
    tasks = TextWorldTasks(files, files[0].parent, max_turns=6)
    demo = tasks.demonstration(0)
    assert len(demo) == TWO_STEP.quest_length
    manifest = json.loads((files[0].parent / "manifest.json").read_text())
    assert [a for _, a in demo] == manifest["games"][0]["walkthrough"]
    # the second observation is what the game answered to the first command
    assert demo[1][0] != demo[0][0] and demo[1][0].startswith("Goal: ")


def test_numbered_actions_accept_the_number(train_files):
    tasks = TextWorldTasks(train_files, train_files[0].parent, max_turns=4,
                           style=ObservationStyle(max_feedback_chars=80, numbered_actions=True))
    demo = tasks.demonstration(0)
    episode = tasks.episode(0)
    observation = episode.reset()
    assert observation == demo[0][0]
    actions = observation.split("Actions: ")[1].split(" | ")
    assert actions == [f"{i} {c}" for i, c in enumerate(episode.admissible, 1)]
    # the demo's reply is the number of the walkthrough command in the shown list
    number = int(demo[0][1])
    assert episode.admissible[number - 1] == episode.walkthrough[0]
    # an out-of-range number goes to the game as typed: an ordinary observation
    outcome = episode.step(str(len(episode.admissible) + 1))
    assert outcome.info["command"] == str(len(episode.admissible) + 1) and not outcome.won
    outcome = episode.step(demo[0][1])
    assert outcome.info["command"] == episode.walkthrough[0]
    assert outcome.won and outcome.reward == 1.0
    episode.close()


def test_actions_one_per_line_are_written_as_a_reply_types_them(train_files):
    from rollout_bridge.envs.textworld_env import format_observation

    assert format_observation("win", "A room.", ["go east", "take key"], one_per_line=True) == (
        "Goal: win\nA room.\nActions:\ngo east\ntake key")
    assert format_observation("win", "A room.", ["go east", "take key"]) == (
        "Goal: win\nA room.\nActions: go east | take key")
    assert format_observation("w", "r", ["go east"], numbered=True, reply_format="command_number",
                              one_per_line=True).endswith("Actions:\ngo east = 1")
    tasks = TextWorldTasks(train_files, train_files[0].parent, max_turns=4,
                           style=ObservationStyle(max_feedback_chars=80, actions_per_line=True))
    episode = tasks.episode(0)
    observation = episode.reset()
    assert observation.split("\nActions:\n")[1].split("\n") == episode.admissible
    outcome = episode.step(episode.walkthrough[0])   # free text: the command as typed
    assert outcome.info["command"] == episode.walkthrough[0]
    episode.close()


def test_blind_style_hides_every_observation_but_plays_the_same_game(train_files):
    from rollout_bridge.envs.textworld_env import BLIND_OBSERVATION

    blind = TextWorldTasks(train_files, train_files[0].parent, max_turns=4,
                           style=ObservationStyle(max_feedback_chars=80, blind=True))
    sighted = TextWorldTasks(train_files, train_files[0].parent, max_turns=4,
                             style=ObservationStyle(max_feedback_chars=80))
    demo, seen = blind.demonstration(0), sighted.demonstration(0)
    assert [reply for _, reply in demo] == [reply for _, reply in seen]   # the same walkthrough commands
    assert all(obs == BLIND_OBSERVATION for obs, _ in demo)
    assert all(obs != BLIND_OBSERVATION for obs, _ in seen)
    episode = blind.episode(0)
    assert episode.reset() == BLIND_OBSERVATION
    outcome = episode.step("look")
    assert outcome.observation == BLIND_OBSERVATION and not outcome.won
    episode.close()


def test_observations_equal_textworlds_own_per_turn_description(data_dir, train_files):
    """An episode reads the room description once, at reset (`read_description`), instead of
    asking TextWorld for it every turn (which plays "look" after each command). Every
    observation, and the game's course, equal those of a game started with TextWorld's own
    `description` info: the reset shows its description, each step the game's answer."""
    import textworld

    from rollout_bridge.envs.textworld_env import clean_feedback, format_observation, start_game

    files = list(train_files) + generate_game_set(TWO_STEP, data_dir)
    infos = textworld.EnvInfos(admissible_commands=True, objective=True, description=True,
                               won=True, lost=True, extras=["walkthrough"])
    for path in files:
        reference = start_game(str(path), infos)
        state = reference.reset()
        episode = TextWorldEpisode(str(path), max_turns=8)
        assert episode.reset() == format_observation(
            state["objective"], clean_feedback(state["description"]), state["admissible_commands"])
        # junk, a move that changes nothing, then the walkthrough to a win
        for command in ["xyzzy", "look", *state["extra.walkthrough"]]:
            state, _, _ = reference.step(command)
            outcome = episode.step(command)
            assert outcome.observation == format_observation(
                state["objective"], clean_feedback(state.feedback), state["admissible_commands"])
            assert outcome.won == bool(state["won"])
        assert outcome.won and outcome.reward == 1.0
        reference.close()
        episode.close()


def test_turn_limit_ends_episode_without_reward(tasks):
    env = TextWorldEnv(tasks)
    env.reset(0)
    results = [env.step("look") for _ in range(tasks.max_turns)]
    assert [r.done for r in results] == [False] * (tasks.max_turns - 1) + [True]
    assert all(r.reward == 0.0 for r in results)
    with pytest.raises(RuntimeError):
        env.step("look")
    env.close()


def test_bad_task_id_rejected(tasks):
    env = TextWorldEnv(tasks)
    for bad in (-1, tasks.num_tasks, 1.5):
        with pytest.raises(ValueError, match="task_id"):
            env.reset(bad)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300))
def test_any_text_is_an_observation(tasks, text):
    """Nothing a model might type crashes the env: unicode, control chars, newlines, long."""
    env = TextWorldEnv(tasks)
    env.reset(1)
    result = env.step(text)
    assert isinstance(result.observation, str) and result.observation.startswith("Goal: ")
    assert result.reward in (0.0, 1.0)
    command = sanitize_command(text)
    assert len(command) <= MAX_COMMAND_CHARS and "\n" not in command
    assert all(32 <= ord(c) < 127 for c in command)
    if not result.done:                    # the game is still playable afterwards
        assert env.step("look").observation.startswith("Goal: ")
    env.close()


def test_known_junk_commands(tasks):
    env = TextWorldEnv(tasks)
    env.reset(0)
    answers = [env.step(cmd).observation.split("\n")[1]
               for cmd in ("xyzzy", "", "\x00\x1b[2J", "take " + "x" * 5000)]
    assert answers[0] == "That's not a verb I recognise."
    assert all(isinstance(a, str) and a for a in answers)
    env.close()


def test_sanitize_and_clean():
    assert sanitize_command("\n  go east  \nopen door") == "go east"
    assert sanitize_command("日本 look") == "look"
    assert sanitize_command("") == ""
    assert sanitize_command("open \\door") == "open door"   # frotz reads "\\" as an escape
    assert clean_feedback("\nYou see.\n\n\n>   -= Room =-0/1") == "You see."
    assert clean_feedback("a" * 50, max_chars=10) == "a" * 10 + " ..."


def test_warm_start_set_is_disjoint(data_dir, train_files):
    # WARM uses the very same seeds as TRAIN: every game would collide and must be replaced
    warm = generate_disjoint_game_set(WARM, data_dir, [TRAIN])
    assert len(warm) == WARM.num_games
    sig = lambda folder: {game_signature(g) for g in
                          json.loads((folder / "manifest.json").read_text())["games"]}
    assert not sig(warm[0].parent) & sig(train_files[0].parent)
    # the same spec without exclusions is another set in another folder (no overwrite)
    plain = generate_game_set(WARM, data_dir)
    assert plain[0].parent != warm[0].parent
    assert sig(plain[0].parent) == sig(train_files[0].parent)    # same seeds, same games
    assert generate_disjoint_game_set(WARM, data_dir, [TRAIN]) == warm   # reused
    assert sorted(p.name for p in warm[0].parent.glob("*.z8")) == sorted(p.name for p in warm)


def test_missing_or_empty_folder_fails_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        list_game_files(tmp_path / "nope")
    (tmp_path / "old.ulx").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="ulx"):
        list_game_files(tmp_path)


def test_bad_spec_values_named():
    with pytest.raises(ValueError, match="num_games"):
        GameSetSpec("x", num_games=0, base_seed=0)
    with pytest.raises(ValueError, match="quest_length"):
        GameSetSpec("x", num_games=1, base_seed=0, quest_length=0)
