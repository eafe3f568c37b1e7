"""Our decoding attention kernel (`dart_lab/engine/attention.py`, csrc/attention.cpp) against torch's SDPA:
  1. the attention alone, 30 layers' caches (each read from memory, as in a step), per (rows, nodes a row);
  2. eager steps of the embedded 4-bit target: one token, a 4-node chain, a batch of 8 rows at one token
     each, the two attentions alternating in one process (`attention.override`).

    python experiments/engine/attention_ab.py [--rounds 5]
    python experiments/engine/attention_ab.py --smoke     # tiny shapes and a tiny random Llama, seconds

main() returns {"alone": {"<rows> x <nodes>, <keys>": {sdpa_ms, ours_ms, max_abs_diff}},
"steps": {step: {sdpa_ms, ours_ms}}}; {} where our kernel is not built.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.engine import attention  # noqa: E402
from dart_lab.engine.batch_target import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402

CASES = ((1, 1, 300), (1, 4, 300), (1, 8, 300), (2, 4, 300), (8, 1, 300), (8, 1, 600), (16, 1, 300))


def best_ms(f, calls: int = 20, rounds: int = 7) -> float:
    """The fastest of `rounds` mean ms over `calls` calls, after one call."""
    f()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        times.append((time.perf_counter() - t0) / calls * 1e3)
    return min(times)


@torch.no_grad()
def kernel_alone(H: int = 9, Hk: int = 3, D: int = 64, layers: int = 30, cases=CASES, calls: int = 20,
                 rounds: int = 7) -> dict:
    print(f"| rows x nodes, keys | SDPA ms ({layers} layers) | ours ms | speed-up | max abs diff |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    out = {}
    for B, N, nk in cases:
        caches = [(torch.randn(B, Hk, 1024, D, generator=g), torch.randn(B, Hk, 1024, D, generator=g))
                  for _ in range(layers)]
        q = torch.randn(B, H, N, D, generator=g)
        mask = torch.zeros(B, 1, N, nk)
        mask[..., nk - N:] = torch.zeros(N, N).masked_fill_(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))

        def sdpa():
            return [F.scaled_dot_product_attention(q, K[:, :, :nk], V[:, :, :nk], attn_mask=mask, scale=D ** -0.5,
                                                   enable_gqa=True) for K, V in caches]

        def ours():
            return [torch.ops.dart_lab.decode_attn(q, K[:, :, :nk], V[:, :, :nk], mask, D ** -0.5) for K, V in caches]

        err = max(float((a - b).abs().max()) for a, b in zip(sdpa()[:2], ours()[:2]))
        a, b = best_ms(sdpa, calls, rounds), best_ms(ours, calls, rounds)
        out[f"{B} x {N}, {nk}"] = {"sdpa_ms": a, "ours_ms": b, "max_abs_diff": err}
        print(f"| {B} x {N}, {nk} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {err:.1e} |", flush=True)
    return out


@torch.no_grad()
def steps(rounds: int, smoke: bool = False) -> dict:
    t = tiny.tiny_target() if smoke else load_target("smollm2-135m", dtype="int4")
    geometry = (t.n_heads, t.n_kv, t.head_dim)
    # the smallest mode: ours up to 4 nodes whatever was measured (a tiny model's steps may all take SDPA)
    nodes = max(t.attention_nodes, 4) if smoke else t.attention_nodes
    print(f"\n{t.name}, {t.precision}, eager; ours up to {nodes} nodes a row")
    P, V = (30, t.vocab_size) if smoke else (150, 40000)
    calls = 3 if smoke else 30
    t.prefill(torch.randint(3, V, (P,), generator=torch.Generator().manual_seed(0)))

    def one_row(n: int, calls: int = calls) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            tree = Tree.single(5) if n == 1 else Tree(torch.tensor([5] * n), torch.arange(-1, n - 1))
            t.verify(tree)
            t.commit([0])
            t.truncate(P)
        return (time.perf_counter() - t0) / calls * 1e3

    g = torch.Generator().manual_seed(0)
    B = 2 if smoke else 8
    bt = BatchTarget(t)
    bt.prefill([torch.randint(3, V, (int(n),), generator=g) for n in torch.randint(P - 30 if smoke else 120, P + 20,
                                                                                    (B,), generator=g)])
    lens, end = list(bt.lens), bt.end

    def batch(calls: int = max(calls // 2, 2)) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            bt.verify([Tree.single(7)] * B)
            bt.commit([[0]] * B)
        ms = (time.perf_counter() - t0) / calls * 1e3
        bt.lens, bt.end = list(lens), end
        return ms

    cases = {"one token": lambda: one_row(1), "4-node chain": lambda: one_row(4), f"{B} rows x one token": batch}
    res: dict = {}
    for r in range(rounds + 1):  # round 0 warms up
        for on in (0, nodes):
            attention.override(*geometry, on)
            for name, f in cases.items():
                ms = f()
                if r:
                    res.setdefault((name, on), []).append(ms)
    attention.override(*geometry, None)  # forgotten: the next step measures it again, as at load
    print("| step | SDPA ms | ours ms | speed-up |\n|---|---|---|---|")
    out = {}
    for name in cases:
        a, b = statistics.median(res[(name, 0)]), statistics.median(res[(name, nodes)])
        out[name] = {"sdpa_ms": a, "ours_ms": b}
        print(f"| {name} | {a:.2f} | {b:.2f} | {a / b:.3f}x |")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="4 query / 2 K/V heads of 16, 2 layers' caches, a tiny random Llama, 1 round (the tests' mode)")
    args = ap.parse_args(argv)
    if not attention.available():
        print(f"our attention kernel is not built here: {attention.reason()}")
        return {}
    if args.smoke:
        alone = kernel_alone(4, 2, 16, layers=2, cases=((1, 1, 40), (1, 4, 40), (2, 1, 60)), calls=3, rounds=2)
        return {"alone": alone, "steps": steps(1, smoke=True)}
    return {"alone": kernel_alone(), "steps": steps(args.rounds)}


if __name__ == "__main__":
    main()
