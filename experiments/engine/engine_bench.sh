#!/usr/bin/env bash
# The engine benchmark (issues "speed where the user is" and "context-aware DART"): one `dart-lab bench`
# per dataset and temperature, every method interleaved per prompt, auto dtype, auto tree budget, 128 new
# tokens per prompt, on the paper's five datasets plus the copy-heavy `copy_edit` set:
#   T=0: ar, dart, dart-ctx and its ablations (two parts alone, pooled copy rate), eagle3, pld, HF generate -- NUM_PROMPTS per dataset
#   T=1: ar, dart, dart-ctx, eagle3, pld                                      -- T1_PROMPTS per dataset
# Run it on an idle machine: each JSON records the machine's load and marks a contended run.
#   bash experiments/engine/engine_bench.sh [OUT_DIR]      (NUM_PROMPTS=5 T1_PROMPTS=3 for a shorter run;
#   METHODS_T0=ar,dart,dart-ctx,eagle3,pld,hf leaves out the dart-ctx ablations)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-reproduce/results/$(date +%F)_local_engine}
B=.venv/bin
N0=${NUM_PROMPTS:-10}
N1=${T1_PROMPTS:-10}
R0=${REPEATS:-2}  # T=0 passes per (prompt, method), the fastest counts (a noisy VM host; dart_lab/bench.py)
DATASETS=${DATASETS:-mt_bench humaneval gsm8k code_alpaca alpaca copy_edit}
M0=${METHODS_T0:-ar,dart,dart-ctx,dart-ctx-ngram,dart-ctx-copy,dart-ctx-pooled,eagle3,pld,hf}  # without the ablations: ~1/3 shorter
mkdir -p "$OUT"
START=$(date +%s)
for ds in $DATASETS; do
  $B/dart-lab bench --methods "$M0" --dataset "$ds" \
    --num-prompts "$N0" --repeats "$R0" --max-new-tokens 128 --out "$OUT/${ds}_T0.json" --no-progress
done
for ds in $DATASETS; do
  $B/dart-lab bench --methods ar,dart,dart-ctx,eagle3,pld --dataset "$ds" --num-prompts "$N1" --max-new-tokens 128 \
    --temperature 1.0 --out "$OUT/${ds}_T1.json" --no-progress
done
$B/python experiments/engine/engine_table.py "$OUT" | tee "$OUT/TABLE.md"
echo "engine bench: $(( ($(date +%s) - START) / 60 )) min"
