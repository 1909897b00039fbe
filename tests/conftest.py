"""Shared test fixtures (generic; no module-specific state)."""

import jax
import numpy as np
import pytest


@pytest.fixture(params=["eager", "jit"])
def maybe_jit(request):
    """Run a function eagerly or under ``jax.jit`` (tests use it as ``maybe_jit(fn)``).

    ``maybe_jit(fn, static_argnames=...)`` forwards the static arguments to ``jax.jit``.
    """
    if request.param == "eager":
        return lambda fn, **kwargs: fn
    return lambda fn, **kwargs: jax.jit(fn, **kwargs)


@pytest.fixture
def np_rng():
    """A seeded NumPy generator (fresh per test)."""
    return np.random.default_rng(0)
