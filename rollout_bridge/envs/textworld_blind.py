"""The prompt-blind ceiling of a TextWorld task set, computed exactly.

A *prompt-blind* policy never reads an observation: its reply at turn t depends only on
t and on its own earlier replies (and its own randomness). On the default task the
commands are shown numbered, in a fresh uniformly random order at every turn, and only a
shown command's number is played (`ObservationStyle(numbered_actions=True,
shuffle_actions=True, free_text=False)`). Whatever number such a policy types, the order
it indexes is uniform and independent of everything the policy has seen, so the command
played is uniform over the admissible ones; any other reply plays nothing. A blind policy
therefore only chooses, per turn, between "a uniformly random admissible command" and
"nothing". Winning ends the episode, so P(won within k random commands) is
non-decreasing in k and the best blind policy plays a random command at every turn. Its
success on game g with at most T turns is

    V_T(s0),   V_0(s) = won(s),   V_k(s) = 1 if won(s) else mean_{c in A(s)} V_{k-1}(s ∘ c)

over the game's logic states s (TextWorld's own rules, `textworld.logic.State`), A(s)
the distinct admissible commands (what the z-machine game lists; each plays its first
logic action, as TextWorld's own envs do) and lost states absorbing at 0. The ceiling of
a task set is the mean of V_T over its games (each game is one task, sampled with equal
weight by the evaluation). States are memoised by their facts; the states first reached
after T commands are never expanded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from rollout_bridge.envs.process_pool import worker_pool
from rollout_bridge.atomic_files import write_text_atomic

CACHE_NAME = "blind_ceiling.json"


class _GameLogic:
    """One game's logic: the start state, the distinct admissible commands of a state
    with the state each leads to, and the win / loss conditions."""

    def __init__(self, json_path: str | os.PathLike):
        import textworld
        from textworld.generator.inform7 import Inform7Game

        self.game = textworld.Game.load(str(json_path))
        self.inform7 = Inform7Game(self.game)
        self.rules = list(self.game.kb.rules.values())
        self.constants = self.game.kb.types.constants_mapping

    def start(self):
        return self.game.world.state.copy()

    def won(self, state) -> bool:
        return all(any(event.is_triggering(state) for event in quest.win_events) for quest in self.game.quests)

    def lost(self, state) -> bool:
        return any(any(event.is_triggering(state) for event in quest.fail_events) for quest in self.game.quests)

    def commands(self, state) -> dict[str, object]:
        """command text -> the logic action it plays (the first one, as TextWorld's envs)."""
        actions = list(state.all_applicable_actions(self.rules, self.constants))
        first: dict[str, object] = {}
        for command, action in zip(self.inform7.gen_commands_from_actions(actions), actions):
            first.setdefault(command, action)
        return dict(sorted(first.items()))

    def successors(self, state) -> list:
        """The state after each distinct admissible command, in sorted command order."""
        children = []
        for action in self.commands(state).values():
            child = state.copy()
            child.apply(action)
            children.append(child)
        return children


def random_walk_success(json_path: str | os.PathLike, max_turns: int) -> float:
    """V_T(s0) of the module docstring: P(the uniform random walk over admissible commands
    wins within `max_turns` commands) for the game whose TextWorld description is
    `json_path` (the `.json` next to a generated `.z8`)."""
    if max_turns < 0:
        raise ValueError(f"max_turns must be >= 0, got {max_turns}")
    logic = _GameLogic(json_path)
    start = logic.start()
    index = {frozenset(start.facts): 0}
    won, lost, children = [logic.won(start)], [logic.lost(start)], [None]
    level = [(0, start)]
    for _ in range(max_turns):   # expand the states first reached after 0..T-1 commands
        next_level = []
        for sid, state in level:
            if won[sid] or lost[sid]:
                continue
            kids = []
            for child in logic.successors(state):
                key = frozenset(child.facts)
                if key not in index:
                    index[key] = len(won)
                    won.append(logic.won(child))
                    lost.append(logic.lost(child))
                    children.append(None)
                    next_level.append((index[key], child))
                kids.append(index[key])
            children[sid] = kids
        level = next_level
    won_arr = np.asarray(won, np.float64)
    value = won_arr.copy()                           # V_0
    for _ in range(max_turns):                       # V_k from V_{k-1}
        new = won_arr.copy()
        for sid, kids in enumerate(children):
            if kids and not won[sid] and not lost[sid]:
                new[sid] = value[kids].mean()
        value = new
    return float(value[0])


def _description(game_file: str | os.PathLike) -> Path:
    path = Path(game_file).with_suffix(".json")
    if not path.exists():
        raise FileNotFoundError(f"{path} (TextWorld's game description) is missing: the blind ceiling "
                                "needs the .json written next to each generated game")
    return path


def blind_ceilings(game_files: Sequence[str | os.PathLike], max_turns: int, workers: int = 1,
                   progress: Callable[[int, int], None] | None = None) -> np.ndarray:
    """Per game, `random_walk_success` with `max_turns`; cached per game set folder in
    `blind_ceiling.json` (game file name -> {max_turns: value}); `workers` processes."""
    files = [Path(f) for f in game_files]
    caches = {folder: _read_cache(folder) for folder in {f.parent for f in files}}
    key = str(max_turns)
    todo = [f for f in files if key not in caches[f.parent].get(f.name, {})]
    done = len(files) - len(todo)
    if progress is not None:
        progress(done, len(files))
    if todo:
        with worker_pool(max(1, workers)) as pool:
            futures = [pool.submit(random_walk_success, _description(f), max_turns) for f in todo]
            for path, future in zip(todo, futures):
                caches[path.parent].setdefault(path.name, {})[key] = future.result()
                done += 1
                if progress is not None:
                    progress(done, len(files))
        for folder, cache in caches.items():
            _write_cache(folder, cache)
    return np.asarray([caches[f.parent][f.name][key] for f in files], np.float64)


def _read_cache(folder: Path) -> dict:
    try:
        return json.loads((folder / CACHE_NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _write_cache(folder: Path, cache: dict) -> None:
    write_text_atomic(folder / CACHE_NAME, json.dumps(cache, indent=1, sort_keys=True))
