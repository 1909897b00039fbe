#!/usr/bin/env python
"""SPO++ training job: warm start (SFT), offline prior, asynchronous single-stream RL.

    python train.py                                   # the embedded CPU TextWorld job
    python train.py --config_path configs/alfworld_qwen35_0p8b.yaml
    python train.py --rollout.batch_size 32 --tracker.rho 0.9 --output_dir runs/x
    python train.py --resume                          # continue from the newest checkpoint
    python train.py --stage warmstart                 # only the cold-start SFT
    python train.py --stage prior                     # only the n-rollouts-per-task prior

Every field of `spopp_jax.config.TrainConfig` is a flag (draccus). Stages (stage=all runs
them in order; each reuses its output in `output_dir` when it was made with the same
settings):
 1. tasks: the TextWorld game set (generated and cached, or `env.game_dir`), and the
    warm-start game set disjoint from it; the policy: `model.path` or a tiny local model.
 2. warm start: SFT on the walkthroughs of the warm-start games, loss on action tokens
    (rollout_bridge.warmstart) -> `output_dir/warmstart_model` (an HF folder).
 3. prior: `prior.rollouts_per_task` rollouts of every training task with that policy ->
    Jeffreys prior (SPEC 2) in `output_dir/prior.json`; its success rate is the
    success BEFORE RL.
 4. RL: the orchestrator (rollout_bridge.orchestrator) + the jitted learner step; metrics
    to `metrics.jsonl` / TensorBoard, an orbax checkpoint every `checkpoint_every` updates
    (learner state, tracker, sampler RNG, orchestrator counters), then the same rollouts
    with the final policy (success AFTER RL, `eval_after.json`) and `learning_curve.png`.
A crash loses at most the updates since the last checkpoint; `--resume` restores the
tracker, step, policy event and RNG exactly as saved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from spopp_jax.config import TrainConfig, format_config_error, load_config


# ============================================================================ config


def parse_config(argv: Sequence[str]) -> TrainConfig:
    """draccus parse; a bad value exits with status 2 and the message naming the field."""
    from draccus.utils import ParsingError

    try:
        return load_config(argv)
    except ParsingError as error:
        print(f"config error: {format_config_error(error)}", file=sys.stderr)
        raise SystemExit(2) from None


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def warmstart_model(self) -> Path:
        return self.root / "warmstart_model"

    @property
    def warmstart_record(self) -> Path:
        return self.root / "warmstart_model" / "warmstart.json"

    @property
    def prior(self) -> Path:
        return self.root / "prior.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def eval_after(self) -> Path:
        return self.root / "eval_after.json"

    @property
    def curve(self) -> Path:
        return self.root / "learning_curve.png"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"


def _as_dict(section) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(section)))


def stage_key(cfg: TrainConfig, *sections: str) -> dict:
    """The settings an output depends on (reuse it only if they are unchanged)."""
    return {name: _as_dict(getattr(cfg, name)) for name in sections}


def checkpoint_key(cfg: TrainConfig) -> dict:
    """Settings a checkpoint must agree with to be resumed (not steps, logging, paths)."""
    key = stage_key(cfg, "model", "env", "warmstart", "prior", "tracker", "sampler",
                    "advantage", "loss", "optim", "rollout")
    key["method"] = cfg.method
    key["seed"] = cfg.seed
    return key


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ============================================================================ tasks + model


def check_inputs(cfg: TrainConfig) -> None:
    """Local inputs a recipe names must exist (nothing is downloaded): fail early, clearly."""
    from rollout_bridge.tiny_model import check_model_folder

    if cfg.model.path is not None:
        try:
            check_model_folder(cfg.model.path)
        except FileNotFoundError as error:
            raise SystemExit(f"input error: {error}") from None
    if cfg.env.game_dir is not None and not Path(cfg.env.game_dir).is_dir():
        raise SystemExit(f"input error: env.game_dir={cfg.env.game_dir!r} does not exist. For "
                         "ALFWorld: `pip install alfworld && alfworld-download`, then point "
                         "env.game_dir at $ALFWORLD_DATA/json_2.1.1/train")
    if cfg.env.kind == "math_tir":
        if not Path(cfg.env.data_dir).is_dir():
            raise SystemExit(f"input error: env.data_dir={cfg.env.data_dir!r} does not exist: "
                             "put the DAPO-Math-17K prompts and the cold-start SFT data there")
        raise SystemExit("env.kind='math_tir': the Math-TIR environment (sandboxed Python "
                         "tool) is not part of this build")
    if cfg.env.kind != "textworld":
        raise SystemExit(f"env.kind={cfg.env.kind!r} is not available in train.py of this "
                         "build (only 'textworld'; ALFWorld games load through env.game_dir)")
    if cfg.rollout.engine != "jax":
        raise SystemExit(f"rollout.engine={cfg.rollout.engine!r}: train.py drives the embedded "
                         "JAX engine only in this build")


class _GenerationBar:
    """tqdm over game generation (only shown when games are actually being made)."""

    def __init__(self, cfg: TrainConfig, what: str):
        self.cfg, self.what, self.bar = cfg, what, None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"generating {self.what}",
                            disable=not self.cfg.progress, leave=False)
        self.bar.n = done
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_task_sets(cfg: TrainConfig):
    """(train_tasks, warm_tasks or None) for env.kind == textworld."""
    from rollout_bridge.envs import textworld_games as games
    from rollout_bridge.envs.textworld_env import ObservationStyle, TextWorldTasks

    env = cfg.env
    style = ObservationStyle(env.max_feedback_chars, env.numbered_actions)
    spec = games.GameSetSpec("train", env.num_games, env.game_seed, env.world_size,
                             env.nb_objects, env.quest_length)
    if env.game_dir is not None:
        root = Path(env.game_dir)
        files = games.list_game_files(root)
        if env.num_games:
            order = np.random.default_rng(env.game_seed).permutation(len(files))
            files = sorted(files[i] for i in order[:env.num_games])
        train = TextWorldTasks(files, root, env.max_turns, style)
    else:
        log(f"games: {spec.folder_name} in {env.data_dir} (generated once, then reused)")
        bar = _GenerationBar(cfg, "training games")
        files = games.generate_game_set(spec, env.data_dir, progress=bar)
        bar.close()
        train = TextWorldTasks(files, files[0].parent, env.max_turns, style)
    warm = None
    if cfg.warmstart.enabled and env.warmstart_games > 0:
        if env.game_dir is not None:
            raise SystemExit("warmstart.enabled with env.game_dir: the warm start uses generated "
                             "TextWorld games; set warmstart.enabled=false for your own games")
        warm_spec = games.GameSetSpec("warmstart", env.warmstart_games, env.warmstart_seed,
                                      env.world_size, env.nb_objects, env.quest_length)
        log(f"warm-start games: {warm_spec.folder_name} (disjoint from the training games)")
        bar = _GenerationBar(cfg, "warm-start games")
        warm_files = games.generate_disjoint_game_set(warm_spec, env.data_dir, [spec],
                                                      progress=bar)
        bar.close()
        warm = TextWorldTasks(warm_files, warm_files[0].parent, env.max_turns, style)
    return train, warm


def base_model_folder(cfg: TrainConfig, train_tasks, warm_tasks) -> Path:
    """`model.path` (checked, never downloaded) or the tiny local model for these tasks."""
    from rollout_bridge.tiny_model import TinyModelShape, check_model_folder, ensure_tiny_model

    if cfg.model.path is not None:
        return check_model_folder(cfg.model.path)
    corpus = [train_tasks.episode(t).reset() for t in range(train_tasks.num_tasks)]
    if warm_tasks is not None:
        corpus += [f"{obs}\n{reply}" for t in range(warm_tasks.num_tasks)
                   for obs, reply in warm_tasks.demonstration(t)]
    m = cfg.model
    shape = TinyModelShape(m.tiny_vocab_size, m.tiny_hidden_size, m.tiny_intermediate_size,
                           m.tiny_num_layers, m.tiny_num_heads, m.tiny_num_kv_heads,
                           m.tiny_head_dim, m.seed)
    folder = ensure_tiny_model(m.tiny_dir, corpus, shape)
    log(f"tiny model: {folder}")
    return folder


def load_chat(folder: Path):
    from transformers import AutoTokenizer

    from rollout_bridge.agent import ChatFormat

    return ChatFormat.from_tokenizer(AutoTokenizer.from_pretrained(str(folder)))


def load_model(folder: Path, cfg: TrainConfig):
    from spopp_jax.models import from_pretrained

    return from_pretrained(str(folder), dtype=cfg.model.dtype)


def learner_config(cfg: TrainConfig):
    from spopp_jax.learner import LearnerConfig

    return LearnerConfig(learning_rate=cfg.optim.learning_rate,
                         weight_decay=cfg.optim.weight_decay,
                         max_grad_norm=cfg.optim.max_grad_norm,
                         num_micro_batches=cfg.optim.num_micro_batches,
                         num_mini_batches=cfg.optim.num_mini_batches,
                         logprob_chunk_size=cfg.optim.logprob_chunk_size,
                         clip_low=cfg.loss.clip_low, clip_high=cfg.loss.clip_high,
                         dual_clip=cfg.loss.dual_clip, is_cap=cfg.loss.is_cap)


def make_engine(cfg: TrainConfig, model, policy_event: int, seed: int):
    from rollout_bridge.engine.jax_engine import JaxEngine

    slots = cfg.rollout.max_inflight
    return JaxEngine(model, num_slots=slots, max_len=cfg.rollout.max_seq_len,
                     steps_per_call=min(8, cfg.rollout.max_new_tokens),
                     policy_event=policy_event, seed=seed)


def agent_config(cfg: TrainConfig):
    from rollout_bridge.agent import AgentConfig
    from rollout_bridge.engine.base import SamplingParams

    sampling = SamplingParams(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens)
    return AgentConfig(max_turns=cfg.env.max_turns, max_total_tokens=cfg.rollout.max_seq_len,
                       sampling=sampling)


def env_factory(tasks):
    from rollout_bridge.envs.textworld_env import TextWorldEnv

    return lambda: TextWorldEnv(tasks)


# ============================================================================ stage: warm start


def run_warmstart(cfg: TrainConfig, paths: RunPaths, base: Path, chat, warm_tasks) -> Path:
    """SFT on the warm-start walkthroughs; returns the folder of the initial RL policy."""
    if not cfg.warmstart.enabled or warm_tasks is None:
        return base
    key = stage_key(cfg, "model", "env", "warmstart")
    key["base"] = str(base)
    if paths.warmstart_record.exists():
        record = json.loads(paths.warmstart_record.read_text())
        if record.get("key") == key:
            log(f"warm start: reusing {paths.warmstart_model} (final SFT loss "
                f"{record['losses'][-1]:.3f})")
            return paths.warmstart_model
    from spopp_jax.learner import LearnerConfig, init_train_state, make_sft_step
    from spopp_jax.models import save_pretrained

    from rollout_bridge.prior import write_json_atomic
    from rollout_bridge.warmstart import run_sft, sft_examples

    ws = cfg.warmstart
    examples = sft_examples(warm_tasks, chat, max_length=ws.max_length)
    log(f"warm start: SFT on {len(examples)} walkthroughs of games outside the training set, "
        f"{ws.epochs} epochs, batch {ws.batch_size}, lr {ws.learning_rate}")
    model = load_model(base, cfg)
    sft_cfg = LearnerConfig(learning_rate=ws.learning_rate, weight_decay=ws.weight_decay,
                            max_grad_norm=cfg.optim.max_grad_norm,
                            logprob_chunk_size=cfg.optim.logprob_chunk_size)
    model_def, state = init_train_state(model, sft_cfg)
    sft_step = make_sft_step(model_def, sft_cfg)
    start = time.time()
    state, losses = run_sft(sft_step, state, examples, epochs=ws.epochs,
                            batch_size=ws.batch_size, pad_id=chat.tokenizer.pad_token_id,
                            seed=cfg.seed)
    folder = paths.warmstart_model
    folder.mkdir(parents=True, exist_ok=True)
    save_pretrained(model_def.merge(state.params), str(folder))
    chat.tokenizer.save_pretrained(str(folder))
    write_json_atomic(paths.warmstart_record, {
        "key": key, "losses": losses, "examples": len(examples),
        "wall_s": time.time() - start})
    log(f"warm start: {len(losses)} steps in {time.time() - start:.0f}s, loss "
        f"{losses[0]:.3f} -> {losses[-1]:.3f}")
    return folder


# ============================================================================ stage: prior


async def _success_rollouts(cfg: TrainConfig, model, policy_event: int, chat, tasks,
                            n: int, seed: int, what: str):
    from tqdm import tqdm

    from rollout_bridge.prior import rollout_successes

    engine = make_engine(cfg, model, policy_event, seed)
    bar = tqdm(total=tasks.num_tasks * n, desc=what, disable=not cfg.progress, leave=False)
    try:
        return await rollout_successes(engine, env_factory(tasks), chat, tasks.num_tasks, n,
                                       agent_config(cfg), cfg.rollout.max_inflight,
                                       on_done=lambda _: bar.update(1))
    finally:
        bar.close()
        await engine.close()


def run_prior(cfg: TrainConfig, paths: RunPaths, policy: Path, chat, tasks):
    """(alpha0, beta0, record) of the offline prior; record None when not computed."""
    from rollout_bridge.prior import prior_record, read_prior_file, write_json_atomic

    if cfg.prior.path is not None:
        alpha0, beta0 = read_prior_file(cfg.prior.path, tasks.num_tasks)
        return alpha0, beta0, json.loads(Path(cfg.prior.path).read_text())
    if not cfg.prior.enabled:
        half = np.full(tasks.num_tasks, 0.5, np.float32)
        return half, half.copy(), None
    key = stage_key(cfg, "model", "env", "warmstart", "prior", "rollout")
    key.update(rho=cfg.tracker.rho, policy=str(policy))
    if paths.prior.exists():
        record = json.loads(paths.prior.read_text())
        if record.get("key") == key:
            log(f"prior: reusing {paths.prior} (success before RL {record['success_rate']:.3f})")
            alpha0, beta0 = read_prior_file(paths.prior, tasks.num_tasks)
            return alpha0, beta0, record
    n = cfg.prior.rollouts_per_task
    log(f"prior: {n} rollouts x {tasks.num_tasks} tasks with the initial policy")
    start = time.time()
    successes, trials = asyncio.run(_success_rollouts(
        cfg, load_model(policy, cfg), 0, chat, tasks, n, cfg.seed + 1_000_003, "prior"))
    record = prior_record(successes, trials, cfg.prior_mass)
    record.update(key=key, wall_s=time.time() - start)
    write_json_atomic(paths.prior, record)
    log(f"prior: success before RL {record['success_rate']:.3f} "
        f"({int(successes.sum())}/{int(trials.sum())}) in {time.time() - start:.0f}s")
    return np.asarray(record["alpha0"], np.float32), np.asarray(record["beta0"], np.float32), record


# ============================================================================ stage: RL


class PolicyLearner:
    """The orchestrator's learner callable: one jitted SPO++ step per batch (in the
    orchestrator's learner thread), the new weights for publishing and, for SPO, the
    per-task divergence D of the task's previous response (SPEC 2 baseline)."""

    def __init__(self, model_def, state, cfg: TrainConfig):
        from spopp_jax.learner import make_compute_logprobs, make_train_step

        self.model_def = model_def
        self.state = state
        self.method = cfg.method
        self.train_step = make_train_step(model_def, learner_config(cfg))
        self.compute_logprobs = make_compute_logprobs(model_def, cfg.optim.logprob_chunk_size) if cfg.method == "spo" else None

    def weights(self):
        return self.model_def.merge(self.state.params)

    def __call__(self, learner_input):
        from rollout_bridge.orchestrator import LearnerOutput

        self.state, metrics = self.train_step(self.state, learner_input.batch)
        metrics = {k: float(v) for k, v in metrics.items()}
        divergence = None
        if self.method == "spo":
            divergence = self._divergences(learner_input.previous)
        return LearnerOutput(self.weights(), metrics, divergence)

    def _divergences(self, previous) -> list[float | None]:
        """D_i = token-mean |log pi_then - log pi_now| over y'_i, the task's previous
        response (pi_then = its recorded rollout log-probs, pi_now = after this update);
        None where the task has no previous response (D = 0)."""
        from rollout_bridge.baselines import token_mean_abs_log_ratio
        from rollout_bridge.trajectory import pack_train_batch

        rows = [i for i, p in enumerate(previous) if p is not None]
        divergence: list[float | None] = [None] * len(previous)
        if not rows:
            return divergence
        trajectories = [previous[i] for i in rows]
        batch = pack_train_batch(trajectories, np.zeros(len(rows), np.float32),
                                 pad_to_multiple=64)
        logp_now = np.asarray(self.compute_logprobs(self.state.params, batch))
        for row, i in enumerate(rows):
            divergence[i] = token_mean_abs_log_ratio(batch.action_mask[row],
                                                     batch.rollout_logp[row], logp_now[row])
        return divergence


def orchestrator_config(cfg: TrainConfig):
    from rollout_bridge.orchestrator import OrchestratorConfig

    r = cfg.rollout
    return OrchestratorConfig(
        method=cfg.method, measure=cfg.advantage.measure, batch_size=r.batch_size,
        publish_every=r.publish_every, drain=r.drain, max_in_flight=r.max_inflight,
        max_buffered_batches=r.max_buffered_batches,
        group_size=r.group_size, rho=cfg.tracker.rho, sampler_form=cfg.sampler.form,
        sampler_floor=cfg.sampler.floor, spo_d_half=cfg.tracker.spo_d_half,
        spo_rho_min=cfg.tracker.spo_rho_min, spo_rho_max=cfg.tracker.spo_rho_max,
        pad_to_multiple=r.max_seq_len,   # every batch [B, max_seq_len]: one compile
        seed=cfg.seed)


class UpdateLogger:
    """on_update hook: one metrics row per update, the progress bar."""

    def __init__(self, cfg: TrainConfig, writer, start_step: int):
        from tqdm import tqdm

        self.writer = writer
        self.window = 5
        self.rewards: list[float] = []
        self.last_time = time.time()
        self.start = time.time()
        self.bar = tqdm(total=cfg.steps, initial=start_step, desc="RL", disable=not cfg.progress,
                        dynamic_ncols=True)

    def __call__(self, record) -> None:
        now = time.time()
        trajectories = record.trajectories
        generated = sum(t.num_action_tokens for t in trajectories)
        tokens = sum(len(t.token_ids) for t in trajectories)
        success = float(np.mean([t.reward for t in trajectories]))
        self.rewards.append(success)
        trailing = float(np.mean(self.rewards[-self.window:]))
        row = {
            "success_rate": success,
            "success_trailing": trailing,
            "policy_event": record.policy_event,
            "policy_lag_mean": float(record.policy_lag.mean()),
            "policy_lag_max": float(record.policy_lag.max()),
            "generated_tokens_per_s": generated / max(now - self.last_time, 1e-9),
            "tokens_per_s": tokens / max(now - self.last_time, 1e-9),
            "action_tokens_mean": generated / len(trajectories),
            "trajectory_tokens_max": max(len(t.token_ids) for t in trajectories),
            "truncated_frac": float(np.mean([t.truncated for t in trajectories])),
            "turns_mean": float(np.mean([t.num_turns for t in trajectories])),
            "learner_s": record.end_time - record.start_time,
            "update_wall_s": now - self.last_time,
            "wall_s": now - self.start,
            **{f"diag/{k}": v for k, v in record.diagnostics.items()},
            **{f"learner/{k}": v for k, v in record.learner_metrics.items()},
        }
        self.writer.write(record.update, row)
        self.last_time = now
        self.bar.set_postfix(reward=f"{success:.2f}", trail=f"{trailing:.2f}",
                             tok_s=f"{row['generated_tokens_per_s']:.0f}",
                             lag=f"{row['policy_lag_mean']:.2f}")
        self.bar.update(1)

    def close(self):
        self.bar.close()


def refuse_overwrite(cfg: TrainConfig, latest: int | None, paths: RunPaths) -> None:
    if latest is not None and not cfg.resume:
        raise SystemExit(f"{paths.checkpoints} holds checkpoints up to step {latest}: pass "
                         "--resume to continue that run, or choose a new --output_dir")


def latest_checkpoint_step(paths: RunPaths) -> int | None:
    """Newest complete orbax step folder (an interrupted save leaves only a tmp folder)."""
    if not paths.checkpoints.is_dir():
        return None
    steps = [int(p.name) for p in paths.checkpoints.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(steps, default=None)


def tracker_digest(tracker_state) -> str:
    """sha1 over the tracker arrays (alpha, beta, z_ref as float32 bytes)."""
    import hashlib

    digest = hashlib.sha1()
    for name in ("alpha", "beta", "z_ref"):
        value = tracker_state[name] if isinstance(tracker_state, dict) else getattr(tracker_state, name)
        digest.update(np.ascontiguousarray(np.asarray(value, np.float32)))
    return digest.hexdigest()


def _checkpoint_extras(orchestrator) -> dict:
    return {"orchestrator": orchestrator.state_dict()}


async def _rl_loop(cfg: TrainConfig, paths: RunPaths, policy: Path, chat, tasks, alpha0, beta0):
    import jax

    from spopp_jax.checkpoint import Checkpointer
    from spopp_jax.learner import init_train_state

    from rollout_bridge.metrics import MetricsWriter
    from rollout_bridge.orchestrator import Orchestrator

    checkpointer = Checkpointer(paths.checkpoints, max_to_keep=cfg.keep_checkpoints)
    latest = checkpointer.latest_step()
    refuse_overwrite(cfg, latest, paths)
    model_def, state = init_train_state(load_model(policy, cfg), learner_config(cfg))
    learner = PolicyLearner(model_def, state, cfg)
    engine = make_engine(cfg, learner.weights(), 0, seed=cfg.seed * 7919 + (latest or 0))
    orchestrator = Orchestrator(engine, env_factory(tasks), chat, learner, tasks.num_tasks,
                                orchestrator_config(cfg), agent_config(cfg),
                                prior_alpha=alpha0, prior_beta=beta0)
    resume_step = None
    if cfg.resume and latest is not None:
        # learner state, tracker, sampler RNG and counters exactly as saved; the engine
        # then serves the saved weights under the saved policy event
        restored = checkpointer.restore(state, {"orchestrator": orchestrator.state_dict()},
                                        expected_config=checkpoint_key(cfg))
        learner.state = restored.train_state
        orchestrator.load_state_dict(restored.extras["orchestrator"])
        await engine.publish(learner.weights(), orchestrator.policy_event)
        resume_step = restored.step
        log(f"resume: step {restored.step}, policy event {orchestrator.policy_event}, "
            f"tracker sha1 {tracker_digest(orchestrator.state_dict()['tracker'])}")
    writer = MetricsWriter(paths.root, cfg.tensorboard, resume_step=resume_step)
    logger = UpdateLogger(cfg, writer, orchestrator.updates)
    orchestrator.on_update = logger
    try:
        while orchestrator.updates < cfg.steps:
            chunk = min(cfg.checkpoint_every - orchestrator.updates % cfg.checkpoint_every,
                        cfg.steps - orchestrator.updates)
            await orchestrator.run(chunk)
            saved = dataclasses.replace(learner.state, policy_event=jax.numpy.asarray(
                orchestrator.policy_event, jax.numpy.int32))
            checkpointer.save(orchestrator.updates, saved, _checkpoint_extras(orchestrator),
                              config=checkpoint_key(cfg))
        await orchestrator.close()
        logger.close()
        writer.close()
        n = cfg.prior.rollouts_per_task
        log(f"evaluation: {n} rollouts x {tasks.num_tasks} tasks with the final policy")
        successes, trials = await _success_after(cfg, engine, chat, tasks, n)
    finally:
        await engine.close()
        checkpointer.close()
    return successes, trials


async def _success_after(cfg, engine, chat, tasks, n):
    from tqdm import tqdm

    from rollout_bridge.prior import rollout_successes

    bar = tqdm(total=tasks.num_tasks * n, desc="eval", disable=not cfg.progress, leave=False)
    try:
        return await rollout_successes(engine, env_factory(tasks), chat, tasks.num_tasks, n,
                                       agent_config(cfg), cfg.rollout.max_inflight,
                                       on_done=lambda _: bar.update(1))
    finally:
        bar.close()


def run_rl(cfg: TrainConfig, paths: RunPaths, policy: Path, chat, tasks, alpha0, beta0,
           prior: dict | None) -> dict:
    from rollout_bridge.metrics import plot_learning_curve, read_metrics
    from rollout_bridge.prior import write_json_atomic

    start = time.time()
    successes, trials = asyncio.run(_rl_loop(cfg, paths, policy, chat, tasks, alpha0, beta0))
    after = float(successes.sum() / max(trials.sum(), 1))
    write_json_atomic(paths.eval_after, {"successes": successes.tolist(),
                                         "trials": trials.tolist(), "success_rate": after})
    rows = read_metrics(paths.root / "metrics.jsonl")
    before = None if prior is None else prior["success_rate"]
    plot_learning_curve(rows, paths.curve, title=f"SPO++ ({cfg.method}) on TextWorld",
                        reference_lines={"success before RL (prior rollouts)": before,
                                         "success after RL (same rollouts)": after})
    summary = {
        "success_before_rl": before,
        "success_after_rl": after,
        "success_per_step": [r.get("success_rate") for r in rows],
        "rl_wall_s": time.time() - start,
    }
    write_json_atomic(paths.summary, summary)
    return summary


# ============================================================================ main


def main(argv: Sequence[str] | None = None) -> dict:
    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    paths = RunPaths(Path(cfg.output_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    start = time.time()
    check_inputs(cfg)
    if cfg.stage in ("all", "rl"):   # before any work: never silently restart a run
        refuse_overwrite(cfg, latest_checkpoint_step(paths), paths)
    train_tasks, warm_tasks = build_task_sets(cfg)
    base = base_model_folder(cfg, train_tasks, warm_tasks)
    chat = load_chat(base)
    policy = run_warmstart(cfg, paths, base, chat, warm_tasks)
    if cfg.stage == "warmstart":
        return {"policy": str(policy)}
    alpha0, beta0, prior = run_prior(cfg, paths, policy, chat, train_tasks)
    if cfg.stage == "prior":
        return {"prior": prior}
    summary = run_rl(cfg, paths, policy, chat, train_tasks, alpha0, beta0, prior)
    summary["total_wall_s"] = time.time() - start
    log(f"done in {summary['total_wall_s']:.0f}s: success before RL "
        f"{summary['success_before_rl']}, after RL {summary['success_after_rl']:.3f}; "
        f"curve {paths.curve}")
    return summary


if __name__ == "__main__":
    main()
