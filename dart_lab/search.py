"""N-gram-guided tree search over parallel draft logits (paper section 3.2, Algorithm 1), as the
released implementation runs it (fvliang/DART: `tree_search.py` + its C++ `Searcher`; paper/METHOD.md
"Tree search"). Golden vectors computed by the released code are matched in tests/test_conformance.py.

The draft head gives, in one forward, a distribution for each future level l = 0..D-1, independent
of which tokens are chosen at earlier levels. The search turns them into a tree:

    level l: the top-k (25) tokens of the level-l logits; p = float32 softmax over those k only
    score(child) = score(parent) + w_level(l) * (w_logit(l) * log(p + 1e-10) + w_ng * log(p_ngram + 1e-10))
        w_logit(l) = 0.9**l,  w_level(l) = (l+1)**-0.7,  w_ng = 0.5,  no n-gram term at level 0,
        float32 arithmetic in this order (as the released C++);
        p_ngram = 3-gram probability (per-token back-off, ngram.py) of the token after the last two
        tokens of (context + path)
    candidates: EVERY expansion of the current beam (beam paths x k tokens: 25 at level 0, up to
        500 after) joins one global candidate list
    beam: the 20 best candidates of the level form the next beam; paths ending in EOS rank after
        all others and are never expanded (they stay candidates, so an EOS leaf can be drafted)
    tree: the best `max_nodes` (60) candidates of the global list by score. A candidate that missed
        the beam can still be a leaf, so trees come out wider and shallower than "the best beam
        survivors".

Tie-breaking (the released code uses an unstable std::sort, so its ties are unspecified): both the
beam cut and the final cut order by (score desc, depth asc, candidate index asc), where candidate
index = beam rank of the parent x k + top-k rank of the token. Scores never increase along a path,
so that order puts parents first, and the final cut also checks ancestor closure explicitly
(`tree.best_closed_tree`).

The level loop runs compiled where a C++ compiler is (`dart_lab::beam_candidates`, csrc/search.cpp: the same
float32 arithmetic in the same order, each context's n-gram lookups narrowed to its own range of the keys) and as
numpy otherwise; the numpy loop is the reference the compiled one equals bit for bit (tests/test_search.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import fast
from .errors import DartLabError
from .tree import Tree, best_closed_tree


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
    builder: str = "dart"  # what turns the levels into a tree (builders.py): "dart" is this module's search


@dataclass
class SearchNodes:
    """Everything the search kept, for verification and for visualisation.
    Arrays are (N,) aligned with the Tree's nodes (root first)."""

    tree: Tree
    draft_logp: np.ndarray
    ngram_p: np.ndarray
    level: np.ndarray


def topk_levels(logits: torch.Tensor, k: int, draft_to_target: torch.Tensor | None = None, eps: float = 1e-10):
    """logits (D, Vd) -> (log(p + eps) (D, k) float32, target ids (D, k) int64), where p is the
    float32 softmax over the top-k logits of each level (the released preprocessing)."""
    vals, idx = torch.topk(logits.float(), k, dim=-1)
    p = torch.softmax(vals, dim=-1)
    if draft_to_target is not None:
        idx = draft_to_target[idx]
    p = p.cpu().numpy()
    return np.log(p + np.float32(eps)), idx.cpu().numpy().astype(np.int64)


def log32(x: np.ndarray) -> np.ndarray:
    """float32 x -> log(x) as float32, rounded once from the float64 log: numpy's own float32 log and C's logf
    each differ from that in the last bit for some inputs, while numpy's and C's float64 logs round to the same
    float32 (csrc/search.cpp computes the search's n-gram term so)."""
    return np.log(x.astype(np.float64)).astype(np.float32)


def tree_search(logp: np.ndarray, tokens: np.ndarray, context: list[int], ngram, cfg: TreeSearchConfig,
                eos_ids=frozenset()) -> Tree:
    """logp, tokens: (D, k) per-level log(p + eps) and target ids (see `topk_levels`).
    context: the committed ids, the tree root last. ngram: an `NGram` or None (no n-gram term).
    Returns the Tree (root = context[-1], at most cfg.max_nodes drafted nodes)."""
    return _search(logp, tokens, context, ngram, cfg, eos_ids, nodes=False)


def search_nodes(logp: np.ndarray, tokens: np.ndarray, context: list[int], ngram, cfg: TreeSearchConfig,
                 eos_ids=frozenset()) -> SearchNodes:
    """`tree_search` plus each kept node's draft log p, n-gram p and level (for teaching and plots)."""
    return _search(logp, tokens, context, ngram, cfg, eos_ids, nodes=True)


def tree_search_with_paths(logp: np.ndarray, tokens: np.ndarray, context: list[int], ngram, cfg: TreeSearchConfig,
                           eos_ids=frozenset(), extra_paths=()) -> Tree:
    """`tree_search` whose candidate list also holds `extra_paths`: (tokens, scores) pairs, each a
    path from the root with the cumulative score of every node (non-increasing). A path node that is
    already a candidate keeps the higher of its two scores; the rest join the list; the final cut
    is the same. With no extra paths this IS `tree_search` (the released algorithm). Used by the
    context-aware extension (dart_ctx.ContextDrafter), not by `dart`."""
    return _search(logp, tokens, context, ngram, cfg, eos_ids, nodes=False, extra_paths=extra_paths)


def _merge_paths(tok, par, score, lvl, extra_paths):
    """Add (tokens, scores) paths from the root to the candidate arrays (see tree_search_with_paths)."""
    score = score.copy()
    add_tok, add_par, add_score, add_lvl = [], [], [], []
    added: dict[tuple[int, int], int] = {}  # (parent, token) -> index among the added candidates
    n = tok.size
    for path, scores in extra_paths:
        parent = -1
        for d, (t, sc) in enumerate(zip(path, scores)):
            hit = np.flatnonzero((par == parent) & (tok == t)) if parent < n else np.zeros(0, np.int64)
            if hit.size:
                i = int(hit[0])
                score[i] = max(score[i], np.float32(sc))
            else:  # a new candidate (also every node under a new one)
                j = added.get((parent, int(t)))
                if j is None:
                    j = added[(parent, int(t))] = len(add_tok)
                    add_tok.append(int(t)), add_par.append(parent), add_score.append(np.float32(sc)), add_lvl.append(d)
                else:
                    add_score[j] = max(add_score[j], np.float32(sc))
                i = n + j
            parent = i
    if not add_tok:
        return tok, par, score, lvl
    return (np.concatenate([tok, np.asarray(add_tok, np.int64)]), np.concatenate([par, np.asarray(add_par, np.int64)]),
            np.concatenate([score, np.asarray(add_score, np.float32)]), np.concatenate([lvl, np.asarray(add_lvl, np.int64)]))


def _depth_and_beam(cfg: TreeSearchConfig, levels: int, prune: bool = True) -> tuple[int, int]:
    """Levels searched and beam width, for a drafter that gives `levels` levels (see `_search`)."""
    D = levels if not cfg.max_depth else min(cfg.max_depth, levels)
    D = min(D, max(cfg.max_nodes, 1))  # exact: a node at depth d needs d - 1 kept ancestors
    return D, min(cfg.beam_width, max(cfg.max_nodes, 1)) if prune else cfg.beam_width


def _scoring(cfg: TreeSearchConfig, logp, ngram, eos_ids) -> tuple:
    """What the score arithmetic reads, as the released code has it: logp in float32, the EOS ids, whether
    the n-gram term applies, its weight and eps in float32."""
    f32 = np.float32
    return (np.asarray(logp, dtype=f32), np.array(sorted(eos_ids), dtype=np.int64),
            ngram is not None and cfg.w_ngram != 0.0, f32(cfg.w_ngram), f32(cfg.eps))


def _levels(logp, tokens, context, ngram, cfg: TreeSearchConfig, eos_ids, D: int, beam_width: int,
            compiled: bool | None = None) -> tuple:
    """The search's level loop (`_search`): every candidate's (parent, score, level, top-k rank, n-gram p) as
    arrays, per level the beam's K expansions in beam order (candidate j of a level block = beam path j // K
    extended by top-k token j % K; parent = index into the list, -1 = root). Through `dart_lab::beam_candidates`
    (csrc/search.cpp, the same numbers bit for bit) where it is built and the n-gram is an `NGram`, none, or dart-ctx's
    mix of one with the request's own (`compiles`); compiled=False: this numpy loop, the reference."""
    if compiled is not False:  # the engine's compiled loop, where it runs (`fast`)
        out = fast.call("beam_candidates", logp, tokens, context, ngram, cfg, eos_ids, D, beam_width)
        if out is not None:
            return out
        if compiled:
            raise DartLabError("the compiled search does not run here (its kernel is not built, or this n-gram is not one it reads)")
    K = tokens.shape[1]
    f32 = np.float32
    logp, eos, use_ng, w_ng, eps = _scoring(cfg, logp, ngram, eos_ids)
    last2 = np.array([context[-2] if len(context) >= 2 else -1, context[-1]], dtype=np.int64)

    c_par, c_score, c_ng, sizes = [], [], [], []
    eos_tok = np.isin(tokens[:D], eos) if eos.size else np.zeros((D, K), bool)  # (D, K)
    n_cand = 0
    beam_idx = np.array([-1])  # candidate ids of the current beam (the root only)
    beam_score = np.zeros(1, f32)
    beam_ctx = last2[None]  # (B, 2) last two tokens of context + path
    for lvl in range(D):
        B = beam_idx.size
        if B == 0:
            break
        w_level, w_logit = f32((lvl + 1) ** -cfg.level_exponent), f32(cfg.logit_decay ** lvl)
        tok_l = tokens[lvl]  # (K,) the same candidates for every beam path (parallel drafting)
        inc = logp[lvl] * w_logit  # (K,), broadcast over the beam below
        if use_ng and (lvl > 0 or cfg.ngram_at_level0):
            p_ng = ngram.prob(beam_ctx, np.broadcast_to(tok_l, (B, K))).astype(f32)
            inc = inc + log32(p_ng + eps) * w_ng  # (B, K)
        else:
            p_ng = np.full((B, K), np.nan, f32)
        score = (beam_score[:, None] + w_level * inc).ravel()  # (B*K,) float32
        c_par.append(np.repeat(beam_idx, K))
        c_score.append(score)
        c_ng.append(p_ng.ravel())
        sizes.append(B * K)
        # next beam: non-EOS first, then score desc, then candidate index (stable)
        is_eos = np.broadcast_to(eos_tok[lvl], (B, K)).ravel()
        order = np.lexsort((-score, is_eos))[:beam_width]
        order = order[~is_eos[order]]  # EOS paths are finished: never expanded
        beam_idx = n_cand + order
        beam_score = score[order]
        beam_ctx = np.stack([beam_ctx[order // K, 1], tok_l[order % K]], axis=1)
        n_cand += B * K

    cat = np.concatenate
    score = cat(c_score) if c_score else np.zeros(0, f32)
    lvl = np.repeat(np.arange(len(sizes)), sizes)
    col = (np.arange(score.size) - np.repeat(np.cumsum([0] + sizes[:-1]), sizes)) % K  # top-k rank of each
    return (cat(c_par) if c_par else np.zeros(0, np.int64)), score, lvl, col, (cat(c_ng) if c_ng else score)


def _search(logp, tokens, context, ngram, cfg: TreeSearchConfig, eos_ids, nodes: bool, extra_paths=(), prune=True):
    D, beam_width = _depth_and_beam(cfg, logp.shape[0], prune)
    # Exact for a tree of N = max_nodes < beam_width nodes: a beam of N gives the same tree. A kept node
    # with a kept child outranks that child, so fewer than N candidates of its level rank above it:
    # it is within the first N of its level's beam. A node ranked N or lower in its level's beam is
    # outranked by N kept nodes, and so is everything under it. (The paper's 60 nodes: beam 20, as
    # released.) Small CPU trees search 2.5x fewer n-gram lookups; `prune=False` is the reference.
    # With extra paths (which only raise scores or add nodes) the same holds, except that an exact
    # float tie between a path node and a head candidate may break the other way.
    logp = np.asarray(logp, dtype=np.float32)
    par, score, lvl, col, ng = _levels(logp, tokens, context, ngram, cfg, eos_ids, D, beam_width)
    cand_tok, cand_par = tokens[lvl, col], par
    if extra_paths:
        cand_tok, cand_par, score, lvl_all = _merge_paths(cand_tok, cand_par, score, lvl, extra_paths)
        tree, _ = best_closed_tree(context[-1], cand_tok, cand_par, score, lvl_all, cfg.max_nodes)
        return tree
    tree, chosen = best_closed_tree(context[-1], cand_tok, cand_par, score, lvl, cfg.max_nodes)
    if not nodes:
        return tree
    cat = np.concatenate
    return SearchNodes(tree, cat([[0.0], logp[lvl[chosen], col[chosen]]]), cat([[np.nan], ng[chosen]]),
                       cat([[-1], lvl[chosen]]))


def tree_search_batch(logp: np.ndarray, tokens: np.ndarray, contexts: list[list[int]], ngram, cfg: TreeSearchConfig,
                      eos_ids=frozenset()) -> list[Tree]:
    """`tree_search` for R rows at once (a batch's step, batch.py): logp, tokens (R, D, K) as `topk_levels`
    gives them for stacked logits; contexts: each row's committed ids, its root last. Row r's tree is
    `tree_search(logp[r], tokens[r], contexts[r], ...)` exactly (tests/test_search.py): the same float32
    scores in the same order, the same beam and final cuts; but each level's n-gram lookups and beam cut
    run for every row's beam together, so a step of R rows costs one pass per level, not R (the search
    per row in Python dominated a GPU step at 64 rows: the H200 results in reproduce/results/). Where the
    compiled level loop is built (`_levels`), each row runs it alone instead (`engine.ops`).

    Beam entries of all rows sit in one array, grouped by row in beam order, so a row's block of a level
    (its beam x K candidates) is contiguous and candidate index j within it is the per-row search's j."""
    fast_trees = fast.call("tree_search_batch", logp, tokens, contexts, ngram, cfg, eos_ids)  # the engine's, where it runs
    if fast_trees is not None:
        return fast_trees
    R = logp.shape[0]
    D, beam_width = _depth_and_beam(cfg, logp.shape[1])  # the pruned beam, exact as in `_search`
    K = tokens.shape[2]
    f32 = np.float32
    logp, eos, use_ng, w_ng, eps = _scoring(cfg, logp, ngram, eos_ids)
    eos_tok = np.isin(tokens[:, :D], eos) if eos.size else np.zeros((R, D, K), bool)  # (R, D, K)
    # the current beam of every row: row, candidate id within the row (-1 = root), score, last two tokens
    b_row = np.arange(R)
    b_idx = np.full(R, -1, np.int64)
    b_score = np.zeros(R, f32)
    b_ctx = np.array([[c[-2] if len(c) >= 2 else -1, c[-1]] for c in contexts], dtype=np.int64).reshape(R, 2)
    n_cand = np.zeros(R, np.int64)  # candidates each row holds so far
    blocks = []  # per level: (row, parent, score, level, top-k rank) of every candidate, flat
    for lvl in range(D):
        if b_row.size == 0:
            break
        w_level, w_logit = f32((lvl + 1) ** -cfg.level_exponent), f32(cfg.logit_decay ** lvl)
        tok_l = tokens[b_row, lvl]  # (E, K): each entry's row's candidates at this level
        inc = logp[b_row, lvl] * w_logit
        if use_ng and (lvl > 0 or cfg.ngram_at_level0):
            p_ng = ngram.prob(b_ctx, tok_l).astype(f32)
            inc = inc + log32(p_ng + eps) * w_ng
        score = (b_score[:, None] + w_level * inc).ravel()  # (E*K,) float32
        row = np.repeat(b_row, K)
        # j: the candidate's index within its row's block (entries of a row are contiguous, in beam order)
        first = np.searchsorted(b_row, b_row)  # each entry's row's first entry
        j = ((np.arange(b_row.size) - first)[:, None] * K + np.arange(K)).ravel()
        blocks.append((row, np.repeat(b_idx, K), score, np.full(score.size, lvl), j % K))
        # next beam per row: non-EOS first, then score desc, then j (the per-row search's stable order; a
        # row's candidates lie in j order, so the stable sort keeps it without a key of its own)
        is_eos = eos_tok[row, lvl, j % K]
        order = np.lexsort((-score, 2 * row + is_eos))
        srow = row[order]
        rank = np.arange(order.size) - np.searchsorted(srow, srow)
        order = order[(rank < beam_width) & ~is_eos[order]]  # EOS paths are finished: never expanded
        parent_entry = order // K
        b_idx = n_cand[row[order]] + j[order]
        b_ctx = np.stack([b_ctx[parent_entry, 1], tok_l.ravel()[order]], axis=1)
        b_row, b_score = row[order], score[order]
        n_cand += np.bincount(row, minlength=R)
    return _trees_by_row(blocks, tokens, contexts, cfg.max_nodes)


def _trees_by_row(blocks: list, tokens: np.ndarray, contexts: list[list[int]], max_nodes: int) -> list[Tree]:
    """`tree_search_batch`'s last cut: each row's candidates (from every level's flat block of (row, parent,
    score, level, top-k rank)) in level order, as the per-row search lists them, kept as its best closed tree."""
    if not blocks:
        return [Tree.single(c[-1]) for c in contexts]
    row, par, score, lvl, col = (np.concatenate(x) for x in zip(*blocks))
    by_row = np.argsort(row, kind="stable")
    bounds = np.searchsorted(row[by_row], np.arange(len(contexts) + 1))
    trees = []
    for r in range(len(contexts)):
        sel = by_row[bounds[r]:bounds[r + 1]]
        tree, _ = best_closed_tree(contexts[r][-1], tokens[r, lvl[sel], col[sel]], par[sel], score[sel], lvl[sel],
                                   max_nodes)
        trees.append(tree)
    return trees
