"""The prior stage: ``prior.rollouts_per_task`` rollouts of every task with the initial
policy -> the Jeffreys prior of the tracker (SPEC 2), reused from the run folder,
``prior.cache_dir`` or the policy's shipped records when made with the same settings on
the same tasks (``prior_key``)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from rollout_bridge.components import load_policy
from rollout_bridge.evaluation import evaluation_seed, success_rollouts
from rollout_bridge.evaluation_cache import EVALUATION_SCHEME, find_record, policy_digest, tasks_digest, write_cached
from rollout_bridge.atomic_files import write_json_atomic
from rollout_bridge.prior import prior_record, read_prior_file
from rollout_bridge.run_errors import UserError
from rollout_bridge.run_folder import RunPaths, fixed_policy_key, log
from rollout_bridge.run_report import prior_text

PRIOR_SEED_OFFSET = 1_000_003  # the prior's engine seed = job seed + this (apart from RL's)


def prior_key(cfg, policy: Path, rho: float, tasks: str | None) -> dict:
    """What the prior's episodes depend on: the settings, ``rho`` (its mass), the seed, the
    policy's content (not its path), the episode scheme and the training tasks' content
    ``tasks`` (``tasks_digest``)."""
    key = fixed_policy_key(cfg, "model", "env", "warmstart", "prior", "rollout")
    key.update(rho=rho, seed=cfg.seed, policy=policy_digest(policy), episodes=EVALUATION_SCHEME, tasks=tasks)
    return key


def run_prior(cfg, paths: RunPaths, policy: Path, chat, env, agent, make_engine: Callable, rho: float,
              concurrency: int):
    """(alpha0, beta0, record) of the offline prior (``prior.*``, SPEC 2); record None when
    not computed. ``make_engine(model, seed)`` builds the rollout engine; ``concurrency``
    episodes run at once; the prior mass is ``prior.mass`` or 1/(1 − rho)."""
    if cfg.prior.path is not None:
        alpha0, beta0 = read_prior_file(cfg.prior.path, env.num_tasks)
        return alpha0, beta0, json.loads(Path(cfg.prior.path).read_text())
    if not cfg.prior.enabled:
        half = np.full(env.num_tasks, 0.5, np.float32)
        return half, half.copy(), None
    key = prior_key(cfg, policy, rho, tasks_digest(env.train))
    if paths.prior.exists():
        record = json.loads(paths.prior.read_text())
        if record.get("key") == key:
            log(f"prior: reusing {paths.prior} ({prior_text(record)})")
            alpha0, beta0 = read_prior_file(paths.prior, env.num_tasks)
            return alpha0, beta0, record
    found = find_record(cfg.prior.cache_dir, policy, "prior", key)
    if found.record is not None:
        record = found.record
        log(f"prior: {found.line} ({prior_text(record)})")
        write_json_atomic(paths.prior, record)
        alpha0, beta0 = read_prior_file(paths.prior, env.num_tasks)
        return alpha0, beta0, record
    if found.line is not None:
        log(f"prior: {found.line}")
    n = cfg.prior.rollouts_per_task
    log(f"prior: {n} rollouts x {env.num_tasks} tasks with the initial policy")
    start = time.time()

    async def rollouts():
        engine = make_engine(load_policy(policy, cfg.model), cfg.seed + PRIOR_SEED_OFFSET)
        try:
            return await success_rollouts(engine, env, chat, agent, concurrency, n, "prior", cfg.progress,
                                          evaluation_seed(cfg.seed, "train"))
        finally:
            await engine.close()

    successes, trials = asyncio.run(rollouts())
    if not np.asarray(trials).sum():  # a prior of no evidence would be saved as success NaN and reused
        raise UserError(f"prior: none of the {n * env.num_tasks} episodes finished, so no prior was written "
                        f"(a prompt longer than rollout.max_total_tokens={cfg.rollout.max_total_tokens}, or an env that fails "
                        "every episode?)", "config error")
    mass = cfg.prior.mass if cfg.prior.mass is not None else 1.0 / (1.0 - rho)
    record = prior_record(successes, trials, mass)
    record.update(key=key, wall_s=time.time() - start)
    write_json_atomic(paths.prior, record)
    write_cached(cfg.prior.cache_dir, "prior", key, record)
    log(f"prior: {prior_text(record)} in {time.time() - start:.0f}s")
    return np.asarray(record["alpha0"], np.float32), np.asarray(record["beta0"], np.float32), record
