"""Verification: which drafted tokens the target accepts, and the bonus token (paper section 3.3).

Greedy (temperature 0): walk from the root; at each node the target's argmax must equal the token
of one of its children to go on. The longest matching root-to-leaf path is accepted and the argmax
at its last node is the bonus token. The result is exactly greedy autoregressive decoding.

Sampling (temperature > 0): recursive rejection sampling over the distinct children of the current
node (SpecInfer's multi-draft rejection with a deterministic draft). Why it is lossless:

    The tree is a deterministic function of the context, i.e. each child token x is "proposed" with
    draft probability q(x) = 1. Standard speculative sampling accepts x with probability
    min(1, p(x)/q(x)) = p(x) and, on rejection, samples from the residual norm(max(p - q, 0)),
    which is p with x removed and renormalised. So step by step:
      P(emit x1) = p(x1)                                          (accepted first)
      P(emit x2) = (1 - p(x1)) * p(x2) / (1 - p(x1)) = p(x2)      (x1 rejected, x2 accepted)
      ... and if every child is rejected, a token y outside the children is drawn from the residual
      p(y) / (1 - sum_children p) with overall probability (1 - sum_children p) * that = p(y).
    Every token is emitted with exactly its target probability p, and once a child is accepted the
    same argument applies at the child with the target distribution conditioned on that path. By
    induction the emitted sequence has the target's autoregressive distribution.

`p` here is the *processed* target distribution: logits / temperature, then top-k, then top-p —
the same `target_probs` is used by the AR baseline, so both sample from one distribution.
"""
from __future__ import annotations

import torch

from .config import GenerationConfig
from .tree import Tree


def target_probs(logits: torch.Tensor, cfg: GenerationConfig) -> torch.Tensor:
    """logits (N, V) float -> probabilities (N, V) after temperature, top-k and top-p (temperature > 0)."""
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if cfg.top_p < 1.0:
        sp, si = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop = (sp.cumsum(-1) - sp) >= cfg.top_p
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token id drawn from p (V,) (non-negative, any positive total) by inverting its CDF (float64
    cumulative sums; a zero-probability id is never drawn). Why not torch.multinomial: over a 49K
    vocabulary it costs ~20x more per draw on a CPU (docs/speed.md) -- per token of every sampled step."""
    cdf = torch.cumsum(p.double(), 0)
    u = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= cdf.numel():  # u rounded up to the total: the last id with positive probability
        i = int(torch.nonzero(p > 0)[-1])
    return i


def greedy_accept(tree: Tree, logits: torch.Tensor | list[int]) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target argmax. Returns (node path from root, bonus token).
    logits: (N, V), or the argmax per node already taken (a batch takes all rows' at once: one
    device->host copy per step instead of one per row)."""
    # (N,) one device->host copy; max's indices are argmax's (the first maximum), and cheaper on a CPU
    best = logits if isinstance(logits, list) else logits.max(-1).indices.tolist()
    tokens, children = tree.tokens.tolist(), tree.children()
    path, node = [0], 0
    while True:
        nxt = next((c for c in children[node] if tokens[c] == best[node]), None)
        if nxt is None:
            return path, best[node]
        path.append(nxt)
        node = nxt


def sample_accept(tree: Tree, probs, generator: torch.Generator) -> tuple[list[int], int]:
    """Recursive rejection over distinct children (see module docstring). probs: (N, V) target
    probabilities, or a function node -> (V,) probabilities of that node (then only the nodes the walk
    visits are computed: `accept` does this, since a softmax over the vocabulary costs ~0.4 ms per row
    on a CPU and a walk visits tau of the tree's rows, not all of them). A function must return a new
    tensor each call (the walk zeroes rejected tokens in it)."""
    row = probs if callable(probs) else (lambda i: probs[i].clone())  # p is edited below: a fresh row
    tokens, children = tree.tokens.tolist(), tree.children()
    path, node = [0], 0
    while True:
        p = row(node)
        mass = float(p.sum())  # the residual's mass, less each rejected child's p below
        accepted = None
        for c in children[node]:
            x = tokens[c]
            px = float(p[x])
            if px <= 0.0:  # already rejected sibling with the same token, or outside top-k/top-p
                continue
            u = torch.rand((), generator=generator, device=generator.device).item()
            if u * mass < px:
                accepted = c
                break
            p[x] = 0.0
            mass -= px
        if accepted is None:
            return path, sample_token(p, generator)
        path.append(accepted)
        node = accepted


def accept(tree: Tree, logits: torch.Tensor, cfg: GenerationConfig, generator: torch.Generator | None):
    """Dispatch on temperature. Returns (accepted node path incl. root, bonus token id)."""
    if cfg.greedy:
        return greedy_accept(tree, logits)
    return sample_accept(tree, lambda node: target_probs(logits[node:node + 1], cfg)[0], generator)
