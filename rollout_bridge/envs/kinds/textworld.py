"""The ``textworld`` env kind: generated TextWorld games (tw-make custom) or a folder of your
own (ALFWorld's game.tw-pddl files, or .z8), played by typing commands."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from rollout_bridge.envs.kinds.base import (CommandGameConfig, EnvBundle, EnvConfig, GenerationBar, check,
                                            generation_workers)
from rollout_bridge.run_errors import UserError


@EnvConfig.register_subclass("textworld")
@dataclasses.dataclass
class TextWorldConfig(CommandGameConfig):
    """TextWorld tasks. `game_dir` None: a seeded generated set of `num_games` games
    (tw-make custom --world-size/--nb-objects/--quest-length, seeds game_seed+i) cached in
    `data_dir`; the warm-start demonstrations are walkthroughs of a separate generated set
    of `warmstart_games` games, and the `heldout_games` generated games are disjoint from
    both. The admissible commands come in a fresh random order every turn when
    `shuffle_actions`; `free_text_commands=False` plays only a shown command's number (any
    other reply spends the turn); the goal heads every observation, or only the first when
    `goal_every_turn=False`."""

    world_size: int = 3
    nb_objects: int = 4
    quest_length: int = 3
    shuffle_actions: bool = True
    free_text_commands: bool = True
    goal_every_turn: bool = False
    warmstart_orders: int = 4   # shuffled actions: each walkthrough shown in this many orders
    # this fraction of the warm-start demonstrations name their rooms and things with fresh
    # random words (rollout_bridge.envs.textworld_rename): names must be copied
    warmstart_rename: float = 0.5
    # this fraction of the TRAINING games' episodes (prior, RL, training-game evaluations),
    # decided per episode from its seed, name every room and thing with fresh random words
    # (observations renamed, typed commands renamed back): no name can be memorized per
    # game, so what RL learns must hold on games it never saw. Held-out games are always
    # played as generated.
    rename_episodes: float = 0.0
    # every observation hidden ("(hidden)"), demonstrations too: the prompt-blind control for
    # free-text commands, trained and evaluated like the agent
    blind_observations: bool = False
    # free-text commands: the folder of a finished run of this recipe with
    # blind_observations=true on the same games; its success after RL is printed beside the
    # agent's as the prompt-blind reference (rollout_bridge/envs/blind_control.py)
    blind_control: Optional[str] = "assets/textworld_blind_control"

    def __post_init__(self):
        super().__post_init__()
        for name in ("world_size", "nb_objects", "quest_length"):
            check(getattr(self, name) > 0, f"env.{name}", "> 0", getattr(self, name))
        check(self.warmstart_orders >= 1, "env.warmstart_orders", ">= 1", self.warmstart_orders)
        for name in ("warmstart_rename", "rename_episodes"):
            check(0.0 <= getattr(self, name) <= 1.0, f"env.{name}", "in [0, 1]", getattr(self, name))

    def build(self, seed: int, with_demonstrations: bool, log: Callable[[str], None] = print,
              progress: bool = False) -> EnvBundle:
        """The TextWorld task sets (:func:`textworld_bundle`)."""
        return textworld_bundle(self, seed, with_demonstrations, log, progress)


def _generated(spec, data_dir: str, progress: bool, what: str, exclude=(), log=None):
    from rollout_bridge.envs import textworld_games as games

    bar = GenerationBar(what, progress, log)
    try:
        return games.generate_game_set(spec, data_dir, exclude_signatures=exclude, progress=bar,
                                       workers=generation_workers(), log=log)
    finally:
        bar.close()


def _blind_ceiling(tasks, log: Callable[[str], None], progress: bool, what: str) -> float:
    """Mean over `tasks`' games of the exact prompt-blind success (textworld_blind)."""
    from rollout_bridge.envs.textworld_blind import blind_ceilings

    bar = GenerationBar(f"prompt-blind ceiling ({what})", progress, log)
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


def textworld_bundle(env: TextWorldConfig, seed: int, with_demonstrations: bool, log: Callable[[str], None],
                     progress: bool) -> EnvBundle:
    """TextWorld: ``env.game_dir`` (your own games, e.g. ALFWorld's) or a seeded generated
    set; ``env.heldout_games`` generated games never trained on (evaluated before and after
    RL, ``extra_evals["heldout"]``); warm-start walkthroughs from a generated set disjoint
    from both. With shuffled, number-only actions the exact prompt-blind ceiling of the
    training and held-out sets is computed (``reference_success``)."""
    from rollout_bridge.envs import textworld_games as games
    from rollout_bridge.envs.blind_control import describe_tasks, load_blind_control
    from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldEnv, TextWorldTasks

    style = ObservationStyle(env.max_feedback_chars, env.numbered_actions, env.shuffle_actions,
                             env.free_text_commands, shuffle_seed=seed,
                             goal_every_turn=env.goal_every_turn, reply_format=env.reply_format,
                             actions_per_line=env.actions_per_line, blind=env.blind_observations)

    train_style = dataclasses.replace(style, rename_fraction=env.rename_episodes)   # training games only

    def task_set(name: str, count: int, seed: int, exclude=(), what: str = "", shown=style):
        spec = games.GameSetSpec(name, count, seed, env.world_size, env.nb_objects, env.quest_length)
        log(f"{what}: {spec.folder_name} in {env.data_dir} (made once: unpacked if it ships, else generated)")
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

        warm = RenamedDemonstrations(warm, textworld_names_of(warm_games.game_files), env.warmstart_rename, seed)
    extra = {} if held is None else {"heldout": (held, lambda: TextWorldEnv(held))}
    return EnvBundle(train=train, env_factory=lambda: TextWorldEnv(train), max_turns=env.max_turns,
                     corpus=corpus, warm=warm, held_out=held, extra_evals=extra, reference_success=reference,
                     reference_se=reference_se, tasks_record=tasks_record)
