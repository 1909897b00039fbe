"""Offline prior of the task tracker (SPEC section 2, "Offline prior")."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spopp_jax import _checks

__all__ = ["jeffreys_prior"]


def jeffreys_prior(successes, trials, mass: float = 8.0) -> tuple[jax.Array, jax.Array]:
    """Jeffreys-smoothed Beta(s + ½, n − s + ½) rescaled to total mass M (SPEC 2):

        α0 = M (s + ½) / (n + 1),   β0 = M (n − s + ½) / (n + 1)       (n > 0)
        α0 = β0 = ½                                                    (n = 0)

    M = 1/(1 − ρ) = 8 for ρ = 0.875 (steady-state effective count).

    Args:
      successes: [...] s, integers 0 <= s <= n.
      trials: [...] n >= 0 offline rollouts per task.
      mass: M > 0.

    Returns:
      (prior_alpha, prior_beta), float32 arrays of the broadcast shape.
    """
    successes = jnp.asarray(successes)
    trials = jnp.asarray(trials)
    _checks.check_bool_or_numeric("successes", successes)
    _checks.check_bool_or_numeric("trials", trials)
    try:
        jnp.broadcast_shapes(successes.shape, trials.shape)
    except ValueError as err:
        raise ValueError(
            f"`successes` shape {successes.shape} and `trials` shape {trials.shape} "
            "do not broadcast"
        ) from err
    _checks.check_values(
        lambda n: np.all(np.isfinite(n) & (n >= 0) & (n == np.round(n))),
        "`trials` must be non-negative integers",
        trials,
    )
    _checks.check_values(
        lambda s, n: np.all(np.isfinite(s) & (s >= 0) & (s <= n) & (s == np.round(s))),
        "`successes` must be integers in [0, trials]",
        successes,
        trials,
    )
    _checks.check_positive("mass", mass)
    s = successes.astype(jnp.float32)
    n = trials.astype(jnp.float32)
    scale = mass / (n + 1.0)
    empty = n == 0
    alpha = jnp.where(empty, 0.5, scale * (s + 0.5))
    beta = jnp.where(empty, 0.5, scale * (n - s + 0.5))
    return alpha, beta
