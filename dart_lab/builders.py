"""Tree builders over one DART head's per-level logits, beyond the paper: the same forward, other ways to spend a
budget of theta drafted nodes. Each is a pure function of (level logits, context, theta) returning a `Tree` whose
`ranks` are the order it took its nodes, so the tree of any smaller budget is its first nodes (what the tree budget
reads tau(theta) from, `cost.acceptance_profile`).

- "dart": the released search (paper Sec. 3.2, Algorithm 1; `search.tree_search`): a beam over levels scored by the
  head's top-k log-probabilities and the 3-gram, then the best theta nodes.
- "best-first": DDTree's Algorithm 1 (arXiv 2604.12989): the theta most probable prefixes under the head's
  per-level marginals, p(x_1..x_d) = prod_l p_l(x_l) (full-vocabulary softmax, no n-gram), taken best first from a
  heap that holds, for each taken node, its next sibling by rank and its first child. Ties go to the smaller rank
  tuple, as DDTree's heap breaks them. A prefix's weight is summed along its path (DDTree updates a sibling's by
  subtracting one level's term and adding the next: the same weight up to rounding).
- "best-first-ngram": the released path score (its top-k log-probabilities, level weights and the 3-gram term)
  taken best first over every top-k path instead of through a beam of 20. The score never rises along a path (each
  term is a log of at most 1 times a non-negative weight), so the theta best paths are ancestor-closed.
- "chain": the top-1 token of each level, theta levels deep (DFlash's single draft).
"""
from __future__ import annotations

import heapq

import numpy as np
import torch

from .errors import DartLabError
from .search import TreeSearchConfig, log32, topk_levels, tree_search
from .tree import Tree

BUILDERS = ("dart", "best-first", "best-first-ngram", "chain")


def build(name: str, logits: torch.Tensor, context: list[int], theta: int, ngram=None,
          cfg: TreeSearchConfig = TreeSearchConfig(), draft_to_target: torch.Tensor | None = None,
          eos_ids=frozenset()) -> Tree:
    """The tree builder `name` over `logits` (D, Vd) (the head's levels), rooted at context[-1], theta drafted
    nodes at most. draft_to_target maps draft-vocabulary ids to the target's."""
    if name == "dart":
        import dataclasses

        logp, toks = topk_levels(logits, cfg.topk, draft_to_target)
        return tree_search(logp, toks, context, ngram, dataclasses.replace(cfg, max_nodes=theta), eos_ids)
    if name == "best-first":
        return best_first(logits, context[-1], theta, draft_to_target)
    if name == "best-first-ngram":
        logp, toks = topk_levels(logits, cfg.topk, draft_to_target)
        return best_first_scored(logp, toks, context, theta, ngram, cfg, eos_ids)
    if name == "chain":
        return chain(logits, context[-1], theta, draft_to_target)
    raise DartLabError(f"unknown tree builder {name!r}: one of {', '.join(BUILDERS)}")


def _tree(root: int, tokens: list[int], parents: list[int]) -> Tree:
    """Nodes in the order taken (rank) -> a `Tree` (parents come first: a node is taken after its parent)."""
    n = len(tokens)
    return Tree(torch.tensor([root] + tokens), torch.tensor([-1] + parents),
                ranks=torch.tensor([-1] + list(range(n))))


def best_first(logits: torch.Tensor, root: int, theta: int, draft_to_target: torch.Tensor | None = None) -> Tree:
    """DDTree's best-first tree (module docstring)."""
    D = logits.shape[0]
    if theta <= 0 or D == 0:
        return Tree.single(root)
    lp = torch.log_softmax(logits.float(), dim=-1)
    k = min(theta, lp.shape[-1])
    vals, idx = _ranked(lp, k)  # rank r of level l: the r-th likeliest token (ties: the smaller id)
    vals = vals.double().tolist()
    if draft_to_target is not None:
        idx = draft_to_target[idx]
    idx = idx.tolist()
    heap = [(-vals[0][0], (0,), 0, 0.0)]  # (-weight, ranks, parent node, the parent's weight)
    tokens, parents = [], []
    while heap and len(tokens) < theta:
        neg_w, ranks, parent, base = heapq.heappop(heap)
        depth, rank = len(ranks), ranks[-1]
        tokens.append(idx[depth - 1][rank])
        parents.append(parent)
        me = len(tokens)  # this node's index in the tree (root 0)
        if rank + 1 < k:  # its next sibling
            heapq.heappush(heap, (-(base + vals[depth - 1][rank + 1]), ranks[:-1] + (rank + 1,), parent, base))
        if depth < D:  # its first child
            heapq.heappush(heap, (-(-neg_w + vals[depth][0]), ranks + (0,), me, -neg_w))
    return _tree(root, tokens, parents)


def _ranked(lp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each level (D, V) by (value desc, id asc) and their values: every token tied with
    the k-th is a candidate, so ties at the cut go to the smaller id as a full stable sort would give them, without
    sorting the vocabulary."""
    kth = torch.topk(lp, k, dim=-1).values[:, -1:]
    vals, idx = [], []
    for row, cut in zip(lp, kth):
        cand = torch.nonzero(row >= cut).flatten()  # ascending ids
        order = torch.sort(row[cand], descending=True, stable=True).indices[:k]
        vals.append(row[cand][order])
        idx.append(cand[order])
    return torch.stack(vals), torch.stack(idx)


def best_first_scored(logp: np.ndarray, tokens: np.ndarray, context: list[int], theta: int, ngram,
                      cfg: TreeSearchConfig, eos_ids=frozenset()) -> Tree:
    """The released path score taken best first (module docstring). logp, tokens (D, K) as `topk_levels` gives
    them; each node's K children are scored when it is taken and pushed one at a time, best first. An EOS node
    is not expanded (as the released search does not expand it)."""
    D, K = logp.shape
    if theta <= 0 or D == 0:
        return Tree.single(context[-1])
    f32 = np.float32
    use_ng = ngram is not None and cfg.w_ngram != 0.0
    prev2 = context[-2] if len(context) >= 2 else -1

    def children(depth: int, score: float, a: int, b: int) -> list[tuple[float, int]]:
        """(score, top-k rank) of a node's children at level `depth`, best first (ties: the smaller rank)."""
        inc = logp[depth].astype(f32) * f32(cfg.logit_decay ** depth)
        if use_ng and (depth > 0 or cfg.ngram_at_level0):
            p = ngram.prob(np.array([[a, b]], dtype=np.int64), tokens[depth][None].astype(np.int64))[0].astype(f32)
            inc = inc + log32(p + f32(cfg.eps)) * f32(cfg.w_ngram)
        s = f32(score) + f32((depth + 1) ** -cfg.level_exponent) * inc
        order = sorted(range(K), key=lambda r: (-float(s[r]), r))
        return [(float(s[r]), r) for r in order]

    out_tok, out_par = [], []
    first = children(0, 0.0, prev2, context[-1])
    counter = 0  # heap order among equal scores: first pushed, first taken
    heap = [(-first[0][0], counter, 0, 0, first, 0, prev2, context[-1])]  # (-score, n, depth, parent, siblings, i, a, b)
    while heap and len(out_tok) < theta:
        neg, _, depth, parent, sibs, i, a, b = heapq.heappop(heap)
        tok = int(tokens[depth][sibs[i][1]])
        out_tok.append(tok)
        out_par.append(parent)
        me = len(out_tok)
        if i + 1 < K:
            counter += 1
            heapq.heappush(heap, (-sibs[i + 1][0], counter, depth, parent, sibs, i + 1, a, b))
        if depth + 1 < D and tok not in eos_ids:
            kids = children(depth + 1, -neg, b, tok)
            counter += 1
            heapq.heappush(heap, (-kids[0][0], counter, depth + 1, me, kids, 0, b, tok))
    return _tree(context[-1], out_tok, out_par)


def chain(logits: torch.Tensor, root: int, theta: int, draft_to_target: torch.Tensor | None = None) -> Tree:
    """The top-1 token of each of the first theta levels, one path (DFlash's draft)."""
    n = min(theta, logits.shape[0])
    if n <= 0:
        return Tree.single(root)
    idx = logits[:n].float().argmax(-1)
    if draft_to_target is not None:
        idx = draft_to_target[idx]
    return _tree(root, idx.tolist(), list(range(n)))
