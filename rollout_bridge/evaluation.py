"""Evaluation: ``n`` rollouts of every task of a set with one policy, with common random
numbers per set (``evaluation_seed``), so that the prior and the evaluations before and
after RL compare policies on the same episodes. The evaluations of the final policy after
RL (``evaluate_after_rl``) and of the initial policy on the env kind's extra sets before RL
(``evaluate_policy``, cached in ``prior.cache_dir`` or shipped with the policy)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from rollout_bridge.agent import derived_seed
from rollout_bridge.components import load_policy
from rollout_bridge.evaluation_cache import EVALUATION_SCHEME, find_record, policy_digest, tasks_digest, write_cached
from rollout_bridge.prior import rollout_successes
from rollout_bridge.progress_lines import TenthLines, show_bar
from rollout_bridge.run_folder import fixed_policy_key, log

EXTRA_EVAL_SEED_OFFSET = 17  # the extra evaluations' engine seed (apart from the prior's and RL's)



# ------------------------------------------------------------------ stage: prior / evaluation
def evaluation_seed(seed: int, task_set: str) -> int:
    """The common-random-numbers seed of the job's evaluations of ``task_set`` ("train",
    "heldout", ...): the prior and the evaluations before and after RL of one job (and
    ``scripts/heldout_eval.py``) give every policy the same random numbers per episode."""
    return derived_seed(seed, "evaluation", task_set)


async def success_rollouts(engine, env, chat, agent, concurrency: int, n: int, what: str, progress: bool,
                           crn_seed: int | None = None, task_ids=None, semaphore=None):
    """(successes, trials) per task of ``n`` rollouts of every task in ``task_ids`` (None:
    all) with ``engine``; ``crn_seed``: common random numbers, ``semaphore``: episodes in
    flight shared with other evaluations (``rollout_successes``)."""
    from tqdm import tqdm

    total = (env.num_tasks if task_ids is None else len(task_ids)) * n
    shown = show_bar(progress)
    bar = tqdm(total=total, desc=what, disable=not shown, leave=False)
    lines = TenthLines(what, None if shown else log, total, unit=" episodes")
    try:
        return await rollout_successes(engine, env.env_factory, chat, env.num_tasks, n, agent, concurrency,
                                       on_done=lambda _: (bar.update(1), lines.step()), crn_seed=crn_seed,
                                       task_ids=task_ids, semaphore=semaphore)
    finally:
        bar.close()


async def extra_evaluations(engine, env, chat, agent, concurrency: int, n: int, when: str,
                            progress: bool, seed: int, semaphore=None) -> dict:
    """The env kind's additional evaluations (``env.extra_evals``: ALFWorld's held-out
    games, Math-TIR with the tool disabled): name -> {success_rate, successes, trials}
    (per task) of ``n`` rollouts per task; ``when`` names it in the log ("before RL", ...).
    Each set plays with common random numbers ``evaluation_seed(seed, name)``; ``semaphore``:
    episodes in flight shared with other evaluations (``rollout_successes``)."""
    results = {}
    for name, (tasks, factory) in env.extra_evals.items():
        view = dataclasses.replace(env, train=tasks, env_factory=factory)
        log(f"evaluation {when} ({name}): {n} rollouts x {view.num_tasks} tasks")
        successes, trials = await success_rollouts(engine, view, chat, agent, concurrency, n, name, progress,
                                                   evaluation_seed(seed, name), semaphore=semaphore)
        results[name] = {"success_rate": float(successes.sum() / max(trials.sum(), 1)),
                         "successes": successes.tolist(), "trials": trials.tolist()}
        log(f"evaluation {when} ({name}): success {results[name]['success_rate']:.3f}")
    return results


def evaluation_key(cfg, policy: Path, rollouts: int, sets: dict[str, str | None]) -> dict:
    """What the evaluations before RL depend on: the settings (not ``env.rename_episodes``,
    which renames training episodes only), the seed, the policy's content, ``rollouts``
    per task, the episode scheme and ``sets``: each evaluated set's name -> its content
    (``tasks_digest``)."""
    key = fixed_policy_key(cfg, "model", "env", "warmstart", "rollout")
    key.update(seed=cfg.seed, policy=policy_digest(policy), rollouts=rollouts, sets=sorted(sets),
               episodes=EVALUATION_SCHEME, tasks=dict(sorted(sets.items())))
    key["env"].pop("rename_episodes", None)
    return key


async def evaluate_policy(job, policy: Path, chat, rollouts: int | None = None, when: str = "before RL") -> dict:
    """The env kind's extra evaluations of ``policy`` (an HF folder) on a fresh engine seeded
    ``seed + EXTRA_EVAL_SEED_OFFSET``, ``rollouts`` per task (default
    ``evaluation.heldout_rollouts``), with common random numbers; empty when the env kind has
    none. Read from ``prior.cache_dir`` when an earlier run made the same evaluation, or
    from the policy's shipped records when they were measured on the same games."""
    if not job.env.extra_evals:
        return {}
    cfg = job.cfg
    rollouts = rollouts or cfg.evaluation.rollouts(cfg.prior, "heldout")
    key = evaluation_key(cfg, policy, rollouts,
                         {name: tasks_digest(tasks) for name, (tasks, _) in job.env.extra_evals.items()})
    found = find_record(cfg.prior.cache_dir, policy, "evaluation", key)
    if found.record is not None:
        for name, record in found.record.items():
            log(f"evaluation {when} ({name}): {found.line}: success {record['success_rate']:.3f}")
        return found.record
    if found.line is not None:
        log(f"evaluation {when}: {found.line}")
    engine = job.engine(load_policy(policy, cfg.model), seed=cfg.seed + EXTRA_EVAL_SEED_OFFSET)
    try:
        results = await extra_evaluations(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight,
                                          rollouts, when, cfg.progress, cfg.seed)
    finally:
        await engine.close()
    write_cached(cfg.prior.cache_dir, "evaluation", key, results)
    return results


async def evaluate_after_rl(job, engine, chat):
    """(successes, trials, extra) of the final policy on ``engine``: ``evaluation.train_rollouts``
    per training task (``evaluation.train_games`` of them) and the env kind's extra
    evaluations, ``evaluation.heldout_rollouts`` per task. The sets share the engine's
    ``max_in_flight`` episodes in flight, the training tasks' first: the held-out episodes
    fill the slots the last training episodes leave, with no idle tail between the sets
    (each episode plays its own common random numbers, whichever set it runs beside)."""
    cfg = job.cfg
    n = cfg.evaluation.rollouts(cfg.prior, "train")
    tasks = cfg.evaluation.train_task_ids(job.env.num_tasks)
    log(f"evaluation: {n} rollouts x {len(tasks)} tasks with the final policy"
        + (f" (training tasks 0-{len(tasks) - 1} of {job.env.num_tasks})" if len(tasks) < job.env.num_tasks else "")
        + (", then the held-out sets in the slots they leave" if job.env.extra_evals else ""))
    in_flight = asyncio.Semaphore(job.orchestrator.max_in_flight)
    (successes, trials), extra = await asyncio.gather(
        success_rollouts(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight, n, "eval", cfg.progress,
                         evaluation_seed(cfg.seed, "train"), tasks, semaphore=in_flight),
        extra_evaluations(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight,
                          cfg.evaluation.rollouts(cfg.prior, "heldout"), "after RL", cfg.progress,
                          cfg.seed, semaphore=in_flight))
    return successes, trials, extra
