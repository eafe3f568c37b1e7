"""Draft trees: tokens, parents, depths, the ancestor mask and root-to-leaf paths.

A tree is stored in topological order: node 0 is the root (the last committed token, whose logits
give the first draft level) and parents[i] < i for every other node. The target verifies all nodes
in one forward where node i attends to exactly its ancestors and itself ("tree attention",
SpecInfer / Medusa / EAGLE; DART paper section 3.3).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import fast
from .errors import DartLabError


@dataclass
class Tree:
    """tokens: (N,) long; parents: (N,) long with parents[0] = -1 and parents[i] < i.
    depths: (N,) long, depth[0] = 0. scores: optional (N,) float (search score of each node).
    ranks: optional (N,) long, the order in which a budgeted builder took each node (root -1): the
    tree of any smaller budget n is exactly the nodes of rank < n (see `best_closed_tree`)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    ranks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long).cpu()
        self.parents = torch.as_tensor(self.parents, dtype=torch.long).cpu()
        n = self.tokens.numel()
        if n == 0 or self.parents.numel() != n:
            raise ValueError("a tree needs >= 1 node and one parent per node")
        par = self.parents.tolist()
        if par[0] != -1 or any(not (0 <= p < i) for i, p in enumerate(par[1:], 1)):
            raise ValueError("parents must satisfy parents[0] == -1 and 0 <= parents[i] < i")
        if self.depths is None:
            d = [0] * n
            for i in range(1, n):
                d[i] = d[par[i]] + 1
            self.depths = torch.tensor(d, dtype=torch.long)
        self._mask = None
        self._children = None

    def __len__(self) -> int:
        return self.tokens.numel()

    @classmethod
    def single(cls, root: int) -> "Tree":
        """The one-node tree of plain autoregressive decoding."""
        return cls(torch.tensor([root]), torch.tensor([-1]))

    @classmethod
    def from_paths(cls, root: int, paths: list[list[int]]) -> "Tree":
        """Merge token paths (each continuing after `root`) into a trie; shared prefixes share nodes."""
        tokens, parents, index = [root], [-1], {}
        for path in paths:
            node = 0
            for t in path:
                key = (node, int(t))
                if key not in index:
                    index[key] = len(tokens)
                    tokens.append(int(t))
                    parents.append(node)
                node = index[key]
        return cls(torch.tensor(tokens), torch.tensor(parents))

    def ancestor_mask(self) -> torch.Tensor:
        """(N, N) bool: mask[i, j] is True iff j is an ancestor of i or j == i."""
        if self._mask is None:
            n = len(self)
            m = np.eye(n, dtype=bool)
            par = self.parents.numpy()
            for i in range(1, n):  # parents come first, so their rows are already complete
                m[i] |= m[par[i]]
            self._mask = torch.from_numpy(m)
        return self._mask

    def children(self) -> list[list[int]]:
        """children()[i] = node indices whose parent is i, in tree order (best-scored first)."""
        if self._children is None:
            ch = [[] for _ in range(len(self))]
            for i, p in enumerate(self.parents.tolist()[1:], 1):
                ch[p].append(i)
            self._children = ch
        return self._children

    def path_to(self, i: int) -> list[int]:
        """Node indices root..i."""
        out, par = [], self.parents.tolist()
        while i != -1:
            out.append(i)
            i = par[i]
        return out[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices."""
        ch = self.children()
        return [self.path_to(i) for i in range(len(self)) if not ch[i]]


def best_closed_tree(root: int, tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray, depths: np.ndarray,
                     max_nodes: int, compiled: bool | None = None) -> tuple["Tree", np.ndarray]:
    """Keep the best `max_nodes` of M scored candidate nodes as an ancestor-closed tree.

    tokens, parents, scores, depths: (M,) arrays of the candidates; parents[i] indexes the same arrays
    (-1 = child of the root). Candidates are ranked by (score desc, depth asc, index asc) and a
    candidate is kept only once its parent is: scores never increase along a path, so this equals
    "the best max_nodes by score" and stays ancestor-closed on exact ties (where the released
    EAGLE-3 builder can attach a node to a parent it did not keep). Used by the DART tree search and
    the EAGLE-3 dynamic tree.
    Returns the Tree (root first, then by depth, best first within a depth, so children lists are
    best-first) and `chosen` (N-1,): the candidate index of tree node j+1. Through the engine's compiled
    selection where it runs (`fast`: the same selection); compiled=False: this numpy code, the reference."""
    fast_pick = fast.call("closed_tree", parents, scores, depths, max_nodes) if compiled is not False else None
    if fast_pick is not None:  # the engine's selection (`fast`)
        chosen_arr, rank, par = fast_pick
        return Tree(torch.as_tensor(np.concatenate([[root], tokens[chosen_arr]]).astype(np.int64)),
                    torch.as_tensor(np.concatenate([[-1], par])),
                    scores=torch.as_tensor(np.concatenate([[0.0], scores[chosen_arr].astype(np.float64)])),
                    ranks=torch.as_tensor(np.concatenate([[-1], rank]))), chosen_arr
    if compiled:
        raise DartLabError("the compiled tree selection does not run here (its kernel is not built)")
    M = scores.size
    if M > max_nodes > 0:  # only the candidates that can make the cut need a full sort
        kth = np.partition(-scores, max_nodes - 1)[max_nodes - 1]
        pool = np.flatnonzero(-scores <= kth)
    else:
        pool = np.arange(M)
    taken = np.zeros(M, bool)
    chosen: list[int] = []
    while True:
        order = pool[np.lexsort((pool, depths[pool], -scores[pool]))]
        for i in order.tolist():
            if len(chosen) >= max_nodes:
                break
            if not taken[i] and (parents[i] < 0 or taken[parents[i]]):
                taken[i] = True
                chosen.append(i)
        if len(chosen) >= max_nodes or pool.size == M:
            break
        pool = np.arange(M)  # a closure skip left room: rank every candidate (exact ties only)
    chosen_arr = np.asarray(chosen, dtype=np.int64)
    rank = np.empty(M, np.int64)
    rank[chosen_arr] = np.arange(chosen_arr.size)
    chosen_arr = chosen_arr[np.lexsort((rank[chosen_arr], depths[chosen_arr]))] if chosen else chosen_arr
    pos = np.zeros(M, np.int64)
    pos[chosen_arr] = np.arange(1, chosen_arr.size + 1)
    par = parents[chosen_arr]
    tree = Tree(torch.as_tensor(np.concatenate([[root], tokens[chosen_arr]]).astype(np.int64)),
                torch.as_tensor(np.concatenate([[-1], np.where(par < 0, 0, pos[np.maximum(par, 0)])]).astype(np.int64)),
                scores=torch.as_tensor(np.concatenate([[0.0], scores[chosen_arr].astype(np.float64)])),
                ranks=torch.as_tensor(np.concatenate([[-1], rank[chosen_arr]]).astype(np.int64)))
    return tree, chosen_arr

