"""What does checking the weights every step cost a one-token step? `FastTarget` takes the weights' key (every
parameter's storage and version: has a weight changed since its packs were built?) at a request's prompt and
keeps it for the request's steps, and reads its dtype and device from the listed parameters. The other side
does what it did before: the key taken at every step and the dtype and device read by walking the module
tree. Eager one-token steps of the embedded target after a random prompt, the two sides alternating run by
run in one process; median ms a step.

    python experiments/engine/weights_key_ab.py [--dtype int4] [--runs 10] [--steps 40]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.fast_llama import FastTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.target import Target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="int4")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype=args.dtype)
    prompt = torch.randint(100, 40000, (150,), generator=torch.Generator().manual_seed(0))
    t.prefill(prompt)
    own, tok = (FastTarget.dtype, FastTarget.device), 5

    def run(every_step: bool) -> float:
        nonlocal tok
        FastTarget.dtype, FastTarget.device = (Target.dtype, Target.device) if every_step else own
        try:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                if every_step:
                    t._key = None
                out = t.verify(Tree.single(tok))
                tok = int(out.logits[0].argmax())
                t.commit([0])
            return (time.perf_counter() - t0) / args.steps * 1e3
        finally:
            FastTarget.dtype, FastTarget.device = own

    run(False)
    ms = {True: [], False: []}
    for r in range(args.runs):
        for side in ((True, False) if r % 2 == 0 else (False, True)):
            ms[side].append(run(side))
        if t.seq_len > 1500:  # a new request before the context grows long
            t.prefill(prompt)
    print(f"key and dtype every step: {statistics.median(ms[True]):.3f} ms a step; "
          f"key at the prompt: {statistics.median(ms[False]):.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
