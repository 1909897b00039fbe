#!/usr/bin/env python
"""SPO++ training job: warm start (SFT), offline prior, asynchronous single-stream RL.

    python train.py                                   # TrainConfig's defaults: the agentic TextWorld job (configs/default.yaml)
    python train.py --config_path configs/smoke.yaml  # the tiny 2-turn smoke job
    python train.py --config_path configs/alfworld_qwen35_0p8b.yaml
    python train.py --rollout.batch_size 32 --tracker.rho 0.9 --output_dir runs/x
    python train.py --resume                          # continue from the newest checkpoint
    python train.py --stage warmstart                 # only the cold-start SFT
    python train.py --stage prior                     # only the n-rollouts-per-task prior
    python train.py --rollout.engine vllm_server --rollout.servers.launch.count 2   # on vLLM servers
    JAX_COORDINATOR_ADDRESS=h:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<i> python train.py --distributed

Every field of `rollout_bridge.config.TrainConfig` is a flag (draccus). This script only
composes: each component is built from its own config section by
`rollout_bridge.components` (which also holds the extension points: argv preprocessors,
metric sinks, end-of-run hooks), the env kind by `rollout_bridge.envs.kinds`, the method
by `rollout_bridge.methods`. Stages (stage=all runs them in order; each reuses its output
in `output_dir` when it was made with the same settings):
 1. tasks (the env kind's bundle) and the policy: `model.path` or a tiny local model.
 2. warm start: SFT on teacher demonstrations -> `output_dir/warmstart_model`.
 3. prior: `prior.rollouts_per_task` rollouts of every task -> Jeffreys prior (SPEC 2) in
    `output_dir/prior.json`; its success rate is the success BEFORE RL.
 4. RL: the orchestrator + `PolicyLearner`; metrics to `metrics.jsonl` / TensorBoard, an
    orbax checkpoint every `checkpoint_every` updates (learner state, the method's state
    incl. SPO's previous responses, sampler RNG, counters, buffered trajectories), then
    the evaluation of the final policy (success AFTER RL; `evaluation.train_rollouts` per
    training task and `evaluation.heldout_rollouts` per held-out task, each defaulting to
    `prior.rollouts_per_task`) and `learning_curve.png`;
    the final policy as a HF folder in `hf_model` (with `export_every` also
    `exports/step_<k>`), and with `--wandb true` the metrics also in Weights & Biases.
Rollout engines (`rollout.engine`): the embedded JAX engine, vLLM in this process, or vLLM
servers given by URL or launched by this script (docs/FLEET.md); every stage uses the same
one. `--distributed`: the learner as several processes; process 0 runs the job and feeds the
others each learner call (rollout_bridge/learner_processes.py, distributed_learner.py).
verl knob names are accepted as aliases (`--actor.clip_ratio_low 0.2`, docs/CONVENTIONS.md).
A user mistake (missing config file, unwritable output_dir, full disk, a setting this
version lacks) ends in one line and exit status 2 (rollout_bridge.run_errors).
A crash loses at most the updates since the last checkpoint; `--resume` restores it exactly.
"""

from __future__ import annotations

import os
import sys

from rollout_bridge.run_guard import install_signal_handlers

if __name__ == "__main__":
    install_signal_handlers()  # before the heavy imports: Ctrl-C / SIGTERM end in one line at any stage
    # GPUs of the learner and launched servers, JAX's memory settings: before JAX loads
    from rollout_bridge.node_layout import apply_before_jax

    apply_before_jax(sys.argv[1:], os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "default.yaml"))

import asyncio
import dataclasses
import faulthandler
import time
from pathlib import Path
from typing import Sequence

import jax
import numpy as np

from rollout_bridge import components as build
from rollout_bridge import distributed_learner as distributed
from rollout_bridge.distributed_learner import LeaderLearner
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.evaluation_cache import EVALUATION_SCHEME, cache_file, read_cached, write_cached
from rollout_bridge.job import (RunPaths, UpdateLogger, checkpoint_key, enable_compilation_cache, evaluation_seed,
                                extra_evaluations, folder_digest, latest_checkpoint_step, log, refuse_overwrite,
                                report_run, run_prior, run_warmstart, stage_key, state_digest, success_rollouts)
from rollout_bridge.metrics import MetricsWriter, read_metrics
from rollout_bridge.learner_processes import DISTRIBUTED_FLAG, build_learner, follow_process_0, start_distributed
from rollout_bridge.orchestrator import Orchestrator
from rollout_bridge.prior import write_json_atomic
from rollout_bridge.run_guard import prepare_run, run_guarded
from rollout_bridge.run_report import final_line, log_regime, stage_times
from spopp_jax.checkpoint import CheckpointMismatchError, Checkpointer
from rollout_bridge.config import ConfigFileError, TrainConfig, format_config_error, load_config
from rollout_bridge.run_errors import (UserError, check_config_path, check_output_dir, config_path_argument,
                                  run_cleanly, unknown_fields_line)

ENGINE_SEED_STRIDE = 7919  # RL engine seed = job seed x this + resumed step (a fresh stream per resume)
EXTRA_EVAL_SEED_OFFSET = 17  # the extra evaluations' engine seed (apart from the prior's and RL's)


def parse_config(argv: Sequence[str]) -> TrainConfig:
    """draccus parse after the argv hooks (verl aliases); a missing config file, a refused
    alias, a bad value or a setting this version lacks raise UserError (one line, exit 2
    through run_cleanly) naming the file / field."""
    from draccus.utils import ParsingError

    check_config_path(argv)
    try:
        return load_config(build.preprocess_argv(list(argv)))
    except ConfigFileError as error:
        raise UserError(str(error), "config error") from None
    except ParsingError as error:
        message = format_config_error(error)
        older = unknown_fields_line(message, config_path_argument(argv), TrainConfig)
        raise UserError(older or message, "config error") from None


@dataclasses.dataclass
class Job:
    """The built components every stage shares."""

    cfg: TrainConfig
    paths: RunPaths
    env: object
    agent: object
    orchestrator: object
    learner: object
    servers: object = None  # rollout.engine=vllm_server: the job's vLLM servers (started)
    policy_folder: Path | None = None  # the initial policy's HF folder (tokenizer of vLLM weight folders)

    def engine(self, model, seed: int, policy_event: int = 0):
        return build.build_engine(self.cfg, model, self.agent, self.orchestrator, policy_event, seed,
                                  servers=self.servers, policy_folder=self.policy_folder, run_dir=self.paths.root)

    def engine_metrics(self, engine=None) -> dict:
        """Per-update counters of the rollout servers (restarts, lost servers, publish times),
        or the embedded engine's prefill counters (run totals: prefilled and reused prompt
        tokens, requests on cache rows of an older policy event)."""
        if self.servers is not None:
            return self.servers.metrics()
        stats = getattr(engine, "prefix_stats", None)
        return {} if stats is None else {k: float(v) for k, v in dataclasses.asdict(stats).items()}


async def rl_loop(job: Job, policy: Path, chat, alpha0, beta0):
    cfg, paths = job.cfg, job.paths
    # several learner processes: the others start following; then, in the same order on
    # every process, the checkpointer (orbax syncs the processes) and the learner
    distributed.share_from_process_0(str(policy))
    checkpointer = Checkpointer(paths.checkpoints, max_to_keep=cfg.keep_checkpoints)
    latest = checkpointer.latest_step()
    refuse_overwrite(cfg.resume, latest, paths)
    learner = LeaderLearner(build_learner(cfg, job.learner, job.orchestrator, policy))
    try:
        return await rl_stage(job, policy, chat, alpha0, beta0, learner, checkpointer, latest)
    finally:
        learner.stop()
        checkpointer.close()


async def rl_stage(job: Job, policy: Path, chat, alpha0, beta0, learner: LeaderLearner, checkpointer, latest):
    cfg, paths = job.cfg, job.paths
    engine = job.engine(learner.weights(), seed=cfg.seed * ENGINE_SEED_STRIDE + (latest or 0))
    orchestrator = Orchestrator(engine, job.env.env_factory, chat, learner, job.env.num_tasks, job.orchestrator,
                                job.agent, prior_alpha=alpha0, prior_beta=beta0)
    resume_step = None
    if cfg.resume and latest is not None:  # exactly as saved; the engine then serves the saved weights
        try:
            restored = learner.restore(checkpointer, latest, checkpoint_key(cfg))  # every learner process
        except CheckpointMismatchError as error:
            raise UserError(f"--resume: {error}\n(resume with that run's settings, or choose a new "
                            "--output_dir)") from None
        orchestrator.load_state_dict(restored.extras["orchestrator"])
        await engine.publish(learner.weights(), orchestrator.policy_event)
        resume_step = restored.step
        log(f"resume: step {restored.step}, policy event {orchestrator.policy_event}, method state sha1 "
            f"{state_digest(orchestrator.state_dict()['method'])}, {len(orchestrator.ready)} buffered trajectories")
    writer = MetricsWriter(paths.root, cfg.tensorboard, resume_step=resume_step, sinks=build.wandb_sinks(cfg, paths.root, log))
    sinks = [UpdateLogger(writer, cfg.steps, orchestrator.updates, cfg.progress,
                          extra=lambda: job.engine_metrics(engine))]
    sinks += build.metric_sinks(cfg, paths.root)
    orchestrator.on_update = sinks
    try:
        while orchestrator.updates < cfg.steps:
            chunk = min(cfg.checkpoint_every - orchestrator.updates % cfg.checkpoint_every,
                        cfg.steps - orchestrator.updates)
            await orchestrator.run(chunk)
            learner.save(checkpointer, orchestrator.updates, {"orchestrator": orchestrator.state_dict(),
                         **writer.checkpoint_extras()}, checkpoint_key(cfg))
            if cfg.export_every and orchestrator.updates % cfg.export_every == 0:
                build.export_policy(cfg, learner, policy, paths.export(orchestrator.updates), log)
        build.export_policy(cfg, learner, policy, paths.hf_model, log)
        await orchestrator.close()
        for sink in sinks:
            getattr(sink, "close", lambda: None)()
        n = cfg.evaluation.rollouts(cfg.prior, "train")
        tasks = cfg.evaluation.train_task_ids(job.env.num_tasks)
        log(f"evaluation: {n} rollouts x {len(tasks)} tasks with the final policy"
            + (f" (training tasks 0-{len(tasks) - 1} of {job.env.num_tasks})" if len(tasks) < job.env.num_tasks else ""))
        successes, trials = await success_rollouts(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight,
                                                   n, "eval", cfg.progress, evaluation_seed(cfg.seed, "train"), tasks)
        extra = await extra_evaluations(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight,
                                        cfg.evaluation.rollouts(cfg.prior, "heldout"), "after RL", cfg.progress,
                                        cfg.seed)
    finally:
        await engine.close()
    learner.stop()
    for hook in build.END_OF_RUN_HOOKS:
        hook(cfg, paths.root, learner)
    return successes, trials, extra


async def evaluate_policy(job: Job, policy: Path, chat, rollouts: int | None = None, when: str = "before RL") -> dict:
    """The env kind's extra evaluations of ``policy`` (an HF folder) on a fresh engine seeded
    ``seed + EXTRA_EVAL_SEED_OFFSET``, ``rollouts`` per task (default
    ``evaluation.heldout_rollouts``), with common random numbers; empty when the env kind has
    none. Read from ``prior.cache_dir`` when an earlier run made the same evaluation."""
    if not job.env.extra_evals:
        return {}
    cfg = job.cfg
    rollouts = rollouts or cfg.evaluation.rollouts(cfg.prior, "heldout")
    key = stage_key(cfg, "model", "env", "warmstart", "rollout")
    key.update(seed=cfg.seed, policy=folder_digest(policy), rollouts=rollouts, sets=sorted(job.env.extra_evals),
               episodes=EVALUATION_SCHEME)
    key["env"].pop("rename_episodes", None)   # renames training episodes only, never these sets
    cached = read_cached(cfg.prior.cache_dir, "evaluation", key)
    if cached is not None:
        for name, record in cached.items():
            log(f"evaluation {when} ({name}): reusing {cache_file(cfg.prior.cache_dir, 'evaluation', key)} "
                f"from an earlier run: success {record['success_rate']:.3f}")
        return cached
    engine = job.engine(build.load_policy(policy, cfg.model), seed=cfg.seed + EXTRA_EVAL_SEED_OFFSET)
    try:
        results = await extra_evaluations(engine, job.env, chat, job.agent, job.orchestrator.max_in_flight,
                                          rollouts, when, cfg.progress, cfg.seed)
    finally:
        await engine.close()
    write_cached(cfg.prior.cache_dir, "evaluation", key, results)
    return results


def run_rl(job: Job, policy: Path, chat, alpha0, beta0, prior: dict | None) -> dict:
    start = time.time()
    before_extra = asyncio.run(evaluate_policy(job, policy, chat))
    successes, trials, after_extra = asyncio.run(rl_loop(job, policy, chat, alpha0, beta0))
    after = float(successes.sum() / max(trials.sum(), 1))
    paths = job.paths
    after_record = {"successes": successes.tolist(), "trials": trials.tolist(), "success_rate": after}
    write_json_atomic(paths.eval_after, after_record)
    rows = read_metrics(paths.root / "metrics.jsonl")
    prior = None if prior is None else same_tasks(prior, after_record)
    before = None if prior is None else prior["success_rate"]
    summary = {"success_before_rl": before, "success_after_rl": after,
               "success_per_step": [r.get("success_rate") for r in rows], **stage_times(rows, time.time() - start)}
    summary.update(report_run(paths, f"SPO++ ({job.cfg.method.name}) on {job.cfg.env.kind}", rows, prior, after_record,
                              before_extra, after_extra, job.env.reference_success, job.env.reference_se))
    summary["async_regime"] = log_regime(job.cfg, rows, log)
    if job.env.tasks_record:
        summary["env"] = dict(job.env.tasks_record)
    for name in after_extra:  # e.g. heldout_before_rl / heldout_after_rl (ALFWorld), no_tool_* (Math-TIR)
        summary[f"{name}_before_rl"] = before_extra.get(name)
        summary[f"{name}_after_rl"] = after_extra[name]
    write_json_atomic(paths.summary, summary)
    return summary


def same_tasks(prior: dict, evaluated: dict) -> dict:
    """The prior's record restricted to the tasks ``evaluated`` played (``evaluation.train_games``
    evaluates a subset after RL): before and after RL then compare the same games."""
    played = np.asarray(evaluated["trials"]) > 0
    if played.all():
        return prior
    successes = np.where(played, prior["successes"], 0)
    trials = np.where(played, prior["trials"], 0)
    return {"successes": successes.tolist(), "trials": trials.tolist(),
            "success_rate": float(successes.sum() / max(trials.sum(), 1))}


def main(argv: Sequence[str] | None = None) -> dict:
    args = list(sys.argv[1:] if argv is None else argv)
    several = DISTRIBUTED_FLAG in args
    cfg = parse_config([a for a in args if a != DISTRIBUTED_FLAG])
    paths = RunPaths(check_output_dir(cfg.output_dir))
    compilation_cache = enable_compilation_cache(cfg.compilation_cache_dir)
    if compilation_cache is not None:
        log(f"JAX compilation cache: {compilation_cache}")
    start = time.time()
    if several:
        start_distributed(cfg)
        if jax.process_index() != 0:
            return follow_process_0(cfg)
    try:
        return run_job(cfg, paths, start)
    finally:
        if several:
            distributed.release_followers()  # followers still waiting for an RL stage: none comes


def run_job(cfg: TrainConfig, paths: RunPaths, start: float) -> dict:
    build.check_inputs(cfg)  # local inputs and the engine choice: fail before any work
    prepare_run(cfg, paths)  # the run lock; --resume: settings checked, the intact step chosen, before any work
    if cfg.stage in ("all", "rl"):  # never silently restart a run
        refuse_overwrite(cfg.resume, latest_checkpoint_step(paths), paths)
    env = build_env(cfg, cfg.warmstart.enabled, log, cfg.progress)
    try:
        return run_stages(cfg, paths, env, start)
    finally:
        env.close()  # e.g. Math-TIR's sandbox workers and verifier processes


def run_stages(cfg: TrainConfig, paths: RunPaths, env, start: float) -> dict:
    agent = build.build_agent_config(cfg, env.max_turns)
    learner_cfg = build.build_learner_config(cfg)
    job = Job(cfg, paths, env, agent, build.build_orchestrator_config(cfg, agent, cfg.seed), learner_cfg)
    base = build.model_folder(cfg.model, env.corpus, log)
    chat = build.load_chat(base, env.chat_tools)
    policy = run_warmstart(cfg, paths, base, chat, env.warm, learner_cfg)
    if cfg.stage == "warmstart":
        return {"policy": str(policy)}
    job.policy_folder = policy
    job.servers = build.build_rollout_servers(cfg, paths.root, agent)
    try:
        if job.servers is not None:  # one set of servers for the prior, the evaluations and RL
            log(f"rollout servers: {cfg.rollout.server_urls or f'launching {cfg.rollout.servers.launch.count}'} "
                f"(logs in {paths.root}/rollout_servers)")
            job.servers.start(policy)
        return finish_stages(job, policy, chat, start)
    finally:
        if job.servers is not None:
            job.servers.close()


def finish_stages(job: Job, policy: Path, chat, start: float) -> dict:
    """The prior and RL (with its evaluations) on the job's engines."""
    cfg, paths, env = job.cfg, job.paths, job.env
    alpha0, beta0, prior = run_prior(cfg, paths, policy, chat, env, job.agent, job.engine, job.orchestrator.rho,
                                     job.orchestrator.max_in_flight)
    if cfg.stage == "prior":
        return {"prior": prior}
    summary = run_rl(job, policy, chat, alpha0, beta0, prior)
    summary["total_wall_s"] = time.time() - start  # the whole job: games, warm start, prior, RL
    write_json_atomic(paths.summary, summary)
    log(final_line(summary, paths.curve))
    return summary


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a native crash (XLA, a C extension) prints every thread's Python stack
    raise SystemExit(run_guarded(main))
