"""How much of what the target says can a draft vocabulary of size K draft at all? (issue: draft
vocabulary). A token outside the draft vocabulary can never be drafted: acceptance ends there.

Counts assistant-token frequencies in a feature cache (ShareGPT answers, the training data), takes the
K most frequent as the draft vocabulary (as `dart-lab train` does), and measures the share of the
target's greedy tokens (T=0, the first N prompts x M new tokens of each benchmark dataset) that fall
outside it, for several K.
    python experiments/heads/vocab_coverage.py --features runs/features --num-prompts 10 --max-new-tokens 128
    python experiments/heads/vocab_coverage.py --smoke    # a tiny random target, a feature cache written for it

main() returns {"features", "train_conversations", ..., "outside_share": {dataset: {K: share, "tokens": n}}}.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab import GenerationConfig, generate, load_target  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.features import FeatureDataset, write_features  # noqa: E402
from dart_lab.losses import token_ranks  # noqa: E402

SIZES = (4096, 8192, 16384, 24576, 32768)
DATASETS = ("mt_bench", "humaneval", "gsm8k", "code_alpaca", "alpaca")
OUT = "reproduce/results/2026-11-30_epyc-2c_vocab-coverage/vocab_coverage.json"


def smoke_features(target, folder: Path, n: int = 8) -> Path:
    """A feature cache for the tiny target: its greedy answers to random prompts as the assistant tokens."""
    examples = []
    for i, p in enumerate(tiny.prompts(n, target.vocab_size, seed=1)):
        out = generate(target, p, None, GenerationConfig(max_new_tokens=24, stop_on_eos=False)).tokens
        examples.append((f"smoke-{i}", p.tolist() + out, [False] * len(p) + [True] * len(out)))
    write_features(target, examples, folder, len(examples), dtype=torch.float32, progress=False)
    return folder


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--features", default="", help="a feature cache folder (`dart-lab features`); required unless --smoke")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None, help="write the JSON here (default: the stored run's file; --smoke: none)")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target, 3 random prompts x 16 tokens, K = 16-128 (the tests' mode)")
    a = ap.parse_args(argv)
    if not a.smoke and not a.features:
        ap.error("--features is required (or --smoke)")
    with tempfile.TemporaryDirectory() as tmp:
        if a.smoke:
            target, sizes, datasets = tiny.tiny_target(), (16, 32, 64, 128), ("random",)
            a.features, a.num_prompts, a.max_new_tokens = str(smoke_features(target, Path(tmp))), 3, 16
        else:
            target, sizes, datasets = load_target("smollm2-135m"), SIZES, DATASETS
        ds = FeatureDataset(Path(a.features) / "train")
        rank = token_ranks(ds, target.vocab_size, always=sorted(target.eos_ids))  # as `dart-lab train` picks
    out = {"features": "(smoke)" if a.smoke else str(a.features), "train_conversations": len(ds),
           "num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens, "dtype": str(target.dtype),
           "outside_share": {}}
    for name in datasets:
        toks = []
        prompts = (tiny.prompts(a.num_prompts, target.vocab_size) if name == "random" else
                   [target.encode_prompt(p["prompt"]) for p in load_prompts(name, a.num_prompts)])
        for ids in prompts:
            res = generate(target, ids, None, GenerationConfig(max_new_tokens=a.max_new_tokens, stop_on_eos=not a.smoke))
            toks += res.tokens
        r = rank[torch.tensor(toks)]
        out["outside_share"][name] = {str(k): round((r >= k).float().mean().item(), 4) for k in sizes}
        out["outside_share"][name]["tokens"] = len(toks)
        print(name, out["outside_share"][name], flush=True)
    if a.out is None and not a.smoke:
        a.out = OUT
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
