"""The vLLM rollout servers of one ``train.py`` job (``rollout.engine: vllm_server``).

One `RolloutServers` lives for the whole job; every stage that rolls out (the prior, the
evaluations, RL) gets its own `VllmFleetEngine` over the same servers from
`RolloutServers.engine(model, policy_event, ...)`:

* servers: ``rollout.engine.server_urls`` (running elsewhere: never started or stopped here)
  or ``rollout.engine.launch.count`` local ``vllm serve`` processes (`VllmServerLauncher`):
  started from the job's initial policy folder, ``wait_ready``, watched every
  ``health_interval_s`` (a dead one is restarted on its port, or dropped after
  ``max_restarts``), stopped at ``close`` (also at interpreter exit). Logs go to
  ``<run>/rollout_servers/logs/server-<i>.log``; ``<run>/rollout_servers/servers.json``
  lists each server's url, pid, state and restarts (rewritten on every restart / drop).
* weights: the filesystem publish (`vllm_weights.write_policy_folder`: HF safetensors and
  a policy-event marker); a server started with ``python -m rollout_bridge.serve`` (no
  shared filesystem needed) gets each folder's files over HTTP first (`vllm_upload`,
  ``weights_transport``). Each engine writes its stage's model as ``policy-<k>`` into a
  folder of its own, ``<run>/rollout_servers/weights/engine-<n>``, and the servers load
  it before the stage's first request. A new engine first makes every server forget the
  policy event the previous engine installed: stages reuse event numbers (the prior and
  RL both start at event 0) with possibly other weights, and a server holding the same
  event would otherwise skip the load. An RL publish (``publish_inflight``: pause "keep",
  reload, resume) writes the next folder on a worker thread from the learner's
  un-donated parameter snapshot (``PolicyLearner(snapshot_weights=True)``), so the
  learner's next step runs during the export and the install.
* metrics (`metrics`, one row per update): launcher restarts / drops, and of the newest
  engine the servers lost / rejoined, retried / failed requests, the latest publish's
  export and install seconds, the folders uploaded over HTTP and the latest upload's
  seconds.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import threading
import urllib.error
import urllib.request
from typing import Any, Callable, ClassVar, Literal, Optional

from rollout_bridge.engine.choice import EngineConfig, check as _check, check_vllm_temperature
from rollout_bridge.engine.vllm_fleet import VllmFleetConfig, VllmFleetEngine, VllmServerSpec
from rollout_bridge.engine.vllm_launcher import ServerLaunch, ServerLaunchConfig, VllmServerLauncher
from rollout_bridge.engine.vllm_worker_ext import UNKNOWN_POLICY_EVENT

logger = logging.getLogger(__name__)

SERVERS_DIR = "rollout_servers"  # under the run folder
FORGET_TIMEOUT_S = 30.0

LauncherFactory = Callable[[ServerLaunchConfig, str, str], Any]  # (config, model_dir, log_dir) -> launcher


def parse_server_urls(text: str) -> tuple[str, ...]:
    """``rollout.engine.server_urls`` ("http://a:8000, http://b:8000") as a tuple of URLs."""
    urls = tuple(u.strip().rstrip("/") for u in text.split(",") if u.strip())
    if not urls:
        raise ValueError(f"rollout.engine.server_urls lists no URL: {text!r}")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout.engine.server_urls: {url!r} must start with http:// or https://")
    return urls


@dataclasses.dataclass(frozen=True)
class ServerFleet:
    """The fleet's settings of ``rollout.engine: vllm_server``. ``capacity``: requests sent
    to one server at once. ``health_interval_s``: how often dead servers are looked for
    (restarted by the launcher, taken out of / back into rotation by the fleet).
    ``outage_wait_s``: when no server is in rotation, how long a request waits for one to
    come back before it fails (0: at once; remote servers restarted by hand need minutes).
    ``weights_transport``: how published weights reach a server: "path" (it reads the
    trainer's folder: shared filesystem), "http" (uploaded to a server started with
    ``python -m rollout_bridge.serve``), "auto" (http where the server offers it)."""

    capacity: int = 8
    health_interval_s: float = 5.0
    outage_wait_s: float = 0.0
    weights_transport: Literal["auto", "path", "http"] = "auto"

    def __post_init__(self):
        _check(self.capacity > 0, "rollout.engine.capacity", "> 0", self.capacity)
        _check(self.health_interval_s > 0, "rollout.engine.health_interval_s", "> 0", self.health_interval_s)
        _check(math.isfinite(self.outage_wait_s) and self.outage_wait_s >= 0, "rollout.engine.outage_wait_s",
               "finite and >= 0", self.outage_wait_s)
        _check(self.weights_transport in ("auto", "path", "http"), "rollout.engine.weights_transport",
               "one of ['auto', 'path', 'http']", self.weights_transport)


@dataclasses.dataclass(frozen=True)
class RolloutServersConfig(ServerFleet):
    """The fleet's settings (`ServerFleet`) and what the job sets (``metadata["from"]``):
    run_dir, the job's run folder (logs, weights and servers.json go under
    ``<run_dir>/rollout_servers``), and exactly one of ``urls`` (running servers) and
    ``launch`` (servers to start)."""

    run_dir: str = dataclasses.field(default="", metadata={"from": "output_dir (the job's run folder)"})
    urls: tuple[str, ...] = dataclasses.field(default=(), metadata={"from": "rollout.engine.server_urls"})
    launch: ServerLaunchConfig | None = dataclasses.field(default=None, metadata={
        "from": "rollout.engine.launch with rollout.engine.capacity and rollout.max_total_tokens"})

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "urls", tuple(self.urls))
        if not self.run_dir:
            raise ValueError("RolloutServersConfig needs run_dir (the job's run folder)")
        if bool(self.urls) == (self.launch is not None):
            raise ValueError("give exactly one of urls (running servers) and launch (servers to start)")

    @property
    def folder(self) -> str:
        return os.path.join(self.run_dir, SERVERS_DIR)


@EngineConfig.register_subclass("vllm_server")
@dataclasses.dataclass(frozen=True)
class VllmServerEngineConfig(ServerFleet, EngineConfig):
    """``rollout.engine: vllm_server``: vLLM servers given by ``server_urls``
    (comma-separated, running elsewhere) or launched by train.py (``launch``: its ``count``
    >= 1), never both; the fleet's settings are `ServerFleet`'s. One set of servers serves
    every stage of the job (`RolloutServers`)."""

    uses_servers: ClassVar[bool] = True

    server_urls: Optional[str] = None
    launch: ServerLaunch = dataclasses.field(default_factory=ServerLaunch)

    def __post_init__(self):
        super().__post_init__()
        _check((self.launch.count > 0) != (self.server_urls is not None), "rollout.engine.launch.count",
               "0 when rollout.engine.server_urls is set and >= 1 when it is not (rollout.engine=vllm_server "
               "needs the URLs of running servers or servers to launch, not both)", self.launch.count)

    def check_runnable(self, rollout) -> None:
        """Temperature 1 (raw log-probs); well-formed URLs, or an interpreter with vLLM to
        launch the servers with."""
        import importlib.util
        import sys

        check_vllm_temperature(self.name, rollout)
        if self.server_urls is not None:
            parse_server_urls(self.server_urls)
            return
        python = self.launch.python
        if python is not None and not (os.path.isfile(python) and os.access(python, os.X_OK)):
            raise ValueError(f"rollout.engine.launch.python={python}: no such executable (the interpreter that "
                             "runs `vllm serve`, e.g. <repo>/.venv-vllm/bin/python from scripts/setup_vllm_cpu.sh)")
        if python is None and importlib.util.find_spec("vllm") is None:
            raise ValueError(f"rollout.engine.launch.count={self.launch.count} starts `vllm serve` with "
                             f"{sys.executable}, which has no vllm: set rollout.engine.launch.python to an "
                             "interpreter that has it (on CPU: <repo>/.venv-vllm/bin/python, scripts/setup_vllm_cpu.sh)")

    def servers(self, run_dir, agent, launcher_factory: LauncherFactory | None = None) -> "RolloutServers":
        """The job's servers; ``start(policy_folder)`` launches them (a no-op for URLs)."""
        urls = () if self.server_urls is None else parse_server_urls(self.server_urls)
        launch = None
        if not urls:
            settings = {f.name: getattr(self.launch, f.name) for f in dataclasses.fields(ServerLaunch)}
            launch = ServerLaunchConfig(capacity=self.capacity, max_model_len=agent.max_total_tokens, **settings)
        fleet = {f.name: getattr(self, f.name) for f in dataclasses.fields(ServerFleet)}
        return RolloutServers(RolloutServersConfig(run_dir=str(run_dir), urls=urls, launch=launch, **fleet),
                              launcher_factory=launcher_factory)

    def build(self, model, agent, orchestrator, policy_event: int, seed: int, servers=None,
              policy_folder=None, run_dir=None) -> VllmFleetEngine:
        """A fleet engine over the job's started ``servers``."""
        if servers is None:
            raise ValueError("rollout.engine=vllm_server: the engine needs the job's servers")
        return servers.engine(model, policy_event, policy_folder, drain=orchestrator.drain)

    def record_key(self) -> dict:
        """The URLs are keyed (records written before the servers' settings existed hold
        them); which servers were launched, and the fleet's settings, are not: where the
        rollouts run, not what they are (a run may continue on one more server, other GPUs)."""
        return {**super().record_key(), "server_urls": self.server_urls}


class RolloutServers:
    """The servers of a job and the fleet engines over them (see the module docstring).

    ``launcher_factory`` replaces `VllmServerLauncher` (tests use a stand-in server)."""

    def __init__(self, config: RolloutServersConfig, launcher_factory: LauncherFactory | None = None):
        self.config = config
        self._launcher_factory = launcher_factory or (lambda c, model_dir, log_dir: VllmServerLauncher(
            c, model_dir, log_dir))
        self._launcher = None
        self._engines = 0
        self._engine: VllmFleetEngine | None = None
        self._write_lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle
    def start(self, model_dir: str | os.PathLike) -> None:
        """Launch the local servers from ``model_dir`` and wait until they are healthy
        (a no-op for ``urls``)."""
        if self.config.launch is None or self._launcher is not None:
            return
        os.makedirs(self.config.folder, exist_ok=True)
        self._launcher = self._launcher_factory(self.config.launch, os.fspath(model_dir),
                                                os.path.join(self.config.folder, "logs"))
        self._launcher.start()
        self._write_state()
        try:
            self._launcher.wait_ready()
        except BaseException:
            self.close()
            raise
        self._launcher.watch(self.config.health_interval_s, on_events=self._on_launcher_events)

    def close(self) -> None:
        """Stop launched servers (SIGTERM, then SIGKILL after the grace time)."""
        if self._launcher is not None:
            self._launcher.close()
            self._write_state()

    def __enter__(self) -> "RolloutServers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def specs(self) -> tuple[VllmServerSpec, ...]:
        if self._launcher is not None:
            return tuple(self._launcher.specs())
        if self.config.launch is not None:
            raise RuntimeError("RolloutServers.start() must run before engines are built")
        return tuple(VllmServerSpec(url, self.config.capacity) for url in self.config.urls)

    # ---------------------------------------------------------------- engines
    def engine(self, model: Any, policy_event: int, tokenizer_dir: str | os.PathLike | None,
               drain: str = "finish") -> VllmFleetEngine:
        """A fleet engine whose servers serve ``model`` as ``policy_event`` from its first
        request on. ``drain``: the fleet's drained ``publish`` ("finish" / "abort"; with
        the orchestrator's drain "none" only a server without pause "keep" drains)."""
        from rollout_bridge.engine.vllm_weights import write_policy_folder

        specs = self.specs()
        self._forget_policies(specs)
        weights = os.path.join(self.config.folder, "weights")
        if os.path.isdir(weights):  # earlier stages' folders: no server needs them any more
            shutil.rmtree(weights, ignore_errors=True)
        self._engines += 1
        root = os.path.join(weights, f"engine-{self._engines}")
        tokenizer = None if tokenizer_dir is None else os.fspath(tokenizer_dir)
        folder = write_policy_folder(model, root, int(policy_event), tokenizer)
        config = VllmFleetConfig(servers=specs, weights_root=root, tokenizer_dir=tokenizer, initial_folder=folder,
                                 health_interval_s=self.config.health_interval_s,
                                 outage_wait_s=self.config.outage_wait_s,
                                 weights_transport=self.config.weights_transport,
                                 drain="abort" if drain == "abort" else "finish")
        self._engine = VllmFleetEngine(config)
        return self._engine

    def _forget_policies(self, specs) -> None:
        """Every reachable server forgets its policy event (best effort: a server that is
        down restarts without one anyway)."""
        body = json.dumps({"method": "spopp_set_policy_event", "args": [str(UNKNOWN_POLICY_EVENT)],
                           "timeout": FORGET_TIMEOUT_S}).encode()
        for spec in specs:
            request = urllib.request.Request(f"{spec.url}/collective_rpc", data=body,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=FORGET_TIMEOUT_S):
                    pass
            except (urllib.error.URLError, OSError) as err:
                logger.info("%s did not forget its policy event: %r", spec.url, err)

    # ---------------------------------------------------------------- reporting
    def metrics(self) -> dict[str, float]:
        """Counters for the per-update metrics row (see the module docstring)."""
        out: dict[str, float] = {}
        if self._launcher is not None:
            stats = self._launcher.stats
            out.update(server_restarts=float(stats.restarts), servers_dropped=float(stats.dropped))
        if self._engine is not None:
            fleet = self._engine.stats
            out.update(servers_lost=float(fleet.servers_lost), servers_rejoined=float(fleet.servers_rejoined),
                       request_retries=float(fleet.retries), requests_failed=float(fleet.failed),
                       inflight_updates=float(fleet.inflight_updates),
                       drained_fallbacks=float(fleet.drained_fallbacks),
                       publish_export_s=fleet.last_export_s, publish_install_s=fleet.last_publish_s,
                       weight_uploads=float(fleet.uploads), publish_upload_s=fleet.last_upload_s)
        return out

    def _on_launcher_events(self, events: list[tuple[int, str]]) -> None:
        for index, what in events:
            logger.warning("rollout server %d %s", index, what)
        self._write_state()

    def _write_state(self) -> None:
        """``servers.json``: url, pid, state, restarts and log of every launched server."""
        if self._launcher is None:
            return
        rows = [{"index": s.index, "url": s.url, "pid": None if s.process is None else s.process.pid,
                 "state": s.state, "restarts": s.restarts, "log": s.log_path} for s in self._launcher.servers()]
        path = os.path.join(self.config.folder, "servers.json")
        with self._write_lock:
            with open(path + ".tmp", "w") as f:
                json.dump({"servers": rows}, f, indent=1)
            os.replace(path + ".tmp", path)


__all__ = ["RolloutServers", "RolloutServersConfig", "SERVERS_DIR", "ServerFleet", "VllmServerEngineConfig",
           "parse_server_urls"]
