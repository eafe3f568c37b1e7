#!/usr/bin/env bash
# Beyond the paper: dart-ctx against dart and PLD, with its two parts alone (request-local n-gram,
# copy candidates), on a copy-heavy set and two of the paper's datasets. Idle machine; T=0.
#   bash reproduce/context_bench.sh [OUT_DIR] [NUM_PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reproduce/results/context}
N=${2:-5}
mkdir -p "$OUT"
for ds in copy_edit mt_bench humaneval; do
  .venv/bin/dart-lab bench --methods ar,dart,dart-ctx,dart-ctx-ngram,dart-ctx-copy,pld --dataset "$ds" \
    --num-prompts "$N" --max-new-tokens 128 --out "$OUT/${ds}_T0.json" --no-progress
done
