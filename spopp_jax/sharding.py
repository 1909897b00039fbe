"""Device mesh (data, fsdp, tensor), learner-state / batch shardings, multi-host init.

Layout:
  - parameters: `spopp_jax.models.partitioning` rules over the ("fsdp", "tensor") axes,
    replicated over "data";
  - optimizer state: each parameter-shaped leaf (Adam moments) like its parameter,
    counters replicated;
  - batch: rows over ("data", "fsdp") jointly, sequence replicated.
`train_step` is the same code on 1 or N devices: jit + these shardings let XLA insert the
collectives (the global token count and the gradient sums become all-reduces).

Several processes (multi-host, or `--distributed` on one host; each process owns its
local devices and all run the same jitted step, SPMD):
  1. every process calls `initialize_distributed` (`jax.distributed.initialize`) first;
  2. every process builds the same initial TrainState (same seed or checkpoint) and places
     it with `shard_train_state` (each process fills its own devices' shards);
  3. data path: ONLY process 0 runs the orchestrator (engine, agents, tracker). For each
     update it packs the global batch [B, T] (fixed shapes: the orchestrator pads to
     `max_seq_len`); `broadcast_from_process_0` sends that host batch to every process
     (the others pass a placeholder of the same shapes, `jax.ShapeDtypeStruct`s from the
     config), then `shard_global_batch` places it: each process keeps only the rows of
     its own devices;
  4. every process runs `train_step`; process 0 publishes the new weights (gathering
     them with `jax.experimental.multihost_utils.process_allgather` when sharded).
The result equals the single-process step up to reduction order
(tests/test_multiprocess_learner.py: 2 processes x 4 CPU devices vs 1 x 8 vs 1 x 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from spopp_jax.models.partitioning import parameter_shardings

__all__ = [
    "MESH_AXES",
    "BATCH_AXES",
    "MeshConfig",
    "DistributedConfig",
    "make_mesh",
    "initialize_distributed",
    "batch_sharding",
    "replicated",
    "train_state_sharding",
    "shard_train_state",
    "shard_batch",
    "shard_global_batch",
    "place_batch",
    "broadcast_from_process_0",
]

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; one of them may be -1 (= all remaining devices)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Multi-host settings for `jax.distributed.initialize`; single host when num_processes=1."""

    coordinator_address: str | None = None
    num_processes: int = 1
    process_id: int = 0


def _resolve_axis_sizes(sizes: Sequence[int], num_devices: int) -> tuple[int, ...]:
    names = dict(zip(MESH_AXES, sizes))
    for name, size in names.items():
        if size == 0 or size < -1:
            raise ValueError(f"mesh axis `{name}` must be >= 1 or -1, got {size}")
    fill = [name for name, size in names.items() if size == -1]
    if len(fill) > 1:
        raise ValueError(f"at most one mesh axis may be -1, got {fill}")
    fixed = math.prod(size for size in sizes if size != -1)
    if fill:
        if num_devices % fixed:
            raise ValueError(
                f"{num_devices} devices are not divisible by the fixed mesh axes "
                f"{ {k: v for k, v in names.items() if v != -1} }"
            )
        names[fill[0]] = num_devices // fixed
    if math.prod(names.values()) != num_devices:
        raise ValueError(
            f"mesh {names} needs {math.prod(names.values())} devices, have {num_devices}"
        )
    return tuple(names[name] for name in MESH_AXES)


def make_mesh(
    data: int = -1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A `Mesh` with axes ("data", "fsdp", "tensor") over `devices` (default: all devices).

    One axis may be -1 to take the remaining devices; the product must equal the device
    count. `make_mesh()` on one device is the trivial (1, 1, 1) mesh.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = _resolve_axis_sizes((data, fsdp, tensor), len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)  # GSPMD propagation, not explicit
    if len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), MESH_AXES, axis_types=auto)


def initialize_distributed(
    coordinator_address: str | None = None, num_processes: int = 1, process_id: int = 0
) -> bool:
    """`jax.distributed.initialize` for multi-host runs; a no-op (returns False) on one host.

    Call before any other JAX call. Returns True when it initialised the runtime.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if num_processes == 1:
        return False
    if not coordinator_address:
        raise ValueError("coordinator_address is required when num_processes > 1")
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return True


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, batch: Any) -> Any:
    """Per-leaf `NamedSharding`: leading (row) axis over ("data", "fsdp"), rest replicated.

    Raises ValueError when a leaf's row count is not divisible by data·fsdp.
    """
    rows_per_shard = mesh.shape["data"] * mesh.shape["fsdp"]

    def leaf_sharding(path, leaf):
        if leaf.shape[0] % rows_per_shard:
            raise ValueError(
                f"batch field {jax.tree_util.keystr(path)} has {leaf.shape[0]} rows, not "
                f"divisible by data*fsdp = {rows_per_shard}"
            )
        return NamedSharding(mesh, P(BATCH_AXES))

    return jax.tree_util.tree_map_with_path(leaf_sharding, batch)


def train_state_sharding(state: Any, mesh: Mesh, optimizer: optax.GradientTransformation) -> Any:
    """Shardings with the structure of a `spopp_jax.learner.TrainState`.

    `optimizer` must be the one that built ``state.opt_state`` (`learner.make_optimizer`):
    its parameter-shaped leaves are found with `optax.tree_map_params`.
    """
    params = parameter_shardings(state.params, mesh)
    opt_state = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        state.opt_state,
        params,
        transform_non_params=lambda _: replicated(mesh),
    )
    return dataclasses.replace(
        state,
        params=params,
        opt_state=opt_state,
        step=replicated(mesh),
        policy_event=replicated(mesh),
    )


def _place_global(value: Any, sharding: NamedSharding) -> jax.Array:
    """A global array of ``value`` (the same full value on every process) on ``sharding``;
    each process fills only its addressable shards."""
    host = np.asarray(value)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_train_state(state: Any, sharding: Any) -> Any:
    """Places every leaf of `state` on its sharding (copies; the input stays valid).

    Multi-process: every process passes the same full `state` (same seed / checkpoint)
    and fills its own devices' shards.
    """
    if jax.process_count() == 1:
        return jax.device_put(state, sharding)
    return jax.tree.map(_place_global, state, sharding)


def broadcast_from_process_0(tree: Any) -> Any:
    """Process 0's host pytree on every process (SPMD data path, see the module doc).

    Processes other than 0 pass a placeholder of the same structure, shapes and dtypes
    (e.g. zeros); their values are ignored. Single process: returns `tree` unchanged.
    """
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return jax.device_get(multihost_utils.broadcast_one_to_all(tree))


def shard_global_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a GLOBAL batch that every process holds in full (after
    `broadcast_from_process_0`) with rows over (data, fsdp); each process keeps only the
    rows of its own devices. Single process: the same as `shard_batch`."""
    shardings = batch_sharding(mesh, batch)
    if jax.process_count() == 1:
        return jax.device_put(batch, shardings)
    return jax.tree.map(_place_global, batch, shardings)


def place_batch(batch: Any, mesh: Mesh) -> Any:
    """A global host batch on ``mesh``: rows over (data, fsdp) (`shard_global_batch`). In
    one process a batch whose row count data*fsdp does not divide (e.g. a last, smaller
    batch of scored responses) is replicated instead: the same result, no row split."""
    rows_per_shard = mesh.shape["data"] * mesh.shape["fsdp"]
    leaves = jax.tree.leaves(batch)
    if jax.process_count() == 1 and any(leaf.shape[0] % rows_per_shard for leaf in leaves):
        return jax.device_put(batch, replicated(mesh))
    return shard_global_batch(batch, mesh)


def shard_batch(batch: Any, mesh: Mesh) -> Any:
    """Places a `TrainBatch` (or any pytree of [B, ...] arrays) with rows over (data, fsdp).

    Single host: `batch` is the global batch. Multi-host (`jax.process_count() > 1`): each
    process passes its own rows and the global batch is their concatenation in process order.
    """
    if jax.process_count() == 1:
        return jax.device_put(batch, batch_sharding(mesh, batch))

    def global_array(x):
        global_shape = (x.shape[0] * jax.process_count(),) + tuple(x.shape[1:])
        sharding = NamedSharding(mesh, P(BATCH_AXES))
        return jax.make_array_from_process_local_data(sharding, np.asarray(x), global_shape)

    return jax.tree.map(global_array, batch)
