"""Advantage whitening under the trajectory or the action-token measure (SPEC section 4).

For n finished trajectories with scalar advantages A_i and action-token counts L_i:

    trajectory measure:    μ = (1/n) Σ A_i,          σ² = Σ (A_i − μ)² / (n − 1)
    action-token measure:  μ = Σ L_i A_i / Σ L_i,    σ² = Σ L_i (A_i − μ)² / (Σ L_i − 1)
    Ã_i = (A_i − μ) / (σ + eps)

Both are one weighted formula with weights w_i = 1 (trajectory) or w_i = L_i (token):
μ = Σ w A / Σ w, σ² = Σ w (A − μ)² / (Σ w − 1).

Edge cases (SPEC 4):
  * constant advantages (σ² = 0 exactly, including after float rounding: the data are
    shifted by one weighted element before summing, so equal values give exactly 0) and a
    single trajectory (n = 1, or Σ L_i = 1) give Ã = 0, never NaN;
  * L_i = 0 trajectories carry no token weight (they do count in the trajectory measure);
  * Σ L_i = 0 under the token measure gives Ã = 0;
  * *nearly* constant advantages are whitened as the formula says (|Ã_i| stays bounded by
    sqrt(Σw) for weighted entries, but noise is amplified; documented, not hidden).

Degenerate input, eagerly and under ``jit`` (where value checks cannot run):

  ============================  =============================  ==========================
  input                         eager call                     under jit
  ============================  =============================  ==========================
  empty batch (n = 0)           ValueError                     ValueError (a shape)
  every L_i = 0 (all masked)    Ã = 0 (token measure)          Ã = 0
  a NaN / inf advantage         ValueError                     Ã = NaN for every entry:
                                                               the learner's guard skips
                                                               the update (never a silent
                                                               all-zero batch)
  a negative L_i                ValueError                     Ã = NaN for every entry
  eps < 0, NaN or inf           ValueError (a negative eps     ValueError when eps is a
                                flips signs where σ < |eps|,   Python number; a traced
                                an infinite one zeroes Ã)      eps is not checked
  ============================  =============================  ==========================

Statistics are float32. :func:`whiten_tokens` computes the same thing from a packed token
stream with segment sums, so it can run on the learner's ``[B, T]`` batch directly.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from spopp_jax import _checks

__all__ = [
    "MEASURES",
    "whiten",
    "whiten_tokens",
    "token_weighted_center",
    "length_advantage_cov",
    "batch_stats",
]

MEASURES = ("token", "trajectory")


def _check_measure(measure: str) -> None:
    if measure not in MEASURES:
        raise ValueError(f"`measure` must be one of {MEASURES}, got {measure!r}")


def _check_trajectory_args(advantages, action_lengths) -> None:
    _checks.check_rank("advantages", advantages, 1)
    _checks.check_same_shape({"advantages": advantages, "action_lengths": action_lengths})
    if advantages.shape[0] == 0:
        raise ValueError("`advantages` is empty: need at least one trajectory")
    _checks.check_floating("advantages", advantages)
    _checks.check_bool_or_numeric("action_lengths", action_lengths)
    _checks.check_values(
        lambda a: np.all(np.isfinite(a)), "`advantages` must be finite", advantages
    )
    _checks.check_values(
        lambda n: np.all(np.isfinite(n) & (n >= 0)),
        "`action_lengths` must be finite and >= 0",
        action_lengths,
    )


def _check_eps(eps) -> None:
    """eps must be finite and >= 0 when it is a concrete number (a traced one is not
    checked): a negative eps flips the sign of Ã where σ < |eps|, an infinite one zeroes Ã."""
    if isinstance(eps, (int, float, np.number)) or (_checks.is_concrete(eps) and np.ndim(eps) == 0):
        value = float(eps)
        if not (np.isfinite(value) and value >= 0):
            raise ValueError(f"`eps` must be finite and >= 0, got {value!r} (a negative eps flips "
                             "the advantages' signs, an infinite one makes them all 0)")


def _weighted_whiten(values: jax.Array, weights: jax.Array, eps: float) -> jax.Array:
    """(values − μ_w) / (σ_w + eps), zeros when σ_w² = 0 or Σw = 0; every entry NaN when a
    value is not finite or a weight is negative or not finite (see module doc)."""
    _check_eps(eps)
    poisoned = ~jnp.all(jnp.isfinite(values) & jnp.isfinite(weights) & (weights >= 0))
    total = jnp.sum(weights)
    # Shift by the first positively weighted value: constant data become exact zeros.
    shift = values[jnp.argmax(weights > 0)]
    shifted = values - shift
    mean_shifted = jnp.sum(weights * shifted) / jnp.maximum(total, 1e-30)
    centered = shifted - mean_shifted
    denom = jnp.where(total > 1.0, total - 1.0, 1.0)
    var = jnp.sum(weights * centered * centered) / denom
    std = jnp.sqrt(var)
    ok = (var > 0) & (total > 0)
    whitened = jnp.where(ok, centered / jnp.where(ok, std + eps, 1.0), 0.0)
    return jnp.where(poisoned, jnp.nan, whitened)


def whiten(
    advantages: jax.Array,
    action_lengths: jax.Array,
    measure: str = "token",
    eps: float = 1e-8,
) -> jax.Array:
    """Whiten [n] scalar advantages under ``measure`` ("token" or "trajectory"), SPEC 4.

    Args:
      advantages: [n] float A_i.
      action_lengths: [n] L_i >= 0, the action tokens of trajectory i.
      measure: "token" (SPO++, weights L_i) or "trajectory" (weights 1). Static.
      eps: added to σ.

    Returns:
      [n] float32 Ã_i (broadcast it to trajectory i's tokens).
    """
    _check_measure(measure)
    advantages = jnp.asarray(advantages)
    action_lengths = jnp.asarray(action_lengths)
    _check_trajectory_args(advantages, action_lengths)
    values = advantages.astype(jnp.float32)
    if measure == "token":
        weights = action_lengths.astype(jnp.float32)
    else:
        weights = jnp.ones_like(values)
    return _weighted_whiten(values, weights, eps)


def token_weighted_center(advantages: jax.Array, action_lengths: jax.Array) -> jax.Array:
    """Loss-weighted centre Σ L_i A_i / Σ L_i (0 when Σ L_i = 0), SPEC 4."""
    advantages = jnp.asarray(advantages)
    action_lengths = jnp.asarray(action_lengths)
    _check_trajectory_args(advantages, action_lengths)
    weights = action_lengths.astype(jnp.float32)
    total = jnp.sum(weights)
    num = jnp.sum(weights * advantages.astype(jnp.float32))
    return jnp.where(total > 0, num / jnp.maximum(total, 1e-30), 0.0)


def length_advantage_cov(action_lengths: jax.Array, advantages: jax.Array) -> jax.Array:
    """Cov_n(L, A) = (1/n) Σ (L_i − L̄)(A_i − Ā) (divisor n), SPEC 4 / Eq. 5."""
    advantages = jnp.asarray(advantages)
    action_lengths = jnp.asarray(action_lengths)
    _check_trajectory_args(advantages, action_lengths)
    lengths = action_lengths.astype(jnp.float32)
    adv = advantages.astype(jnp.float32)
    return jnp.mean((lengths - jnp.mean(lengths)) * (adv - jnp.mean(adv)))


def _segment_table(advantages, segment_ids, action_mask, num_segments):
    """Per-segment (A_i, L_i, present_i) from a flat token stream (padding: id < 0).

    L_i is a segment sum; A_i is read with a scatter-*set* (one value of the segment, so
    no averaging round-off, and much cheaper than a scatter-add on CPU).
    """
    valid = (segment_ids >= 0) & (segment_ids < num_segments)
    action = valid & (action_mask != 0)
    adv = advantages.astype(jnp.float32)
    n = num_segments + 1  # the last bucket swallows padding / ignored tokens
    all_ids = jnp.where(valid, segment_ids, num_segments)
    action_ids = jnp.where(action, segment_ids, num_segments)

    lengths = jax.ops.segment_sum(action.astype(jnp.float32), action_ids, num_segments=n)
    lengths = lengths[:num_segments]
    present = jnp.zeros(n, bool).at[all_ids].set(True)[:num_segments]
    # A_i from its action tokens when it has any, else from any of its tokens.
    from_all = jnp.zeros(n, jnp.float32).at[all_ids].set(adv)[:num_segments]
    from_actions = jnp.zeros(n, jnp.float32).at[action_ids].set(adv)[:num_segments]
    seg_adv = jnp.where(lengths > 0, from_actions, jnp.where(present, from_all, 0.0))

    def consistent(seg_adv, ids, act, val, a):
        has_action = np.zeros(num_segments, bool)
        has_action[ids[act]] = True
        read = act | (val & ~has_action[np.where(val, ids, 0)])
        return np.all(a[read] == seg_adv[ids[read]])

    _checks.check_values(
        consistent,
        "`advantages` must be constant over each trajectory's action tokens "
        "(over all its tokens when it has none)",
        seg_adv, segment_ids, action, valid, adv,
    )
    return seg_adv, lengths, present, all_ids, valid


def whiten_tokens(
    advantages: jax.Array,
    segment_ids: jax.Array,
    action_mask: jax.Array,
    num_segments: int,
    measure: str = "token",
    eps: float = 1e-8,
) -> jax.Array:
    """:func:`whiten` computed from a packed token stream with segment sums (SPEC 4).

    Args:
      advantages: [...] float, trajectory i's scalar A_i broadcast to its tokens (at least
        to its action tokens; A_i is read from its action tokens, or from all its tokens
        when it has none; a value check rejects a trajectory whose values differ there).
      segment_ids: [...] int trajectory index in [0, num_segments) of each token, global
        across the whole array (rows of a ``[B, T]`` batch must not reuse ids); a negative
        id marks padding.
      action_mask: [...] bool/0-1, True on tokens generated by the policy; L_i = Σ mask.
      num_segments: static number of trajectory slots; a slot with no token is absent
        (it counts in neither measure).
      measure, eps: as in :func:`whiten`.

    Returns:
      [...] float32: Ã of each token's trajectory (on all its tokens), 0 on padding.
      Equals ``whiten(A, L, measure)[segment_ids]`` for the present trajectories.
    """
    _check_measure(measure)
    advantages = jnp.asarray(advantages)
    segment_ids = jnp.asarray(segment_ids)
    action_mask = jnp.asarray(action_mask)
    _checks.check_same_shape(
        {"advantages": advantages, "segment_ids": segment_ids, "action_mask": action_mask}
    )
    _checks.check_floating("advantages", advantages)
    _checks.check_integer("segment_ids", segment_ids)
    _checks.check_bool_or_numeric("action_mask", action_mask)
    if not (isinstance(num_segments, (int, np.integer)) and num_segments >= 1):
        raise ValueError(f"`num_segments` must be a static int >= 1, got {num_segments!r}")
    _checks.check_values(
        lambda s: np.all(s < num_segments),
        f"`segment_ids` must be < num_segments={num_segments} (negative = padding)",
        segment_ids,
    )
    _checks.check_values(
        lambda a, s: np.all(np.isfinite(a) | (s < 0)),
        "`advantages` must be finite on non-padding tokens",
        advantages,
        segment_ids,
    )
    shape = advantages.shape
    seg_adv, lengths, present, ids, valid = _segment_table(
        advantages.reshape(-1), segment_ids.reshape(-1), action_mask.reshape(-1), num_segments
    )
    weights = lengths if measure == "token" else present.astype(jnp.float32)
    whitened = _weighted_whiten(seg_adv, weights, eps)
    per_token = jnp.where(valid, jnp.append(whitened, 0.0)[ids], 0.0)
    return per_token.reshape(shape)


def _quantile_key(q: float) -> str:
    return f"length_q{100 * q:g}".replace(".", "_")


def batch_stats(
    advantages: jax.Array,
    action_lengths: jax.Array,
    quantiles: Sequence[float] = (0.0, 0.1, 0.5, 0.9, 1.0),
    eps: float = 1e-8,
) -> dict[str, jax.Array]:
    """Per-batch diagnostics SPEC 4 asks to log (a flat dict of float32 scalars).

    Keys:
      ``cov_n_length_advantage``: Cov_n(L, A) of the raw advantages;
      ``center_after_trajectory_whitening``: Σ L Ã / Σ L with trajectory-measure Ã
        (= Cov_n(L, Ã)/L̄, SPEC Eq. 5);
      ``center_after_token_whitening``: the same with token-measure Ã (0 up to rounding);
      ``length_mean``, ``num_action_tokens``, ``num_trajectories``;
      ``length_q<p>`` for each requested quantile p (e.g. ``length_q50``), linear
      interpolation as ``jnp.quantile``.
    """
    advantages = jnp.asarray(advantages)
    action_lengths = jnp.asarray(action_lengths)
    _check_trajectory_args(advantages, action_lengths)
    for q in quantiles:
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"`quantiles` must lie in [0, 1], got {q}")
    lengths = action_lengths.astype(jnp.float32)
    traj = whiten(advantages, action_lengths, "trajectory", eps)
    tok = whiten(advantages, action_lengths, "token", eps)
    stats = {
        "cov_n_length_advantage": length_advantage_cov(action_lengths, advantages),
        "center_after_trajectory_whitening": token_weighted_center(traj, action_lengths),
        "center_after_token_whitening": token_weighted_center(tok, action_lengths),
        "length_mean": jnp.mean(lengths),
        "num_action_tokens": jnp.sum(lengths),
        "num_trajectories": jnp.asarray(lengths.shape[0], jnp.float32),
    }
    levels = jnp.quantile(lengths, jnp.asarray(quantiles, jnp.float32))
    for i, q in enumerate(quantiles):
        stats[_quantile_key(q)] = levels[i]
    return stats
