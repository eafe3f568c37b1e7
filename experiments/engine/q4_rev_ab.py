"""Is our 4-bit kernel (`dart_lab/csrc/q4mm.cpp`) faster than it was at another git revision, per row count?
The kernel's source at `--rev` is built under its own op namespace beside the working tree's; one sweep over
the embedded target's 120 decoder linear shapes (random 4-bit groups: the kernel's time does not depend on their
values), the two alternating over 7 rounds, median of each round's fastest of 3. Each revision takes its own
path for a row count (AVX-512 or AMX tiles, by its own threshold); outputs are compared bit for bit first.

    python experiments/engine/q4_rev_ab.py --rev HEAD~1 [--rows 1,2,3,4,5,8,16,32] [--avx2]

`--avx2`: both builds forced onto their AVX2 path (`q4.avx2_path`, what a CPU without AVX512-BF16 takes).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import q4  # noqa: E402
from kernel_ab import alternate, ops_at, q4_sweep, q4_weights  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rows", default="1,2,3,4,5,8,16,32")
    ap.add_argument("--avx2", action="store_true", help="both builds on their AVX2 path (q4.avx2_path)")
    args = ap.parse_args(argv)
    if not q4.available():
        print(f"our 4-bit kernel is not built here: {q4.reason()}")
        return 1
    rev = ops_at("q4mm", args.rev)
    ops = {args.rev: rev.q4mm, "now": torch.ops.dart_lab.q4mm}
    if args.avx2:
        rev.q4mm_avx2(1)
        q4.avx2_path(True)
    g = torch.Generator().manual_seed(0)
    weights = q4_weights(g)
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    for m in rows:
        for wp, sl, n, k in weights[:4]:
            if not torch.equal(*(op(xs[m][k], wp, sl, n, 1) for op in ops.values())):
                print(f"{m} rows: the outputs differ (another summation order or path)")
                break
    ms = alternate({v: (lambda op: lambda m: q4_sweep(op, xs[m], weights))(op) for v, op in ops.items()}, rows, 7)
    print("rows  " + "  ".join(f"{v:>10}" for v in ops) + "   (ms a sweep of the 120 linears)")
    for m in rows:
        print(f"{m:>4}  " + "  ".join(f"{ms[(v, m)]:10.2f}" for v in ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
