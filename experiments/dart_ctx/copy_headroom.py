"""How many tokens per step could copying give? (issue "context-aware DART", the copy-heavy target)

Replays the target's own greedy answers (AR, T=0, bf16) and, at every answer position, asks what a
drafting policy would have had accepted, stepping on by that + the bonus token -- tau with no cost
attached, so it bounds what a policy can reach, not how fast it runs. Policies:
  copy            the copy dart-ctx proposes (`copy_match`: suffix up to 8 tokens, 16 deep, periodic)
  copy + k alt    and k more copies from other earlier occurrences with a different first token, each
                  `alt_len` tokens deep (a small tree of copies), the best one counting
  head oracle     the copy, and where its first token is wrong, one head token that is always right
  branch oracle   the same, and the copy that follows ids + [that token] (dart-ctx's branch idea)
    python experiments/dart_ctx/copy_headroom.py --datasets copy_edit,mt_bench --num-prompts 10 [--out headroom.json]
    python experiments/dart_ctx/copy_headroom.py --smoke     # a tiny random target's answers to random prompts

main() returns {"command", "tau": {dataset: {policy: tau}}} (in the smallest mode one "dataset", `random`).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
import tiny  # noqa: E402

from dart_lab.config import GenerationConfig  # noqa: E402
from dart_lab.data import load_prompts  # noqa: E402
from dart_lab.drafters import copy_match  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.methods import make_runner  # noqa: E402


def kept(chain, future) -> int:
    k = 0
    for c, t in zip(chain, future):
        if c != t:
            break
        k += 1
    return k


def copy_alternatives(ctx: list[int], length: int, max_ngram: int = 8) -> list[tuple[int, ...]]:
    """Continuations of every earlier occurrence of the last token, longest suffix match first, then
    the most recent; one per distinct continuation."""
    a = np.asarray(ctx)
    found: dict[tuple[int, ...], int] = {}
    for e in np.flatnonzero(a[:-1] == a[-1])[::-1]:
        n = 1
        while n < max_ngram and e - n >= 0 and a[e - n] == a[a.size - 1 - n]:
            n += 1
        c = tuple(a[e + 1:e + 1 + length].tolist())
        if c and c not in found:
            found[c] = n
    return sorted(found, key=lambda c: -found[c])


def policies(alt_len: int):
    def copy(ctx, fut):
        return kept(copy_match(ctx, 8, 16, True)[0], fut)

    def alts(k):
        def f(ctx, fut):
            main = copy_match(ctx, 8, 16, True)[0]
            others = [c for c in copy_alternatives(ctx, alt_len) if not main or c[0] != main[0]][:k]
            return max([kept(main, fut)] + [kept(c, fut) for c in others])
        return f

    def oracle(branch):
        def f(ctx, fut):
            a = kept(copy_match(ctx, 8, 16, True)[0], fut)
            if a or len(fut) < 2:
                return a
            return 1 + (kept(copy_match(ctx + [fut[0]], 8, 15, True)[0], fut[1:]) if branch else 0)
        return f

    return {"copy": copy, "copy + 1 alt": alts(1), "copy + 2 alt": alts(2),
            "head oracle": oracle(False), "branch oracle": oracle(True)}


def greedy_answers(target, ar, dataset: str, num_prompts: int, max_new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy answer) for the first `num_prompts` prompts of `dataset`; dataset
    "random": `tiny.prompts` (the smallest mode's target has no tokenizer), decoded past EOS."""
    if dataset == "random":
        ids_list, cfg = tiny.prompts(num_prompts, target.vocab_size), GenerationConfig(max_new_tokens=max_new_tokens,
                                                                                        stop_on_eos=False)
    else:
        ids_list = [target.encode_prompt(p["prompt"]) for p in load_prompts(dataset, num_prompts)]
        cfg = GenerationConfig(max_new_tokens=max_new_tokens)
    return [(ids.tolist(), ar.generate(ids, cfg).tokens) for ids in ids_list]


def replay(answers, policy) -> float:
    steps = toks = 0
    for ctx, out in answers:
        j = 0
        while j < len(out):
            a = policy(ctx + out[:j], out[j:])
            j += a + 1
            steps += 1
            toks += a + 1
    return toks / steps


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="copy_edit,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--alt-len", type=int, default=4)
    ap.add_argument("--out", default="", help="also write the JSON here")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target, 3 random prompts x 24 tokens (the tests' mode)")
    args = ap.parse_args(argv)
    if args.smoke:
        target, args.datasets, args.num_prompts, args.max_new_tokens = tiny.tiny_target(), "random", 3, 24
    else:
        target = load_target("smollm2-135m")
    ar = make_runner("ar", target)
    res = {"command": "python experiments/dart_ctx/copy_headroom.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"), "tau": {}}
    for ds in args.datasets.split(","):
        answers = greedy_answers(target, ar, ds, args.num_prompts, args.max_new_tokens)
        res["tau"][ds] = {name: round(replay(answers, f), 3) for name, f in policies(args.alt_len).items()}
        print(ds, res["tau"][ds])
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
