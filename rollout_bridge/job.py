"""The stages of a training job other than RL (warm start, prior, evaluation), its run
folder and its per-update log. ``train.py`` composes them (see its docstring)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from rollout_bridge.agent import derived_seed
from rollout_bridge.components import load_policy
from rollout_bridge.evaluation_cache import EVALUATION_SCHEME, cache_file, read_cached, write_cached
from rollout_bridge.metrics import MetricsWriter
from rollout_bridge.prior import prior_record, read_prior_file, rollout_successes, write_json_atomic
from rollout_bridge.progress_lines import TenthLines, show_bar
from rollout_bridge.run_report import event_order, lag_histogram, prior_text, reference_name, success_axis_limits
from rollout_bridge.run_errors import UserError

PRIOR_SEED_OFFSET = 1_000_003  # the prior's engine seed = job seed + this (apart from RL's)
TRAILING_WINDOW = 5  # updates in the trailing success mean of the progress bar


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    warmstart_model = property(lambda self: self.root / "warmstart_model")
    warmstart_record = property(lambda self: self.root / "warmstart_model" / "warmstart.json")  # WARMSTART_RECORD_NAME
    warmstart_checkpoints = property(lambda self: self.root / "warmstart_checkpoints")  # SFT in progress
    prior = property(lambda self: self.root / "prior.json")
    checkpoints = property(lambda self: self.root / "checkpoints")
    eval_after = property(lambda self: self.root / "eval_after.json")
    curve = property(lambda self: self.root / "learning_curve.png")
    summary = property(lambda self: self.root / "summary.json")
    hf_model = property(lambda self: self.root / "hf_model")

    def export(self, step: int) -> Path:
        return self.root / "exports" / f"step_{step}"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def enable_compilation_cache(directory: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache in `directory` (TrainConfig
    `compilation_cache_dir`) unless `JAX_COMPILATION_CACHE_DIR` already chose one; the folder
    in use, or None. Call before anything is compiled: JAX decides at the first compile.
    Every executable is kept, not only those that took JAX's default 1 s to compile: the
    rollout engine's prefill shapes compile in ~0.5 s each, and a job meets a hundred or
    more of them (unless `JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says otherwise)."""
    chosen = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if chosen:
        return chosen
    if directory is None:
        return None
    jax.config.update("jax_compilation_cache_dir", str(Path(directory).resolve()))
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return directory


# Settings no stage key holds, so a prior, an evaluation or a checkpoint stays reusable when
# they change: where the rollouts run, not what they are (a run may continue on other
# launched servers: one more, other GPUs; rollout.server_urls stays in the key, checkpoints
# written before rollout.servers existed hold it), and rollout.prefix_reuse_across_publish,
# which acts only across publishes (a fixed policy's prior and evaluations have none; a
# resumed run may change it), and env.blind_control, a finished run read for the report only.
UNKEYED_FIELDS = {"rollout": ("servers", "prefix_reuse_across_publish", "pack_rows"), "prior": ("cache_dir",),
                  "env": ("blind_control",), "model": ("remat",)}


def stage_key(cfg, *sections: str) -> dict:
    """The settings an output depends on (reuse it only if they are unchanged; the
    ``UNKEYED_FIELDS`` are left out). ``warmstart.group_by_length`` (added after keys
    were first written) is keyed only where it changes an output, a warm start that is
    trained with it on; so records written before it existed stay valid. ``env.rename_episodes``
    (added later too) is keyed only when it is not 0; ``env.alfred_filter`` and
    ``env.alfred_floor_plans`` only when on for generated ALFWorld games (the only games they
    change; with both off those games are the ones made before they existed)."""
    key = {name: json.loads(json.dumps(dataclasses.asdict(getattr(cfg, name)))) for name in sections}
    generated_alfworld = cfg.env.kind == "alfworld" and cfg.env.game_dir is None
    for field in ("alfred_filter", "alfred_floor_plans"):
        if "env" in key and not (generated_alfworld and getattr(cfg.env, field)):
            key["env"].pop(field, None)
    for name, fields in UNKEYED_FIELDS.items():
        for field in fields:
            key.get(name, {}).pop(field, None)
    if "warmstart" in key and not (cfg.warmstart.enabled and cfg.warmstart.group_by_length):
        key["warmstart"].pop("group_by_length", None)
    if "env" in key and not cfg.env.rename_episodes:
        key["env"].pop("rename_episodes", None)
    return key


def checkpoint_key(cfg) -> dict:
    """Settings a checkpoint must agree with to be resumed (not steps, logging, paths)."""
    key = stage_key(cfg, "model", "env", "warmstart", "prior", "tracker", "sampler", "advantage", "loss", "optim",
                    "rollout")
    key.update(method=cfg.method.to_dict(), seed=cfg.seed)
    return key


def latest_checkpoint_step(paths: RunPaths) -> int | None:
    """Newest complete orbax step folder (an interrupted save leaves only a tmp folder)."""
    if not paths.checkpoints.is_dir():
        return None
    steps = [int(p.name) for p in paths.checkpoints.iterdir() if p.is_dir() and p.name.isdigit()]
    return max(steps, default=None)


def refuse_overwrite(resume: bool, latest: int | None, paths: RunPaths) -> None:
    if latest is not None and not resume:
        raise UserError(f"{paths.checkpoints} holds checkpoints up to step {latest}: pass "
                         "--resume to continue that run, or choose a new --output_dir")


def state_digest(tree: Any) -> str:
    """sha1 over every array leaf of a state pytree, in path order (e.g. a method's
    state: its tracker alpha, beta, z_ref, SPO's previous responses)."""
    digest = hashlib.sha1()
    leaves = sorted(jax.tree_util.tree_flatten_with_path(tree)[0], key=lambda item: jax.tree_util.keystr(item[0]))
    for path, leaf in leaves:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()


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


# ------------------------------------------------------------------ stage: warm start
# Bump when the code that turns games into SFT examples (observation text, reply format,
# tokenization) or runs the SFT changes in a way the config does not show.
WARMSTART_RECIPE_VERSION = 2
WARMSTART_RECORD_NAME = "warmstart.json"


def folder_digest(folder: Path, skip: tuple[str, ...] = (WARMSTART_RECORD_NAME,)) -> str:
    """sha1 over every file under `folder` (relative path and bytes, in sorted order)."""
    digest = hashlib.sha1()
    for path in sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name not in skip):
        digest.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def warmstart_key(cfg, base: Path) -> dict:
    """Everything the warm-start SFT result depends on, so a cached warm start is reused
    only when it would come out the same: the ``model``, ``env`` (which games, their
    observation text and reply format) and ``warmstart`` sections, the job seed (SFT batch
    order), the optimizer fields the SFT step reads, the base model's files (content, not
    path) and ``WARMSTART_RECIPE_VERSION``."""
    key = stage_key(cfg, "model", "env", "warmstart")
    key.update(seed=cfg.seed, max_grad_norm=cfg.optim.max_grad_norm, logprob_chunk_size=cfg.optim.logprob_chunk_size,
               base=folder_digest(base), recipe_version=WARMSTART_RECIPE_VERSION)
    return key


class SFTCheckpoints:
    """The warm start's SFT, checkpointed at epoch ends (at most one save per ``every_s``
    seconds, the newest kept) so that a crash loses at most that much: a rerun of the job
    with the same warm-start settings (``key``) resumes at the last saved epoch; a
    checkpoint of other settings is removed with a log line. Removed once SFT finished."""

    def __init__(self, directory: Path, key: dict, every_s: float = 60.0):
        self.directory, self.key, self.every_s = Path(directory), key, every_s
        self.last_save = time.time()
        self._checkpointer = None

    def _open(self):
        from spopp_jax.checkpoint import Checkpointer

        if self._checkpointer is None:
            self._checkpointer = Checkpointer(self.directory, max_to_keep=1)
        return self._checkpointer

    def restore(self, state, epochs: int):
        """(state, losses, epochs done): from the newest checkpoint of this warm start, or
        the given state with nothing done."""
        import shutil

        from spopp_jax.checkpoint import CheckpointMismatchError

        if not self.directory.is_dir():
            return state, [], 0
        checkpointer = self._open()
        if checkpointer.latest_step() is None:
            return state, [], 0
        try:
            restored = checkpointer.restore(state, expected_config={"key": self.key})
        except CheckpointMismatchError as error:
            log(f"warm start: {self.directory} holds the SFT of other settings; starting afresh "
                f"({str(error).splitlines()[0]})")
            self.close()
            shutil.rmtree(self.directory)
            return state, [], 0
        epochs_done = min(int(restored.step), epochs)
        losses = [float(x) for x in np.asarray(restored.extras["losses"]).ravel()]
        log(f"warm start: resuming SFT after epoch {epochs_done}/{epochs} ({len(losses)} steps done, "
            f"from {self.directory})")
        return restored.train_state, losses, epochs_done

    def maybe_save(self, epochs_done: int, state, losses: list[float]) -> None:
        if time.time() - self.last_save < self.every_s:
            return
        self._open().save(epochs_done, state, extras={"losses": np.asarray(losses, np.float32)},
                          config={"key": self.key})
        self.last_save = time.time()

    def close(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    def remove(self) -> None:
        import shutil

        self.close()
        shutil.rmtree(self.directory, ignore_errors=True)


class SFTProgress:
    """The warm start's progress: a bar with the running loss (``progress``) and, in any
    case, one log line per tenth of the steps (loss mean since the last line, s/step)."""

    def __init__(self, total_steps: int, epochs: int, progress: bool, done_steps: int = 0):
        from tqdm import tqdm

        self.total, self.epochs, self.start = total_steps, epochs, time.time()
        self.done_steps = done_steps  # resumed: steps done before this run
        self.every = max(1, total_steps // 10)
        self.window: list[float] = []
        self.bar = tqdm(total=total_steps, initial=done_steps, desc="warm start (SFT)",
                        disable=not show_bar(progress), dynamic_ncols=True)

    def step(self, step: int, metrics: dict) -> None:
        self.window.append(metrics["loss"])
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        done = step + 1
        if done % self.every == 0 or done == self.total:
            elapsed = time.time() - self.start
            log(f"warm start: step {done}/{self.total} (epoch {-(-done * self.epochs // self.total)}/{self.epochs}), "
                f"loss {np.mean(self.window):.3f}, {elapsed / (done - self.done_steps):.2f} s/step, {elapsed:.0f}s")
            self.window = []

    def close(self) -> None:
        self.bar.close()


def run_warmstart(cfg, paths: RunPaths, base: Path, chat, warm_tasks, learner_config) -> Path:
    """SFT on the warm-start walkthroughs (``warmstart.*``); the initial RL policy's folder."""
    from rollout_bridge.learner_processes import build_sft_learner
    from rollout_bridge.warmstart import run_sft, sft_examples
    from spopp_jax.learner import LearnerConfig, make_sft_step
    from spopp_jax.models import save_pretrained

    ws = cfg.warmstart
    if not ws.enabled or warm_tasks is None:
        return base
    key = warmstart_key(cfg, base)
    if paths.warmstart_record.exists():
        record = json.loads(paths.warmstart_record.read_text())
        if record.get("key") == key:
            log(f"warm start: reusing {paths.warmstart_model} (final SFT loss {record['losses'][-1]:.3f})")
            return paths.warmstart_model
    examples = sft_examples(warm_tasks, chat, max_length=ws.max_length, loss_on=ws.loss_on)
    log(f"warm start: SFT on {len(examples)} demonstrations of tasks outside the training set (loss on {ws.loss_on}), "
        f"{ws.epochs} epochs, batch {ws.batch_size}{' grouped by length' if ws.group_by_length else ''}, "
        f"lr {ws.learning_rate}")
    sft_cfg = LearnerConfig(learning_rate=ws.learning_rate, weight_decay=ws.weight_decay,
                            max_grad_norm=learner_config.max_grad_norm,
                            logprob_chunk_size=learner_config.logprob_chunk_size)
    model_def, state, mesh = build_sft_learner(cfg, base, sft_cfg)  # the RL learner's mesh and precision
    start = time.time()
    saved = SFTCheckpoints(paths.warmstart_checkpoints, key)
    state, done_losses, start_epoch = saved.restore(state, ws.epochs)
    progress = SFTProgress(ws.epochs * -(-len(examples) // ws.batch_size), ws.epochs, cfg.progress,
                           done_steps=len(done_losses))
    try:
        state, losses = run_sft(make_sft_step(model_def, sft_cfg), state, examples, epochs=ws.epochs,
                                batch_size=ws.batch_size, pad_id=chat.tokenizer.pad_token_id, seed=cfg.seed,
                                on_step=progress.step, start_epoch=start_epoch, losses=done_losses,
                                on_epoch=saved.maybe_save, group_by_length=ws.group_by_length, mesh=mesh)
    finally:
        progress.close()
        saved.close()
    folder = paths.warmstart_model
    folder.mkdir(parents=True, exist_ok=True)
    save_pretrained(model_def.merge(state.params), str(folder))  # in model.compute_dtype
    chat.tokenizer.save_pretrained(str(folder))
    write_json_atomic(paths.warmstart_record, {"key": key, "losses": losses, "examples": len(examples),
                                               "wall_s": time.time() - start})
    saved.remove()  # the finished model is saved: the SFT checkpoints are not needed any more
    log(f"warm start: {len(losses)} steps in {time.time() - start:.0f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return folder


# ------------------------------------------------------------------ stage: prior / evaluation
def evaluation_seed(seed: int, task_set: str) -> int:
    """The common-random-numbers seed of the job's evaluations of ``task_set`` ("train",
    "heldout", ...): the prior and the evaluations before and after RL of one job (and
    ``scripts/heldout_eval.py``) give every policy the same random numbers per episode."""
    return derived_seed(seed, "evaluation", task_set)


async def success_rollouts(engine, env, chat, agent, concurrency: int, n: int, what: str, progress: bool,
                           crn_seed: int | None = None, task_ids=None):
    """(successes, trials) per task of ``n`` rollouts of every task in ``task_ids`` (None:
    all) with ``engine``; ``crn_seed``: common random numbers (``rollout_successes``)."""
    from tqdm import tqdm

    total = (env.num_tasks if task_ids is None else len(task_ids)) * n
    shown = show_bar(progress)
    bar = tqdm(total=total, desc=what, disable=not shown, leave=False)
    lines = TenthLines(what, None if shown else log, total, unit=" episodes")
    try:
        return await rollout_successes(engine, env.env_factory, chat, env.num_tasks, n, agent, concurrency,
                                       on_done=lambda _: (bar.update(1), lines.step()), crn_seed=crn_seed,
                                       task_ids=task_ids)
    finally:
        bar.close()


async def extra_evaluations(engine, env, chat, agent, concurrency: int, n: int, when: str,
                            progress: bool, seed: int) -> dict:
    """The env kind's additional evaluations (``env.extra_evals``: ALFWorld's held-out
    games, Math-TIR with the tool disabled): name -> {success_rate, successes, trials}
    (per task) of ``n`` rollouts per task; ``when`` names it in the log ("before RL", ...).
    Each set plays with common random numbers ``evaluation_seed(seed, name)``."""
    results = {}
    for name, (tasks, factory) in env.extra_evals.items():
        view = dataclasses.replace(env, train=tasks, env_factory=factory)
        log(f"evaluation {when} ({name}): {n} rollouts x {view.num_tasks} tasks")
        successes, trials = await success_rollouts(engine, view, chat, agent, concurrency, n, name, progress,
                                                   evaluation_seed(seed, name))
        results[name] = {"success_rate": float(successes.sum() / max(trials.sum(), 1)),
                         "successes": successes.tolist(), "trials": trials.tolist()}
        log(f"evaluation {when} ({name}): success {results[name]['success_rate']:.3f}")
    return results


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
    key = stage_key(cfg, "model", "env", "warmstart", "prior", "rollout")
    key.update(rho=rho, seed=cfg.seed, policy=folder_digest(policy),    # the policy's content, not its path
               episodes=EVALUATION_SCHEME)
    if paths.prior.exists():
        record = json.loads(paths.prior.read_text())
        if record.get("key") == key:
            log(f"prior: reusing {paths.prior} ({prior_text(record)})")
            alpha0, beta0 = read_prior_file(paths.prior, env.num_tasks)
            return alpha0, beta0, record
    record = read_cached(cfg.prior.cache_dir, "prior", key)
    if record is not None:
        log(f"prior: reusing {cache_file(cfg.prior.cache_dir, 'prior', key)} from an earlier run "
            f"({prior_text(record)})")
        write_json_atomic(paths.prior, record)
        alpha0, beta0 = read_prior_file(paths.prior, env.num_tasks)
        return alpha0, beta0, record
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
    mass = cfg.prior.mass if cfg.prior.mass is not None else 1.0 / (1.0 - rho)
    record = prior_record(successes, trials, mass)
    record.update(key=key, wall_s=time.time() - start)
    write_json_atomic(paths.prior, record)
    write_cached(cfg.prior.cache_dir, "prior", key, record)
    log(f"prior: {prior_text(record)} in {time.time() - start:.0f}s")
    return np.asarray(record["alpha0"], np.float32), np.asarray(record["beta0"], np.float32), record


# ------------------------------------------------------------------ stage: report
def success_estimate(successes, trials) -> dict:
    """Success rate of per-task rollouts and its standard error, games as clusters:

        rate = Σ_g s_g / Σ_g n_g,   se = std_g(s_g / n_g) / √G   (ddof 1; equal n_g)

    (rollouts of one game are correlated, so the SE is over games, not episodes)."""
    successes, trials = np.asarray(successes, np.float64), np.asarray(trials, np.float64)
    if successes.shape != trials.shape or successes.ndim != 1 or not (trials > 0).any():
        raise ValueError("successes and trials must be equal-length 1-D arrays, some trials > 0")
    played = trials > 0   # a game whose every rollout failed (env error) carries no evidence
    successes, trials = successes[played], trials[played]
    per_game = successes / trials
    games = len(per_game)
    se = float(per_game.std(ddof=1) / np.sqrt(games)) if games > 1 else float("nan")
    return {"success_rate": float(successes.sum() / trials.sum()), "se": se, "episodes": int(trials.sum()),
            "games": games}


def paired_gain(before: dict, after: dict) -> dict:
    """After − before on the same games (records with per-game ``successes``/``trials``):

        gain = mean_g(d_g),  se = std_g(d_g) / √G,  d_g = after_g − before_g   (ddof 1)"""
    rate = lambda record: np.asarray(record["successes"], np.float64) / np.asarray(record["trials"], np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        diff = rate(after) - rate(before)
    diff = diff[np.isfinite(diff)]   # games with rollouts on both sides
    if diff.size < 2:
        return {"gain": float(diff.mean()), "se": float("nan")}
    return {"gain": float(diff.mean()), "se": float(diff.std(ddof=1) / np.sqrt(diff.size))}


def margin_text(difference: float, se: float) -> str:
    """'<difference / se> SE', or 'SE 0 (no spread over games)' when the SE is 0 (every
    game agrees: a ratio would print as inf or nan)."""
    return f"{difference / se:+.1f} SE" if se > 0 else "SE 0 (no spread over games)"


def margin_line(name: str, estimate: dict, reference: float | None, what: str, reference_se: float | None = None) -> str:
    """'<name> <rate> ± <se> vs <what> <reference>: margin <k> SE' (one report line). A
    measured reference (``reference_se``, independent of the estimate) widens the SE of
    the difference to sqrt(se² + reference_se²)."""
    line = f"{name}: {estimate['success_rate']:.3f} ± {estimate['se']:.3f} (SE over {estimate['games']} games, " \
           f"{estimate['episodes']} episodes)"
    if reference is None:
        return line
    shown = f"{reference:.3f}" if reference_se is None else f"{reference:.3f} ± {reference_se:.3f} (measured)"
    se = float(np.hypot(estimate["se"], reference_se or 0.0))
    return f"{line} vs {what} {shown}: {margin_text(estimate['success_rate'] - reference, se)}"


def plot_job_curve(rows, path: Path, title: str, held_out: dict, references: dict) -> Path:
    """learning_curve.png: training success per update (and its trailing mean), held-out
    success before and after RL with ±2 SE bars (``held_out``: name -> (update, estimate)),
    and horizontal reference lines (``references``: label -> success, e.g. the exact
    prompt-blind ceilings and the warm start's training success)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rollout_bridge.metrics import trailing_mean

    points = [(r["step"], r["success_rate"]) for r in rows if "success_rate" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shown = [*references.values(),   # every plotted value: the success axis fits them
             *(e["success_rate"] + k * 2 * e["se"] for _, e in held_out.values() for k in (-1, 1))]
    if points:
        steps, values = map(np.asarray, zip(*points))
        shown += [*values, *trailing_mean(values, TRAILING_WINDOW)]
        ax.plot(steps, values, "o-", ms=3, alpha=0.35, label="train success per update")
        ax.plot(steps, trailing_mean(values, TRAILING_WINDOW), "-", lw=2,
                label=f"train success, trailing mean ({TRAILING_WINDOW})")
    for label, (update, estimate) in held_out.items():
        ax.errorbar([update], [estimate["success_rate"]], yerr=[2 * estimate["se"]], fmt="s", ms=7, capsize=5,
                    label=f"{label}: {estimate['success_rate']:.2f} ± 2 SE")
    for (label, value), style in zip(references.items(), ("--", ":", "-.", (0, (1, 3)), (0, (5, 5)))):
        if value is not None:
            ax.axhline(value, ls=style, color="gray", label=f"{label}: {value:.2f}")
    ax.set_xlabel("learner update")
    ax.set_ylabel("success rate")
    ax.set_ylim(*success_axis_limits(shown))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report_run(paths: RunPaths, title: str, rows, train_before: dict | None, train_after: dict,
               extra_before: dict, extra_after: dict, references: dict, reference_se: dict | None = None) -> dict:
    """The end-of-job report: summary fields (success with SEs over games, the held-out
    gain over the warm start paired by game, the reference successes such as the exact
    prompt-blind ceiling and the margins to them, the policy-lag histogram), the log lines
    and ``learning_curve.png``. ``train_*``/``extra_*`` are evaluation records with per-game
    ``successes`` / ``trials``; ``references`` name -> success (``EnvBundle.reference_success``),
    ``reference_se`` name -> SE of a measured one (``EnvBundle.reference_se``)."""
    reference_se = dict(reference_se or {})
    fields: dict[str, Any] = dict(references)
    fields.update({f"{name}_se": se for name, se in reference_se.items()})
    lines = []
    last_update = max((r["step"] for r in rows), default=0)
    held_points = {}
    for name, before, after in (("train", train_before, train_after),
                                *((name, extra_before.get(name), extra_after[name]) for name in extra_after)):
        ceiling = "prompt_blind_ceiling" if name == "train" else f"{name}_prompt_blind_ceiling"
        blind, blind_se = references.get(ceiling), reference_se.get(ceiling)
        blind_name = reference_name(ceiling, blind_se is not None, games=False)
        after_estimate = success_estimate(after["successes"], after["trials"])
        fields[f"{name}_after_rl_estimate"] = after_estimate
        lines.append(margin_line(f"{name} success after RL", after_estimate, blind, blind_name, blind_se))
        if before is not None:
            before_estimate = success_estimate(before["successes"], before["trials"])
            gain = paired_gain(before, after)
            fields[f"{name}_before_rl_estimate"] = before_estimate
            fields[f"{name}_gain_over_warm_start"] = gain
            lines.append(margin_line(f"{name} success of the warm start", before_estimate, blind,
                                     blind_name, blind_se))
            lines.append(f"{name} gain of RL over the warm start: {gain['gain']:+.3f} ± {gain['se']:.3f} "
                         f"(paired by game): {margin_text(gain['gain'], gain['se'])}")
            if name != "train":
                held_points[f"{name} before RL (warm start)"] = (0, before_estimate)
        if name != "train":
            held_points[f"{name} after RL"] = (last_update, after_estimate)
    histogram = lag_histogram(rows)
    fields["policy_lag_histogram"] = histogram
    lines.append("policy lag of trained trajectories: " + ", ".join(f"{k}: {v:.0%}" for k, v in histogram.items()))
    order = event_order(rows)
    if order is not None:
        fields["event_order"] = order
        lines.append(f"results received out of event order: {order['out_of_event_order']:.0f} of "
                     f"{order['received']:.0f} ({order['fraction']:.1%})")
    curve_refs = {"train success before RL (warm start)": None if train_before is None else
                  success_estimate(train_before["successes"], train_before["trials"])["success_rate"]}
    curve_refs.update({reference_name(name, name in reference_se): value for name, value in references.items()})
    plot_job_curve(rows, paths.curve, title, held_points, curve_refs)
    for line in lines:
        log(line)
    return fields
