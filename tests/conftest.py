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


@pytest.fixture(scope="session", autouse=True)
def shared_generated_games(tmp_path_factory):
    """One folder of generated TextWorld game sets for the whole session (tiny_run.games_dir):
    each set is generated once, by the first test that asks for it."""
    import tiny_run

    tiny_run.SHARED_GAMES_DIR = tmp_path_factory.mktemp("generated_games")
    yield tiny_run.SHARED_GAMES_DIR
    tiny_run.SHARED_GAMES_DIR = None


@pytest.fixture(scope="session", autouse=True)
def shared_compilation_cache(tmp_path_factory):
    """Subprocesses of the session (``python train.py`` and other scripts, which compile the
    same tiny programs again and again) share one JAX persistent compilation cache: a later
    process reads what an earlier one compiled (a repeated tiny train.py run: ~45 s -> ~21 s
    here). The executables are the ones XLA would compile; an unreadable entry only costs a
    recompile (JAX warns). This process imported jax before the fixture ran, so its own
    configuration is unchanged."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_compilation_cache")))
        patch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
        yield


@pytest.fixture
def np_rng():
    """A seeded NumPy generator (fresh per test)."""
    return np.random.default_rng(0)


EIGHT_CPU_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="session")
def run_on_8_devices():
    """``run(args, timeout=600)``: ``python *args`` in a subprocess that sees 8 simulated CPU
    devices (the flag must be set before jax is imported, hence a fresh process); returns
    the ``CompletedProcess`` with text stdout / stderr. The subprocess runs in the checkout's
    root with the root first on ``PYTHONPATH``, as pytest's own process does: a worker may
    import ``train`` and read ``configs/*.yaml`` whatever the caller's environment."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])

    def run(args, timeout: float = 600):
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, **EIGHT_CPU_DEVICES, "PYTHONPATH": path}
        return subprocess.run([sys.executable, *map(str, args)], env=env, cwd=root, capture_output=True,
                               text=True, timeout=timeout)

    return run


def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (the default, pyproject.toml: one test file per worker) runs in this one
    process when it would gain nothing or risk much: a selection of one test file, or a
    ``-m integration`` selection (those tests start vLLM servers, one at a time on a small
    host)."""
    markexpr = config.getoption("markexpr") or ""
    if "integration" in markexpr and "not integration" not in markexpr:
        return 0
    files = {arg.split("::")[0] for arg in config.args}
    if len(files) == 1 and next(iter(files)).endswith(".py"):
        return 0
    return None
