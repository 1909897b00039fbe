"""The ``alfworld`` env kind (docs/ALFWORLD.md): ALFWorld games generated from the alfworld
package's own domain, layouts and goal templates, or downloaded game folders."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Callable, Optional

from rollout_bridge.envs.kinds.base import CommandGameConfig, EnvBundle, EnvConfig, GenerationBar, check
from rollout_bridge.run_errors import UserError


@EnvConfig.register_subclass("alfworld")
@dataclasses.dataclass
class AlfworldConfig(CommandGameConfig):
    """ALFWorld tasks (rollout_bridge.envs.alfworld_tasks). `game_dir` null: games
    generated in `data_dir`, only tasks ALFRED's task sampler would make when
    `alfred_filter` (rollout_bridge.envs.alfworld_games.alfred_exclusions), training /
    warm-start games on ALFRED's training floor plans and held-out games on its test floor
    plans when `alfred_floor_plans`, of the `alfworld_task_types` (None = all six), with
    `max_distractors` objects besides the targets and `max_receptacles` receptacles kept per
    floor plan (None = all, as released). Downloaded games: `game_dir`, and `heldout_dir`
    a folder whose first `heldout_games` games are held out."""

    heldout_dir: Optional[str] = None
    max_distractors: int = 6
    max_receptacles: Optional[int] = None
    alfworld_task_types: Optional[tuple[str, ...]] = None
    alfred_filter: bool = True
    alfred_floor_plans: bool = True

    def __post_init__(self):
        super().__post_init__()
        check(self.max_distractors >= 0, "env.max_distractors", ">= 0", self.max_distractors)
        check(self.max_receptacles is None or self.max_receptacles >= 4, "env.max_receptacles", "null or >= 4",
              self.max_receptacles)
        check(self.alfworld_task_types is None or len(self.alfworld_task_types) > 0, "env.alfworld_task_types",
              "null or non-empty", self.alfworld_task_types)

    def record_key(self) -> dict:
        """``alfred_filter`` and ``alfred_floor_plans`` (added after keys were first written)
        only when on for generated games, the only games they change: with both off those
        games are the ones made before they existed."""
        key = super().record_key()
        for field in ("alfred_filter", "alfred_floor_plans"):
            if not (self.game_dir is None and key[field]):
                del key[field]
        return key

    def build(self, seed: int, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
        """The training games, held-out games never trained on (evaluated before and after
        RL, ``extra_evals["heldout"]``) and the warm-start games."""
        missing = [m for m in ("alfworld", "fast_downward") if importlib.util.find_spec(m) is None]
        if missing:
            raise UserError(f"env.type='alfworld' needs {', '.join(missing)}: pip install 'alfworld==0.4.2' "
                            "'textworld[pddl]'")
        for field, folder in (("env.game_dir", self.game_dir), ("env.heldout_dir", self.heldout_dir)):
            if folder is not None and not Path(folder).is_dir():
                raise UserError(f"{field}={folder!r} does not exist")
        from rollout_bridge.envs import alfworld_tasks
        from rollout_bridge.envs.alfworld_games import TASK_TYPES

        unknown = sorted(set(self.alfworld_task_types or ()) - set(TASK_TYPES))
        if unknown:
            raise UserError(f"env.alfworld_task_types: unknown {unknown}; choose from {list(TASK_TYPES)}")
        config = alfworld_tasks.AlfworldTaskConfig(
            game_dir=self.game_dir, heldout_dir=self.heldout_dir, data_dir=self.data_dir, num_games=self.num_games,
            game_seed=self.game_seed, heldout_games=self.heldout_games, heldout_seed=self.heldout_seed,
            warmstart_games=self.warmstart_games if with_demonstrations else 0, warmstart_seed=self.warmstart_seed,
            max_distractors=self.max_distractors, max_receptacles=self.max_receptacles, max_turns=self.max_turns,
            alfred_filter=self.alfred_filter, alfred_floor_plans=self.alfred_floor_plans,
            max_feedback_chars=self.max_feedback_chars, numbered_actions=self.numbered_actions,
            command_numbers=self.reply_format == "command_number", actions_per_line=self.actions_per_line,
            workers=max(1, min(2, os.cpu_count() or 1)),
            **({} if self.alfworld_task_types is None else {"task_types": tuple(self.alfworld_task_types)}))
        log(f"ALFWorld games in {self.data_dir} (generated once, then reused)" if self.game_dir is None
            else f"ALFWorld games from {self.game_dir}")
        bars: list[GenerationBar] = []

        def bar(name: str) -> GenerationBar:
            bars.append(GenerationBar(f"ALFWorld {name} games", progress, log))
            return bars[-1]

        try:
            sets = alfworld_tasks.build_task_sets(config, bar)
        finally:
            for made in bars:
                made.close()
        held = sets.heldout
        log(f"ALFWorld tasks: {sets.train.num_tasks} train, {0 if held is None else held.num_tasks} held-out, "
            f"{0 if sets.warm is None else sets.warm.num_tasks} warm-start")

        def corpus() -> list[str]:
            texts = [sets.train.episode(t).reset() for t in range(sets.train.num_tasks)]
            if sets.warm is not None:
                texts += [f"{obs}\n{reply}" for t in range(sets.warm.num_tasks)
                          for obs, reply in sets.warm.demonstration(t)]
            return texts

        extra = {} if held is None else {"heldout": (held, alfworld_tasks.env_factory(held))}
        return EnvBundle(train=sets.train, env_factory=alfworld_tasks.env_factory(sets.train),
                         max_turns=self.max_turns, corpus=corpus, warm=sets.warm, held_out=held, extra_evals=extra)
