"""How fast could dart-ctx be with THIS head? A hindsight bound on its step policy (issue "context-aware DART").

dart-ctx decides each step between a copy-only step (verify the copy chain alone), a tree step (the
head's theta nodes + the copy on top, one head forward + search) and, in fallback, an AR step. This
replays the target's own greedy answers (AR, T=0, the auto dtype) and, at EVERY answer position j,
computes what each option would have had accepted there (greedy: the longest tree path the answer
follows) and what it costs on this machine: verify(nodes) from the cost curve at that context
(`cost.curve_at`) plus, for a tree step, the head forward + search time measured here. A dynamic
program over positions then finds the cheapest way through each answer:
  pld            prompt lookup (3-token suffix, 10 copied) every step
  copy-only      dart-ctx's copy chain alone every step
  tree theta     dart-ctx's tree step (head theta nodes + copy) every step, for each theta
  dart-ctx rule  its online choice between the two (ContextConfig.copy_only) at --rule-theta; and the
                 same rule with p corrected by the head's agreement with the copy's first token
  hindsight: copy or AR / copy or tree theta   the cheapest mix of those two, chosen with hindsight
  oracle         the cheapest mix of AR / copy-only / tree(theta for every theta) steps, chosen with
                 hindsight, step by step: no online rule can beat it with this head and copy rule
  oracle, exact copies  the same, with each copy chain cut to exactly what the answer keeps (a
                 clairvoyant chain length: looser still)
Speeds are decode only (no prefill), over AR priced by the same curve. The head sees every position
(its cache is fed one accepted token at a time, as a decode would have fed it; its drafts do not
depend on how earlier steps were grouped). Approximations: copy p is scored at every position
against the answer's future (more trials than a decode sees); tree verification in bf16 may part
from the answer at near-ties (ignored).
    python experiments/dart_ctx/copy_head_oracle.py --datasets copy_edit --num-prompts 20 --thetas 2,4,8,16
    python experiments/dart_ctx/copy_head_oracle.py --self-check   # the bound's pieces against brute force
    python experiments/dart_ctx/copy_head_oracle.py --smoke        # the whole bound on a tiny random target

main() returns the result JSON ({"command", "dtype", "datasets": {dataset: {..., "speed_vs_ar_decode_only"}}}),
or {"self_check": "passed"}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root (run by path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: tiny.py (the smallest mode)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # this script's folder: copy_headroom.py
import tiny  # noqa: E402
from copy_headroom import greedy_answers, kept  # noqa: E402

from dart_lab.config import BudgetConfig  # noqa: E402
from dart_lab.cost import curve_at, expected_copy_tokens, interpolate  # noqa: E402
from dart_lab.dart_ctx import ContextDrafter, MixedNGram  # noqa: E402
from dart_lab.drafters import copy_chain  # noqa: E402
from dart_lab.loading import load_target  # noqa: E402
from dart_lab.measure import cost_curve  # noqa: E402
from dart_lab.methods import MethodOptions, make_drafter, make_runner  # noqa: E402
from dart_lab.search import topk_levels, tree_search_with_paths  # noqa: E402


def tree_accepted(tree, future: list[int]) -> int:
    """Greedy acceptance (as `acceptance.greedy_accept`, with the answer as the target's argmax): the
    longest path from the root whose tokens the answer continues with."""
    toks, children = tree.tokens.tolist(), tree.children()
    node = a = 0
    for t in future:
        node = next((c for c in children[node] if toks[c] == t), None)
        if node is None:
            break
        a += 1
    return a


def options_at_positions(target, d: ContextDrafter, ctx: list[int], out: list[int], thetas: list[int]) -> list[dict]:
    """Per answer position j (root = out[j]): what each option keeps there and its nodes / ms."""
    full = ctx + out
    aux = target.prefill(torch.as_tensor(full), want_aux=True, all_logits=False).aux  # (T, 3H)
    d.begin(target, ctx + out[:1], aux[:len(ctx)])
    rows = []
    for j in range(len(out) - 1):
        ids = full[:len(ctx) + j + 1]
        fut = out[j + 1:]
        t0 = time.perf_counter()
        chain, p = d.offer_copy(ids)
        logits = d.draft_logits()
        logp, toks = topk_levels(logits, d.search.topk, d.vocab_map)
        t1 = time.perf_counter()
        d.local.sync(ids)
        ngram = MixedNGram(d.ngram, d.local, d.ctx.w_context)
        paths = d.copy_path(ids, ngram, chain, p)
        pld = copy_chain(ids, 3, 10)
        row = {"ctx": len(ids), "copy_len": len(chain), "copy_kept": kept(chain, fut), "head_ms": (t1 - t0) * 1e3,
               "pld_len": len(pld), "pld_kept": kept(pld, fut), "tree": {}, "p": float(p),
               "head_agrees": bool(chain) and int(toks[0, 0]) == chain[0],
               "bucket": d.last_copies[0][3] if chain else -1}
        for th in thetas:
            t2 = time.perf_counter()
            search = dataclasses.replace(d.search, max_nodes=th + len(chain))
            tree = tree_search_with_paths(logp, toks, ids, ngram, search, d.eos, paths)
            row["tree"][th] = (len(tree) - 1, tree_accepted(tree, fut), (time.perf_counter() - t2) * 1e3)
        d.score_copies(full)  # the copy against the answer's future (the trials behind p)
        d.observe(full[:len(ids) + 1], aux[len(ids) - 1:len(ids)])
        rows.append(row)
    return rows


def cheapest(rows, cost, options) -> float:
    """Minimum total ms to emit the answer after its first token, each step one of `options(row, curve)`
    -> [(advance, ms)] chosen with hindsight; dynamic program from the end."""
    n = len(rows)
    best = np.zeros(n + 1)
    for j in range(n - 1, -1, -1):
        best[j] = min(ms + best[min(j + adv, n)] for adv, ms in options(rows[j], curve_at(cost, rows[j]["ctx"])))
    return float(best[0])


def walk(rows, cost, choose) -> float:
    """Total ms of an online policy: `choose(row, curve)` -> (advance, ms) at each step it lands on."""
    j, ms = 0, 0.0
    while j < len(rows):
        adv, t = choose(rows[j], curve_at(cost, rows[j]["ctx"]))
        j, ms = j + adv, ms + t
    return ms


def self_check() -> dict:
    """The bound's two pieces against brute force (tests/test_experiments.py runs this):
    tree_accepted = the engine's greedy acceptance, and the hindsight program = the minimum over every
    sequence of steps, which no online walk beats."""
    import itertools

    from dart_lab.acceptance import greedy_accept
    from dart_lab.tree import Tree

    tree = Tree.from_paths(7, [[1, 2, 3], [1, 4], [5]])
    assert [tree_accepted(tree, f) for f in ([1, 4, 9], [1, 2, 3, 3], [5, 1], [9])] == [2, 3, 1, 0]
    assert tree_accepted(Tree.single(7), [1]) == 0
    for future in ([1, 4, 9], [1, 2, 3, 3], [5, 1], [9]):  # the answer as the target's argmax
        logits = torch.nn.functional.one_hot(torch.tensor([(future + [0] * 4)[d] for d in tree.depths.tolist()]),
                                             10).float()
        assert tree_accepted(tree, future) == len(greedy_accept(tree, logits)[0]) - 1
    rng = np.random.default_rng(0)
    cost = {"verify_ms": {1: 1.0}}  # no context growth: curve_at returns it as is
    for _ in range(30):
        n = int(rng.integers(1, 7))
        rows = [{"ctx": 10 + j, "opts": [(1, float(rng.uniform(1, 3)))] +
                 [(int(rng.integers(1, 4)), float(rng.uniform(1, 6))) for _ in range(2)]} for j in range(n)]

        def brute(j):
            return 0.0 if j >= n else min(ms + brute(j + adv) for adv, ms in rows[j]["opts"])
        best = cheapest(rows, cost, lambda r, c: r["opts"])
        assert np.isclose(best, brute(0))
        for pick in itertools.product(range(3), repeat=2):  # online rules that pick by position parity
            assert walk(rows, cost, lambda r, c, pick=pick: r["opts"][pick[r["ctx"] % 2]]) >= best - 1e-9
    print("self-check passed")
    return {"self_check": "passed"}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--self-check", action="store_true", help="check the bound's pieces on toy cases, then stop")
    ap.add_argument("--smoke", action="store_true", default=tiny.smoke_default(),
                    help="a tiny random target and head, 2 random prompts x 16 tokens, thetas 2,4 (the tests' mode)")
    ap.add_argument("--datasets", default="copy_edit")
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--thetas", default="2,4,8,16")
    ap.add_argument("--dart-head", default="", help="a DART head folder (default: the shipped head)")
    ap.add_argument("--rule-theta", type=int, default=4, help="theta of the online rule (one of --thetas)")
    ap.add_argument("--out", default="")
    ap.add_argument("--rows", default="", help="also write the per-position options here (JSON)")
    args = ap.parse_args(argv)
    if args.self_check:
        return self_check()
    if args.smoke:
        args.datasets, args.num_prompts, args.max_new_tokens, args.thetas, args.rule_theta = "random", 2, 16, "2,4", 4
    thetas = [int(t) for t in args.thetas.split(",")]
    if args.smoke:  # a small curve, not cached; random heads and n-gram table (no shipped ones for this target)
        target = tiny.tiny_target()
        cost = cost_curve(target, BudgetConfig(sizes=(1, 2, 4, 8, 16, 32), repeats=2, prompt_len=32,
                                               long_prompt_len=96), cache=False)
        opts, cache = MethodOptions(tree_nodes=str(max(thetas)), random_heads=True), {"ngram": tiny.ngram()}
    else:
        target = load_target("smollm2-135m")
        cost = cost_curve(target)
        opts, cache = MethodOptions(tree_nodes=str(max(thetas)), dart_head=args.dart_head), None
    ar = make_runner("ar", target)
    d = make_drafter("dart-ctx", target, opts, cache)
    res = {"command": "python experiments/dart_ctx/copy_head_oracle.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "dtype": str(target.dtype), "datasets": {}}
    for ds in args.datasets.split(","):
        answers = greedy_answers(target, ar, ds, args.num_prompts, args.max_new_tokens)
        per = [options_at_positions(target, d, ctx, out, thetas) for ctx, out in answers if len(out) > 1]
        head_ms = float(np.mean([r["head_ms"] for rows in per for r in rows[1:]]))  # [0] feeds the prompt
        search_ms = {th: float(np.mean([r["tree"][th][2] for rows in per for r in rows])) for th in thetas}

        v = interpolate

        def ar_opt(r, c):
            return [(1, v(c, 1))]

        def copy_opt(r, c, exact=False):
            return [(r["copy_kept"] + 1, v(c, (r["copy_kept"] if exact else r["copy_len"]) + 1))] if r["copy_len"] else []

        def tree_opt(th):
            return lambda r, c: [(r["tree"][th][1] + 1, v(c, r["tree"][th][0] + 1) + head_ms + search_ms[th])]

        def every(r, c, exact=False):
            return ar_opt(r, c) + copy_opt(r, c, exact) + sum((tree_opt(th)(r, c) for th in thetas), [])

        # dart-ctx's online rule (ContextConfig.copy_only) at theta = rule_theta, with g = the head's mean
        # gain over the copy in these very rows (the drafter learns it per request)
        th = args.rule_theta
        g = float(np.mean([r["tree"][th][1] - r["copy_kept"] for rows in per for r in rows if r["copy_len"]]))

        def rule(r, c):
            L = r["copy_len"]
            if L:
                e = expected_copy_tokens(r["p"], L)
                if e / v(c, L + 1) > (e + g) / (v(c, th + L + 1) + head_ms + search_ms[th]):
                    return copy_opt(r, c)[0]
            return tree_opt(th)(r, c)[0]
        # the same rule with p corrected by whether the head's top level-0 token is the copy's first
        # token (the head then runs before every step, so a copy-only step pays its forward too); the
        # correction per match-length bucket is fitted on these very rows (optimistic)
        rs = [r for rows in per for r in rows if r["copy_len"]]
        kept_rate = {}
        for b in {r["bucket"] for r in rs}:
            base = np.mean([r["copy_kept"] > 0 for r in rs if r["bucket"] == b])
            for a in (False, True):
                sub = [r["copy_kept"] > 0 for r in rs if r["bucket"] == b and r["head_agrees"] == a]
                kept_rate[b, a] = (float(np.mean(sub)) if sub else base, max(base, 1e-3))

        def informed(r, c):
            L = r["copy_len"]
            if L:
                now, base = kept_rate[r["bucket"], r["head_agrees"]]
                e = expected_copy_tokens(min(r["p"] * now / base, 0.99), L)
                if e / v(c, L + 1) > (e + g) / (v(c, th + L + 1) + head_ms + search_ms[th]):
                    adv, ms = copy_opt(r, c)[0]
                    return adv, ms + head_ms
            return tree_opt(th)(r, c)[0]
        first = lambda opts: (lambda r, c: opts(r, c)[0])
        online = {"pld": lambda r, c: (r["pld_kept"] + 1, v(c, r["pld_len"] + 1)),
                  "copy-only": lambda r, c: (copy_opt(r, c) or ar_opt(r, c))[0],
                  **{f"tree {t}": first(tree_opt(t)) for t in thetas},
                  f"dart-ctx rule (theta {th})": rule,
                  f"dart-ctx rule (theta {th}), p corrected by the head": informed}
        hindsight = {"hindsight: copy or AR": lambda r, c: ar_opt(r, c) + copy_opt(r, c),
                     f"hindsight: copy or tree {th}": lambda r, c: copy_opt(r, c) + tree_opt(th)(r, c),
                     "oracle": every,
                     "oracle, exact copies": lambda r, c: every(r, c, exact=True)}
        ar_ms = sum(walk(rows, cost, first(ar_opt)) for rows in per)
        speed = {name: round(ar_ms / sum(walk(rows, cost, f) for rows in per), 3) for name, f in online.items()}
        speed.update({name: round(ar_ms / sum(cheapest(rows, cost, f) for rows in per), 3) for name, f in hindsight.items()})
        res["datasets"][ds] = {"prompts": len(per), "positions": sum(map(len, per)), "head_ms": round(head_ms, 2),
                               "search_ms": {k: round(x, 2) for k, x in search_ms.items()},
                               "speed_vs_ar_decode_only": speed,
                               "rule_gain_g": round(g, 3),
                               "copy_first_kept_by_bucket_and_head_agreement": {
                                   f"n={b + 1}{'+' if b == max(kb for kb, _ in kept_rate) else ''}, head {'agrees' if a else 'differs'}":
                                   round(x[0], 3) for (b, a), x in sorted(kept_rate.items())},
                               "oracle_over_pld": round(speed["oracle"] / speed["pld"], 3),
                               "rule_over_pld": round(speed[f"dart-ctx rule (theta {th})"] / speed["pld"], 3)}
        print(ds, json.dumps(res["datasets"][ds]), flush=True)
        if args.rows:
            Path(args.rows).write_text(json.dumps(per))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
