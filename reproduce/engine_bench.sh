#!/usr/bin/env bash
# The engine benchmark (issue "speed where the user is"): every method interleaved per prompt, auto dtype,
# auto tree budget, 10 prompts x 128 new tokens per dataset at T=0, and 5 x 128 at T=1 (DART vs AR vs EAGLE-3).
# Run it on an idle machine: each JSON records the machine's load and marks a contended run.
#   bash reproduce/engine_bench.sh [OUT_DIR]      (NUM_PROMPTS=5 T1_PROMPTS=3 for a shorter run)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reproduce/results/engine}
B=.venv/bin
N0=${NUM_PROMPTS:-10}
N1=${T1_PROMPTS:-5}
mkdir -p "$OUT"
for ds in mt_bench humaneval gsm8k code_alpaca alpaca; do
  $B/dart-lab bench --methods ar,dart,eagle3,pld,hf --dataset "$ds" --num-prompts "$N0" --max-new-tokens 128 \
    --out "$OUT/${ds}_T0.json" --no-progress
done
for ds in mt_bench humaneval gsm8k code_alpaca alpaca; do
  $B/dart-lab bench --methods ar,dart,eagle3 --dataset "$ds" --num-prompts "$N1" --max-new-tokens 128 \
    --temperature 1.0 --out "$OUT/${ds}_T1.json" --no-progress
done
