"""The fused full-forward attention (`jax.nn.dot_product_attention`): which kernel is
chosen where, and that its semantics (GQA head grouping, the layout's causal / padding /
segment mask) equal our own attention on real tokens, values and gradients. On this CPU the
"xla" implementation of the same call stands in for "cudnn" (the GPU kernel is chosen only
on a GPU backend with 16-bit inputs; `scripts/gpu_check.sh` runs it there)."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from spopp_jax.models import attention
from spopp_jax.models.attention import (causal_block_attention, fused_attention,
                                        fused_attention_implementation)
from spopp_jax.models.testing import tiny_config
from spopp_jax.models.qwen3 import init_model
from test_attention_blocks import _inputs, _layout, assert_same_on_real_tokens


@pytest.mark.parametrize("backend,dtype,head_dim,expected", [
    ("gpu", "bfloat16", 128, "cudnn"), ("gpu", "float16", 64, "cudnn"),
    ("gpu", "float32", 64, None), ("gpu", "bfloat16", 256, None),
    ("cpu", "bfloat16", 64, None), ("tpu", "bfloat16", 64, None), ("cpu", "float32", 64, None)])
def test_the_fused_kernel_is_chosen_only_on_a_gpu_with_16_bit_inputs(backend, dtype, head_dim, expected):
    assert fused_attention_implementation(jnp.dtype(dtype), head_dim, backend) == expected


def test_this_cpu_keeps_our_attention():
    assert jax.default_backend() == "cpu"
    assert fused_attention_implementation(jnp.bfloat16, 64) is None


@pytest.mark.parametrize("jit", [True, False])
@pytest.mark.parametrize("time,kind", [(13, "padding"), (24, "packed")])
def test_fused_equals_our_attention_on_real_tokens(time, kind, jit):
    inputs = _inputs(time, seed=time)
    layout, real = _layout(time, kind)
    real = jnp.asarray(real, jnp.float32)

    def ours(q, k, v):
        return causal_block_attention(q, k, v, layout, 4)

    def fused(q, k, v):
        return fused_attention(q, k, v, layout, "xla")

    assert_same_on_real_tokens(fused, ours, inputs, real, jit=jit)


def test_fused_attention_needs_a_full_forward():
    query, key, value, _ = _inputs(8, seed=0)
    layout, _ = _layout(8, "padding")
    with pytest.raises(ValueError, match="full forward"):
        fused_attention(query, key[:, :6], value[:, :6], layout, "xla")


def test_the_model_forward_takes_the_fused_path_when_chosen(monkeypatch):
    """The Attention module's wiring: with the choice forced to "xla" (standing in for a
    GPU's "cudnn"), the whole model's logits on real tokens are unchanged."""
    model = init_model(tiny_config(), seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)
    mask = jnp.asarray(np.arange(12)[None, :] < np.array([[12], [7]]))
    ours = model(ids, attention_mask=mask)
    calls = []

    def chosen(dtype, head_dim, backend=None):
        calls.append(head_dim)
        return "xla"

    monkeypatch.setattr(attention, "fused_attention_implementation", chosen)
    fused = model(ids, attention_mask=mask)
    assert calls, "the forward did not ask for the fused kernel"
    real = np.asarray(mask)[:, :, None]
    np.testing.assert_allclose(np.asarray(fused) * real, np.asarray(ours) * real, atol=2e-5, rtol=2e-5)
