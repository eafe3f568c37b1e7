"""Two ways of compiling the 4-bit target's steps, in one process on the same target: chains of 1 and 4 nodes
after random prompts of several lengths, the two modes' graphs alternating round by round; median ms per
verify, whether the argmax agrees, and the seconds each mode spent compiling. Variants:

- keys: attention over exactly the cached keys (their number a symbol in one graph per node bucket:
  `FastTarget.key_bucket` None) against static key buckets (a graph per multiple of 256 slots, the padding
  read and masked);
- wrapper: inductor's C++ wrapper (`cpp_wrapper`: the graph's kernels called from C++) against its Python one;
- chunk: the generated kernels parallelised from 512 elements (inductor's default `cpp.min_chunk_size`)
  against from 4096 (a token's small ops then run on one thread).

    python experiments/engine/compiled_ab.py --variant keys [--contexts 150,250,400] [--nodes 1,4] [--rounds 8]
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

# variant -> mode -> (FastTarget attributes, inductor config while compiling and running)
VARIANTS = {
    "keys": {"bucket 256": ({"key_bucket": 256}, {}), "exact": ({"key_bucket": None}, {})},
    "wrapper": {"python": ({}, {"cpp_wrapper": False}), "c++": ({}, {"cpp_wrapper": True})},
    "chunk": {"512": ({}, {"cpp.min_chunk_size": 512}), "4096": ({}, {"cpp.min_chunk_size": 4096})},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", choices=sorted(VARIANTS), required=True)
    ap.add_argument("--contexts", default="150,250,400")
    ap.add_argument("--nodes", default="1,4")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtype", default="int4")
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype=args.dtype)
    t.compile = True
    g = torch.Generator().manual_seed(0)
    contexts = [int(x) for x in args.contexts.split(",")]
    sizes = [int(x) for x in args.nodes.split(",")]
    prompts = {P: torch.randint(100, 40000, (P,), generator=g) for P in contexts}
    trees = {n: Tree(torch.randint(100, 40000, (n,), generator=g), torch.arange(-1, n - 1)) for n in sizes}
    modes = VARIANTS[args.variant]
    graphs, compile_s = {}, {m: 0.0 for m in modes}
    ms = {(m, P, n): [] for m in modes for P in contexts for n in sizes}
    top = {}
    for r in range(args.rounds + 1):  # round 0 compiles and warms up
        for mode in (list(modes) if r % 2 else list(reversed(modes))):
            attrs, config = modes[mode]
            for k, v in attrs.items():
                setattr(t, k, v)
            t._step_graph = graphs.get(mode)
            c0 = t.compile_seconds
            with torch._inductor.config.patch(config):
                for P, prompt in prompts.items():
                    t.prefill(prompt)
                    for n, tree in trees.items():
                        t0 = time.perf_counter()
                        out = t.verify(tree)
                        if r:
                            ms[(mode, P, n)].append((time.perf_counter() - t0) * 1e3)
                        top.setdefault((mode, P, n), out.logits.argmax(-1))
                        t.commit([0])
                        t.truncate(P)
            graphs[mode] = t._step_graph
            compile_s[mode] += t.compile_seconds - c0
    a, b = modes
    for P in contexts:
        for n in sizes:
            row = {m: round(statistics.median(ms[(m, P, n)]), 2) for m in modes}
            print(json.dumps({"context": P, "nodes": n, "verify_ms": row, "speedup": round(row[a] / row[b], 3),
                              "same_argmax": bool(torch.equal(top[(a, P, n)], top[(b, P, n)]))}), flush=True)
    print(json.dumps({"compile_seconds": {m: round(s, 1) for m, s in compile_s.items()},
                      "shapes": {m: sorted(map(str, graphs[m].shapes)) for m in modes}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
