"""The learner as several processes (``train.py --distributed``).

Data path (SPMD: every process must run the same jitted computations in the same order):

  * process 0 runs the whole job: warm start, prior, the orchestrator with the engine,
    agents and tracker, checkpoints' bookkeeping, exports. The other processes run only
    `follow`: a loop that waits for process 0's next learner command.
  * every collective learner action on process 0 goes through `LeaderLearner`, which
    first SENDS the command and then runs it: the header ("command,payload bytes") goes
    through jax's coordination service key-value store (key ``spopp_learner/<n>``; a
    follower blocks on it for as long as process 0 collects rollouts: a collective would
    time out, gloo after 30 s), then the payload (a pickled Python object as a uint8
    array) through ``broadcast_from_process_0``, once both sides are there. Each follower
    runs the same action on its own `PolicyLearner`:
      - ``CALL``: payload = the orchestrator's ``LearnerInput`` (the packed [B, T] batch
        and, for SPO, the previous responses); every process places the batch on the
        global mesh (``shard_global_batch``: each keeps its devices' rows), runs the same
        train step and log-prob passes; only process 0's ``LearnerOutput`` is used;
      - ``WEIGHTS``: the parameters gathered to the host (``process_allgather``) for a
        publish / export on process 0;
      - ``SAVE``: payload = (step, extras, config) of a checkpoint; every process calls
        ``Checkpointer.save`` with the global state (orbax writes each process's shards,
        process 0 the rest);
      - ``RESTORE``: payload = (step, config) of the checkpoint ``--resume`` continues;
        every process restores the SAME checkpoint onto its own shards of the global state
        (``Checkpointer.restore`` with its sharded state as the target: orbax reads each
        process's shards). Process 0 alone loads the extras it needs (the orchestrator's
        state, the method's); the followers drop theirs;
      - ``STOP``: followers return.
  * the first broadcast (`share_from_process_0`) hands the followers the run's policy
    folder once process 0 has finished the warm start (they load the same weights).

Costs: one full parameter copy per process before sharding (every process builds the
same TrainState, then keeps its shards), one broadcast of each batch (B x T int32 /
float32: small next to a train step) and a host gather of the parameters per publish.
A follower waits inside a collective while process 0 runs the warm start and the prior.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any

import numpy as np

CALL, WEIGHTS, SAVE, STOP, SHARE, RESTORE = 1, 2, 3, 4, 5, 6
COMMAND_NAMES = {CALL: "call", WEIGHTS: "weights", SAVE: "save", STOP: "stop", SHARE: "share", RESTORE: "restore"}
HEADER_KEY = "spopp_learner/{index}"  # coordination-service key of the index-th command
FOLLOWER_WAIT_MS = 7 * 24 * 3600 * 1000  # a follower waits this long for process 0's next command
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """Where this process stands: ``num_processes`` learner processes, this one
    ``process_id``, the coordinator at ``coordinator_address`` (host:port)."""

    coordinator_address: str | None
    num_processes: int
    process_id: int

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def settings_from_env(environ=os.environ) -> DistributedSettings:
    """``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` (all three
    set, or none: then ``jax.distributed.initialize`` detects a cluster, e.g. SLURM).
    ValueError names a missing or bad variable."""
    names = (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
    given = [name for name in names if environ.get(name)]
    if not given:
        return DistributedSettings(None, 0, 0)  # auto-detected by jax
    if len(given) != len(names):
        missing = [name for name in names if name not in given]
        raise ValueError(f"--distributed: {', '.join(given)} set but not {', '.join(missing)} (set all three, "
                         "or none on a cluster jax detects)")
    try:
        num, pid = int(environ[ENV_NUM_PROCESSES]), int(environ[ENV_PROCESS_ID])
    except ValueError:
        raise ValueError(f"--distributed: {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers, got "
                         f"{environ[ENV_NUM_PROCESSES]!r}, {environ[ENV_PROCESS_ID]!r}") from None
    if num < 1 or not 0 <= pid < num:
        raise ValueError(f"--distributed: need {ENV_NUM_PROCESSES} >= 1 and 0 <= {ENV_PROCESS_ID} < it, got "
                         f"{num}, {pid}")
    return DistributedSettings(environ[ENV_COORDINATOR], num, pid)


def initialize(settings: DistributedSettings) -> DistributedSettings:
    """``jax.distributed.initialize`` (before any other JAX call); gloo collectives on a
    CPU-only host. Returns the settings jax settled on."""
    import jax

    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if settings.coordinator_address is None:
        jax.distributed.initialize()
    else:
        jax.distributed.initialize(coordinator_address=settings.coordinator_address,
                                   num_processes=settings.num_processes, process_id=settings.process_id)
    return DistributedSettings(settings.coordinator_address, jax.process_count(), jax.process_index())


# ------------------------------------------------------------------ the command channel
_channel = {"sent": 0, "received": 0}  # commands sent (process 0) / received (a follower)


def _broadcast(tree: Any) -> Any:
    from spopp_jax.sharding import broadcast_from_process_0

    return broadcast_from_process_0(tree)


def _coordination_client():
    from jax._src import distributed as jax_distributed

    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("the learner command channel needs jax.distributed.initialize first")
    return client


def send(command: int, payload: Any = None) -> None:
    """Process 0: the next command (header through the key-value store, the pickled
    ``payload`` by broadcast)."""
    data = np.frombuffer(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    index, _channel["sent"] = _channel["sent"], _channel["sent"] + 1
    _coordination_client().key_value_set(HEADER_KEY.format(index=index), f"{command},{data.size}")
    if data.size:
        _broadcast(data)


def receive() -> tuple[int, Any]:
    """Other processes: the next (command, payload) process 0 sent (waits up to
    ``FOLLOWER_WAIT_MS``)."""
    index, _channel["received"] = _channel["received"], _channel["received"] + 1
    header = _coordination_client().blocking_key_value_get(HEADER_KEY.format(index=index), FOLLOWER_WAIT_MS)
    command, size = (int(part) for part in header.split(","))
    if command not in COMMAND_NAMES:
        raise RuntimeError(f"learner follower: unknown command {command} from process 0")
    payload = None
    if size:
        payload = pickle.loads(np.asarray(_broadcast(np.zeros(size, np.uint8))).tobytes())
    return command, payload


_shared = {"done": False}  # process 0 has sent the SHARE its followers wait for first


def share_from_process_0(value: Any = None) -> Any:
    """Process 0's ``value`` on every process (the others pass nothing)."""
    import jax

    if jax.process_count() == 1:
        return value
    if jax.process_index() == 0:
        send(SHARE, value)
        _shared["done"] = True
        return value
    command, payload = receive()
    if command != SHARE:
        raise RuntimeError(f"learner follower: expected the shared value, got {COMMAND_NAMES[command]}")
    return payload


def release_followers() -> None:
    """Process 0 at exit: followers still waiting for the first SHARE get None (no RL
    stage ran, or it failed before starting) and return."""
    import jax

    if jax.process_count() > 1 and jax.process_index() == 0 and not _shared["done"]:
        share_from_process_0(None)


# ------------------------------------------------------------------ both sides
class LeaderLearner:
    """Process 0's learner when there are several learner processes: each action is sent
    to the others first, then run on ``learner`` (a `PolicyLearner`); the followers run it
    on theirs (`follow`). One process drives its `PolicyLearner` directly."""

    def __init__(self, learner: Any):
        import jax

        if jax.process_count() == 1:
            raise ValueError("LeaderLearner is for several learner processes; one process drives its learner "
                             "directly")
        self.learner = learner
        self.stopped = False

    def __getattr__(self, name: str):  # model_def, config, ... of the wrapped learner
        return getattr(self.learner, name)

    @property
    def state(self):
        return self.learner.state

    @state.setter
    def state(self, value):
        self.learner.state = value

    def _send(self, command: int, payload: Any = None) -> None:
        if self.stopped:
            raise RuntimeError(f"the learner processes were stopped: no {COMMAND_NAMES[command]} after stop()")
        send(command, payload)

    def __call__(self, learner_input):
        self._send(CALL, learner_input)
        return self.learner(learner_input)

    def weights(self):
        self._send(WEIGHTS)
        return self.learner.weights()

    def save(self, checkpointer, step: int, extras: dict, config: Any) -> None:
        """A checkpoint of the learner's state (every process writes its shards)."""
        self._send(SAVE, (step, extras, config))
        self.learner.save(checkpointer, step, extras, config)

    def restore(self, checkpointer, step: int, config: Any):
        """Every process restores checkpoint ``step`` onto its shards; returns process 0's
        ``RestoredCheckpoint`` (extras included). A config mismatch raises
        ``CheckpointMismatchError`` on every process alike (the same files are read)."""
        self._send(RESTORE, (step, config))
        return self.learner.restore(checkpointer, step, config)

    def stop(self) -> None:
        """Followers return from `follow` (idempotent)."""
        if not self.stopped:
            send(STOP)
        self.stopped = True


def follow(learner: Any, checkpointer: Any = None) -> int:
    """A follower process's loop: run process 0's learner commands on ``learner`` (a
    `PolicyLearner`) until STOP; returns the number of learner calls."""
    calls = 0
    while True:
        command, payload = receive()
        if command == STOP:
            return calls
        if command == CALL:
            learner(payload)
            calls += 1
        elif command == WEIGHTS:
            learner.weights()
        elif command in (SAVE, RESTORE) and checkpointer is None:
            raise RuntimeError(f"learner follower: process 0 sent {COMMAND_NAMES[command]}, this process has no "
                               "checkpointer")
        elif command == SAVE:
            learner.save(checkpointer, *payload)  # (step, extras, config)
        elif command == RESTORE:
            learner.restore(checkpointer, *payload)  # (step, config)
        else:
            raise RuntimeError(f"learner follower: unexpected {COMMAND_NAMES[command]} command")


__all__ = ["DistributedSettings", "LeaderLearner", "follow", "initialize", "receive", "release_followers", "send",
           "settings_from_env", "share_from_process_0"]
