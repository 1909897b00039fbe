"""The embedded JAX rollout engine: continuous batching over KV-cache slots.

``JaxEngine`` implements the ``RolloutEngine`` contract (docs/DESIGN.md) on top of the
model's cached decode (``init_cache`` / ``forward_cached``) and the pure slot transitions
of ``slot_decode``:

* ``num_slots`` slots share one KV cache of ``max_len`` positions per slot. A request joins
  a free slot between decode chunks (batched, bucketed prefill) and leaves as soon as it
  finishes; nobody waits for the longest request of a batch.
* One background thread runs the scheduler; each host round-trip runs ``steps_per_call``
  jitted decode steps (``lax.scan``, fixed shapes: one compile). JAX releases the GIL while
  computing, so the asyncio event loop of the callers stays responsive.
* Prefill shapes are bucketed (rows, new tokens and cache window each rounded up to
  2^k or 3 * 2^(k-1): at most 1.5x padding per axis), bounding recompiles to
  O(log S * log^2 max_len). The requests admitted together prefill in one call per
  power-of-two width class (a conversation's first turn, hundreds of new tokens, does not
  pad its later turns, tens, to its width), and each call attends only the cache window
  its rows reach (at least 256 positions), not all ``max_len`` positions. With
  ``background_compile`` a shape met for the first time compiles on a background thread
  while its calls run padded to a compiled larger shape (``prefill_programs``), so a
  compile does not stop the decoding slots. With JAX's persistent compilation cache on,
  the prefill programs are also kept traced and lowered beside it (``program_store``): a
  new process compiles them (from that cache) without tracing the model again.
* Prefix reuse (multi-turn agents): a finished request leaves its slot's cache rows
  holding its prompt and all its tokens but the last. A later request whose prompt
  extends that whole sequence (the next turn of the same conversation: history, reply,
  observation) is admitted into that slot and prefills only the new tokens. A turn then
  costs its own tokens instead of the whole history again. By default reuse only happens
  when the kept rows were computed entirely by the weights installed now (any publish
  forgets them), so the sampled tokens and log-probs are those of a full prefill up to
  float rounding. ``prefix_reuse_across_publish`` also keeps them across in-flight
  publishes: a conversation's next turn then continues on rows that older weights wrote,
  as a request decoding through an in-flight publish does (PipelineRL's kept cache; the
  log-probs are still those of the distribution that sampled each token, so the
  learner's importance weight stays exact); a drained publish still forgets them. It is on
  for attention-only caches (``prefix_reuse``; a hybrid model's recurrent layers always
  prefill in full). ``prefix_stats`` counts prefilled and reused tokens, and the requests
  that reused rows of an older policy event.
* Log-probs are ``log_softmax(logits / temperature)[token]`` in float32, from the logits
  that sampled the token, before top-k / top-p.
* Determinism: request r's i-th token uses ``fold_in(PRNGKey(seed_r), i)``, so a request's
  samples do not depend on its slot or on the other requests (``generate(..., seed=)``;
  without a seed the engine derives one from its own seed and a request counter).

Publish semantics, two modes (SPEC 3):
* ``publish`` (drain "finish"; every token of a request comes from one policy event)
  WAITS for the requests already decoding to finish with the old weights, admits nothing
  meanwhile, then installs the new weights; requests still queued (not yet admitted) and
  all later ones run on the new weights.
* ``publish_inflight`` (drain "none", "Publishing without a drain") installs the new
  weights between two decode chunks (host round-trips of ``steps_per_call`` steps) without
  waiting for, pausing or aborting anything. Requests in flight continue under the new
  weights with their KV cache KEPT (PipelineRL): cache rows written before the swap were
  computed by the old weights and are not recomputed. Token i of a request is sampled by
  the weights installed when its decode step was dispatched; that event is recorded per
  token (``GenerationResult.token_policy_events``) together with the log-prob, so the
  learner's per-token importance weight compares against the exact sampling
  distribution. ``publish_stats`` counts the in-flight publishes and the requests that
  kept a cache across one (the kept-cache off-policyness to log).
Publishes of both kinds install in submission order. ``GenerationResult.policy_event``
is the event of the first token. Published arrays are copied, so a learner that later
donates or mutates its buffers cannot corrupt the engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import os
import threading
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from rollout_bridge.engine import slot_decode
from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams
from rollout_bridge.engine.choice import EngineConfig, check
from rollout_bridge.engine.prefill_programs import PrefillPrograms, background_compiler
from rollout_bridge.program_store import compile_stored, store_for
from spopp_jax.models.cache import AttentionCache


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    max_new_tokens: int  # capped by the cache length
    rng_key: np.ndarray  # uint32[2]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    token_events: list[int] = dataclasses.field(default_factory=list)  # policy event per token
    cancelled: bool = False
    start: int = 0  # prompt tokens read from the slot's kept cache rows (prefix reuse)
    admit_event: int = -1  # policy event of the weights at admission
    oldest_row_event: int = -1  # oldest policy event of its cache rows (reused ones included)


@dataclasses.dataclass(eq=False)
class _Publish:
    params: tuple[jax.Array, ...]  # flat parameter leaves
    policy_event: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    inflight: bool = False  # install between decode chunks instead of after a drain


@dataclasses.dataclass
class PrefixStats:
    """Prefill counters: ``prefilled_tokens`` went through the model at admission,
    ``reused_tokens`` were read from a slot's kept cache rows instead (prefix reuse), over
    ``reused_requests`` requests; ``stale_reused_requests`` of those reused rows written
    by an older policy event (``prefix_reuse_across_publish``), ``stale_reused_tokens``
    of them."""

    prefilled_tokens: int = 0
    reused_tokens: int = 0
    reused_requests: int = 0
    stale_reused_requests: int = 0
    stale_reused_tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Abort:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


_CLOSE = object()
_RELEASE = jax.jit(slot_decode.release, donate_argnums=0)


class _Transitions(NamedTuple):
    admit: Callable  # (param_leaves, state, requests, key_len) -> state
    decode: Callable  # (param_leaves, state, num_steps) -> (state, output)
    prefill: dict  # (parameter and state layout, slots, stop ids, background) -> PrefillPrograms


@functools.lru_cache(maxsize=16)
def _transitions_for(graphdef: nnx.GraphDef, param_treedef: Any) -> _Transitions:
    """Jitted slot transitions with the model structure closed over.

    Hashing an nnx GraphDef costs ~1 ms, so it is hashed once per engine here rather than
    as a static argument on every call; params travel as a flat tuple of arrays. Engines
    over the same structure share these jits (and their compiled executables), and engines
    of the same layout their compiled prefill programs (``prefill``).
    """

    def admit(param_leaves, state, requests, key_len):
        params = jax.tree.unflatten(param_treedef, param_leaves)
        return slot_decode.admit(graphdef, params, state, requests, key_len)

    def decode(param_leaves, state, num_steps):
        params = jax.tree.unflatten(param_treedef, param_leaves)
        return slot_decode.decode_steps(graphdef, params, state, num_steps)

    return _Transitions(
        admit=jax.jit(admit, static_argnums=3, donate_argnums=1),
        decode=jax.jit(decode, static_argnums=2, donate_argnums=1),
        prefill={},
    )


_FINISH_NAMES = {slot_decode.FINISH_STOP: "stop", slot_decode.FINISH_LENGTH: "length"}


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _notify(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    try:
        loop.call_soon_threadsafe(_resolve, future, result, error)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


def prng_key_data(seed: int) -> np.ndarray:
    """Legacy uint32[2] threefry key of a 64-bit seed: ``[seed >> 32, seed & 0xffffffff]``.

    Equals ``jax.random.PRNGKey(seed)`` for ``0 <= seed < 2**32``; larger seeds keep their
    high bits (without x64, ``PRNGKey`` would truncate them). Computed on the host.
    """
    seed = int(seed) % (1 << 64)
    return np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)


# Smallest cache window a prefill attends (`slot_decode.admit`'s key_len), so a run
# compiles few (width, window) pairs.
_MIN_KEY_WINDOW = 256


def _bucket(n: int, minimum: int, maximum: int) -> int:
    size = max(minimum, 1 << max(0, n - 1).bit_length())
    return min(size, maximum)


def _fine_bucket(n: int, minimum: int, maximum: int) -> int:
    """The smallest size >= n of the form 2^k or 3 * 2^(k-1) (1, 2, 3, 4, 6, 8, 12, ...),
    clipped to [minimum, maximum]: at most 1.5x padding where powers of two pad up to 2x,
    for about twice as many shapes to compile."""
    power = 1 << max(0, n - 1).bit_length()
    size = power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power
    return min(max(minimum, size), maximum)


@dataclasses.dataclass
class PublishStats:
    """In-flight publish counters (SPEC 3: log the kept-cache off-policyness).

    inflight_publishes: ``publish_inflight`` calls installed.
    requests_kept_cache: sum over those installs of the requests decoding at the swap
      (each continues on a KV cache partly written by the previous weights).
    drained_publishes: ``publish`` calls installed (after a drain).
    """

    inflight_publishes: int = 0
    requests_kept_cache: int = 0
    drained_publishes: int = 0


class JaxEngine(RolloutEngine):
    """Embedded continuous-batching JAX engine (see the module docstring).

    Args:
      model: an nnx module with ``init_cache`` / ``forward_cached`` (spopp_jax.models).
      num_slots: concurrent requests decoded together.
      max_len: KV-cache positions per slot (prompt + generated tokens).
      steps_per_call: decode steps per jitted call (host round-trip).
      policy_event: event of the initial weights.
      seed: engine seed for requests that pass none.
      max_stop_tokens: capacity of a request's ``stop_token_ids``.
      min_prefill_len: smallest prefill bucket.
      cache_dtype: KV-cache dtype.
      prefix_reuse: prefill a conversation's next turn on top of the cache rows its
        previous request left (attention-only caches; see the module docstring).
      prefix_reuse_across_publish: keep those rows across in-flight publishes (see the
        module docstring); off: every publish forgets them.
      background_compile: compile a new prefill shape on a background thread and run its
        calls padded to a compiled larger shape meanwhile (``prefill_programs``); off:
        the scheduler compiles it before the call.
      program_store: with JAX's persistent compilation cache on, keep the prefill programs
        exported (traced and lowered) beside it, so a later process skips that work
        (``program_store``); off: every process traces and lowers each shape it meets.
    """

    supports_inflight_publish = True

    def __init__(
        self,
        model: nnx.Module,
        *,
        num_slots: int = 16,
        max_len: int = 2048,
        steps_per_call: int = 8,
        policy_event: int = 0,
        seed: int = 0,
        max_stop_tokens: int = 8,
        min_prefill_len: int = 16,
        cache_dtype: Any = jnp.float32,
        prefix_reuse: bool = True,
        prefix_reuse_across_publish: bool = False,
        background_compile: bool = False,
        program_store: bool = True,
    ):
        self.publish_stats = PublishStats()
        self.prefix_stats = PrefixStats()
        self.min_key_window = _MIN_KEY_WINDOW  # max_len: every prefill attends the whole cache
        self.shape_bucket = _fine_bucket  # prefill rows, width and window (benchmarks compare `_bucket`)
        if steps_per_call < 1:
            raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
        graphdef, params = nnx.split(model)
        self._graphdef = graphdef
        param_leaves, self._param_treedef = jax.tree.flatten(params)
        self._param_leaves = tuple(_copy_tree(param_leaves))
        self._param_specs = [(x.shape, x.dtype) for x in self._param_leaves]
        self._num_slots = int(num_slots)
        self._max_len = int(max_len)
        self._steps_per_call = int(steps_per_call)
        self._max_stop_tokens = int(max_stop_tokens)
        self._min_prefill_len = int(min_prefill_len)
        self._vocab_size = _vocab_size(model)
        self._seed = int(seed)
        self._request_counter = 0
        self._tokens_generated = 0
        self.policy_event = int(policy_event)

        # Distinct buffers per leaf: the jitted transitions donate the whole state.
        self._state = _copy_tree(slot_decode.init_slot_state(model, num_slots, max_len, max_stop_tokens, cache_dtype))
        self._prefix_reuse = bool(prefix_reuse) and all(
            isinstance(layer, AttentionCache) for layer in self._state.cache)
        self._transitions = _transitions_for(graphdef, self._param_treedef)
        self._background_compile = bool(background_compile)
        self._program_store = bool(program_store)
        self._prefill = self._prefill_programs()
        self._release = _RELEASE

        # Scheduler-thread state (touched only by that thread after start).
        self._slots: list[_Request | None] = [None] * self._num_slots
        # what a free slot's cache rows hold at positions 0.. (prefix reuse), and when
        self._kept: list[tuple[int, ...] | None] = [None] * self._num_slots
        self._kept_at: list[int] = [0] * self._num_slots
        self._kept_event: list[int] = [0] * self._num_slots  # oldest policy event of the kept rows
        self._across_publish = bool(prefix_reuse_across_publish)
        self._finished_count = 0
        self._pending: collections.deque[_Request] = collections.deque()
        self._publishes: collections.deque[_Publish] = collections.deque()
        self._last_publish_submitted: asyncio.Future | None = None  # event-loop side
        # Shared with callers, guarded by the condition.
        self._inbox: collections.deque[Any] = collections.deque()
        self._wakeup = threading.Condition()
        self._ended: collections.Counter[str] = collections.Counter()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="JaxEngine-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ async front end
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def prefill_compile_stats(self):
        """How prefill calls found their program (``PrefillCompileStats``), counted over
        every engine that shares this one's compiled prefill programs."""
        return self._prefill.stats

    @property
    def num_running(self) -> int:
        """Requests holding a slot now (decoding)."""
        return sum(request is not None for request in self._slots)

    @property
    def num_tokens_generated(self) -> int:
        """Tokens handed to requests so far (all requests, all events)."""
        return self._tokens_generated

    @property
    def stats(self) -> dict[str, int]:
        """Counts of ended requests by outcome ("stop", "length", "abort", "cancelled")."""
        return dict(self._ended)

    async def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, seed: int | None = None
    ) -> GenerationResult:
        """Decode a continuation of ``prompt_ids``; ``seed`` (else ``params.seed``) fixes this
        request's samples."""
        prompt = tuple(int(t) for t in prompt_ids)
        self._validate(prompt, params)
        if seed is None:
            seed = params.seed
        if seed is None:
            self._request_counter += 1
            seed = hash((self._seed, self._request_counter)) & ((1 << 63) - 1)
        loop = asyncio.get_running_loop()
        request = _Request(
            prompt_ids=prompt,
            params=params,
            max_new_tokens=min(params.max_new_tokens, self._max_len - len(prompt) + 1),
            rng_key=prng_key_data(seed),
            loop=loop,
            future=loop.create_future(),
        )
        self._submit(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            with self._wakeup:  # wake the scheduler (and end its pipelined round) to free the slot
                self._inbox.append(None)
                self._wakeup.notify()
            raise

    async def publish(self, weights: Any, policy_event: int) -> None:
        """Install ``weights`` (nnx.State, its pure dict, nnx.Module or HF folder) as ``policy_event``.

        Waits until every request already decoding has finished on the old weights.
        """
        await self._publish(weights, policy_event, inflight=False)

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Install ``weights`` as ``policy_event`` between two decode chunks (SPEC 3).

        Returns once installed; requests in flight keep their slot and KV cache and
        continue on the new weights (see the module docstring). Nothing is aborted.
        """
        await self._publish(weights, policy_event, inflight=True)

    async def _publish(self, weights: Any, policy_event: int, *, inflight: bool) -> None:
        # Publishes reach the scheduler in call order although their conversions run in
        # parallel threads: each waits for the previous call's submission first.
        loop = asyncio.get_running_loop()
        previous, submitted = self._last_publish_submitted, loop.create_future()
        self._last_publish_submitted = submitted
        try:
            params = await asyncio.to_thread(self._to_params, weights)  # copy off the scheduler
            if previous is not None and previous.get_loop() is loop:
                await asyncio.shield(previous)
            command = _Publish(params=params, policy_event=int(policy_event), loop=loop,
                               future=loop.create_future(), inflight=inflight)
            self._submit(command)
        finally:
            submitted.set_result(None)
        await command.future

    async def abort_all(self) -> None:
        """Finish every decoding or queued request now with ``finish_reason == "abort"``."""
        loop = asyncio.get_running_loop()
        command = _Abort(loop=loop, future=loop.create_future())
        self._submit(command)
        await command.future

    async def close(self) -> None:
        """Abort everything in flight and stop the scheduler thread."""
        if not self._closed and self._error is None:
            self._submit(_CLOSE)
            self._closed = True  # later calls raise at once
        await asyncio.to_thread(self._thread.join)

    # ------------------------------------------------------------------ validation
    def _validate(self, prompt: tuple[int, ...], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not 1 <= len(prompt) <= self._max_len:
            raise ValueError(f"prompt_ids must have 1..max_len={self._max_len} tokens, got {len(prompt)}")
        if self._vocab_size is not None and any(not 0 <= t < self._vocab_size for t in prompt):
            raise ValueError(f"prompt_ids must lie in [0, {self._vocab_size})")
        if len(params.stop_token_ids) > self._max_stop_tokens:
            raise ValueError(
                f"params.stop_token_ids has {len(params.stop_token_ids)} ids, the engine holds at most "
                f"max_stop_tokens={self._max_stop_tokens}"
            )

    def _to_params(self, weights: Any) -> tuple[jax.Array, ...]:
        if isinstance(weights, (str, os.PathLike)):
            from spopp_jax.models import from_pretrained  # the learner's loader

            weights = from_pretrained(os.fspath(weights))
        if isinstance(weights, nnx.Module):
            weights = nnx.state(weights)
        elif isinstance(weights, dict) and not isinstance(weights, nnx.State):
            # a pure dict (nnx.to_pure_dict, as the learner's TrainState.params holds)
            template = jax.tree.unflatten(self._param_treedef, self._param_leaves)
            try:
                nnx.replace_by_pure_dict(template, weights)
            except (KeyError, ValueError, TypeError) as error:
                raise ValueError(f"weights: pure dict does not match the engine model: {error!r}") from error
            weights = template
        leaves, treedef = jax.tree.flatten(weights)
        specs = [(jnp.shape(x), jnp.asarray(x).dtype) for x in leaves]
        if treedef != self._param_treedef or specs != self._param_specs:
            raise ValueError("weights must match the engine model's parameter tree (structure, shapes, dtypes)")
        return tuple(_copy_tree(leaves))

    # ------------------------------------------------------------------ scheduler thread
    def _submit(self, item: Any) -> None:
        if self._error is not None:
            raise RuntimeError("JaxEngine scheduler failed") from self._error
        if self._closed:
            raise RuntimeError("JaxEngine is closed")
        with self._wakeup:
            self._inbox.append(item)
            self._wakeup.notify()

    def _run(self) -> None:
        try:
            while True:
                with self._wakeup:
                    while not self._inbox and not self._any_active() and not self._pending and not self._publishes:
                        self._wakeup.wait()
                    commands = list(self._inbox)
                    self._inbox.clear()
                if not self._handle(commands):
                    return
                self._drop_cancelled()
                self._install_publishes()
                self._admit_pending()
                if self._any_active():
                    self._decode_round()
        except BaseException as error:  # fail every waiter instead of hanging them
            self._error = error
            self._fail_everything(error)

    def _handle(self, commands: list[Any]) -> bool:
        for index, command in enumerate(commands):
            if command is None:  # a wake-up (cancelled request)
                continue
            if command is _CLOSE:
                self._closed = True
                self._abort_everything()
                with self._wakeup:  # what came after the close fails with it
                    self._inbox.extendleft(reversed(commands[index + 1:]))
                self._fail_everything(RuntimeError("JaxEngine is closed"))
                return False
            if isinstance(command, _Request):
                self._pending.append(command)
            elif isinstance(command, _Publish):
                self._publishes.append(command)
            elif isinstance(command, _Abort):
                self._abort_everything()
                _notify(command.loop, command.future)
        return True

    def _any_active(self) -> bool:
        return any(request is not None for request in self._slots)

    def _drop_cancelled(self) -> None:
        pending = len(self._pending)
        self._pending = collections.deque(r for r in self._pending if not r.cancelled)
        cancelled = [i for i, r in enumerate(self._slots) if r is not None and r.cancelled]
        if cancelled:
            self._free_slots(cancelled)
        dropped = pending - len(self._pending) + len(cancelled)
        if dropped:
            self._ended["cancelled"] += dropped

    def _free_slots(self, slots: list[int]) -> None:
        mask = np.zeros((self._num_slots,), bool)
        mask[slots] = True
        self._state = self._release(self._state, jnp.asarray(mask))
        for i in slots:
            self._slots[i] = None
            self._kept[i] = None  # aborted mid-chunk: the rows hold an unknown tail

    def _install_publishes(self) -> None:
        """Install queued publishes in order: an in-flight one at once (we are between
        decode chunks: every dispatched chunk has been consumed), a drained one once no
        request is decoding."""
        while self._publishes and (self._publishes[0].inflight or not self._any_active()):
            command = self._publishes.popleft()
            if command.inflight:
                self.publish_stats.inflight_publishes += 1
                self.publish_stats.requests_kept_cache += self.num_running
            else:
                self.publish_stats.drained_publishes += 1
            self._param_leaves = command.params
            self._prefill = self._prefill_programs()  # the same programs unless the layout changed
            self.policy_event = command.policy_event
            if not (command.inflight and self._across_publish):
                self._kept = [None] * self._num_slots  # rows computed by the old weights: not reused
            _notify(command.loop, command.future)

    def _admit_pending(self) -> None:
        if self._publishes:
            return  # drain for the pending publish: admit nothing on the old weights
        free = [i for i, r in enumerate(self._slots) if r is None]
        admitted: list[tuple[int, _Request]] = []
        while free and self._pending:
            request = self._pending.popleft()
            slot, request.start = self._pick_slot(free, request.prompt_ids)
            request.oldest_row_event = self._kept_event[slot] if request.start else self.policy_event
            free.remove(slot)
            admitted.append((slot, request))
        if not admitted:
            return
        try:
            self._prefill_admitted(admitted)
        except BaseException:  # back in the queue, so the engine's failure reaches their callers
            self._pending.extendleft(reversed([request for _, request in admitted]))
            raise
        for slot, request in admitted:
            self._slots[slot] = request
            self._kept[slot] = None
            request.admit_event = self.policy_event
            self.prefix_stats.prefilled_tokens += len(request.prompt_ids) - 1 - request.start
            self.prefix_stats.reused_tokens += request.start
            self.prefix_stats.reused_requests += request.start > 0
            if request.start and request.oldest_row_event < self.policy_event:
                self.prefix_stats.stale_reused_requests += 1
                self.prefix_stats.stale_reused_tokens += request.start

    def _prefill_admitted(self, admitted: list[tuple[int, _Request]]) -> None:
        """Prefill the admitted requests into their slots: one call per width class."""
        for group in self._prefill_groups(admitted):
            rows = self.shape_bucket(len(group), 1, self._num_slots)
            width = self.shape_bucket(max(len(r.prompt_ids) - 1 - r.start for _, r in group),
                                      self._min_prefill_len, self._max_len)
            key_len = self.shape_bucket(max(len(r.prompt_ids) - 1 for _, r in group),
                                        max(width, self.min_key_window), self._max_len)
            (rows, width, key_len), program = self._prefill.program((rows, width, key_len))
            batch = _requests_batch(group, rows, width, self._num_slots, self._max_stop_tokens)
            self._state = program(self._param_leaves, self._state, batch)

    def _prefill_programs(self) -> PrefillPrograms:
        """The compiled prefill programs for this engine's parameter and state layout (shapes,
        dtypes, shardings), shared with every engine of the same model structure and layout."""
        spec = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        params = tuple(spec(x) for x in self._param_leaves)
        state = jax.tree.map(spec, self._state)
        key = (params, tuple(jax.tree.leaves(state)), self._num_slots, self._max_stop_tokens,
               self._background_compile, self._program_store)
        programs = self._transitions.prefill.get(key)
        if programs is None:
            admit, num_slots, max_stop = self._transitions.admit, self._num_slots, self._max_stop_tokens

            store = store_for((self._graphdef, self._param_treedef)) if self._program_store else None
            layout = repr(key[:4])  # what the programs depend on (not how they are compiled or kept)

            def compile_shape(shape):
                rows, width, window = shape
                batch = _requests_batch([], rows, width, num_slots, max_stop)
                if store is None:
                    return admit.lower(params, state, batch, window).compile()
                return compile_stored(store, ("admit", layout, shape), lambda p, s, b: admit(p, s, b, window),
                                      (params, state, batch), donate_argnums=(1,), like=1)

            submit = background_compiler().submit if self._background_compile else None
            programs = self._transitions.prefill.setdefault(key, PrefillPrograms(compile_shape, submit))
        return programs

    def _width_bucket(self, request: _Request) -> int:
        """Prefill width class of ``request``: its new tokens rounded up to a power of two
        (the call's width is `_fine_bucket` of its group's longest)."""
        return _bucket(len(request.prompt_ids) - 1 - request.start, self._min_prefill_len, self._max_len)

    def _prefill_groups(self, admitted: list[tuple[int, _Request]]) -> list[list[tuple[int, _Request]]]:
        """The admitted requests in one prefill call per width bucket: a conversation's
        first turn (hundreds of new tokens) does not pad its later turns (tens) to its width."""
        groups: dict[int, list[tuple[int, _Request]]] = {}
        for slot, request in admitted:
            groups.setdefault(self._width_bucket(request), []).append((slot, request))
        return [groups[width] for width in sorted(groups)]

    def _pick_slot(self, free: list[int], prompt: tuple[int, ...]) -> tuple[int, int]:
        """(slot, start): the free slot whose kept rows are the longest prefix of
        ``prompt[:-1]`` (start = its length), else the free slot kept longest ago (start 0)."""
        best, start = None, 0
        for slot in free:
            kept = self._kept[slot]
            if kept and start < len(kept) < len(prompt) and prompt[:len(kept)] == kept:
                best, start = slot, len(kept)
        if best is None:
            best = min(free, key=lambda slot: (self._kept[slot] is not None, self._kept_at[slot]))
        return best, start

    def _decode_round(self) -> None:
        """Decode chunks until a command arrives or the pipeline should stop.

        While nobody waits for a slot, the next chunk is dispatched BEFORE the host syncs
        on the current one (the device never idles on host wake-ups), as long as some
        request is sure to still be running after the current chunk. With requests
        waiting, each chunk is synced first so a freed slot is refilled at once.
        """
        chunk = self._dispatch_chunk()
        while True:
            pipelined = None
            if not self._inbox and not self._pending and self._some_request_outlives_chunk():
                pipelined = self._dispatch_chunk()
            self._consume_chunk(*chunk)
            if pipelined is None:
                return
            chunk = pipelined

    def _dispatch_chunk(self) -> tuple[slot_decode.DecodeOutput, int]:
        """Dispatch one decode chunk; returns its output and the policy event of the
        weights it runs on (the event of every token it samples)."""
        self._state, output = self._transitions.decode(self._param_leaves, self._state, self._steps_per_call)
        return output, self.policy_event

    def _some_request_outlives_chunk(self) -> bool:
        """True if a request will still be below its length limit after the chunk in flight
        (``token_ids`` holds the tokens of the chunks consumed so far), i.e. the next chunk
        has work unless that request samples a stop token first."""
        return any(r is not None and r.max_new_tokens - len(r.token_ids) > self._steps_per_call
                   for r in self._slots)

    def _consume_chunk(self, output: slot_decode.DecodeOutput, policy_event: int) -> None:
        tokens, logprobs, emitted, finish = jax.device_get(
            (output.token_ids, output.logprobs, output.emitted, output.finish)
        )
        for slot in np.flatnonzero(emitted.any(axis=0)).tolist():
            request = self._slots[slot]
            if request is None:  # not running on the host side any more
                continue
            mask = emitted[:, slot]
            request.token_ids.extend(tokens[mask, slot].tolist())
            request.logprobs.extend(logprobs[mask, slot].tolist())
            request.token_events.extend([policy_event] * int(mask.sum()))
            self._tokens_generated += int(mask.sum())
            reasons = finish[mask, slot]
            if reasons[-1] != slot_decode.FINISH_NONE:
                self._slots[slot] = None
                self._keep_rows(slot, request)
                self._finish(request, _FINISH_NAMES[int(reasons[-1])])

    def _keep_rows(self, slot: int, request: _Request) -> None:
        """Remember what the finished request left in its slot's rows: its prompt and its
        tokens but the last (sampled, never fed): when all were computed by the current
        weights, or also older ones with ``prefix_reuse_across_publish``."""
        if self._prefix_reuse and (request.admit_event == self.policy_event or self._across_publish):
            self._finished_count += 1
            self._kept[slot] = request.prompt_ids + tuple(request.token_ids[:-1])
            self._kept_at[slot] = self._finished_count
            self._kept_event[slot] = request.oldest_row_event

    def _finish(self, request: _Request, reason: str) -> None:
        self._ended[reason] += 1
        events = request.token_events
        result = GenerationResult(
            token_ids=tuple(request.token_ids),
            logprobs=tuple(request.logprobs),
            finish_reason=reason,
            policy_event=events[0] if events else self.policy_event,
            token_policy_events=tuple(events),
        )
        _notify(request.loop, request.future, result)

    def _abort_everything(self) -> None:
        active = [i for i, r in enumerate(self._slots) if r is not None]
        requests = [self._slots[i] for i in active] + list(self._pending)
        if active:
            self._free_slots(active)
        self._pending.clear()
        for request in requests:
            self._finish(request, "abort")

    def _fail_everything(self, error: BaseException) -> None:
        waiters = [r for r in self._slots if r is not None] + list(self._pending) + list(self._publishes)
        with self._wakeup:
            waiters += [c for c in self._inbox if c is not _CLOSE and c is not None]
            self._inbox.clear()
        for waiter in waiters:
            _notify(waiter.loop, waiter.future, error=RuntimeError(f"JaxEngine stopped: {error!r}"))


def _copy_tree(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _vocab_size(model: nnx.Module) -> int | None:
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    return int(size) if size is not None else None


def _requests_batch(
    admitted: list[tuple[int, _Request]], rows: int, width: int, num_slots: int, max_stop_tokens: int
) -> slot_decode.SlotRequests:
    slot = np.full((rows,), num_slots, np.int32)
    prefix_ids = np.zeros((rows, width), np.int32)
    prefix_len = np.zeros((rows,), np.int32)
    start = np.zeros((rows,), np.int32)
    last_token = np.zeros((rows,), np.int32)
    max_new = np.ones((rows,), np.int32)
    temperature = np.ones((rows,), np.float32)
    top_k = np.zeros((rows,), np.int32)
    top_p = np.ones((rows,), np.float32)
    rng_key = np.zeros((rows, 2), np.uint32)
    stop_ids = np.full((rows, max_stop_tokens), -1, np.int32)
    for row, (slot_index, request) in enumerate(admitted):
        prompt, params = request.prompt_ids, request.params
        slot[row] = slot_index
        prefix_ids[row, : len(prompt) - 1 - request.start] = prompt[request.start:-1]
        prefix_len[row] = len(prompt) - 1
        start[row] = request.start
        last_token[row] = prompt[-1]
        max_new[row] = request.max_new_tokens
        temperature[row] = params.temperature
        top_k[row] = params.top_k
        top_p[row] = params.top_p
        rng_key[row] = request.rng_key
        stop_ids[row, : len(params.stop_token_ids)] = params.stop_token_ids
    return slot_decode.SlotRequests(
        slot=slot,
        prefix_ids=prefix_ids,
        prefix_len=prefix_len,
        start=start,
        last_token=last_token,
        max_new_tokens=max_new,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        rng_key=rng_key,
        stop_token_ids=stop_ids,
    )


@EngineConfig.register_subclass("jax")
@dataclasses.dataclass(frozen=True)
class JaxEngineConfig(EngineConfig):
    """``rollout.engine: jax``, the embedded engine above (the default). ``steps_per_call``:
    decode steps per engine call (a host round-trip; at most the rollout's max_new_tokens
    are used). It changes no sampled token, only how soon a finished request's slot is
    refilled and a publish lands: a slot decodes to the end of the chunk its request ends
    in, so chunks much longer than the replies waste steps (the main job's replies are a
    few tokens: its held-out evaluation took 44.5 s at 8 and 33-35 s at 1-3, docs/PERFORMANCE.md).
    ``prefix_reuse_across_publish`` (drain none): a conversation's next turn
    prefills only its new tokens on top of the cache rows its previous turn left even when
    an in-flight publish came in between (those rows were written by older weights, as the
    kept cache of a request decoding through the publish is, SPEC 3); false: every publish
    forgets the rows and the next turn prefills the whole conversation again.
    ``background_compile``: a prefill shape met for the first time compiles on a background
    thread while its calls run padded to a larger compiled shape (``prefill_programs``; the
    same tokens up to float rounding); off by default: on 2 CPU cores it sped up a cold
    evaluation but slowed a cold RL run, whose learner lost the CPU the compiles and padded
    calls took (docs/PERFORMANCE.md). The job's ``program_store`` (a top-level setting) keeps
    the prefill programs exported in the compilation cache's ``prefill_programs`` folder."""

    traces_programs: ClassVar[bool] = True
    steps_per_call: int = 2
    prefix_reuse_across_publish: bool = False
    background_compile: bool = False

    def __post_init__(self):
        check(self.steps_per_call > 0, "rollout.engine.steps_per_call", "> 0", self.steps_per_call)

    def build(self, model, agent, orchestrator, policy_event: int, seed: int, servers=None,
              policy_folder=None, run_dir=None, program_store: bool = True) -> JaxEngine:
        """One slot per in-flight request, a cache row as long as the agent's conversations."""
        return JaxEngine(model, num_slots=orchestrator.max_in_flight, max_len=agent.max_total_tokens,
                         steps_per_call=min(self.steps_per_call, agent.sampling.max_new_tokens),
                         policy_event=policy_event, seed=seed,
                         prefix_reuse_across_publish=self.prefix_reuse_across_publish,
                         background_compile=self.background_compile,
                         program_store=program_store)

    def record_key(self) -> dict:
        """``prefix_reuse_across_publish`` acts only across publishes (a fixed policy's prior
        and evaluations have none; a resumed run may change it), ``background_compile`` only
        on float rounding: not keyed."""
        return {**super().record_key(), "engine_steps_per_call": self.steps_per_call}
