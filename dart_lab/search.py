"""N-gram-guided tree search over parallel draft logits (paper section 3.2, Algorithm 1).

The draft head gives, in one forward, a distribution for each future level l = 0..D-1, independent
of which tokens are chosen at earlier levels. The search turns these per-level distributions into a
tree of likely continuations:

    level l: top-k (25) tokens of the level-l logits, log p = log softmax over those k only
    score(child) = score(parent) + w_level(l) * (w_logit(l) * log(p + eps) + w_ng * log(p_ngram + eps))
        w_logit(l) = 0.9**l,  w_level(l) = (l+1)**-0.7,  w_ng = 0.5,  no n-gram term at level 0
        p_ngram = 3-gram probability of the token after the last two tokens of (context + path)
    beam: the 20 best partial paths survive each level (paths ending in EOS ranked after all others
        and never expanded); each survivor is expanded with the same k tokens of the next level
    tree: the best `max_nodes` (60) beam survivors over all levels, taken in order of
        (score desc, depth asc). Scores never increase along a path, so a parent always precedes
        its children in that order; a node is only taken once its parent is, which makes the tree
        ancestor-closed even with ties.

Deterministic: ties are broken by candidate index (stable sorts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .tree import Tree


@dataclass(frozen=True)
class TreeSearchConfig:
    topk: int = 25
    beam_width: int = 20
    max_nodes: int = 60  # draft nodes kept, root excluded (the released code's 60)
    w_ngram: float = 0.5
    logit_decay: float = 0.9  # w_logit(l) = logit_decay ** l
    level_exponent: float = 0.7  # w_level(l) = (l + 1) ** -level_exponent
    ngram_at_level0: bool = False  # the released code has no n-gram term at level 0
    max_depth: int = 0  # levels used; 0 = every level the drafter gives
    eps: float = 1e-10


@dataclass
class SearchNodes:
    """Everything the search kept, for verification and for visualisation.
    Arrays are (N,) aligned with the Tree's nodes (root first)."""

    tree: Tree
    draft_logp: np.ndarray
    ngram_p: np.ndarray
    level: np.ndarray


def topk_levels(logits: torch.Tensor, k: int, draft_to_target: torch.Tensor | None = None):
    """logits (D, Vd) -> (log p (D, k) float64 over the top-k, target ids (D, k) int64)."""
    vals, idx = torch.topk(logits.float(), k, dim=-1)
    logp = torch.log_softmax(vals, dim=-1)
    if draft_to_target is not None:
        idx = draft_to_target[idx]
    return logp.cpu().numpy().astype(np.float64), idx.cpu().numpy().astype(np.int64)


def tree_search(logp: np.ndarray, tokens: np.ndarray, context: list[int], ngram, cfg: TreeSearchConfig,
                eos_ids=frozenset(), return_nodes: bool = False):
    """logp, tokens: (D, k) per-level top-k log-probs and target ids (see `topk_levels`).
    context: the committed ids, the tree root last. ngram: an `NGram` or None.
    Returns the Tree (root = context[-1]), or SearchNodes if return_nodes."""
    D = logp.shape[0] if not cfg.max_depth else min(cfg.max_depth, logp.shape[0])
    eos = np.array(sorted(eos_ids), dtype=np.int64)
    use_ng = ngram is not None and cfg.w_ngram != 0.0
    last2 = np.array([context[-2] if len(context) >= 2 else -1, context[-1]], dtype=np.int64)

    # all kept nodes (beam survivors), flat lists; parent = index into these lists, -1 = root
    n_tok, n_par, n_score, n_lp, n_ng, n_lvl = [], [], [], [], [], []
    beam_idx = np.array([-1])  # node ids of the current beam (root only)
    beam_score = np.zeros(1)
    beam_ctx = last2[None]  # (B, 2) last two tokens of context + path
    K = tokens.shape[1]
    for lvl in range(D):
        B = beam_idx.size
        if B == 0:
            break
        w_level = (lvl + 1) ** -cfg.level_exponent
        w_logit = cfg.logit_decay ** lvl
        tok_l = tokens[lvl]  # (K,) the same candidates for every beam path (parallel drafting)
        inc = np.tile(w_logit * logp[lvl], (B, 1))
        if use_ng and (lvl > 0 or cfg.ngram_at_level0):
            p_ng = ngram.prob(beam_ctx, np.broadcast_to(tok_l, (B, K)))
            inc += cfg.w_ngram * np.log(p_ng + cfg.eps)
        else:
            p_ng = np.full((B, K), np.nan)
        score = (beam_score[:, None] + w_level * inc).ravel()
        eos_l = np.isin(tok_l, eos) if eos.size else np.zeros(K, bool)
        is_eos = np.tile(eos_l, B)
        # EOS-ending paths rank after all others; stable sort keeps ties in candidate order
        order = np.lexsort((-score, is_eos))[: cfg.beam_width]
        parent_row, col = np.divmod(order, K)
        sel_tok = tok_l[col]
        new_ids = np.arange(len(n_tok), len(n_tok) + order.size)
        n_tok.extend(sel_tok.tolist())
        n_par.extend(beam_idx[parent_row].tolist())
        sel_score = score[order]
        n_score.extend(sel_score.tolist())
        n_lp.extend(logp[lvl][col].tolist())
        n_ng.extend(p_ng[parent_row, col].tolist())
        n_lvl.extend([lvl] * order.size)
        keep = ~eos_l[col]  # EOS paths are finished: not expanded
        beam_idx = new_ids[keep]
        beam_score = sel_score[keep]
        beam_ctx = np.stack([beam_ctx[parent_row[keep], 1], sel_tok[keep]], axis=1)

    # best max_nodes over all levels, parents first (score desc, then depth asc, then creation order)
    score = np.asarray(n_score)
    lvl = np.asarray(n_lvl)
    order = np.lexsort((np.arange(score.size), lvl, -score))
    par = np.asarray(n_par)
    taken = np.zeros(score.size, bool)
    chosen = []
    for i in order:
        if len(chosen) >= cfg.max_nodes:
            break
        if par[i] == -1 or taken[par[i]]:
            taken[i] = True
            chosen.append(i)
    # topological layout: by level, then by rank (best first), so children lists are best-first
    rank = {int(i): r for r, i in enumerate(chosen)}
    chosen.sort(key=lambda i: (lvl[i], rank[int(i)]))
    pos = {int(i): j + 1 for j, i in enumerate(chosen)}
    toks = [context[-1]] + [n_tok[i] for i in chosen]
    parents = [-1] + [0 if par[i] == -1 else pos[int(par[i])] for i in chosen]
    tree = Tree(torch.tensor(toks), torch.tensor(parents), scores=torch.tensor([0.0] + score[chosen].tolist()))
    if not return_nodes:
        return tree
    idx = np.asarray(chosen, dtype=np.int64)
    return SearchNodes(tree, np.concatenate([[0.0], np.asarray(n_lp)[idx]]),
                       np.concatenate([[np.nan], np.asarray(n_ng)[idx]]), np.concatenate([[-1], lvl[idx]]))
