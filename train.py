#!/usr/bin/env python
"""SPO++ training job: warm start (SFT), offline prior, asynchronous single-stream RL.

    python train.py                                   # TrainConfig's defaults: the agentic TextWorld job (configs/default.yaml)
    python train.py --config_path configs/smoke.yaml  # the tiny 2-turn smoke job
    python train.py --config_path configs/alfworld_qwen35_0p8b.yaml
    python train.py --rollout.batch_size 32 --tracker.rho 0.9 --output_dir runs/x
    python train.py --resume                          # continue from the newest checkpoint
    python train.py --stage warmstart                 # only the cold-start SFT
    python train.py --stage prior                     # only the n-rollouts-per-task prior
    python train.py --rollout.engine vllm_server --rollout.engine.launch.count 2   # on vLLM servers
    JAX_COORDINATOR_ADDRESS=h:1234 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=<i> python train.py --distributed

Every field of `rollout_bridge.config.TrainConfig` is a flag (draccus). This script only
composes: each component is built from its own config section by
`rollout_bridge.components` (which also holds the extension points: argv preprocessors,
metric sinks, end-of-run hooks), the env kind by `rollout_bridge.envs.kinds`, the method
by `rollout_bridge.methods`. Stages, each one call into one module (stage=all runs them in
order; each reuses its output in `output_dir` when it was made with the same settings):
 1. tasks (`envs.kinds`): the env kind's bundle; the policy: `model.path` or a tiny local model.
 2. warm start (`warmstart_stage`): SFT on teacher demonstrations -> `output_dir/warmstart_model`.
 3. prior (`prior_stage`): `prior.rollouts_per_task` rollouts of every task -> Jeffreys
    prior (SPEC 2) in `output_dir/prior.json`; its success rate is the success BEFORE RL.
 4. evaluation before RL (`evaluation`): the env kind's extra sets (held-out games).
 5. RL (`rl_stage`): the orchestrator + `PolicyLearner`; metrics to `metrics.jsonl` /
    TensorBoard, an orbax checkpoint every `checkpoint_every` updates (learner state, the
    method's state incl. SPO's previous responses, sampler RNG, counters, buffered
    trajectories); export of the final policy as a HF folder in `hf_model` (with
    `export_every` also `exports/step_<k>`), then the evaluation of the final policy
    (success AFTER RL; `evaluation.train_rollouts` per training task of the first
    `evaluation.train_games` (default `prior.rollouts_per_task` on 256) and
    `evaluation.heldout_rollouts` (default 4) per held-out task); with `--wandb true` the
    metrics also in Weights & Biases.
 6. report (`job_report`): `summary.json`, `learning_curve.png` and the report lines.
Rollout engines (`rollout.engine`, a choice like `method`, each engine with its own fields):
the embedded JAX engine, vLLM in this process, or vLLM servers given by URL or launched by
this script (docs/FLEET.md); every stage uses the same one. `--distributed`: the learner as several processes; process 0 runs the job and feeds the
others each learner call (rollout_bridge/learner_processes.py, distributed_learner.py).
verl knob names are accepted as aliases (`--actor.clip_ratio_low 0.2`, docs/CONVENTIONS.md).
A user mistake (missing config file, a flag, method, env kind or engine that does not exist,
unwritable output_dir, full disk, a setting this version lacks) ends in one line and exit
status 2 (rollout_bridge.run_errors); `--help` lists every setting.
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
import contextlib
import faulthandler
import time
from typing import Sequence

import jax

from rollout_bridge import components as build
from rollout_bridge import distributed_learner as distributed
from rollout_bridge.config import (ChoiceError, ConfigFileError, FlagError, TrainConfig, format_config_error,
                                   load_config)
from rollout_bridge.envs.kinds import build_env
from rollout_bridge.evaluation import evaluate_policy
from rollout_bridge.job import build_job, start_servers
from rollout_bridge.job_report import write_summary
from rollout_bridge.learner_processes import DISTRIBUTED_FLAG, follow_process_0, start_distributed
from rollout_bridge.prior_stage import run_prior
from rollout_bridge.rl_stage import run_rl
from rollout_bridge.run_errors import (UserError, check_config_path, check_output_dir, check_renamed_flags,
                                       config_path_argument, unknown_fields_line)
from rollout_bridge.run_guard import prepare_run, run_guarded
from rollout_bridge.run_folder import RunPaths, enable_compilation_cache, latest_checkpoint_step, log, refuse_overwrite
from rollout_bridge.warmstart_stage import run_warmstart


def parse_config(argv: Sequence[str]) -> TrainConfig:
    """draccus parse after the argv hooks (verl aliases); a missing config file, a refused
    alias, a bad value or a setting this version lacks raise UserError (one line, exit 2
    through run_guarded) naming the file / field."""
    from draccus.utils import ParsingError

    check_config_path(argv)
    check_renamed_flags(argv)
    try:
        return load_config(build.preprocess_argv(list(argv)))
    except (ConfigFileError, ChoiceError, FlagError) as error:
        raise UserError(str(error), "config error") from None
    except ParsingError as error:
        message = format_config_error(error)
        older = unknown_fields_line(message, config_path_argument(argv), TrainConfig)
        raise UserError(older or message, "config error") from None


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
    with contextlib.ExitStack() as at_exit:  # at exit, in reverse order of registration
        if several:  # followers still waiting for an RL stage: none comes
            at_exit.callback(distributed.release_followers)
        # before any work: local inputs and the engine choice; never silently restart a run
        build.check_inputs(cfg)
        prepare_run(cfg, paths)  # the run lock; --resume: settings checked, the intact step chosen
        refuse_overwrite(cfg.resume, latest_checkpoint_step(paths), paths)  # every stage: its outputs are the run's

        env = build_env(cfg, cfg.warmstart.enabled, log, cfg.progress)                       # 1. tasks
        at_exit.callback(env.close)  # e.g. Math-TIR's sandbox workers and verifier processes
        job = build_job(cfg, paths, env)
        base = build.model_folder(cfg.model, env.corpus, log)
        chat = build.load_chat(base, env.chat_tools)

        policy = run_warmstart(cfg, paths, base, chat, env.warm, job.learner)                # 2. warm start
        if cfg.stage == "warmstart":
            return {"policy": str(policy)}
        start_servers(job, policy, at_exit)

        alpha0, beta0, prior = run_prior(cfg, paths, policy, chat, env, job.agent, job.engine,  # 3. prior
                                         job.orchestrator.tracker.rho, job.orchestrator.max_in_flight)
        if cfg.stage == "prior":
            return {"prior": prior}

        rl_start, resumed_from = time.time(), latest_checkpoint_step(paths)  # the checkpoint RL continues from
        before_extra = asyncio.run(evaluate_policy(job, policy, chat))                       # 4. evaluation before RL
        successes, trials, after_extra = asyncio.run(run_rl(job, policy, chat, alpha0, beta0))  # 5. RL, export, evaluation
        return write_summary(job, prior, successes, trials, before_extra, after_extra,     # 6. report
                             rl_start, start, resumed_from=resumed_from)


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)  # a native crash (XLA, a C extension) prints every thread's Python stack
    raise SystemExit(run_guarded(main))
