"""Is our decoding attention kernel (`dart_lab/csrc/attention.cpp`) faster than it was at another git revision,
and than torch's SDPA, per (rows, nodes a row)? The kernel's source at `--rev` is built under its own op
namespace beside the working tree's; 30 layers' caches of the embedded target's geometry (9 query heads, 3 key
heads, head size 64), each read from memory as in a step, 256 cached keys; the three alternate over 5 rounds,
median of each round's fastest of 3. `--spread F`: rows of a batch as long as a batch's are (row b's own keys
end F b / (B - 1) of the way short of the longest row's, the slots between masked for it, its tree after them).

    python experiments/engine/attention_rev_ab.py --rev HEAD~1 [--rows 1,8] [--nodes 1,2,4,5,8,16] [--spread 0.4] \
        [--cache bf16]

`--cache bf16`: the caches in bf16, as a 4-bit or bf16 target keeps them (SDPA then reads them widened to fp32).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import attention  # noqa: E402
from kernel_ab import alternate, ops_at, wall_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--nodes", default="1,2,4,5,8,16")
    ap.add_argument("--spread", type=float, default=0.0)
    ap.add_argument("--cache", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args(argv)
    if not attention.available():
        print(f"our attention kernel is not built here: {attention.reason()}")
        return 1
    old, new = ops_at("attention", args.rev).decode_attn, torch.ops.dart_lab.decode_attn
    g = torch.Generator().manual_seed(0)
    L, Hk, H, D, nk = 30, 3, 9, 64, 256
    nodes = [int(x) for x in args.nodes.split(",")]
    for B in (int(b) for b in args.rows.split(",")):
        dt = torch.bfloat16 if args.cache == "bf16" else torch.float32
        caches = [(torch.randn(B, Hk, 2 * nk, D, generator=g).to(dt), torch.randn(B, Hk, 2 * nk, D, generator=g).to(dt))
                  for _ in range(L)]
        qs = {n: torch.randn(B, H, n, D, generator=g) for n in nodes}
        masks = {n: torch.zeros(B if args.spread else 1, 1, n, nk) for n in nodes}
        for n in nodes:
            masks[n][..., nk - n:] = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            for b in range(B if args.spread else 0):
                own = round((nk - n) * (1 - args.spread * b / max(B - 1, 1)))
                masks[n][b, ..., own:nk - n] = float("-inf")

        def timer(op):
            return lambda n: wall_ms(lambda: [op(qs[n], K[:, :, :nk], V[:, :, :nk], masks[n], 0.125) for K, V in caches])

        ms = alternate({args.rev: timer(old), "now": timer(new),
                        "sdpa": lambda n: wall_ms(lambda: [attention._sdpa(qs[n], K, V, masks[n], nk, 0.125)
                                                           for K, V in caches])}, nodes, 5)
        for n in nodes:
            print(f"{B} rows x {n} nodes, 30 layers: ms  " + "  ".join(f"{k} {ms[(k, n)]:.3f}" for k in (args.rev, "now", "sdpa")),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
