"""Does a batch whose rows carry aux states for their drafters cost more than plain batched AR? DART in a
theta-0 batch (the budget fell back) still asks every step for the three hidden states its head reads, so that
its cache stays whole when trees come back. Both sides decode the same HumanEval prompts in plain batched AR
steps (`batch.generate_batch`), one with drafters that want aux and draft nothing, alternating in one process;
decode seconds and median verify ms per side, and each round's ratio.

    python experiments/engine/batch_aux_ab.py [--rows 8] [--tokens 64] [--rounds 10]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab.batch import generate_batch  # noqa: E402
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.generate import Drafter  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402


class AuxAR(Drafter):
    """Plain AR steps (the root alone) that receive the accepted positions' aux states, as a fallen-back DART row."""

    needs_aux = True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    t = load_target()
    prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.rows)]
    cfg = GenerationConfig(max_new_tokens=args.tokens, stop_on_eos=False)
    sides = {"plain": lambda: generate_batch(t, prompts, None, cfg),
             "aux": lambda: generate_batch(t, prompts, [AuxAR() for _ in prompts], cfg)}
    for run in sides.values():  # warm-up
        run()
    decode = {k: [] for k in sides}
    verify = {k: [] for k in sides}
    for r in range(args.rounds):
        for name in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            res = sides[name]()
            decode[name].append(res.decode_s)
            verify[name].append(statistics.median(s["verify_ms"] for s in res.steps))
    for name in sides:
        print(f"{name}: decode {statistics.median(decode[name]):.4f} s, verify {statistics.median(verify[name]):.3f} ms "
              f"(medians of {args.rounds})")
    print("aux / plain per round:", " ".join(f"{a / b:.3f}" for a, b in zip(decode["aux"], decode["plain"])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
