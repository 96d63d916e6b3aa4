#!/usr/bin/env bash
# An environment for vLLM's own drafter trainer (PyPI `speculators`), beside the main one, and
# print its path: the other side of scripts/parity.sh (issue 41).
#
# Builds .venv-speculators (or $DRAFTTRAIN_SPECULATORS_VENV) with speculators==$SPECULATORS_VERSION
# (0.9.0). torch is installed first and then pinned to the CPU wheel through constraints.txt, so pip
# never reaches for a CUDA build; speculators pins transformers<=5.19 (the main environment has a
# newer one), hence an environment of its own. speculators requires torchvision and torchaudio:
# PyPI's builds of those (and torchcodec) are CUDA builds that fail to load against the CPU torch,
# and speculators' text-model trainer does not use them, so they are removed after the install
# (as scripts/setup_vllm.sh does for vLLM). drafttrain itself is not installed here: parity.sh
# converts data and judges exports in the main environment and only trains in this one.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTTRAIN_SPECULATORS_VENV:-.venv-speculators}
VERSION=${SPECULATORS_VERSION:-0.9.0}
PYTHON=${PYTHON:-python3}
check='import sys, importlib.metadata as m, speculators.train.trainer
sys.exit(m.version("speculators") != sys.argv[1])'
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "$check" "$VERSION" 2>/dev/null; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  PIP_CONSTRAINT="$PWD/constraints.txt" "$VENV/bin/python" -m pip install -q "speculators==$VERSION"
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -c "$check" "$VERSION"
fi
echo "$VENV"
