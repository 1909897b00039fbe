"""Decode-time caches: one pytree per layer, so layer types can keep different state.

`KVCache` is a tuple with one entry per decoder layer. Attention layers hold an
`AttentionCache` (keys/values indexed by absolute position); Gated DeltaNet layers hold a
`LinearAttentionCache` (the conv window and the recurrent state after the row's last token:
constant size, whatever the context length). Every leaf has the slot (batch) axis first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionCache:
    """key, value: [batch, max_len, kv_heads, head_dim]; index = absolute token position."""

    key: jax.Array
    value: jax.Array

    @classmethod
    def zeros(cls, batch_size: int, max_len: int, kv_heads: int, head_dim: int,
              dtype) -> "AttentionCache":
        shape = (batch_size, max_len, kv_heads, head_dim)
        return cls(key=jnp.zeros(shape, dtype), value=jnp.zeros(shape, dtype))

    @property
    def max_len(self) -> int:
        return self.key.shape[1]


@struct.dataclass
class LinearAttentionCache:
    """conv: [batch, kernel - 1, conv_dim], the row's last kernel - 1 conv inputs (zeros
    where the run is shorter); state: [batch, heads, key_dim, value_dim] float32, the delta
    rule state S after the row's last token."""

    conv: jax.Array
    state: jax.Array

    @classmethod
    def zeros(cls, batch_size: int, kernel_size: int, conv_dim: int, heads: int, key_dim: int,
              value_dim: int, dtype) -> "LinearAttentionCache":
        return cls(conv=jnp.zeros((batch_size, kernel_size - 1, conv_dim), dtype),
                   state=jnp.zeros((batch_size, heads, key_dim, value_dim), jnp.float32))


KVCache = tuple  # tuple[AttentionCache | LinearAttentionCache, ...], one per layer


def write_at_positions(buffer: jax.Array, update: jax.Array, positions: jax.Array) -> jax.Array:
    """buffer[b, positions[b, t]] = update[b, t] for positions >= 0 (others dropped).

    buffer: [B, S, ...]; update: [B, T, ...]; positions: [B, T] int. Positions outside
    [0, S) write nothing (mode="drop"), so padding (position < 0) leaves the buffer as is.
    """
    if buffer.ndim < 2 or update.shape[:2] != positions.shape:
        raise ValueError(f"update [B, T, ...] must match positions [B, T]: {update.shape}, "
                         f"{positions.shape}")
    if update.shape[0] != buffer.shape[0] or update.shape[2:] != buffer.shape[2:]:
        raise ValueError(f"update {update.shape} does not fit buffer {buffer.shape}")
    max_len = buffer.shape[1]
    index = jnp.where(positions >= 0, positions, max_len)  # out of range -> dropped
    rows = jnp.broadcast_to(jnp.arange(buffer.shape[0])[:, None], positions.shape)
    return buffer.at[rows, index].set(update.astype(buffer.dtype), mode="drop")
