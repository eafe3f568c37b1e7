"""Copy rules priced by this machine's verify cost (issue "context-aware DART"): which copy rule pays?

Replays the target's own greedy answers (AR, T=0) and, at every step, lets a copy-only rule propose a
chain, accepts its longest prefix that the answer continues with (+ the bonus token) and charges
verify(chain + 1) ms from the machine's measured cost curve (`budget.cost_curve`, cached). Speed over AR =
tokens per verify-ms x verify(1). No head, no search and no prefill: it isolates the copy rule itself
(decode only, so it reads higher than an end-to-end bench). Rules:
  pld               prompt lookup: 3-token suffix, 10 tokens copied
  copies, per request     dart-ctx's copy rule (p per match length, cut at p^depth >= 0.1), learned
                          from each request alone (ContextConfig.copy_history = 0)
  copies, with history    the same, each match length's reliability carried over from earlier requests
  + other occurrence      and a 2-token copy from the best earlier occurrence with another first token
  + skip one              and a 2-token copy that assumes the last token replaced one of the text's
                          (match the suffix before it, continue one token further on)
  copies, substituting    the copy rule with the request's learned one-token substitutions (a copy
                          token A the answer replaced by B, the copy going on right after): the suffix
                          is matched with B read as A and the chain written with A as B -- for "rewrite
                          with clearer names", if the target renamed consistently
The extra copies form a small tree with the first (the best of them counts; every node is paid for).
The rules run on the library's own code (`drafters.copy_match`, `ContextDrafter`'s copy bookkeeping).
    python experiments/dart_ctx/copy_replay_speed.py --datasets copy_edit,mt_bench --num-prompts 10
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from copy_headroom import copy_alternatives, greedy_answers, kept  # reproduce/ (the script's folder)

from dart_lab.budget import cost_curve, interpolate
from dart_lab.dart_ctx import ContextConfig, ContextDrafter
from dart_lab.drafters import copy_chain, copy_match
from dart_lab.loading import load_target
from dart_lab.methods import make_runner, random_head


def replay(answers, propose, curve, extra=None) -> dict:
    """propose(ids, new_request) -> chain; extra(ids, chain) -> more chains (a tree with the first).
    Returns tau and the speed over AR of decoding `answers` with it."""
    steps = toks = ms = 0.0
    for ctx, out in answers:
        propose(None, ctx)  # a new request
        j = 0
        while j < len(out):
            ids = ctx + out[:j]
            chains = [propose(ids, None)]
            chains += extra(ids, chains[0]) if extra else []
            a = max(kept(c, out[j:]) for c in chains)
            j += a + 1
            steps, toks, ms = steps + 1, toks + a + 1, ms + interpolate(curve, 1 + sum(map(len, chains)))
    return {"tau": round(toks / steps, 3), "speed_vs_ar": round(toks / ms * interpolate(curve, 1), 3)}


def other_occurrence(ids, chain, length=2):
    return [c[:length] for c in copy_alternatives(ids, length) if not chain or c[0] != chain[0]][:1]


def skip_one(ids, chain, length=2, max_ngram=4):
    """The text's continuation one token past the best match of the suffix before the last token."""
    c = copy_match(ids[:-1], max_ngram, length + 1)[0][1:]
    return [c] if c and (not chain or c[0] != chain[0]) else []


def context_rule(target, history: int):
    """dart-ctx's copy rule, driven through ContextDrafter's own bookkeeping (its head is never run)."""
    d = ContextDrafter(random_head(target, "dart"), None, ctx=ContextConfig(copy_history=history))

    def propose(ids, new_request):
        if new_request is not None:
            d.begin_copies(new_request)
            return []
        d.score_copies(ids)  # the last copy against the tokens committed since
        chain, n, _ = d.copy_candidate(ids)
        d.last_copies = [(len(ids), [], chain, d.match_bucket(n))] if chain else []
        return chain
    return propose


def substituting_rule(target, history: int):
    """`context_rule` with one-token substitutions learned from this request (see the module docstring):
    A -> B once the answer put B where a copy proposed A and then went on with the copy's next token."""
    d = ContextDrafter(random_head(target, "dart"), None, ctx=ContextConfig(copy_history=history))
    st = {"subst": {}, "last": None, "pending": []}

    def propose(ids, new_request):
        if new_request is not None:
            d.begin_copies(new_request)
            st.update(subst={}, last=None, pending=[])
            return []
        subst = st["subst"]
        if st["last"]:  # the first mismatch of the last copy: a candidate A -> B, confirmed by the next token
            at, src, written = st["last"]
            for i, (c, t) in enumerate(zip(written, ids[at:])):
                if c != t:
                    if i + 1 < len(src):
                        st["pending"].append((at + i, src[i], t, src[i + 1]))
                    break
        waiting = []
        for pos, a, b, nxt in st["pending"]:
            if len(ids) <= pos + 1:
                waiting.append((pos, a, b, nxt))
            elif ids[pos + 1] == nxt and a != b and b not in subst.values():
                subst[a] = b
        st["pending"] = waiting
        d.score_copies(ids)
        back = {b: a for a, b in subst.items()}
        chain, n, _ = d.copy_candidate([back.get(x, x) for x in ids])
        written = [subst.get(x, x) for x in chain]
        d.last_copies = [(len(ids), [], written, d.match_bucket(n))] if written else []
        st["last"] = (len(ids), chain, written) if chain else None
        return written
    return propose


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", default="copy_edit,mt_bench")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    target = load_target("smollm2-135m")
    curve = cost_curve(target)["verify_ms"]
    ar = make_runner("ar", target)
    res = {"command": "python experiments/dart_ctx/copy_replay_speed.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "dtype": str(target.dtype), "verify_ms": curve, "datasets": {}}
    for ds in args.datasets.split(","):
        answers = greedy_answers(target, ar, ds, args.num_prompts, args.max_new_tokens)
        hist = ContextConfig().copy_history
        rules = {"pld": lambda ids, new: [] if new is not None else copy_chain(ids, 3, 10),
                 "copies, per request": context_rule(target, 0),
                 "copies, with history": context_rule(target, hist),
                 "copies, substituting": substituting_rule(target, hist)}
        res["datasets"][ds] = {name: replay(answers, rule, curve) for name, rule in rules.items()}
        for name, extra in (("+ other occurrence", other_occurrence), ("+ skip one", skip_one)):
            res["datasets"][ds][name] = replay(answers, context_rule(target, hist), curve, extra)
        print(ds, res["datasets"][ds], flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
