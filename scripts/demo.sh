#!/usr/bin/env bash
# The main job on the embedded default: SmolLM2-135M-Instruct as target, held-out HumanEval
# prompts, an acceptance report per drafter. Everything is cached under $DRAFTTRAIN_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/setup_env.sh | tail -1)
source "$VENV/bin/activate"
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-runs/demo}
LIMIT=${LIMIT:-20}
MAX_NEW=${MAX_NEW:-128}
mkdir -p "$OUT"

TARGET=$(drafttrain assets smollm2 | tail -1)
drafttrain assets humaneval --out "$OUT/humaneval.jsonl" >/dev/null
common=(--target "$TARGET" --prompts "$OUT/humaneval.jsonl" --limit "$LIMIT" --max-new-tokens "$MAX_NEW")
drafttrain eval "${common[@]}" --method ngram --out "$OUT/ngram"
drafttrain eval "${common[@]}" --draft "$TARGET" --out "$OUT/self_draft"
echo "reports: $OUT/ngram/report.md, $OUT/self_draft/report.md"
