"""Environment kinds for ``train.py``: ``env.kind`` name -> builder of its task sets.

A builder takes the ``env`` config section (plus whether warm-start demonstrations are
wanted and a progress flag) and returns an :class:`EnvBundle`. A new kind (e.g.
``math_tir``, an ALFWorld game generator) is one builder and one ``register_env_kind``
line (and its name in ``EnvSection.kind``'s Literal).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from rollout_bridge.envs.base import EnvFactory


@dataclasses.dataclass(frozen=True)
class EnvBundle:
    """What a job needs from its environment kind.

    train: the training task set (``num_tasks``); env_factory: a fresh environment over
    it per episode; max_turns: the episode turn limit; warm: a task set with
    ``demonstration(t)`` (teacher (observation, reply) pairs) for the warm-start SFT, or
    None; held_out: a task set for evaluation, None = evaluate on ``train``; corpus:
    texts for a locally trained tiny tokenizer.
    """

    train: Any
    env_factory: EnvFactory
    max_turns: int
    corpus: Callable[[], Sequence[str]]
    warm: Any | None = None
    held_out: Any | None = None

    @property
    def num_tasks(self) -> int:
        return self.train.num_tasks


EnvBuilder = Callable[[Any, bool, Callable[[str], None], bool], EnvBundle]
_ENV_KINDS: dict[str, EnvBuilder] = {}


def register_env_kind(name: str, builder: EnvBuilder) -> None:
    """``builder(env_section, with_demonstrations, log, progress) -> EnvBundle``."""
    _ENV_KINDS[name] = builder


def env_kinds() -> tuple[str, ...]:
    return tuple(_ENV_KINDS)


def build_env(env_section, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
    """The bundle of ``env_section.kind``; SystemExit naming the field when unknown."""
    if env_section.kind not in _ENV_KINDS:
        raise SystemExit(f"env.kind={env_section.kind!r} is not available in this build "
                         f"(registered kinds: {list(_ENV_KINDS)})")
    return _ENV_KINDS[env_section.kind](env_section, with_demonstrations, log, progress)


class _GenerationBar:
    """tqdm over game generation (only shown when games are actually being made)."""

    def __init__(self, what: str, enabled: bool):
        self.what, self.enabled, self.bar = what, enabled, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"generating {self.what}", disable=not self.enabled, leave=False)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _generated(spec, data_dir: str, progress: bool, what: str, disjoint_from=()):
    from rollout_bridge.envs import textworld_games as games

    bar = _GenerationBar(what, progress)
    try:
        if disjoint_from:
            return games.generate_disjoint_game_set(spec, data_dir, list(disjoint_from), progress=bar)
        return games.generate_game_set(spec, data_dir, progress=bar)
    finally:
        bar.close()


def textworld_bundle(env, with_demonstrations: bool, log: Callable[[str], None], progress: bool) -> EnvBundle:
    """TextWorld: ``env.game_dir`` (your own games, e.g. ALFWorld's) or a seeded generated
    set; warm-start walkthroughs from a generated set disjoint from the training games."""
    from rollout_bridge.envs import textworld_games as games
    from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEnv, TextWorldTasks

    if env.game_dir is not None and not Path(env.game_dir).is_dir():
        raise SystemExit(f"input error: env.game_dir={env.game_dir!r} does not exist. For "
                         "ALFWorld: `pip install alfworld && alfworld-download`, then point "
                         "env.game_dir at $ALFWORLD_DATA/json_2.1.1/train")
    style = ObservationStyle(env.max_feedback_chars, env.numbered_actions)
    spec = games.GameSetSpec("train", env.num_games, env.game_seed, env.world_size, env.nb_objects,
                             env.quest_length)
    if env.game_dir is not None:
        root = Path(env.game_dir)
        files = games.list_game_files(root)
        if env.num_games:
            order = np.random.default_rng(env.game_seed).permutation(len(files))
            files = sorted(files[i] for i in order[:env.num_games])
        train = TextWorldTasks(files, root, env.max_turns, style)
    else:
        log(f"games: {spec.folder_name} in {env.data_dir} (generated once, then reused)")
        files = _generated(spec, env.data_dir, progress, "training games")
        train = TextWorldTasks(files, files[0].parent, env.max_turns, style)
    warm = None
    if with_demonstrations and env.warmstart_games > 0:
        if env.game_dir is not None:
            raise SystemExit("warmstart.enabled with env.game_dir: the warm start uses generated "
                             "TextWorld games; set warmstart.enabled=false for your own games")
        warm_spec = games.GameSetSpec("warmstart", env.warmstart_games, env.warmstart_seed, env.world_size,
                                      env.nb_objects, env.quest_length)
        log(f"warm-start games: {warm_spec.folder_name} (disjoint from the training games)")
        warm_files = _generated(warm_spec, env.data_dir, progress, "warm-start games", disjoint_from=[spec])
        warm = TextWorldTasks(warm_files, warm_files[0].parent, env.max_turns, style)

    def corpus() -> list[str]:
        texts = [train.episode(t).reset() for t in range(train.num_tasks)]
        if warm is not None:
            texts += [f"{obs}\n{reply}" for t in range(warm.num_tasks) for obs, reply in warm.demonstration(t)]
        return texts

    return EnvBundle(train=train, env_factory=lambda: TextWorldEnv(train), max_turns=env.max_turns,
                     corpus=corpus, warm=warm)


def math_tir_unavailable(env, with_demonstrations: bool, log, progress) -> EnvBundle:
    """Placeholder until the Math-TIR environment (sandboxed Python tool) lands."""
    if not Path(env.data_dir).is_dir():
        raise SystemExit(f"input error: env.data_dir={env.data_dir!r} does not exist: "
                         "put the DAPO-Math-17K prompts and the cold-start SFT data there")
    raise SystemExit("env.kind='math_tir': the Math-TIR environment (sandboxed Python "
                     "tool) is not part of this build")


register_env_kind("textworld", textworld_bundle)
register_env_kind("math_tir", math_tir_unavailable)
