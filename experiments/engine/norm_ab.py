"""Our one-pass fp32 norm (`dart_lab::rms_norm`, csrc/norm.cpp) against torch's F.rms_norm in eager steps of the
embedded 4-bit target: one token, and 8 rows at one token each, the two alternating in one process
(`kernels.rms_norm_here` answered False for the F.rms_norm rounds).

    python experiments/engine/norm_ab.py [--rounds 6]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dart_lab import kernels
from dart_lab.batch import BatchTarget
from dart_lab.loading import load_target
from dart_lab.tree import Tree


@torch.no_grad()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    built = kernels.rms_norm_here
    if not built():
        raise SystemExit(f"our norm is not built here: {kernels._norm.get('reason')}")
    t = load_target("smollm2-135m", dtype="int4")
    P = 150
    t.prefill(torch.randint(100, 40000, (P,), generator=torch.Generator().manual_seed(0)))

    def one_token(calls: int = 40) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            t.verify(Tree.single(500))
            t.commit([0])
            t.truncate(P)
        return (time.perf_counter() - t0) / calls * 1e3

    g = torch.Generator().manual_seed(0)
    bt = BatchTarget(t)
    bt.prefill([torch.randint(100, 40000, (int(n),), generator=g) for n in torch.randint(120, 170, (8,), generator=g)])
    lens, end = list(bt.lens), bt.end

    def batch8(calls: int = 15) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            bt.verify([Tree.single(7)] * 8)
            bt.commit([[0]] * 8)
        ms = (time.perf_counter() - t0) / calls * 1e3
        bt.lens, bt.end = list(lens), end
        return ms

    res: dict = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for ours in (False, True):
            kernels.rms_norm_here = built if ours else (lambda: False)
            for name, f in (("one token", one_token), ("8 rows x one token", batch8)):
                ms = f()
                if r:
                    res.setdefault((name, ours), []).append(ms)
    kernels.rms_norm_here = built
    print("| step | F.rms_norm ms | ours ms | speed-up |\n|---|---|---|---|")
    for name in ("one token", "8 rows x one token"):
        a, b = statistics.median(res[(name, False)]), statistics.median(res[(name, True)])
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.3f}x |")


if __name__ == "__main__":
    main()
