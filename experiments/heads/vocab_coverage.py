"""How much of what the target says can a draft vocabulary of size K draft at all? (issue: draft
vocabulary). A token outside the draft vocabulary can never be drafted: acceptance ends there.

Counts assistant-token frequencies in a feature cache (ShareGPT answers, the training data), takes the
K most frequent as the draft vocabulary (as `dart-lab train` does), and measures the share of the
target's greedy tokens (T=0, the first N prompts x M new tokens of each benchmark dataset) that fall
outside it, for several K.
    python experiments/heads/vocab_coverage.py --features runs/features --num-prompts 10 --max-new-tokens 128
"""
import argparse
import json
from pathlib import Path

import torch

from dart_lab import GenerationConfig, generate, load_target
from dart_lab.data import load_prompts
from dart_lab.features import FeatureDataset
from dart_lab.train import token_ranks

SIZES = (4096, 8192, 16384, 24576, 32768)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", required=True)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="reproduce/results/2026-11-30_epyc-2c_vocab-coverage/vocab_coverage.json")
    a = ap.parse_args()
    target = load_target("smollm2-135m")
    ds = FeatureDataset(Path(a.features) / "train")
    rank = token_ranks(ds, target.vocab_size, always=sorted(target.eos_ids))  # as `dart-lab train` picks
    out = {"features": str(a.features), "train_conversations": len(ds), "num_prompts": a.num_prompts,
           "max_new_tokens": a.max_new_tokens, "dtype": str(target.dtype), "outside_share": {}}
    for name in ("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca"):
        toks = []
        for p in load_prompts(name, a.num_prompts):
            res = generate(target, target.encode_prompt(p["prompt"]), None,
                           GenerationConfig(max_new_tokens=a.max_new_tokens))
            toks += res.tokens
        r = rank[torch.tensor(toks)]
        out["outside_share"][name] = {str(k): round((r >= k).float().mean().item(), 4) for k in SIZES}
        out["outside_share"][name]["tokens"] = len(toks)
        print(name, out["outside_share"][name], flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
