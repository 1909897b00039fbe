"""The run config's ``env`` section: a choice of environment kind, each kind one registered
:class:`EnvConfig` subclass that carries its own fields and checks and builds its task sets.

``EnvConfig`` holds the fields every kind reads (where the tasks live, how many, their
seeds, the turn limit and the observation length); :class:`CommandGameConfig` adds those of
the text games played by typing commands (TextWorld, ALFWorld). A kind's ``build(...)``
returns an :class:`EnvBundle`, everything a job needs from its tasks. Adding a kind is one
new file in ``rollout_bridge/envs/kinds/`` registering its config: the registry imports
every module of the package, so ``--env.type <name>`` selects it with no other edit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Literal, Mapping, Optional, Sequence

import draccus

from rollout_bridge.envs.base import EnvFactory
from rollout_bridge.progress_lines import TenthLines, show_bar
from rollout_bridge.run_errors import check_setting as check

MAX_GENERATION_WORKERS = 2   # the CPU job's cores; more only crowd a shared box
REPLY_FORMATS = ("number", "command_number")
# Records (priors, evaluation caches, warm starts, checkpoints) were first keyed when one flat
# env section held every kind's fields: a kind's ``record_key`` still has that layout, each of
# these fields the kind lacks at the value the repository's recipes of the kinds without it set.
FIRST_RECORD_KEY = {"game_dir": None, "world_size": 1, "nb_objects": 3, "quest_length": 1, "numbered_actions": True,
                    "shuffle_actions": False, "free_text_commands": True, "goal_every_turn": True,
                    "reply_format": "number", "warmstart_orders": 1, "warmstart_rename": 0.0, "rename_episodes": 0.0,
                    "actions_per_line": False, "blind_observations": False, "heldout_dir": None, "max_distractors": 6,
                    "max_receptacles": None, "alfworld_task_types": None}


@dataclasses.dataclass(frozen=True)
class EnvBundle:
    """What a job needs from its environment kind.

    train: the training task set (``num_tasks``); env_factory: a fresh environment over
    it per episode; max_turns: the episode turn limit; warm: a task set with
    ``demonstration(t)`` (teacher (observation, reply) pairs) for the warm-start SFT, or
    None; held_out: a task set for evaluation, None = evaluate on ``train``; corpus:
    texts for a locally trained tiny tokenizer; chat_tools: tool schemas handed to the chat
    template (None: no tools); extra_evals: name -> (task set, env factory) of additional
    evaluations of the policy before and after RL (e.g. ALFWorld's held-out games, Math-TIR
    with the tool disabled); reference_success: name -> success of a reference policy
    on these tasks (e.g. the exact prompt-blind ceiling), reported beside the agent's;
    reference_se: name -> the standard error of a measured reference (absent: exact);
    tasks_record: what the job's summary.json records about its tasks (``env``);
    close: releases what the kind started (sandbox workers, verifier processes).
    """

    train: Any
    env_factory: EnvFactory
    max_turns: int
    corpus: Callable[[], Sequence[str]]
    warm: Any | None = None
    held_out: Any | None = None
    chat_tools: Sequence[Mapping[str, Any]] | None = None
    extra_evals: Mapping[str, tuple[Any, EnvFactory]] = dataclasses.field(default_factory=dict)
    reference_success: Mapping[str, float] = dataclasses.field(default_factory=dict)
    reference_se: Mapping[str, float] = dataclasses.field(default_factory=dict)
    tasks_record: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    close: Callable[[], None] = lambda: None

    @property
    def num_tasks(self) -> int:
        return self.train.num_tasks


@dataclasses.dataclass
class EnvConfig(draccus.PluginRegistry, discover_packages_path="rollout_bridge.envs.kinds"):
    """The run config's ``env`` section: one registered subclass per kind (``textworld``,
    ``alfworld``, ``math_tir``, and any kind file added to this package). In YAML:
    ``env: {type: alfworld, ...}``; on the command line ``--env alfworld`` (or
    ``--env.type alfworld``) and ``--env.<field> v``.

    Every kind: `num_games` training tasks drawn with seeds from `game_seed` (data in
    `data_dir`), `warmstart_games` tasks for the warm-start demonstrations (seeds from
    `warmstart_seed`) and `heldout_games` tasks evaluated before and after RL, never trained
    on (seeds from `heldout_seed`), all three sets disjoint; episodes of at most `max_turns`
    turns, each observation cut to `max_feedback_chars`.
    """

    data_dir: str = "artifacts/textworld_games"
    num_games: int = 1024
    game_seed: int = 0
    max_turns: int = 12
    max_feedback_chars: int = 600
    warmstart_games: int = 256
    warmstart_seed: int = 100_000
    heldout_games: int = 512
    heldout_seed: int = 200_000

    @classmethod
    def default_choice_name(cls) -> str:
        return "textworld"

    @property
    def kind(self) -> str:
        """The name this kind is registered (and selected on the command line) under."""
        return EnvConfig.get_choice_name(type(self))

    def __post_init__(self):
        for name in ("max_turns", "max_feedback_chars"):
            check(getattr(self, name) > 0, f"env.{name}", "> 0", getattr(self, name))
        least = 0 if self.own_tasks else 1   # 0 of your own games: all of them
        check(self.num_games >= least, "env.num_games", f">= {least}", self.num_games)
        for name in ("game_seed", "warmstart_seed", "warmstart_games", "heldout_games"):
            check(getattr(self, name) >= 0, f"env.{name}", ">= 0", getattr(self, name))

    @property
    def own_tasks(self) -> bool:
        """True when the training tasks are the user's files rather than drawn from the seeds."""
        return False

    def known_num_tasks(self) -> Optional[int]:
        """The number of training tasks when the config alone decides it (drawn tasks:
        ``num_games``); None when only the built task set knows it."""
        return None if self.own_tasks else self.num_games

    def build(self, seed: int, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
        """The kind's task sets (``seed``: the job seed, for per-episode randomness such
        as shuffled actions; ``with_demonstrations``: build the warm-start set)."""
        raise NotImplementedError(f"env kind {self.kind!r} has no build()")

    def record_key(self) -> dict[str, Any]:
        """The section in a stage key (``run_folder.stage_key``), in the layout records were
        first written in (``FIRST_RECORD_KEY``): the kind's name as ``kind``; ``rename_episodes``
        (added after keys were first written) only when it is not 0."""
        key = {"kind": self.kind, **FIRST_RECORD_KEY, **dataclasses.asdict(self)}
        if not key["rename_episodes"]:
            del key["rename_episodes"]
        return key

    def to_dict(self) -> dict[str, Any]:
        """The section as a YAML/JSON mapping, ``type`` first (what ``env:`` parses back)."""
        return {"type": self.kind, **dataclasses.asdict(self)}


@dataclasses.dataclass
class CommandGameConfig(EnvConfig):
    """The fields of text games played by typing commands (TextWorld, ALFWorld; not itself
    a kind). `game_dir`: a folder of your own games (None: generated ones; with it,
    `num_games` are picked by a seeded shuffle, 0 = all). Observations: the game text, then
    the admissible commands, numbered when `numbered_actions` (the reply may then be the
    number), one per line after "Actions:" when `actions_per_line`; `reply_format`
    "command_number" lists and replies "<command> = <number>" (textworld plays only the
    number, alfworld plays the text when it is a valid command, else the number)."""

    game_dir: Optional[str] = None
    numbered_actions: bool = False
    reply_format: Literal["number", "command_number"] = "number"
    actions_per_line: bool = True

    @property
    def own_tasks(self) -> bool:
        return self.game_dir is not None

    def __post_init__(self):
        super().__post_init__()
        check(self.reply_format in REPLY_FORMATS, "env.reply_format", f"one of {list(REPLY_FORMATS)}",
              self.reply_format)


def env_kinds() -> tuple[str, ...]:
    """Every registered kind (each module of ``rollout_bridge.envs.kinds`` imported)."""
    return tuple(EnvConfig.get_known_choices())


def default_env() -> EnvConfig:
    """The default kind's section with every default (the main job's tasks)."""
    return EnvConfig.get_choice_class(EnvConfig.default_choice_name())()


def build_env(cfg, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
    """The job's tasks: ``cfg.env.build`` with the job seed."""
    return cfg.env.build(cfg.seed, with_demonstrations, log, progress)


class GenerationBar:
    """tqdm over game generation (only shown when games are actually being made) on a
    terminal; with the bar off (``--progress false``, nohup, CI: ``show_bar``) and a ``log``,
    one line per tenth instead."""

    def __init__(self, what: str, enabled: bool, log: Callable[[str], None] | None = None):
        self.what, self.enabled, self.bar = what, show_bar(enabled), None
        self.lines = TenthLines(f"generating {what}", None if self.enabled else log)

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"generating {self.what}", disable=not self.enabled, leave=False)
        self.bar.n = done
        self.bar.refresh()
        self.lines.reach(done, total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def generation_workers() -> int:
    """Processes that generate games (and compute blind ceilings): every core, at most
    ``MAX_GENERATION_WORKERS``."""
    return max(1, min(MAX_GENERATION_WORKERS, os.cpu_count() or 1))
