"""A job's run folder (``RunPaths``), its log line, and the keys that decide whether a
stage's output in it is reused: a stage reuses its output only when the settings it
depends on (``stage_key``) are unchanged."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from rollout_bridge.run_errors import UserError

WARMSTART_RECORD_NAME = "warmstart.json"


@dataclasses.dataclass(frozen=True)
class RunPaths:
    root: Path

    warmstart_model = property(lambda self: self.root / "warmstart_model")
    warmstart_record = property(lambda self: self.root / "warmstart_model" / WARMSTART_RECORD_NAME)
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
# they change: rollout.pack_rows (how learner rows are packed, not what is trained),
# prior.cache_dir, env.blind_control (a finished run read for the report only), model.remat.
# The rollout engine is keyed by its `record_key` (rollout_bridge/engine/choice.py): its name
# and the flat fields records were first written with, not where the rollouts run.
UNKEYED_FIELDS = {"rollout": ("pack_rows",), "prior": ("cache_dir",),
                  "env": ("blind_control",), "model": ("remat",)}
# Fields renamed after keys were first written are keyed under their first names, so the
# records (priors, evaluation caches, checkpoints) written before the rename stay valid.
KEYED_AS = {"rollout": {"max_in_flight": "max_inflight", "max_total_tokens": "max_seq_len"},
            "advantage": {"whiten_eps": "eps"}}
# How the RL loop receives results: a fixed policy's episodes (the prior, the evaluations,
# the yardstick, all played by `success_rollouts`, not the orchestrator) do not depend on it,
# so their records key these fields at their defaults and runs at any value share them.
RECEIPT_FIELDS = {"rollout": {"result_delay_s": 0.0}}
# How many decode steps the embedded engine runs per host round trip: a request's tokens
# depend on its seed and their positions only (tests/test_jax_engine.py), so a fixed policy's
# episodes do not depend on it either, and their records key it at the value they were first
# written with. RL checkpoints key the value in use: it decides when an in-flight publish lands.
DECODE_CHUNK_FIELDS = {"rollout": {"engine_steps_per_call": 8}}
# How the learner lays out its batches: a fixed policy's episodes do not depend on it either,
# so their records key it at the value it had when records were first written (the shipped
# warm start's prior and evaluation among them) and every layout shares them.
LEARNER_LAYOUT_FIELDS = {"rollout": {"pad_to_multiple": 256}}


def stage_key(cfg, *sections: str) -> dict:
    """The settings an output depends on (reuse it only if they are unchanged; the
    ``UNKEYED_FIELDS`` are left out). ``warmstart.group_by_length`` (added after keys
    were first written) is keyed only where it changes an output, a warm start that is
    trained with it on; so records written before it existed stay valid. ``env.rename_episodes``
    (added later too) is keyed only when it is not 0; ``env.alfred_filter`` and
    ``env.alfred_floor_plans`` only when on for generated ALFWorld games (the only games they
    change; with both off those games are the ones made before they existed): the env kind's
    ``record_key`` (rollout_bridge/envs/kinds/base.py)."""
    key = {name: json.loads(json.dumps(dataclasses.asdict(getattr(cfg, name)))) for name in sections}
    if "rollout" in key:
        key["rollout"].update(cfg.rollout.engine.record_key())   # replaces the engine's section
    if "env" in key:
        key["env"] = json.loads(json.dumps(cfg.env.record_key()))   # the layout records were first written in
    for name, fields in UNKEYED_FIELDS.items():
        for field in fields:
            key.get(name, {}).pop(field, None)
    for name, renamed in KEYED_AS.items():
        for field, first_name in renamed.items():
            if field in key.get(name, {}):
                key[name][first_name] = key[name].pop(field)
    if "warmstart" in key and not (cfg.warmstart.enabled and cfg.warmstart.group_by_length):
        key["warmstart"].pop("group_by_length", None)
    return key


def fixed_policy_key(cfg, *sections: str) -> dict:
    """``stage_key`` for records of a fixed policy's episodes: the ``RECEIPT_FIELDS``, the
    ``DECODE_CHUNK_FIELDS`` and the ``LEARNER_LAYOUT_FIELDS`` at the values records were first
    written with (so those records stay valid)."""
    key = stage_key(cfg, *sections)
    for name, fields in (*RECEIPT_FIELDS.items(), *DECODE_CHUNK_FIELDS.items(), *LEARNER_LAYOUT_FIELDS.items()):
        if name in key:
            key[name].update({field: value for field, value in fields.items() if field in key[name]})
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
    """A folder with checkpoints is a run's: any stage started there without ``--resume``
    (whose settings check keeps its warm start, prior and checkpoints consistent) is refused,
    a ``--stage warmstart`` or ``--stage prior`` with other settings included (it would
    replace the warm start or prior that run's checkpoints and exports were made from)."""
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



def folder_digest(folder: Path, skip: tuple[str, ...] = (WARMSTART_RECORD_NAME,)) -> str:
    """sha1 over every file under `folder` (relative path and bytes, in sorted order) but
    those with a name in `skip` or inside a folder of such a name."""
    digest = hashlib.sha1()
    kept = lambda path: path.is_file() and not set(path.relative_to(folder).parts) & set(skip)
    for path in sorted(p for p in Path(folder).rglob("*") if kept(p)):
        digest.update(str(path.relative_to(folder)).encode())
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
