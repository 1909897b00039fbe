"""Non-blocking publish: the next learner update starts while the previous weights are
exported and installed (SPEC 3, "Publishing without a drain").

Why a snapshot: the learner's jitted step DONATES its TrainState, so the parameter buffers
of update t are deleted when update t+1 is dispatched. Handing those buffers to a slow
export (HF folder, NCCL broadcast, vLLM load) would either make the learner wait for the
export or hand the exporter deleted arrays. ``BackgroundPublisher.submit`` therefore takes
a SNAPSHOT first (an un-donated copy) and gives the snapshot to a publisher thread; the
learner may donate its own buffers right after ``submit`` returns.

    snapshot = copy(params)                 # on the learner's devices ("device") or host
    learner: step t+1 ... step t+2 ...      # runs while
    publisher thread: install(snapshot, k)  # export / engine.publish_inflight

Costs, both reported in ``PublishTimes``:
  * memory: one extra parameter copy per pending publish (``snapshot_bytes``; at most
    ``max_pending`` copies live), on the learner's devices for ``snapshot="device"`` (the
    copy is one async device op: the learner does not wait for it), in host RAM for
    ``snapshot="host"`` (the device-to-host transfer then runs in the learner's thread).
  * learner idle on publish: ``submit`` waits only while ``max_pending`` earlier publishes
    are still installing (back-pressure, so snapshots cannot pile up); that wait is
    ``idle_s`` of the update, to be logged per update.

Rejected: publishing from the live (donated) state with a lock around the step (the learner
then idles for the whole export, which is what this removes); skipping donation (a full
extra TrainState copy, params AND optimizer moments, at every step instead of one params
copy per publish).

Installs run one at a time in submission order on one thread, so policy events arrive at
the engine in order. An install that raises is re-raised (with its event) by the next
``submit`` / ``wait`` / ``close``: nothing is dropped silently.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

SNAPSHOT_KINDS = ("device", "host")

Installer = Callable[[Any, int], None]  # (snapshot params, policy_event) -> None, blocking


@dataclasses.dataclass(frozen=True)
class PublisherConfig:
    """snapshot: "device" (copy on the learner's devices) or "host" (numpy copy).
    max_pending: publishes that may be exporting / installing at once; ``submit`` waits
      (learner idle on publish) while that many are still in flight.
    """

    snapshot: str = "device"
    max_pending: int = 1

    def __post_init__(self):
        if self.snapshot not in SNAPSHOT_KINDS:
            raise ValueError(f"PublisherConfig.snapshot must be one of {SNAPSHOT_KINDS}, got {self.snapshot!r}")
        if self.max_pending < 1:
            raise ValueError(f"PublisherConfig.max_pending must be >= 1, got {self.max_pending}")


@dataclasses.dataclass
class PublishTimes:
    """Per-publisher counters (seconds are wall-clock).

    idle_s: learner time inside the latest ``submit`` (waiting for back-pressure plus
      dispatching the snapshot); total_idle_s: summed over all submits.
    install_s: duration of the latest finished install; installs: finished installs.
    snapshot_bytes: bytes of one snapshot (the memory cost of each pending publish).
    """

    idle_s: float = 0.0
    total_idle_s: float = 0.0
    install_s: float = 0.0
    installs: int = 0
    snapshot_bytes: int = 0


@jax.jit
def _device_copy(tree: Any) -> Any:
    # jnp.copy is a real copy (copy_p): jit never forwards it as the donated input buffer.
    return jax.tree.map(jnp.copy, tree)


def snapshot_params(params: Any, kind: str = "device") -> Any:
    """An un-donated copy of a parameter pytree: new device buffers (same shardings) for
    ``"device"``, numpy arrays for ``"host"``. The caller may donate ``params`` afterwards."""
    if kind == "device":
        return _device_copy(params)
    if kind == "host":
        return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(params))
    raise ValueError(f"snapshot kind must be one of {SNAPSHOT_KINDS}, got {kind!r}")


def tree_nbytes(tree: Any) -> int:
    """Bytes held by a pytree of arrays on this process (addressable shards of sharded
    arrays: replicas count once per device that holds them)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array):
            total += sum(shard.data.nbytes for shard in leaf.addressable_shards)
        else:
            total += np.asarray(leaf).nbytes
    return total


class PublishError(RuntimeError):
    """An earlier background install failed (its policy event is in the message)."""


class BackgroundPublisher:
    """Snapshot-then-install-in-the-background publisher (see the module docstring).

    Args:
      install: blocking ``install(snapshot, policy_event)`` run on the publisher thread,
        e.g. ``engine_installer(engine, loop)`` or an HF-folder export.
      config: ``PublisherConfig``.
    """

    def __init__(self, install: Installer, config: PublisherConfig = PublisherConfig()):
        self._install = install
        self.config = config
        self.times = PublishTimes()
        self._queue: list[tuple[Any, int]] = []
        self._pending = 0  # submitted and not finished installing
        self._error: BaseException | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="BackgroundPublisher", daemon=True)
        self._thread.start()

    def submit(self, params: Any, policy_event: int) -> float:
        """Snapshot ``params`` and publish them as ``policy_event`` in the background.

        Returns the learner's idle time in this call (waiting while ``max_pending``
        publishes are in flight, plus dispatching the snapshot). After it returns the
        caller may donate or overwrite ``params``.
        """
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: self._pending < self.config.max_pending or self._error is not None)
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError("BackgroundPublisher is closed")
        snapshot = snapshot_params(params, self.config.snapshot)
        with self._changed:
            self._queue.append((snapshot, int(policy_event)))
            self._pending += 1
            self._changed.notify_all()
        idle = time.perf_counter() - start
        self.times.idle_s = idle
        self.times.total_idle_s += idle
        self.times.snapshot_bytes = tree_nbytes(snapshot)
        return idle

    def wait(self) -> float:
        """Block until every submitted publish is installed; returns the seconds waited."""
        start = time.perf_counter()
        with self._changed:
            self._changed.wait_for(lambda: self._pending == 0 or self._error is not None)
            self._raise_if_failed()
        return time.perf_counter() - start

    def close(self) -> None:
        """Install what is pending, then stop the thread (re-raises a failed install)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join()
        with self._changed:
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PublishError(f"background publish failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return  # closed and drained
                snapshot, policy_event = self._queue.pop(0)
            start = time.perf_counter()
            try:
                self._install(snapshot, policy_event)
            except BaseException as error:  # surfaced to the learner by submit / wait / close
                with self._changed:
                    self._error = RuntimeError(f"policy event {policy_event}: {error!r}")
                    self._error.__cause__ = error
                    self._queue.clear()
                    self._pending = 0
                    self._changed.notify_all()
                return
            del snapshot  # the snapshot's memory goes back before the next one is waited for
            with self._changed:
                self.times.install_s = time.perf_counter() - start
                self.times.installs += 1
                self._pending -= 1
                self._changed.notify_all()


def engine_installer(engine: Any, loop: asyncio.AbstractEventLoop, inflight: bool = True) -> Installer:
    """An ``Installer`` that publishes into a ``RolloutEngine`` living on ``loop`` (the
    orchestrator's event loop): ``publish_inflight`` (SPEC 3 default) or the drained
    ``publish``. Blocks the publisher thread until the engine has installed."""

    def install(snapshot: Any, policy_event: int) -> None:
        publish = engine.publish_inflight if inflight else engine.publish
        asyncio.run_coroutine_threadsafe(publish(snapshot, policy_event), loop).result()

    return install
