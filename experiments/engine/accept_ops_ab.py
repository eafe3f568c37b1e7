"""Is a decode step's accept + compaction cheaper with a step's argmax and near-tie margins taken in one pass over
the logits (`dart_lab::top2`, csrc/norm.cpp) and a batch's cache compaction as plain copies
(`dart_lab::move_slots`, csrc/rope.cpp) than with torch's max + topk(2) and advanced indexing? The 4-bit embedded
target (or `--dtype`), plain AR: the first B HumanEval prompts decoded together (`Runner.generate_batch`) and
one prompt alone (`Runner.generate`), the two settings alternating in one process; median ms a step (batch:
verify + accept + compact; one row: decode seconds / steps).

    python experiments/engine/accept_ops_ab.py [--rows 8] [--rounds 6] [--dtype int4]
"""
from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dart_lab import kernels  # noqa: E402
from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_runner  # noqa: E402

batch = importlib.import_module("dart_lab.batch")
generate = importlib.import_module("dart_lab.generate")


def torch_top2(logits: torch.Tensor) -> tuple[list[int], list[float]]:
    """The torch ops `generate.top2` replaces: max for the argmax, topk(2) for the margin."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return logits.max(-1).indices.tolist(), (top[:, 0] - top[:, 1]).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--dtype", default="int4")
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype=args.dtype)
    prompts = [target.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", args.rows)]
    cfg, runner = GenerationConfig(max_new_tokens=128), make_runner("ar", target)
    ours, move_here = generate.top2, kernels.move_slots_here
    batch_ms, one_ms = {"ops": [], "torch": []}, {"ops": [], "torch": []}
    for r in range(args.rounds + 1):
        for side in (("ops", "torch") if r % 2 else ("torch", "ops")):
            batch.top2 = generate.top2 = ours if side == "ops" else torch_top2
            kernels.move_slots_here = move_here if side == "ops" else (lambda: False)
            out = runner.generate_batch(prompts, cfg)
            alone = runner.generate(prompts[r % len(prompts)], cfg)
            if r:  # round 0 warms up
                batch_ms[side].append(statistics.mean(s["verify_ms"] + s["accept_ms"] for s in out.steps))
                one_ms[side].append(alone.decode_s / max(len(alone.steps), 1) * 1e3)
    batch.top2 = generate.top2 = ours
    kernels.move_slots_here = move_here
    for side in ("torch", "ops"):
        print(f"{side}: {args.rows} rows {statistics.median(batch_ms[side]):.2f} ms a step (verify + accept + "
              f"compact); one row {statistics.median(one_ms[side]):.2f} ms a step", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
