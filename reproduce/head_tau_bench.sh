#!/usr/bin/env bash
# Decoding tau of the shipped heads with the paper's 60-node tree (issue "training at CPU scale"):
# T=0, 10 prompts x 128 new tokens on each of the five datasets, DART and EAGLE-3 (AR for the lossless
# check). tau does not depend on the machine's load (T=0 is deterministic), so the two halves of the
# datasets run side by side.
#   bash reproduce/head_tau_bench.sh [OUT_DIR] [extra bench flags, e.g. --dart-head DIR]
#   (NUM_PROMPTS=3 for a short run; METHODS=dart,eagle3 leaves out AR's lossless check, ~1/4 shorter)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-reproduce/results/$(date +%F)_local_heads-tau60}
shift || true
B=.venv/bin
mkdir -p "$OUT"
run() {
  for ds in "$@"; do
    $B/dart-lab bench --methods "${METHODS:-ar,dart,eagle3}" --tree-nodes paper --dataset "$ds" --num-prompts "${NUM_PROMPTS:-10}" \
      --max-new-tokens 128 --out "$OUT/${ds}_tau60.json" --no-progress $EXTRA > /dev/null
  done
}
EXTRA="$*"
if [ "${PARALLEL:-1}" = 1 ]; then run mt_bench humaneval gsm8k & run code_alpaca alpaca & wait; else run mt_bench humaneval gsm8k code_alpaca alpaca; fi
$B/python - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
rows = {f.stem.replace("_tau60", ""): json.loads(f.read_text())["methods"] for f in sorted(out.glob("*_tau60.json"))}
print("| dataset | DART tau | EAGLE-3 tau |\n|---|---|---|")
for ds, m in rows.items():
    print(f"| {ds} | {m['dart']['tau']:.2f} | {m['eagle3']['tau']:.2f} |")
mean = lambda k: sum(m[k]["tau"] for m in rows.values()) / len(rows)
print(f"| mean | {mean('dart'):.2f} | {mean('eagle3'):.2f} |")
PY
$B/python reproduce/update_cards.py --decoding-tau-only --results "$OUT"  # the model cards state these figures
