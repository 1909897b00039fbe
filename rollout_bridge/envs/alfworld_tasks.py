"""The ALFWorld env kind: its config, its task sets (train, held-out, warm start) and its
env factory — the entry point an env-kind registry calls (kind "alfworld").

    sets = build_task_sets(AlfworldTaskConfig(...), progress=...)
    factory = env_factory(sets.train)        # zero-argument callable -> AlfworldEnv

Generated games (`game_dir=None`): three sets from `rollout_bridge.envs.alfworld_games`,
cached under `data_dir`: `num_games` training games (seeds `game_seed + i`), then
`heldout_games` held-out games whose tasks (`<type>-<Obj>-None-<Recep>-<scene>`) never
occur in the training set, and `warmstart_games` warm-start games whose tasks occur in
neither (so the warm start teaches the skill, not the answers, and held-out success
measures transfer). With `alfred_floor_plans` (default) the training and warm-start sets
use only ALFRED's training floor plans (alfworld's `TRAIN_SCENE_NUMBERS`) and the held-out
set only its test floor plans (`TEST_SCENE_NUMBERS`), so held-out games are in rooms never
trained on; with `alfred_filter` (default) every set holds only tasks ALFRED's sampler
would make (`alfworld_games.alfred_exclusions`).
Downloaded games (`game_dir` = e.g. `$ALFWORLD_DATA/json_2.1.1/train`): `num_games` games
picked by a seeded shuffle (0 = all); `heldout_dir` (e.g. `.../valid_unseen`) for the
held-out set; the warm start needs generated games (or none).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from rollout_bridge.envs import alfworld_games as games
from rollout_bridge.envs.alfworld_env import (
    ALFWORLD_MAX_TURNS,
    AlfworldEnv,
    AlfworldTasks,
    list_alfworld_games,
)
from rollout_bridge.envs.textworld_env import ObservationStyle

Progress = Callable[[str], Callable[[int, int], None]]   # set name -> (done, total) callback


@dataclasses.dataclass(frozen=True)
class AlfworldTaskConfig:
    """What the ALFWorld kind needs (each field read here only)."""

    game_dir: Optional[str] = None
    heldout_dir: Optional[str] = None
    data_dir: str = "artifacts/alfworld_games"
    num_games: int = 128
    game_seed: int = 0
    heldout_games: int = 32
    heldout_seed: int = 200_000
    warmstart_games: int = 0
    warmstart_seed: int = 100_000
    task_types: tuple[str, ...] = games.TASK_TYPES
    max_distractors: int = 6
    max_receptacles: Optional[int] = None
    alfred_filter: bool = True        # only tasks ALFRED's sampler would make
    alfred_floor_plans: bool = True   # train / warm start on ALFRED's training plans, held out on its test plans
    max_turns: int = ALFWORLD_MAX_TURNS
    max_feedback_chars: int = 2000
    numbered_actions: bool = False
    command_numbers: bool = False   # actions listed and replied as "<command> = <number>"
    actions_per_line: bool = False  # "Actions:" then one command per line
    workers: int = 2

    def __post_init__(self):
        for name in ("num_games", "heldout_games", "warmstart_games"):
            if getattr(self, name) < 0:
                raise ValueError(f"env.{name} must be >= 0, got {getattr(self, name)}")
        if self.game_dir is None and self.num_games < 1:
            raise ValueError(f"env.num_games must be >= 1 for generated games, got {self.num_games}")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")
        if self.workers < 1:
            raise ValueError(f"env.workers must be >= 1, got {self.workers}")

    @property
    def style(self) -> ObservationStyle:
        return ObservationStyle(self.max_feedback_chars, self.numbered_actions,
                                actions_per_line=self.actions_per_line)

    def spec(self, name: str, num_games: int, base_seed: int,
             exclude: frozenset = frozenset(), heldout: bool = False) -> games.AlfworldSetSpec:
        """The set `name`; `heldout` sets draw from the test floor plans, others from the
        training ones (both from every plan without `alfred_floor_plans`)."""
        floor_plans = ("test" if heldout else "train") if self.alfred_floor_plans else "all"
        return games.AlfworldSetSpec(name, num_games, base_seed, self.task_types,
                                     self.max_distractors, self.max_receptacles,
                                     tuple(sorted(exclude)), floor_plans, self.alfred_filter)


@dataclasses.dataclass
class AlfworldTaskSets:
    train: AlfworldTasks
    heldout: Optional[AlfworldTasks]
    warm: Optional[AlfworldTasks]

    def close(self) -> None:
        for tasks in (self.train, self.heldout, self.warm):
            if tasks is not None:
                tasks.close()


def _tasks(files, root, config: AlfworldTaskConfig) -> AlfworldTasks:
    return AlfworldTasks(files, root, config.max_turns, config.style,
                         command_numbers=config.command_numbers)


def _downloaded(folder: str, num_games: int, seed: int, config) -> AlfworldTasks:
    root = Path(folder)
    files = list_alfworld_games(root)
    if num_games:
        order = np.random.default_rng(seed).permutation(len(files))
        files = sorted(files[i] for i in order[:num_games])
    return _tasks(files, root, config)


def _generated(spec: games.AlfworldSetSpec, config, progress: Optional[Progress]):
    callback = progress(spec.name) if progress is not None else None
    files = games.generate_game_set(spec, config.data_dir, config.workers, callback)
    return files, _tasks(files, Path(config.data_dir) / spec.folder_name, config)


def build_task_sets(config: AlfworldTaskConfig,
                    progress: Optional[Progress] = None) -> AlfworldTaskSets:
    """Train, held-out (None when 0 games / no heldout_dir) and warm-start (None when 0)."""
    if config.game_dir is not None:
        train = _downloaded(config.game_dir, config.num_games, config.game_seed, config)
        heldout = (_downloaded(config.heldout_dir, config.heldout_games, config.heldout_seed,
                               config) if config.heldout_dir is not None else None)
        exclude = games.task_names(train.game_files)
    else:
        files, train = _generated(config.spec("train", config.num_games, config.game_seed),
                                  config, progress)
        exclude = games.task_names(files)
        heldout = None
        if config.heldout_games:
            spec = config.spec("heldout", config.heldout_games, config.heldout_seed, exclude,
                               heldout=True)
            heldout = _generated(spec, config, progress)[1]
    if heldout is not None:
        exclude |= games.task_names(heldout.game_files)
    warm = None
    if config.warmstart_games:
        spec = config.spec("warmstart", config.warmstart_games, config.warmstart_seed, exclude)
        warm = _generated(spec, config, progress)[1]
    return AlfworldTaskSets(train, heldout, warm)


def env_factory(tasks: AlfworldTasks) -> Callable[[], AlfworldEnv]:
    """One `AlfworldEnv` per call (per episode); players come from the set's pool."""
    return lambda: AlfworldEnv(tasks)

