"""Should our decoding attention prefetch K and V ahead of its loops on this CPU? Variants of
`dart_lab/csrc/attention.cpp` with a software prefetch of the key (score pass) and value (sum pass) rows 4, 8
or 16 keys ahead (into L1; the kernel's is 8), or none, built side by side under their own op namespaces
and timed on a batch step's attention: 30 layers' caches (L, B, 3 key heads, capacity, 64) of the embedded
target's geometry (9 query heads), B rows of one new position each over `--keys` cached keys, 9 alternating
rounds, median of each round's fastest of 3.

    python experiments/engine/attention_prefetch_ab.py [--rows 1,8] [--keys 220]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_ops, source, wall_ms  # noqa: E402

AHEAD = "constexpr int64_t kAhead = 8;"
VARIANTS = {"none": None, "4keys": 4, "8keys": 8, "16keys": 16}


def build(name: str, ahead):
    src = source("attention")
    assert AHEAD in src and src.count("_mm_prefetch(") == 2, "the kernel's prefetches changed: update this experiment"
    if ahead is None:  # the prefetch lines dropped
        src = "\n".join(line for line in src.splitlines() if "_mm_prefetch(" not in line)
    else:
        src = src.replace(AHEAD, f"constexpr int64_t kAhead = {ahead};")
    return build_ops(src, "attn_" + name).decode_attn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--keys", type=int, default=220)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    ops = {name: build(name, ahead) for name, ahead in VARIANTS.items()}
    g = torch.Generator().manual_seed(0)
    L, Hk, H, D, cap = 30, 3, 9, 64, 512
    caches = {B: (torch.randn(L, B, Hk, cap, D, generator=g), torch.randn(L, B, Hk, cap, D, generator=g)) for B in rows}
    qs = {B: torch.randn(B, H, 1, D, generator=g) for B in rows}
    n = args.keys

    def layers(op, B: int) -> list:
        k, v = caches[B]
        return [op(qs[B], k[i, :, :, :n], v[i, :, :, :n], None, D ** -0.5) for i in range(L)]

    ref = {B: layers(ops["none"], B) for B in rows}
    for name, op in ops.items():  # the same arithmetic: every variant's output equals the kernel's
        for B in rows:
            assert all(torch.equal(a, b) for a, b in zip(layers(op, B), ref[B])), name
    ms = alternate({v: (lambda op: lambda B: wall_ms(lambda: layers(op, B)))(op) for v, op in ops.items()}, rows,
                   args.rounds)
    for B in rows:
        print(f"{B} rows x {n} keys, 30 layers: ms  " + "  ".join(f"{v} {ms[(v, B)]:.3f}" for v in ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
