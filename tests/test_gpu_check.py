"""scripts/gpu_check.sh --cpu: every check of the GPU script runs at toy sizes on CPU and
prints exactly one VERDICT line; what needs a GPU (cuDNN, vLLM) says SKIP, never PASS."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FAST_CHECKS = ["mixed_precision_step", "cudnn_attention", "engine_decode", "memory_settings", "vllm_inflight"]


def run_check(*args, env=None, timeout=900):
    """The script under the interpreter running the tests (``PYTHON``; the script's default is
    ``python3`` from PATH, which need not be this environment's)."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--cpu", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable),
                               "SPOPP_GPU_CHECK_TIMEOUT_S": str(timeout), **(env or {})})
    verdicts = dict(re.findall(r"^VERDICT (\w+): (PASS|FAIL|SKIP)", done.stdout, flags=re.M))
    return done, verdicts


def test_cpu_dry_run_prints_one_verdict_per_check():
    done, verdicts = run_check("--only", *FAST_CHECKS, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert list(verdicts) == FAST_CHECKS
    assert verdicts["mixed_precision_step"] == "PASS" and verdicts["engine_decode"] == "PASS"
    assert verdicts["cudnn_attention"] == "SKIP"           # no GPU: cuDNN not run (ours vs XLA is)
    assert verdicts["memory_settings"] == "PASS"           # the variable given above is reported
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in done.stdout
    assert verdicts["vllm_inflight"] == "SKIP"
    assert "MFU" in done.stdout


@pytest.mark.slow
def test_cpu_dry_run_of_every_check():
    done, verdicts = run_check()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert verdicts["qwen35_tiny"] == "PASS" and len(verdicts) == 6
