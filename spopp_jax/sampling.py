"""Task sampling weights and idle-task dispatch sampling (SPEC section 3).

Idle tasks (none in flight) are drawn with weight

    inside_sqrt  (SPO++, default):  u(v̂) = sqrt(v̂ (1 − v̂) + floor)
    outside_sqrt (SPO authors):     u(v̂) = sqrt(v̂ (1 − v̂)) + floor

:func:`sample_idle_tasks` draws k distinct idle tasks by successive sampling without
replacement (each draw proportional to u among the tasks not yet drawn), implemented with
the Gumbel-top-k trick: the k largest of log u_x + G_x, G_x ~ Gumbel(0, 1) i.i.d.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from spopp_jax import _checks

__all__ = ["FORMS", "uncertainty_weights", "sample_idle_tasks"]

FORMS = ("inside_sqrt", "outside_sqrt")


def uncertainty_weights(v_hat, floor: float = 0.05, form: str = "inside_sqrt") -> jax.Array:
    """Sampling weight u(v̂) of each task (SPEC 3); ``form`` is static.

    Args:
      v_hat: [...] baselines in [0, 1].
      floor: >= 0, keeps certain tasks (v̂ = 0 or 1) sampleable.
      form: "inside_sqrt" sqrt(v̂(1−v̂) + floor) or "outside_sqrt" sqrt(v̂(1−v̂)) + floor.
    """
    if form not in FORMS:
        raise ValueError(f"`form` must be one of {FORMS}, got {form!r}")
    v_hat = jnp.asarray(v_hat)
    _checks.check_floating("v_hat", v_hat)
    _checks.check_values(
        lambda v: np.all((v >= 0) & (v <= 1)), "`v_hat` must lie in [0, 1] (no NaN)", v_hat
    )
    _checks.check_nonnegative("floor", floor)
    v = v_hat.astype(jnp.float32)
    spread = jnp.clip(v * (1.0 - v), 0.0, 0.25)
    if form == "inside_sqrt":
        return jnp.sqrt(spread + floor)
    return jnp.sqrt(spread) + floor


def sample_idle_tasks(
    key: jax.Array,
    v_hat,
    in_flight_mask,
    k: int,
    floor: float = 0.05,
    form: str = "inside_sqrt",
) -> jax.Array:
    """Draw k distinct idle tasks, each draw ∝ :func:`uncertainty_weights` (SPEC 3).

    Args:
      key: PRNG key.
      v_hat: [num_tasks] frozen-at-read baselines.
      in_flight_mask: [num_tasks] bool, True for tasks with a request in flight; these are
        never returned.
      k: static number of tasks to draw (0 <= k <= num_tasks).
      floor, form: as in :func:`uncertainty_weights`. Idle tasks of weight 0 (only possible
        with floor = 0) are drawn only after every positive-weight idle task.

    Returns:
      [k] int32 task ids in draw order.

    Fewer than k idle tasks: with a concrete ``in_flight_mask`` this raises ``ValueError``.
    Under ``jit`` (traced mask) the value check is skipped and the slots that could not be
    filled hold -1 (the idle tasks come first), so callers inside jit must test for -1.
    """
    v_hat = jnp.asarray(v_hat)
    in_flight_mask = jnp.asarray(in_flight_mask)
    _checks.check_rank("v_hat", v_hat, 1)
    _checks.check_same_shape({"v_hat": v_hat, "in_flight_mask": in_flight_mask})
    _checks.check_bool_or_numeric("in_flight_mask", in_flight_mask)
    num_tasks = v_hat.shape[0]
    if not (isinstance(k, (int, np.integer)) and 0 <= k <= num_tasks):
        raise ValueError(f"`k` must be a static int in [0, {num_tasks}], got {k!r}")
    _checks.check_values(
        lambda m: np.sum(m == 0) >= k,
        f"fewer than k={k} idle tasks: `in_flight_mask` leaves too few tasks idle",
        in_flight_mask,
    )
    weights = uncertainty_weights(v_hat, floor, form)
    idle = in_flight_mask == 0
    gumbel = jax.random.gumbel(key, (num_tasks,), jnp.float32)
    # finite stand-in for log 0: zero-weight idle tasks rank after all positive ones,
    # but before in-flight tasks (-inf)
    log_w = jnp.where(weights > 0, jnp.log(jnp.where(weights > 0, weights, 1.0)), -1e30)
    score = jnp.where(idle, log_w + gumbel, -jnp.inf)
    top_score, top_ids = jax.lax.top_k(score, k)
    return jnp.where(top_score > -jnp.inf, top_ids, -1).astype(jnp.int32)
