"""How far ahead our 4-bit kernel should prefetch, on this CPU: variants of `dart_lab/csrc/q4mm.cpp` with the
prefetch distance (1-8 KB) and hint (L1 / L2) changed, a far and a near one, or no prefetch, built side by side (each under its
own op namespace) and timed on one sweep over the embedded target's 120 decoder linear shapes (random 4-bit
weights: the kernel's time does not depend on their values), 9 alternating rounds, median of each round's
fastest of 3.

    python experiments/engine/q4_prefetch_ab.py [--rows 1,4,8]
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_ops, q4_sweep, q4_weights, source  # noqa: E402

# every prefetch of the weights in the kernel's paths (the one a CPU runs is the one timed)
LINE = re.compile(r"_mm_prefetch\(\(const char\*\)\(wb \+ \(quad \+ \d+\) \* 32\), _MM_HINT_T\d\);")
# each variant: the prefetches a quad issues, (quads ahead, hint); two of them: a far one into L2, a near one into L1
VARIANTS = {"1KB": [(32, "_MM_HINT_T0")], "2KB": [(64, "_MM_HINT_T0")], "4KB": [(128, "_MM_HINT_T0")],
            "2KB-L2": [(64, "_MM_HINT_T1")], "4KB-L2": [(128, "_MM_HINT_T1")], "8KB-L2": [(256, "_MM_HINT_T1")],
            "1KB+4KB-L2": [(32, "_MM_HINT_T0"), (128, "_MM_HINT_T1")], "none": []}


def build(name: str, spec):
    src = source("q4mm")
    assert LINE.search(src), "the kernel's prefetch line changed: update this experiment"
    line = " ".join(f"_mm_prefetch((const char*)(wb + (quad + {d}) * 32), {h});" for d, h in spec)
    return build_ops(LINE.sub(lambda _: line, src), "v_" + name.replace("-", "_").replace("+", "_")).q4mm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    ops = {name: build(name, spec) for name, spec in VARIANTS.items()}
    g = torch.Generator().manual_seed(0)
    weights = q4_weights(g)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    ms = alternate({v: (lambda op: lambda m: q4_sweep(op, xs[m], weights))(op) for v, op in ops.items()}, rows,
                   args.rounds)
    for m in rows:
        print(f"rows {m}: ms a sweep  " + "  ".join(f"{v} {ms[(v, m)]:.2f}" for v in ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
