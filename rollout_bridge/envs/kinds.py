"""Environment kinds for ``train.py``: ``env.kind`` name -> builder of its task sets.

A builder takes the job config (it reads the ``env`` section and its kind's own section,
e.g. ``math_tir``; plus whether warm-start demonstrations are wanted and a progress flag)
and returns an :class:`EnvBundle`. A new kind (e.g.
``math_tir``, an ALFWorld game generator) is one builder and one ``register_env_kind``
line (and its name in ``EnvSection.kind``'s Literal).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from rollout_bridge.envs.base import EnvFactory
from rollout_bridge.progress_lines import TenthLines, show_bar
from rollout_bridge.run_errors import UserError

MAX_GENERATION_WORKERS = 2   # the CPU job's cores; more only crowd a shared box


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


EnvBuilder = Callable[[Any, bool, Callable[[str], None], bool], EnvBundle]
_ENV_KINDS: dict[str, EnvBuilder] = {}


def register_env_kind(name: str, builder: EnvBuilder) -> None:
    """``builder(cfg, with_demonstrations, log, progress) -> EnvBundle`` (``cfg`` the job's
    TrainConfig: ``cfg.env`` and the kind's own section)."""
    _ENV_KINDS[name] = builder


def env_kinds() -> tuple[str, ...]:
    return tuple(_ENV_KINDS)


def build_env(cfg, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
    """The bundle of ``cfg.env.kind``; UserError naming the field when unknown."""
    if cfg.env.kind not in _ENV_KINDS:
        raise UserError(f"env.kind={cfg.env.kind!r} is not available in this build "
                        f"(registered kinds: {list(_ENV_KINDS)})")
    return _ENV_KINDS[cfg.env.kind](cfg, with_demonstrations, log, progress)


class _GenerationBar:
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


def _generated(spec, data_dir: str, progress: bool, what: str, exclude=(), log=None):
    from rollout_bridge.envs import textworld_games as games

    bar = _GenerationBar(what, progress, log)
    try:
        return games.generate_game_set(spec, data_dir, exclude_signatures=exclude, progress=bar,
                                       workers=generation_workers())
    finally:
        bar.close()


def _blind_ceiling(tasks, log: Callable[[str], None], progress: bool, what: str) -> float:
    """Mean over `tasks`' games of the exact prompt-blind success (textworld_blind)."""
    from rollout_bridge.envs.textworld_blind import blind_ceilings

    bar = _GenerationBar(f"prompt-blind ceiling ({what})", progress, log)
    try:
        per_game = blind_ceilings(tasks.game_files, tasks.max_turns, generation_workers(), bar)
    finally:
        bar.close()
    log(f"prompt-blind ceiling ({what}): {per_game.mean():.4f} (uniform random admissible command each turn, "
        f"exact over {len(per_game)} games, {tasks.max_turns} turns)")
    return float(per_game.mean())


def _textworld_own_games(env, style) -> Any:
    from rollout_bridge.envs import textworld_games as games
    from rollout_bridge.envs.textworld_env import TextWorldTasks

    if not Path(env.game_dir).is_dir():
        raise UserError(f"env.game_dir={env.game_dir!r} does not exist. For "
                        "ALFWorld: `pip install alfworld && alfworld-download`, then point "
                        "env.game_dir at $ALFWORLD_DATA/json_2.1.1/train")
    if env.heldout_games:
        raise UserError("env.heldout_games with env.game_dir: held-out games are generated; "
                        "set env.heldout_games=0 for your own games")
    root = Path(env.game_dir)
    files = games.list_game_files(root)
    if env.num_games:
        order = np.random.default_rng(env.game_seed).permutation(len(files))
        files = sorted(files[i] for i in order[:env.num_games])
    return TextWorldTasks(files, root, env.max_turns, style)


class ReorderedDemonstrations:
    """A warm-start task set whose every walkthrough appears ``orders`` times, each time
    with the commands shown in fresh random orders (shuffled actions: the numbers to type
    differ, the commands do not), so the SFT teaches finding a command's number in the
    list rather than remembering numbers. Item i is walkthrough i mod num_tasks."""

    def __init__(self, tasks, orders: int):
        if orders < 1:
            raise ValueError(f"orders must be >= 1, got {orders}")
        self.tasks, self.orders = tasks, orders

    @property
    def num_tasks(self) -> int:
        return self.tasks.num_tasks * self.orders

    def demonstration(self, index: int) -> list[tuple[str, str]]:
        return self.tasks.demonstration(index % self.tasks.num_tasks)


def textworld_bundle(cfg, with_demonstrations: bool, log: Callable[[str], None], progress: bool) -> EnvBundle:
    """TextWorld: ``env.game_dir`` (your own games, e.g. ALFWorld's) or a seeded generated
    set; ``env.heldout_games`` generated games never trained on (evaluated before and after
    RL, ``extra_evals["heldout"]``); warm-start walkthroughs from a generated set disjoint
    from both. With shuffled, number-only actions the exact prompt-blind ceiling of the
    training and held-out sets is computed (``reference_success``)."""
    from rollout_bridge.envs import textworld_games as games
    from rollout_bridge.envs.blind_control import describe_tasks, load_blind_control
    from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEnv, TextWorldTasks

    env = cfg.env
    style = ObservationStyle(env.max_feedback_chars, env.numbered_actions, env.shuffle_actions,
                             env.free_text_commands, shuffle_seed=cfg.seed,
                             goal_every_turn=env.goal_every_turn, reply_format=env.reply_format,
                             actions_per_line=env.actions_per_line, blind=env.blind_observations)

    train_style = dataclasses.replace(style, rename_fraction=env.rename_episodes)   # training games only

    def task_set(name: str, count: int, seed: int, exclude=(), what: str = "", shown=style):
        spec = games.GameSetSpec(name, count, seed, env.world_size, env.nb_objects, env.quest_length)
        log(f"{what}: {spec.folder_name} in {env.data_dir} (generated once, then reused)")
        files = _generated(spec, env.data_dir, progress, what, exclude, log)
        return TextWorldTasks(files, files[0].parent, env.max_turns, shown)

    if env.rename_episodes > 0:
        log(f"training episodes renamed: {env.rename_episodes:.0%} of them show fresh random names "
            "(held-out games never)")
    if env.game_dir is not None:
        train = _textworld_own_games(env, train_style)
    else:
        train = task_set("train", env.num_games, env.game_seed, what="training games", shown=train_style)
    generated = [] if env.game_dir is not None else list(train.game_files)
    held = None
    if env.heldout_games > 0:
        held = task_set("heldout", env.heldout_games, env.heldout_seed, games.set_signatures(generated),
                        "held-out games")
        generated += held.game_files
    warm = None
    if with_demonstrations and env.warmstart_games > 0:
        if env.game_dir is not None:
            raise UserError("warmstart.enabled with env.game_dir: the warm start uses generated "
                            "TextWorld games; set warmstart.enabled=false for your own games")
        warm = task_set("warmstart", env.warmstart_games, env.warmstart_seed, games.set_signatures(generated),
                        "warm-start games (disjoint from the training and held-out games)")
    reference, reference_se = {}, {}
    tasks_record = describe_tasks(train.root.name, None if held is None else held.root.name, style.blind)
    exact_ceiling = style.shuffle_actions and not style.free_text and not style.blind and env.game_dir is None
    if env.blind_control is not None:
        if exact_ceiling:
            raise UserError("env.blind_control is for free-text commands: with shuffled numbered actions the "
                            "exact prompt-blind ceiling is computed instead (set env.blind_control=null)")
        reference, reference_se = load_blind_control(env.blind_control, tasks_record)
        log(f"prompt-blind control: {env.blind_control} (training games {reference['prompt_blind_ceiling']:.3f})")
    elif exact_ceiling:
        reference["prompt_blind_ceiling"] = _blind_ceiling(train, log, progress, "training games")
        if held is not None:
            reference["heldout_prompt_blind_ceiling"] = _blind_ceiling(held, log, progress, "held-out games")

    warm_games = warm

    def corpus() -> list[str]:   # the tokenizer's texts: each walkthrough once, as a sighted agent sees them
        def sighted(tasks):   # blind or renamed: the same tokenizer as the sighted agent's
            if not (style.blind or tasks.style.rename_fraction):
                return tasks
            return TextWorldTasks(tasks.game_files, tasks.root, env.max_turns,
                                  dataclasses.replace(style, blind=False, rename_fraction=0.0))

        seen = sighted(train)
        texts = [seen.episode(t).reset() for t in range(seen.num_tasks)]
        if warm_games is not None:
            shown = sighted(warm_games)
            texts += [f"{obs}\n{reply}" for t in range(shown.num_tasks) for obs, reply in shown.demonstration(t)]
        return texts

    if warm is not None and style.shuffle_actions and env.warmstart_orders > 1:
        warm = ReorderedDemonstrations(warm, env.warmstart_orders)
    if warm is not None and env.warmstart_rename > 0:
        from rollout_bridge.envs.textworld_rename import RenamedDemonstrations, textworld_names_of

        warm = RenamedDemonstrations(warm, textworld_names_of(warm_games.game_files), env.warmstart_rename, cfg.seed)
    extra = {} if held is None else {"heldout": (held, lambda: TextWorldEnv(held))}
    return EnvBundle(train=train, env_factory=lambda: TextWorldEnv(train), max_turns=env.max_turns,
                     corpus=corpus, warm=warm, held_out=held, extra_evals=extra, reference_success=reference,
                     reference_se=reference_se, tasks_record=tasks_record)


def math_tir_evaluations(setup) -> dict:
    """Math-TIR's extra evaluations: the training problems with the tool disabled
    (``no_tool``) and, when ``env.heldout_games`` > 0, the held-out
    problems with and without the tool (``heldout``, ``heldout_no_tool``); both sources."""
    evals = {"no_tool": (setup.train, setup.env_factory(tools_enabled=False))}
    if setup.held_out is not None:
        evals["heldout"] = (setup.held_out, setup.env_factory(tasks=setup.held_out))
        evals["heldout_no_tool"] = (setup.held_out, setup.env_factory(tools_enabled=False, tasks=setup.held_out))
    return evals


def math_tir_bundle(cfg, with_demonstrations: bool, log: Callable[[str], None], progress: bool) -> EnvBundle:
    """Math-TIR (SPEC 6): ``math_tir.source`` arithmetic (seeded problems + scripted teacher)
    or dapo (DAPO-Math-17K parquet files in ``env.data_dir`` + a filtered teacher JSONL);
    the model's Python runs in the tool sandbox; ``env.max_turns`` tool calls, then one
    more turn for the final answer, scored by math-verify. Also evaluated with the tool
    disabled, and on held-out problems (:func:`math_tir_evaluations`)."""
    from rollout_bridge.envs.math_tir import build_math_tir
    from rollout_bridge.envs.math_tir.tool_format import PYTHON_TOOL_SCHEMA

    env, section = cfg.env, cfg.math_tir
    if section.source == "dapo" and not Path(env.data_dir).is_dir():
        raise UserError(f"env.data_dir={env.data_dir!r} does not exist: put the DAPO-Math-17K "
                        "prompts and the cold-start SFT data there")
    log(f"math_tir: {section.source} tasks, sandboxed Python tool ({section.sandbox.num_workers} warm workers)")
    setup = build_math_tir(env, section, cfg.seed, with_teacher=with_demonstrations)
    return EnvBundle(train=setup.train, env_factory=setup.env_factory(), max_turns=env.max_turns + 1,
                     corpus=setup.corpus, warm=setup.demonstrations,
                     chat_tools=[PYTHON_TOOL_SCHEMA] if section.tool_format == "qwen" else None,
                     extra_evals=math_tir_evaluations(setup),
                     close=setup.close)


def alfworld_bundle(cfg, with_demonstrations: bool, log: Callable[[str], None], progress: bool) -> EnvBundle:
    """ALFWorld (docs/ALFWORLD.md): games generated from the alfworld package's own domain,
    layouts and goal templates (``env.game_dir`` null), or downloaded game folders
    (``env.game_dir``, ``env.heldout_dir``); held-out games never trained on are evaluated
    before and after RL (``extra_evals["heldout"]``)."""
    import importlib.util
    import os

    env = cfg.env
    if env.warmstart_rename > 0 or env.rename_episodes > 0 or env.blind_observations or env.blind_control:
        raise UserError("env.warmstart_rename, env.rename_episodes, env.blind_observations and env.blind_control "
                        "are for env.kind=textworld only "
                        "(ALFWorld observations have their own format)")
    missing = [m for m in ("alfworld", "fast_downward") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"env.kind='alfworld' needs {', '.join(missing)}: pip install 'alfworld==0.4.2' "
                        "'textworld[pddl]'")
    for field, folder in (("env.game_dir", env.game_dir), ("env.heldout_dir", env.heldout_dir)):
        if folder is not None and not Path(folder).is_dir():
            raise UserError(f"{field}={folder!r} does not exist")
    from rollout_bridge.envs import alfworld_tasks
    from rollout_bridge.envs.alfworld_games import TASK_TYPES

    unknown = sorted(set(env.alfworld_task_types or ()) - set(TASK_TYPES))
    if unknown:
        raise UserError(f"env.alfworld_task_types: unknown {unknown}; choose from {list(TASK_TYPES)}")
    config = alfworld_tasks.AlfworldTaskConfig(
        game_dir=env.game_dir, heldout_dir=env.heldout_dir, data_dir=env.data_dir, num_games=env.num_games,
        game_seed=env.game_seed, heldout_games=env.heldout_games, heldout_seed=env.heldout_seed,
        warmstart_games=env.warmstart_games if with_demonstrations else 0, warmstart_seed=env.warmstart_seed,
        max_distractors=env.max_distractors, max_receptacles=env.max_receptacles, max_turns=env.max_turns,
        alfred_filter=env.alfred_filter, alfred_floor_plans=env.alfred_floor_plans,
        max_feedback_chars=env.max_feedback_chars, numbered_actions=env.numbered_actions,
        command_numbers=env.reply_format == "command_number", actions_per_line=env.actions_per_line,
        workers=max(1, min(2, os.cpu_count() or 1)),
        **({} if env.alfworld_task_types is None else {"task_types": tuple(env.alfworld_task_types)}))
    log(f"ALFWorld games in {env.data_dir} (generated once, then reused)" if env.game_dir is None
        else f"ALFWorld games from {env.game_dir}")
    bars: list[_GenerationBar] = []

    def bar(name: str) -> _GenerationBar:
        bars.append(_GenerationBar(f"ALFWorld {name} games", progress, log))
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
            texts += [f"{obs}\n{reply}" for t in range(sets.warm.num_tasks) for obs, reply in sets.warm.demonstration(t)]
        return texts

    extra = {} if held is None else {"heldout": (held, alfworld_tasks.env_factory(held))}
    return EnvBundle(train=sets.train, env_factory=alfworld_tasks.env_factory(sets.train), max_turns=env.max_turns,
                     corpus=corpus, warm=sets.warm, held_out=held, extra_evals=extra)


register_env_kind("textworld", textworld_bundle)
register_env_kind("alfworld", alfworld_bundle)
register_env_kind("math_tir", math_tir_bundle)
