"""Where a batched step's time goes: B rows of the 4-bit embedded target (random prompts of 120-170 tokens,
prefilled row by row) take steps together through `BatchTarget` (eager), each row an N-node chain (N = 1: plain
AR steps); median ms per step, then `torch.profiler`'s table over 20 steps.

    python experiments/engine/batch_profile.py [B] [N]     # B = 8, N = 1 by default
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv: list[str]) -> int:
    B = int(argv[0]) if argv else 8
    N = int(argv[1]) if len(argv) > 1 else 1
    t = load_target("smollm2-135m", dtype="int4")
    g = torch.Generator().manual_seed(0)
    bt = BatchTarget(t)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g) for n in torch.randint(120, 170, (B,), generator=g)]
    out = bt.prefill(prompts)
    toks = [int(lg[-1].argmax()) for lg in out.logits]

    def steps(n: int) -> float:
        nonlocal toks
        t0 = time.perf_counter()
        for _ in range(n):
            vo = bt.verify([Tree.from_paths(x, [list(range(7, 6 + N))]) if N > 1 else Tree.single(x) for x in toks])
            toks = [int(lg[0].argmax()) for lg in vo.logits]
            bt.commit([[0]] * B)
        return (time.perf_counter() - t0) / n * 1e3

    steps(3)
    print(f"B={B} N={N} step {statistics.median(steps(10) for _ in range(3)):.2f} ms", flush=True)
    with profile() as prof:
        steps(20)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
