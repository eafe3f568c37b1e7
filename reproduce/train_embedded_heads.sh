#!/usr/bin/env bash
# Reproduces the draft heads shipped in dart_lab/heads/smollm2-135m/ on a 2-core CPU.
#   bash reproduce/train_embedded_heads.sh [NUM_TRAIN] [MINUTES] [HEADS] [CONTINUATIONS] [MORE_TRAIN] [MORE_MINUTES] [MORE_PHASES]
# 1. one target pass over NUM_TRAIN ShareGPT conversations (+ 64 held out), resumable (~0.55 s per
#    conversation here); 2. each head in HEADS trained in turn with both cores for MINUTES of wall time
#    (the same budget for every head), held-out acc-k / chain tau every 500 steps and decoding tau
#    (60-node tree, T=0, calibration prompts) in the learning curve; then each run is continued through
#    CONTINUATIONS, "TOTAL_MINUTES:DART_STEPS:EAGLE3_STEPS" each: to that total wall time with a cosine
#    of that length (what the extra minutes reach here) -- how the shipped heads were made: 60 min,
#    continued to 95 and then to 125 min (each decided when the curves still rose; "" = 60 min only);
#    3. more data: the feature cache extended to MORE_TRAIN conversations (the first NUM_TRAIN are the
#    same shards), and each head continued from its bf16 head for MORE_MINUTES more (`--init-from`: new
#    optimizer, peak lr 5e-4) through MORE_PHASES, "DART_STEPS:EAGLE3_STEPS" each (a cosine of that
#    length; a later phase resumes and recomputes it, as in step 2): how the shipped heads were
#    continued in a later session, whose feature cache and checkpoints were gone. DART finished its
#    first 1,710-step cosine in 17.6 of its 30 minutes (1.62 steps/s) and was continued to 2,900 steps
#    within them; EAGLE-3 (~0.3 steps/s) used its 30 minutes on 570 ("" or 0 = skip);
#    4. ship: bf16 head, model card, summary and learning curve (training_curve.json).
# Interrupted? Run it again: features and training resume where they stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_TRAIN=${1:-2048}
MINUTES=${2:-60}
HEADS=${3:-dart eagle3}
CONTINUATIONS=${4-95:6200:1930 125:7700:2400}
MORE_TRAIN=${5-4096}
MORE_MINUTES=${6-30}
MORE_PHASES=${7-1710:570 2900:570}
BIN=.venv/bin
RUNS=${DART_LAB_RUNS:-runs}
START=$(date +%s)
$BIN/dart-lab features --out "$RUNS/features" --num-train "$NUM_TRAIN" --num-val 64 --max-len 512
for KIND in $HEADS; do
  # max-steps sets the cosine schedule: about what 60 minutes of this trainer reach here (DART ~1,500
  # tokens/s, EAGLE-3 ~340 tokens/s, ~460 tokens per conversation, 2 per step)
  STEPS=$([ "$KIND" = dart ] && echo 5000 || echo 1200)
  train() {
    $BIN/dart-lab train "$KIND" --features "$RUNS/features" --out "$RUNS/$KIND" --max-steps "$1" \
      --time-budget "$2" --seqs-per-step 2 --warmup-steps 100 --val-every 500 --val-examples 32 \
      --decode-every 500 --save-every 100 >> "$RUNS/$KIND.log" 2>&1
  }
  # a rerun after the first phase goes straight on to the continuation
  # a rerun skips the phases already done (a finished run refuses a shorter schedule)
  [ -f "$RUNS/$KIND/phase1.done" ] || { train "$STEPS" "$MINUTES" && touch "$RUNS/$KIND/phase1.done"; }
  for PHASE in $CONTINUATIONS; do
    IFS=: read -r TOTAL DART_STEPS EAGLE3_STEPS <<< "$PHASE"
    [ -f "$RUNS/$KIND/phase_$TOTAL.done" ] && continue
    train "$([ "$KIND" = dart ] && echo "$DART_STEPS" || echo "$EAGLE3_STEPS")" "$TOTAL" && touch "$RUNS/$KIND/phase_$TOTAL.done"
  done
done
# 3. more data, each head continued from where step 2 left it (same wall time for both)
if [ "${MORE_TRAIN:-0}" -gt "$NUM_TRAIN" ] && [ "${MORE_MINUTES:-0}" != 0 ]; then
  $BIN/dart-lab features --out "$RUNS/features" --num-train "$MORE_TRAIN" --num-val 64 --max-len 512
  for KIND in $HEADS; do
    for PHASE in $MORE_PHASES; do
      IFS=: read -r DART_STEPS EAGLE3_STEPS <<< "$PHASE"
      STEPS=$([ "$KIND" = dart ] && echo "$DART_STEPS" || echo "$EAGLE3_STEPS")
      [ -f "$RUNS/$KIND-more/phase_$STEPS.done" ] && continue
      $BIN/dart-lab train "$KIND" --features "$RUNS/features" --out "$RUNS/$KIND-more" \
        --init-from "$RUNS/$KIND/head" --lr 5e-4 --max-steps "$STEPS" --time-budget "$MORE_MINUTES" --seqs-per-step 2 \
        --warmup-steps 100 --val-every 500 --val-examples 32 --decode-every 500 --save-every 100 \
        >> "$RUNS/$KIND-more.log" 2>&1  # no `&& touch`: a failed phase must stop the script (set -e)
      touch "$RUNS/$KIND-more/phase_$STEPS.done"
    done
    touch "$RUNS/$KIND-more/done"
  done
fi
# 4. ship
for KIND in $HEADS; do
  FINAL=$RUNS/$KIND
  [ -f "$RUNS/$KIND-more/done" ] && FINAL=$RUNS/$KIND-more
  mkdir -p dart_lab/heads/smollm2-135m
  rm -rf "dart_lab/heads/smollm2-135m/$KIND"
  cp -r "$FINAL/head" "dart_lab/heads/smollm2-135m/$KIND"
  cp "$FINAL/summary.json" "dart_lab/heads/smollm2-135m/$KIND/training_summary.json"
  $BIN/python reproduce/learning_curve.py "$RUNS/$KIND/log.jsonl" "$RUNS/$KIND/curve.json"
  CURVE=$RUNS/$KIND/curve.json
  if [ "$FINAL" != "$RUNS/$KIND" ]; then
    $BIN/python reproduce/learning_curve.py "$FINAL/log.jsonl" "$RUNS/$KIND-more/curve.json" "$CURVE"
    CURVE=$RUNS/$KIND-more/curve.json
  fi
  cp "$CURVE" "dart_lab/heads/smollm2-135m/$KIND/training_curve.json"
done
# model cards: held-out evaluation on all 64 validation conversations
$BIN/python reproduce/update_cards.py --features "$RUNS/features"
echo "heads shipped in dart_lab/heads/smollm2-135m; total $(( ($(date +%s) - START) / 60 )) min"
