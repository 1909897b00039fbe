"""DESIGN's one-way data flow: the learner package (`spopp_jax`) never imports the bridge
(`rollout_bridge`), and the config's env kinds are exactly the registered ones."""

import pkgutil
import subprocess
import sys
import typing

import spopp_jax

LEARNER_MODULES = sorted(m.name for m in pkgutil.walk_packages(spopp_jax.__path__, "spopp_jax."))


def test_learner_modules_import_nothing_from_the_bridge():
    # a fresh interpreter: this test process has the bridge loaded already
    script = (
        "import importlib, sys\n"
        f"for name in {LEARNER_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "leaked = sorted(m for m in sys.modules if m.split('.')[0] == 'rollout_bridge')\n"
        "print(','.join(leaked))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    leaked = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert leaked == "", f"importing spopp_jax loaded bridge modules: {leaked}"
    assert "spopp_jax.config" in LEARNER_MODULES and "spopp_jax.env_sections" in LEARNER_MODULES


def test_env_kind_literal_lists_exactly_the_registered_kinds():
    from rollout_bridge.envs.kinds import env_kinds
    from spopp_jax.config import EnvSection

    hints = typing.get_type_hints(EnvSection)
    assert set(typing.get_args(hints["kind"])) == set(env_kinds())
