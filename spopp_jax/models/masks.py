"""Token layouts: positions and the ingredients of the attention mask.

The mask is built per query chunk by `mask_block` as [B, Tq, S] booleans (never
[B, H, T, S], and never [B, T, T] for sequences longer than one chunk).

  may_attend[b, t, s] = (key_index[s] <= query_index[b, t]) & key_valid[b, s]
                        & (query_segment[b, t] == key_segment[b, s])

Full-sequence forward (training / scoring): query_index = t, key_index = s (causal by
index), key_valid = real tokens, segments = packed-sequence ids.
Cached decode (the rollout engine): query_index = positions[b, t] (< 0 = padding, attends
to nothing), key_index = cache index s, every key valid, one segment. Row b's token at
position p attends to cache indices <= p.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class TokenLayout(NamedTuple):
    """What a token mixer needs to know about the tokens of one call ([B, T] / [B, S]).

    positions: rotary positions (int32; < 0 marks padding in cached decode).
    token_valid: real (non-padding) query tokens.
    query_index, query_segment: causal index and segment id of each query token.
    key_valid, key_segment: per key (S = T for the full forward, S = cache length).
    """

    positions: jax.Array
    token_valid: jax.Array
    query_index: jax.Array
    query_segment: jax.Array
    key_valid: jax.Array
    key_segment: jax.Array


def mask_block(query_index: jax.Array, query_segment: jax.Array, key_valid: jax.Array,
               key_segment: jax.Array) -> jax.Array:
    """[B, Tq, S] bool: (s <= query_index) & key_valid[s] & same segment."""
    key_index = jnp.arange(key_valid.shape[1], dtype=jnp.int32)
    return ((key_index[None, None, :] <= query_index[:, :, None])
            & key_valid[:, None, :]
            & (query_segment[:, :, None] == key_segment[:, None, :]))


def may_attend(layout: TokenLayout) -> jax.Array:
    """The whole [B, T, S] mask of a layout (short sequences; long ones go by chunks)."""
    return mask_block(layout.query_index, layout.query_segment, layout.key_valid,
                      layout.key_segment)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T] bool: token t begins a contiguous segment (t = 0 or its id differs from
    t - 1's)."""
    return jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def default_positions(token_valid: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Number of earlier real tokens in the same (contiguous) segment: left padding and
    every packed segment start at position 0; padding gets the last real position (>= 0).

    With c[t] = sum_{s<=t} valid[s] and base[t] = c just before t's segment starts,
    position[t] = max(c[t] - base[t] - 1, 0). O(B T).
    """
    valid = token_valid.astype(jnp.int32)
    count = jnp.cumsum(valid, axis=1)
    starts = segment_starts(segment_ids)
    base = jax.lax.cummax(jnp.where(starts, count - valid, 0), axis=1)
    return jnp.maximum(count - base - 1, 0)


def sequence_layout(input_ids: jax.Array, attention_mask: jax.Array | None = None,
                    positions: jax.Array | None = None,
                    segment_ids: jax.Array | None = None) -> TokenLayout:
    """Layout of a full forward over [B, T] tokens.

    attention_mask: [B, T] (bool or 0/1), True for real tokens (default all real).
    segment_ids: [B, T] int, tokens attend only within their segment (default one segment).
    positions: [B, T] int; default `default_positions` (packed segments and left-padded
    rows start at 0).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
    shape = input_ids.shape
    token_valid = (jnp.ones(shape, bool) if attention_mask is None
                   else _checked(attention_mask, shape, "attention_mask").astype(bool))
    segment_ids = (jnp.zeros(shape, jnp.int32) if segment_ids is None
                   else _checked(segment_ids, shape, "segment_ids").astype(jnp.int32))
    if positions is None:
        positions = default_positions(token_valid, segment_ids)
    else:
        positions = _checked(positions, shape, "positions").astype(jnp.int32)
    query_index = jnp.broadcast_to(jnp.arange(shape[1], dtype=jnp.int32), shape)
    return TokenLayout(positions, token_valid, query_index, segment_ids, token_valid,
                       segment_ids)


def cached_layout(positions: jax.Array, cache_len: int) -> TokenLayout:
    """Layout of a cached decode step: row b's token t sits at cache index positions[b, t]
    and attends to cache indices <= positions[b, t]; positions < 0 are padding."""
    if positions.ndim != 2:
        raise ValueError(f"positions must be [B, T], got shape {positions.shape}")
    positions = positions.astype(jnp.int32)
    batch = positions.shape[0]
    return TokenLayout(positions=positions, token_valid=positions >= 0,
                       query_index=positions, query_segment=jnp.zeros_like(positions),
                       key_valid=jnp.ones((batch, cache_len), bool),
                       key_segment=jnp.zeros((batch, cache_len), jnp.int32))


def _checked(x: jax.Array, shape: tuple[int, ...], name: str) -> jax.Array:
    x = jnp.asarray(x)
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} (as input_ids), got {x.shape}")
    return x
