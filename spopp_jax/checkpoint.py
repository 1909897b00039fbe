"""Orbax checkpoints of the learner: TrainState + arbitrary extra pytrees + a JSON config.

One checkpoint step is one orbax directory holding these items, written atomically
(orbax writes into a temporary directory and renames it when every item is complete):

- ``train_state``: the learner's `TrainState` (params, optimizer state, step, policy_event),
- ``extra_<name>``: any other pytree (tracker state, orchestrator counters, sampler key),
    typed PRNG keys are stored as their key data and re-wrapped on restore,
- ``config``: a JSON document (model config, learner config, ...). A restore refuses a
    checkpoint whose config or parameter shapes differ from what the caller expects and
    names every difference.
- ``manifest``: JSON bookkeeping (extra names, which leaves were PRNG keys).
- ``checksums.json``: the SHA-256 and size of every file above, written once orbax has
    finalized the step (`spopp_jax.checkpoint_integrity`) and verified before a restore:
    damaged bytes raise `CheckpointCorruptError` instead of restoring wrong numbers.

A save that fails (a full disk, a quota) raises one `CheckpointWriteError` and removes the
step's temporary folder as far as orbax's threads let it (a folder left behind is ignored
by later saves and restores, like one a killed job leaves); the earlier steps are untouched. The
tracebacks orbax's and tensorstore's worker threads report about the same failure (absl
ERROR records, "Event loop is closed" from futures that complete after orbax closed its
event loop) are kept in `failure_details()` instead of printed; after a failed save the
late ones keep going there too, so the caller decides what the user sees.

A train state holding NaN or ±inf is never written (`NonFiniteStateError`): the newest
step on disk is always the last finite one.

Restoring onto another mesh: pass targets whose leaves are arrays or
`jax.ShapeDtypeStruct`s carrying the *new* shardings; orbax reads each array straight
into its target sharding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from spopp_jax import checkpoint_integrity as integrity
from spopp_jax.pytree_paths import path_name

_TRAIN_STATE = "train_state"
_CONFIG = "config"
_MANIFEST = "manifest"
_EXTRA_PREFIX = "extra_"


# Bumped when the on-disk layout changes; a checkpoint with a higher number is refused.
# Checkpoints written before the number was recorded read as version 1.
CHECKPOINT_FORMAT_VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint on disk does not match the model/config the caller asked for."""


class CheckpointCorruptError(ValueError):
    """A checkpoint step on disk cannot be read (truncated or missing files)."""


class NonFiniteStateError(ValueError):
    """A train state holding NaN or ±inf was not saved; the earlier checkpoints stand."""


class CheckpointWriteError(OSError):
    """A save of ``step`` failed (e.g. the disk is full); the previous checkpoints are untouched."""

    def __init__(self, message: str, step: int | None = None):
        super().__init__(message)
        self.step = step


# ----------------------------------------------------------------------------- failure noise
_MAX_DETAILS = 200   # records kept (the first ones: later ones repeat the same failure)
_CLOSED_LOOP = "Event loop is closed"
_REMOVE_TRIES = 5
_REMOVE_WAIT_S = 0.1


class _WorkerNoise(logging.Filter):
    """While a save runs: absl ERROR records from worker threads and unraisable exceptions
    are kept in ``details`` instead of printed; a save that succeeds hands them back to the
    usual handlers. After a save failed, the late ones of the same failure keep going to
    ``details``: absl ERROR records logged from orbax's threads and tensorstore's callbacks
    into orbax's closed event loop ("Event loop is closed")."""

    def __init__(self):
        super().__init__()
        self.details: list[str] = []
        self.active = 0
        self.failed = False
        self._held: list[Any] = []
        self._lock = threading.Lock()
        self._previous_hook = None
        self._kept_before = 0

    def _keep(self, text: str) -> None:
        with self._lock:
            if len(self.details) < _MAX_DETAILS:
                self.details.append(text)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or record.threadName == "MainThread":
            return True
        if not self.active and not (self.failed and "orbax" in record.pathname):
            return True
        text = f"{record.levelname}:{record.name}: {record.getMessage()}"
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self._keep(text)
        if not self.failed:
            self._held.append(record)
        return False

    def unraisable(self, info) -> None:
        late = self.failed and isinstance(info.exc_value, RuntimeError) and _CLOSED_LOOP in str(info.exc_value)
        if not (self.active or late):
            return self._previous_hook(info)
        lines = traceback.format_exception(info.exc_type, info.exc_value, info.exc_traceback)
        self._keep(f"unraisable exception ({info.err_msg or 'in'} {info.object!r}):\n" + "".join(lines))
        if not self.failed:
            self._held.append(info)

    @contextlib.contextmanager
    def catching(self):
        logger = logging.getLogger("absl")
        if self.active == 0 and not self.failed:
            logger.addFilter(self)
            self._previous_hook = sys.unraisablehook
            sys.unraisablehook = self.unraisable
            self._kept_before = len(self.details)
        self.active += 1
        try:
            yield
        except BaseException:
            self.failed = True   # the worker threads go on failing after the save raised
            raise
        finally:
            self.active -= 1
            if self.active == 0 and not self.failed:
                held, self._held = self._held, []
                del self.details[self._kept_before:]
                logger.removeFilter(self)
                sys.unraisablehook = self._previous_hook
                for item in held:
                    if isinstance(item, logging.LogRecord):
                        logger.handle(item)
                    else:
                        self._previous_hook(item)


_noise = _WorkerNoise()


def failure_details() -> list[str]:
    """What orbax's and tensorstore's threads reported about failed saves (see the module
    docstring), oldest first."""
    with _noise._lock:
        return list(_noise.details)


class RestoredCheckpoint(NamedTuple):
    step: int
    train_state: Any
    extras: dict[str, Any]
    config: dict[str, Any]


# ----------------------------------------------------------------------------- helpers


def to_json_config(config: Any) -> Any:
    """Converts dataclasses / mappings / sequences / scalars into plain JSON values."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: to_json_config(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if isinstance(config, Mapping):
        return {str(k): to_json_config(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [to_json_config(v) for v in config]
    if isinstance(config, (np.generic, np.ndarray)):
        return config.tolist()
    if config is None or isinstance(config, (bool, int, float, str)):
        return config
    raise TypeError(f"config value {config!r} of type {type(config).__name__} is not JSON-able")


def _flatten_json(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(_flatten_json(v, f"{prefix}.{k}" if prefix else str(k)))
        if not tree and prefix:
            out[prefix] = {}
        return out
    return {prefix: tree}


def config_differences(saved: Any, expected: Any) -> list[str]:
    """Lists 'key: saved X, expected Y' for every differing leaf of two JSON configs."""
    saved_flat = _flatten_json(to_json_config(saved))
    expected_flat = _flatten_json(to_json_config(expected))
    diffs = []
    for key in sorted(set(saved_flat) | set(expected_flat)):
        s = saved_flat.get(key, "<missing>")
        e = expected_flat.get(key, "<missing>")
        if s != e:
            diffs.append(f"{key}: saved {s!r}, expected {e!r}")
    return diffs


_path_name = path_name  # orbax metadata and live pytrees spell one path differently


def shape_differences(saved_metadata: Any, target: Any) -> list[str]:
    """Lists leaves whose (shape, dtype) or presence differ between saved metadata and target."""
    saved = {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(saved_metadata)[0]}
    wanted = {_path_name(p): v for p, v in jax.tree_util.tree_flatten_with_path(target)[0]}
    diffs = []
    for key in sorted(set(saved) | set(wanted)):
        if key not in saved:
            diffs.append(f"{key}: missing in checkpoint")
            continue
        if key not in wanted:
            diffs.append(f"{key}: in checkpoint but not in target")
            continue
        s_shape = tuple(getattr(saved[key], "shape", np.shape(saved[key])))
        w_shape = tuple(np.shape(wanted[key]))
        if s_shape != w_shape:
            diffs.append(f"{key}: saved shape {s_shape}, expected {w_shape}")
            continue
        s_dtype = getattr(saved[key], "dtype", None)
        w_dtype = getattr(wanted[key], "dtype", None)
        if s_dtype is not None and w_dtype is not None and np.dtype(s_dtype) != np.dtype(w_dtype):
            diffs.append(f"{key}: saved dtype {np.dtype(s_dtype)}, expected {np.dtype(w_dtype)}")
    return diffs


def _is_prng_key(x: Any) -> bool:
    return hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _unwrap_keys(tree: Any) -> tuple[Any, dict[str, str]]:
    """Replaces typed PRNG-key leaves by their key data; returns {keystr(path): impl name}."""
    key_impls: dict[str, str] = {}

    def unwrap(path, x):
        if _is_prng_key(x):
            key_impls[jax.tree_util.keystr(path)] = str(jax.random.key_impl(x))
            return jax.random.key_data(x)
        return x

    return jax.tree_util.tree_map_with_path(unwrap, tree), key_impls


def _rewrap_keys(tree: Any, key_impls: Mapping[str, str]) -> Any:
    def rewrap(path, x):
        impl = key_impls.get(jax.tree_util.keystr(path))
        return jax.random.wrap_key_data(jnp.asarray(x), impl=impl) if impl else x

    return jax.tree_util.tree_map_with_path(rewrap, tree)


def _abstract(tree: Any) -> Any:
    """Arrays -> ShapeDtypeStruct keeping their sharding; typed keys -> their key data's."""

    def to_abstract(x):
        if _is_prng_key(x):
            x = jax.eval_shape(jax.random.key_data, x)
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        if isinstance(x, (np.ndarray, np.generic, int, float, bool)):
            arr = np.asarray(x)
            return jax.ShapeDtypeStruct(arr.shape, arr.dtype)
        return x

    return jax.tree.map(to_abstract, tree)


def _to_savable(tree: Any) -> Any:
    """Python scalars -> numpy scalars so every leaf has a shape and dtype."""
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, (int, float, bool)) else x, tree)


# ----------------------------------------------------------------------------- manager


class Checkpointer:
    """Saves/restores (TrainState, extras, config) with an orbax `CheckpointManager`.

    Keeps the newest `max_to_keep` steps. Saves are synchronous unless `async_save=True`
    (then call `wait_until_finished()` before relying on the files).
    """

    def __init__(
        self, directory: str | os.PathLike, max_to_keep: int = 3, async_save: bool = False
    ):
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(os.fspath(directory))
        self._async = async_save
        self._pending: list[int] = []   # saved steps whose checksums are not written yet
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
            ),
        )

    # -- queries
    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def wait_until_finished(self) -> None:
        self._manager.wait_until_finished()
        self._write_pending_checksums()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._write_pending_checksums()
        self._manager.close()

    def _remove_partial(self, step: int) -> None:
        """Removes the temporary folder of a failed save of ``step`` (frees its space),
        once orbax's threads for it have ended."""
        with contextlib.suppress(Exception), _noise.catching():
            self._manager.wait_until_finished()
        if jax.process_index() != 0 or not os.path.isdir(self.directory):
            return
        for attempt in range(_REMOVE_TRIES):   # a late tensorstore write may recreate a file
            partial = [name for name in os.listdir(self.directory)
                       if name.startswith(f"{step}.orbax-checkpoint-tmp")]
            if not partial:
                return
            if attempt:
                time.sleep(_REMOVE_WAIT_S)
            for name in partial:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(int(step)))

    def damage(self, step: int) -> str | None:
        """Why step ``step`` fails its checksums (`checkpoint_integrity.find_damage`), or None."""
        return integrity.find_damage(self.step_dir(step))

    def verify(self, step: int) -> None:
        """Raises `CheckpointCorruptError` naming the file when the step's bytes changed."""
        why = self.damage(step)
        if why is not None:
            raise self._corrupt(step, why)

    def _write_pending_checksums(self) -> None:
        for step in self._pending:
            if jax.process_index() == 0 and os.path.isdir(self.step_dir(step)):
                integrity.write_checksums(self.step_dir(step))
        self._pending = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- save
    def save(
        self,
        step: int,
        train_state: Any,
        extras: Mapping[str, Any] | None = None,
        config: Any = None,
    ) -> None:
        """Writes one checkpoint at `step` (atomically; an existing step raises FileExistsError)."""
        if int(step) in self._manager.all_steps():
            raise FileExistsError(f"checkpoint step {step} already exists in {self.directory}")
        extras = dict(extras or {})
        for name in extras:
            if not name.isidentifier():
                raise ValueError(f"extras key {name!r} must be a Python identifier")
        bad = integrity.non_finite_leaves(train_state)
        if bad:
            previous = self.all_steps()
            raise NonFiniteStateError(
                f"checkpoint step {step} was not written: the train state holds NaN/inf (in "
                f"{', '.join(bad)}); the last finite checkpoint is "
                f"{f'step {previous[-1]}' if previous else 'none'} in {self.directory}")
        items: dict[str, Any] = {_TRAIN_STATE: ocp.args.StandardSave(_to_savable(train_state))}
        key_impls = {}
        for name, tree in extras.items():
            tree, key_impls[name] = _unwrap_keys(tree)
            # Wrapped in a dict: orbax's StandardSave refuses a bare array / scalar item.
            items[_EXTRA_PREFIX + name] = ocp.args.StandardSave({"tree": _to_savable(tree)})
        items[_CONFIG] = ocp.args.JsonSave(to_json_config(config if config is not None else {}))
        items[_MANIFEST] = ocp.args.JsonSave({
            "extras": sorted(extras), "prng_keys": key_impls,
            "format_version": CHECKPOINT_FORMAT_VERSION})
        previous = self.all_steps()
        try:
            with _noise.catching():
                if not self._manager.save(int(step), args=ocp.args.Composite(**items)):
                    raise RuntimeError(f"orbax declined to save step {step} in {self.directory}")
                self._pending.append(int(step))
                if not self._async:
                    self.wait_until_finished()
        except (OSError, ValueError) as error:   # tensorstore reports ENOSPC/EFBIG as ValueError
            self._remove_partial(int(step))
            raise CheckpointWriteError(
                f"checkpoint step {step} could not be written to {self.directory} "
                f"({type(error).__name__}: {error}); the previous checkpoints {previous} "
                "are intact", step=int(step)
            ) from error

    # -- restore
    def read_config(self, step: int | None = None) -> dict[str, Any]:
        step = self._resolve_step(step)
        return self._manager.restore(
            step, args=ocp.args.Composite(**{_CONFIG: ocp.args.JsonRestore()})
        )[_CONFIG]

    def restore(
        self,
        train_state_target: Any,
        extras_targets: Mapping[str, Any] | None = None,
        expected_config: Any = None,
        step: int | None = None,
    ) -> RestoredCheckpoint:
        """Restores a checkpoint onto the shardings of the given targets.

        Args:
            train_state_target: pytree of arrays or `jax.ShapeDtypeStruct`s (with the sharding to
                restore onto) with the structure of the saved train state.
            extras_targets: optional {name: target pytree}; extras not named here are restored
                as saved (host numpy arrays). Names not in the checkpoint raise.
            expected_config: if given, the saved JSON config must equal it, else
                `CheckpointMismatchError` names each differing key.
            step: the step to restore; the latest when None.
        """
        step = self._resolve_step(step)
        self.verify(step)
        with self._readable(step):
            json_items = self._manager.restore(
                step,
                args=ocp.args.Composite(
                    **{_CONFIG: ocp.args.JsonRestore(), _MANIFEST: ocp.args.JsonRestore()}
                ),
            )
        saved_config, manifest = json_items[_CONFIG], json_items[_MANIFEST]
        if manifest is None:
            raise self._corrupt(step, "its manifest is missing")
        version = manifest.get("format_version", 1)
        if version > CHECKPOINT_FORMAT_VERSION:
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} was written by a newer spopp-jax "
                f"(checkpoint format {version}, this build reads up to "
                f"{CHECKPOINT_FORMAT_VERSION}); upgrade spopp-jax to resume it"
            )
        if expected_config is not None:
            diffs = config_differences(saved_config, expected_config)
            if diffs:
                raise CheckpointMismatchError(
                    f"checkpoint step {step} in {self.directory} was saved with a different config:\n  "
                    + "\n  ".join(diffs)
                )
        extras_targets = dict(extras_targets or {})
        unknown = sorted(set(extras_targets) - set(manifest["extras"]))
        if unknown:
            raise CheckpointMismatchError(
                f"checkpoint step {step} has no extras {unknown}; it has {manifest['extras']}"
            )

        state_target = _abstract(train_state_target)
        diffs = shape_differences(self._train_state_metadata(step), state_target)
        if diffs:
            raise CheckpointMismatchError(
                f"checkpoint step {step} train_state does not match the target "
                f"({len(diffs)} differences):\n  " + "\n  ".join(_first(diffs, 20))
            )

        items: dict[str, Any] = {_TRAIN_STATE: ocp.args.StandardRestore(state_target)}
        for name in manifest["extras"]:
            target = extras_targets.get(name)
            items[_EXTRA_PREFIX + name] = ocp.args.StandardRestore(
                None if target is None else {"tree": _abstract(target)}
            )
        with self._readable(step):
            restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        extras = {
            name: _rewrap_keys(
                restored[_EXTRA_PREFIX + name]["tree"], manifest["prng_keys"].get(name, {})
            )
            for name in manifest["extras"]
        }
        return RestoredCheckpoint(step, restored[_TRAIN_STATE], extras, saved_config)

    def _corrupt(self, step: int, why: str) -> CheckpointCorruptError:
        older = [s for s in self.all_steps() if s < step]
        hint = f"; restore an older one with step={older[-1]}" if older else ""
        return CheckpointCorruptError(
            f"checkpoint step {step} in {self.directory} is unreadable: {why}{hint}"
        )

    @contextlib.contextmanager
    def _readable(self, step: int):
        """Turns the storage layer's errors on a damaged step folder (truncated files,
        missing items) into `CheckpointCorruptError` naming the step."""
        try:
            yield
        except (CheckpointMismatchError, FileNotFoundError) as error:
            if isinstance(error, CheckpointMismatchError):
                raise
            raise self._corrupt(step, f"{type(error).__name__}: {error}") from error
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            raise self._corrupt(step, f"{type(error).__name__}: {error}") from error

    def _train_state_metadata(self, step: int) -> Any:
        """Shapes/dtypes of the saved train state, read from disk (also in a fresh process,
        where the manager has no handler registered for the item yet)."""
        path = epath.Path(self.directory) / str(step) / _TRAIN_STATE
        return _tree_of(ocp.StandardCheckpointHandler().metadata(path))

    def _resolve_step(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
        elif step not in self._manager.all_steps():
            raise FileNotFoundError(
                f"no checkpoint step {step} in {self.directory}; have {self.all_steps()}"
            )
        return int(step)


def _first(lines: list[str], limit: int) -> list[str]:
    return lines if len(lines) <= limit else lines[:limit] + [f"... and {len(lines) - limit} more"]


def _tree_of(metadata: Any) -> Any:
    """The pytree inside an orbax item metadata object (API differs across versions)."""
    return getattr(metadata, "tree", metadata)
