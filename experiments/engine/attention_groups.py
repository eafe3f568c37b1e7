"""Grouped-query attention over a static cache, two ways: SDPA with `enable_gqa` (what `decoder_step` runs)
against the query heads folded into the query length, (B, kv_heads, group x N, hd) with the mask repeated per
group (each K/V read once per group). SmolLM2-135M's geometry (9 query heads, 3 KV heads, head dim 64), 30
layers' caches (so K/V come from memory, as in a step), random values; outputs compared.

    python experiments/engine/attention_groups.py [--dtype fp32|bf16]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _ms(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    return round(statistics.median(ts), 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    args = ap.parse_args(argv)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    torch.manual_seed(0)
    L, nh, nkv, hd, cap = 30, 9, 3, 64, 512
    g = nh // nkv
    for B, N, P in ((1, 1, 250), (1, 8, 250), (1, 60, 250), (2, 4, 250), (8, 1, 250), (8, 4, 250)):
        n = P + N
        K, V = torch.randn(L, B, nkv, cap, hd).to(dt), torch.randn(L, B, nkv, cap, hd).to(dt)
        q = torch.randn(B, N, nh, hd).to(dt).transpose(1, 2)
        mask = torch.zeros(B, 1, N, n).masked_fill_(torch.rand(B, 1, N, n) < 0.1, float("-inf"))
        mask[..., :P] = 0
        mask = mask.to(dt)

        def gqa():
            return [F.scaled_dot_product_attention(q, K[i, :, :, :n], V[i, :, :, :n], attn_mask=mask,
                                                   enable_gqa=True) for i in range(L)]

        def grouped():
            qg = q.reshape(B, nkv, g * N, hd)
            mg = mask[:, :, None].expand(B, 1, g, N, n).reshape(B, 1, g * N, n)
            return [F.scaled_dot_product_attention(qg, K[i, :, :, :n], V[i, :, :, :n], attn_mask=mg).view(B, nh, N, hd)
                    for i in range(L)]

        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(gqa(), grouped()))
        print(json.dumps({"rows": B, "nodes": N, "cached": P, "enable_gqa_ms": _ms(gqa), "grouped_ms": _ms(grouped),
                          "max_abs_diff": diff}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
