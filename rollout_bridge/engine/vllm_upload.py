"""Policy weights over HTTP, for a vLLM server that shares no filesystem with the trainer.

The trainer writes a policy folder as always (`vllm_weights.write_policy_folder`, on its
own disk); a server started with ``python -m rollout_bridge.serve`` then receives that
folder's files over HTTP into a folder of its own (its ``--weights-dir``, memory-backed
``/dev/shm`` by default), and the worker extension loads it from there with the same RPC
as a shared folder (``spopp_load_policy(folder, event)``, which checks the marker).

Protocol (both routes live on the vLLM server's own port):

* ``PUT /spopp/policy/{event}/files/{name}``: the raw bytes of one file of the folder
  (streamed to disk as they arrive, never held whole in memory);
* ``POST /spopp/policy/{event}/commit`` with ``{"files": {name: size}}``: the server
  checks that every file arrived with its size, writes the ``spopp_policy.json`` marker
  and renames the staging folder to ``policy-<event>`` (atomic: a reader sees no folder
  or a complete one), keeps the newest ``keep`` folders, and answers
  ``{"folder": <its path>, "policy_event": event}``.

The upload happens while the server keeps serving; only the load itself runs under the
fleet's pause (in-flight publish) or drain. `PolicyInbox` is the server side (standard
library only: it runs inside vLLM's environment and in the stand-in test server);
`upload_policy` the client side (httpx, in the trainer).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, AsyncIterator, Iterable, Mapping

from rollout_bridge.engine.vllm_worker_ext import POLICY_MARKER

ROUTE_PREFIX = "/spopp/policy"
COMMIT_ROUTE = ROUTE_PREFIX + "/{policy_event}/commit"  # as listed in the server's /openapi.json
FILE_ROUTE = ROUTE_PREFIX + "/{policy_event}/files/{name}"
CHUNK_BYTES = 8 << 20
STAGING_PREFIX = ".incoming-"
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_FOLDER_RE = re.compile(r"^policy-(\d{8,})$")


class UploadError(ValueError):
    """A refused upload (bad name or event, a missing or short file)."""


def check_file_name(name: str) -> str:
    """``name`` if it is a plain file name (no folder part, no leading dot)."""
    if not _NAME_RE.match(name) or ".." in name:
        raise UploadError(f"refused file name {name!r}: letters, digits, '_', '-', '.' only, no leading dot")
    return name


def check_policy_event(value: Any) -> int:
    try:
        event = int(value)
    except (TypeError, ValueError):
        raise UploadError(f"policy event must be an integer, got {value!r}") from None
    if event < 0:
        raise UploadError(f"policy event must be >= 0, got {event}")
    return event


class PolicyInbox:
    """The server side: policy folders received over HTTP under ``root``."""

    def __init__(self, root: str, keep: int = 2):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.root = os.path.abspath(root)
        self.keep = keep
        os.makedirs(self.root, exist_ok=True)

    def folder(self, policy_event: int) -> str:
        return os.path.join(self.root, f"policy-{check_policy_event(policy_event):08d}")

    def staging(self, policy_event: int) -> str:
        return os.path.join(self.root, f"{STAGING_PREFIX}policy-{check_policy_event(policy_event):08d}")

    def write_file(self, policy_event: int, name: str, chunks: Iterable[bytes]) -> int:
        """Write one file of ``policy_event``'s folder from ``chunks``; returns its size."""
        path = self._file_path(policy_event, name)
        size = 0
        with open(path, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                size += len(chunk)
        return size

    def open_file(self, policy_event: int, name: str):
        """A binary file to write ``name`` of ``policy_event``'s folder into (async servers
        write chunk by chunk themselves)."""
        return open(self._file_path(policy_event, name), "wb")

    def _file_path(self, policy_event: int, name: str) -> str:
        staging = self.staging(policy_event)
        os.makedirs(staging, exist_ok=True)
        return os.path.join(staging, check_file_name(name))

    def commit(self, policy_event: int, sizes: Mapping[str, int]) -> str:
        """Check the staged files against ``sizes``, mark and publish the folder; returns
        its path. A second commit of the same event replaces the first (a retried upload)."""
        event = check_policy_event(policy_event)
        staging = self.staging(event)
        if not sizes:
            raise UploadError("commit lists no files")
        for name, size in sizes.items():
            path = os.path.join(staging, check_file_name(name))
            if not os.path.isfile(path):
                raise UploadError(f"policy {event}: {name} was not uploaded")
            if os.path.getsize(path) != int(size):
                raise UploadError(f"policy {event}: {name} has {os.path.getsize(path)} bytes, expected {size}")
        with open(os.path.join(staging, POLICY_MARKER), "w") as f:
            json.dump({"policy_event": event}, f)
        final = self.folder(event)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(staging, final)
        self.prune(protect=event)
        return final

    def prune(self, protect: int) -> list[int]:
        """Remove all but the newest ``keep`` published folders (never ``protect``), and
        the staging folders of uploads older than ``protect`` that never committed (the
        trainer died or dropped this server mid-upload)."""
        names = os.listdir(self.root)
        events = sorted(int(m.group(1)) for m in map(_FOLDER_RE.match, names) if m)
        removed = [k for k in events[:-self.keep] if k != protect]
        for k in removed:
            shutil.rmtree(self.folder(k), ignore_errors=True)
        for name in names:
            match = _FOLDER_RE.match(name[len(STAGING_PREFIX):]) if name.startswith(STAGING_PREFIX) else None
            if match and int(match.group(1)) < protect:
                shutil.rmtree(os.path.join(self.root, name), ignore_errors=True)
        return removed


# ------------------------------------------------------------------ the client (trainer side)


def folder_files(folder: str) -> dict[str, int]:
    """{name: size} of the files a server needs from a policy folder (not the marker: the
    server writes its own at commit)."""
    return {name: os.path.getsize(os.path.join(folder, name)) for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name)) and name != POLICY_MARKER and not name.startswith(".")}


async def _file_chunks(path: str) -> AsyncIterator[bytes]:
    import asyncio

    with open(path, "rb") as f:
        while True:
            chunk = await asyncio.to_thread(f.read, CHUNK_BYTES)
            if not chunk:
                return
            yield chunk


async def upload_policy(client: Any, url: str, folder: str, policy_event: int, timeout_s: float) -> str:
    """Send ``folder`` (a published policy folder) to the server at ``url`` as
    ``policy_event``; returns the folder's path ON THE SERVER. ``client``: an
    ``httpx.AsyncClient``. Raises ``httpx.HTTPError`` when the server refuses or fails."""
    sizes = folder_files(folder)
    event = check_policy_event(policy_event)
    for name, size in sizes.items():
        response = await client.put(f"{url}{ROUTE_PREFIX}/{event}/files/{name}",
                                    content=_file_chunks(os.path.join(folder, name)),
                                    headers={"Content-Length": str(size)}, timeout=timeout_s)
        response.raise_for_status()
    response = await client.post(f"{url}{ROUTE_PREFIX}/{event}/commit", json={"files": sizes}, timeout=timeout_s)
    response.raise_for_status()
    return str(response.json()["folder"])


__all__ = [
    "COMMIT_ROUTE",
    "FILE_ROUTE",
    "PolicyInbox",
    "ROUTE_PREFIX",
    "UploadError",
    "check_file_name",
    "check_policy_event",
    "folder_files",
    "upload_policy",
]
