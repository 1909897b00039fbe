"""Finished evaluations of a fixed policy, kept across runs (``prior.cache_dir``) and shipped
beside a policy (``<policy folder>/evaluations``).

The offline prior and the evaluations before RL play the initial policy only, and with
common random numbers (``rollout_successes(crn_seed=...)``) what they play is fixed by
their key: the policy's content (``policy_digest``), the task sets' content
(``tasks_digest``), the agent, sampling and engine settings, the seed and the number of
episodes. A second run with the same key (another ``output_dir``, other RL settings) reads
the record instead of playing the episodes again. ``EVALUATION_SCHEME`` is part of every
key: bump it when the code changes which episodes an evaluation plays, so records of the
old scheme are never read.

One JSON file per key, ``<folder>/<kind>-<sha256 of the key>.json``, holding the record
and its key; a file whose key differs or that does not parse is ignored (and rewritten
in the cache after the evaluation). ``find_record`` looks in the cache first, then in the
policy's own ``evaluations`` folder: records measured once for a shipped policy (the main
job's warm start), read only under the very same key, so a machine whose games came out
differently (another textworld, another generator) plays the episodes itself.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Sequence

from rollout_bridge.atomic_files import write_json_atomic
from rollout_bridge.run_folder import WARMSTART_RECORD_NAME, folder_digest

EVALUATION_SCHEME = "common random numbers 1"   # derived_seed(evaluation seed, task, round)
SHIPPED_RECORDS = "evaluations"   # <policy folder>/evaluations/<kind>-<hash>.json: records shipped with a policy


def cache_file(cache_dir: str | os.PathLike, kind: str, key: dict) -> Path:
    """Where the record of ``key`` lives: ``<cache_dir>/<kind>-<sha256 prefix>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return Path(cache_dir) / f"{kind}-{digest}.json"


def read_cached(cache_dir: str | os.PathLike | None, kind: str, key: dict) -> dict | None:
    """The cached record of ``key`` (without its key), or None: no cache, no file, a file
    that does not parse or one written for another key."""
    if cache_dir is None:
        return None
    path = cache_file(cache_dir, kind, key)
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(stored, dict) or stored.get("key") != key or "record" not in stored:
        return None
    return stored["record"]


def write_cached(cache_dir: str | os.PathLike | None, kind: str, key: dict, record: dict) -> Path | None:
    """Keep ``record`` for ``key`` (atomically); None when there is no cache."""
    if cache_dir is None:
        return None
    return write_json_atomic(cache_file(cache_dir, kind, key), {"key": key, "record": record})


def policy_digest(policy: str | os.PathLike) -> str:
    """The policy's content: every file of its folder but its notes (README.md, the warm
    start's record) and the records shipped beside it, which do not change what it plays."""
    return folder_digest(Path(policy), skip=(WARMSTART_RECORD_NAME, "README.md", SHIPPED_RECORDS))


def tasks_digest(tasks: Any, task_ids: Sequence[int] | None = None) -> str | None:
    """The content of a task set's tasks ``task_ids`` (None: all, in task order): its games
    (each task's name and game, ``game_files_digest``: the same seeds give the same digest on
    every machine), or the problems it holds in memory (Math-TIR: each one's prompt, ground
    truth and key, read from ``env.data_dir`` or drawn from seeds); None for a set of neither
    kind (its tasks are made by code from the keyed settings)."""
    files = getattr(tasks, "game_files", None)
    if files is not None:
        from rollout_bridge.envs.textworld_games import game_files_digest

        if task_ids is None:
            return game_files_digest(tasks.task_names, files)
        return game_files_digest([tasks.task_names[i] for i in task_ids], [files[i] for i in task_ids])
    problems = getattr(tasks, "tasks", None)
    if not isinstance(problems, Sequence):
        return None
    ids = range(len(problems)) if task_ids is None else task_ids
    if not all(dataclasses.is_dataclass(problems[i]) for i in ids):
        return None
    text = json.dumps([dataclasses.asdict(problems[i]) for i in ids], sort_keys=True)
    return hashlib.sha1(text.encode()).hexdigest()


def key_differences(key: Any, other: Any, prefix: str = "") -> list[str]:
    """The dotted fields in which two keys differ ("tasks", "env.max_turns", ...)."""
    if not (isinstance(key, dict) and isinstance(other, dict)):
        return [] if key == other else [prefix or "key"]
    differences = []
    for field in sorted(set(key) | set(other)):
        name = f"{prefix}.{field}" if prefix else field
        if field not in key or field not in other:
            differences.append(name)
        else:
            differences += key_differences(key[field], other[field], name)
    return differences


@dataclasses.dataclass(frozen=True)
class Found:
    """What ``find_record`` found: ``record`` (None: play the episodes) and ``line``, what
    to log: which record is used, or why the policy's shipped record is not (None: there
    is none to mention)."""

    record: dict | None
    line: str | None


def find_record(cache_dir: str | os.PathLike | None, policy: str | os.PathLike, kind: str, key: dict) -> Found:
    """The record of ``key``: from ``cache_dir`` (an earlier run on this machine), else from
    the policy's ``evaluations`` folder (shipped with it), else none, with the line that
    says so (naming, when the policy ships a record of this kind, the key fields in which
    it differs: e.g. ``tasks``, games generated differently on this machine)."""
    record = read_cached(cache_dir, kind, key)
    if record is not None:
        return Found(record, f"reusing {cache_file(cache_dir, kind, key)} from an earlier run")
    shipped = Path(policy) / SHIPPED_RECORDS
    record = read_cached(shipped, kind, key)
    if record is not None:
        return Found(record, f"reusing {cache_file(shipped, kind, key)}, shipped with the policy "
                             "(same settings and games)")
    differences = []
    for path in sorted(shipped.glob(f"{kind}-*.json")):
        try:
            other = json.loads(path.read_text()).get("key")
        except (OSError, ValueError, AttributeError):
            continue
        found = key_differences(key, other)
        if not differences or len(found) < len(differences):
            differences = found
    if differences:
        return Found(None, f"not reusing the record shipped in {shipped}: it was measured with other "
                           f"{', '.join(differences[:4])}{' ...' if len(differences) > 4 else ''}")
    return Found(None, None)
