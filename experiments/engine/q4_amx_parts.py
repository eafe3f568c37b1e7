"""What bounds our 4-bit kernel's AMX path at a few rows (`dart_lab/csrc/q4mm.cpp`, one tile of rows)? Variants of
the working tree's source, each with one part of a group's work left out (their outputs are wrong; only their
time counts): `no scaling` (each group's products not scaled into the rows' sums), `no lookups` (the 4-bit values
looked up for the first groups of a block only), `no tile stores` (the products not stored for the scaling);
each built under its own op namespace, one sweep over the embedded target's 120 decoder linear shapes, all
alternating over 7 rounds. A part whose removal saves about what the whole path costs beyond one row's sweep
is what the path waits on.

    python experiments/engine/q4_amx_parts.py [--rows 2,4,8,16]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import q4  # noqa: E402
from kernel_ab import alternate, build_ops, q4_sweep, q4_weights, source  # noqa: E402

CUTS = {  # variant -> (text of the working tree's source, its replacement)
    "no scaling": ("""      out[r] = _mm512_fmadd_ps(_mm512_load_ps(c + r * 16), scale, out[r]);
      out[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + h]), out[r]);""",
                   """      out[r] = _mm512_add_ps(out[r], _mm512_add_ps(scale, low));"""),
    "no lookups": ("""        if (g + 2 < G) group_tile(wb, g + 2, bt[2 * (1 - set)]);
        if (g + 3 < G) group_tile(wb, g + 3, bt[2 * (1 - set) + 1]);""",
                   """        if (g == 0 && G > 3) { group_tile(wb, 2, bt[2]); group_tile(wb, 3, bt[3]); }"""),
    "no tile stores": ("""        _tile_stored(0, ct[2 * set], 64);
        if (two) _tile_stored(3, ct[2 * set + 1], 64);""",
                       """        if (g < 4) { _tile_stored(0, ct[2 * set], 64); if (two) _tile_stored(3, ct[2 * set + 1], 64); }"""),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2,4,8,16")
    args = ap.parse_args(argv)
    if not q4.available() or q4.amx_rows() < 0:
        print("our 4-bit kernel's AMX path is not available here")
        return 1
    src = source("q4mm")
    ops = {"whole": torch.ops.dart_lab.q4mm}
    for i, (name, (old, new)) in enumerate(CUTS.items()):
        if old not in src:
            print(f"{name}: the source no longer has the part this variant cuts; update CUTS")
            return 1
        ops[name] = getattr(build_ops(src.replace(old, new), f"q4_part{i}"), "q4mm")
    g = torch.Generator().manual_seed(0)
    weights = q4_weights(g)
    rows = [1] + [int(r) for r in args.rows.split(",")]
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    ms = alternate({v: (lambda op: lambda m: q4_sweep(op, xs[m], weights))(op) for v, op in ops.items()}, rows, 7)
    print("rows  " + "  ".join(f"{v:>14}" for v in ops) + "   (ms a sweep of the 120 linears; 1 row: the AVX-512 path)")
    for m in rows:
        print(f"{m:>4}  " + "  ".join(f"{ms[(v, m)]:14.2f}" for v in ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
