"""The RL stage: the orchestrator and the learner for ``steps`` updates, an orbax
checkpoint every ``checkpoint_every`` updates (restored exactly by ``--resume``), the
exports, then the evaluation of the final policy on the same engine; and ``UpdateLogger``,
its per-update metrics sink."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Protocol

import jax
import numpy as np

from rollout_bridge import components as build
from rollout_bridge import distributed_learner as distributed
from rollout_bridge.distributed_learner import LeaderLearner
from rollout_bridge.evaluation import evaluate_after_rl
from rollout_bridge.learner_processes import build_learner
from rollout_bridge.learning_curve import TRAILING_WINDOW
from rollout_bridge.methods import LearnerInput, LearnerOutput
from rollout_bridge.metrics import MetricsWriter
from rollout_bridge.orchestrator import Orchestrator
from rollout_bridge.progress_lines import show_bar
from rollout_bridge.run_errors import UserError
from rollout_bridge.run_folder import checkpoint_key, log, refuse_overwrite, state_digest
from spopp_jax.checkpoint import CheckpointMismatchError, Checkpointer, RestoredCheckpoint

ENGINE_SEED_STRIDE = 7919  # RL engine seed = job seed x this + resumed step (a fresh stream per resume)


class RLLearner(Protocol):
    """What the RL stage drives: the `PolicyLearner` in one process; on process 0 of several
    learner processes the `LeaderLearner` over it, which sends each action to the others
    first (rollout_bridge/distributed_learner.py)."""

    def __call__(self, learner_input: LearnerInput) -> LearnerOutput: ...
    def weights(self) -> Any: ...
    def save(self, checkpointer: Checkpointer, step: int, extras: dict, config: Any) -> None: ...
    def restore(self, checkpointer: Checkpointer, step: int, config: Any) -> RestoredCheckpoint: ...


class UpdateLogger:
    """The metrics sink of ``train.py``: one row per update to ``metrics.jsonl`` /
    TensorBoard (``MetricsWriter``) and the progress bar; in any case one log line per
    tenth of the updates (success since the last line, trailing mean, policy lag, s/update),
    so that a run's log shows how RL goes when no terminal shows the bar. ``extra()``
    (optional): more counters for each row, as ``rollout/<name>`` (e.g. the vLLM servers'
    restarts)."""

    def __init__(self, writer: MetricsWriter, steps: int, start_step: int, progress: bool,
                 extra: Callable[[], dict] | None = None):
        from tqdm import tqdm

        self.writer = writer
        self.extra = extra
        self.steps, self.every = steps, max(1, steps // 10)
        self.rewards: list[float] = []
        self.window: list[tuple[float, float]] = []  # (success, mean policy lag) since the last line
        self.window_start_update = start_step
        self.last_time = self.start = self.window_start = time.time()
        self.bar = tqdm(total=steps, initial=start_step, desc="RL", disable=not show_bar(progress),
                        dynamic_ncols=True)

    def __call__(self, record) -> None:
        now = time.time()
        trajectories = record.trajectories
        generated = sum(t.num_action_tokens for t in trajectories)
        tokens = sum(len(t.token_ids) for t in trajectories)
        success = float(np.mean([t.reward for t in trajectories]))
        self.rewards = (self.rewards + [success])[-TRAILING_WINDOW:]
        trailing = float(np.mean(self.rewards))
        elapsed = max(now - self.last_time, 1e-9)
        row = {
            "success_rate": success,
            "success_trailing": trailing,
            "policy_event": record.policy_event,
            "policy_lag_mean": float(record.policy_lag.mean()),
            "policy_lag_max": float(record.policy_lag.max()),
            "generated_tokens_per_s": generated / elapsed,
            "tokens_per_s": tokens / elapsed,
            "action_tokens_mean": generated / len(trajectories),
            "trajectory_tokens_max": max(len(t.token_ids) for t in trajectories),
            "truncated_frac": float(np.mean([t.truncated for t in trajectories])),
            "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
            "learner_s": record.end_time - record.start_time,
            "update_wall_s": now - self.last_time,
            "wall_s": now - self.start,
            **{f"diag/{k}": v for k, v in record.diagnostics.items()},
            **{f"learner/{k}": v for k, v in record.learner_metrics.items()},
            **{f"rollout/{k}": v for k, v in (self.extra() if self.extra is not None else {}).items()},
        }
        self.writer.write(record.update, row)
        self.last_time = now
        self.bar.set_postfix(reward=f"{success:.2f}", trail=f"{trailing:.2f}",
                             tok_s=f"{row['generated_tokens_per_s']:.0f}", lag=f"{row['policy_lag_mean']:.2f}")
        self.bar.update(1)
        self.window.append((success, row["policy_lag_mean"]))
        if record.update % self.every == 0 or record.update == self.steps:
            self._log_window(record.update, trailing, now)

    def _log_window(self, update: int, trailing: float, now: float) -> None:
        success, lag = np.mean(self.window, axis=0)
        first = self.window_start_update + 1  # the window holds updates first..update
        per_update = (now - self.window_start) / (update - first + 1)
        span = f"update {update}" if first == update else f"updates {first}-{update}"
        log(f"RL: update {update}/{self.steps}, success {success:.3f} over {span} "
            f"(trailing {TRAILING_WINDOW}: {trailing:.3f}), policy lag {lag:.2f}, "
            f"{per_update:.1f} s/update, {now - self.start:.0f}s")
        self.window, self.window_start, self.window_start_update = [], now, update

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


async def run_rl(job, policy: Path, chat, alpha0, beta0):
    """(successes, trials, extra evaluations) of the final policy after RL from ``policy``
    (an HF folder) with the prior ``alpha0`` / ``beta0`` (SPEC 2), then the end-of-run hooks;
    refuses to overwrite a run's checkpoints without ``--resume``."""
    cfg, paths = job.cfg, job.paths
    # several learner processes: the others start following; then, in the same order on
    # every process, the checkpointer (orbax syncs the processes) and the learner
    distributed.share_from_process_0(str(policy))
    checkpointer = Checkpointer(paths.checkpoints, max_to_keep=cfg.keep_checkpoints)
    latest = checkpointer.latest_step()
    refuse_overwrite(cfg.resume, latest, paths)
    learner: RLLearner = build_learner(cfg, job.learner, job.orchestrator, policy)
    several = jax.process_count() > 1
    if several:  # process 0 of several learner processes: each learner action goes to the others first
        learner = LeaderLearner(learner)
    try:
        successes, trials, extra = await train_and_evaluate(job, policy, chat, alpha0, beta0, learner, checkpointer,
                                                            latest)
    finally:
        if several:
            learner.stop()  # the followers return from `follow`
        checkpointer.close()
    for hook in build.END_OF_RUN_HOOKS:
        hook(cfg, paths.root, learner)
    return successes, trials, extra


async def train_and_evaluate(job, policy: Path, chat, alpha0, beta0, learner: RLLearner, checkpointer, latest):
    """The RL loop on a fresh engine (resumed from ``latest`` with ``--resume``), the exports,
    then the evaluation of the final policy on that engine."""
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
        successes, trials, extra = await evaluate_after_rl(job, engine, chat)
    finally:
        await engine.close()
    return successes, trials, extra
