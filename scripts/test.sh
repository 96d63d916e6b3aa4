#!/usr/bin/env bash
# The test suite: tiny random models on CPU, a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/setup_env.sh | tail -1)
export WANDB_MODE=offline HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$HOME/.cache/drafttrain/torch_extensions}
# torch's extension builder waits forever on a `lock` file that a killed build left behind
# (DeepSpeed's CPU communication op is built on the first 2-process test): clear it first.
find "$TORCH_EXTENSIONS_DIR" -name lock -type f -delete 2>/dev/null || true
exec "$VENV/bin/python" -m pytest tests "$@"
