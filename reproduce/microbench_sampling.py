"""What does one sampled (T > 0) verification cost on this CPU? Times `acceptance.accept` on random
logits over the embedded target's 49,152-token vocabulary for trees of 1 / 5 / 9 nodes (a chain: the
walk visits the root and goes deeper only when a draft is accepted), against the previous code path
kept here for comparison: target probabilities for every tree row, then `torch.multinomial` for the
bonus token. Same process, one thread count. Run it on an idle machine.

    python reproduce/microbench_sampling.py
"""
from __future__ import annotations

import statistics
import time

import torch

from dart_lab.acceptance import accept, target_probs
from dart_lab.config import GenerationConfig
from dart_lab.tree import Tree


def previous_accept(tree: Tree, logits: torch.Tensor, cfg: GenerationConfig, g: torch.Generator):
    """The code before this change: all rows' probabilities, a full sum per child, multinomial bonus."""
    probs = target_probs(logits, cfg)
    tokens, children = tree.tokens.tolist(), tree.children()
    path, node = [0], 0
    while True:
        p = probs[node].clone()
        accepted = None
        for c in children[node]:
            x = tokens[c]
            px = float(p[x])
            if px <= 0.0:
                continue
            if torch.rand((), generator=g).item() * float(p.sum()) < px:
                accepted = c
                break
            p[x] = 0.0
        if accepted is None:
            return path, torch.multinomial(p / p.sum(), 1, generator=g).item()
        path.append(accepted)
        node = accepted


def ms(f, n: int = 300) -> float:
    for _ in range(20):
        f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def main() -> None:
    cfg = GenerationConfig(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    print(f"accept at T=1 over a 49,152-token vocabulary, bf16 logits, {torch.get_num_threads()} threads (median ms)")
    print("tree nodes: previous (all rows + multinomial) / now (visited rows + inverse CDF)")
    for n in (1, 5, 9):
        tree = Tree(torch.randint(0, 49152, (n,), generator=g), torch.arange(-1, n - 1))
        logits = torch.randn(n, 49152, generator=g).to(torch.bfloat16) * 3
        old = ms(lambda: previous_accept(tree, logits, cfg, g))
        new = ms(lambda: accept(tree, logits, cfg, g))
        print(f"{n}: {old:.3f} / {new:.3f}")


if __name__ == "__main__":
    main()
