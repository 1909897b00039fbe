"""The one-token decode attention (`single_query_attention`) equals the batched
`grouped_query_attention`, and a compiled decode step reads the KV cache in place (no
transposed copy of a cache-sized array: the cause of decode slowing ~10x at context 4096)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from spopp_jax.models import init_model
from spopp_jax.models.attention import single_query_attention
from spopp_jax.models.layers import grouped_query_attention
from spopp_jax.models.testing import tiny_config, tiny_qwen35_hf_config
from spopp_jax.models.config import ModelConfig

# An odd cache length no other dimension of the tiny models has, to find its arrays in HLO.
DISTINCT_CACHE_LEN = 997
SLOTS = 3


def _inputs(seed: int, batch: int, length: int, kv_heads: int, groups: int, head_dim: int,
            dtype):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(batch, 1, kv_heads, groups, head_dim))
    key = rng.normal(size=(batch, length, kv_heads, head_dim))
    value = rng.normal(size=(batch, length, kv_heads, head_dim))
    position = rng.integers(-1, length, size=(batch,))  # -1: a padding row, no key
    mask = (np.arange(length)[None, :] <= position[:, None])[:, None, :]
    return (jnp.asarray(query, dtype), jnp.asarray(key, dtype), jnp.asarray(value, dtype),
            jnp.asarray(mask))


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch=st.integers(1, 4), length=st.integers(1, 40),
       kv_heads=st.integers(1, 3), groups=st.integers(1, 3), head_dim=st.sampled_from([4, 16]))
def test_single_query_attention_equals_grouped_query_attention(seed, batch, length, kv_heads,
                                                               groups, head_dim):
    args = _inputs(seed, batch, length, kv_heads, groups, head_dim, jnp.float32)
    got = single_query_attention(*args)
    want = grouped_query_attention(*args)
    assert got.shape == want.shape and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-5)


def test_single_query_attention_bfloat16_cache():
    """bf16 cache: float32 scores and sums, bf16 output within bf16 rounding."""
    args = _inputs(0, 4, 33, 2, 2, 16, jnp.bfloat16)
    got = single_query_attention(*args)
    want = grouped_query_attention(*[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a
                                     for a in args])
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2)


def test_single_query_attention_rejects_several_queries():
    query, key, value, mask = _inputs(0, 2, 8, 2, 2, 4, jnp.float32)
    with pytest.raises(ValueError, match=r"query \[B,1,K,G,D\]"):
        single_query_attention(jnp.concatenate([query, query], axis=1), key, value, mask)


def _cache_sized_copies(model) -> list[str]:
    """HLO lines of the compiled one-token `forward_cached` that copy or transpose an
    array with at least as many elements as one key cache."""
    cache = model.init_cache(SLOTS, DISTINCT_CACHE_LEN)
    cache_elements = min(leaf.size for leaf in jax.tree.leaves(cache) if leaf.ndim == 4)

    token = jnp.ones((SLOTS, 1), jnp.int32)
    position = jnp.full((SLOTS, 1), 5, jnp.int32)
    text = (jax.jit(lambda t, p, c: model.forward_cached(t, p, c), donate_argnums=2)
            .lower(token, position, cache).compile().as_text())
    found = []
    for line in text.splitlines():
        match = re.search(r"= [a-z0-9]+\[([0-9,]*)\]\S* (copy|transpose)\(", line)
        if match and str(DISTINCT_CACHE_LEN) in match.group(1).split(","):
            if np.prod([int(d) for d in match.group(1).split(",")]) >= cache_elements:
                found.append(line.strip()[:200])
    return found


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_decode_step_reads_the_cache_in_place(name):
    """No transpose/copy of the KV cache per step (with the two einsums of
    `grouped_query_attention`, XLA:CPU transposed both caches to [B, K, ...] every step)."""
    if name == "qwen3":
        config = tiny_config("qwen3")
    else:
        config = ModelConfig.from_hf(tiny_qwen35_hf_config())
    assert _cache_sized_copies(init_model(config)) == []
