"""Where a one-token step's time goes, per op (`torch.profiler`), on the embedded target: eager or compiled
(`--compile`: one shape compiled first), after a random prompt; plus the wall time of verify + commit
against the compiled graph's call alone (the Python around the graph).

    python experiments/engine/step_profile.py [--dtype int4] [--compile] [--steps 40] [--rows 20] [--nodes 1] [--sdpa]

`--nodes N` verifies a chain of N nodes per step instead of one token (what a tree of N costs, per op);
`--sdpa`: attention through torch's SDPA at every step, not our kernel (`dart_lab/attention.py`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import attention  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=20, help="ops listed")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--nodes", type=int, default=1, help="a chain of this many nodes per verify")
    ap.add_argument("--sdpa", action="store_true", help="torch's SDPA for every step's attention")
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype=args.dtype)
    if args.sdpa:
        attention.override(t.n_heads, t.n_kv, t.head_dim, 0)
    t.compile = args.compile
    P = args.context
    t.prefill(torch.randint(100, 40000, (P,), generator=torch.Generator().manual_seed(0)))
    tok = 500

    def steps(n: int) -> float:
        nonlocal tok
        t0 = time.perf_counter()
        for _ in range(n):
            tree = Tree.single(tok) if args.nodes == 1 else Tree(
                torch.tensor([tok] * args.nodes), torch.arange(-1, args.nodes - 1))
            tok = int(t.verify(tree).logits[0].argmax())
            t.commit([0])
            t.truncate(P)
        return (time.perf_counter() - t0) / n * 1e3

    steps(3)  # warm up (and compile the one shape)
    wall = statistics.median(steps(args.steps) for _ in range(5))
    print(f"one-token step (verify + commit): {wall:.2f} ms", flush=True)
    if args.compile and args.nodes == 1:
        graph, positions, slots = t._graph(), torch.tensor([P]), torch.tensor([P])  # distinct: aliasing is guarded too
        kb = t.key_bucket or 1
        nk = -(-(P + 1) // kb) * kb
        mask = torch.zeros(1, nk).masked_fill_(torch.arange(nk)[None] > P, float("-inf"))[None, None]
        ks, vs = t._layer_caches()

        @torch.no_grad()  # as verify runs it: grad mode is one of the graph's guards
        def graph_only(n: int) -> float:
            t0 = time.perf_counter()
            for _ in range(n):
                int(graph.run(torch.tensor([tok]), positions, slots, mask, ks, vs, nk if t.key_bucket else None)[0][0].argmax())
            return (time.perf_counter() - t0) / n * 1e3

        graph_only(3)
        print(f"the compiled graph's call alone: {statistics.median(graph_only(args.steps) for _ in range(5)):.2f} ms",
              flush=True)
    with profile() as prof:
        steps(args.steps)
    print(f"per step, {args.steps} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
