"""Shared input validation for the pure functions of ``spopp_jax``.

Two kinds of checks:

* **Static checks** (shapes, ranks, dtypes, Python-scalar ranges) look only at what is
  known at trace time, so they raise ``ValueError`` both eagerly and while tracing under
  ``jax.jit`` / ``jax.vmap``.
* **Value checks** (NaN rewards, ids out of range, negative lengths, ...) need the numbers.
  :func:`check_values` runs its predicate only when every array it is given is concrete
  (NumPy arrays, Python scalars, or committed ``jax.Array`` s, i.e. not tracers). Under
  ``jit``/``vmap``/``grad`` the inputs are tracers and value checks are *skipped*, so the same
  function stays jit-safe; the numeric code itself must then stay NaN-free on bad input
  (the functions guard with ``jnp.where`` on their inputs).

Every error message names the offending argument.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "is_concrete",
    "check_values",
    "check_same_shape",
    "check_rank",
    "check_floating",
    "check_integer",
    "check_bool_or_numeric",
    "check_open_unit_interval",
    "check_positive",
    "check_nonnegative",
]


def is_concrete(*arrays) -> bool:
    """True when none of ``arrays`` is a JAX tracer (so its values can be read)."""
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def check_values(
    predicate: Callable[..., np.ndarray | bool], message: str, *arrays
) -> None:
    """Raise ``ValueError(message)`` when ``predicate(*numpy_arrays)`` is False.

    The predicate receives the arrays as NumPy arrays. It is evaluated only when all
    ``arrays`` are concrete; under tracing the check is skipped (documented behaviour).
    """
    if not is_concrete(*arrays):
        return
    ok = predicate(*(np.asarray(a) for a in arrays))
    if not bool(np.all(ok)):
        raise ValueError(message)


def _shape(x) -> tuple[int, ...]:
    return tuple(jnp.shape(x))


def check_same_shape(named: Mapping[str, object]) -> tuple[int, ...]:
    """All arrays in ``named`` (name -> array) have one shape; return it."""
    items = list(named.items())
    first_name, first = items[0]
    shape = _shape(first)
    for name, arr in items[1:]:
        if _shape(arr) != shape:
            raise ValueError(
                f"`{name}` has shape {_shape(arr)} but `{first_name}` has shape {shape}; "
                "they must match"
            )
    return shape


def check_rank(name: str, x, ranks: int | Sequence[int]) -> None:
    ranks = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if jnp.ndim(x) not in ranks:
        raise ValueError(
            f"`{name}` must have rank in {ranks}, got shape {_shape(x)}"
        )


def check_floating(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise ValueError(f"`{name}` must be a floating array, got dtype {jnp.result_type(x)}")


def check_integer(name: str, x) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"`{name}` must be an integer array, got dtype {jnp.result_type(x)}")


def check_bool_or_numeric(name: str, x) -> None:
    dt = jnp.result_type(x)
    if not (dt == jnp.bool_ or jnp.issubdtype(dt, jnp.number)):
        raise ValueError(f"`{name}` must be a boolean or numeric array, got dtype {dt}")


def check_open_unit_interval(name: str, value) -> None:
    """``value`` (scalar or array) lies strictly inside (0, 1); value check."""
    check_values(
        lambda v: np.isfinite(v) & (v > 0) & (v < 1),
        f"`{name}` must lie in the open interval (0, 1)",
        value,
    )


def check_positive(name: str, value) -> None:
    check_values(
        lambda v: np.isfinite(v) & (v > 0), f"`{name}` must be finite and > 0", value
    )


def check_nonnegative(name: str, value) -> None:
    check_values(
        lambda v: np.isfinite(v) & (v >= 0), f"`{name}` must be finite and >= 0", value
    )
