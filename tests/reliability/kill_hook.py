"""Runs `train.py` with a self-inflicted `kill -9` at a chosen point of the RL loop.

    python tests/reliability/kill_hook.py PHASE N -- <train.py flags>

PHASE is where the process SIGKILLs itself, at the N-th occurrence after the RL loop has
opened its checkpoint folder (the warm start and the prior rollouts are not counted):

- ``rollout``: inside the N-th `JaxEngine.generate` call (a request in flight),
- ``learner``: right after the N-th jitted train step finished (new params in memory,
  neither published nor checkpointed),
- ``publish``: at the start of the N-th `JaxEngine.publish`,
- ``checkpoint``: during the N-th `Checkpointer.save`, as soon as orbax's temporary folder
  for that step appears (the write is in progress).

Two more PHASEs inject a fault instead of a kill:

- ``nan_batch``: from the N-th train step on, every batch's advantages are NaN (as a
  broken reward / advantage pipeline would make them): the learner must skip those
  updates and stop the run after `LearnerConfig.max_consecutive_skips` of them.
- ``fill_disk``: just before the N-th `Checkpointer.save`, a file ``disk_filler`` beside
  the run folder takes all but `FILL_LEAVE_BYTES` of its file system's free space (the
  disk fills up while the job runs, as another job's output would fill it); the save
  then meets ENOSPC part-way.

SIGKILL cannot be caught, so nothing is flushed or cleaned up: the same as `kill -9` from
outside, but landing exactly in the named phase. Before dying the hook prints
``KILL_HOOK <phase> <n>`` (flushed) so the caller can check where it landed. Only library
entry points are patched; train.py itself runs unmodified through its CLI (`runpy`).
"""

from __future__ import annotations

import functools
import os
import runpy
import signal
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PHASES = ("rollout", "learner", "publish", "checkpoint", "nan_batch", "fill_disk")
FILLER = "disk_filler"
FILL_LEAVE_BYTES = 64 * 1024
_TMP_GLOB = "*.orbax-checkpoint-tmp*"
_POLL_S = 0.002


class _Trigger:
    def __init__(self, phase: str, nth: int):
        self.phase, self.nth = phase, nth
        self.armed = False
        self.count = 0

    def hit(self, phase: str) -> bool:
        """Counts one occurrence of ``phase``; True when this is the one to die at."""
        if not self.armed or phase != self.phase:
            return False
        self.count += 1
        return self.count == self.nth

    def die(self) -> None:
        print(f"KILL_HOOK {self.phase} {self.count}", flush=True)
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def fill_disk(filler: Path, leave: int = FILL_LEAVE_BYTES) -> None:
    """Allocates ``filler`` so that ``leave`` bytes stay free on its file system."""
    stats = os.statvfs(filler.parent)
    size = stats.f_bavail * stats.f_frsize - leave
    if size > 0:
        with open(filler, "wb") as handle:
            os.posix_fallocate(handle.fileno(), 0, size)
    print(f"KILL_HOOK fill_disk: {filler} takes {size} bytes", flush=True)


def install(phase: str, nth: int) -> _Trigger:
    """Patches the library entry points; returns the trigger (for tests)."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if nth < 1:
        raise ValueError(f"N must be >= 1, got {nth}")
    from rollout_bridge.engine.jax_engine import JaxEngine
    from spopp_jax import checkpoint, learner

    trigger = _Trigger(phase, nth)

    original_init = checkpoint.Checkpointer.__init__

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        trigger.armed = True   # the RL loop has started

    checkpoint.Checkpointer.__init__ = init

    original_generate = JaxEngine.generate

    @functools.wraps(original_generate)
    async def generate(self, *args, **kwargs):
        if trigger.hit("rollout"):
            trigger.die()
        return await original_generate(self, *args, **kwargs)

    JaxEngine.generate = generate

    original_publish = JaxEngine.publish

    @functools.wraps(original_publish)
    async def publish(self, *args, **kwargs):
        if trigger.hit("publish"):
            trigger.die()
        return await original_publish(self, *args, **kwargs)

    JaxEngine.publish = publish

    original_make_train_step = learner.make_train_step

    @functools.wraps(original_make_train_step)
    def make_train_step(*args, **kwargs):
        step = original_make_train_step(*args, **kwargs)

        def killing_step(state, batch):
            if trigger.phase == "nan_batch" and trigger.armed:
                trigger.count += 1
                if trigger.count >= trigger.nth:
                    import dataclasses

                    import numpy as np

                    nan = np.full(np.shape(batch.advantages), np.nan, np.float32)
                    batch = dataclasses.replace(batch, advantages=nan)
            out = step(state, batch)
            if trigger.hit("learner"):
                import jax

                jax.block_until_ready(out)
                trigger.die()
            return out

        return killing_step

    learner.make_train_step = make_train_step

    original_save = checkpoint.Checkpointer.save

    @functools.wraps(original_save)
    def save(self, *args, **kwargs):
        if trigger.hit("fill_disk"):
            fill_disk(Path(self.directory).parent.parent / FILLER)
        if trigger.hit("checkpoint"):
            directory = Path(self.directory)

            def watch():
                while not list(directory.glob(_TMP_GLOB)):
                    time.sleep(_POLL_S)
                trigger.die()

            threading.Thread(target=watch, daemon=True).start()
            original_save(self, *args, **kwargs)
            trigger.die()   # the write finished before the watcher saw it: die right after
        return original_save(self, *args, **kwargs)

    checkpoint.Checkpointer.save = save
    return trigger


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[2] != "--":
        raise SystemExit("usage: kill_hook.py PHASE N -- <train.py flags>")
    sys.path.insert(0, str(ROOT))
    install(argv[0], int(argv[1]))
    sys.argv = [str(ROOT / "train.py"), *argv[3:]]
    runpy.run_path(str(ROOT / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
