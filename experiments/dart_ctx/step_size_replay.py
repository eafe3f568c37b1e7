"""Would a tree size chosen per STEP (from the head's own confidence) beat the one theta per generation?

Decodes prompts at T=0 with the `dart` drafter at the widest budget (63 nodes) and records, at every
step, each drafted node in rank order with its path's draft probability (the product of the head's
per-level probabilities along the path, `SearchNodes.draft_logp`) and whether the target accepted it.
Because the tree of a budget k is exactly the nodes of rank < k, any per-step rule can be replayed
exactly on these records: tokens = 1 + accepted nodes of rank < k, cost = verify(k + 1) + drafting and
search, from this machine's measured cost curve.
  fixed theta     the best single theta in hindsight (what the runner's budget aims at)
  per step        k = argmax_k (1 + sum_{r<k} c(node r)) / (verify(k + 1) + overhead), with
                  c = acceptance rate by path-probability bin, calibrated on the OTHER dataset
                  (nodes beyond --cap are never drafted; both rules pay --overhead-ms per tree step)
    python experiments/dart_ctx/step_size_replay.py --datasets mt_bench,alpaca --num-prompts 8 --max-new-tokens 96
    python experiments/dart_ctx/step_size_replay.py --replay reproduce/results/local/step_size_replay.json --cap 8
The records (~0.8 MB) go to reproduce/results/local/ (outside git); --replay re-analyses them.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from dart_lab.budget import acceptance_profile, cost_curve, interpolate
from dart_lab.data import load_prompts
from dart_lab.generate import GenerationConfig, generate
from dart_lab.loading import load_target
from dart_lab.methods import make_drafter
from dart_lab.search import search_nodes, topk_levels

BINS = np.arange(-12.0, 0.01, 0.5)  # log path probability bins


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datasets", default="mt_bench,alpaca")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--overhead-ms", type=float, default=3.5, help="drafting + search ms per tree step")
    ap.add_argument("--cap", type=int, default=8, help="widest tree either rule may verify (drafted nodes)")
    ap.add_argument("--out", default="reproduce/results/local/step_size_replay.json")
    ap.add_argument("--replay", help="analyse saved records instead of decoding")
    a = ap.parse_args()
    if a.replay:
        d = json.loads(Path(a.replay).read_text())
        analyse(d["data"], {int(k): v for k, v in d["verify_ms"].items()}, a.overhead_ms, a.cap)
        return
    target = load_target("smollm2-135m")
    curve = cost_curve(target)["verify_ms"]
    drafter = make_drafter("dart", target)
    drafter.set_budget(63)
    ranked = []  # per step of the current prompt: the path log-probs of its nodes in rank order

    def propose(ids):  # DartDrafter.propose, keeping what the search knows about each node
        logp, toks = topk_levels(drafter.draft_logits(), drafter.search.topk, drafter.vocab_map)
        sn = search_nodes(logp, toks, ids, drafter.ngram, drafter.search, drafter.eos)
        par = sn.tree.parents.numpy()
        path_lp = np.zeros(len(sn.tree))
        for i in range(1, len(sn.tree)):  # parents come first
            path_lp[i] = path_lp[par[i]] + sn.draft_logp[i]
        ranked.append(path_lp[np.argsort(sn.tree.ranks.numpy()[1:]) + 1].tolist())
        drafter.last_timing = {"draft_ms": 0.0, "search_ms": 0.0}
        return sn.tree

    drafter.propose = propose
    data = {}
    for ds in a.datasets.split(","):
        data[ds] = []
        for p in load_prompts(ds, a.num_prompts):
            ranked.clear()
            res = generate(target, target.encode_prompt(p["prompt"]), drafter,
                           GenerationConfig(max_new_tokens=a.max_new_tokens))
            data[ds] += [{"lp": lp, "acc": s.get("path_ranks", [])} for s, lp in zip(res.steps, ranked)]
            print(ds, p["id"], len(res.steps), "steps, tau", round(len(res.tokens) / max(1, len(res.steps)), 2), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"verify_ms": curve, "data": data}))
    analyse(data, curve, a.overhead_ms, a.cap)


def calibrate(recs) -> np.ndarray:
    hit, tot = np.zeros(len(BINS) + 1), np.zeros(len(BINS) + 1)
    for r in recs:
        acc = set(r["acc"])
        b = np.digitize(r["lp"], BINS)
        for k, bb in enumerate(b):
            tot[bb] += 1
            hit[bb] += k in acc
    return hit / np.maximum(tot, 1)


def analyse(data, curve, overhead, cap) -> None:
    ver = np.array([interpolate(curve, n) for n in range(1, cap + 2)])  # ver[k] = verify(k + 1)
    paid = np.where(np.arange(cap + 1) > 0, overhead, 0.0)  # a step of k = 0 is a plain AR step
    ar = 1.0 / ver[0]
    for ds, recs in data.items():
        c = calibrate([r for d, rs in data.items() if d != ds for r in rs] or recs)
        tau = acceptance_profile([{"path_ranks": r["acc"]} for r in recs], cap)  # tau(theta), theta = 0..cap
        fixed = [tau[th] / (ver[th] + paid[th]) / ar for th in range(cap + 1)]
        best_th = int(np.argmax(fixed))
        tok = ms = 0.0
        ks = []
        for r in recs:
            e = 1.0 + np.concatenate([[0.0], np.cumsum(c[np.digitize(r["lp"][:cap], BINS)])])  # E[tokens], k = 0..cap
            k = int(np.argmax(e / (ver[:len(e)] + paid[:len(e)])))
            ks.append(k)
            tok += 1 + sum(1 for x in r["acc"] if x < k)
            ms += ver[k] + paid[k]
        print(f"{ds}: steps {len(recs)}; best fixed theta {best_th} (in hindsight): {fixed[best_th]:.3f}x AR; "
              f"per-step k (mean {statistics.fmean(ks):.2f}, k = 0 on {np.mean(np.array(ks) == 0):.2f}): "
              f"{tok / ms / ar:.3f}x AR (decode only)")


if __name__ == "__main__":
    main()
