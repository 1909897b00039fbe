"""Causal query blocks (`causal_block_attention`) = dense masked attention on real tokens.

The reference is the dense [T, T] attention of `chunked_attention` with one chunk (the
formula of SPEC's model: softmax(q k^T / sqrt(D) + mask) v over all keys), compared on
real query tokens, with gradients of a loss that weighs only real tokens.
"""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from spopp_jax.models.attention import (ATTENTION_REMAT_SCORE_BYTES, Attention,
                                        causal_block_attention, causal_query_block,
                                        causal_scores_bytes, chunked_attention)
from spopp_jax.models.masks import sequence_layout

BATCH, KV_HEADS, GROUPS, HEAD_DIM = 3, 2, 2, 8
TOL = 1e-5


def _inputs(time, seed):
    rng = np.random.default_rng(seed)
    query = rng.normal(size=(BATCH, time, KV_HEADS, GROUPS, HEAD_DIM))
    key, value = (rng.normal(size=(BATCH, time, KV_HEADS, HEAD_DIM)) for _ in range(2))
    weight = rng.normal(size=query.shape)
    return [jnp.asarray(x, jnp.float32) for x in (query, key, value, weight)]


def _layout(time, kind):
    """Row 0 full; row 1 right-padded; row 2 left-padded ("padding") or two packed
    segments ("packed")."""
    mask = np.ones((BATCH, time), bool)
    mask[1, time - time // 3:] = False
    segments = np.zeros((BATCH, time), np.int32)
    if kind == "padding":
        mask[2, :time // 4] = False
    else:
        segments[2, time // 2:] = 1
    return sequence_layout(jnp.zeros((BATCH, time), jnp.int32), jnp.asarray(mask),
                           segment_ids=jnp.asarray(segments)), mask


def _loss_and_grads(attend, inputs, real):
    query, key, value, weight = inputs
    weight = weight * real[:, :, None, None, None]  # only real query tokens count

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v) * weight)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(query, key, value)


def assert_same_on_real_tokens(attend, reference, inputs, real, jit=True):
    """`attend` = `reference` on real query tokens: outputs, and the loss and q/k/v
    gradients of a loss that weighs only real tokens."""
    run = jax.jit(attend) if jit else attend
    keep = real[:, :, None, None, None]
    np.testing.assert_allclose(run(*inputs[:3]) * keep, jax.jit(reference)(*inputs[:3]) * keep,
                               atol=TOL, rtol=TOL)
    loss_got, grads_got = _loss_and_grads(attend, inputs, real)
    loss_want, grads_want = _loss_and_grads(reference, inputs, real)
    np.testing.assert_allclose(loss_got, loss_want, atol=TOL, rtol=TOL)
    for name, got, want in zip("qkv", grads_got, grads_want):
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL, err_msg=f"d{name}")


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("time,block,kind", [(13, 4, "padding"), (24, 5, "packed"),
                                             (16, 16, "padding"), (7, 1, "packed")])
def test_blocks_match_dense_attention(time, block, kind, remat):
    inputs = _inputs(time, seed=time * 31 + block)
    layout, real = _layout(time, kind)
    real = jnp.asarray(real, jnp.float32)

    def dense(q, k, v):
        return chunked_attention(q, k, v, layout, chunk_size=time)

    def blocked(q, k, v):
        return causal_block_attention(q, k, v, layout, block, remat=remat)

    assert_same_on_real_tokens(blocked, dense, inputs, real)
    assert_same_on_real_tokens(blocked, dense, inputs, real, jit=False)


def test_block_sizes():
    assert causal_query_block(256) == 64
    assert causal_query_block(1024) == 128
    assert causal_query_block(10) == 64  # one block: the dense attention


def test_causal_scores_bytes_counts_each_block_against_its_keys():
    # T = 10, blocks of 4: [0, 4) x 4 keys, [4, 8) x 8, [8, 10) x 10 = 68 scores per row and head
    assert causal_scores_bytes(2, 3, 10, 4) == 4 * 2 * 3 * (16 + 32 + 20)
    assert causal_scores_bytes(1, 1, 8, 8) == 4 * 64  # one block: the dense scores
    # the main job's PPO mini-batch (4 rows x 1,792 tokens, 4 heads, blocks of 224) keeps
    # its scores; a 16-head, 8,192-token row is rematerialised
    assert causal_scores_bytes(4, 4, 1792, 224) < ATTENTION_REMAT_SCORE_BYTES
    assert causal_scores_bytes(1, 16, 8192, 1024) > ATTENTION_REMAT_SCORE_BYTES


@pytest.mark.parametrize("budget,rematerialised", [(0, True), (ATTENTION_REMAT_SCORE_BYTES, False)])
def test_attention_rematerialises_blocks_only_over_the_score_budget(budget, rematerialised):
    from flax import nnx

    from spopp_jax.models.testing import tiny_config

    config = tiny_config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    attention = Attention(config, dtype=jnp.float32, rngs=nnx.Rngs(0), chunk_size=16,
                          remat_score_bytes=budget)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 40, 32)), jnp.float32)
    layout = sequence_layout(jnp.zeros((2, 40), jnp.int32))
    graphdef, state = nnx.split(attention)

    def loss(state, x):
        return jnp.sum(nnx.merge(graphdef, state)(x, layout) ** 2)

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(state, x))
    assert ("remat" in jaxpr or "checkpoint" in jaxpr) == rematerialised


def test_blocks_need_a_full_forward():
    query, key, value, _ = _inputs(8, seed=0)
    layout, _ = _layout(8, "padding")
    with pytest.raises(ValueError, match="keys = queries"):
        causal_block_attention(query, key[:, :6], value[:, :6], layout, 4)
    with pytest.raises(ValueError, match="block_size"):
        causal_block_attention(query, key, value, layout, 0)
