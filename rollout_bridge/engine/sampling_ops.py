"""Jitted per-row token sampling: temperature, top-k, top-p, behaviour log-probs.

Pure functions over a batch of rows (one row = one engine slot); every row carries its
own temperature / top-k / top-p / PRNG key, so requests with different sampling params
share one decode batch. Semantics (the engine contract in docs/DESIGN.md):

  scaled_logp = log_softmax(logits / temperature)            float32, over the full vocab
  allowed     = top-p( top-k( scaled_logp ) )                k first, then nucleus p
  token       ~ Categorical(softmax(scaled_logp restricted to allowed))
  logprob     = scaled_logp[token]                          (BEFORE top-k / top-p)

The log-prob is the one the learner's importance weight compares against (SPEC 5), read
from the same float32 logits that sampled the token.

top-k: the k highest-ranked tokens (``top_k <= 0`` or ``>= V``: off). top-p: after top-k,
the smallest prefix of the ranking whose renormalised mass reaches ``top_p`` (the
top-ranked token is always kept; ``top_p >= 1``: off). Ranking ties break towards the lower
token id, so the allowed set is exactly ``top_k`` tokens and ``top_k == 1`` is argmax
(``jnp.argmax`` also returns the first maximum).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_rows(logits: jax.Array, **per_row: jax.Array) -> None:
    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
    for name, value in per_row.items():
        if value.shape[:1] != logits.shape[:1]:
            raise ValueError(f"{name} must have leading dim B={logits.shape[0]}, got shape {value.shape}")


def scaled_log_probs(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """log_softmax(logits / temperature) in float32.

    Args:
      logits: [B, V] any float dtype.
      temperature: [B] float, > 0.
    Returns:
      [B, V] float32 log-probabilities.
    """
    _check_rows(logits, temperature=temperature)
    if temperature.ndim != 1:
        raise ValueError(f"temperature must be [B], got shape {temperature.shape}")
    scaled = logits.astype(jnp.float32) / temperature.astype(jnp.float32)[:, None]
    return jax.nn.log_softmax(scaled, axis=-1)


def allowed_token_mask(log_probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Boolean [B, V] mask of the tokens top-k then top-p allow.

    Args:
      log_probs: [B, V] float32 normalised log-probabilities (``scaled_log_probs``).
      top_k: [B] int; ``<= 0`` or ``>= V`` disables top-k.
      top_p: [B] float in (0, 1]; ``>= 1`` disables top-p.
    Returns:
      [B, V] bool, True where the token may be sampled. At least one token per row.
    """
    _check_rows(log_probs, top_k=top_k, top_p=top_p)
    batch, vocab = log_probs.shape
    # Stable sort of -logp: descending probability, ties -> lower token id first.
    order = jnp.argsort(-log_probs, axis=-1, stable=True)
    sorted_logp = jnp.take_along_axis(log_probs, order, axis=-1)
    rank = jnp.arange(vocab, dtype=jnp.int32)[None, :]
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k).astype(jnp.int32)
    keep_k = rank < k[:, None]
    # Renormalise over the top-k set, then keep ranks whose EXCLUSIVE cumulative mass is
    # below top_p: the smallest prefix reaching top_p (rank 0 always kept).
    masked_sorted = jnp.where(keep_k, sorted_logp, -jnp.inf)
    probs = jax.nn.softmax(masked_sorted, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    p = top_p.astype(jnp.float32)[:, None]
    keep_sorted = keep_k & ((mass_before < p) | (p >= 1.0) | (rank == 0))
    rows = jnp.arange(batch)[:, None]
    return jnp.zeros((batch, vocab), dtype=bool).at[rows, order].set(keep_sorted)


def uniforms_from_keys(keys: jax.Array) -> jax.Array:
    """One float32 uniform in (0, 1] per row: ``1 - uniform(key_b)`` ([B] keys -> [B])."""
    return 1.0 - jax.vmap(lambda key: jax.random.uniform(key, (), dtype=jnp.float32))(keys)


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row and return (token_ids [B] int32, logprobs [B] float32).

    ``sample_with_uniforms`` with u_b = ``uniforms_from_keys(keys)[b]``.

    Args:
      logits: [B, V] float.
      temperature: [B] float > 0.
      top_k: [B] int (<= 0: off).
      top_p: [B] float in (0, 1].
      keys: [B] PRNG keys (legacy uint32[B, 2] or typed), one per row.
    """
    _check_rows(logits, keys=keys)
    return sample_with_uniforms(logits, temperature, top_k, top_p, uniforms_from_keys(keys))


def sample_with_uniforms(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    uniform: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row from its uniform u in (0, 1]; (token_ids [B] int32,
    logprobs [B] float32).

    ``logprobs = log_softmax(logits / temperature)[token]`` (before filtering). Sampling is
    by inverse CDF with ONE uniform per row: token = the first index whose cumulative
    probability reaches ``u * total``; tokens outside the allowed set have zero
    probability and can never be chosen (a flat CDF step is never the first to reach u).
    One uniform per row instead of V Gumbel draws keeps the PRNG off the decode critical
    path (the engine draws a whole decode chunk's uniforms at once). The sort for
    top-k/top-p runs only when some row filters (``lax.cond``).

    Args:
      logits: [B, V] float.
      temperature: [B] float > 0.
      top_k: [B] int (<= 0: off).
      top_p: [B] float in (0, 1].
      uniform: [B] float32 in (0, 1] (``uniforms_from_keys``).
    """
    _check_rows(logits, temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform)
    vocab = logits.shape[-1]
    log_probs = scaled_log_probs(logits, temperature)
    filtering = jnp.any(((top_k > 0) & (top_k < vocab)) | (top_p < 1.0))
    probs = jax.lax.cond(
        filtering,
        lambda lp: jnp.where(allowed_token_mask(lp, top_k, top_p), jnp.exp(lp), 0.0),
        jnp.exp,
        log_probs,
    )
    cdf = jnp.cumsum(probs, axis=-1)
    target = uniform.astype(jnp.float32) * cdf[:, -1]
    tokens = jnp.sum(cdf < target[:, None], axis=-1, dtype=jnp.int32)
    tokens = jnp.minimum(tokens, vocab - 1)
    token_logp = jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
    return tokens, token_logp
