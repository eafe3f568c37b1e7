"""Is a batch's prefill cheaper with its prompts packed end to end into one forward (`BatchTarget`'s
`pack_tokens`: the linears see every prompt's tokens at once, attention stays per prompt) than prompt by
prompt? And does the MLP's bf16 -> bf16 silu * up (`dart_lab::silu_mul_bf16`, where gate|up and down both take
their bf16 copies) beat widening to fp32 between them ("packed, fp32 mlp": `fast_llama._bf16_mlp` patched to
decline)? And does the prompt's rotation as one op (`dart_lab::rope_heads`, "packed, torch rotation": the torch ops
it replaces, `kernels.turned_off("rope")`) help? The 4-bit embedded target (or `--dtype`), the first B HumanEval
prompts through the chat template; the settings alternate in one process, each round one whole prefill of the B
prompts; the median ms over rounds, and how far the last tokens' logits lie from the first setting's.

    python experiments/engine/prefill_pack_ab.py [--rows 8] [--rounds 7] [--dtype int4]
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
from dart_lab import fast_llama, kernels  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="int4")
    args = ap.parse_args(argv)
    t = load_target("smollm2-135m", dtype=args.dtype)
    for B in (int(x) for x in args.rows.split(",")):
        prompts = [t.encode_prompt(p["prompt"]) for p in load_prompts("humaneval", B)]
        sides = (("alone", 1, True), ("packed", 2048, True), ("packed, fp32 mlp", 2048, False),
                 ("packed, torch rotation", 2048, True))
        times, outs, bf16_mlp = {n: [] for n, _, _ in sides}, {}, fast_llama._bf16_mlp
        for r in range(args.rounds + 1):
            for name, pack, mlp in sides:
                fast_llama._bf16_mlp = bf16_mlp if mlp else (lambda *a: None)
                bt = BatchTarget(t, pack_tokens=pack)
                t0 = time.perf_counter()
                with kernels.turned_off(*(("rope",) if "torch rotation" in name else ())):
                    out = bt.prefill(prompts)
                if r:  # round 0 warms up
                    times[name].append((time.perf_counter() - t0) * 1e3)
                outs[name] = torch.cat(out.logits)
        fast_llama._bf16_mlp = bf16_mlp
        ms = {n: statistics.median(v) for n, v in times.items()}
        first = outs["alone"]
        print(f"{B} prompts ({sum(x.numel() for x in prompts)} tokens), median ms: " + "; ".join(
            f"{n} {ms[n]:.1f} ({ms['alone'] / ms[n]:.2f}x, logits max |diff| {(outs[n] - first).abs().max():.2e}, "
            f"argmax equal {bool((outs[n].argmax(-1) == first.argmax(-1)).all())})" for n in ms), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
