#!/usr/bin/env bash
# Does training on the target's own answers help the 135M target? Same conversations, same steps:
#   orig  : first user turn + the ShareGPT (ChatGPT) answer
#   regen : first user turn + the target's greedy answer (dart-lab regenerate)
# Both heads are validated on held-out conversations answered by the target (what a draft sees at
# inference), then benchmarked with the tree on MT-bench and GSM8K. Then the shipped DART head is
# fine-tuned on the regenerated set (300 steps) and compared with itself the same way.
#   bash reproduce/regen_ablation.sh [NUM_TRAIN] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_TRAIN=${1:-256}
STEPS=${2:-600}
B=.venv/bin
R=${DART_LAB_RUNS:-runs}/regen
mkdir -p "$R"
$B/dart-lab regenerate --out "$R/val_conv" --num 64 --skip 17000 --max-new-tokens 192 --batch-size 16
$B/dart-lab regenerate --out "$R/train_conv" --num "$NUM_TRAIN" --max-new-tokens 192 --batch-size 16
$B/dart-lab features --out "$R/feat_regen" --conversations "$R/train_conv" --val-conversations "$R/val_conv" \
  --num-train "$NUM_TRAIN" --num-val 64 --max-turns 1
$B/dart-lab features --out "$R/feat_orig" --val-conversations "$R/val_conv" \
  --num-train "$NUM_TRAIN" --num-val 64 --max-turns 1
for v in orig regen; do
  OMP_NUM_THREADS=1 $B/dart-lab train dart --features "$R/feat_$v" --out "$R/dart_$v" --max-steps "$STEPS" \
    --val-every "$STEPS" --val-examples 64 > "$R/train_$v.log" 2>&1 &
done
wait
for ds in mt_bench gsm8k; do
  $B/dart-lab bench --methods ar,dart --dataset "$ds" --num-prompts 5 --max-new-tokens 64 \
    --dart-head "$R/dart_orig/head" --out "$R/bench_orig_$ds.json" --no-progress
  $B/dart-lab bench --methods ar,dart --dataset "$ds" --num-prompts 5 --max-new-tokens 64 \
    --dart-head "$R/dart_regen/head" --out "$R/bench_regen_$ds.json" --no-progress
done
OMP_NUM_THREADS=1 $B/dart-lab train dart --features "$R/feat_regen" --out "$R/dart_shipped_ft" \
  --init-from dart_lab/heads/smollm2-135m/dart --max-steps 300 --lr 3e-4 --warmup-steps 10 --val-every 300 \
  --val-examples 64 > "$R/ft.log" 2>&1
for h in shipped ft; do
  EH=""; BH=""
  if [ "$h" = ft ]; then EH="--head $R/dart_shipped_ft/head"; BH="--dart-head $R/dart_shipped_ft/head"; fi
  $B/dart-lab eval-head dart $EH --features "$R/feat_regen" --num 64 | tail -1 > "$R/eval_${h}_on_regen_val.json"
  $B/dart-lab eval-head dart $EH --features "${DART_LAB_RUNS:-runs}/features" --num 64 | tail -1 \
    > "$R/eval_${h}_on_sharegpt_val.json"
  for ds in mt_bench gsm8k; do
    $B/dart-lab bench --methods ar,dart --dataset "$ds" --num-prompts 5 --max-new-tokens 64 $BH \
      --out "$R/bench_${h}_$ds.json" --no-progress
  done
done
$B/python reproduce/collect_regen.py "$R"
