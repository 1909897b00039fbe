"""Offline value prior (SPEC 2): n rollouts per task with the initial policy -> Jeffreys prior.

    α0_x = M (s_x + ½)/(n + 1),   β0_x = M (n − s_x + ½)/(n + 1),   M = 1/(1 − ρ) = 8

(`spopp_jax.priors.jeffreys_prior`), s_x = successes of task x in n rollouts. The same
rollout routine measures a policy's success rate (`evaluate_policy`), which is how the run
reports success before RL (= the prior rollouts) and after RL.

The prior file is JSON: {"num_tasks", "rollouts_per_task", "mass", "successes",
"trials", "alpha0", "beta0", "success_rate"}; written atomically, read back with
`read_prior_file` (which checks the task count).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from rollout_bridge.agent import AgentConfig, ChatFormat, derived_seed, run_episode
from rollout_bridge.engine.base import RolloutEngine
from rollout_bridge.envs.base import EnvFactory
from rollout_bridge.trajectory import DispatchStamp


async def rollout_successes(engine: RolloutEngine, env_factory: EnvFactory, chat: ChatFormat,
                            num_tasks: int, rollouts_per_task: int,
                            agent_config: AgentConfig, max_concurrency: int = 16,
                            on_done: Callable[[int], None] | None = None,
                            crn_seed: int | None = None,
                            task_ids: Sequence[int] | None = None,
                            semaphore: asyncio.Semaphore | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(successes, trials) per task, [num_tasks] int64 each, from `rollouts_per_task`
    episodes of every task in `task_ids` (None: all `num_tasks`; the others keep 0 trials)
    with the engine's current policy. Failed or aborted episodes are not counted as trials
    (no evidence either way).

    `crn_seed`: episode r of task t plays with episode seed ``derived_seed(crn_seed, t, r)``
    (`run_episode`), so every policy evaluated with the same `crn_seed` meets the same
    random numbers (common random numbers: the per-task paired difference of two policies
    loses the noise they share). None: the engine's and the env's own draws.
    `semaphore`: the episodes in flight, shared with evaluations running beside this one on
    the same engine (acquired first come, first served); None: `max_concurrency` of its own."""
    if num_tasks < 1 or rollouts_per_task < 1 or max_concurrency < 1:
        raise ValueError(f"num_tasks, rollouts_per_task and max_concurrency must be >= 1, got "
                         f"{num_tasks}, {rollouts_per_task}, {max_concurrency}")
    task_ids = range(num_tasks) if task_ids is None else [int(t) for t in task_ids]
    if not task_ids or len(set(task_ids)) != len(task_ids) or not all(0 <= t < num_tasks for t in task_ids):
        raise ValueError(f"task_ids must be distinct task ids in [0, {num_tasks}), at least one")
    successes = np.zeros(num_tasks, np.int64)
    trials = np.zeros(num_tasks, np.int64)
    if semaphore is None:
        semaphore = asyncio.Semaphore(max_concurrency)
    event = int(engine.policy_event)
    finished = 0

    async def one(request_id: int, task_id: int, round_index: int) -> None:
        nonlocal finished
        seed = None if crn_seed is None else derived_seed(crn_seed, task_id, round_index)
        async with semaphore:
            env = env_factory()
            stamp = DispatchStamp(request_id, task_id, event, 0.0, float("nan"), 0.0)
            try:
                trajectory = await run_episode(engine, env, chat, stamp, agent_config, seed)
            finally:
                close = getattr(env, "close", None)
                if close is not None:
                    result = close()
                    if asyncio.iscoroutine(result):
                        await result
        if trajectory.usable:
            trials[task_id] += 1
            successes[task_id] += int(trajectory.reward == 1.0)
        finished += 1
        if on_done is not None:
            on_done(finished)

    # interleave tasks (round r of every task, then round r+1) so progress is even
    jobs = [(r * num_tasks + t, t, r) for r in range(rollouts_per_task) for t in task_ids]
    await asyncio.gather(*(one(i, t, r) for i, t, r in jobs))
    return successes, trials


def prior_record(successes: Sequence[int], trials: Sequence[int], mass: float) -> dict:
    from spopp_jax.priors import jeffreys_prior

    successes = np.asarray(successes, np.int64)
    trials = np.asarray(trials, np.int64)
    alpha0, beta0 = jeffreys_prior(successes, trials, mass)
    total = int(trials.sum())
    return {
        "num_tasks": int(successes.shape[0]),
        "rollouts_per_task": int(trials.max(initial=0)),
        "mass": float(mass),
        "successes": successes.tolist(),
        "trials": trials.tolist(),
        "alpha0": np.asarray(alpha0, np.float64).tolist(),
        "beta0": np.asarray(beta0, np.float64).tolist(),
        "success_rate": float(successes.sum() / total) if total else float("nan"),
    }


def read_prior_file(path: str | os.PathLike, num_tasks: int) -> tuple[np.ndarray, np.ndarray]:
    """(alpha0, beta0) float32 [num_tasks] from a prior file; the task count must match."""
    with open(path) as f:
        try:
            record = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"prior file {str(path)!r} is not valid JSON: {error}") from None
    missing = [key for key in ("alpha0", "beta0") if key not in record]
    if missing:
        raise ValueError(f"prior file {str(path)!r} lacks {', '.join(map(repr, missing))}")
    alpha0 = np.asarray(record["alpha0"], np.float32)
    beta0 = np.asarray(record["beta0"], np.float32)
    if alpha0.shape != (num_tasks,) or beta0.shape != (num_tasks,):
        raise ValueError(f"prior file {str(path)!r} has {alpha0.shape[0]} tasks, the task set "
                         f"has {num_tasks}")
    if not (np.all(alpha0 > 0) and np.all(beta0 > 0)):
        raise ValueError(f"prior file {str(path)!r} has non-positive alpha0/beta0")
    return alpha0, beta0
