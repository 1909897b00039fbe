"""Grouped-query self-attention with optional q/k RMSNorm (Qwen3) or qkv bias (Qwen2).

  q = RoPE(q_norm(x Wq)), k = RoPE(k_norm(x Wk)), v = x Wv
  out = softmax(q k^T / sqrt(head_dim) + mask) v, then o_proj.
The same module serves the full forward (`__call__`) and cached decode (`decode`): decode
first writes this call's k/v at their positions, then attends over the whole cache.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from spopp_jax.models.cache import AttentionCache, write_at_positions
from spopp_jax.models.config import ModelConfig
from spopp_jax.models.layers import (Linear, RMSNorm, apply_rope, grouped_query_attention,
                                     rope_inverse_frequencies)
from spopp_jax.models.masks import TokenLayout


class Attention(nnx.Module):
    """Qwen3 / Qwen2 attention token mixer (HF name: `self_attn`)."""

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, head_dim = config.hidden_size, config.head_dim
        self.q_proj = Linear(hidden, self.num_heads * head_dim, use_bias=config.qkv_bias,
                             dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, use_bias=config.qkv_bias,
                             dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, use_bias=config.qkv_bias,
                             dtype=dtype, rngs=rngs)
        self.o_proj = Linear(self.num_heads * head_dim, hidden, use_bias=config.o_bias,
                             dtype=dtype, rngs=rngs)
        if config.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps=config.rms_norm_eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.rope = (config.rope_theta, config.rope_type, config.rope_factor)

    def init_cache(self, batch_size: int, max_len: int, dtype) -> AttentionCache:
        return AttentionCache.zeros(batch_size, max_len, self.num_kv_heads, self.head_dim, dtype)

    def _project(self, x: jax.Array, positions: jax.Array):
        """q [B, T, K, G, D], k and v [B, T, K, D], rotary applied at `positions`."""
        batch, time, _ = x.shape
        q = self.q_proj(x).reshape(batch, time, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, time, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, time, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq = rope_inverse_frequencies(self.head_dim, *self.rope)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        groups = self.num_heads // self.num_kv_heads
        return q.reshape(batch, time, self.num_kv_heads, groups, self.head_dim), k, v

    def _output(self, attended: jax.Array) -> jax.Array:
        batch, time = attended.shape[:2]
        return self.o_proj(attended.reshape(batch, time, self.num_heads * self.head_dim))

    def __call__(self, x: jax.Array, layout: TokenLayout) -> jax.Array:
        q, k, v = self._project(x, layout.positions)
        return self._output(grouped_query_attention(q, k, v, layout.may_attend))

    def decode(self, x: jax.Array, layout: TokenLayout,
               cache: AttentionCache) -> tuple[jax.Array, AttentionCache]:
        q, k, v = self._project(x, layout.positions)
        cache = AttentionCache(key=write_at_positions(cache.key, k, layout.positions),
                               value=write_at_positions(cache.value, v, layout.positions))
        attended = grouped_query_attention(q.astype(cache.key.dtype), cache.key, cache.value,
                                           layout.may_attend)
        return self._output(attended.astype(x.dtype)), cache
