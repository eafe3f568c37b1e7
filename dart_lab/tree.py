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


@dataclass
class Tree:
    """tokens: (N,) long; parents: (N,) long with parents[0] = -1 and parents[i] < i.
    depths: (N,) long, depth[0] = 0. scores: optional (N,) float (search score of each node)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor | None = None
    scores: torch.Tensor | None = None

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
