"""The one-token decode attention (`single_query_attention`) equals the batched
`grouped_query_attention`, and a compiled decode step reads the KV cache in place (no
transposed copy of a cache-sized array: the cause of decode slowing ~10x at context 4096)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spopp_jax.models import ModelConfig, init_model
from spopp_jax.models.attention import DECODE_KEY_BLOCK, single_query_attention
from spopp_jax.models.layers import grouped_query_attention
from spopp_jax.models.testing import tiny_config, tiny_qwen35_hf_config

# Odd cache lengths no other dimension of the tiny models has (to find their arrays in
# HLO): one read in blocks of DECODE_KEY_BLOCK keys, one read as a single block.
BLOCKWISE_CACHE_LEN, ONE_BLOCK_CACHE_LEN = 997, 509
SLOTS = 3


def _inputs(seed: int, batch: int, length: int, kv_heads: int, groups: int, head_dim: int,
            dtype):
    """query, key, value, mask [B, 1, S] of decode positions in [-1, S) (-1: a padding
    row, no allowed key), and the positions."""
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, 1, kv_heads, groups, head_dim))
    key = rng.normal(size=(batch, length, kv_heads, head_dim))
    value = rng.normal(size=(batch, length, kv_heads, head_dim))
    position = rng.integers(-1, length, size=(batch,))
    mask = (np.arange(length)[None, :] <= position[:, None])[:, None, :]
    return (jnp.asarray(query, dtype), jnp.asarray(key, dtype), jnp.asarray(value, dtype),
            jnp.asarray(mask)), position


def _check_against_reference(got, args, position, atol):
    """Rows with an allowed key equal grouped_query_attention (float32 inputs); rows
    without one are 0."""
    want = np.asarray(jax.jit(grouped_query_attention)(*[a.astype(jnp.float32) for a in args[:3]],
                                                       args[3]))
    got = np.asarray(got, np.float32)
    assert got.shape == want.shape
    live = position >= 0
    np.testing.assert_allclose(got[live], want[live], atol=atol, rtol=1e-5)
    assert np.all(got[~live] == 0)


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), length=st.integers(1, 40),
       kv_heads=st.integers(1, 3), groups=st.integers(1, 3), head_dim=st.sampled_from([4, 16]),
       block_size=st.integers(1, 16))
def test_single_query_attention_equals_grouped_query_attention(seed, batch, length, kv_heads,
                                                               groups, head_dim, block_size):
    """One block (key_limit None) and by blocks up to key_limit = max position + 1 (cache
    lengths that are and are not multiples of the block, blocks longer than the cache).
    Jitted: every example has new shapes, and one compile is cheaper than op-by-op
    dispatch (eager: the fixed cases below)."""
    args, position = _inputs(seed, batch, length, kv_heads, groups, head_dim, jnp.float32)
    one_block = jax.jit(single_query_attention)(*args)
    assert one_block.dtype == jnp.float32
    _check_against_reference(one_block, args, position, atol=1e-6)
    blocks = jax.jit(single_query_attention, static_argnums=5)(
        *args, jnp.int32(position.max() + 1), block_size)
    _check_against_reference(blocks, args, position, atol=1e-6)


def test_one_block_and_by_blocks_eager_and_jitted(maybe_jit):
    args, position = _inputs(5, 3, 21, 2, 3, 4, jnp.float32)
    _check_against_reference(maybe_jit(single_query_attention)(*args), args, position, atol=1e-6)
    by_blocks = maybe_jit(single_query_attention, static_argnums=5)(*args, jnp.int32(position.max() + 1), 4)
    _check_against_reference(by_blocks, args, position, atol=1e-6)


def test_blocks_past_the_key_limit_are_not_read():
    """Blocks that start at or past key_limit are never read: NaN there changes nothing."""
    args, position = _inputs(3, 4, 37, 2, 2, 8, jnp.float32)
    limit, block_size = int(position.max()) + 1, 5
    first_unread = -(-limit // block_size) * block_size
    assert first_unread < 37
    query, key, value, mask = args
    poisoned = [x.at[:, first_unread:].set(jnp.nan) for x in (key, value)]
    got = single_query_attention(query, *poisoned, mask, jnp.int32(limit), block_size)
    _check_against_reference(got, args, position, atol=1e-6)


def test_single_query_attention_bfloat16_cache():
    """bf16 cache: float32 scores and sums, bf16 output within bf16 rounding."""
    args, position = _inputs(0, 4, 33, 2, 2, 16, jnp.bfloat16)
    got = single_query_attention(*args, jnp.int32(position.max() + 1), 8)
    assert got.dtype == jnp.bfloat16
    _check_against_reference(got, args, position, atol=2e-2)


def test_single_query_attention_rejects_bad_shapes():
    (query, key, value, mask), _ = _inputs(0, 2, 8, 2, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match=r"query \[B,1,K,G,D\]"):
        single_query_attention(jnp.concatenate([query, query], axis=1), key, value, mask)
    with pytest.raises(ValueError, match="mask"):
        single_query_attention(query, key, value, mask[:, :, :4])
    with pytest.raises(ValueError, match="block_size"):
        single_query_attention(query, key, value, mask, jnp.int32(3), 0)


def _cache_sized_copies(model, cache_len: int) -> list[str]:
    """HLO lines of the compiled one-token `forward_cached` that copy or transpose an
    array with at least as many elements as one key cache."""
    cache = model.init_cache(SLOTS, cache_len)
    cache_elements = min(leaf.size for leaf in jax.tree.leaves(cache) if leaf.ndim == 4)

    token = jnp.ones((SLOTS, 1), jnp.int32)
    position = jnp.full((SLOTS, 1), 5, jnp.int32)
    text = (jax.jit(lambda t, p, c: model.forward_cached(t, p, c), donate_argnums=2)
            .lower(token, position, cache).compile().as_text())
    found = []
    for line in text.splitlines():
        match = re.search(r"= [a-z0-9]+\[([0-9,]*)\]\S* (copy|transpose)\(", line)
        if match and str(cache_len) in match.group(1).split(","):
            if np.prod([int(d) for d in match.group(1).split(",")]) >= cache_elements:
                found.append(line.strip()[:200])
    return found


@pytest.mark.parametrize("name, cache_len", [("qwen3", BLOCKWISE_CACHE_LEN),
                                             ("qwen3_5", BLOCKWISE_CACHE_LEN),
                                             ("qwen3", ONE_BLOCK_CACHE_LEN)])
def test_decode_step_reads_the_cache_in_place(name, cache_len):
    """No transpose/copy of the KV cache per step (with the two einsums of
    `grouped_query_attention`, XLA:CPU transposed both caches to [B, K, ...] every step)."""
    assert ONE_BLOCK_CACHE_LEN <= DECODE_KEY_BLOCK < BLOCKWISE_CACHE_LEN
    if name == "qwen3":
        config = tiny_config("qwen3")
    else:
        config = ModelConfig.from_hf(tiny_qwen35_hf_config())
    assert _cache_sized_copies(init_model(config), cache_len) == []
