"""The agentic TextWorld task of configs/textworld_agentic.yaml: shuffled number-only
actions, the goal once, parallel generation, and the exact prompt-blind ceiling.

References nobody here wrote: the z-machine game itself (the admissible commands the DP
expands must be the ones the compiled game lists, and a blind policy played through the
real environment must win as often as the DP says), and brute-force enumeration of every
command sequence (the DP's recursion, SPEC-style, checked against the definition).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from rollout_bridge.envs.textworld_blind import _GameLogic, blind_ceilings, random_walk_success
from rollout_bridge.envs.textworld_env import (NOT_A_NUMBER_FEEDBACK, ObservationStyle, TextWorldTasks,
                                               resolve_command, shown_number)
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set, set_signatures

# 2 rooms, quest length 2: small enough to enumerate every 3-command sequence.
SMALL = GameSetSpec("agentic", num_games=3, base_seed=7, world_size=2, nb_objects=2, quest_length=2)
AGENTIC = ObservationStyle(max_feedback_chars=600, numbered_actions=True, shuffle_actions=True,
                           free_text=False, shuffle_seed=0, goal_every_turn=False)
BLIND_EPISODES = 150      # Monte-Carlo episodes per blind policy through the real game
MC_SIGMAS = 4.0           # tolerance of the Monte-Carlo check, in binomial SEs
COMMAND_NUMBER = dataclasses.replace(AGENTIC, reply_format="command_number")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return generate_game_set(SMALL, tmp_path_factory.mktemp("games"), workers=2)


@pytest.fixture(scope="module")
def tasks(files):
    return TextWorldTasks(files, files[0].parent, max_turns=3, style=AGENTIC)


def test_parallel_generation_equals_serial(files, tmp_path):
    serial = generate_game_set(SMALL, tmp_path, workers=1)
    assert [p.name for p in serial] == [p.name for p in files]
    assert set_signatures(serial) == set_signatures(files)
    assert sorted(p.name for p in files[0].parent.glob("*.z8")) == [p.name for p in files]   # no extras left


def test_shuffled_numbers_play_the_shown_command(tasks):
    episode = tasks.episode(0)
    first = episode.reset()
    assert first.startswith("Goal: ")
    shown = list(episode.admissible)
    assert sorted(shown) == sorted(set(shown))
    assert f"1 {shown[0]} |" in first
    outcome = episode.step("1")
    assert outcome.info["command"] == shown[0]
    assert not outcome.observation.startswith("Goal: ")   # the goal heads the first observation only


def test_orders_differ_between_episodes_and_repeat_on_reset(tasks):
    orders = []
    for _ in range(6):
        episode = tasks.episode(0)
        episode.reset()
        orders.append(tuple(episode.admissible))
    assert len(set(orders)) > 1
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    episode = tasks.episode(0)
    episode.reset()
    again = tuple(episode.admissible)
    episode.reset()
    assert tuple(episode.admissible) == again


@pytest.mark.parametrize("reply", ["open door", "0", "99", "", "go north", "<a shown command>"])
def test_a_reply_that_is_no_shown_number_plays_nothing(tasks, reply):
    episode = tasks.episode(1)
    episode.reset()
    reply = episode.admissible[0] if reply == "<a shown command>" else reply   # its text is no number
    before = sorted(episode.admissible)
    outcome = episode.step(reply)
    assert NOT_A_NUMBER_FEEDBACK in outcome.observation and outcome.reward == 0.0
    assert outcome.info["not_a_number"] and episode.commands == [] and episode.turns == 1
    assert sorted(episode.admissible) == before


def test_walkthrough_demonstration_wins_with_numbers(tasks):
    for t in range(tasks.num_tasks):
        pairs = tasks.demonstration(t)
        assert all(reply.isdigit() for _, reply in pairs)


def test_free_text_off_needs_numbers():
    with pytest.raises(ValueError, match="numbered_actions"):
        ObservationStyle(numbered_actions=False, free_text=False)


def test_logic_commands_are_the_games_admissible_commands(files):
    """Along the walkthrough the DP's command lists equal the compiled game's lists."""
    plain = TextWorldTasks(files, files[0].parent, max_turns=8)
    for t, path in enumerate(plain.game_files):
        logic = _GameLogic(path.replace(".z8", ".json"))
        state = logic.start()
        episode = plain.episode(t)
        episode.reset()
        for command in episode.walkthrough:
            commands = logic.commands(state)
            assert list(commands) == episode.admissible
            state.apply(commands[command])
            episode.step(command)
        assert logic.won(state) and episode.won


def _brute_force(path: str, turns: int) -> float:
    """Mean over all equally likely command paths of 'won within `turns`' (the definition)."""
    logic = _GameLogic(path)

    def value(state, left: int) -> float:
        if logic.won(state):
            return 1.0
        if left == 0:
            return 0.0
        children = logic.successors(state)
        return float(np.mean([value(child, left - 1) for child in children]))

    return value(logic.start(), turns)


@pytest.mark.parametrize("turns", [0, 1, 2, 3])
def test_dp_equals_brute_force(files, turns):
    for path in files:
        json_path = str(path).replace(".z8", ".json")
        assert random_walk_success(json_path, turns) == pytest.approx(_brute_force(json_path, turns), abs=1e-12)


def test_blind_policies_through_the_real_game_match_the_ceiling(files, tasks):
    """A policy that always replies '1' (or cycles 2, 1, 3) never reads: played through the
    z-machine game, its success matches the exact ceiling within Monte-Carlo error."""
    ceiling = blind_ceilings(files, tasks.max_turns)
    rng = np.random.default_rng(0)
    for replies in (itertools.repeat("1"), itertools.cycle(["2", "1", "3"])):
        script = list(itertools.islice(replies, tasks.max_turns))
        task_ids = rng.integers(0, tasks.num_tasks, BLIND_EPISODES)
        wins = []
        for t in task_ids:
            episode = tasks.episode(int(t))
            episode.reset()
            for reply in script:
                if episode.done:
                    break
                episode.step(reply if int(reply) <= len(episode.admissible) else "1")
            wins.append(episode.won)
            episode.close()
        expected = float(ceiling[task_ids].mean())
        se = np.sqrt(max(expected * (1 - expected), 1e-3) / BLIND_EPISODES)
        assert abs(np.mean(wins) - expected) < MC_SIGMAS * se, (np.mean(wins), expected)


def test_ceilings_are_cached(files, tmp_path):
    first = blind_ceilings(files, 2)
    cache = files[0].parent / "blind_ceiling.json"
    assert cache.exists()
    assert np.array_equal(blind_ceilings(files, 2), first)
    assert ((0 <= first) & (first <= 1)).all()


def test_a_game_its_walkthrough_cannot_win_is_skipped(tmp_path):
    """tw-make seed 100171 (3 rooms, 4 objects, quest length 3) names a 'type P box' and a
    'box': the compiled game answers the walkthrough's 'take type P latchkey from box' with
    'Which do you mean...', so the walkthrough never wins and the seed is not a task."""
    from rollout_bridge.envs.textworld_games import generate_game

    spec = GameSetSpec("ambiguous", num_games=1, base_seed=100171, world_size=3, nb_objects=4, quest_length=3)
    path = tmp_path / "game_100171.z8"
    assert generate_game(100171, spec, path) is None
    assert not list(tmp_path.iterdir())
    fine = generate_game(100172, spec, tmp_path / "game_100172.z8")
    assert fine is not None and fine["walkthrough"]


@pytest.mark.parametrize("reply, number", [
    ("3", 3), ("go south = 3", 3), ("go south=12", 12), ("  take key from box =  2 ", 2),
    ("a = b = 4", 4), ("0", 0)])
def test_command_number_reply_names_the_number_after_the_last_equals(reply, number):
    assert shown_number(reply, "command_number") == number


@pytest.mark.parametrize("reply", ["go south", "go south =", "= ", "", "go south = 3a", "3 = go south",
                                   "go south = -1", "go south = 2.5", "go south = \u00b2"])
def test_malformed_command_number_replies_name_no_number(reply):
    assert shown_number(reply, "command_number") is None


def test_number_format_accepts_only_a_bare_number():
    assert shown_number("3", "number") == 3
    assert shown_number("go south = 3", "number") is None
    assert resolve_command("go south = 3", ["a", "b", "c"], True, "number") == "go south = 3"
    with pytest.raises(ValueError, match="reply_format"):
        shown_number("3", "text")
    with pytest.raises(ValueError, match="reply_format"):
        ObservationStyle(reply_format="text")


def test_command_number_lists_text_then_number_and_plays_only_the_number(tasks):
    """The list reads "<command> = <k>"; the reply's text is ignored: the command played is
    the k-th shown, even when the text names another command."""
    episode = TextWorldTasks(tasks.game_files, tasks.root, max_turns=6, style=COMMAND_NUMBER).episode(0)
    first = episode.reset()
    shown = list(episode.admissible)
    assert f"{shown[0]} = 1 | {shown[1]} = 2" in first
    assert episode.reply_for(shown[1]) == f"{shown[1]} = 2"
    outcome = episode.step(f"{shown[1]} = 1")
    assert outcome.info["command"] == shown[0]
    for reply in (shown[0], f"{shown[0]} = {len(shown) + 1}", f"{shown[0]} = 0"):
        outcome = episode.step(reply)
        assert outcome.info.get("not_a_number") and len(episode.commands) == 1


def test_command_number_demonstrations_win(tasks):
    replay = TextWorldTasks(tasks.game_files, tasks.root, max_turns=3, style=COMMAND_NUMBER)
    for t in range(replay.num_tasks):
        pairs = replay.demonstration(t)
        assert all(shown_number(reply, "command_number") is not None and " = " in reply for _, reply in pairs)


def test_blind_command_number_replies_match_the_ceiling(files, tasks):
    """The ceiling argument for "command_number": a blind policy that always types the same
    command text (the walkthrough's first command of game 0) with number 1 plays a uniformly
    random shown command, whatever the text says; through the real game its success
    matches the exact ceiling within Monte-Carlo error."""
    replay = TextWorldTasks(tasks.game_files, tasks.root, max_turns=3, style=COMMAND_NUMBER)
    walkthrough_first = replay.demonstration(0)[0][1].rpartition("=")[0].strip()
    ceiling = blind_ceilings(files, replay.max_turns)
    task_ids = np.random.default_rng(1).integers(0, replay.num_tasks, BLIND_EPISODES)
    wins, hits, firsts = [], 0, 0
    for t in task_ids:
        episode = replay.episode(int(t))
        episode.reset()
        while not episode.done:
            outcome = episode.step(f"{walkthrough_first} = 1")
            if t == 0 and episode.turns == 1:
                firsts += 1
                hits += outcome.info["command"] == walkthrough_first
        wins.append(episode.won)
        episode.close()
    expected = float(ceiling[task_ids].mean())
    se = np.sqrt(max(expected * (1 - expected), 1e-3) / BLIND_EPISODES)
    assert abs(np.mean(wins) - expected) < MC_SIGMAS * se, (np.mean(wins), expected)
    assert hits < firsts   # the text did not choose the command
