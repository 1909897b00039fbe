"""The ALFWorld environment plays both a generated game and a game folder in the layout of
ALFWorld's released data (json_2.1.1/<split>/<task>/<trial>/game.tw-pddl + traj_data.json,
hand-written here from the issue's example, no stored walkthrough): admissible commands,
won flag, the 50-turn limit, the planner / hand-coded expert's plans, numbered replies, a
pool that reuses fast-downward players."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("alfworld")
pytest.importorskip("fast_downward")

from rollout_bridge.envs import alfworld_games as games  # noqa: E402
from rollout_bridge.envs.alfworld_env import (  # noqa: E402
    ALFWORLD_MAX_TURNS,
    AlfworldEnv,
    AlfworldTasks,
    command_number_list,
    command_number_reply,
    resolve_command_number,
    split_intro,
)
from rollout_bridge.envs.base import Environment, StepResult  # noqa: E402
from rollout_bridge.envs.textworld_env import ObservationStyle  # noqa: E402

APPLE = "Apple_bar__plus_00_dot_30_bar__plus_00_dot_90_bar__minus_01_dot_20"
COUNTER = "CounterTop_bar__plus_00_dot_69_bar__plus_00_dot_95_bar__minus_02_dot_48"
FRIDGE = "Fridge_bar__minus_02_dot_10_bar__plus_00_dot_00_bar__plus_01_dot_07"
LOCS = ("loc_bar_3_bar__minus_7_bar_2_bar_30", "loc_bar__minus_4_bar_4_bar_3_bar_30",
        "loc_bar_0_bar_0_bar_0_bar_30")
HAND_PROBLEM = f"""(define (problem plan_hand)
(:domain alfred)
(:objects
agent1 - agent
AppleType - otype
CounterTopType - rtype
FridgeType - rtype
{APPLE} - object
{COUNTER} - receptacle
{FRIDGE} - receptacle
{LOCS[0]} - location
{LOCS[1]} - location
{LOCS[2]} - location
)
(:init
(atLocation agent1 {LOCS[2]})
(receptacleType {COUNTER} CounterTopType)
(receptacleType {FRIDGE} FridgeType)
(receptacleAtLocation {COUNTER} {LOCS[0]})
(receptacleAtLocation {FRIDGE} {LOCS[1]})
(openable {FRIDGE})
(objectType {APPLE} AppleType)
(pickupable {APPLE})
(coolable {APPLE})
(inReceptacle {APPLE} {COUNTER})
(objectAtLocation {APPLE} {LOCS[0]})
(canContain FridgeType AppleType)
(canContain CounterTopType AppleType)
(= (distance {LOCS[0]} {LOCS[1]}) 4)
(= (distance {LOCS[1]} {LOCS[0]}) 4)
)
(:goal (and (exists (?r - receptacle) (exists (?o - object) (and (inReceptacle ?o ?r)
 (objectType ?o AppleType) (receptacleType ?r FridgeType))))))
)
"""
HAND_WALKTHROUGH = ["go to countertop 1", "take apple 1 from countertop 1", "go to fridge 1",
                    "open fridge 1", "move apple 1 to fridge 1"]


@pytest.fixture(scope="module")
def released_layout(tmp_path_factory):
    """A folder shaped like $ALFWORLD_DATA/json_2.1.1/train with one hand-written game."""
    root = tmp_path_factory.mktemp("alfworld_data") / "json_2.1.1" / "train"
    trial = root / "pick_and_place_simple-Apple-None-Fridge-1" / "trial_T20190000_000000_000000"
    trial.mkdir(parents=True)
    data = games.package_data()
    (trial / games.GAME_FILE).write_text(json.dumps({
        "pddl_domain": data["domain"],
        "grammar": data["grammar"].replace(games.GOAL_PLACEHOLDER, "put an apple in fridge"),
        "pddl_problem": HAND_PROBLEM, "solvable": True}))
    (trial / games.TRAJ_DATA).write_text(json.dumps({
        "task_type": "pick_and_place_simple",
        "pddl_params": {"object_target": "Apple", "parent_target": "Fridge", "toggle_target": "",
                        "mrecep_target": "", "object_sliced": False}}))
    return root


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    spec = games.AlfworldSetSpec("envtest", num_games=2, base_seed=3, max_distractors=2,
                                 task_types=("pick_cool_then_place_in_recep",
                                             "look_at_obj_in_light"))
    data_dir = tmp_path_factory.mktemp("alfworld_gen")
    games.generate_game_set(spec, data_dir)
    return data_dir / spec.folder_name


def test_downloaded_layout_plays_to_a_win_with_replanned_walkthrough(released_layout):
    tasks = AlfworldTasks.from_folder(released_layout)
    env = AlfworldEnv(tasks)
    assert isinstance(env, Environment) and env.num_tasks == 1
    assert tasks.max_turns == ALFWORLD_MAX_TURNS == 50
    observation = env.reset(0)
    assert observation.startswith("Goal: put an apple in fridge.\n")
    assert "you see a countertop 1, and a fridge 1" in observation
    assert "Welcome" not in observation
    episode = env.last_episode
    assert episode.walkthrough == HAND_WALKTHROUGH    # no stored walkthrough: the planner's
    assert observation.endswith("Actions: " + " | ".join(episode.admissible))
    assert "go to fridge 1" in episode.admissible and "open fridge 1" not in episode.admissible
    results = [env.step(command) for command in HAND_WALKTHROUGH]
    assert all(isinstance(r, StepResult) for r in results)
    assert [r.reward for r in results] == [0.0] * 4 + [1.0] and results[-1].done
    assert "You move the apple 1 to the fridge 1." in results[-1].observation
    env.close()
    tasks.close()


def test_generated_games_play_and_demonstrate(generated):
    tasks = AlfworldTasks.from_folder(generated,
                                      style=ObservationStyle(2000, numbered_actions=True))
    created = None
    for task_id in range(tasks.num_tasks):
        pairs = tasks.demonstration(task_id)
        assert pairs and all(reply.isdigit() for _, reply in pairs)
        assert all(obs.startswith("Goal: ") for obs, _ in pairs)
        created = tasks.pool.created if created is None else created
    assert tasks.pool.created == created      # demonstrations reused the same player


def test_turn_limit_ends_without_reward_and_nonsense_is_an_observation(released_layout):
    tasks = AlfworldTasks.from_folder(released_layout, max_turns=3)
    env = AlfworldEnv(tasks)
    env.reset(0)
    results = [env.step(text) for text in ("fly to the moon", "\x00\\", "go to fridge 1")]
    assert [r.done for r in results] == [False, False, True]
    assert all(r.reward == 0.0 for r in results)
    assert results[0].observation.split("\n")[1] == "Nothing happens."
    with pytest.raises(RuntimeError, match="over"):
        env.step("look")
    with pytest.raises(ValueError, match="task_id"):
        env.reset(1)
    env.close()
    tasks.close()


@pytest.mark.parametrize("expert", ["planner", "handcoded"])
def test_expert_plans_follow_the_game(released_layout, expert):
    tasks = AlfworldTasks.from_folder(released_layout, expert=expert)
    episode = tasks.episode(0)
    episode.reset()
    taken = []
    for _ in range(10):
        assert episode.expert_plan, expert
        command = episode.expert_plan[0]
        if command not in episode.admissible:        # hand-coded expert's first move is "look"
            assert command == "look"
        taken.append(command)
        if episode.step(command).won:
            break
    assert episode.won, taken
    episode.close()
    tasks.close()


def test_sequential_envs_share_one_player(released_layout, generated):
    tasks = AlfworldTasks.from_folder(released_layout)
    other = AlfworldTasks.from_folder(generated)
    assert other.pool is tasks.pool                # one pool per process (per expert type)
    created = None
    for round_ in range(4):
        env = AlfworldEnv(tasks if round_ % 2 else other)
        env.reset(0)
        env.step("look")
        env.close()
        created = tasks.pool.created if created is None else created
    assert tasks.pool.created == created


def test_split_intro():
    intro = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.\n\n"
             "Your task is to: put a clean mug in cabinet.")
    assert split_intro(intro) == ("put a clean mug in cabinet.", "You are in the middle of a room.")
    assert split_intro("no task here") == ("", "no task here")


def _transcript(tasks) -> list[str]:
    lines = []
    for task_id in range(tasks.num_tasks):
        episode = tasks.episode(task_id)
        lines.append(episode.reset())
        lines += [episode.step(c).observation for c in episode.walkthrough + ["look"]
                  if not episode.done]
        episode.close()
    return lines


def test_speedups_leave_the_game_text_unchanged(generated, released_layout, monkeypatch):
    from textworld.envs.pddl import textgen

    from rollout_bridge.envs import alfworld_env

    folders = (generated, released_layout)
    alfworld_env.uninstall_speedups()
    monkeypatch.setattr(alfworld_env, "install_speedups", lambda: None)
    try:
        assert not hasattr(textgen._parse_and_convert, "original")
        plain = [_transcript(AlfworldTasks.from_folder(f)) for f in folders]
    finally:
        monkeypatch.undo()
        alfworld_env.install_speedups()
    assert hasattr(textgen._parse_and_convert, "original")
    fast = [_transcript(AlfworldTasks.from_folder(f)) for f in folders]
    fast_again = [_transcript(AlfworldTasks.from_folder(f)) for f in folders]   # from cache
    assert plain == fast == fast_again
    assert len(plain[0]) > 4 and "You move the apple 1 to the fridge 1." in plain[1][-1]


def test_textworld_tasks_refuse_alfworld_games_by_name(released_layout):
    from rollout_bridge.envs.textworld_env import TextWorldTasks

    with pytest.raises(ValueError, match=r"game\.tw-pddl is an ALFWorld game.*AlfworldTasks"):
        TextWorldTasks.from_folder(released_layout)


def test_concurrent_episodes_in_threads_do_not_break(generated):
    """textworld's PDDL engine parses with tatsu on every step (not thread-safe): before
    the engine lock, 8 threads stepping at once lost episodes to IndexError."""
    import random
    import threading

    tasks = AlfworldTasks.from_folder(generated, max_turns=6,
                                      style=ObservationStyle(240, numbered_actions=True))
    errors = []

    def play(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2):
            env = AlfworldEnv(tasks)
            try:
                env.reset(rng.randrange(tasks.num_tasks))
                for _ in range(4):
                    reply = str(rng.randint(1, len(env.last_episode.admissible)))
                    if env.step(reply).done:
                        break
            except Exception as exc:   # noqa: BLE001 - counted, then asserted empty
                errors.append(f"{type(exc).__name__}: {exc}")
            finally:
                env.close()
    threads = [threading.Thread(target=play, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []


ADMISSIBLE = ["examine drawer 1", "go to bed 1", "go to drawer 2", "look", "open drawer 1"]


@pytest.mark.parametrize("reply, played", [
    ("go to drawer 2 = 3", "go to drawer 2"),     # command and its number
    ("go to drawer 2 = 5", "go to drawer 2"),     # a wrong number: the command text plays
    ("go to drawer 9 = 5", "open drawer 1"),      # not a command: its number plays
    ("go to drawer 2", "go to drawer 2"),         # the command alone
    ("go to drawer 9 = 6", "go to drawer 9 = 6"),  # neither: sent as typed (the game answers)
    ("3", "3"),                                   # a bare number is not this format's reply
])
def test_command_number_replies_resolve(reply, played):
    assert resolve_command_number(reply, ADMISSIBLE) == played


def test_command_number_list_and_reply_round_trip():
    shown = command_number_list(ADMISSIBLE)
    assert shown[0] == "examine drawer 1 = 1" and shown[-1] == "open drawer 1 = 5"
    for k, command in enumerate(ADMISSIBLE, 1):
        reply = command_number_reply(command, ADMISSIBLE)
        assert reply == shown[k - 1] and resolve_command_number(reply, ADMISSIBLE) == command
    assert command_number_reply("fly", ADMISSIBLE) == "fly"


def test_command_numbers_list_commands_then_numbers_and_demonstrate(released_layout):
    tasks = AlfworldTasks.from_folder(released_layout, command_numbers=True)
    env = AlfworldEnv(tasks)
    observation = env.reset(0)
    episode = env.last_episode
    assert observation.endswith("Actions: " + " | ".join(command_number_list(episode.admissible)))
    assert env.step("go to countertop 1 = 99").observation.split("\n")[1].startswith(
        "You arrive at countertop 1.")                # the command text decides
    env.close()
    pairs = tasks.demonstration(0)
    assert [reply.rsplit(" = ", 1)[0] for _, reply in pairs] == HAND_WALKTHROUGH
    assert all(reply.rsplit(" = ", 1)[1].isdigit() for _, reply in pairs)


def test_actions_per_line_list_one_command_per_line_and_play_the_typed_text(released_layout):
    tasks = AlfworldTasks.from_folder(released_layout, style=ObservationStyle(2000, actions_per_line=True))
    env = AlfworldEnv(tasks)
    observation = env.reset(0)
    episode = env.last_episode
    assert observation.endswith("Actions:\n" + "\n".join(episode.admissible))
    assert env.step("go to countertop 1").observation.split("\n")[1].startswith("You arrive at countertop 1.")
    env.close()
    pairs = tasks.demonstration(0)
    assert [reply for _, reply in pairs] == HAND_WALKTHROUGH and "Actions:\n" in pairs[0][0]
    tasks.close()
