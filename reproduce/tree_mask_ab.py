"""Paired A/B, one process: a tree verify with the attention mask additive (built once per forward, what
`fast_llama.FastTarget` does) vs boolean (SDPA converts it in every layer: the previous code). The two
variants alternate call by call, so a slow stretch of the machine hits both; the figure is the median
of the per-pair differences. The boolean variant makes its mask once per forward as well (a wrapper
around SDPA that both variants pass through), so only SDPA's own handling differs. Idle machine:

    .venv/bin/python reproduce/tree_mask_ab.py
"""
from __future__ import annotations

import statistics
import time
import types

import torch
import torch.nn.functional as F

from dart_lab import fast_llama
from dart_lab.loading import load_target
from dart_lab.tree import Tree

STATE = {"bool": False, "mask": None}


def sdpa(q, k, v, attn_mask=None, **kw):
    if STATE["bool"] and attn_mask is not None:
        if STATE["mask"] is None:
            STATE["mask"] = attn_mask == 0  # allowed where the additive mask is 0
        attn_mask = STATE["mask"]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)


def main() -> None:
    fast_llama.F = types.SimpleNamespace(**{**vars(F), "scaled_dot_product_attention": sdpa})
    t = load_target()
    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(0)
    trees = {5: Tree(torch.tensor([5, 10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1, 1])),
             11: Tree(torch.arange(11) + 5, torch.tensor([-1] + list(range(10))))}
    print(f"runner {type(t).__name__}, {t.dtype}; ms per verify, median over 56 pairs")
    for P in (150, 300, 600):
        t.prefill(torch.randint(100, 40000, (P,), generator=g), want_aux=True, all_logits=False)
        ts = {(n, b): [] for n in trees for b in (False, True)}
        for r in range(60):
            for n, tree in trees.items():
                for b in ((False, True) if r % 2 else (True, False)):
                    STATE["bool"], STATE["mask"] = b, None
                    t0 = time.perf_counter()
                    t.verify(tree, want_aux=True)
                    ts[(n, b)].append((time.perf_counter() - t0) * 1e3)
                    t.commit([0])
                    t.truncate(P)
        for n in trees:
            add, boo = ts[(n, False)][4:], ts[(n, True)][4:]
            d = statistics.median([y - x for x, y in zip(add, boo)])
            print(f"context {P}, {n} nodes: additive {statistics.median(add):.2f}, boolean {statistics.median(boo):.2f}, "
                  f"boolean minus additive (paired) {d:+.2f} ms")


if __name__ == "__main__":
    main()
