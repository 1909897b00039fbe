"""In-flight weight updates in the embedded JAX engine (SPEC 3, "Publishing without a drain").

References nobody here wrote into the engine: the learner model's full forward
``model(input_ids)`` (``replay`` of tests/test_jax_engine.py) and, for the kept KV cache, a
two-call ``forward_cached`` written here from the cache-kept definition (prefix positions
run by the old weights, the rest by the new ones). Tolerance 2e-5 absolute (float32), as
in tests/test_jax_engine.py.

The swap is made observable without the cache effect by variants that change ONLY the
final norm scale: every layer's K/V (hence the cache) is identical under them, so the
full forward of each event's model is the exact reference for that event's tokens, and
the variants' log-probs differ enough that the wrong model would fail the check.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.jax_engine import JaxEngine
from test_jax_engine import LOGP_ATOL, model_a, model_b, replay, tiny_model  # noqa: F401 (fixtures)

PROMPT = [3, 17, 5, 29]
NEW_TOKENS = 96  # prompt + tokens stay within replay's fixed length (128)
SAMPLED = SamplingParams(max_new_tokens=NEW_TOKENS)  # temperature 1, no filtering
ENGINE = dict(num_slots=2, max_len=128, steps_per_call=2)
HOLD_TIMEOUT_S = 60.0
MIN_MODEL_GAP = 1e-3  # the models must differ by more than this on the compared tokens


def norm_variant(model: nnx.Module, scale: float) -> nnx.Module:
    """A copy of ``model`` whose final norm scale is multiplied by ``scale`` (KV unchanged)."""
    graphdef, state = nnx.split(model)
    variant = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    variant.model.norm.scale[...] = variant.model.norm.scale[...] * scale
    return variant


PUBLISH_AT_CHUNKS = (4, 16)  # decode calls that wait for the next publish (of 48)


def hold_decode_for_publishes(engine: JaxEngine, at_chunks) -> set[int]:
    """Test double around the engine's jitted decode: decode call ``at_chunks[j]`` waits
    (on the scheduler thread) until publish j is queued for or installed in the engine,
    so a long request cannot end before the event loop gets to publish, however loaded
    the machine is. Returns the set of j whose decode call is waiting (or has waited)."""
    decode = engine._transitions.decode
    calls = itertools.count()
    publish_number = {chunk: j for j, chunk in enumerate(at_chunks)}
    held_for: set[int] = set()

    def held(param_leaves, state, num_steps):
        j = publish_number.get(next(calls))
        if j is not None:
            held_for.add(j)
        deadline = time.monotonic() + HOLD_TIMEOUT_S
        while j is not None and engine.publish_stats.inflight_publishes <= j and not engine._inbox:
            if time.monotonic() > deadline:
                raise TimeoutError(f"publish {j} was never queued")
            time.sleep(0.001)
        return decode(param_leaves, state, num_steps)

    engine._transitions = engine._transitions._replace(decode=held)
    return held_for


async def wait_for_hold(held_for: set[int], publish: int) -> None:
    """Until the decode call that waits for ``publish`` is reached: the calls since the
    previous publish have given the current event its tokens, and no more come before
    ``publish`` (waiting for "one more token than now" deadlocked when a descheduled event
    loop read the count only after the engine had stopped there)."""
    deadline = time.monotonic() + HOLD_TIMEOUT_S
    while publish not in held_for:
        assert time.monotonic() < deadline, f"the decode call held for publish {publish} was never reached"
        await asyncio.sleep(0.001)


async def generate_across_publishes(model, publishes, seed: int = 7):
    """One long request; each (weights, event) of ``publishes`` is published in flight
    when decode call ``PUBLISH_AT_CHUNKS[j]`` waits for it. Returns
    the result, the engine's publish stats and its outcome counts."""
    engine = JaxEngine(model, **ENGINE)
    held_for = hold_decode_for_publishes(engine, PUBLISH_AT_CHUNKS[: len(publishes)])
    try:
        request = asyncio.create_task(engine.generate(PROMPT, SAMPLED, seed=seed))
        for j, (weights, event) in enumerate(publishes):
            await wait_for_hold(held_for, j)
            await engine.publish_inflight(weights, policy_event=event)
        result = await request
        return result, engine.publish_stats, engine.stats
    finally:
        await engine.close()


def test_request_spanning_inflight_publishes_has_each_events_logprobs(model_a):
    """Two in-flight publishes during one request: tokens of all three events, each
    token's log-prob equals the full forward of its event's model, nothing aborted."""
    models = {0: model_a, 1: norm_variant(model_a, 1.5), 2: norm_variant(model_a, 0.6)}
    publishes = [(nnx.state(models[1]), 1), (models[2], 2)]  # a State and a Module
    result, publish_stats, outcomes = asyncio.run(generate_across_publishes(model_a, publishes))

    assert result.finish_reason == "length" and len(result.token_ids) == NEW_TOKENS
    assert "abort" not in outcomes and outcomes == {"length": 1}
    assert publish_stats.inflight_publishes == 2 and publish_stats.requests_kept_cache == 2
    events = np.asarray(result.events_per_token())
    assert set(events.tolist()) == {0, 1, 2}, events
    assert result.policy_event == 0 and result.event_span == (0, 2)
    logprobs = np.asarray(result.logprobs)
    for event, model in models.items():
        _, expected, _ = replay(model, PROMPT, result.token_ids)
        mine = events == event
        np.testing.assert_allclose(logprobs[mine], expected[mine], atol=LOGP_ATOL, err_msg=f"event {event}")
        if event > 0:  # the previous weights would not pass: the swap really happened
            _, previous, _ = replay(models[event - 1], PROMPT, result.token_ids)
            assert np.abs(previous[mine] - expected[mine]).max() > MIN_MODEL_GAP


def kept_cache_logprobs(old, new, prompt, tokens, num_old_tokens: int) -> np.ndarray:
    """log-probs of ``tokens[num_old_tokens:]`` when the cache of every position before
    the first new-event step was written by ``old`` and the rest is decoded by ``new``.

    Token i is sampled by the step that feeds ids[L-1+i] (ids = prompt + tokens, L =
    len(prompt)) at position L-1+i, so ``old`` wrote positions 0 .. L-2+num_old_tokens.
    """
    return split_cache_logprobs(old, new, prompt, tokens, len(prompt) - 1 + num_old_tokens)[num_old_tokens:]


def split_cache_logprobs(old, new, prompt, tokens, split: int) -> np.ndarray:
    """log-probs of all ``tokens`` when ``old`` wrote the cache of positions 0 .. split-1
    and ``new`` runs positions split .. (split <= len(prompt) - 1 + len(tokens))."""
    ids = np.asarray(list(prompt) + list(tokens), np.int32)
    end = len(prompt) - 1 + len(tokens)  # position L-1+i samples token i
    cache = old.init_cache(1, len(ids), jnp.float32)
    _, cache = old.forward_cached(jnp.asarray(ids[None, :split]), jnp.arange(split)[None, :], cache)
    logits, _ = new.forward_cached(jnp.asarray(ids[None, split:end]), jnp.arange(split, end)[None, :], cache)
    logits = np.asarray(logits[0], np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    first = len(prompt) - 1 - split   # row of position L-1 (negative: old also ran some tokens)
    rows = np.arange(max(first, 0), end - split)
    sampled = np.asarray(tokens)[rows - first]
    return np.concatenate([np.full(max(-first, 0), np.nan), logp[rows, sampled]])


def test_inflight_publish_keeps_the_kv_cache_of_the_old_weights(model_a, model_b):
    """All weights change: tokens after the swap follow the new weights over the OLD cache
    (PipelineRL), not a recompute of the prefix by the new weights."""
    result, _, outcomes = asyncio.run(generate_across_publishes(model_a, [(nnx.state(model_b), 1)]))
    assert outcomes == {"length": 1}
    events = np.asarray(result.events_per_token())
    num_old = int((events == 0).sum())
    assert 0 < num_old < NEW_TOKENS and (events[num_old:] == 1).all()
    logprobs = np.asarray(result.logprobs)
    _, expected_old, _ = replay(model_a, PROMPT, result.token_ids)
    np.testing.assert_allclose(logprobs[:num_old], expected_old[:num_old], atol=LOGP_ATOL)
    expected_kept = kept_cache_logprobs(model_a, model_b, PROMPT, result.token_ids, num_old)
    np.testing.assert_allclose(logprobs[num_old:], expected_kept, atol=LOGP_ATOL)
    _, recomputed, _ = replay(model_b, PROMPT, result.token_ids)
    assert np.abs(recomputed[num_old:] - expected_kept).max() > MIN_MODEL_GAP  # cache matters


def test_inflight_publish_when_idle_and_after_a_drained_publish(model_a, model_b):
    """With nothing decoding the weights install at once; a drained publish queued before
    an in-flight one installs first (submission order); later requests are one event."""

    async def body():
        engine = JaxEngine(model_a, **ENGINE)
        try:
            await engine.publish_inflight(nnx.state(model_b), policy_event=1)
            assert engine.policy_event == 1
            first = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6), seed=1)
            drained = asyncio.create_task(engine.publish(nnx.state(model_a), policy_event=2))
            inflight = asyncio.create_task(engine.publish_inflight(nnx.state(model_b), policy_event=3))
            await asyncio.gather(drained, inflight)
            second = await engine.generate(PROMPT, SamplingParams(max_new_tokens=6), seed=1)
            return first, second, engine.policy_event, engine.publish_stats
        finally:
            await engine.close()

    first, second, event, publish_stats = asyncio.run(body())
    assert first.events_per_token() == (1,) * 6 and first.policy_event == 1
    assert second.events_per_token() == (3,) * 6 and event == 3
    assert second.token_ids == first.token_ids  # same seed, same weights (B)
    assert (publish_stats.inflight_publishes, publish_stats.drained_publishes) == (2, 1)
    assert publish_stats.requests_kept_cache == 0
    _, expected, _ = replay(model_b, PROMPT, first.token_ids)
    np.testing.assert_allclose(first.logprobs, expected, atol=LOGP_ATOL)


def test_inflight_publish_rejects_weights_of_another_shape(model_a):
    other = tiny_model(0)
    other.model.norm.scale = nnx.Param(jnp.ones((7,)))

    async def body():
        engine = JaxEngine(model_a, **ENGINE)
        try:
            with pytest.raises(ValueError, match="parameter tree"):
                await engine.publish_inflight(nnx.state(other), policy_event=1)
            return engine.policy_event
        finally:
            await engine.close()

    assert asyncio.run(body()) == 0


def test_publishes_install_in_call_order_when_a_conversion_is_slow(model_a, model_b):
    """The weight conversion runs in a worker thread; a slow first conversion must not let
    a later publish overtake it (event 3 would be replaced by event 2)."""

    async def body():
        engine = JaxEngine(model_a, **ENGINE)
        convert = engine._to_params

        def slow_for_event_2(weights):
            if weights is slow_weights:
                time.sleep(0.5)
            return convert(weights)

        engine._to_params = slow_for_event_2
        slow_weights = nnx.state(model_a)
        try:
            await asyncio.gather(engine.publish(slow_weights, policy_event=2),
                                 engine.publish_inflight(nnx.state(model_b), policy_event=3))
            return engine.policy_event
        finally:
            await engine.close()

    assert asyncio.run(body()) == 3


TURN = SamplingParams(max_new_tokens=6)


def test_prefix_reuse_across_publish_continues_a_conversation_on_the_old_weights_rows(model_a, model_b):
    """prefix_reuse_across_publish: after an in-flight publish, a conversation's next turn
    prefills only its new tokens on the rows the old weights wrote (counted as stale), and
    samples as the two-model cache reference says; off, or after a drained publish, the
    turn prefills everything with the new weights."""

    async def body(across: bool, drained: bool = False):
        engine = JaxEngine(model_a, num_slots=1, max_len=128, steps_per_call=2,
                           prefix_reuse_across_publish=across)
        try:
            first = await engine.generate([3, 1, 4], TURN, seed=1)
            publish = engine.publish if drained else engine.publish_inflight
            await publish(nnx.state(model_b), policy_event=1)
            follow_up = [3, 1, 4, *first.token_ids, 5]
            second = await engine.generate(follow_up, TURN, seed=2)
            return follow_up, second, engine.prefix_stats
        finally:
            await engine.close()

    follow_up, second, stats = asyncio.run(body(across=True))
    kept = len(follow_up) - 2   # the first turn's prompt and its tokens but the last
    assert (stats.reused_requests, stats.reused_tokens) == (1, kept)
    assert (stats.stale_reused_requests, stats.stale_reused_tokens) == (1, kept)
    expected = split_cache_logprobs(model_a, model_b, follow_up, second.token_ids, split=kept)
    np.testing.assert_allclose(second.logprobs, expected, atol=LOGP_ATOL)
    _, recomputed, _ = replay(model_b, follow_up, second.token_ids)
    assert np.abs(recomputed - expected).max() > MIN_MODEL_GAP   # the old rows matter
    for across, drained in ((False, False), (True, True)):
        follow_up, second, stats = asyncio.run(body(across, drained))
        assert stats.reused_tokens == 0 and stats.stale_reused_requests == 0
        _, recomputed, _ = replay(model_b, follow_up, second.token_ids)
        np.testing.assert_allclose(second.logprobs, recomputed, atol=LOGP_ATOL)
