"""Pure, jit-friendly state transitions of the slot-based (continuous-batching) decoder.

The engine owns ``num_slots`` rows of one KV cache (``model.init_cache``). A request lives
in one slot from admission to finish; slots join and leave between decode chunks, and every
row keeps its own position, so there is no padding to the longest request.

Token timeline of a request with prompt ``p[0..L-1]`` (cache length ``max_len``):
  * ``admit``: the prefix ``p[start..L-2]`` is written to cache indices ``start..L-2`` of
    its slot (one batched prefill over the admitted rows only), ``last_token = p[L-1]``,
    ``position = L-1``. ``start`` is 0, or the length of a prefix ``p[0..start-1]`` the
    slot's cache rows already hold (prefix reuse across the turns of one conversation:
    the previous request's prompt and tokens; ``JaxEngine`` decides when it may).
  * each decode step feeds ``last_token`` at ``position`` (written, then attended with
    indices ``<= position``), samples token ``g`` from the resulting logits
    (``sampling_ops.sample_with_uniforms``; the uniform of the request's i-th token is
    drawn from ``fold_in(rng_key, i)``), then ``last_token = g``, ``position += 1``.
  * the request finishes right after sampling a stop token ("stop") or its
    ``max_new_tokens``-th token ("length"). The host caps ``max_new_tokens`` at
    ``max_len - L + 1`` so no position exceeds ``max_len - 1``.

Functions take ``(graphdef, params, ...)`` and ``nnx.merge`` inside, so weights are jit
arguments: publishing new weights of the same structure never recompiles.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from rollout_bridge.engine.sampling_ops import sample_with_uniforms, uniforms_from_keys
from spopp_jax.models.cache import AttentionCache

FINISH_NONE = 0
FINISH_STOP = 1
FINISH_LENGTH = 2


@flax.struct.dataclass
class SlotState:
    """Device state of all slots (leading dim S = num_slots everywhere but ``cache``)."""

    cache: Any  # the model's KVCache pytree, batch = S
    last_token: jax.Array  # [S] int32, token fed at the next step
    position: jax.Array  # [S] int32, cache index ``last_token`` is written to
    active: jax.Array  # [S] bool, slot holds a running request
    num_generated: jax.Array  # [S] int32
    max_new_tokens: jax.Array  # [S] int32 (already capped by the cache length)
    temperature: jax.Array  # [S] float32
    top_k: jax.Array  # [S] int32 (<= 0: off)
    top_p: jax.Array  # [S] float32
    rng_key: jax.Array  # [S, 2] uint32, the request's key; step i uses fold_in(key, i)
    stop_token_ids: jax.Array  # [S, MAX_STOP] int32, padded with -1


@flax.struct.dataclass
class SlotRequests:
    """P requests to admit (rows with ``slot == num_slots`` are padding and dropped)."""

    slot: jax.Array  # [P] int32
    prefix_ids: jax.Array  # [P, T] int32, prompt[start:-1] left-aligned, padded with 0
    prefix_len: jax.Array  # [P] int32, len(prompt) - 1
    start: jax.Array  # [P] int32, cache positions 0..start-1 already hold prompt[:start]
    last_token: jax.Array  # [P] int32, prompt[-1]
    max_new_tokens: jax.Array  # [P] int32
    temperature: jax.Array  # [P] float32
    top_k: jax.Array  # [P] int32
    top_p: jax.Array  # [P] float32
    rng_key: jax.Array  # [P, 2] uint32
    stop_token_ids: jax.Array  # [P, MAX_STOP] int32


@flax.struct.dataclass
class DecodeOutput:
    """What ``num_steps`` decode steps produced, step-major ([n, S])."""

    token_ids: jax.Array  # int32
    logprobs: jax.Array  # float32, log_softmax(logits / temperature)[token]
    emitted: jax.Array  # bool, the slot was active and sampled this token
    finish: jax.Array  # int32, FINISH_* of the slot after this step


def _check_cache_batch(cache: Any, num_slots: int) -> None:
    for leaf in jax.tree.leaves(cache):
        if leaf.ndim == 0 or leaf.shape[0] != num_slots:
            raise ValueError(
                f"cache leaves must have the slot (batch) axis first with size {num_slots}, "
                f"got a leaf of shape {leaf.shape}"
            )


def init_slot_state(model: nnx.Module, num_slots: int, max_len: int, max_stop_tokens: int, cache_dtype: Any) -> SlotState:
    """All slots free; the cache comes from ``model.init_cache(num_slots, max_len, dtype)``."""
    if num_slots < 1 or max_len < 2 or max_stop_tokens < 1:
        raise ValueError(
            f"need num_slots >= 1, max_len >= 2, max_stop_tokens >= 1; got "
            f"{num_slots}, {max_len}, {max_stop_tokens}"
        )
    cache = model.init_cache(num_slots, max_len, cache_dtype)
    _check_cache_batch(cache, num_slots)
    zeros_i = jnp.zeros((num_slots,), jnp.int32)
    return SlotState(
        cache=cache,
        last_token=zeros_i,
        position=zeros_i,
        active=jnp.zeros((num_slots,), bool),
        num_generated=zeros_i,
        max_new_tokens=zeros_i,
        temperature=jnp.ones((num_slots,), jnp.float32),
        top_k=zeros_i,
        top_p=jnp.ones((num_slots,), jnp.float32),
        rng_key=jnp.zeros((num_slots, 2), jnp.uint32),
        stop_token_ids=jnp.full((num_slots, max_stop_tokens), -1, jnp.int32),
    )


def _take_rows(cache: Any, rows: jax.Array) -> Any:
    return jax.tree.map(lambda x: jnp.take(x, rows, axis=0, mode="clip"), cache)


def _put_rows(cache: Any, rows: jax.Array, values: Any) -> Any:
    return jax.tree.map(lambda x, v: x.at[rows].set(v, mode="drop"), cache, values)


def _key_window(cache: Any, key_len: int | None) -> Any:
    """The first ``key_len`` positions of every attention layer's rows (others whole)."""
    if key_len is None:
        return cache
    return tuple(AttentionCache(key=layer.key[:, :key_len], value=layer.value[:, :key_len])
                 if isinstance(layer, AttentionCache) else layer for layer in cache)


def _put_key_window(cache: Any, window: Any) -> Any:
    """``cache`` with `_key_window`'s positions replaced by ``window``'s."""
    return tuple(AttentionCache(key=full.key.at[:, :part.key.shape[1]].set(part.key),
                                value=full.value.at[:, :part.value.shape[1]].set(part.value))
                 if isinstance(full, AttentionCache) else part for full, part in zip(cache, window))


def admit(graphdef: nnx.GraphDef, params: nnx.State, state: SlotState, requests: SlotRequests,
          key_len: int | None = None) -> SlotState:
    """Prefill the admitted requests' prefixes into their slots' cache rows; start them.

    Only the P admitted rows go through the model (gathered from, then scattered back into,
    the S-row cache); padding rows (``slot == S``) are clipped on gather and dropped on
    scatter, and their positions are -1 so the model writes nothing for them. Row p's
    token t is written at position ``start[p] + t`` and attends to the cache indices up to
    it, so a reused prefix (``start > 0``) is read from the row, not recomputed; entries
    beyond the new tokens are never attended (indices > position are masked).
    ``key_len`` (static; None = the whole cache): the prefill reads and writes only cache
    positions < key_len, so its attention costs P x T x key_len instead of P x T x
    max_len; every row's ``prefix_len`` must be <= key_len (the positions it writes).
    """
    num_slots = state.active.shape[0]
    prefix_width = requests.prefix_ids.shape[1]
    if requests.prefix_ids.ndim != 2 or requests.slot.shape != requests.prefix_ids.shape[:1]:
        raise ValueError(
            f"requests.prefix_ids must be [P, T] with slot [P], got {requests.prefix_ids.shape} "
            f"and {requests.slot.shape}"
        )
    model = nnx.merge(graphdef, params)
    index = jnp.arange(prefix_width, dtype=jnp.int32)[None, :]
    real = requests.slot < num_slots
    new_tokens = requests.prefix_len - requests.start
    positions = jnp.where((index < new_tokens[:, None]) & real[:, None], requests.start[:, None] + index, -1)
    rows_cache = _take_rows(state.cache, requests.slot)
    _, window = model.forward_cached(requests.prefix_ids, positions, _key_window(rows_cache, key_len))
    rows_cache = _put_key_window(rows_cache, window) if key_len is not None else window
    rows = requests.slot

    def put(field: jax.Array, value: jax.Array) -> jax.Array:
        return field.at[rows].set(value.astype(field.dtype), mode="drop")

    return state.replace(
        cache=_put_rows(state.cache, rows, rows_cache),
        last_token=put(state.last_token, requests.last_token),
        position=put(state.position, requests.prefix_len),
        active=put(state.active, real),
        num_generated=put(state.num_generated, jnp.zeros_like(requests.slot)),
        max_new_tokens=put(state.max_new_tokens, requests.max_new_tokens),
        temperature=put(state.temperature, requests.temperature),
        top_k=put(state.top_k, requests.top_k),
        top_p=put(state.top_p, requests.top_p),
        rng_key=put(state.rng_key, requests.rng_key),
        stop_token_ids=put(state.stop_token_ids, requests.stop_token_ids),
    )


def chunk_uniforms(rng_key: jax.Array, num_generated: jax.Array, num_steps: int) -> jax.Array:
    """The sampling uniforms of a whole decode chunk, drawn at once: [num_steps, S],

      u[j, s] = uniforms_from_keys(fold_in(rng_key[s], num_generated[s] + j))
    i.e. the uniform of row s's (num_generated[s] + j)-th token. A row active at step j of
    a chunk was active at every earlier step of it (slots join and leave between chunks),
    so its counter then is exactly num_generated[s] + j: the same draws as one
    ``fold_in`` per step. Why at once: XLA:CPU runs threefry as a rolled while loop of
    small kernels (5 iterations of ~16 each, for fold_in and again for the uniform);
    inside the decode step that was about as many kernel launches as the model's whole
    forward. Per chunk it is two loops over [num_steps * S] words.
    """
    num_slots = num_generated.shape[0]
    counts = num_generated[None, :] + jnp.arange(num_steps, dtype=num_generated.dtype)[:, None]
    keys = jnp.broadcast_to(rng_key, (num_steps, *rng_key.shape)).reshape(num_steps * num_slots, -1)
    keys = jax.vmap(jax.random.fold_in)(keys, counts.reshape(-1))
    return uniforms_from_keys(keys).reshape(num_steps, num_slots)


def _decode_step(model: nnx.Module, state: SlotState, uniform: jax.Array) -> tuple[SlotState, DecodeOutput]:
    positions = jnp.where(state.active, state.position, -1)[:, None]
    logits, cache = model.forward_cached(state.last_token[:, None], positions, state.cache)
    tokens, logprobs = sample_with_uniforms(logits[:, -1, :], state.temperature, state.top_k, state.top_p, uniform)
    num_generated = state.num_generated + state.active.astype(jnp.int32)
    hit_stop = jnp.any(tokens[:, None] == state.stop_token_ids, axis=-1)
    hit_length = num_generated >= state.max_new_tokens
    finish = jnp.where(
        state.active & hit_stop, FINISH_STOP, jnp.where(state.active & hit_length, FINISH_LENGTH, FINISH_NONE)
    ).astype(jnp.int32)
    still_active = state.active & (finish == FINISH_NONE)
    new_state = state.replace(
        cache=cache,
        last_token=jnp.where(still_active, tokens, state.last_token),
        position=state.position + still_active.astype(jnp.int32),
        active=still_active,
        num_generated=num_generated,
    )
    return new_state, DecodeOutput(token_ids=tokens, logprobs=logprobs, emitted=state.active, finish=finish)


def decode_steps(graphdef: nnx.GraphDef, params: nnx.State, state: SlotState, num_steps: int) -> tuple[SlotState, DecodeOutput]:
    """Run ``num_steps`` decode steps over all slots in one ``lax.scan`` (one host round-trip).

    A slot that finishes mid-chunk goes inactive (its positions become -1: no cache writes,
    no emitted tokens) for the rest of the chunk. Shapes are fixed by (S, num_steps): one
    compile. The chunk's sampling uniforms are drawn before the scan (``chunk_uniforms``).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    model = nnx.merge(graphdef, params)
    uniforms = chunk_uniforms(state.rng_key, state.num_generated, num_steps)

    def body(carry: SlotState, uniform: jax.Array) -> tuple[SlotState, DecodeOutput]:
        return _decode_step(model, carry, uniform)

    return jax.lax.scan(body, state, uniforms)


def release(state: SlotState, slot_mask: jax.Array) -> SlotState:
    """Deactivate the slots where ``slot_mask`` [S] is True (abort / cancelled requests)."""
    if slot_mask.shape != state.active.shape:
        raise ValueError(f"slot_mask must be [S]={state.active.shape}, got {slot_mask.shape}")
    return state.replace(active=state.active & ~slot_mask)
