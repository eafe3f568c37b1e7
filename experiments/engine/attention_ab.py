"""Our decoding attention kernel (`dart_lab/attention.py`, csrc/attention.cpp) against torch's SDPA:
  1. the attention alone, 30 layers' caches (each read from memory, as in a step), per (rows, nodes a row);
  2. eager steps of the embedded 4-bit target: one token, a 4-node chain, a batch of 8 rows at one token
     each, the two attentions alternating in one process (`attention.override`).

    python experiments/engine/attention_ab.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from dart_lab import attention
from dart_lab.batch import BatchTarget
from dart_lab.loading import load_target
from dart_lab.tree import Tree


def best_ms(f, calls: int = 20, rounds: int = 7) -> float:
    f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return min(times)


@torch.no_grad()
def kernel_alone(H: int = 9, Hk: int = 3, D: int = 64) -> None:
    print("| rows x nodes, keys | SDPA ms (30 layers) | ours ms | speed-up | max abs diff |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for B, N, nk in ((1, 1, 300), (1, 4, 300), (1, 8, 300), (2, 4, 300), (8, 1, 300), (8, 1, 600), (16, 1, 300)):
        caches = [(torch.randn(B, Hk, 1024, D, generator=g), torch.randn(B, Hk, 1024, D, generator=g)) for _ in range(30)]
        q = torch.randn(B, H, N, D, generator=g)
        mask = torch.zeros(B, 1, N, nk)
        mask[..., nk - N:] = torch.zeros(N, N).masked_fill_(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))

        def sdpa():
            return [F.scaled_dot_product_attention(q, K[:, :, :nk], V[:, :, :nk], attn_mask=mask, scale=D ** -0.5,
                                                   enable_gqa=True) for K, V in caches]

        def ours():
            return [torch.ops.dart_lab.decode_attn(q, K[:, :, :nk], V[:, :, :nk], mask, D ** -0.5) for K, V in caches]

        err = max(float((a - b).abs().max()) for a, b in zip(sdpa()[:2], ours()[:2]))
        a, b = best_ms(sdpa), best_ms(ours)
        print(f"| {B} x {N}, {nk} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {err:.1e} |", flush=True)


@torch.no_grad()
def steps(rounds: int) -> None:
    t = load_target("smollm2-135m", dtype="int4")
    geometry = (t.n_heads, t.n_kv, t.head_dim)
    nodes = t.attention_nodes
    print(f"\nembedded target, int4, eager; ours up to {nodes} nodes a row (measured at load)")
    P = 150
    t.prefill(torch.randint(100, 40000, (P,), generator=torch.Generator().manual_seed(0)))

    def one_row(n: int, calls: int = 30) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            tree = Tree.single(500) if n == 1 else Tree(torch.tensor([500] * n), torch.arange(-1, n - 1))
            t.verify(tree)
            t.commit([0])
            t.truncate(P)
        return (time.perf_counter() - t0) / calls * 1e3

    g = torch.Generator().manual_seed(0)
    B = 8
    bt = BatchTarget(t)
    bt.prefill([torch.randint(100, 40000, (int(n),), generator=g) for n in torch.randint(120, 170, (B,), generator=g)])
    lens, end = list(bt.lens), bt.end

    def batch(calls: int = 15) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            bt.verify([Tree.single(7)] * B)
            bt.commit([[0]] * B)
        ms = (time.perf_counter() - t0) / calls * 1e3
        bt.lens, bt.end = list(lens), end
        return ms

    cases = {"one token": lambda: one_row(1), "4-node chain": lambda: one_row(4), "8 rows x one token": batch}
    res: dict = {}
    for r in range(rounds + 1):  # round 0 warms up
        for on in (0, nodes):
            attention.override(*geometry, on)
            for name, f in cases.items():
                ms = f()
                if r:
                    res.setdefault((name, on), []).append(ms)
    attention.override(*geometry, nodes)
    print("| step | SDPA ms | ours ms | speed-up |\n|---|---|---|---|")
    for name in cases:
        a, b = statistics.median(res[(name, 0)]), statistics.median(res[(name, nodes)])
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.3f}x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not attention.available():
        raise SystemExit(f"our attention kernel is not built here: {attention.reason()}")
    kernel_alone()
    steps(args.rounds)


if __name__ == "__main__":
    main()
