"""A scripted :class:`RolloutEngine` for tests, and a virtual-time asyncio loop.

``FakeEngine(script)`` answers each request with ``script(request) -> ScriptedReply``:
scripted tokens, log-probs and latency. Latency is an ``asyncio`` sleep, so under
:func:`run_virtual` (an event loop whose clock jumps to the next timer whenever nothing is
runnable) scripted latencies give exact, repeatable completion orders in zero wall time.
"""

from __future__ import annotations

import asyncio
import bisect
import dataclasses
import selectors
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence, TypeVar

from rollout_bridge.engine.base import GenerationResult, RolloutEngine, SamplingParams

T = TypeVar("T")


@dataclass(frozen=True)
class FakeRequest:
    """What the script sees: the request's index (0, 1, ...), prompt, params and policy."""

    index: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    policy_event: int


@dataclass(frozen=True)
class ScriptedReply:
    """Tokens to return after ``latency`` seconds; ``logprobs`` default to -1.0 each."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None = None
    latency: float = 0.0


@dataclass
class RequestRecord:
    """Engine-side log of one request (for assertions in tests)."""

    request: FakeRequest
    start_time: float
    finish_time: float | None = None
    result: GenerationResult | None = None


@dataclass
class FakeEngine(RolloutEngine):
    """Scripted engine: per-request latency and tokens, publish log, abort support.

    ``max_new_tokens`` truncates a reply (finish "length"); a reply ending in one of
    ``params.stop_token_ids`` finishes "stop" (tokens after the first stop are dropped).
    ``abort_all`` ends every pending request at once with finish "abort" and no tokens.
    ``keep_records=False`` keeps no per-request log (long simulated runs: bounded memory).

    In-flight publish (SPEC 3, "Publishing without a drain"): ``publish_inflight`` installs
    the weights after ``publish_latency`` without touching pending requests. A reply's
    token i counts as sampled at ``start + (i + 1)/n · latency`` (evenly spread), and its
    event is the one installed at that time, so a request that spans an install returns
    ``token_policy_events`` of several events (only then; otherwise None as before).
    """

    script: Callable[[FakeRequest], ScriptedReply]
    policy_event: int = 0
    publish_latency: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    published: list[tuple[int, Any]] = field(default_factory=list)
    max_concurrent: int = 0
    closed: bool = False
    keep_records: bool = True
    num_requests: int = 0
    supports_inflight_publish: bool = True
    _installs: list[tuple[float, int]] = field(default_factory=list)  # (loop time, event), in order
    _pending: dict[int, asyncio.Event] = field(default_factory=dict)

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        if self.closed:
            raise RuntimeError("FakeEngine is closed")
        loop = asyncio.get_running_loop()
        request = FakeRequest(self.num_requests, tuple(map(int, prompt_ids)), params, self.policy_event)
        self.num_requests += 1
        record = RequestRecord(request, start_time=loop.time())
        if self.keep_records:
            self.records.append(record)
        reply = self.script(request)
        abort_event = asyncio.Event()
        self._pending[request.index] = abort_event
        self.max_concurrent = max(self.max_concurrent, len(self._pending))
        try:
            try:
                await asyncio.wait_for(abort_event.wait(), timeout=max(reply.latency, 0.0))
                aborted = True
            except asyncio.TimeoutError:
                aborted = abort_event.is_set()
        finally:
            self._pending.pop(request.index, None)
        result = _finish(reply, params, request.policy_event, aborted)
        if not aborted and self._installs and self._installs[-1][0] > record.start_time:
            result = self._with_token_events(result, record.start_time, max(reply.latency, 0.0),
                                             len(reply.token_ids))
        record.finish_time = loop.time()
        record.result = result
        return result

    async def publish(self, weights: Any, policy_event: int) -> None:
        await self._install(weights, policy_event)

    async def _install(self, weights: Any, policy_event: int) -> None:
        """The install both publish paths share (subclasses hook ``publish`` /
        ``publish_inflight`` separately)."""
        if policy_event < self.policy_event:
            raise ValueError(f"policy_event must not decrease: {policy_event} < {self.policy_event}")
        if self.publish_latency > 0:
            await asyncio.sleep(self.publish_latency)
        if self.keep_records:
            self.published.append((int(policy_event), weights))
        self.policy_event = int(policy_event)

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Install between two (virtual) decode steps; pending requests keep running (the
        install itself is the same as ``publish``: nothing here waits for requests; the
        per-token events come from each request's timeline in ``generate``)."""
        await self._install(weights, policy_event)
        self._installs.append((asyncio.get_running_loop().time(), self.policy_event))  # one per publish

    def _event_at(self, time: float, start_event: int) -> int:
        """The event installed at ``time`` (``start_event`` if no install came before)."""
        done = bisect.bisect_right(self._installs, (time, float("inf")))
        return max(start_event, self._installs[done - 1][1]) if done else start_event

    def _with_token_events(self, result: GenerationResult, start: float, latency: float,
                           scripted_tokens: int) -> GenerationResult:
        """``result`` with per-token events: token i sampled at start + (i+1)/n · latency."""
        n = max(scripted_tokens, 1)
        events = tuple(self._event_at(start + (i + 1) / n * latency, result.policy_event)
                       for i in range(len(result.token_ids)))
        if not events:
            return result
        return dataclasses.replace(result, policy_event=events[0], token_policy_events=events)

    async def abort_all(self) -> None:
        for abort_event in list(self._pending.values()):
            abort_event.set()
        await asyncio.sleep(0)

    async def close(self) -> None:
        await self.abort_all()
        self.closed = True


def _finish(reply: ScriptedReply, params: SamplingParams, policy_event: int, aborted: bool) -> GenerationResult:
    """Apply abort / stop tokens / max_new_tokens to a scripted reply."""
    if aborted:
        return GenerationResult((), (), "abort", policy_event)
    token_ids = tuple(int(t) for t in reply.token_ids)
    logprobs = tuple(reply.logprobs) if reply.logprobs is not None else (-1.0,) * len(token_ids)
    if len(logprobs) != len(token_ids):
        raise ValueError(f"scripted logprobs ({len(logprobs)}) and token_ids ({len(token_ids)}) differ in length")
    finish_reason = "length"
    for i, tok in enumerate(token_ids[: params.max_new_tokens]):
        if tok in params.stop_token_ids:
            return GenerationResult(token_ids[: i + 1], logprobs[: i + 1], "stop", policy_event)
    if len(token_ids) < params.max_new_tokens:
        finish_reason = "stop"  # the script ended the reply (an EOS the test did not list)
    n = params.max_new_tokens
    return GenerationResult(token_ids[:n], logprobs[:n], finish_reason, policy_event)


# ----------------------------------------------------------------------------------------
# Virtual time
# ----------------------------------------------------------------------------------------


class _VirtualSelector(selectors.DefaultSelector):
    """Selector whose waits with a timeout advance the loop's virtual clock instead.

    While executor work (threads) is pending it blocks for real until the thread's result
    wakes the loop: work in threads takes zero virtual time.
    """

    def __init__(self):
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout=None):
        loop = self.loop
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if loop is not None and loop.pending_executor_jobs > 0:
            return super().select(None)
        if timeout is None:
            return super().select(None)
        loop.virtual_now += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop whose clock jumps to the next timer whenever nothing is runnable."""

    def __init__(self):
        selector = _VirtualSelector()
        super().__init__(selector)
        selector.loop = self
        self.virtual_now = 0.0
        self.pending_executor_jobs = 0

    def time(self) -> float:
        return self.virtual_now

    def run_in_executor(self, executor, func, *args):
        future = super().run_in_executor(executor, func, *args)
        self.pending_executor_jobs += 1

        def _done(_):
            self.pending_executor_jobs -= 1

        future.add_done_callback(_done)
        return future


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion on a fresh :class:`VirtualTimeLoop`; close the loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()
