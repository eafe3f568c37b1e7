"""What does a batch step cost when its rows' trees differ in size, with a pad node computed like a real one
("pads computed": every row's nodes through the linears, a pad attending to its row's committed keys) against
skipped ("pads skipped": a pad sees only itself, `decoder_step(live=...)` leaves it out of the linears, the
attention kernel takes its one key's V and is chosen by a row's real nodes)? A row of 9 or 16 nodes beside
one-node rows takes the eager layers (past the attention kernel's width), where the pads are gathered out. The 4-bit embedded target, B rows of random prompts of
120-170 tokens; per tree pattern (nodes a row) the two sides alternate in one process, each round a few
verify + commit steps; the median ms a step, and the largest logit difference between the sides' real nodes
(0: a row's numbers do not depend on its neighbours' pads).

    python experiments/engine/batch_pads_ab.py [--rows 8] [--rounds 7] [--dtype int4]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import fast_llama  # noqa: E402
from dart_lab.batch import BatchTarget  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.tree import Tree  # noqa: E402


class PadsComputed(BatchTarget):
    """The same steps with every row's pad nodes attending to the row's committed keys and through the linears."""

    def verify(self, trees, want_aux=False):
        step, additive = fast_llama.decoder_step, self._additive

        def wide(allowed):  # a pad node sees the row's committed keys again (the mask before pads were skipped)
            allowed = allowed.clone()
            for b, t in enumerate(trees):
                allowed[b, len(t):, :self.end] = torch.arange(self.end) < self.lens[b]
            return additive(allowed)

        fast_llama.decoder_step = lambda *a, live=None, **k: step(*a, **k)
        self._additive = wide
        try:
            return super().verify(trees, want_aux)
        finally:
            fast_llama.decoder_step, self._additive = step, additive


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="int4")
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype=args.dtype)
    B = args.rows
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (int(n),), generator=g) for n in torch.randint(120, 170, (B,), generator=g)]
    patterns = [[1] * B, [2] + [1] * (B - 1), [2] * (B // 2) + [1] * (B - B // 2), [2] * B, [3] + [1] * (B - 1),
                [5] + [1] * (B - 1), [3] * B, [9] + [1] * (B - 1), [16] + [1] * (B - 1)]
    sides = {"pads computed": PadsComputed, "pads skipped": BatchTarget}
    for sizes in patterns:
        trees = [Tree.from_paths(5, [list(range(7, 6 + n))]) if n > 1 else Tree.single(5) for n in sizes]
        held = {name: cls(t) for name, cls in sides.items()}
        for bt in held.values():
            bt.prefill(prompts)
        ms, last = {name: [] for name in sides}, {}
        for r in range(args.rounds + 1):
            for name, bt in held.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    out = bt.verify(trees)
                    bt.commit([[0]] * B)
                if r:  # round 0 warms up
                    ms[name].append((time.perf_counter() - t0) / args.steps * 1e3)
                last[name] = out.flat
        diff = (last["pads computed"] - last["pads skipped"]).abs().max().item()
        print(f"{B} rows, nodes a row {sizes}: " + "; ".join(f"{n} {statistics.median(v):.2f} ms" for n, v in ms.items())
              + f" ({statistics.median(ms['pads computed']) / statistics.median(ms['pads skipped']):.2f}x; real nodes' "
              f"logits max |diff| {diff:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
