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


EIGHT_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="session")
def run_on_8_devices():
    """``run(args, timeout=600)``: ``python *args`` in a subprocess that sees 8 simulated CPU
    devices (the flag must be set before jax is imported, hence a fresh process); returns
    the ``CompletedProcess`` with text stdout / stderr."""
    import os
    import subprocess
    import sys

    def run(args, timeout: float = 600):
        env = {**os.environ, **EIGHT_CPU_DEVICES}
        return subprocess.run([sys.executable, *map(str, args)], env=env, capture_output=True, text=True,
                              timeout=timeout)

    return run
