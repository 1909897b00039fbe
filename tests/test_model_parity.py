"""Logits parity with transformers' PyTorch Qwen3 / Qwen2 (tiny random models, fp32), plus
NumPy float64 references for RMSNorm and rotary embeddings."""

import functools

import numpy as np
import pytest
import torch
import jax
import jax.numpy as jnp
from flax import nnx
from hypothesis import example, given, settings, strategies as st

from spopp_jax.models import ModelConfig, from_pretrained, init_model
from spopp_jax.models.layers import apply_rope, rms_norm, rope_inverse_frequencies
from spopp_jax.models.testing import random_hf_model, tiny_hf_config

TOL = 1e-4


@nnx.jit
def _forward(model, input_ids, attention_mask=None, positions=None, segment_ids=None):
    return model(input_ids, attention_mask=attention_mask, positions=positions,
                 segment_ids=segment_ids)


def hf_logits(hf_model, input_ids, attention_mask=None, position_ids=None):
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.as_tensor(np.array(input_ids), dtype=torch.long),
            attention_mask=None if attention_mask is None else torch.as_tensor(
                np.asarray(attention_mask), dtype=torch.long),
            position_ids=None if position_ids is None else torch.as_tensor(
                np.asarray(position_ids), dtype=torch.long))
    return out.logits.float().numpy()


def load_pair(tmp_path, model_type="qwen3", seed=0, **config_kwargs):
    hf_config = tiny_hf_config(model_type, **config_kwargs)
    hf_model = random_hf_model(hf_config, seed=seed)
    hf_model.save_pretrained(tmp_path)
    return hf_model, from_pretrained(str(tmp_path), dtype="float32")


CASES = [
    # (model_type, rope_theta, tied, num_heads, num_kv_heads, also run eagerly)
    ("qwen3", 1e4, True, 4, 2, True),
    ("qwen3", 1e6, False, 4, 2, False),
    ("qwen3", 1e6, True, 4, 1, False),
    ("qwen3", 1e4, False, 4, 4, False),
    ("qwen2", 1e4, False, 4, 2, True),
    ("qwen2", 1e6, True, 4, 2, False),
]


@pytest.mark.parametrize("model_type,rope_theta,tied,heads,kv_heads,eager", CASES)
def test_logits_match_transformers(tmp_path, model_type, rope_theta, tied, heads, kv_heads,
                                   eager):
    hf_model, model = load_pair(tmp_path, model_type, rope_theta=rope_theta,
                                tie_word_embeddings=tied, num_attention_heads=heads,
                                num_key_value_heads=kv_heads)
    assert model.config.rope_theta == rope_theta
    assert (model.lm_head is None) == tied
    input_ids = np.random.default_rng(1).integers(0, 128, size=(2, 40))
    expected = hf_logits(hf_model, input_ids)
    got = _forward(model, jnp.asarray(input_ids))
    assert got.dtype == jnp.float32 and got.shape == (2, 40, 128)
    np.testing.assert_allclose(np.asarray(got), expected, atol=TOL, rtol=0)
    if eager:
        np.testing.assert_allclose(np.asarray(model(jnp.asarray(input_ids))), expected,
                                   atol=TOL, rtol=0)


def test_rope_theta_changes_logits(tmp_path):
    """The theta-sensitivity that the parity cases rely on: same weights, other theta."""
    _, model = load_pair(tmp_path, rope_theta=1e4)
    other_config = ModelConfig.from_hf(
        {**model.config.hf_config, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    model_other = init_model(other_config, seed=99)
    nnx.update(model_other, nnx.state(model, nnx.Param))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(1, 40)))
    assert float(jnp.max(jnp.abs(_forward(model, ids) - _forward(model_other, ids)))) > 1e-3


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_matches_transformers(tmp_path, model_type, side):
    hf_model, model = load_pair(tmp_path, model_type, seed=3, rope_theta=1e6)
    rng = np.random.default_rng(2)
    lengths = [24, 17, 5]
    total = 24
    input_ids = np.zeros((3, total), np.int64)
    mask = np.zeros((3, total), np.int64)
    for row, length in enumerate(lengths):
        cols = slice(total - length, total) if side == "left" else slice(0, length)
        input_ids[row, cols] = rng.integers(1, 128, size=length)
        mask[row, cols] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    got = np.asarray(_forward(model, jnp.asarray(input_ids), jnp.asarray(mask)))
    assert np.all(np.isfinite(got))
    for row, length in enumerate(lengths):
        # Reference: each sequence alone, unpadded.
        real = mask[row].astype(bool)
        alone = hf_logits(hf_model, input_ids[row:row + 1, real])[0]
        np.testing.assert_allclose(got[row, real], alone, atol=TOL, rtol=0)
    # And transformers' own padded forward with explicit positions.
    padded = hf_logits(hf_model, input_ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], padded[real], atol=TOL, rtol=0)


def test_packed_segments_match_separate_sequences(tmp_path):
    hf_model, model = load_pair(tmp_path, seed=4, rope_theta=1e6)
    rng = np.random.default_rng(5)
    lengths = [7, 11, 6]  # + 4 padding tokens at the end
    total = sum(lengths) + 4
    input_ids = np.zeros((1, total), np.int64)
    segment_ids = np.zeros((1, total), np.int64)
    mask = np.zeros((1, total), np.int64)
    start = 0
    for segment, length in enumerate(lengths):
        input_ids[0, start:start + length] = rng.integers(0, 128, size=length)
        segment_ids[0, start:start + length] = segment + 1
        mask[0, start:start + length] = 1
        start += length
    got = np.asarray(_forward(model, jnp.asarray(input_ids), jnp.asarray(mask),
                              segment_ids=jnp.asarray(segment_ids)))
    start = 0
    for length in lengths:
        alone = hf_logits(hf_model, input_ids[:, start:start + length])[0]
        np.testing.assert_allclose(got[0, start:start + length], alone, atol=TOL, rtol=0)
        start += length


def test_bfloat16_params_close_to_float32(tmp_path):
    hf_model, model = load_pair(tmp_path, seed=6)
    model_bf16 = from_pretrained(str(tmp_path), dtype="bfloat16")
    leaves = jax.tree_util.tree_leaves(nnx.state(model_bf16, nnx.Param))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in leaves)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 128, size=(2, 16)))
    logits_bf16 = _forward(model_bf16, ids)
    assert logits_bf16.dtype == jnp.float32
    expected = hf_logits(hf_model, ids)
    error = np.abs(np.asarray(logits_bf16) - expected).max()
    assert error < 0.05 * np.abs(expected).max(), error


# ---- NumPy float64 references for the building blocks -------------------------------

def test_rms_norm_against_float64():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 8)) * 3.0
    scale = rng.uniform(0.5, 1.5, size=8)
    eps = 1e-6
    expected = scale * x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)
    got = rms_norm(jnp.asarray(x, jnp.float32), jnp.asarray(scale, jnp.float32), eps)
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("theta", [1e4, 1e6])
def test_rope_against_float64(theta):
    """Rotate-half RoPE: pair (i, i + D/2) rotated by angle pos * theta^(-2i/D)."""
    rng = np.random.default_rng(1)
    batch, time, heads, dim = 2, 6, 3, 8
    x = rng.normal(size=(batch, time, heads, dim))
    positions = rng.integers(0, 1000, size=(batch, time))
    expected = np.empty_like(x)
    half = dim // 2
    for i in range(half):
        angle = positions * theta ** (-2.0 * i / dim)  # [B, T]
        c, s = np.cos(angle)[..., None], np.sin(angle)[..., None]  # [B, T, 1] over heads
        a, b = x[..., i], x[..., i + half]
        expected[..., i] = a * c - b * s
        expected[..., i + half] = b * c + a * s
    inv_freq = rope_inverse_frequencies(dim, theta)
    got = apply_rope(jnp.asarray(x, jnp.float32), jnp.asarray(positions), inv_freq)
    np.testing.assert_allclose(np.asarray(got), expected, atol=2e-4)


def test_rope_theta_read_from_both_config_places():
    base = tiny_hf_config().to_dict()
    new_style = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    legacy = {k: v for k, v in base.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 2.5e5
    assert ModelConfig.from_hf(new_style).rope_theta == 5e5
    assert ModelConfig.from_hf(legacy).rope_theta == 2.5e5


def test_unsupported_config_fails_loudly():
    base = tiny_hf_config().to_dict()
    with pytest.raises(NotImplementedError):
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6,
                                                         "factor": 4.0}})
    with pytest.raises(NotImplementedError):
        ModelConfig.from_hf({**base, "model_type": "llama"})


# ---- properties --------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _property_model():
    return init_model(ModelConfig.from_hf(tiny_hf_config(rope_theta=1e6)), seed=7)


_PROPERTY_WIDTH = 24  # one compiled shape for every example


@settings(max_examples=15, deadline=None)
@given(length=st.integers(1, 12), left_pad=st.integers(0, 12), pad_token=st.integers(-2, 130),
       seed=st.integers(0, 2**16))
@example(length=5, left_pad=3, pad_token=128, seed=0)  # id == vocab_size
@example(length=5, left_pad=3, pad_token=-1, seed=0)
def test_padding_does_not_change_real_logits(length, left_pad, pad_token, seed):
    """Logits of real tokens do not depend on where the padding sits (left / right / both)
    or on the padding tokens' ids, even out-of-vocabulary ones (-1, V). Reference: the
    tokens first, zeros after them."""
    ids = np.random.default_rng(seed).integers(0, 128, size=length)
    reference_ids = np.zeros((1, _PROPERTY_WIDTH), np.int32)
    reference_ids[0, :length] = ids
    reference_mask = np.arange(_PROPERTY_WIDTH)[None] < length
    reference = _forward(_property_model(), jnp.asarray(reference_ids),
                         jnp.asarray(reference_mask))
    padded = np.full((1, _PROPERTY_WIDTH), pad_token, np.int32)
    padded[0, left_pad:left_pad + length] = ids
    mask = np.zeros((1, _PROPERTY_WIDTH), bool)
    mask[0, left_pad:left_pad + length] = True
    got = _forward(_property_model(), jnp.asarray(padded), jnp.asarray(mask))
    assert np.all(np.isfinite(np.asarray(got)))
    np.testing.assert_allclose(np.asarray(got[0, left_pad:left_pad + length]),
                               np.asarray(reference[0, :length]), atol=1e-5)


def test_remat_gives_the_same_gradients():
    config = ModelConfig.from_hf(tiny_hf_config(rope_theta=1e6))
    plain, rematerialised = init_model(config, seed=8), init_model(config, seed=8, remat=True)
    ids = jnp.asarray(np.random.default_rng(3).integers(0, 128, size=(2, 10)))

    def loss(model):
        return jnp.sum(jax.nn.log_softmax(model(ids), axis=-1)[..., 5])

    graphdef, state = nnx.split(rematerialised)
    jaxpr = str(jax.make_jaxpr(lambda s: loss(nnx.merge(graphdef, s)))(state))
    assert jaxpr.count("remat") == config.num_hidden_layers
    grad_fn = nnx.jit(nnx.grad(loss))
    grads = jax.tree_util.tree_leaves(grad_fn(plain))
    grads_remat = jax.tree_util.tree_leaves(grad_fn(rematerialised))
    assert len(grads) == len(grads_remat)
    for g, g_remat in zip(grads, grads_remat):
        np.testing.assert_allclose(np.asarray(g_remat), np.asarray(g), atol=1e-6)


def test_chunked_attention_matches_transformers(tmp_path):
    """A call longer than the chunk (T = 40, chunk 16): causal query blocks of 16, each
    rematerialised in the backward pass (a score budget of 0 bytes); same logits as
    transformers, with left padding; same gradients as the call within one chunk (blocks of
    64 queries, no remat: its scores are far under `ATTENTION_REMAT_SCORE_BYTES`)."""
    hf_model, _ = load_pair(tmp_path, seed=10, rope_theta=1e6)
    chunked = from_pretrained(str(tmp_path), attention_chunk_size=16)
    for layer in chunked.model.layers:
        layer.mixer.remat_score_bytes = 0
    whole = from_pretrained(str(tmp_path), attention_chunk_size=64)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 128, size=(2, 40))
    mask = np.ones((2, 40), np.int64)
    mask[1, :9] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    expected = hf_logits(hf_model, ids, mask, positions)
    got = np.asarray(_forward(chunked, jnp.asarray(ids), jnp.asarray(mask)))
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], expected[real], atol=TOL, rtol=0)

    def loss(model):
        logits = model(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        return jnp.sum(jnp.where(jnp.asarray(real)[..., None],
                                 jax.nn.log_softmax(logits, axis=-1), 0.0)[..., 7])

    grad_fn = nnx.jit(nnx.grad(loss))
    for g_chunked, g_whole in zip(jax.tree_util.tree_leaves(grad_fn(chunked)),
                                  jax.tree_util.tree_leaves(grad_fn(whole))):
        # float32, summed in another order: a few ulps (|g| reaches ~80 here)
        np.testing.assert_allclose(np.asarray(g_chunked), np.asarray(g_whole), atol=1e-5,
                                   rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.tuples(st.integers(0, 3), st.booleans()), min_size=1,
                              max_size=12), min_size=1, max_size=3))
def test_default_positions_count_real_tokens_of_the_segment(rows):
    """position[t] = #(real tokens s < t of t's segment), clipped at >= 0 for padding."""
    from spopp_jax.models.masks import default_positions
    width = max(len(r) for r in rows)
    segments = np.zeros((len(rows), width), np.int32)
    valid = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        for t, (segment, is_real) in enumerate(row):
            segments[b, t], valid[b, t] = segment, is_real
        segments[b, len(row):] = row[-1][0]
    # Segments must be contiguous: renumber runs so that a repeated id starts a new one.
    runs = np.cumsum(np.concatenate([np.zeros((len(rows), 1), bool),
                                     segments[:, 1:] != segments[:, :-1]], axis=1), axis=1)
    expected = np.zeros_like(segments)
    for b in range(len(rows)):
        for t in range(width):
            same = (runs[b, :t] == runs[b, t]) & valid[b, :t]
            expected[b, t] = max(int(same.sum()) - (0 if valid[b, t] else 1), 0)
    got = np.asarray(default_positions(jnp.asarray(valid), jnp.asarray(segments)))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.slow
def test_qwen3_0p6b_shaped_layers_match_transformers(tmp_path):
    """Qwen3-0.6B's layer shapes (hidden 1024, 16/8 heads of 128, MLP 3072), 2 layers,
    a 4096-token vocabulary, 256 tokens."""
    hf_config = tiny_hf_config(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                               num_key_value_heads=8, head_dim=128, vocab_size=4096,
                               rope_theta=1e6, tie_word_embeddings=True)
    hf_model = random_hf_model(hf_config, seed=12)
    hf_model.save_pretrained(str(tmp_path))
    model = from_pretrained(str(tmp_path), attention_chunk_size=128)
    ids = np.random.default_rng(13).integers(0, 4096, size=(1, 256))
    np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(ids))),
                               hf_logits(hf_model, ids), atol=TOL, rtol=0)
