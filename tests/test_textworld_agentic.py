"""The agentic TextWorld task of configs/textworld_agentic.yaml (issue #15): shuffled number-only
actions, the goal once, parallel generation, and the exact prompt-blind ceiling.

References nobody here wrote: the z-machine game itself (the admissible commands the DP
expands must be the ones the compiled game lists, and a blind policy played through the
real environment must win as often as the DP says), and brute-force enumeration of every
command sequence (the DP's recursion, SPEC-style, checked against the definition).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from rollout_bridge.envs.textworld_blind import _GameLogic, blind_ceilings, random_walk_success
from rollout_bridge.envs.textworld_env import (NOT_A_NUMBER_FEEDBACK, ObservationStyle, TextWorldTasks)
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set, set_signatures

# 2 rooms, quest length 2: small enough to enumerate every 3-command sequence.
SMALL = GameSetSpec("agentic", num_games=3, base_seed=7, world_size=2, nb_objects=2, quest_length=2)
AGENTIC = ObservationStyle(max_feedback_chars=600, numbered_actions=True, shuffle_actions=True,
                           free_text=False, shuffle_seed=0, goal_every_turn=False)
BLIND_EPISODES = 150      # Monte-Carlo episodes per blind policy through the real game
MC_SIGMAS = 4.0           # tolerance of the Monte-Carlo check, in binomial SEs


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


@pytest.mark.parametrize("reply", ["open door", "0", "99", "", "go north"])
def test_a_reply_that_is_no_shown_number_plays_nothing(tasks, reply):
    episode = tasks.episode(1)
    episode.reset()
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
