"""A tiny synthetic multi-turn environment with a learnable, checkable success rule.

Task ``x`` (deterministic from ``(seed, x)``) has ``num_turns(x)`` in ``[1, max_turns]``
rounds. Each round's observation shows a target word (``... say: <word>``) after a
task-dependent amount of filler text. The agent succeeds on a round when the first word of
its reply equals the target word (case-insensitive, punctuation stripped); a wrong reply
ends the episode with reward 0; answering every round ends it with reward 1 (binary
terminal reward, SPEC 1). Episode lengths (rounds and observation sizes) vary by task.

Tests can inject latency (``latency(task_id, call) -> seconds``, ``call`` = 0 for reset,
1.. for steps) and faults (``fault(task_id, call) -> bool``: raise :class:`EnvFault`).
``SyntheticEnv`` is synchronous (``time.sleep``; run through ``as_async``);
``AsyncSyntheticEnv`` sleeps with ``asyncio.sleep`` (exact under virtual time).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from dataclasses import dataclass
from typing import Callable

from rollout_bridge.envs.base import AsyncEnvironment, Environment, StepResult, check_task_id

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket",
    "garden", "silver", "candle", "forest", "window", "planet", "bridge", "honey",
)
FILLER = ("the", "room", "is", "quiet", "and", "a", "lamp", "glows", "near", "door")


class EnvFault(RuntimeError):
    """An injected environment failure."""


@dataclass(frozen=True)
class SyntheticTask:
    """The deterministic content of one task: its target words and filler lengths."""

    task_id: int
    words: tuple[str, ...]
    filler_lengths: tuple[int, ...]


def make_task(task_id: int, seed: int = 0, max_turns: int = 3, max_filler: int = 12) -> SyntheticTask:
    """Task ``task_id``: 1..max_turns rounds, each with a target word and filler length."""
    rng = random.Random(f"synthetic-{seed}-{task_id}")
    num_turns = 1 + task_id % max_turns
    words = tuple(rng.choice(WORDS) for _ in range(num_turns))
    filler_lengths = tuple(rng.randint(0, max_filler) for _ in range(num_turns))
    return SyntheticTask(task_id, words, filler_lengths)


def first_word(text: str) -> str:
    """The first alphabetic word of ``text``, lower-cased ('' if none)."""
    match = re.search(r"[A-Za-z]+", text)
    return match.group(0).lower() if match else ""


def render_observation(task: SyntheticTask, round_index: int) -> str:
    """Observation of round ``round_index``: filler words, then ``say: <word>``."""
    rng = random.Random(f"filler-{task.task_id}-{round_index}")
    filler = " ".join(rng.choice(FILLER) for _ in range(task.filler_lengths[round_index]))
    prefix = f"{filler}. " if filler else ""
    return f"{prefix}Round {round_index + 1} of {len(task.words)}, say: {task.words[round_index]}"


class _SyntheticCore:
    """Episode state machine shared by the sync and async variants."""

    def __init__(
        self,
        num_tasks: int = 16,
        seed: int = 0,
        max_turns: int = 3,
        max_filler: int = 12,
        latency: Callable[[int, int], float] | None = None,
        fault: Callable[[int, int], bool] | None = None,
    ):
        if num_tasks < 1:
            raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.num_tasks = num_tasks
        self.seed = seed
        self.max_turns = max_turns
        self.max_filler = max_filler
        self.latency = latency
        self.fault = fault
        self.task: SyntheticTask | None = None
        self.round = 0
        self.calls = 0

    def _begin_call(self, task_id: int) -> float:
        call = self.calls
        self.calls += 1
        if self.fault is not None and self.fault(task_id, call):
            raise EnvFault(f"injected fault: task {task_id}, call {call}")
        return float(self.latency(task_id, call)) if self.latency is not None else 0.0

    def _reset(self, task_id: int) -> str:
        task_id = check_task_id(task_id, self.num_tasks)
        self.task = make_task(task_id, self.seed, self.max_turns, self.max_filler)
        self.round = 0
        return render_observation(self.task, 0)

    def _step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("step() called before reset()")
        target = self.task.words[self.round]
        if first_word(action_text) != target:
            self.task = None
            return StepResult("Wrong.", 0.0, True)
        self.round += 1
        if self.round == len(self.task.words):
            self.task = None
            return StepResult("Correct. Done.", 1.0, True)
        return StepResult("Correct. " + render_observation(self.task, self.round), 0.0, False)

    def _task_id(self) -> int:
        return self.task.task_id if self.task is not None else -1


class SyntheticEnv(_SyntheticCore, Environment):
    """Synchronous synthetic environment (latency via ``time.sleep``)."""

    def reset(self, task_id: int) -> str:
        self.calls = 0
        delay = self._begin_call(task_id)
        if delay > 0:
            time.sleep(delay)
        return self._reset(task_id)

    def step(self, action_text: str) -> StepResult:
        delay = self._begin_call(self._task_id())
        if delay > 0:
            time.sleep(delay)
        return self._step(action_text)


class AsyncSyntheticEnv(_SyntheticCore, AsyncEnvironment):
    """Asynchronous synthetic environment (latency via ``asyncio.sleep``)."""

    async def reset(self, task_id: int) -> str:
        self.calls = 0
        delay = self._begin_call(task_id)
        if delay > 0:
            await asyncio.sleep(delay)
        return self._reset(task_id)

    async def step(self, action_text: str) -> StepResult:
        delay = self._begin_call(self._task_id())
        if delay > 0:
            await asyncio.sleep(delay)
        return self._step(action_text)
