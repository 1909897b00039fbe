"""The warm-start stage: SFT of the base model on the teacher's demonstrations
(``warmstart.*``), checkpointed at epoch ends, cached in the run folder by its key."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from rollout_bridge.atomic_files import write_json_atomic
from rollout_bridge.progress_lines import show_bar
from rollout_bridge.run_folder import RunPaths, folder_digest, log, stage_key

# Bump when the code that turns games into SFT examples (observation text, reply format,
# tokenization) or runs the SFT changes in a way the config does not show.
WARMSTART_RECIPE_VERSION = 2


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
    from rollout_bridge.warmstart import run_sft, sft_examples
    from rollout_bridge.learner_processes import build_sft_learner
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
    sft_cfg = LearnerConfig(num_micro_batches=1, length_bucket=None, num_mini_batches=1, action_logits_fraction=None,
                            learning_rate=ws.learning_rate, weight_decay=ws.weight_decay,
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
    paths.warmstart_record.unlink(missing_ok=True)  # a kill mid-save must not leave new weights under the old key
    save_pretrained(model_def.merge(state.params), str(folder))  # in model.compute_dtype
    chat.tokenizer.save_pretrained(str(folder))
    write_json_atomic(paths.warmstart_record, {"key": key, "losses": losses, "examples": len(examples),
                                               "wall_s": time.time() - start})
    saved.remove()  # the finished model is saved: the SFT checkpoints are not needed any more
    log(f"warm start: {len(losses)} steps in {time.time() - start:.0f}s, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    return folder
