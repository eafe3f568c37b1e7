"""Is an eager step cheaper with its decoder layers in one op (`dart_lab::q4_layers`, csrc/layers.cpp: our kernels
called from C++) than through the Python loop of `fast_llama.decoder_step`? The 4-bit embedded target; B rows
of random 150-250-token prompts in a `BatchTarget` (one row: the target itself), steps of N nodes a row (a
chain), the two sides alternating step by step (`kernels.turned_off("layers")`); median ms a step, and whether
both sides' logits are equal.

    python experiments/engine/layers_op_ab.py [--rows 1,8] [--nodes 1,4] [--steps 40]
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
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--nodes", default="1,4")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype="int4")
    print(f"layers op built: {kernels.layers_here()} ({kernels._layers.get('reason')})", flush=True)
    g = torch.Generator().manual_seed(0)
    for B in (int(x) for x in args.rows.split(",")):
        prompts = [torch.randint(3, t.vocab_size, (int(torch.randint(150, 251, (), generator=g)),), generator=g)
                   for _ in range(B)]
        for N in (int(x) for x in args.nodes.split(",")):
            chain = Tree(torch.arange(20, 20 + N), torch.arange(-1, N - 1))
            bt = BatchTarget(t)
            bt.prefill(prompts)
            start = list(bt.lens)
            times, logits = {"loop": [], "op": []}, {}
            for step in range(args.steps + 2):
                for side in ("loop", "op"):
                    with kernels.turned_off("layers") if side == "loop" else kernels.turned_off():
                        bt.lens, bt.end = list(start), max(start)  # the same step again (its K/V rewritten)
                        t0 = time.perf_counter()
                        out = bt.verify([chain] * B)
                        bt.commit([[0]] * B)
                        if step >= 2:  # two rounds warm up
                            times[side].append((time.perf_counter() - t0) * 1e3)
                        logits[side] = out.flat
            ms = {k: statistics.median(v) for k, v in times.items()}
            print(f"{B} row(s) x {N} node(s): loop {ms['loop']:.2f} ms, one op {ms['op']:.2f} ms "
                  f"({ms['loop'] / ms['op']:.2f}x); logits equal {torch.equal(logits['loop'], logits['op'])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
