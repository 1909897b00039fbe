"""Files written whole or not at all: a reader sees the old file or the new one, never a part.

Every record the project keeps across processes (priors, evaluation caches, game sets,
metrics, stored programs) is written here: into a temporary file of the writer's own in
the same folder (two processes writing one file at once never share it), flushed to disk,
then renamed over the target; a failed write removes its temporary file.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` whole or not at all (see the module docstring)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask's mode, as open() gives
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """``text`` as UTF-8, written by `write_bytes_atomic`."""
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, record: dict) -> Path:
    """``record`` as indented JSON, written by `write_text_atomic`."""
    return write_text_atomic(path, json.dumps(record, indent=1))
