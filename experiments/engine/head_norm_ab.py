"""Is the DART head's forward cheaper with its RMSNorms on our one-pass op (`dart_lab::rms_norm`, without
gradients on fp32 CPU tensors) than on torch's `F.rms_norm` + weight? The shipped head on the embedded target
(`--dtype`, default auto), a theta-4 budget after one HumanEval prompt, the two sides alternating forward by
forward in one process (`kernels.rms_norm_here` patched off for the torch side); median ms of one draft forward.

    python experiments/engine/head_norm_ab.py [--rounds 30] [--dtype auto]
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
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_runner  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    target = load_target("smollm2-135m", dtype=args.dtype)
    d = make_runner("dart", target).drafter
    d.set_budget(4)
    prompt = target.encode_prompt(load_prompts("humaneval", 1)[0]["prompt"])
    out = target.prefill(prompt, want_aux=True, all_logits=False)
    ids = prompt.tolist() + [int(out.logits[-1].argmax())]
    d.begin(target, ids, out.aux)
    ours, ms = kernels.rms_norm_here, {"torch": [], "ours": []}
    with torch.no_grad():
        for r in range(args.rounds):
            for side in (("ours", "torch") if r % 2 else ("torch", "ours")):
                kernels.rms_norm_here = ours if side == "ours" else (lambda: False)
                t0 = time.perf_counter()
                d.draft_logits()
                if r >= 4:  # the first rounds warm up
                    ms[side].append((time.perf_counter() - t0) * 1e3)
                ids = ids + [ids[-1]]
                d.observe(ids, out.aux[-1:])
    kernels.rms_norm_here = ours
    print(f"draft forward (theta 4): torch norms {statistics.median(ms['torch']):.3f} ms, ours "
          f"{statistics.median(ms['ours']):.3f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
