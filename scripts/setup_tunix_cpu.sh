#!/usr/bin/env bash
# Create the isolated virtual environment that runs Google's Tunix (PyPI `google-tunix`,
# 0.1.7) on CPU, for benchmarks/peer_tunix.py (our learner step vs Tunix's GRPO step).
#
# Tunix pins safetensors < 0.8 and pulls its own jax / flax / transformers / datasets /
# tensorflow-datasets stack, so it lives in its own venv (default: <repo>/.venv-tunix,
# ignored by git via `.venv*/`). Every package is pinned by scripts/tunix_cpu_constraints.txt
# (a `pip freeze` of a working install), so the environment is reproducible. No accelerator
# extras: jax from PyPI is the CPU build. torch is not needed and not installed.
#
# Idempotent: if the venv already has google-tunix at the pinned version and
# `import tunix.rl.agentic.agentic_grpo_learner` works, nothing is installed.
#
# Usage: scripts/setup_tunix_cpu.sh [VENV_DIR]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venv-tunix}"
PYTHON="${PYTHON:-python3}"
TUNIX_VERSION="${TUNIX_VERSION:-0.1.7}"
CONSTRAINTS="${REPO_ROOT}/scripts/tunix_cpu_constraints.txt"

check() {
  "${VENV_DIR}/bin/python" - "${TUNIX_VERSION}" <<'PY'
import importlib.metadata as md, sys
if md.version("google-tunix") != sys.argv[1]:
    raise SystemExit(f"google-tunix {md.version('google-tunix')} != {sys.argv[1]}")
from packaging.version import Version
if Version(md.version("safetensors")) >= Version("0.8"):
    raise SystemExit("safetensors must be < 0.8 for google-tunix")
import tunix.models.qwen3.params  # noqa: F401
import tunix.rl.agentic.agentic_grpo_learner  # noqa: F401
import tunix.rl.trainer  # noqa: F401
import jax
print("import tunix: ok; jax devices:", jax.devices())
PY
}

if [[ -x "${VENV_DIR}/bin/python" ]] && check >/dev/null 2>&1; then
  echo "google-tunix ${TUNIX_VERSION} already installed and importable in ${VENV_DIR}"
else
  if [[ ! -x "${VENV_DIR}/bin/python" ]]; then
    "${PYTHON}" -m venv "${VENV_DIR}"
  fi
  "${VENV_DIR}/bin/python" -m pip install --upgrade pip wheel
  "${VENV_DIR}/bin/python" -m pip install -c "${CONSTRAINTS}" \
    "google-tunix==${TUNIX_VERSION}" "safetensors<0.8" packaging
fi

echo "installed in ${VENV_DIR}:"
"${VENV_DIR}/bin/python" -m pip list --format=freeze 2>/dev/null \
  | grep -iE '^(google-tunix|jax|jaxlib|flax|optax|qwix|orbax-checkpoint|safetensors|transformers|numpy|grain|datasets|tensorflow-datasets)=='
check
echo "Tunix environment ready at ${VENV_DIR}"
