#!/usr/bin/env bash
# drafttrain against vLLM's own drafter trainer (PyPI `speculators`, in .venv-speculators): the same target,
# the same data, the same steps, one judge (issue 41). For each KIND (eagle3, dflash):
#   1. drafttrain trains its draft with recipes/configs/${TARGET}_${KIND}_demo.yaml (CONFIG_EAGLE3 /
#      CONFIG_DFLASH pick another), set to what speculators can also do: optim.min_lr_ratio=0 (its schedules
#      decay to 0), train.keep_best=false (the last step's weights, as speculators exports them),
#      train.eval_every=0 and, for EAGLE-3, loss.teacher=hidden (the target's whole distribution over the
#      draft vocabulary, speculators' teacher); its answers are written to (or read from) drafttrain's cache;
#   2. `python -m drafttrain.parity data` writes those same rows (prompts and the target's answers, cut to
#      data.max_seq_len as drafttrain cuts them) in speculators' dataset layout, with the target's hidden
#      states at the draft's layers (what vLLM's extraction writes, computed with transformers here: speculators
#      does not compute them itself) and drafttrain's draft vocabulary (d2t/t2d): OURS, CONVERTED, not a
#      regeneration through vLLM-CPU, so both trainers see the same tokens;
#   3. speculators trains on them with the matched flags (`python -m drafttrain.parity argv`, written with what
#      could and could not be matched to $OUT/settings-KIND.json) through scripts/speculators_train.py, which
#      makes its trainer run on a CPU (two accelerator-only calls) and stop at exactly the same step count;
#   4. speculators' last checkpoint is rewritten in drafttrain's (and vLLM's) export layout, the same weights;
#   5. one `drafttrain compare` judges both exports on the same held-out prompts (HumanEval and the training
#      sources' held-out split, which neither trainer saw), by drafttrain's decoder and, with SERVED=1, by vLLM's
#      CPU engine serving each export (`NAME=...@vllm`, .venv-vllm);
#   6. `python -m drafttrain.parity report` writes $OUT/parity.md: tau and per-position acceptance by each judge,
#      samples/s of each trainer; APPEND_TO=docs/benchmarks.md also appends it there under a dated heading.
# Matched: target, prompts, answers, sequence cut, target layers, draft vocabulary, steps, AdamW (lr, weight
# decay, betas, eps, clipping 1.0), warm-up steps and decay shape, seed, architecture (EAGLE-3: speculators'
# plain variant; DFlash: layers, block, non-causal block, mask token), loss (EAGLE-3: forward KL, TTT steps,
# step decay; DFlash: CE to the target's token, slot decay), the positions trained, the exported step.
# Not matched (settings-KIND.json lists them with numbers): the batch (drafttrain pads B sequences, speculators
# packs whole sequences into a row sized to average B a step), warm-up's first value, initialisation, the
# exported dtype (speculators writes bfloat16), EAGLE-3's loss scale (normalised step weights against summed),
# DFlash's anchors (per answer against per packed row) and mask embedding (trained against the target's, frozen),
# and where the target's features come from (online against stored: speculators' samples/s leaves out the
# target's forward, which the features line of the speed table times instead).
#
# Knobs: TARGET (smollm2; gemma3: its EAGLE-3 is not served by vLLM-CPU 0.32), KINDS ("eagle3 dflash"), STEPS and
# BATCH (default: the config's train.max_steps and micro_batch_size), K_EAGLE3 (4) and K_DFLASH (7) drafts a step in
# the comparison, LIMIT (12 prompts of each held-out file), MAX_NEW (96), SERVED (1), THREADS (nproc), OUT
# (runs/parity-$TARGET), APPEND_TO, HS_DTYPE (float32: the stored hidden states, and speculators' compute dtype;
# bfloat16 on a GPU, as vLLM would write them). ROWS converts only the first ROWS training rows for speculators (a toy run to
# check the pipeline: drafttrain's data is not cut, so the two then differ). DRAFTTRAIN_VENV,
# DRAFTTRAIN_SPECULATORS_VENV and DRAFTTRAIN_VLLM_VENV pick existing environments (else each is built).
# A toy run: STEPS=4 BATCH=2 ROWS=16 LIMIT=2 MAX_NEW=16 bash scripts/parity.sh
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-smollm2}
KINDS=${KINDS:-"eagle3 dflash"}
OUT=${OUT:-runs/parity-$TARGET}
LIMIT=${LIMIT:-12}
MAX_NEW=${MAX_NEW:-96}
K_EAGLE3=${K_EAGLE3:-4}
K_DFLASH=${K_DFLASH:-7}
SERVED=${SERVED:-1}
THREADS=${THREADS:-$(nproc)}
for kind in $KINDS; do
  case $kind in eagle3|dflash) ;; *) echo "error: KINDS has $kind; use eagle3 and/or dflash" >&2; exit 2;; esac
  [ -f "recipes/configs/${TARGET}_${kind}_demo.yaml" ] || {
    echo "error: TARGET=$TARGET has no recipes/configs/${TARGET}_${kind}_demo.yaml; use smollm2 or gemma3" >&2; exit 2; }
done

VENV=$(bash scripts/setup_env.sh | tail -1)
SPEC_VENV=$(bash scripts/setup_speculators.sh | tail -1)
JUDGE_VENV=$VENV
if [ "$SERVED" = 1 ]; then JUDGE_VENV=$(bash scripts/setup_vllm.sh | tail -1); fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's drafttrain and recipes, whichever env runs
export WANDB_MODE=${WANDB_MODE:-offline} HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DRAFTTRAIN_HOME=${DRAFTTRAIN_HOME:-$HOME/.cache/drafttrain}
PY=$VENV/bin/python
mkdir -p "$OUT"
MODEL=$("$PY" -m drafttrain.cli assets "$TARGET" | tail -1)
"$PY" -m drafttrain.cli assets humaneval --out "$OUT/humaneval.jsonl" >/dev/null
[ -f "$DRAFTTRAIN_HOME/prompts/stdlib.jsonl" ] ||
  "$PY" -m drafttrain.cli assets stdlib --out "$DRAFTTRAIN_HOME/prompts/stdlib.jsonl" --num 2000 >/dev/null

for kind in $KINDS; do
  upper=$(echo "$kind" | tr a-z A-Z)
  config_var=CONFIG_$upper
  config=${!config_var:-recipes/configs/${TARGET}_${kind}_demo.yaml}
  k_var=K_$upper
  k=${!k_var}
  overrides=(target="$MODEL" optim.min_lr_ratio=0 train.keep_best=false train.eval_every=0
             eval.num_prompts=2 eval.max_new_tokens=16)
  [ "$kind" = eagle3 ] && overrides+=(loss.teacher=hidden)
  [ -n "${STEPS:-}" ] && overrides+=(train.max_steps="$STEPS" train.checkpoint_every="$STEPS")
  [ -n "${BATCH:-}" ] && overrides+=(train.micro_batch_size="$BATCH")
  if [ -n "${STEPS:-}" ] && [ "$STEPS" -lt 20 ]; then overrides+=(optim.warmup_steps=1 train.log_every=1); fi

  echo "== $kind: drafttrain trains ($config ${overrides[*]})"
  OMP_NUM_THREADS=$THREADS "$PY" "recipes/train_$kind.py" --config "$config" output_dir="$OUT/drafttrain-$kind" \
    --overwrite "${overrides[@]}"

  echo "== $kind: the same rows in speculators' layout"
  rm -rf "$OUT/data-$kind"
  start=$(date +%s.%N)
  OMP_NUM_THREADS=$THREADS "$PY" -m drafttrain.parity data --kind "$kind" --config "$config" --out "$OUT/data-$kind" \
    --dtype "${HS_DTYPE:-float32}" ${ROWS:+--limit "$ROWS"} "${overrides[@]}"
  "$PY" -c "import sys, time; print(round(time.time() - float(sys.argv[1]), 2))" "$start" > "$OUT/data-$kind.seconds"

  echo "== $kind: speculators trains"
  gpu=()
  if "$SPEC_VENV/bin/python" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then gpu=(--gpu); fi
  "$PY" -m drafttrain.parity argv --kind "$kind" --config "$config" --data "$OUT/data-$kind" \
    --save "$OUT/speculators-$kind" --settings-out "$OUT/settings-$kind.json" "${gpu[@]}" "${overrides[@]}" \
    > "$OUT/speculators-$kind.argv"
  mapfile -t flags < "$OUT/speculators-$kind.argv"
  rm -rf "$OUT/speculators-$kind"
  mkdir -p "$OUT/speculators-$kind"
  OMP_NUM_THREADS=$THREADS "$SPEC_VENV/bin/python" scripts/speculators_train.py \
    --speed-out "$OUT/speculators-$kind/speed.json" "${flags[@]}"
  last=$(for d in "$OUT/speculators-$kind/checkpoints"/[0-9]*; do basename "$d"; done | sort -n | tail -1)
  "$PY" -m drafttrain.parity export --kind "$kind" --checkpoint "$OUT/speculators-$kind/checkpoints/$last" \
    --target "$MODEL" --out "$OUT/speculators-$kind/export"

  echo "== $kind: one judge"
  drafters=(--drafter "drafttrain=$kind:$OUT/drafttrain-$kind/final"
            --drafter "speculators=$kind:$OUT/speculators-$kind/export")
  if [ "$SERVED" = 1 ]; then
    drafters+=(--drafter "drafttrain-served=$kind:$OUT/drafttrain-$kind/final@vllm"
               --drafter "speculators-served=$kind:$OUT/speculators-$kind/export@vllm")
  fi
  tree=()
  [ "$kind" = eagle3 ] && tree=(--tree chain)  # vLLM verifies chains
  OMP_NUM_THREADS=$THREADS "$JUDGE_VENV/bin/python" -m drafttrain.cli compare --target "$MODEL" "${drafters[@]}" \
    --prompts "$OUT/humaneval.jsonl" --prompts "$OUT/drafttrain-$kind/heldout.jsonl" --limit "$LIMIT" \
    --max-new-tokens "$MAX_NEW" --num-draft-tokens "$k" "${tree[@]}" --dtype float32 \
    --out "$OUT/judge-$kind" --overwrite --quiet
done

# shellcheck disable=SC2086
"$PY" -m drafttrain.parity report --dir "$OUT" --kinds $KINDS > "$OUT/parity.md"
if [ -n "${APPEND_TO:-}" ]; then
  { echo; echo "## drafttrain against speculators $(date -u +%Y-%m-%d) ($TARGET, scripts/parity.sh)"; echo
    cat "$OUT/parity.md"; } >> "$APPEND_TO"
fi
cat "$OUT/parity.md"
