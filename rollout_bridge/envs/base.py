"""The environment interface.

An environment plays one episode at a time: ``reset(task_id)`` starts the repeatable task
``task_id`` (a stable integer in ``[0, num_tasks)``, SPEC 2 "task identity") and returns
the first observation text; ``step(action_text)`` returns ``StepResult(observation,
reward, done)``. Rewards are binary and terminal (SPEC 1): 0.0 on every non-final step,
1.0 or 0.0 on the step that ends the episode.

Environments may be slow. Synchronous ones implement :class:`Environment` and are driven
off the event loop through :func:`as_async` (``asyncio.to_thread``); environments that are
natively async implement :class:`AsyncEnvironment`. The orchestrator builds one
environment per concurrent episode with an ``env_factory`` (a zero-argument callable).
"""

from __future__ import annotations

import abc
import asyncio
import threading
from typing import Callable, NamedTuple, Union


class StepResult(NamedTuple):
    """Outcome of one environment step: next observation, reward in {0, 1}, episode end."""

    observation: str
    reward: float
    done: bool


class Environment(abc.ABC):
    """A synchronous, possibly slow environment (one episode at a time)."""

    num_tasks: int

    @abc.abstractmethod
    def reset(self, task_id: int) -> str:
        """Start task ``task_id``; return the first observation."""

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the agent's reply; return the next observation, reward and done flag."""

    def set_episode_seed(self, seed: int | None) -> None:
        """Fix the random numbers of the next ``reset``'s episode (evaluations give every
        policy the same ones); default: the environment draws none, nothing to fix."""

    def close(self) -> None:
        """Release resources (default: none)."""


class AsyncEnvironment(abc.ABC):
    """A natively asynchronous environment (one episode at a time)."""

    num_tasks: int

    @abc.abstractmethod
    async def reset(self, task_id: int) -> str:
        """Start task ``task_id``; return the first observation."""

    @abc.abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply the agent's reply; return the next observation, reward and done flag."""

    def set_episode_seed(self, seed: int | None) -> None:
        """As :meth:`Environment.set_episode_seed` (default: nothing to fix)."""

    async def close(self) -> None:
        """Release resources (default: none)."""


class ThreadedEnvironment(AsyncEnvironment):
    """Runs a synchronous :class:`Environment` in worker threads (``asyncio.to_thread``),
    one call at a time.

    Cancelling a coroutine that awaits a call does not stop the call's thread (asyncio
    cannot), so when the orchestrator aborts an episode during ``step`` the step goes on
    while the episode's cancellation handler asks for ``close``. Calls are therefore
    serialized by a per-environment lock taken in the worker thread: that ``close`` runs
    after the step returns. Unserialized, closing a TextWorld game unloads its Z-machine
    interpreter (jericho: ``shutdown`` + ``dlclose``) under the running step and crashes
    the process with a segmentation fault (episodes are aborted this way at the end of RL).
    """

    def __init__(self, env: Environment):
        self.env = env
        self.num_tasks = env.num_tasks
        self._one_call_at_a_time = threading.Lock()

    def set_episode_seed(self, seed: int | None) -> None:
        self.env.set_episode_seed(seed)

    def _serialized(self, method: Callable, *args):
        with self._one_call_at_a_time:
            return method(*args)

    async def reset(self, task_id: int) -> str:
        return await asyncio.to_thread(self._serialized, self.env.reset, task_id)

    async def step(self, action_text: str) -> StepResult:
        return await asyncio.to_thread(self._serialized, self.env.step, action_text)

    async def close(self) -> None:
        await asyncio.to_thread(self._serialized, self.env.close)


AnyEnvironment = Union[Environment, AsyncEnvironment]
EnvFactory = Callable[[], AnyEnvironment]


def as_async(env: AnyEnvironment) -> AsyncEnvironment:
    """Return ``env`` itself if it is async, else wrap it in :class:`ThreadedEnvironment`."""
    if isinstance(env, AsyncEnvironment):
        return env
    if isinstance(env, Environment):
        return ThreadedEnvironment(env)
    raise TypeError(f"env must be an Environment or AsyncEnvironment, got {type(env).__name__}")


def check_task_id(task_id: int, num_tasks: int) -> int:
    """Validate a task id: an integer in ``[0, num_tasks)``; raises ValueError otherwise."""
    if isinstance(task_id, bool) or int(task_id) != task_id:
        raise ValueError(f"task_id must be an integer, got {task_id!r}")
    if not 0 <= int(task_id) < num_tasks:
        raise ValueError(f"task_id must be in [0, {num_tasks}), got {task_id}")
    return int(task_id)
