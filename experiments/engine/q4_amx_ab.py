"""Our 4-bit kernel on Intel's AMX tiles against its AVX-512 path (`q4.amx_rows`), per row count, in one
process: one sweep over the embedded target's 120 decoder linear shapes (random 4-bit groups; the kernel's
time does not depend on their values), the paths alternating over 9 rounds, median of each round's fastest of
3; bf16 weights through oneDNN (`F.linear`, AMX where present) beside them.

    python experiments/engine/q4_amx_ab.py [--rows 1,2,4,8,16,32,64] [--steps]

`--steps`: the 4-bit target's verify of 1-16 nodes after 128 tokens (`budget.measure_verify`), the kernel's
AMX path on and off alternating in one process (the per-row path tables as measured with it on).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import q4  # noqa: E402
from kernel_ab import Q4_SHAPES as SHAPES, alternate, wall_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", action="store_true")
    args = ap.parse_args(argv)
    if not q4.available() or q4.amx_rows() < 0:
        print(f"no AMX path here: {q4.reason() or 'the CPU has no AMX-BF16 (or Linux does not grant the tiles)'}")
        return 1
    default = q4.amx_rows()
    if args.steps:
        return steps(default, args.rounds)
    g = torch.Generator().manual_seed(0)
    lins, dense = [], []
    for k, n in SHAPES:
        q = torch.randint(0, 16, (n, k), generator=g)
        scale = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.005).half().float()
        low = (torch.randn(n, k // 32, 1, generator=g) * 0.05).half().float()
        lins.append(q4.Q4Linear.of_groups((q, scale, low)))
        dense.append((q.reshape(n, k // 32, 32) * scale + low).reshape(n, k).to(torch.bfloat16))
    rows = [int(r) for r in args.rows.split(",")]
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    xb = {m: {k: v.to(torch.bfloat16) for k, v in d.items()} for m, d in xs.items()}

    def q4_sweep(m: int) -> float:
        return wall_ms(lambda: [lin(xs[m][k]) for lin, (k, _) in zip(lins, SHAPES)])

    def bf16_sweep(m: int) -> float:
        return wall_ms(lambda: [F.linear(xb[m][k], w) for w, (k, _) in zip(dense, SHAPES)])

    paths = {"avx512": (lambda m: (q4.amx_rows(0), q4_sweep(m))[1]),
             "amx": (lambda m: (q4.amx_rows(1), q4_sweep(m))[1]),
             "bf16": bf16_sweep}
    # agreement of the two paths (the same products and fp32 sums, in another order)
    q4.amx_rows(0)
    a = [lin(xs[rows[-1]][k]) for lin, (k, _) in zip(lins[:4], SHAPES)]
    q4.amx_rows(1)
    b = [lin(xs[rows[-1]][k]) for lin, (k, _) in zip(lins[:4], SHAPES)]
    err = max((u - v).abs().max().item() / v.abs().max().item() for u, v in zip(a, b))
    ms = alternate(paths, rows, args.rounds)
    q4.amx_rows(default)
    print(f"AMX path from {default} rows by default; AMX vs AVX-512 max relative difference {err:.1e}")
    print("rows  " + "  ".join(f"{p:>8}" for p in paths) + "   (ms a sweep of the 120 linears)")
    for m in rows:
        print(f"{m:4d}  " + "  ".join(f"{ms[(p, m)]:8.2f}" for p in paths))
    return 0


def steps(default: int, rounds: int) -> int:
    from dart_lab.budget import measure_verify
    from dart_lab.loading import load_target

    t = load_target("smollm2-135m", dtype="int4")
    sizes = (1, 2, 4, 8, 16)
    got = {p: {n: [] for n in sizes} for p in ("avx512", "amx")}
    for r in range(rounds):
        for p in (("avx512", "amx") if r % 2 == 0 else ("amx", "avx512")):
            q4.amx_rows(0 if p == "avx512" else default)
            for n, ms in measure_verify(t, sizes, repeats=3, prompt_len=128).items():
                got[p][n].append(ms)
    q4.amx_rows(default)
    print("nodes  " + "  ".join(f"{p:>8}" for p in got) + "   (verify ms after 128 tokens, medians)")
    for n in sizes:
        print(f"{n:5d}  " + "  ".join(f"{statistics.median(got[p][n]):8.2f}" for p in got))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
