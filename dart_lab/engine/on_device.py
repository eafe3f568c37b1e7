"""DART's search and greedy acceptance for every row of a batch at once, as tensor ops on the device the logits
live on (beyond the released code, which searches one row on the host).

`search_batch` is `search.tree_search_batch` with every shape fixed by the config rather than by the data: each
row keeps a beam of W slots (its live entries first, in beam order, the rest marked dead), so a level is a few
batched ops and no step waits on the host between levels. The arithmetic is the reference's, op for op in float32
(the n-gram probabilities in float64, their log rounded once from float64 as `search.log32` does), and the orders
are the reference's stable ones, so the trees are the same bit for bit (tests/test_on_device.py, on the golden
vectors and on random batches). Scores never rise along a path (every increment is a log of at most 1 times a
non-negative weight), so a parent always ranks before its child and the best N candidates by (score desc, depth
asc, index asc) are already ancestor-closed: `tree.best_closed_tree`'s cut is one sort.

`greedy_accept_batch` is `acceptance.greedy_accept` for padded trees: a node is on the accepted path when it and
each of its ancestors is the first child of its parent whose token is the parent's argmax.
"""
from __future__ import annotations

import numpy as np
import torch

from ..search import TreeSearchConfig, _depth_and_beam
from ..tree import Tree


class DeviceNGram:
    """An `ngram.NGram`'s sorted count tables as tensors on `device`, looked up by `torch.searchsorted`."""

    def __init__(self, ngram, device):
        t = lambda a, dt: torch.as_tensor(np.ascontiguousarray(a), dtype=dt, device=device)  # noqa: E731
        self.V = int(ngram.V)
        self.uni = t(ngram._uni_dense, torch.float64)
        self.bi = (t(ngram.bi_keys, torch.int64), t(ngram.bi_counts, torch.float64))
        self.tri = (t(ngram.tri_keys, torch.int64), t(ngram.tri_counts, torch.float64))

    @staticmethod
    def _count(table, q: torch.Tensor) -> torch.Tensor:
        keys, counts = table
        if keys.numel() == 0:
            return torch.zeros(q.shape, dtype=torch.float64, device=q.device)
        idx = torch.searchsorted(keys, q).clamp_max(keys.numel() - 1)
        return torch.where(keys[idx] == q, counts[idx], 0.0)

    def prob(self, ctx: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """`NGram.prob` for ctx (..., 2) and tokens (..., K): p (..., K) float64, the same back-off."""
        V = self.V
        a, b = ctx[..., 0], ctx[..., 1]
        b0 = b.clamp_min(0)
        c_b = torch.where(b >= 0, self.uni[b0], 0.0)
        c_ab = torch.where((a >= 0) & (b >= 0), self._count(self.bi, a.clamp_min(0) * V + b0), 0.0)
        c_bt = torch.where((b >= 0)[..., None], self._count(self.bi, b0[..., None] * V + tokens), 0.0)
        out = torch.where(c_bt > 0, c_bt / c_b.clamp_min(1.0)[..., None], 0.0)
        c_abt = self._count(self.tri, (a.clamp_min(0)[..., None] * V + b0[..., None]) * V + tokens)
        tri = (c_ab > 0)[..., None] & (c_bt > 0) & (c_abt > 0)
        return torch.where(tri, c_abt / torch.where(c_ab > 0, c_ab, 1.0)[..., None], out)


def _f32(x: float, device) -> torch.Tensor:
    return torch.tensor(np.float32(x), dtype=torch.float32, device=device)


def search_batch(logp: torch.Tensor, tokens: torch.Tensor, last2: torch.Tensor, ngram: DeviceNGram | None,
                 cfg: TreeSearchConfig, eos_ids=frozenset()) -> dict:
    """The search of R rows at once. logp, tokens (R, L, K) as `search.topk_levels` gives them (float32, int64),
    last2 (R, 2) int64: each row's last two committed ids (-1 where absent), the root last.
    Returns the trees as padded tensors: "tokens", "parents", "ranks" (R, N + 1) (root first, then by depth,
    best first within a depth; parents -1 at the root and past a row's last node), "scores" (R, N + 1) float64,
    "size" (R,) nodes a row (root included); `trees(...)` makes `Tree`s of them."""
    R, L, K = logp.shape
    dev = logp.device
    D, W = _depth_and_beam(cfg, L)
    use_ng = ngram is not None and cfg.w_ngram != 0.0
    w_ng, eps = _f32(cfg.w_ngram, dev), _f32(cfg.eps, dev)
    eos = torch.tensor(sorted(eos_ids), dtype=torch.int64, device=dev)
    # the beam: W slots a row, the live ones first; pos = the candidate's index in the padded list (-1: the root)
    b_pos = torch.full((R, W), -1, dtype=torch.int64, device=dev)
    b_score = torch.zeros(R, W, dtype=torch.float32, device=dev)
    b_ctx = last2[:, None, :].expand(R, W, 2).clone()
    b_live = torch.zeros(R, W, dtype=torch.bool, device=dev)
    b_live[:, 0] = True
    blocks = []  # per level: (parent pos, score, live) of its W * K candidates a row
    for lvl in range(D):
        tok_l = tokens[:, lvl, None, :].expand(R, W, K)
        inc = logp[:, lvl, None, :] * _f32(cfg.logit_decay ** lvl, dev)
        if use_ng and (lvl > 0 or cfg.ngram_at_level0):
            p_ng = ngram.prob(b_ctx, tok_l).to(torch.float32)
            inc = inc + (p_ng + eps).double().log().float() * w_ng
        score = (b_score[:, :, None] + _f32((lvl + 1) ** -cfg.level_exponent, dev) * inc).reshape(R, W * K)
        live = b_live[:, :, None].expand(R, W, K).reshape(R, W * K)
        blocks.append((b_pos[:, :, None].expand(R, W, K).reshape(R, W * K), score, live))
        # next beam: live non-EOS candidates by score desc, ties by index (the reference's stable order)
        expand = live & ~torch.isin(tok_l.reshape(R, W * K), eos)
        key = torch.where(expand, -score, torch.inf)
        order = torch.sort(key, dim=1, stable=True).indices[:, :W]
        b_live = torch.gather(expand, 1, order)
        b_pos = lvl * W * K + order
        b_score = torch.gather(score, 1, order)
        b_ctx = torch.stack([torch.gather(b_ctx[..., 1], 1, order // K), torch.gather(tok_l.reshape(R, W * K), 1, order)], -1)
    par, score, live = (torch.cat(x, 1) for x in zip(*blocks))  # (R, D * W * K)
    return _best_tree(tokens, last2[:, 1], par, score, live, D, W, K, cfg.max_nodes)


def _best_tree(tokens, roots, par, score, live, D: int, W: int, K: int, N: int) -> dict:
    """The best N live candidates a row by (score desc, depth asc, index asc), laid out as `tree.best_closed_tree`
    lays them out (ancestor-closed already: module docstring)."""
    R, M = score.shape
    dev = score.device
    lvl = torch.arange(M, device=dev) // (W * K)
    by_depth = torch.sort(lvl.expand(R, M), dim=1, stable=True).indices  # index asc within a depth
    key = torch.where(live, -score, torch.inf).gather(1, by_depth)
    ranked = by_depth.gather(1, torch.sort(key, dim=1, stable=True).indices)  # (R, M) best first
    n = min(N, M)
    chosen = ranked[:, :n]
    taken = live.gather(1, chosen)
    size = taken.sum(1) + 1
    rank = torch.arange(n, device=dev).expand(R, n)
    # tree order: by depth, then rank; the dead ones last
    order = torch.sort(torch.where(taken, lvl[chosen] * n + rank, D * n + rank), dim=1, stable=True).indices
    chosen, rank, taken = chosen.gather(1, order), rank.gather(1, order), taken.gather(1, order)
    pos = torch.full((R, M), -1, dtype=torch.int64, device=dev)
    pos.scatter_(1, chosen, torch.arange(1, n + 1, device=dev).expand(R, n))
    p = par.gather(1, chosen)
    parents = torch.where(p < 0, 0, pos.gather(1, p.clamp_min(0)))
    cand_tok = tokens[torch.arange(R, device=dev)[:, None], lvl[chosen], chosen % K]
    pad = lambda x, v: torch.cat([torch.full((R, 1), v, dtype=x.dtype, device=dev), x], 1)  # noqa: E731
    return {"tokens": torch.cat([roots[:, None], torch.where(taken, cand_tok, 0)], 1),
            "parents": pad(torch.where(taken, parents, -1), -1), "ranks": pad(torch.where(taken, rank, -1), -1),
            "scores": pad(torch.where(taken, score.gather(1, chosen), 0.0).double(), 0.0), "size": size}


def trees(out: dict) -> list[Tree]:
    """`search_batch`'s padded trees as `Tree`s (one device-to-host copy of each tensor)."""
    host = {k: v.cpu() for k, v in out.items()}
    return [Tree(host["tokens"][r, :s], host["parents"][r, :s], scores=host["scores"][r, :s], ranks=host["ranks"][r, :s])
            for r, s in enumerate(host["size"].tolist())]


def greedy_accept_batch(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """`acceptance.greedy_accept` for R padded trees at once. tokens, parents (R, N) (parents -1 at the root and
    at pads), best (R, N): the target's argmax at each node. Returns (path (R, N): the accepted nodes, root first,
    then -1; length (R,): accepted drafted nodes; bonus (R,): the argmax after the last accepted node), on the device."""
    R, N = tokens.shape
    dev = tokens.device
    idx = torch.arange(N, device=dev).expand(R, N)
    node = parents >= 0
    ok = node & (tokens == best.gather(1, parents.clamp_min(0)))
    # the first matching child of each parent (children in index order, as `Tree.children` lists them)
    first = torch.full((R, N + 1), N, dtype=torch.int64, device=dev)
    first.scatter_reduce_(1, torch.where(ok, parents, N), torch.where(ok, idx, N), reduce="amin")
    good = ok & (first.gather(1, parents.clamp_min(0)) == idx)
    good[:, 0] = True
    # pointer doubling, log2(N) rounds and no host sync: on[i] = good over i and all its ancestors, depth[i] = hops
    up = torch.where(node, parents, idx)  # the root points at itself
    on, depth = good.clone(), node.long()
    for _ in range(max(N - 1, 1).bit_length()):
        on, depth, up = on & on.gather(1, up), depth + depth.gather(1, up), up.gather(1, up)
    length = torch.where(on, depth, 0).amax(1)
    last = torch.where(on & (depth == length[:, None]), idx, N).amin(1)
    path = torch.full((R, N + 1), -1, dtype=torch.int64, device=dev)  # column N takes what is not on the path
    path.scatter_(1, torch.where(on, depth, N), torch.where(on, idx, -1))
    path = path[:, :N]
    return path, length, best.gather(1, last[:, None])[:, 0]


def tree_layout(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths (R, N) and ancestor masks (R, N, N) (mask[r, i, j]: j is i or an ancestor of i; a pad, parent -1
    beyond the root, sees only itself) of R padded trees, built where the parents are, without a host copy:
    log2(N) squarings of the one-step ancestor relation. A verify's positions are the row's length + depth."""
    R, N = parents.shape
    dev = parents.device
    idx = torch.arange(N, device=dev).expand(R, N)
    node = (parents >= 0) & (idx > 0)
    step = torch.eye(N, dtype=torch.float32, device=dev).expand(R, N, N).clone()
    step[torch.arange(R, device=dev)[:, None].expand(R, N)[node], idx[node], parents[node]] = 1.0
    up, depth = torch.where(node, parents, idx), node.long()
    for _ in range(max(N - 1, 1).bit_length()):
        step = (step @ step).clamp_max_(1.0)  # paths of up to twice the length
        depth, up = depth + depth.gather(1, up), up.gather(1, up)
    return depth, step > 0
