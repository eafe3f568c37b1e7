"""Does a bf16 K/V cache (`FastTarget.bf16_cache`: our attention kernel widens it in registers) make decoding
steps cheaper than the fp32 cache, at 1 and at B rows? The 4-bit embedded target, B random prompts of 100-250
tokens prefilled into a `BatchTarget`, then one-token (AR) steps of every row; the two caches alternate in
one process, each round the median ms a step of `--steps` steps, the median over rounds reported.

    python experiments/engine/bf16_cache_ab.py [--rows 1,8] [--steps 30] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype="int4")
    g = torch.Generator().manual_seed(0)
    for B in (int(b) for b in args.rows.split(",")):
        prompts = [torch.randint(100, 40000, (int(n),), generator=g) for n in torch.randint(100, 250, (B,), generator=g)]

        def steps(bf16: bool) -> float:
            t.bf16_cache = bf16
            bt = BatchTarget(t)
            toks = [int(lg[-1].argmax()) for lg in bt.prefill(prompts).logits]
            assert bt._k.dtype == (torch.bfloat16 if bf16 else torch.float32), "the cache is not the one asked for"
            ms = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                toks = bt.verify([Tree.single(x) for x in toks]).flat.max(-1).indices.tolist()
                bt.commit([[0]] * B)
                ms.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(ms)

        got = {True: [], False: []}
        for _ in range(args.rounds):
            for bf16 in (False, True):
                got[bf16].append(steps(bf16))
        f32, b16 = statistics.median(got[False]), statistics.median(got[True])
        print(f"{B} rows, one token each: ms a step  fp32 cache {f32:.2f}  bf16 cache {b16:.2f}  ({f32 / b16:.3f}x)",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
