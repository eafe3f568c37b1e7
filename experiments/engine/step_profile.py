"""Where a one-token step's time goes, per op (`torch.profiler`), on the embedded target: eager or compiled
(`--compile`: one shape compiled first), after a random prompt; the compiled graph's call is the profile's
compiled-region row, the rest of the step's wall time the Python around it.

    python experiments/engine/step_profile.py [--dtype int4] [--compile] [--steps 40] [--rows 20] [--nodes 1] [--sdpa]
    python experiments/engine/step_profile.py --smoke     # a tiny random Llama, eager, a few steps

`--nodes N` verifies a chain of N nodes per step instead of one token (what a tree of N costs, per op);
`--sdpa`: attention through torch's SDPA at every step, not our kernel (`dart_lab/engine/attention.py`).
main() returns {"step_ms": median wall ms of verify + commit, "ops": {op: self CPU ms per step}} (the listed rows).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.engine import attention  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=20, help="ops listed")
    ap.add_argument("--context", type=int, default=150)
    ap.add_argument("--nodes", type=int, default=1, help="a chain of this many nodes per verify")
    ap.add_argument("--sdpa", action="store_true", help="torch's SDPA for every step's attention")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random Llama in fp32, 5 steps, 30 tokens of context (the tests' mode)")
    args = ap.parse_args(argv)
    if args.smoke:
        t, args.steps, args.context = tiny.tiny_target(), min(args.steps, 5), min(args.context, 30)
    else:
        t = load_target("smollm2-135m", dtype=args.dtype)
    V = min(t.vocab_size, 40000)
    geometry = (t.n_heads, t.n_kv, t.head_dim)
    if args.sdpa:
        attention.override(*geometry, 0)
    try:
        t.compile = args.compile
        P = args.context
        t.prefill(torch.randint(3, V, (P,), generator=torch.Generator().manual_seed(0)))
        tok = 5

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
        print(f"{'one-token step' if args.nodes == 1 else f'{args.nodes}-node verify'} (verify + commit): "
              f"{wall:.2f} ms", flush=True)
        with profile() as prof:
            steps(args.steps)
    finally:
        if args.sdpa:
            attention.override(*geometry, None)  # back to what was measured at load
    avg = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.rows]
    print(f"per step, {args.steps} steps:")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    return {"step_ms": wall, "ops": {e.key: e.self_cpu_time_total / 1e3 / args.steps for e in avg}}


if __name__ == "__main__":
    main()
