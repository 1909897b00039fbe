"""Attention masks and default positions, as [B, T, S] booleans (never [B, H, T, S]).

Full-sequence forward (training / scoring):
  may_attend[b, t, s] = (s <= t) & real[b, s] & (segment[b, s] == segment[b, t])
Cached decode (the rollout engine):
  may_attend[b, t, s] = (s <= position[b, t]) & (position[b, t] >= 0)
where s indexes the cache by absolute position.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenLayout(NamedTuple):
    """What a token mixer needs to know about the tokens of one call.

    positions: [B, T] int32 rotary positions (< 0 = padding in cached decode).
    may_attend: [B, T, S] bool; S = T for the full forward, S = cache length for decode.
    token_valid: [B, T] bool, real (non-padding) tokens.
    segment_ids: [B, T] int32 packed-sequence ids (all 0 when not packed).
    """

    positions: jax.Array
    may_attend: jax.Array
    token_valid: jax.Array
    segment_ids: jax.Array


def sequence_layout(input_ids: jax.Array, attention_mask: jax.Array | None = None,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> TokenLayout:
    """Layout of a full forward over [B, T] tokens.

    attention_mask: [B, T] (bool or 0/1), True for real tokens (default all real).
    segment_ids: [B, T] int, tokens attend only within their segment (default one segment).
    positions: [B, T] int; default = number of earlier real tokens of the same segment, so
    left padding and packed sequences both start at position 0.
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    shape = input_ids.shape
    token_valid = (jnp.ones(shape, bool) if attention_mask is None
                   else _checked(attention_mask, shape, "attention_mask").astype(bool))
    segment_ids = (jnp.zeros(shape, jnp.int32) if segment_ids is None
                   else _checked(segment_ids, shape, "segment_ids").astype(jnp.int32))
    time = jnp.arange(shape[1])
    causal = time[None, :] <= time[:, None]                               # [T, S]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]     # [B, T, S]
    may_attend = causal[None] & same_segment & token_valid[:, None, :]
    if positions is None:
        positions = jnp.maximum(jnp.sum(may_attend, axis=-1, dtype=jnp.int32) - 1, 0)
    else:
        positions = _checked(positions, shape, "positions").astype(jnp.int32)
    return TokenLayout(positions, may_attend, token_valid, segment_ids)


def cached_layout(positions: jax.Array, cache_len: int) -> TokenLayout:
    """Layout of a cached decode step: row b's token t sits at cache index positions[b, t]
    and attends to cache indices <= positions[b, t]; positions < 0 are padding."""
    if positions.ndim != 2:
        raise ValueError(f"positions must be [B, T], got shape {positions.shape}")
    positions = positions.astype(jnp.int32)
    token_valid = positions >= 0
    cache_index = jnp.arange(cache_len)
    may_attend = (cache_index[None, None, :] <= positions[:, :, None]) & token_valid[:, :, None]
    return TokenLayout(positions, may_attend, token_valid, jnp.zeros_like(positions))


def _checked(x: jax.Array, shape: tuple[int, ...], name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (as input_ids), got {x.shape}")
    return x
