"""Checksums of a checkpoint step's files, and the finiteness of what a step holds.

Orbax finalizes a step by renaming its temporary folder, so a step folder is complete
when it exists; it cannot tell whether the bytes were later damaged (a flipped bit, a
truncated copy). After the rename, `write_checksums` records the SHA-256 and size of every
file of the step in ``<step>/checksums.json`` (written to a temporary name and renamed);
`find_damage` recomputes them and names the first file that differs, is missing or is
truncated. A step without ``checksums.json`` (written before checksums existed, or killed
between orbax's rename and ours) is reported as unverified, not as damaged: its data is
orbax-complete.

`non_finite_leaves` names the floating-point leaves of a pytree holding NaN or ±inf, so
that no non-finite state is saved as a checkpoint or exported as a model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

CHECKSUM_FILE = "checksums.json"
CHECKSUM_FORMAT = 1
_BLOCK = 1 << 20


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def _data_files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE
                  and not p.name.startswith(f".{CHECKSUM_FILE}"))


def step_checksums(step_dir: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """{relative path: {"sha256", "bytes"}} of every file under ``step_dir``."""
    step_dir = Path(step_dir)
    return {str(p.relative_to(step_dir)): {"sha256": file_sha256(p), "bytes": p.stat().st_size}
            for p in _data_files(step_dir)}


def write_checksums(step_dir: str | os.PathLike) -> Path:
    """Writes ``<step_dir>/checksums.json`` atomically (temporary file, fsync, rename)."""
    step_dir = Path(step_dir)
    record = {"format": CHECKSUM_FORMAT, "files": step_checksums(step_dir)}
    target = step_dir / CHECKSUM_FILE
    tmp = step_dir / f".{CHECKSUM_FILE}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return target


def has_checksums(step_dir: str | os.PathLike) -> bool:
    return (Path(step_dir) / CHECKSUM_FILE).is_file()


def find_damage(step_dir: str | os.PathLike) -> str | None:
    """Why ``step_dir`` does not match its ``checksums.json`` (the first differing file,
    missing, truncated, or other bytes), or None when every recorded file matches. A step
    without the file returns None (see `has_checksums`)."""
    step_dir = Path(step_dir)
    record_path = step_dir / CHECKSUM_FILE
    if not record_path.is_file():
        return None
    try:
        files = json.loads(record_path.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"{CHECKSUM_FILE} is unreadable ({type(error).__name__})"
    for name, expected in sorted(files.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, {expected['bytes']} were written (truncated or overwritten)"
        if file_sha256(path) != expected["sha256"]:
            return f"{name} does not match its checksum (its bytes changed after the save)"
    return None


def non_finite_leaves(tree: Any, limit: int = 5) -> list[str]:
    """Paths of the floating-point leaves of ``tree`` that hold a NaN or ±inf (at most
    ``limit``; typed PRNG keys and integer leaves are skipped)."""
    import jax
    import jax.numpy as jnp

    bad = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if not bool(jnp.isfinite(leaf).all()):
            bad.append(jax.tree_util.keystr(path))
            if len(bad) >= limit:
                break
    return bad
