#!/usr/bin/env bash
# Reproduces the DART and EAGLE-3 heads shipped in dart_lab/heads/smollm2-135m/ on a 2-core CPU.
# Both heads get the same compute budget: the same wall time with one CPU thread each, run side by side.
#   bash reproduce/train_embedded_heads.sh [NUM_TRAIN] [MINUTES]
set -euo pipefail
cd "$(dirname "$0")/.."
NUM_TRAIN=${1:-1536}
MINUTES=${2:-70}
BIN=.venv/bin
RUNS=${DART_LAB_RUNS:-runs}
# 1. one target pass over ShareGPT (resumable): 64 held-out validation conversations + NUM_TRAIN
$BIN/dart-lab features --out "$RUNS/features" --num-train "$NUM_TRAIN" --num-val 64 --max-len 512
# 2. both trainers side by side, one thread each, same wall-clock budget
OMP_NUM_THREADS=1 $BIN/dart-lab train dart --features "$RUNS/features" --out "$RUNS/dart" \
  --max-steps 1800 --time-budget "$MINUTES" --seqs-per-step 2 > "$RUNS/dart.log" 2>&1 &
OMP_NUM_THREADS=1 $BIN/dart-lab train eagle3 --features "$RUNS/features" --out "$RUNS/eagle3" \
  --max-steps 800 --time-budget "$MINUTES" --seqs-per-step 2 > "$RUNS/eagle3.log" 2>&1 &
wait
# 3. ship
mkdir -p dart_lab/heads/smollm2-135m
rm -rf dart_lab/heads/smollm2-135m/dart dart_lab/heads/smollm2-135m/eagle3
cp -r "$RUNS/dart/head" dart_lab/heads/smollm2-135m/dart
cp -r "$RUNS/eagle3/head" dart_lab/heads/smollm2-135m/eagle3
cp "$RUNS/dart/summary.json" dart_lab/heads/smollm2-135m/dart/training_summary.json
cp "$RUNS/eagle3/summary.json" dart_lab/heads/smollm2-135m/eagle3/training_summary.json
# 4. model cards: held-out evaluation (+ the regeneration measurement, if reproduce/regen_ablation.sh ran)
$BIN/python reproduce/update_cards.py --features "$RUNS/features"
echo "heads shipped in dart_lab/heads/smollm2-135m"
