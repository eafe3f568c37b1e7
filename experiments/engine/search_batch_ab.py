"""The tree search of R rows (`search.tree_search_batch`) through the compiled level loop and tree cut
(`dart_lab::beam_candidates`, `dart_lab::closed_tree`: each row alone) against the rows' shared numpy loop and the
numpy tree cut (`kernels.turned_off("search")`): random draft logits (8 levels x 8,192 draft tokens), contexts of
100 tokens, the shipped DART head's n-gram; median of 7 calls per side, ms a call. Then one row's search with
dart-ctx's n-gram (the corpus's mixed with the request's own, `dart_ctx.MixedNGram`) over a context of 300 tokens.

    python experiments/engine/search_batch_ab.py [--rows 1,4,16,64] [--nodes 4,60]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import kernels  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_drafter  # noqa: E402
from dart_lab.dart_ctx import ContextConfig, MixedNGram  # noqa: E402
from dart_lab.ngram import LocalNGram  # noqa: E402
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search, tree_search_batch  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--nodes", default="4,60")
    args = ap.parse_args(argv)
    t = load_target()
    d = make_drafter("dart", t)
    g = torch.Generator().manual_seed(0)
    print("| nodes | rows | compiled ms | numpy ms |\n|---|---|---|---|")
    for nodes in (int(x) for x in args.nodes.split(",")):
        cfg = TreeSearchConfig(max_nodes=nodes)
        for R in (int(x) for x in args.rows.split(",")):
            logp, toks = topk_levels(torch.randn(R * 8, 8192, generator=g) * 3, 25, d.vocab_map)
            logp, toks = logp.reshape(R, 8, 25), toks.reshape(R, 8, 25)
            ctx = [torch.randint(0, 40000, (100,), generator=g).tolist() for _ in range(R)]
            ms = {}
            for side, off in (("compiled", ()), ("numpy", ("search",))):
                ts = []
                for _ in range(7):
                    with kernels.turned_off(*off):
                        t0 = time.perf_counter()
                        tree_search_batch(logp, toks, ctx, d.ngram, cfg)
                        ts.append(time.perf_counter() - t0)
                ms[side] = statistics.median(ts) * 1e3
            print(f"| {nodes} | {R} | {ms['compiled']:.2f} | {ms['numpy']:.2f} |", flush=True)
    print("\n| dart-ctx's mixed n-gram, nodes | compiled ms | numpy ms |\n|---|---|---|")
    for nodes in (int(x) for x in args.nodes.split(",")):
        cfg = TreeSearchConfig(max_nodes=nodes)
        logp, toks = topk_levels(torch.randn(8, 8192, generator=g) * 3, 25, d.vocab_map)
        ctx = torch.randint(0, 40000, (300,), generator=g).tolist()
        ms = {}
        for side, off in (("compiled", ()), ("numpy", ("search",))):
            ts = []
            for _ in range(7):
                mixed = MixedNGram(d.ngram, LocalNGram(ctx), ContextConfig().w_context)  # a new step's n-gram
                with kernels.turned_off(*off):
                    t0 = time.perf_counter()
                    tree_search(logp, toks, ctx, mixed, cfg)
                    ts.append(time.perf_counter() - t0)
            ms[side] = statistics.median(ts) * 1e3
        print(f"| {nodes} | {ms['compiled']:.2f} | {ms['numpy']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
