"""Renamed warm-start demonstrations: every name of a game rewritten the same way in every
turn, whole words only, longer names first; the rest of the text and the walkthrough's
verbs untouched; deterministic per demonstration; `fraction` 0 changes nothing."""

from __future__ import annotations

import re

import numpy as np
import pytest

from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldTasks
from rollout_bridge.envs.textworld_games import GameSetSpec, generate_game_set
from rollout_bridge.envs.textworld_rename import (
    RenamedDemonstrations,
    random_names,
    rename_text,
    textworld_entity_names,
    textworld_names_of,
)

GAMES = GameSetSpec("rename", num_games=2, base_seed=3, world_size=2, nb_objects=3, quest_length=2)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    files = generate_game_set(GAMES, tmp_path_factory.mktemp("tw_rename"))
    return TextWorldTasks(files, files[0].parent, max_turns=8, style=ObservationStyle(max_feedback_chars=600))


class FixedDemonstrations:
    def __init__(self, pairs):
        self.pairs = pairs

    num_tasks = 3

    def demonstration(self, index):
        return list(self.pairs)


def test_whole_words_longest_first_case_insensitive():
    mapping = {"box": "kavo", "Canadian style box": "temi ruza", "chamber": "pilo"}
    text = "-= Bedchamber =- A Canadian style box and a BOX. The chamber, boxes. take shadfly from Canadian style box"
    assert rename_text(text, mapping) == (
        "-= Bedchamber =- A temi ruza and a kavo. The pilo, boxes. take shadfly from temi ruza")
    assert rename_text("unchanged", {}) == "unchanged"


def test_random_names_are_distinct_deterministic_and_keep_up_to_two_words():
    names = ["box", "pair of headphones", "Advent Calendar", "latchkey"] + [f"thing {i}" for i in range(40)]
    first = random_names(names, np.random.default_rng(7))
    assert first == random_names(names, np.random.default_rng(7))
    assert len(set(first.values())) == len(names)
    assert all(re.fullmatch(r"[a-z]+( [a-z]+)?", new) for new in first.values())
    assert len(first["box"].split()) == 1 and len(first["pair of headphones"].split()) == 2


def test_every_turn_uses_the_same_mapping_and_fraction_zero_is_identity():
    pairs = [("Goal: take the red key.\nYou see a red key. Actions: take red key | go east", "take red key"),
             ("You take the red key.\nActions: drop red key | go east", "go east")]
    renamed = RenamedDemonstrations(FixedDemonstrations(pairs), lambda i: ("red key",), fraction=1.0, seed=0)
    out = renamed.demonstration(1)
    new = out[0][1].removeprefix("take ")
    assert new != "red key" and "red key" not in " ".join(o + r for o, r in out)
    assert out[0][0].count(new) == 3 and out[1][0] == f"You take the {new}.\nActions: drop {new} | go east"
    assert out[1][1] == "go east"
    assert renamed.demonstration(1) == out                       # deterministic per index
    assert renamed.demonstration(2) != out                       # a fresh mapping per demonstration
    same = RenamedDemonstrations(FixedDemonstrations(pairs), lambda i: ("red key",), fraction=0.0)
    assert same.demonstration(1) == pairs
    with pytest.raises(ValueError, match="fraction"):
        RenamedDemonstrations(FixedDemonstrations(pairs), lambda i: (), fraction=1.5)


def test_generated_games_walkthroughs_are_renamed_consistently(tasks):
    names_of = textworld_names_of(tasks.game_files)
    for task in range(tasks.num_tasks):
        names = textworld_entity_names(tasks.game_files[task])
        assert names and names_of(task + tasks.num_tasks) == names   # item i is game i mod n
        original = tasks.demonstration(task)
        renamed = RenamedDemonstrations(tasks, names_of, fraction=1.0, seed=1).demonstration(task)
        assert len(renamed) == len(original)
        for (obs, reply), (new_obs, new_reply) in zip(original, renamed):
            assert new_reply.split()[0] == reply.split()[0]           # the verb is kept
            for name in names:
                assert not re.search(rf"\b{re.escape(name)}\b", new_obs + " " + new_reply, re.IGNORECASE), name
        assert any(o != n for o, n in zip(original, renamed))


def test_missing_game_description_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="game description"):
        textworld_entity_names(str(tmp_path / "game.z8"))


def renaming(tasks, fraction: float) -> TextWorldTasks:
    import dataclasses

    return TextWorldTasks(tasks.game_files, tasks.root, tasks.max_turns,
                          dataclasses.replace(tasks.style, rename_fraction=fraction, shuffle_actions=True))


def test_renamed_episodes_hide_every_name_and_still_win(tasks):
    """env.rename_episodes: an episode drawn to rename shows no original name in any
    observation, the walkthrough typed in the new names still wins (commands are renamed
    back), and the action orders are those of the same episode seed without renaming."""
    plain, renamed = renaming(tasks, 0.0), renaming(tasks, 1.0)
    for task in range(tasks.num_tasks):
        names = textworld_entity_names(tasks.game_files[task])
        episode, control = renamed.episode(task, seed=5), plain.episode(task, seed=5)
        observation, control_observation = episode.reset(), control.reset()
        assert episode.renamed and not control.renamed
        assert observation == episode._rename(control_observation) != control_observation
        seen = [observation]
        for command in episode.walkthrough:
            reply = episode.reply_for(command)
            assert reply.split()[0] == command.split()[0]
            outcome = episode.step(reply)
            seen.append(outcome.observation)
            if outcome.done:
                break
        assert episode.won
        for name in names:
            assert not re.search(rf"\b{re.escape(name)}\b", "\n".join(seen), re.IGNORECASE), name
        again = renamed.episode(task, seed=5)
        assert again.reset() == observation                        # the seed fixes the names
        assert renamed.episode(task, seed=6).reset() != observation   # another episode, other names
        for e in (episode, control, again):
            e.close()


def test_rename_fraction_is_drawn_per_episode(tasks):
    half = renaming(tasks, 0.5)
    drawn = []
    for seed in range(24):
        episode = half.episode(0, seed=seed)
        episode.reset()
        drawn.append(episode.renamed)
        episode.close()
    assert 0 < sum(drawn) < len(drawn)
    with pytest.raises(ValueError, match="rename_fraction"):
        ObservationStyle(rename_fraction=1.5)


def test_rename_episodes_is_keyed_only_when_set():
    import dataclasses

    from rollout_bridge.run_folder import stage_key
    from rollout_bridge.config import TrainConfig

    cfg = TrainConfig()
    assert "rename_episodes" not in stage_key(cfg, "env")["env"]   # records written before it stay valid
    renamed = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, rename_episodes=1.0))
    assert stage_key(renamed, "env")["env"]["rename_episodes"] == 1.0
    with pytest.raises(Exception, match="rename_episodes"):
        dataclasses.replace(cfg.env, rename_episodes=2.0)
