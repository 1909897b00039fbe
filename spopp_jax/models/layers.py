"""Building blocks of the decoder: parameter-holding NNX modules and pure functions.

Parameter layouts (the HF <-> JAX mapping in `hf_io.py` relies on them):
  Linear.kernel  [in, out]   (HF nn.Linear.weight is [out, in]: transposed on load/save)
  Linear.bias    [out]
  Embed.embedding [vocab, hidden]
  RMSNorm.scale  [dim]
  OffsetRMSNorm.weight [dim]   (HF layout and name: y = n(x) (1 + weight))

Mixed precision (as Flax's `dtype` / `param_dtype`, MaxText's `dtype` / `weight_dtype`):
each module stores its parameters in `param_dtype` (default: `dtype`) and computes in
`dtype`; the cast happens where a parameter is read (`compute_value`), inside the
differentiated function, so the gradient of an fp32 master weight is fp32 even when the
layer computes in bfloat16. Norms, rotary angles and softmax run in float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

# Finite "minus infinity" for masked attention scores: a fully masked row (padding) gives a
# uniform softmax instead of NaN, and no 0 * inf is ever formed.
MASKED_SCORE = -1e30


def _normal_init(rngs: nnx.Rngs, shape, dtype, stddev: float = 0.02) -> jax.Array:
    return (stddev * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def storage_dtype(dtype, param_dtype=None) -> jnp.dtype:
    """The dtype parameters are stored in: `param_dtype`, or the compute `dtype` when None."""
    return jnp.dtype(dtype if param_dtype is None else param_dtype)


def compute_value(param: nnx.Param, dtype) -> jax.Array:
    """`param`'s value in the compute `dtype` (no op when it is stored so). Its transpose
    casts the gradient back to the stored dtype."""
    return param[...].astype(dtype)


class Linear(nnx.Module):
    """y = x @ kernel (+ bias); kernel [in, out]."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool, dtype,
                 rngs: nnx.Rngs, param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        stored = storage_dtype(dtype, param_dtype)
        self.kernel = nnx.Param(_normal_init(rngs, (in_features, out_features), stored))
        self.bias = nnx.Param(jnp.zeros((out_features,), stored)) if use_bias else None

    def __call__(self, x: jax.Array) -> jax.Array:
        y = linear(x.astype(self.dtype), self.kernel[...])  # casts the kernel itself
        if self.bias is not None:
            y = y + compute_value(self.bias, self.dtype)
        return y


@jax.custom_vjp
def linear(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """y = x @ kernel: x [..., in], kernel [in, out] -> [..., out] in x.dtype (the compute
    dtype; a kernel stored in another dtype, e.g. fp32 master weights, is cast to it).

    Gradient (`_linear_backward`): dx = dy kernel^T, dkernel = x^T dy as ONE dot that
    contracts the tokens (all leading axes flattened) of x and dy in their stored
    row-major layout, accumulated in float32 and returned in the kernel's dtype: an fp32
    master kernel gets an fp32 gradient that was never rounded to bfloat16, and a batch
    sharded over devices is summed in float32. Autodiff's transposed dot led XLA:CPU to
    write a transposed copy of dy (or of x) for every weight gradient, the largest single
    ops of the train step (docs/PERFORMANCE.md). Values are those of autodiff.
    """
    return jnp.einsum("...i,io->...o", x, kernel.astype(x.dtype))


def _linear_forward(x, kernel):
    return linear(x, kernel), (x, kernel)


def _linear_backward(residuals, d_y):
    x, kernel = residuals
    d_x = jnp.einsum("...o,io->...i", d_y, kernel.astype(d_y.dtype))
    tokens_x = x.reshape(-1, x.shape[-1])  # [N, in]
    tokens_d_y = d_y.reshape(-1, d_y.shape[-1])  # [N, out]
    d_kernel = jax.lax.dot_general(tokens_x, tokens_d_y, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
    return d_x.astype(x.dtype), d_kernel.astype(kernel.dtype)


linear.defvjp(_linear_forward, _linear_backward)


class Embed(nnx.Module):
    """Token embedding table [vocab, hidden]; `attend` gives tied-embedding logits."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, rngs: nnx.Rngs,
                 param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        self.embedding = nnx.Param(_normal_init(rngs, (vocab_size, hidden_size),
                                                storage_dtype(dtype, param_dtype)))

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        """Rows of the table; ids outside [0, vocab) (e.g. -1 padding) are clipped, so they
        give finite vectors instead of NaN (masked attention would still multiply their
        values by 0)."""
        rows = jnp.take(self.embedding[...], input_ids, axis=0, mode="clip")
        return rows.astype(self.dtype)  # cast the gathered rows, not the whole table

    def attend(self, x: jax.Array) -> jax.Array:
        """float32 logits = x @ embedding.T."""
        table = compute_value(self.embedding, self.dtype)
        return jnp.einsum("...h,vh->...v", x.astype(table.dtype), table,
                          preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """y = scale * (x / sqrt(mean(x^2) + eps)), statistics in float32, result in x.dtype."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        self.scale = nnx.Param(jnp.ones((dim,), storage_dtype(dtype, param_dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, compute_value(self.scale, self.dtype), self.eps)


class OffsetRMSNorm(nnx.Module):
    """Zero-centred RMSNorm (Qwen3.5): y = (x / sqrt(mean(x^2) + eps)) * (1 + weight).

    `weight` is stored as in HF (an offset, initialised to 0); all in float32, result in
    x.dtype (as transformers' Qwen3_5RMSNorm).
    """

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        self.weight = nnx.Param(jnp.zeros((dim,), storage_dtype(dtype, param_dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = _normalise(x.astype(jnp.float32), self.eps)
        weight = compute_value(self.weight, self.dtype).astype(jnp.float32)
        return (normed * (1.0 + weight)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated DeltaNet output norm: y = scale * rmsnorm(x) * silu(gate).

    As transformers' Qwen3_5RMSNormGated: normalise in float32, cast to x.dtype, multiply
    by `scale`, then by silu(float32 gate); result in x.dtype.
    """

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        self.scale = nnx.Param(jnp.ones((dim,), storage_dtype(dtype, param_dtype)))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        if gate.shape != x.shape:
            raise ValueError(f"gate {gate.shape} must match x {x.shape}")
        normed = _normalise(x.astype(jnp.float32), self.eps).astype(x.dtype)
        normed = compute_value(self.scale, self.dtype) * normed
        return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def _normalise(x32: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x^2) + eps) over the last axis (float32 in, float32 out)."""
    return x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis: scale * x / sqrt(mean(x^2) + eps).

    Matches transformers' Qwen3RMSNorm: normalise in float32, cast back to x.dtype, then
    multiply by the scale (in the promoted dtype of scale and x).
    """
    if scale.shape != x.shape[-1:]:
        raise ValueError(f"scale: shape {scale.shape} does not match x's last axis {x.shape}")
    normed = _normalise(x.astype(jnp.float32), eps).astype(x.dtype)
    return (scale * normed).astype(x.dtype)


def rope_inverse_frequencies(head_dim: int, rope_theta: float, rope_type: str = "default",
                             rope_factor: float = 1.0) -> jax.Array:
    """inv_freq[i] = 1 / theta^(2i / head_dim), i < head_dim / 2 (float32). For partial
    rotary pass the rotary dims as `head_dim` (transformers does the same).

    rope_type "linear" divides the frequencies by `rope_factor` (position interpolation).
    """
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (jnp.float32(rope_theta) ** exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / rope_factor
    elif rope_type != "default":
        raise NotImplementedError(f"rope_type {rope_type!r}")
    return inv_freq


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, "rotate half" layout (as transformers' Qwen3 / Qwen3.5).

    x: [B, T, heads, D]; positions: [B, T] int; inv_freq: [R/2], R <= D the rotary dims.
    angle = position * inv_freq;  with (x1, x2) the two halves of the first R dims:
    out = (x1 cos - x2 sin, x2 cos + x1 sin, x[R:]) (partial rotary: the last D - R dims
    pass unchanged). Angles and products in float32.
    """
    if x.ndim != 4 or positions.shape != x.shape[:2]:
        raise ValueError(f"x must be [B, T, heads, D] and positions [B, T]; got {x.shape}, "
                         f"{positions.shape}")
    rotary_dim = 2 * inv_freq.shape[0]
    if inv_freq.ndim != 1 or rotary_dim > x.shape[-1]:
        raise ValueError(f"inv_freq: shape {inv_freq.shape}, head_dim {x.shape[-1]}")
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, R/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32[..., :rotary_dim], 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin,
                               x32[..., rotary_dim:]], axis=-1)
    return rotated.astype(x.dtype)


def grouped_query_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                            mask: jax.Array) -> jax.Array:
    """softmax(q k^T / sqrt(D) masked) v, with K key/value heads shared by G query heads.

    query: [B, T, K, G, D] (query head h = k * G + g, as transformers' repeat_kv),
    key, value: [B, S, K, D]; mask: [B, T, S] bool (True = may attend).
    Scores and softmax in float32; returns [B, T, K, G, D] in value.dtype.

    The scores are laid out [B, K, T, G, S]: the batched dot over (b, k) emits its free
    query dims in q's own order (t, g), so the float32 scores (the layer's largest
    tensor) are not transposed before the mask and softmax. The softmax is normalised
    after the value product, as flash attention does:
      e = exp(s - max_s s),  out = (e v) / sum_s e
    (= softmax(s) v exactly; the division runs on [B, T, H, D] instead of on the
    [B, H, T, S] probabilities, which are never materialised; docs/PERFORMANCE.md).
    A fully masked row (padding) has e = 1 everywhere: the mean of the values.
    """
    if query.ndim != 5 or key.ndim != 4 or key.shape != value.shape:
        raise ValueError(f"query [B,T,K,G,D], key/value [B,S,K,D]; got {query.shape}, "
                         f"{key.shape}, {value.shape}")
    batch, time, kv_heads, _, head_dim = query.shape
    if key.shape[0] != batch or key.shape[2] != kv_heads or key.shape[3] != head_dim:
        raise ValueError(f"key {key.shape} does not match query {query.shape}")
    if mask.shape != (batch, time, key.shape[1]):
        raise ValueError(f"mask: expected {(batch, time, key.shape[1])}, got {mask.shape}")
    scores = jnp.einsum("btkgd,bskd->bktgs", query, key, preferred_element_type=jnp.float32)
    scores = scores * (head_dim ** -0.5)
    scores = jnp.where(mask[:, None, :, None, :], scores, MASKED_SCORE)
    # softmax is shift-invariant, so the max carries no gradient
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    numerators = jnp.exp(scores - row_max)  # in [0, 1], the row's max entry is 1
    total = jnp.sum(numerators, axis=-1)  # [B, K, T, G], >= 1
    unnormalised = jnp.einsum("bktgs,bskd->bktgd", numerators.astype(value.dtype), value,
                              preferred_element_type=jnp.float32)
    out = unnormalised / total[..., None]
    return jnp.transpose(out, (0, 2, 1, 3, 4)).astype(value.dtype)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, rngs: nnx.Rngs,
                 param_dtype=None):
        def proj(n_in, n_out):
            return Linear(n_in, n_out, use_bias=False, dtype=dtype, rngs=rngs,
                          param_dtype=param_dtype)

        self.gate_proj = proj(hidden_size, intermediate_size)
        self.up_proj = proj(hidden_size, intermediate_size)
        self.down_proj = proj(intermediate_size, hidden_size)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
