"""Compiled 4-bit steps on two path choices, in one process on the same cache: "4bit" (the 4-bit kernel at
every width, the LM head in 16 bits for one row and as 4-bit halves for more) against "measured" (each
linear and the head on the path `int4_by_rows` timed fastest for the step's rows, as eager steps run:
`StepGraph._measured_paths`). Chains of 1-16 nodes after a 200-token random prefix, the two graphs
alternating round by round; median ms per verify and whether the argmax agrees (random tokens: a
disagreement is a near-tie between two arithmetics).

    python experiments/engine/compiled_paths.py [--nodes 1,2,4,8,16] [--rounds 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--context", type=int, default=200)
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype="int4")
    t.compile = True
    g = torch.Generator().manual_seed(0)
    P = args.context
    t.prefill(torch.randint(100, 40000, (P,), generator=g))
    sizes = [int(x) for x in args.nodes.split(",")]
    trees = {n: Tree(torch.randint(100, 40000, (n,), generator=g), torch.arange(-1, n - 1)) for n in sizes}
    graphs = {}
    for mode in ("4bit", "measured"):
        t.int4_paths, t._step_graph = mode, None
        graphs[mode] = t._graph()
    print(json.dumps({"tables": t.dtype_report["int4"]["by_rows"]["tables"]}), flush=True)
    ms = {(m, n): [] for m in graphs for n in sizes}
    top = {}
    for r in range(args.rounds + 2):  # rounds 0-1 compile and warm up
        for mode, graph in (graphs.items() if r % 2 else reversed(graphs.items())):
            t.int4_paths, t._step_graph = mode, graph
            for n, tree in trees.items():
                t0 = time.perf_counter()
                out = t.verify(tree)
                if r >= 2:
                    ms[(mode, n)].append((time.perf_counter() - t0) * 1e3)
                top.setdefault((mode, n), out.logits.argmax(-1))
                t.commit([0])
                t.truncate(P)
    for n in sizes:
        row = {m: round(statistics.median(ms[(m, n)]), 2) for m in graphs}
        print(json.dumps({"nodes": n, "verify_ms": row, "speedup": round(row["4bit"] / row["measured"], 2),
                          "same_argmax": bool(torch.equal(top[("4bit", n)], top[("measured", n)]))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
