"""ALFWorld games (`game.tw-pddl`) played through the `alfworld` package's own wrappers.

Plays generated games (`rollout_bridge.envs.alfworld_games`) and downloaded ones
(`alfworld-download`, then `env.game_dir` at e.g. `$ALFWORLD_DATA/json_2.1.1/train`) the
same way: every `game.tw-pddl` under the folder is a task, task id i = the i-th game in
sorted order of its path relative to the folder (as `TextWorldTasks`).

The engine is textworld's `PddlEnv` under ALFWorld's `AlfredDemangler` (names read
"apple 1"), `AlfredInfos` (the game file) and, for teacher plans, `AlfredExpert`
(`expert="planner"`: fast-downward replans every step; `"handcoded"`: ALFWorld's expert,
which needs the game's `traj_data.json`). Admissible commands and the won flag come from
`PddlEnv`; the walkthrough is the game file's stored one (planner-made when generated).

Observations are those of `textworld_env` ("Goal: ...", the game's text, "Actions: a | b");
the goal is the intro's "Your task is to: ..." sentence. Replies: the command (free text),
its number ("1 go to fridge 1 | ..."; `ObservationStyle.numbered_actions`), or, with
`command_numbers`, the command followed by its number as listed ("go to fridge 1 = 1 |
open fridge 1 = 2", reply "open fridge 1 = 2"): the number is then a copy of the
tokens after the command just written (an induction-head copy for a small model) rather
than a two-hop lookup; `resolve_command_number` says which command such a reply plays. Reward 1.0 on the step that wins;
an episode ends on a win or after `max_turns` (ALFWorld: 50) commands.

Speed and threads: textworld's PddlState translates the PDDL problem to SAS (twice) on
every load and every reset, and `fast_downward.pddl2sas` sets module-global options; every
step re-parses grammar text and rule conditions with tatsu parsers, which are not
thread-safe (8 threads stepping 8 games at once: 5 of 16 episodes died with "IndexError:
pop from empty list"). So every load and step of every player holds one process lock
(`ENGINE_LOCK`, shared with `textworld_env`'s loads); the work is pure Python under the
GIL, so little parallelism is lost. `install_speedups` memoizes the pure text ->
structure steps in this process (benchmarks/alfworld_env_step.py measures the effect).

Resources: every `PddlEnv` loads its own copy of fast-downward's 34 MB library (its
global state is per copy) and never unloads it (unloading one and loading another
segfaults). Environments therefore borrow a `PddlEnv` from the process's shared
`PlayerPool` on `reset` and return it on `close`: a process holds one per concurrent
episode (plus one planner for generation), not one per episode played.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import threading
from pathlib import Path
from typing import Mapping, Sequence

from rollout_bridge.envs.base import check_task_id
from rollout_bridge.envs.textworld_env import (
    ObservationStyle,
    StepOutcome,
    TextWorldEnv,
    TextWorldTasks,
    clean_feedback,
    format_observation,
    reply_for_command,
    resolve_command,
    sanitize_command,
)
from rollout_bridge.envs.textworld_env import _START_LOCK as ENGINE_LOCK

GAME_FILE = "game.tw-pddl"
GAME_KEYS = ("pddl_domain", "grammar", "pddl_problem")

ALFWORLD_MAX_TURNS = 50                     # the paper's interaction budget
EXPERT_TYPES = (None, "planner", "handcoded")
_TASK_LINE = re.compile(r"Your task is to:\s*(.*?)\s*$", re.S)
_WELCOME = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
NUMBER_SEPARATOR = " = "        # "go to fridge 1 = 3": a command, then its number as listed
_COMMAND_NUMBER = re.compile(r"^(.*?)\s*=\s*(\d+)$")
TRANSLATION_CACHE_SIZE = 1024   # SAS translations kept (2 per game: plain, optimized)
TEXT_PARSE_CACHE_SIZE = 4096    # parsed grammar texts kept (templates, rules, intros)


def _memoized_translate(original):
    translate = functools.lru_cache(maxsize=TRANSLATION_CACHE_SIZE)(original)

    def pddl2sas(domain: str, problem: str, verbose: bool = False, optimize: bool = False):
        return translate(domain, problem, bool(verbose), bool(optimize))
    return pddl2sas


def _memoized_text_parse(original):
    parse = functools.lru_cache(maxsize=TEXT_PARSE_CACHE_SIZE)(
        lambda text, rule_name, trace: original(text, rule_name=rule_name, trace=trace))

    def parse_and_convert(text, rule_name="start", trace=False, **kwargs):
        if kwargs or not isinstance(text, str):
            return original(text, rule_name=rule_name, trace=trace, **kwargs)
        return copy.deepcopy(parse(text, rule_name, bool(trace)))   # callers mutate symbols
    return parse_and_convert


def _patch_points():
    import fast_downward
    from textworld.envs.pddl import logic, textgen

    return ((fast_downward, "pddl2sas", _memoized_translate),
            (logic, "_parse_and_convert", _memoized_text_parse),
            (textgen, "_parse_and_convert", _memoized_text_parse))


def install_speedups() -> None:
    """Memoize, in this process, the pure text -> structure steps textworld's PDDL engine
    repeats: `fast_downward.pddl2sas` (PDDL -> SAS, twice per load and per reset), the
    game-logic parser `logic._parse_and_convert` (domain + grammar, every load) and the
    text parser `textgen._parse_and_convert` (tatsu, once per admissible command per step). Results are deep-copied where callers mutate them; the game text is
    unchanged (tests/test_alfworld_env.py compares transcripts). Idempotent."""
    for module, name, memoize in _patch_points():
        current = getattr(module, name)
        if getattr(current, "original", None) is None:
            patched = memoize(current)
            patched.original = current
            setattr(module, name, patched)


def uninstall_speedups() -> None:
    """Restore the library functions `install_speedups` replaced."""
    for module, name, _ in _patch_points():
        original = getattr(getattr(module, name), "original", None)
        if original is not None:
            setattr(module, name, original)


def split_intro(intro: str) -> tuple[str, str]:
    """(objective, room text) of ALFWorld's intro: the "Your task is to: X." sentence and
    what precedes it, without the welcome banner."""
    head, sep, task = intro.partition("Your task is to:")
    if not sep:
        return "", _WELCOME.sub("", intro).strip()
    return task.strip(), _WELCOME.sub("", head).strip()


def command_number_list(admissible: Sequence[str]) -> list[str]:
    """The shown list with `command_numbers`: "<command> = <k>", k the 1-based position."""
    return [f"{command}{NUMBER_SEPARATOR}{k}" for k, command in enumerate(admissible, 1)]


def command_number_reply(command: str, admissible: Sequence[str]) -> str:
    """What the policy types to issue `command` with `command_numbers`: the command, then
    its number as listed; a command not in the list is typed as is."""
    if command in admissible:
        return f"{command}{NUMBER_SEPARATOR}{list(admissible).index(command) + 1}"
    return command


def resolve_command_number(reply: str, admissible: Sequence[str]) -> str:
    """The command a `command_numbers` reply plays: its command text when that is one of
    the `admissible` commands (the number is then ignored), else the command of its number
    k (1 <= k <= len(admissible)), else the reply as typed (the game answers it)."""
    match = _COMMAND_NUMBER.match(reply)
    text = match.group(1) if match else reply
    if text in admissible:
        return text
    if match and 1 <= int(match.group(2)) <= len(admissible):
        return admissible[int(match.group(2)) - 1]
    return reply


class AlfredPddlGame:
    """One `PddlEnv` (one fast-downward library copy) under ALFWorld's wrappers, reused
    across games: `load(game)` starts a game (a path or a game.tw-pddl dict), `step`."""

    def __init__(self, expert: str | None = None, plan: bool = False):
        if expert not in EXPERT_TYPES:
            raise ValueError(f"expert must be one of {EXPERT_TYPES}, got {expert!r}")
        install_speedups()
        import textworld
        from alfworld.agents.environment.alfred_tw_env import (
            AlfredDemangler,
            AlfredExpert,
            AlfredInfos,
        )
        from textworld.envs import PddlEnv

        infos = textworld.EnvInfos(admissible_commands=True, won=True,
                                   policy_commands=plan,
                                   extras=["walkthrough", "gamefile"])
        env = AlfredInfos(AlfredDemangler(PddlEnv(infos)))
        if expert is not None:
            env = AlfredExpert(env, expert_type=expert)
        self.expert = expert
        self._env = env
        self._pddl = env.unwrapped

    def load(self, game: str | os.PathLike | Mapping):
        """Start `game`; return its first state (feedback = the intro)."""
        if not isinstance(game, Mapping):
            read_game_file(game)            # a clear error for a malformed file
            game = str(game)
        with ENGINE_LOCK:
            self._env.load(dict(game) if isinstance(game, Mapping) else game)
            return self._env.reset()

    def step(self, command: str):
        with ENGINE_LOCK:
            state, _, _ = self._env.step(command)
        return state

    def set_planning(self, on: bool) -> None:
        """Replan after every command (state["policy_commands"]) or not (much faster)."""
        self._pddl.request_infos.policy_commands = bool(on)


class PlayerPool:
    """Idle `AlfredPddlGame`s (thread-safe). Players live as long as the process: loading
    many fast-downward copies after unloading one crashes (segfault in dlopen), so none is
    ever unloaded; `shared_pool` gives every task set of the process the same pool."""

    def __init__(self, expert: str | None = None):
        self.expert = expert
        self._idle: list[AlfredPddlGame] = []
        self._lock = threading.Lock()
        self.created = 0

    def acquire(self) -> AlfredPddlGame:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            self.created += 1
        return AlfredPddlGame(self.expert)

    def release(self, player: AlfredPddlGame) -> None:
        with self._lock:
            self._idle.append(player)


_SHARED_POOLS: dict = {}
_SHARED_POOLS_LOCK = threading.Lock()


def shared_pool(expert: str | None = None) -> PlayerPool:
    """The process's pool of players for `expert` (players are reused across task sets)."""
    with _SHARED_POOLS_LOCK:
        if expert not in _SHARED_POOLS:
            _SHARED_POOLS[expert] = PlayerPool(expert)
        return _SHARED_POOLS[expert]


class AlfworldEpisode:
    """One running ALFWorld game on a borrowed player. `reset()` then `step(text)` until
    `done`. Same interface as `TextWorldEpisode` (walkthrough, reply_for, won, ...)."""

    def __init__(self, path: str, max_turns: int, style: ObservationStyle,
                 player: AlfredPddlGame, command_numbers: bool = False):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.path, self.max_turns, self.style, self.player = str(path), max_turns, style, player
        self.command_numbers = command_numbers
        self.commands: list[str] = []
        self.objective = ""
        self.walkthrough: list[str] = []
        self.admissible: list[str] = []
        self.expert_plan: list[str] = []
        self.turns, self.done, self.won, self._started = 0, False, False, False

    def _observe(self, state) -> None:
        self.admissible = list(state["admissible_commands"] or [])
        self.won = bool(state["won"])
        self.expert_plan = list(state.get("extra.expert_plan") or [])

    def _observation(self, feedback: str) -> str:
        feedback = clean_feedback(feedback, self.style.max_feedback_chars)
        if self.command_numbers:
            return format_observation(self.objective, feedback, command_number_list(self.admissible),
                                      numbered=False, one_per_line=self.style.actions_per_line)
        return format_observation(self.objective, feedback, self.admissible,
                                  self.style.numbered_actions, one_per_line=self.style.actions_per_line)

    def reset(self) -> str:
        state = self.player.load(self.path)
        self.commands, self.turns, self.done, self._started = [], 0, False, True
        self.objective, room = split_intro(state.feedback)
        self.walkthrough = list(state.get("extra.walkthrough") or [])
        self._observe(state)
        return self._observation(room)

    def reply_for(self, command: str) -> str:
        """What the policy should type to issue `command` now (its number if numbered;
        "<command> = <number>" with `command_numbers`)."""
        if self.command_numbers:
            return command_number_reply(command, self.admissible)
        return reply_for_command(command, self.admissible, self.style.numbered_actions)

    def resolve(self, text: str) -> str:
        """The command a reply plays (see `resolve_command_number` / `resolve_command`)."""
        reply = sanitize_command(text)
        if self.command_numbers:
            return resolve_command_number(reply, self.admissible)
        return resolve_command(reply, self.admissible, self.style.numbered_actions)

    def step(self, text: str) -> StepOutcome:
        if not self._started:
            raise RuntimeError("call reset() before step()")
        if self.done:
            raise RuntimeError("episode is over; call reset()")
        command = self.resolve(text)
        self.turns += 1
        state = self.player.step(command)
        self.commands.append(command)
        self._observe(state)
        self.done = bool(self.won or self.turns >= self.max_turns)
        info = {"command": command, "turns": self.turns, "lost": False}
        return StepOutcome(self._observation(state.feedback), 1.0 if self.won else 0.0,
                           self.done, self.won, info)

    def close(self) -> None:
        self._started = False


def list_alfworld_games(folder: str | os.PathLike) -> list[Path]:
    """Every `game.tw-pddl` under `folder` (recursive, sorted); a clear error if none."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(f"ALFWorld game folder {str(root)!r} does not exist")
    files = sorted(p for p in root.rglob(GAME_FILE) if p.is_file())
    if not files:
        raise FileNotFoundError(f"no {GAME_FILE} files under {str(root)!r} (generate them "
                                "with rollout_bridge.envs.alfworld_games or point at "
                                "$ALFWORLD_DATA/json_2.1.1/<split>)")
    return files


class AlfworldTasks(TextWorldTasks):
    """A set of ALFWorld games (generated or downloaded). Episodes borrow players from
    the process's shared pool and return them on `close()`. `command_numbers`: actions
    listed and replied as "<command> = <number>" (overrides `style.numbered_actions`)."""

    plays_pddl = True

    def __init__(self, game_files: Sequence[str | os.PathLike], root: str | os.PathLike,
                 max_turns: int = ALFWORLD_MAX_TURNS,
                 style: ObservationStyle = ObservationStyle(max_feedback_chars=2000),
                 expert: str | None = None, command_numbers: bool = False):
        super().__init__(game_files, root, max_turns, style)
        self.pool = shared_pool(expert)
        self.command_numbers = command_numbers

    @classmethod
    def from_folder(cls, folder: str | os.PathLike, max_turns: int = ALFWORLD_MAX_TURNS,
                    style: ObservationStyle = ObservationStyle(max_feedback_chars=2000),
                    expert: str | None = None, command_numbers: bool = False) -> "AlfworldTasks":
        return cls(list_alfworld_games(folder), folder, max_turns, style, expert, command_numbers)

    def episode(self, task_id: int, player: AlfredPddlGame | None = None,
                seed: int | None = None) -> AlfworldEpisode:
        """An episode of task `task_id`; without `player` it borrows one from the pool and
        gives it back on `close()`. `seed` is accepted and unused: ALFWorld episodes
        draw no random numbers (the commands are listed in the game's order)."""
        task_id = check_task_id(task_id, self.num_tasks)
        path = self.game_files[task_id]
        if player is not None:
            return AlfworldEpisode(path, self.max_turns, self.style, player, self.command_numbers)
        episode = AlfworldEpisode(path, self.max_turns, self.style, self.pool.acquire(),
                                  self.command_numbers)
        borrowed, close = episode.player, episode.close

        def close_and_return() -> None:
            close()
            if episode.player is not None:
                self.pool.release(borrowed)
                episode.player = None
        episode.close = close_and_return
        return episode

    def close(self) -> None:
        """Nothing to release: players stay in the process's shared pool."""


class AlfworldEnv(TextWorldEnv):
    """`Environment` over an `AlfworldTasks` set (TextWorldEnv's logic: one episode at a
    time; the episode borrows a player from the pool on `reset`, returns it on `close`)."""

    def __init__(self, tasks: AlfworldTasks):
        if not isinstance(tasks, AlfworldTasks):
            raise TypeError(f"tasks must be AlfworldTasks, got {type(tasks).__name__}")
        super().__init__(tasks)


class GameFileError(ValueError):
    """A game file that cannot be played (names the file and what is wrong)."""


def read_game_file(path: str | os.PathLike) -> dict:
    """Load and check a `game.tw-pddl` file: JSON with the keys PddlEnv needs."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise GameFileError(f"game file {str(path)!r} is not valid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise GameFileError(f"game file {str(path)!r} is not UTF-8 text (byte {exc.start}); "
                            "it is damaged or not a game.tw-pddl") from None
    except (IsADirectoryError, PermissionError) as exc:
        raise GameFileError(f"game file {str(path)!r} cannot be read: {exc.strerror}") from None
    if not isinstance(data, dict):
        raise GameFileError(f"game file {str(path)!r} must hold a JSON object, "
                            f"got {type(data).__name__}")
    for key in GAME_KEYS:
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise GameFileError(f"game file {str(path)!r}: field {key!r} is missing or empty "
                                f"(needs {', '.join(GAME_KEYS)})")
    if data.get("solvable") is False:
        raise GameFileError(f"game file {str(path)!r} is marked unsolvable")
    return data
