"""The rollout-engine contract (docs/DESIGN.md, "Engine contract").

Every backend (the scripted fake, the embedded JAX engine, vLLM in-process or a server
fleet) implements :class:`RolloutEngine`. The orchestrator only speaks this interface.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class Decoding:
    """How replies are sampled (SPEC 6: temperature 1, top-p 1, top-k -1): the decoding
    fields of the run config's ``rollout`` section (`rollout_bridge.config.RolloutSection`
    extends this class). ``top_k = -1`` disables top-k. ``max_new_tokens``: most tokens of
    one reply (the agent lowers it to fit its ``max_total_tokens``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 24

    def __post_init__(self):
        if not (self.temperature > 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be > 0 and finite, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass(frozen=True)
class SamplingParams(Decoding):
    """Decoding parameters of one request: the `Decoding` fields and what each request sets.

    ``stop_token_ids``: generation ends right after one of these is sampled (the stop token
    is part of the output). ``seed``: fixes this request's random numbers (an int in
    [0, 2**63)); None lets the engine draw them. Evaluations seed every turn so that two
    policies see the same random numbers (common random numbers: their paired difference
    has less sampling noise).
    """

    stop_token_ids: tuple[int, ...] = field(default=(), metadata={
        "from": "the agent, per request: the chat format's stop tokens"})
    seed: int | None = field(default=None, metadata={
        "from": "the agent, per turn of an evaluation: the episode seed (common random numbers)"})

    def __post_init__(self):
        Decoding.__post_init__(self)
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed
                                      or not 0 <= int(self.seed) < 1 << 63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class GenerationResult:
    """One finished (or aborted) generation.

    token_ids: sampled tokens (the stop token included when hit).
    logprobs: log_softmax(logits / temperature)[token] for each sampled token, computed
      before top-k / top-p filtering (the behaviour log-prob the learner's importance
      weight compares against, SPEC 5).
    finish_reason: "stop" | "length" | "abort".
    policy_event: the published weights (policy event k, SPEC 2) that generated the FIRST
      token (for a drained publish: every token).
    token_policy_events: per sampled token, the policy event of the weights that sampled
      it (SPEC 3, "Publishing without a drain": a request that spans an in-flight publish
      holds tokens of several events). ``None`` means every token is ``policy_event``
      unless ``last_policy_event`` says otherwise.
    last_policy_event: for engines that cannot attribute tokens to events (vLLM pause
      "keep" then load then resume: the boundary token is not observable over the API),
      the event installed when the request completed, an UPPER bound on the last token's
      event; only with ``token_policy_events = None``. The log-probs stay exact (they are
      the sampling distribution's); only the recorded span is coarse.
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    policy_event: int
    token_policy_events: tuple[int, ...] | None = None
    last_policy_event: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "token_ids", tuple(map(int, self.token_ids)))  # map: no per-token frame
        object.__setattr__(self, "logprobs", tuple(map(float, self.logprobs)))
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"token_ids and logprobs must have equal length, got "
                f"{len(self.token_ids)} and {len(self.logprobs)}"
            )
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}")
        if self.token_policy_events is not None:
            events = tuple(int(e) for e in self.token_policy_events)
            if len(events) != len(self.token_ids):
                raise ValueError(
                    f"token_policy_events must have one entry per token, got {len(events)} "
                    f"for {len(self.token_ids)} tokens"
                )
            if events and events[0] != self.policy_event:
                raise ValueError(
                    f"policy_event ({self.policy_event}) must be the event of the first token "
                    f"({events[0]})"
                )
            if any(b < a for a, b in zip(events, events[1:])):
                raise ValueError("token_policy_events must be non-decreasing")
            object.__setattr__(self, "token_policy_events", events)
        if self.last_policy_event is not None:
            if self.token_policy_events is not None:
                raise ValueError("give token_policy_events or last_policy_event, not both")
            if self.last_policy_event < self.policy_event:
                raise ValueError(
                    f"last_policy_event ({self.last_policy_event}) must be >= policy_event "
                    f"({self.policy_event})"
                )

    def events_per_token(self) -> tuple[int, ...]:
        """The policy event of every sampled token (``policy_event`` repeated when none
        were recorded)."""
        if self.token_policy_events is None:
            return (self.policy_event,) * len(self.token_ids)
        return self.token_policy_events

    @property
    def event_span(self) -> tuple[int, int]:
        """(first, last) policy event among the tokens (SPEC 3: recorded per trajectory);
        with ``last_policy_event``: (policy_event, last_policy_event), a superset."""
        if self.last_policy_event is not None:
            return (self.policy_event, self.last_policy_event)
        events = self.events_per_token()
        if not events:
            return (self.policy_event, self.policy_event)
        return (events[0], events[-1])


class RolloutEngine(abc.ABC):
    """Abstract async generation engine.

    Contract:
      * ``generate`` may be awaited concurrently by many tasks; results come back in
        completion order (first finished first).
      * ``publish(weights, policy_event)`` installs new weights; requests that start
        decoding afterwards are generated by ``policy_event``. A request never mixes
        policies: ``GenerationResult.policy_event`` names the weights of every token.
      * ``abort_all`` makes every in-flight ``generate`` return promptly with
        ``finish_reason == "abort"`` (the tokens so far may be returned).
      * ``policy_event`` is the event of the currently installed weights.
      * In-flight publish (SPEC 3, "Publishing without a drain"): an engine with
        ``supports_inflight_publish = True`` implements ``publish_inflight``: the new
        weights are installed between two decode steps, nothing is aborted or waited
        for, requests in flight continue under them with their KV cache kept, and each
        token's event is recorded in ``GenerationResult.token_policy_events``.
    """

    policy_event: int = 0
    supports_inflight_publish: bool = False

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``prompt_ids``."""

    @abc.abstractmethod
    async def publish(self, weights: Any, policy_event: int) -> None:
        """Install new weights (nnx state or an HF folder path) as ``policy_event``."""

    async def publish_inflight(self, weights: Any, policy_event: int) -> None:
        """Install new weights between two decode steps without stopping or draining
        anything (see the class docstring). Engines that cannot do so raise."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot publish in flight; use rollout.drain finish|abort"
        )

    @abc.abstractmethod
    async def abort_all(self) -> None:
        """Finish every in-flight request with ``finish_reason == "abort"``."""

    async def close(self) -> None:
        """Release resources. Default: nothing to release."""
        return None
