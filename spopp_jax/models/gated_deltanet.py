"""Gated DeltaNet token mixer: Qwen3.5's "linear_attention" layers (HF name `linear_attn`).

  [q; k; v] = silu(causal depthwise conv_K(x W_qkv))      (one conv over the concatenation)
  z = x W_z,  beta = sigmoid(x W_b),  g = -exp(A_log) * softplus(x W_a + dt_bias)
  o = gated delta rule(l2norm(q) / sqrt(d_k), l2norm(k), v, g, beta)   (`delta_rule.py`)
  out = W_out (scale * rmsnorm(o) * silu(z))        (per value head)
q and k have `linear_num_key_heads` heads, each shared by num_value_heads / num_key_heads
value heads (transformers' repeat_interleave).

Runs and padding (exact, not approximated): a run starts at a packed segment's first token
(full forward) or at position 0 (cached decode: a new request in a reused slot). The conv
window of token t holds x[t-j] only for real tokens of t's run (others read as 0), and the
recurrent state restarts at each run start. Padding tokens are zeroed before the
projections (as transformers) and pass through the delta rule (g = 0, beta = 0).

Cached decode (`decode`): each row's real tokens must be contiguous (left or right padding,
positions increasing by one); they are aligned to the front of the row, appended to the
cached conv window, and the delta rule continues from the cached state: the recurrent form
for one token, the chunked form for a prefill.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
from flax import nnx

from spopp_jax.models.cache import LinearAttentionCache
from spopp_jax.models.config import ModelConfig
from spopp_jax.models.delta_rule import (gated_delta_chunked, gated_delta_recurrent,
                                         l2_normalise)
from spopp_jax.models.layers import (GatedRMSNorm, Linear, _normal_init, compute_value,
                                     storage_dtype)
from spopp_jax.models.masks import TokenLayout, segment_starts

# HF initialises A = exp(A_log) uniformly in [A_INIT_LOW, A_INIT_HIGH] and dt_bias to 1.
A_INIT_LOW, A_INIT_HIGH = 0.01, 16.0


def _shift_right(x: jax.Array, steps: int, fill) -> jax.Array:
    """x[:, t - steps] along axis 1 (`fill` for t < steps)."""
    if steps == 0:
        return x
    pad = jnp.full(x.shape[:1] + (steps,) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([pad, x[:, :-steps]], axis=1)


def conv_window_mask(valid: jax.Array, run: jax.Array, kernel_size: int) -> jax.Array:
    """keep[b, t, j] = (t - j >= 0) & valid[b, t - j] & run[b, t - j] == run[b, t];
    valid, run [B, T] -> [B, T, K] bool."""
    return jnp.stack([_shift_right(valid, j, False) & (_shift_right(run, j, -1) == run)
                      for j in range(kernel_size)], axis=-1)


def depthwise_causal_conv(x: jax.Array, weight: jax.Array, keep: jax.Array) -> jax.Array:
    """y[b, t, c] = sum_j weight[c, 0, K-1-j] * x[b, t-j, c] * keep[b, t, j], float32.

    x [B, T, C]; weight [C, 1, K] (torch Conv1d layout, groups = C); keep [B, T, K]
    (`conv_window_mask`). Equals transformers' causal_conv1d_fn (left zero padding) when
    every window entry is kept.
    """
    channels, _, kernel_size = weight.shape
    chex.assert_shape(x, (None, None, channels))
    chex.assert_shape(keep, x.shape[:2] + (kernel_size,))
    x32, w32 = x.astype(jnp.float32), weight[:, 0, :].astype(jnp.float32)
    out = jnp.zeros_like(x32)
    for j in range(kernel_size):
        out = out + jnp.where(keep[..., j:j + 1], _shift_right(x32, j, 0.0),
                              0.0) * w32[:, kernel_size - 1 - j]
    return out


def _align_front(x: jax.Array, shift: jax.Array) -> jax.Array:
    """Row b rotated left by shift[b] along axis 1: out[b, t] = x[b, (t + shift[b]) % T]."""
    time = x.shape[1]
    index = (jnp.arange(time)[None, :] + shift[:, None]) % time
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


class DepthwiseConv1d(nnx.Module):
    """Holds the depthwise causal conv kernel in the HF layout: weight [channels, 1, K]."""

    def __init__(self, channels: int, kernel_size: int, *, dtype, rngs: nnx.Rngs,
                 param_dtype=None):
        self.dtype = jnp.dtype(dtype)
        self.weight = nnx.Param(_normal_init(rngs, (channels, 1, kernel_size),
                                             storage_dtype(dtype, param_dtype)))

    def __call__(self, x: jax.Array, keep: jax.Array) -> jax.Array:
        return depthwise_causal_conv(x, compute_value(self.weight, self.dtype), keep)


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear-attention token mixer; parameters named as transformers'
    Qwen3_5GatedDeltaNet. `chunk_size` (attention queries per block) does not apply: the
    delta rule's chunk is `config.linear_chunk_size`."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs, chunk_size: int = 0,
                 param_dtype=None):
        del chunk_size  # the attention query chunk; see the class docstring
        stored = storage_dtype(dtype, param_dtype)
        self.num_key_heads = config.linear_num_key_heads
        self.num_value_heads = config.linear_num_value_heads
        self.key_head_dim = config.linear_key_head_dim
        self.value_head_dim = config.linear_value_head_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.delta_chunk_size = config.linear_chunk_size
        key_dim = self.num_key_heads * self.key_head_dim
        value_dim = self.num_value_heads * self.value_head_dim
        self.conv_dim = 2 * key_dim + value_dim
        hidden = config.hidden_size
        self.in_proj_qkv = Linear(hidden, self.conv_dim, use_bias=False, dtype=dtype, rngs=rngs,
                                param_dtype=param_dtype)
        self.in_proj_z = Linear(hidden, value_dim, use_bias=False, dtype=dtype, rngs=rngs,
                                param_dtype=param_dtype)
        self.in_proj_b = Linear(hidden, self.num_value_heads, use_bias=False, dtype=dtype,
                                rngs=rngs, param_dtype=param_dtype)
        self.in_proj_a = Linear(hidden, self.num_value_heads, use_bias=False, dtype=dtype,
                                rngs=rngs, param_dtype=param_dtype)
        self.conv1d = DepthwiseConv1d(self.conv_dim, self.kernel_size, dtype=dtype, rngs=rngs,
                                      param_dtype=param_dtype)
        self.dt_bias = nnx.Param(jnp.ones((self.num_value_heads,), stored))
        decay_rate = jax.random.uniform(rngs.params(), (self.num_value_heads,), jnp.float32,
                                        A_INIT_LOW, A_INIT_HIGH)
        self.A_log = nnx.Param(jnp.log(decay_rate).astype(stored))
        self.norm = GatedRMSNorm(self.value_head_dim, eps=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype)
        self.out_proj = Linear(value_dim, hidden, use_bias=False, dtype=dtype, rngs=rngs,
                               param_dtype=param_dtype)

    def init_cache(self, batch_size: int, max_len: int, dtype) -> LinearAttentionCache:
        """Constant-size state per row (`max_len` does not apply)."""
        del max_len
        return LinearAttentionCache.zeros(batch_size, self.kernel_size, self.conv_dim,
                                          self.num_value_heads, self.key_head_dim,
                                          self.value_head_dim, dtype)

    def _mix(self, x: jax.Array, conv_out: jax.Array, valid: jax.Array, starts: jax.Array,
             initial_state: jax.Array, recurrent: bool) -> tuple[jax.Array, jax.Array]:
        """Delta rule and output projection after the conv. conv_out [B, T, conv_dim]
        (before silu); returns (out [B, T, hidden] in x.dtype, final state)."""
        batch, time, _ = x.shape
        mixed = jax.nn.silu(conv_out).astype(x.dtype)
        key_dim = self.num_key_heads * self.key_head_dim
        query, key, value = jnp.split(mixed, [key_dim, 2 * key_dim], axis=-1)
        repeats = self.num_value_heads // self.num_key_heads

        def heads(t: jax.Array, dim: int) -> jax.Array:
            return t.reshape(batch, time, -1, dim)

        query = jnp.repeat(l2_normalise(heads(query, self.key_head_dim)), repeats, axis=2)
        key = jnp.repeat(l2_normalise(heads(key, self.key_head_dim)), repeats, axis=2)
        query = query * (self.key_head_dim ** -0.5)
        real = valid[..., None]
        beta = jnp.where(real, jax.nn.sigmoid(self.in_proj_b(x).astype(jnp.float32)), 0.0)
        rate = jax.nn.softplus(self.in_proj_a(x).astype(jnp.float32)
                               + compute_value(self.dt_bias, x.dtype).astype(jnp.float32))
        a_log = compute_value(self.A_log, x.dtype).astype(jnp.float32)
        decay = jnp.where(real, -jnp.exp(a_log) * rate, 0.0)
        value = heads(value, self.value_head_dim)
        if recurrent:
            core, state = gated_delta_recurrent(query, key, value, decay, beta, starts,
                                                initial_state)
        else:
            core, state = gated_delta_chunked(query, key, value, decay, beta, starts,
                                              initial_state, self.delta_chunk_size)
        gate = heads(self.in_proj_z(x), self.value_head_dim)
        normed = self.norm(core.astype(x.dtype), gate).reshape(batch, time, -1)
        return self.out_proj(normed), state

    def _zero_state(self, batch: int) -> jax.Array:
        return jnp.zeros((batch, self.num_value_heads, self.key_head_dim, self.value_head_dim),
                         jnp.float32)

    def __call__(self, x: jax.Array, layout: TokenLayout) -> jax.Array:
        """Full forward: runs = packed segments (`layout.query_segment`), padding =
        ~`layout.token_valid`."""
        valid = layout.token_valid
        x = jnp.where(valid[..., None], x, 0).astype(x.dtype)
        starts = segment_starts(layout.query_segment)  # a padding start still resets
        run = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
        conv_out = self.conv1d(self.in_proj_qkv(x), conv_window_mask(valid, run,
                                                                     self.kernel_size))
        out, _ = self._mix(x, conv_out, valid, starts, self._zero_state(x.shape[0]),
                           recurrent=False)
        return out

    def decode(self, x: jax.Array, layout: TokenLayout,
               cache: LinearAttentionCache) -> tuple[jax.Array, LinearAttentionCache]:
        """Cached decode / prefill continuing each row from its cache (module docstring)."""
        valid = layout.token_valid
        lead = jnp.argmax(valid, axis=1)  # first real token (0 for an all-padding row)
        x_front = _align_front(jnp.where(valid[..., None], x, 0).astype(x.dtype), lead)
        valid_front = _align_front(valid, lead)
        starts = _align_front(layout.positions == 0, lead) & valid_front
        history = self.kernel_size - 1
        batch = x.shape[0]
        inputs = jnp.concatenate([cache.conv.astype(x.dtype), self.in_proj_qkv(x_front)], 1)
        inputs_valid = jnp.concatenate([jnp.ones((batch, history), bool), valid_front], 1)
        inputs_run = jnp.concatenate([jnp.zeros((batch, history), jnp.int32),
                                      jnp.cumsum(starts, axis=1, dtype=jnp.int32)], 1)
        keep = conv_window_mask(inputs_valid, inputs_run, self.kernel_size)
        conv_out = self.conv1d(inputs, keep)[:, history:]
        out, state = self._mix(x_front, conv_out, valid_front, starts, cache.state,
                               recurrent=x.shape[1] == 1)
        new_conv = _last_window(inputs, inputs_valid, inputs_run, valid_front.sum(axis=1),
                                history)
        out = _align_front(out, (x.shape[1] - lead) % x.shape[1])
        return out, LinearAttentionCache(conv=new_conv.astype(cache.conv.dtype), state=state)


def _last_window(inputs: jax.Array, valid: jax.Array, run: jax.Array, count: jax.Array,
                 history: int) -> jax.Array:
    """The conv window after a row's last real token: inputs[b, count[b] + i], i < history
    (the cached history sits in front, the row's `count[b]` real tokens after it), with
    entries of an earlier run or padding zeroed."""
    index = count[:, None] + jnp.arange(history)[None, :]
    entries = jnp.take_along_axis(inputs, index[..., None], axis=1)
    entry_run = jnp.take_along_axis(run, index, axis=1)
    entry_valid = jnp.take_along_axis(valid, index, axis=1)
    same_run = entry_run == entry_run[:, -1:]
    return jnp.where((same_run & entry_valid)[..., None], entries, 0)
