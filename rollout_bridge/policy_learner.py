"""The orchestrator's learner callable over the jitted SPO++ step (``spopp_jax.learner``).

One call = one update: the train step on the packed batch (in the orchestrator's learner
thread), the new weights for publishing and, when the method asks for a divergence
(``LearnerInput.previous`` is not None, SPO), the SPO recipe's two learner log-probs:

  * π_then of this batch: log-probs at the update's STARTING parameters (verl's
    ``compute_log_prob`` before the actor update), returned as ``trained_logp`` for the
    method to keep with each task's response; with ``old_logp_source="current"`` they are
    also the PPO ratio's π_old (``batch.old_logp``), so the step does not recompute them;
  * π_now of each task's previous response y′ after the update, and
    D_i = token-mean |π_then − π_now| over y′'s action tokens.

The engine's rollout log-probs never enter D. A packed batch (``rollout.pack_rows``: several
trajectories per row, ``TrainBatch.segment_ids``) trains as it is; ``trained_logp`` is read
back to one row per trajectory (`rollout_bridge.trajectory.unpack_rows`).

In-flight publishing (``rollout.drain none``): the orchestrator starts the next update while
the engine still copies the published weights, and the jitted step DONATES its TrainState,
so ``snapshot_weights=True`` hands out an un-donated copy of the parameters
(``background_publish.snapshot_params``: one async device copy per update, the learner does
not wait for it) instead of the live buffers.

Data parallelism (``mesh`` given): the state is placed on the mesh (parameters and AdamW
moments by the partition rules, ``train_state_sharding``) and every batch with its rows
over the mesh's data x fsdp axes (``place_batch``), so each device runs the step on its
own rows and XLA sums the gradients and the global token count across devices; the
micro-batches and the token mean are those of one device. In one process this needs no
flag: the default mesh (``mesh.fsdp -1``) spans every local device.
Several learner processes (``jax.process_count() > 1``, ``train.py --distributed``; the
data path is in ``rollout_bridge.distributed_learner``): each process fills its own
devices' shards from its identical full copy, and what leaves the learner (log-probs, the
weights to publish) is gathered to the host with ``process_allgather``. Every process must
make the same calls in the same order (SPMD).

Programs kept (``program_store=True``, the job's ``program_store``): with JAX's persistent
compilation cache on, the jitted step and log-prob function run from programs exported
into its ``learner_programs`` folder (`rollout_bridge.program_store.StoredPrograms`), so a
rerun, ``--resume`` or another seed compiles each batch width's step without tracing the
model (~2 s a width for the main job's step on 2 CPU cores). Off with several learner
processes.

Mixed precision: the state holds the master weights (``model.param_dtype``); what is
published (to the engines, the HF export) is the parameters cast to the model's compute
dtype (``ModelDef.compute_dtype``), a fresh copy no step donates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rollout_bridge import baselines
from rollout_bridge.background_publish import snapshot_params
from rollout_bridge.methods import LearnerInput, LearnerOutput
from rollout_bridge.program_store import ProgramStore, StoredPrograms, store_for
from rollout_bridge.trajectory import unpack_rows
from spopp_jax.learner import (LearnerConfig, ModelDef, SkipGuard, TrainBatch, cast_floating,
                               make_compute_logprobs, make_optimizer, make_train_step)
from spopp_jax.sharding import place_batch, shard_train_state, train_state_sharding

MIB = 2**20


def to_host(tree):
    """A pytree of (possibly multi-process sharded) arrays as host numpy arrays; a
    collective when several processes hold shards (every process must call it)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


class PolicyLearner:
    """``learner(LearnerInput) -> LearnerOutput`` holding the ``TrainState`` (``.state``)."""

    def __init__(self, model_def: ModelDef, state: Any, config: LearnerConfig, pad_to_multiple: int = 64,
                 snapshot_weights: bool = False, mesh: Any = None, program_store: bool = False):
        self.model_def = model_def
        self.snapshot_weights = snapshot_weights
        self.mesh = mesh
        if self.mesh is not None:  # (several processes: the same full state on each -> its shards)
            state = shard_train_state(state, train_state_sharding(state, self.mesh, make_optimizer(config)))
        self.state = state
        self.config = config
        self.pad_to_multiple = pad_to_multiple
        store = learner_store(model_def) if program_store else None
        self.train_step = StoredPrograms(make_train_step(model_def, config), store, "train_step", config,
                                         donate_argnums=(0,), like=(0, None))
        logprob_settings = (config.logprob_chunk_size, config.action_logits_fraction, config.length_bucket)
        self.compute_logprobs = StoredPrograms(make_compute_logprobs(model_def, *logprob_settings), store,
                                               "compute_logprobs", logprob_settings)
        # a non-finite step is skipped inside train_step; max_consecutive_skips in a row stop the run
        self.skip_guard = SkipGuard.from_config(config)

    @property
    def _gathers(self) -> bool:
        return self.mesh is not None and jax.process_count() > 1

    @property
    def _casts(self) -> bool:
        dtype = self.model_def.compute_dtype
        return dtype is not None and any(leaf.dtype != dtype for leaf in jax.tree.leaves(self.state.params))

    def weights(self):
        """The current policy as an NNX module (what the engine publishes) with its weights in
        the compute dtype; over a copy of the parameters with ``snapshot_weights`` (safe to
        install while the next step runs; a cast is such a copy)."""
        params = cast_floating(self.state.params, self.model_def.compute_dtype)
        if self._gathers:  # gathered, on this process's first device: a copy no step donates
            return self.model_def.merge(jax.device_put(to_host(params), jax.local_devices()[0]))
        if self.snapshot_weights and not self._casts:
            params = snapshot_params(params)
        return self.model_def.merge(params)

    def _place(self, batch: TrainBatch) -> TrainBatch:
        return batch if self.mesh is None else place_batch(batch, self.mesh)

    def __call__(self, learner_input: LearnerInput) -> LearnerOutput:
        batch = self._place(learner_input.batch)
        logp_then = None
        if learner_input.previous is not None:
            logp_then = self.compute_logprobs(self.state.params, batch)
            if self.config.old_logp_source == "current":
                batch = dataclasses.replace(batch, old_logp=logp_then)
        self.state, metrics = self.train_step(self.state, batch)
        metrics = {k: float(v) for k, v in to_host(metrics).items()}
        if metrics.get("skipped_updates"):
            print(f"[{time.strftime('%H:%M:%S')}] learner: non-finite loss/gradient, update skipped "
                  f"(loss {metrics['loss']}, grad_norm {metrics['grad_norm']}); parameters unchanged", flush=True)
        self.skip_guard.observe(metrics)
        if learner_input.previous is None:
            return LearnerOutput(self._timed_weights(metrics), metrics)
        logp_then = np.asarray(to_host(logp_then))
        if learner_input.batch.segment_ids is not None:  # packed rows -> one row per trajectory
            logp_then = unpack_rows(logp_then, np.asarray(learner_input.batch.segment_ids),
                                    count=len(learner_input.trajectories))
        divergence = self.previous_divergences(learner_input.previous, logp_then)
        return LearnerOutput(self._timed_weights(metrics), metrics, divergence, trained_logp=logp_then)

    def _timed_weights(self, metrics: dict):
        """``weights()``, its seconds on the learner's thread as ``metrics["publish_snapshot_s"]``
        (the snapshot's device-copy dispatch, or the multi-process gather): the part of a
        publish the learner itself pays, apart from the orchestrator's publish wait; and
        ``metrics["publish_snapshot_mib"]``, the copy's size (0 without a copy; a multi-process
        learner's gathered copy is the full parameters, on process 0).
        A copy lives until its publish is installed (one installing + at most one pending)."""
        start = time.perf_counter()
        weights = self.weights()
        metrics["publish_snapshot_s"] = time.perf_counter() - start
        copied = self.snapshot_weights or self._gathers or self._casts
        itemsize = None if self.model_def.compute_dtype is None else self.model_def.compute_dtype.itemsize
        full_bytes = sum(leaf.size * (itemsize or leaf.dtype.itemsize)  # the copy is never sharded
                         for leaf in jax.tree.leaves(self.state.params))
        metrics["publish_snapshot_mib"] = full_bytes / MIB if copied else 0.0
        return weights

    def save(self, checkpointer, step: int, extras: dict, config: Any) -> None:
        """Checkpoint ``step``: the TrainState (`saved_state`), ``extras`` and the run's
        ``config`` key. A collective with several learner processes (each writes its shards)."""
        checkpointer.save(step, saved_state(self.state, extras), extras, config=config)

    def restore(self, checkpointer, step: int, config: Any):
        """``.state`` = checkpoint ``step``'s train state, placed like the current one (each
        learner process reads its shards); the ``RestoredCheckpoint``, extras included. A
        config other than the saved one raises ``CheckpointMismatchError``."""
        restored = checkpointer.restore(self.state, expected_config=config, step=step)
        self.state = restored.train_state
        return restored

    def previous_divergences(self, previous, logp_batch: np.ndarray) -> list[float | None]:
        """D_i of each y′ under the current (updated) parameters; None on a first visit."""
        arrays, rows = baselines.pack_previous_responses(previous, logp_batch, self.pad_to_multiple,
                                                         num_rows=len(previous))
        if arrays is None:
            return [None] * len(previous)
        scored = TrainBatch(input_ids=arrays["input_ids"], attention_mask=arrays["attention_mask"],
                            action_mask=arrays["action_mask"], rollout_logp=np.zeros_like(arrays["logp_then"]),
                            advantages=np.zeros_like(arrays["logp_then"]))
        logp_now = np.asarray(to_host(self.compute_logprobs(self.state.params, self._place(scored))))
        return baselines.divergences_from_logprobs(rows, arrays, logp_now)


def learner_store(model_def: ModelDef) -> ProgramStore | None:
    """The program store of the learner's programs (`rollout_bridge.program_store`, folder
    ``learner_programs``) for models of ``model_def``'s structure: its GraphDef, parameter
    treedef and paths, compute dtype and the bytes of its constant (non-parameter) state.
    None with several processes (each holds shards of arrays no one process can export)."""
    if jax.process_count() > 1:
        return None
    constants = hashlib.sha256()
    for leaf in jax.tree.leaves(model_def.rest_state):
        leaf = np.asarray(leaf)
        constants.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    structure = (model_def.graphdef, model_def.param_state_def, model_def.param_paths,
                 str(model_def.compute_dtype), constants.hexdigest())
    return store_for(structure, "learner_programs")


def saved_state(state, extras: dict):
    """The TrainState as checkpointed: its policy event = the orchestrator's (numpy: the
    same value on every process)."""
    event = int(extras["orchestrator"]["counters"]["policy_event"])
    as_array = jnp.asarray if jax.process_count() == 1 else np.asarray
    return dataclasses.replace(state, policy_event=as_array(event, np.int32))
