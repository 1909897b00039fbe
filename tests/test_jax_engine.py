"""Tests of the embedded JAX rollout engine and its sampling ops.

References nobody here wrote: NumPy float64 log-softmax / top-k / top-p written from the
definitions in the engine contract (docs/DESIGN.md), and the learner model's full forward
``model(input_ids)`` recomputed token by token. Tolerance for engine log-probs against
the full forward: 2e-5 absolute (float32; measured ~3e-7 on the tiny model).
"""

from __future__ import annotations

import asyncio
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rollout_bridge.engine.base import SamplingParams
from rollout_bridge.engine.jax_engine import JaxEngine, _fine_bucket, prng_key_data
from rollout_bridge.engine.sampling_ops import allowed_token_mask, sample_tokens, scaled_log_probs
from rollout_bridge.engine.slot_decode import chunk_uniforms
from spopp_jax.models import ModelConfig, init_model

LOGP_ATOL = 2e-5
VOCAB = 48


# --------------------------------------------------------------------------- references
def np_log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def np_allowed(logp: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, float]:
    """Allowed set of one row from the definition; also the distance of top_p to the
    nearest cumulative-mass boundary (to skip cases float32 cannot decide)."""
    vocab = logp.shape[0]
    order = sorted(range(vocab), key=lambda i: (-logp[i], i))
    k = vocab if top_k <= 0 or top_k >= vocab else top_k
    kept = order[:k]
    probs = np.exp(logp[kept] - np.log(np.exp(logp[kept]).sum()))
    allowed = np.zeros(vocab, bool)
    mass = 0.0
    margin = np.inf
    for rank, token in enumerate(kept):
        if rank > 0 and top_p < 1.0:
            margin = min(margin, abs(mass - top_p))
            if mass >= top_p:
                break
        allowed[token] = True
        mass += probs[rank]
    return allowed, margin


REPLAY_LEN = 128
_full_forward = nnx.jit(lambda model, ids: model(ids))


def replay(model, prompt: list[int], tokens, temperature: float = 1.0):
    """Per generated token: (argmax, log_softmax(logits / T)[token], top-2 gap) of the
    learner's full forward ``model(input_ids)``. The forward is causal, so one call over
    prompt + tokens (right-padded to a fixed length) gives, at index t, the logits the
    step-by-step forward of ids[:t + 1] would give."""
    ids = list(prompt) + [int(t) for t in tokens]
    assert len(ids) <= REPLAY_LEN
    padded = np.zeros((1, REPLAY_LEN), np.int32)
    padded[0, : len(ids)] = ids
    all_logits = np.asarray(_full_forward(model, jnp.asarray(padded))[0], np.float64)
    argmaxes, logps, gaps = [], [], []
    for i, token in enumerate(tokens):
        logits = all_logits[len(prompt) - 1 + i]
        top2 = np.sort(logits)[-2:]
        argmaxes.append(int(np.argmax(logits)))
        logps.append(np_log_softmax(logits, temperature)[token])
        gaps.append(top2[1] - top2[0])
    return argmaxes, np.array(logps), np.array(gaps)


# --------------------------------------------------------------------------- fixtures
def tiny_model(seed: int):
    """hidden 32, 2 layers; weights scaled up so next-token distributions are peaked."""
    config = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = init_model(config, seed=seed)
    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda x: x * 6.0 if x.ndim == 2 else x, state))
    return model


@pytest.fixture(scope="module")
def model_a():
    return tiny_model(0)


@pytest.fixture(scope="module")
def model_b():
    return tiny_model(1)


def run(coro):
    return asyncio.run(coro)


async def wait_until(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.001)


async def with_engine(model, body, **kwargs):
    kwargs = {"num_slots": 4, "max_len": 64, "steps_per_call": 4, **kwargs}
    engine = JaxEngine(model, **kwargs)
    try:
        return await body(engine)
    finally:
        await engine.close()


GREEDY = SamplingParams(top_k=1, max_new_tokens=12)
LONG = dict(num_slots=2, max_len=512)  # the engine shape of the long-request tests (one compile)


# --------------------------------------------------------------------------- sampling ops
_sample_many = jax.jit(jax.vmap(sample_tokens, in_axes=(None, None, None, None, 0)))
_allowed_jit = jax.jit(lambda logits, temperature, top_k, top_p: allowed_token_mask(
    scaled_log_probs(logits, temperature), top_k, top_p))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.25, 4.0),
    top_k=st.integers(-1, VOCAB + 2),
    top_p=st.floats(0.05, 1.0),
)
def test_sampled_token_inside_allowed_set_with_unfiltered_logprob(seed, temperature, top_k, top_p):
    rng = np.random.default_rng(seed)
    vocab = 12
    logits = rng.normal(size=(3, vocab)).astype(np.float32) * 3.0
    logits[0, 1] = logits[0, 4]  # a tie: ranks break towards the lower id
    top_k = 0 if top_k == 0 else min(top_k, vocab + 2)
    reference = [np_allowed(np_log_softmax(row, temperature), top_k, top_p) for row in logits]
    assume(all(margin > 1e-4 for _, margin in reference))
    batch = logits.shape[0]
    keys = jax.random.split(jax.random.PRNGKey(seed), 16 * batch).reshape(16, batch, 2)
    temperature_b = jnp.full((batch,), temperature, jnp.float32)
    top_k_b = jnp.full((batch,), top_k, jnp.int32)
    top_p_b = jnp.full((batch,), top_p, jnp.float32)
    mask = np.asarray(_allowed_jit(jnp.asarray(logits), temperature_b, top_k_b, top_p_b))
    for row in range(batch):
        np.testing.assert_array_equal(mask[row], reference[row][0])
    tokens, logps = _sample_many(jnp.asarray(logits), temperature_b, top_k_b, top_p_b, keys)
    tokens, logps = np.asarray(tokens), np.asarray(logps)
    for row in range(batch):
        allowed = reference[row][0]
        assert allowed[tokens[:, row]].all()
        expected = np_log_softmax(logits[row], temperature)[tokens[:, row]]
        np.testing.assert_allclose(logps[:, row], expected, atol=1e-5)


def test_top_k_one_is_argmax_with_lowest_id_on_ties(maybe_jit):
    logits = jnp.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    ones = jnp.ones((2,), jnp.float32)
    tokens, logps = maybe_jit(sample_tokens)(logits, ones, jnp.array([1, 1]), ones, jax.random.split(jax.random.PRNGKey(0), 2))
    np.testing.assert_array_equal(tokens, [1, 0])
    np.testing.assert_allclose(logps, [np_log_softmax(logits[0], 1.0)[1], np_log_softmax(logits[1], 1.0)[0]], atol=1e-6)


def test_sample_frequencies_match_renormalised_distribution(maybe_jit):
    """Plain sampling follows softmax(logits/T); top-k=2 follows it renormalised on the top 2."""
    logits = np.array([1.0, 0.0, -0.5, 0.7], np.float32)
    temperature, draws = 1.5, 20_000
    keys = jax.random.split(jax.random.PRNGKey(3), draws)
    batch_logits = jnp.broadcast_to(jnp.asarray(logits), (draws, 4))
    temp = jnp.full((draws,), temperature, jnp.float32)
    ones = jnp.ones((draws,), jnp.float32)
    probs = np.exp(np_log_softmax(logits, temperature))
    for top_k, expected in [(-1, probs), (2, np.where([1, 0, 0, 1], probs, 0) / (probs[0] + probs[3]))]:
        tokens, _ = maybe_jit(sample_tokens)(batch_logits, temp, jnp.full((draws,), top_k), ones, keys)
        freq = np.bincount(np.asarray(tokens), minlength=4) / draws
        # 5 standard errors of a binomial frequency with n = 20000
        np.testing.assert_allclose(freq, expected, atol=5 * np.sqrt(0.25 / draws))


def test_sampling_ops_reject_bad_shapes():
    logits = jnp.zeros((2, 5))
    with pytest.raises(ValueError, match="temperature"):
        scaled_log_probs(logits, jnp.ones((3,)))
    with pytest.raises(ValueError, match="logits"):
        scaled_log_probs(jnp.zeros((5,)), jnp.ones((5,)))
    with pytest.raises(ValueError, match="top_k"):
        allowed_token_mask(logits, jnp.ones((1,), jnp.int32), jnp.ones((2,)))


def test_prng_key_data_equals_jax_prngkey_and_keeps_high_bits():
    for seed in [0, 1, 12345, 2**32 - 1]:
        np.testing.assert_array_equal(prng_key_data(seed), np.asarray(jax.random.PRNGKey(seed)))
    np.testing.assert_array_equal(prng_key_data(2**32 + 5), [1, 5])



def test_chunk_uniforms_equal_one_fold_in_per_token():
    """A chunk's uniforms drawn at once (slot_decode.chunk_uniforms) are bit for bit the
    per-token draws 1 - uniform(fold_in(key_s, n_s + j)) of the engine contract."""
    rng = np.random.default_rng(0)
    keys = jnp.asarray(np.stack([prng_key_data(int(s)) for s in rng.integers(0, 2**62, 5)]))
    counts = jnp.asarray(rng.integers(0, 1000, 5), jnp.int32)
    got = np.asarray(jax.jit(chunk_uniforms, static_argnums=2)(keys, counts, 3))
    assert got.shape == (3, 5)
    for j in range(3):
        for s in range(5):
            key = jax.random.fold_in(keys[s], counts[s] + j)
            want = 1.0 - jax.random.uniform(key, (), dtype=jnp.float32)
            assert got[j, s] == np.float32(want)


def test_sampled_tokens_follow_the_key_schedule_across_chunks(model_a):
    """Token i of a request with seed r is the inverse-CDF sample of the full forward's
    softmax at u_i = 1 - uniform(fold_in(PRNGKey(r), i)) (NumPy float64), across decode
    chunks of 3 steps; tokens whose u lies within 1e-4 of a CDF step are not judged."""
    params = SamplingParams(temperature=1.0, max_new_tokens=11)
    prompt = [5, 1, 7, 2]

    async def body(engine):
        return await engine.generate(prompt, params, seed=2024)

    result = run(with_engine(model_a, body, steps_per_call=3))
    ids = np.zeros((1, REPLAY_LEN), np.int32)
    ids[0, : len(prompt) + len(result.token_ids)] = list(prompt) + list(result.token_ids)
    all_logits = np.asarray(_full_forward(model_a, jnp.asarray(ids))[0], np.float64)
    judged = 0
    for i, token in enumerate(result.token_ids):
        u = 1.0 - float(jax.random.uniform(jax.random.fold_in(jax.random.PRNGKey(2024), i), ()))
        cdf = np.cumsum(np.exp(np_log_softmax(all_logits[len(prompt) - 1 + i], 1.0)))
        if np.min(np.abs(cdf - u * cdf[-1])) < 1e-4:
            continue
        judged += 1
        assert token == int(np.sum(cdf < u * cdf[-1])), f"token {i}"
    assert judged >= 8


def test_decode_steps_per_call_change_no_sampled_token(model_a):
    """`steps_per_call` is how many decode steps one host round trip runs. A request's
    samples depend only on its seed and token position (`chunk_uniforms`), so engines of
    1, 3 and 8 steps per call give the same tokens and log-probs to the same seeded
    requests: 8 requests on 4 slots (slots refilled), stop tokens ending some mid-chunk.
    (Why the prior and evaluation records do not key it: `JaxEngineConfig.record_key`.)"""
    prompts = [[5, 1, 7, 2], [3, 3], [9, 4, 4, 1, 8, 2, 6], [2], [7, 7, 7], [1, 2], [6], [8, 5]]

    async def body(engine):
        return await asyncio.gather(*(
            engine.generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=3 + 2 * i,
                                                   stop_token_ids=(3, 11)), seed=100 + i)
            for i, prompt in enumerate(prompts)))

    runs = {steps: run(with_engine(model_a, body, steps_per_call=steps)) for steps in (1, 3, 8)}
    reference = runs[1]
    assert {r.finish_reason for r in reference} == {"stop", "length"}
    for steps, results in runs.items():
        for result, expected in zip(results, reference):
            assert result.token_ids == expected.token_ids, f"steps_per_call={steps}"
            np.testing.assert_allclose(result.logprobs, expected.logprobs, rtol=0, atol=1e-6)


# --------------------------------------------------------------------------- engine
def test_greedy_decode_equals_full_forward_argmax_and_logprobs(model_a):
    """6 requests of different prompt lengths over 4 slots (slots are reused)."""
    prompts = [[3], [5, 9], [1, 2, 3, 4, 5, 6, 7], [11] * 20, [7, 8], list(range(30))]

    async def body(engine):
        return await asyncio.gather(*[engine.generate(p, GREEDY) for p in prompts])

    results = run(with_engine(model_a, body))
    for prompt, result in zip(prompts, results):
        assert result.finish_reason == "length" and len(result.token_ids) == GREEDY.max_new_tokens
        argmaxes, logps, gaps = replay(model_a, prompt, result.token_ids)
        assert gaps.min() > 1e-3  # the argmax is well defined at fp32
        assert list(result.token_ids) == argmaxes
        np.testing.assert_allclose(result.logprobs, logps, atol=LOGP_ATOL)
        assert result.policy_event == 0


def test_sampled_logprobs_use_the_temperature_of_the_request(model_a):
    params = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=10)
    prompt = [4, 4, 2]

    async def body(engine):
        return await engine.generate(prompt, params, seed=123)

    result = run(with_engine(model_a, body))
    _, logps, _ = replay(model_a, prompt, result.token_ids, temperature=0.7)
    np.testing.assert_allclose(result.logprobs, logps, atol=LOGP_ATOL)


def test_same_seed_same_tokens_regardless_of_other_requests(model_a):
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    prompt = [9, 8, 7]

    async def alone(engine):
        return await engine.generate(prompt, params, seed=7)

    async def crowded(engine):
        others = [engine.generate([1 + i, 2], params, seed=100 + i) for i in range(5)]
        results = await asyncio.gather(*others[:2], engine.generate(prompt, params, seed=7), *others[2:])
        return results[2]

    first = run(with_engine(model_a, alone))
    second = run(with_engine(model_a, crowded))
    assert first.token_ids == second.token_ids
    np.testing.assert_allclose(first.logprobs, second.logprobs, atol=LOGP_ATOL)


def test_short_request_returns_while_long_one_decodes_and_loop_stays_responsive(model_a):
    async def body(engine):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.005)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        long = asyncio.create_task(engine.generate([1, 2], SamplingParams(max_new_tokens=400)))
        short = asyncio.create_task(engine.generate([3, 4, 5], SamplingParams(max_new_tokens=3)))
        done, _ = await asyncio.wait({long, short}, return_when=asyncio.FIRST_COMPLETED)
        short_first = done == {short} and not long.done()
        result_long = await long
        tick_task.cancel()
        return short_first, short.result(), result_long, ticks

    short_first, short, long, ticks = run(with_engine(model_a, body, **LONG))
    assert short_first
    assert len(short.token_ids) == 3 and len(long.token_ids) == 400
    assert ticks > 0


def test_stop_tokens_and_length_limits(model_a):
    prompt = [2, 3, 5]

    async def body(engine):
        free = await engine.generate(prompt, GREEDY)
        tokens = list(free.token_ids)
        # first position whose token did not occur before it: stopping there is unambiguous
        cut = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
        stop_params = SamplingParams(top_k=1, max_new_tokens=12, stop_token_ids=(VOCAB - 1, tokens[cut]))
        stopped = await engine.generate(prompt, stop_params)
        short = await engine.generate(prompt, SamplingParams(top_k=1, max_new_tokens=5))
        capped = await engine.generate([i % VOCAB for i in range(60)], SamplingParams(top_k=1, max_new_tokens=50))
        return tokens, cut, stopped, short, capped

    tokens, cut, stopped, short, capped = run(with_engine(model_a, body, max_len=64))
    assert stopped.finish_reason == "stop" and list(stopped.token_ids) == tokens[: cut + 1]
    assert short.finish_reason == "length" and list(short.token_ids) == tokens[:5]
    # 60 prompt tokens fill cache indices 0..59; the tokens fed at 59..63 yield 5 samples
    assert capped.finish_reason == "length" and len(capped.token_ids) == 64 - 60 + 1


def test_publish_switches_weights_and_waits_for_in_flight_requests(model_a, model_b):
    prompt = [6, 1, 6]
    order = []

    async def body(engine):
        long = asyncio.create_task(engine.generate(prompt, SamplingParams(top_k=1, max_new_tokens=40)))
        # decoding (a queued request would start on the new weights)
        await wait_until(lambda: engine.num_running == 1 or long.done())
        publish = asyncio.create_task(engine.publish(nnx.state(model_b), policy_event=1))
        long.add_done_callback(lambda _: order.append("long"))
        publish.add_done_callback(lambda _: order.append("publish"))
        await publish
        after = await engine.generate(prompt, GREEDY)
        return await long, after, engine.policy_event

    old, new, event = run(with_engine(model_a, body))
    assert order == ["long", "publish"], order
    assert event == 1
    assert old.policy_event == 0 and new.policy_event == 1
    argmax_a, logp_a, _ = replay(model_a, prompt, old.token_ids)
    assert list(old.token_ids) == argmax_a
    np.testing.assert_allclose(old.logprobs, logp_a, atol=LOGP_ATOL)
    argmax_b, logp_b, _ = replay(model_b, prompt, new.token_ids)
    assert list(new.token_ids) == argmax_b
    np.testing.assert_allclose(new.logprobs, logp_b, atol=LOGP_ATOL)


def test_publish_lets_running_requests_finish_and_starts_queued_ones_on_new_weights(model_a, model_b):
    """2 slots busy (480-token requests) + 1 queued at publish: the running ones finish on A
    (event 0), the queued one starts after the swap on B (event 1)."""
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    lengths = [480, 480, 12]

    async def body(engine):
        tasks = [asyncio.create_task(engine.generate(p, SamplingParams(top_k=1, max_new_tokens=n)))
                 for p, n in zip(prompts, lengths)]
        await wait_until(lambda: engine.num_running == 2)
        await engine.publish(nnx.state(model_b), policy_event=1)
        return await asyncio.gather(*tasks)

    results = run(with_engine(model_a, body, **LONG))
    assert [r.policy_event for r in results] == [0, 0, 1]
    assert [len(r.token_ids) for r in results] == lengths
    for prompt, result, model in zip(prompts, results, [model_a, model_a, model_b]):
        head = result.token_ids[:100]  # causal: a prefix replays on its own
        argmaxes, logps, _ = replay(model, prompt, head)
        assert list(head) == argmaxes
        np.testing.assert_allclose(result.logprobs[:100], logps, atol=LOGP_ATOL)


def test_prefill_is_bucketed_and_decode_compiles_once(model_a):
    """10 prompt lengths admitted one at a time: at most the 5 prefix-width buckets of
    max_len 64 (16, 24, 32, 48, 64) compile for admission, and decode compiles at most once."""
    lengths = [1, 2, 5, 9, 17, 20, 31, 33, 47, 60]

    async def body(engine):
        prefill, decode = engine._prefill, engine._transitions.decode
        before = len(prefill.compiled_shapes), decode._cache_size()
        for n in lengths:
            await engine.generate([i % VOCAB for i in range(n)], SamplingParams(max_new_tokens=3))
        after = len(prefill.compiled_shapes), decode._cache_size()
        return before, after

    (admit0, decode0), (admit1, decode1) = run(with_engine(model_a, body))
    assert admit1 - admit0 <= 5
    assert decode1 - decode0 <= 1


def test_a_failed_prefill_fails_its_requests_instead_of_hanging_them(model_a, monkeypatch):
    """A prefill that raises (a compile error, memory) stops the engine: the requests it was
    admitting, and those queued behind them, fail with the engine's error."""
    from rollout_bridge.engine import jax_engine

    def broken_batch(*args):
        raise MemoryError("no room for the prefill")

    monkeypatch.setattr(jax_engine, "_requests_batch", broken_batch)

    async def body(engine):
        calls = [engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)) for _ in range(6)]
        return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 60)

    outcomes = run(with_engine(model_a, body))
    assert len(outcomes) == 6
    assert all(isinstance(o, RuntimeError) and "no room for the prefill" in str(o) for o in outcomes)


@pytest.mark.parametrize("n", list(range(1, 130)) + [1000, 1025, 1537, 2047])
def test_fine_bucket_pads_less_than_half(n):
    """Sizes 2^k or 3 * 2^(k-1): never below n, under 1.5 n, clipped to [minimum, maximum]."""
    size = _fine_bucket(n, 1, 1 << 20)
    assert n <= size < 1.5 * n + 1
    assert size & (size - 1) == 0 or (size % 3 == 0 and (size // 3) & (size // 3 - 1) == 0)
    assert _fine_bucket(n, 256, 1 << 20) == max(256, size)
    assert _fine_bucket(n, 1, 64) == min(size, 64)


def test_publish_rejects_weights_of_another_shape(model_a):
    other = init_model(ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=8))

    async def body(engine):
        with pytest.raises(ValueError, match="weights"):
            await engine.publish(nnx.state(other), policy_event=1)
        with pytest.raises(ValueError, match="weights"):
            await engine.publish(nnx.to_pure_dict(nnx.state(other)), policy_event=1)
        return engine.policy_event

    assert run(with_engine(model_a, body)) == 0


def test_publish_accepts_a_module_and_a_pure_dict(model_a, model_b):
    """The learner publishes a merged module (train.py) or its pure-dict params."""
    prompt = [3, 1, 4]

    async def body(engine):
        await engine.publish(model_b, policy_event=1)
        from_module = await engine.generate(prompt, GREEDY)
        await engine.publish(nnx.to_pure_dict(nnx.state(model_a)), policy_event=2)
        from_dict = await engine.generate(prompt, GREEDY)
        return from_module, from_dict

    from_module, from_dict = run(with_engine(model_a, body))
    assert (from_module.policy_event, from_dict.policy_event) == (1, 2)
    for model, result in [(model_b, from_module), (model_a, from_dict)]:
        argmaxes, logps, _ = replay(model, prompt, result.token_ids)
        assert list(result.token_ids) == argmaxes
        np.testing.assert_allclose(result.logprobs, logps, atol=LOGP_ATOL)


def test_abort_all_finishes_in_flight_and_queued_requests(model_a):
    """6 long requests on 2 slots: 2 decoding, 4 queued when abort_all arrives."""

    async def body(engine):
        tasks = [asyncio.create_task(engine.generate([i + 1], SamplingParams(max_new_tokens=500))) for i in range(6)]
        await wait_until(lambda: engine.num_running == 2)
        await engine.abort_all()
        aborted = await asyncio.gather(*tasks)
        after = await engine.generate([1], SamplingParams(max_new_tokens=4))
        return aborted, after, engine.stats

    aborted, after, stats = run(with_engine(model_a, body, **LONG))
    assert [r.finish_reason for r in aborted] == ["abort"] * 6
    assert all(len(r.token_ids) < 500 and len(r.token_ids) == len(r.logprobs) for r in aborted)
    assert sum(len(r.token_ids) == 0 for r in aborted) >= 4  # the queued ones never started
    assert after.finish_reason == "length" and len(after.token_ids) == 4
    assert stats == {"abort": 6, "length": 1}


def test_cancelled_request_frees_its_slot(model_a):
    async def body(engine):
        hogs = [asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=500))) for _ in range(2)]
        await wait_until(lambda: engine.num_running == 2)
        for hog in hogs:
            hog.cancel()
        result = await asyncio.wait_for(engine.generate([2], SamplingParams(max_new_tokens=3)), timeout=60)
        return result, engine.stats

    result, stats = run(with_engine(model_a, body, **LONG))
    assert len(result.token_ids) == 3
    assert stats == {"cancelled": 2, "length": 1}


def test_close_aborts_in_flight_requests_and_refuses_new_ones(model_a):
    async def body():
        engine = JaxEngine(model_a, steps_per_call=4, **LONG)
        task = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=500)))
        await wait_until(lambda: engine.num_running == 1)
        await engine.close()
        result = await task
        with pytest.raises(RuntimeError, match="closed"):
            await engine.generate([1], GREEDY)
        await engine.close()  # idempotent
        return result

    result = run(body())
    assert result.finish_reason == "abort" and len(result.token_ids) < 500


def test_generate_validates_its_inputs(model_a):
    async def body(engine):
        with pytest.raises(ValueError, match="prompt_ids"):
            await engine.generate([], GREEDY)
        with pytest.raises(ValueError, match="prompt_ids"):
            await engine.generate(list(range(VOCAB)) + [0] * 20, GREEDY)
        with pytest.raises(ValueError, match="prompt_ids"):
            await engine.generate([VOCAB], GREEDY)
        with pytest.raises(ValueError, match="stop_token_ids"):
            await engine.generate([1], SamplingParams(stop_token_ids=tuple(range(9))))
        return True

    assert run(with_engine(model_a, body))


# --------------------------------------------------------------------------- prefix reuse
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=6)


async def _conversations(engine, openings, turns: int, observation=(5, 6, 7)):
    """Each conversation: prompt, reply, prompt + reply + observation, reply, ... (the
    agent loop's token stream), all conversations at once. Returns per conversation the
    (prompt, result) of every turn."""
    async def talk(index, opening):
        prompt, history = list(opening), []
        for turn in range(turns):
            result = await engine.generate(prompt, SAMPLED, seed=100 * index + turn)
            history.append((list(prompt), result))
            prompt = prompt + list(result.token_ids) + list(observation)
        return history

    return await asyncio.gather(*[talk(i, o) for i, o in enumerate(openings)])


def test_next_turn_prefills_only_its_new_tokens_and_samples_as_a_full_prefill(model_a):
    """4 conversations x 3 turns over 4 slots: turns 2 and 3 read the previous turn's rows
    (counted), and every turn's tokens and log-probs are those of the full forward and of
    an engine that prefills everything."""
    openings = [[3, 1], [9, 9, 2], [4], [8, 7, 6, 5]]

    async def body(engine):
        return await _conversations(engine, openings, turns=3), engine.prefix_stats

    reused, stats = run(with_engine(model_a, body, max_len=128))
    full, full_stats = run(with_engine(model_a, body, max_len=128, prefix_reuse=False))
    assert full_stats.reused_tokens == 0
    assert stats.reused_requests == 8  # every later turn of every conversation
    kept = sum(len(prompt) + len(result.token_ids) - 1 for history in reused for prompt, result in history[:-1])
    assert stats.reused_tokens == kept and stats.prefilled_tokens == full_stats.prefilled_tokens - kept
    for history, history_full in zip(reused, full):
        for (prompt, result), (prompt_full, result_full) in zip(history, history_full):
            assert prompt == prompt_full and result.token_ids == result_full.token_ids
            _, logps, _ = replay(model_a, prompt, result.token_ids)
            np.testing.assert_allclose(result.logprobs, logps, atol=LOGP_ATOL)
            np.testing.assert_allclose(result.logprobs, result_full.logprobs, atol=LOGP_ATOL)


def test_a_publish_forgets_kept_rows_and_another_conversation_never_reads_them(model_a, model_b):
    async def body(engine):
        first = await engine.generate([3, 1, 4], SAMPLED, seed=1)
        await engine.publish(nnx.state(model_b), policy_event=1)
        follow_up = [3, 1, 4, *first.token_ids, 5]
        second = await engine.generate(follow_up, SAMPLED, seed=2)   # rows of the old weights: not read
        after_publish = engine.prefix_stats.reused_tokens
        other = await engine.generate([2, 7, 1, 8], SAMPLED, seed=3)   # not an extension: not read
        return follow_up, second, after_publish, other, engine.prefix_stats

    follow_up, second, after_publish, other, stats = run(with_engine(model_a, body, num_slots=1))
    assert after_publish == 0 and stats.reused_tokens == 0 and stats.reused_requests == 0
    for prompt, result in ((follow_up, second), ([2, 7, 1, 8], other)):
        _, logps, _ = replay(model_b, prompt, result.token_ids)
        np.testing.assert_allclose(result.logprobs, logps, atol=LOGP_ATOL)
