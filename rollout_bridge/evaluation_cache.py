"""Finished evaluations of a fixed policy, kept across runs (``prior.cache_dir``).

The offline prior and the evaluations before RL play the initial policy only, and with
common random numbers (``rollout_successes(crn_seed=...)``) what they play is fixed by
their key: the policy's content, the task sets, the agent, sampling and engine settings,
the seed and the number of episodes. A second run with the same key (another
``output_dir``, other RL settings) reads the record instead of playing the episodes
again. ``EVALUATION_SCHEME`` is part of every key: bump it when the code changes which
episodes an evaluation plays, so records of the old scheme are never read.

One JSON file per key, ``<cache_dir>/<kind>-<sha256 of the key>.json``, holding the
record and its key; a file whose key differs or that does not parse is ignored (and
rewritten after the evaluation).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from rollout_bridge.prior import write_json_atomic

EVALUATION_SCHEME = "common random numbers 1"   # derived_seed(evaluation seed, task, round)


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
