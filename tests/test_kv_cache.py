"""KV-cache decode (`init_cache` / `forward_cached`) equals the full forward."""

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from flax import nnx
from hypothesis import given, settings, strategies as st

from spopp_jax.models import AttentionCache, init_model
from spopp_jax.models.cache import write_at_positions
from spopp_jax.models.testing import tiny_config

TOL = 1e-4
VOCAB = 128


@functools.lru_cache(maxsize=None)
def _model(model_type="qwen3", tied=False, attention_chunk_size=1024):
    return init_model(tiny_config(model_type, rope_theta=1e6, tie_word_embeddings=tied),
                      seed=11, attention_chunk_size=attention_chunk_size)


@functools.lru_cache(maxsize=None)
def _jitted_step():
    """forward_cached as a pure jitted function over (graphdef, state), as the engine uses it."""
    @functools.partial(jax.jit, static_argnums=0, donate_argnums=(4,))
    def step(graphdef, state, input_ids, positions, cache):
        return nnx.merge(graphdef, state).forward_cached(input_ids, positions, cache)
    return step


def _step(model, input_ids, positions, cache, jit):
    if not jit:
        return model.forward_cached(jnp.asarray(input_ids), jnp.asarray(positions), cache)
    graphdef, state = nnx.split(model)
    return _jitted_step()(graphdef, state, jnp.asarray(input_ids, jnp.int32),
                          jnp.asarray(positions, jnp.int32), cache)


_FULL_WIDTH = 32


@functools.lru_cache(maxsize=None)
def _jitted_forward():
    return nnx.jit(lambda m, ids, mask: m(ids, attention_mask=mask))


def _full_logits(model, ids):
    """Full (uncached) forward of one sequence, right-padded to one compiled width."""
    ids = np.asarray(ids)
    padded = np.zeros((1, _FULL_WIDTH), np.int32)
    padded[0, :len(ids)] = ids
    mask = np.arange(_FULL_WIDTH)[None] < len(ids)
    logits = _jitted_forward()(model, jnp.asarray(padded), jnp.asarray(mask))
    return np.asarray(logits)[0, :len(ids)]


@pytest.mark.parametrize("model_type,tied,jit,chunk", [
    ("qwen3", False, True, 1024), ("qwen3", True, True, 1024), ("qwen2", False, True, 1024),
    ("qwen3", False, False, 1024),
    ("qwen3", False, True, 4),  # prefill of 9 queries attends in chunks of 4
])
def test_prefill_then_decode_rows_at_different_positions(model_type, tied, jit, chunk):
    model = _model(model_type, tied, chunk)
    rng = np.random.default_rng(0)
    prompt_lengths = [5, 9, 1]
    decode_steps = 6 if jit else 1  # eager dispatch is slow on the shared CPU
    sequences = [rng.integers(0, VOCAB, size=n + decode_steps) for n in prompt_lengths]
    batch, prefill_len = len(sequences), max(prompt_lengths)
    cache = model.init_cache(batch, 32, jnp.float32)
    # Prefill: right-padded, padding positions = -1.
    ids = np.zeros((batch, prefill_len), np.int32)
    positions = np.full((batch, prefill_len), -1, np.int32)
    for row, n in enumerate(prompt_lengths):
        ids[row, :n] = sequences[row][:n]
        positions[row, :n] = np.arange(n)
    logits, cache = _step(model, ids, positions, cache, jit)
    full = [_full_logits(model, seq) for seq in sequences]
    for row, n in enumerate(prompt_lengths):
        np.testing.assert_allclose(np.asarray(logits[row, :n]), full[row][:n], atol=TOL)
    # Token-by-token: every row at its own position.
    for step in range(decode_steps):
        ids = np.array([[seq[n + step]] for seq, n in zip(sequences, prompt_lengths)], np.int32)
        positions = np.array([[n + step] for n in prompt_lengths], np.int32)
        logits, cache = _step(model, ids, positions, cache, jit)
        for row, n in enumerate(prompt_lengths):
            np.testing.assert_allclose(np.asarray(logits[row, 0]), full[row][n + step],
                                       atol=TOL)


def test_stale_cache_entries_and_padding_rows_are_harmless():
    """A reused slot holds another sequence's K/V beyond its position: never attended.
    A row whose positions are all < 0 writes nothing."""
    model = _model()
    rng = np.random.default_rng(1)
    cache = model.init_cache(2, 16, jnp.float32)
    garbage = [(rng.normal(size=c.key.shape).astype(np.float32),
                rng.normal(size=c.value.shape).astype(np.float32)) for c in cache]
    stale_cache = tuple(AttentionCache(key=jnp.asarray(k), value=jnp.asarray(v))
                        for k, v in garbage)
    seq = rng.integers(0, VOCAB, size=7)
    ids = np.stack([seq, seq]).astype(np.int32)
    positions = np.stack([np.arange(7), np.full(7, -1)]).astype(np.int32)
    logits, new_cache = _step(model, ids, positions, stale_cache, jit=True)  # donated
    np.testing.assert_allclose(np.asarray(logits[0]), _full_logits(model, seq), atol=TOL)
    for (old_key, old_value), new in zip(garbage, new_cache):
        np.testing.assert_array_equal(np.asarray(new.key[1]), old_key[1])
        np.testing.assert_array_equal(np.asarray(new.value[1]), old_value[1])
        np.testing.assert_array_equal(np.asarray(new.key[0, 7:]), old_key[0, 7:])
        assert not np.array_equal(np.asarray(new.key[0, :7]), old_key[0, :7])
    assert np.all(np.isfinite(np.asarray(logits)))


def test_bfloat16_cache():
    model = _model()
    seq = np.random.default_rng(2).integers(0, VOCAB, size=6).astype(np.int32)
    cache = model.init_cache(1, 8, jnp.bfloat16)
    assert all(c.key.dtype == jnp.bfloat16 for c in cache)
    logits, cache = _step(model, seq[None], np.arange(6)[None], cache, jit=True)
    assert logits.dtype == jnp.float32 and cache[0].key.dtype == jnp.bfloat16
    full = _full_logits(model, seq)
    assert np.abs(np.asarray(logits[0]) - full).max() < 0.05 * np.abs(full).max()


def test_write_at_positions_hand_example():
    buffer = jnp.zeros((2, 4, 1))
    update = jnp.array([[[1.0], [2.0]], [[3.0], [4.0]]])
    positions = jnp.array([[2, 3], [-1, 0]])
    got = np.asarray(write_at_positions(buffer, update, positions))[..., 0]
    np.testing.assert_array_equal(got, [[0, 0, 1, 2], [4, 0, 0, 0]])


def test_forward_cached_rejects_bad_shapes():
    model = _model()
    cache = model.init_cache(1, 8)
    with pytest.raises(ValueError, match="positions"):
        model.forward_cached(jnp.zeros((1, 3), jnp.int32), jnp.zeros((1, 2), jnp.int32), cache)


@settings(max_examples=10, deadline=None)
@given(chunks=st.lists(st.integers(1, 5), min_size=1, max_size=5), seed=st.integers(0, 2**16))
def test_chunked_prefill_equals_full_forward(chunks, seed):
    """Feeding a sequence in arbitrary chunks gives the full forward's logits."""
    model = _model()
    total = sum(chunks)
    seq = np.random.default_rng(seed).integers(0, VOCAB, size=total).astype(np.int32)
    full = _full_logits(model, seq)
    cache = model.init_cache(1, 32)
    start = 0
    for size in chunks:
        ids = np.zeros((1, 5), np.int32)  # fixed width: one compiled shape
        positions = np.full((1, 5), -1, np.int32)
        ids[0, :size] = seq[start:start + size]
        positions[0, :size] = np.arange(start, start + size)
        logits, cache = _step(model, ids, positions, cache, jit=True)
        np.testing.assert_allclose(np.asarray(logits[0, :size]), full[start:start + size],
                                   atol=TOL)
        start += size
