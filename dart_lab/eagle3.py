"""EAGLE-3 baseline (Li et al. 2025): an autoregressive feature-level draft head with a dynamic tree.

Same single layer as DART's head (fc over the 3 aux states, MidLayer without the mask vector, final
norm, lm_head over the draft vocabulary; state-dict layout of released heads such as
AngelSlim/Qwen3-*_eagle3), but drafting is autoregressive: step j feeds the head its own output
hidden state of step j-1 together with the embedding of the token chosen at step j-1.

Dynamic tree (EAGLE-2 section 4), counted as the released builder counts (NOTES.md "EAGLE-3
baseline"): one head forward from the root gives its `topk` children; then `depth` more forwards,
each expanding the `topk` best frontier nodes by cumulative log-prob (all frontier nodes in ONE
head forward, with tree attention inside the draft) -> trees reach depth `depth` + 1. Every
candidate enters the final selection; the tree keeps the best `total_tokens` - 1 of them (the
released `total_token` counts the root). Selection is `tree.best_closed_tree`: ancestor-closed
also on exact score ties, where the released builder (closure check commented out) can attach a
node to a parent it did not keep -- the one documented difference.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from .draft_head import HeadBase
from .generate import Drafter
from .tree import best_closed_tree


class Eagle3Head(HeadBase):
    architecture = "LlamaForCausalLMEagle3"
    with_mask = False

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, past_kv=None,
                attn_mask: torch.Tensor | None = None, from_target: bool = True):
        """hidden (B, n, 3H') target aux states (from_target) or (B, n, H) the head's own previous
        outputs; next_ids (B, n) the token after each position. positions (n,).
        Returns logits (B, n, Vd), out hidden (B, n, H) (pre-norm, fed to the next step), (k, v)."""
        lay = self.midlayer
        g = self.fc(hidden) if from_target else hidden
        emb = self.embed_tokens(next_ids).to(g.dtype)
        x = torch.cat([lay.input_layernorm(emb), lay.hidden_norm(g)], dim=-1)
        attn, kv = lay.self_attn(x, positions, attn_mask, past_kv)
        h = g + attn
        h = h + lay.mlp(lay.post_attention_layernorm(h))
        return self.lm_head(self.norm(h)), h, kv


@dataclass(frozen=True)
class Eagle3TreeConfig:
    """EAGLE-3 demo settings used by the DART paper: total_token 60, depth 7, top_k 10, meaning
    what they mean in the released code: 60 nodes including the root (59 drafted), depth 7
    forwards after the root's (trees up to depth 8)."""

    total_tokens: int = 60  # tree nodes including the root
    depth: int = 7  # head forwards after the first one
    topk: int = 10


class Eagle3Drafter(Drafter):
    name = "eagle3"
    needs_aux = True

    def __init__(self, head: Eagle3Head, tree: Eagle3TreeConfig = Eagle3TreeConfig()):
        super().__init__()
        self.head, self.tree_cfg = head, tree
        self._d2t = head.draft_to_target()

    def begin(self, target, ids, aux):
        self.kv = None
        self.n_cached = 0
        self.pending = (aux, ids[-aux.shape[0]:])

    def observe(self, ids, aux):
        self.pending = (aux, ids[-aux.shape[0]:])

    def _topk(self, logits: torch.Tensor, k: int):
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, i = torch.topk(lp, k, dim=-1)
        return v, self._d2t[i]

    @torch.no_grad()
    def propose(self, ids):
        t0 = time.perf_counter()
        cfg, head = self.tree_cfg, self.head
        aux, nxt = self.pending
        dev, dt = aux.device, head.fc.weight.dtype
        n = aux.shape[0]
        # step 0: feed the newly committed prefix; its K/V join the head's cache for good
        pos = torch.arange(self.n_cached, self.n_cached + n, device=dev)
        logits, h, kv = head(aux[None].to(dt), torch.as_tensor(nxt, device=dev)[None], pos, past_kv=self.kv)
        self.kv = kv if self.kv is None else (torch.cat([self.kv[0], kv[0]], -2), torch.cat([self.kv[1], kv[1]], -2))
        self.n_cached += n
        self.pending = None
        P = self.n_cached

        # node bookkeeping (node 0 = root); scores = cumulative log-prob
        lp, tok = self._topk(logits[0, -1], cfg.topk)
        tokens = [ids[-1]] + tok.tolist()
        parents = [-1] + [0] * cfg.topk
        scores = [0.0] + lp.tolist()
        depth = [0] + [1] * cfg.topk
        frontier = list(range(1, cfg.topk + 1))
        parent_hidden = {i: h[0, -1] for i in frontier}  # hidden that produced node i's distribution
        tree_k, tree_v, processed = [], [], []  # K/V of draft-tree nodes already run through the head
        for d in range(1, cfg.depth + 1):
            F = len(frontier)
            hid = torch.stack([parent_hidden[i] for i in frontier])[None]
            tk = torch.tensor([tokens[i] for i in frontier], device=dev)[None]
            pos = torch.tensor([P - 1 + depth[i] for i in frontier], device=dev)
            # each frontier node sees the committed prefix, its processed ancestors and itself
            anc = []
            for i in frontier:
                a, j = set(), parents[i]
                while j > 0:
                    a.add(j)
                    j = parents[j]
                anc.append([p in a for p in processed])
            mask = torch.ones(F, P + len(processed) + F, dtype=torch.bool, device=dev)
            if processed:
                mask[:, P:P + len(processed)] = torch.tensor(anc, device=dev)
            mask[:, P + len(processed):] = torch.eye(F, dtype=torch.bool, device=dev)
            past = self.kv if not processed else (torch.cat([self.kv[0]] + tree_k, -2), torch.cat([self.kv[1]] + tree_v, -2))
            logits, h, kv = head(hid, tk, pos, past_kv=past, attn_mask=mask, from_target=False)
            tree_k.append(kv[0])
            tree_v.append(kv[1])
            processed.extend(frontier)
            lp, tok = self._topk(logits[0], cfg.topk)  # (F, topk)
            cand = (torch.tensor([scores[i] for i in frontier], device=dev)[:, None] + lp.to(dev)).flatten()
            cand_tok = tok.flatten().tolist()
            cand_score = cand.tolist()
            new_ids = []
            for r in range(len(cand_score)):
                pi = frontier[r // cfg.topk]
                tokens.append(cand_tok[r])
                parents.append(pi)
                scores.append(cand_score[r])
                depth.append(d + 1)
                new_ids.append(len(tokens) - 1)
                parent_hidden[len(tokens) - 1] = h[0, r // cfg.topk]
            order = np.argsort(-np.asarray(cand_score), kind="stable")[: cfg.topk]
            frontier = [new_ids[o] for o in order]

        # keep the best total_tokens - 1 candidates (the root is the released count's first node)
        tree, _ = best_closed_tree(tokens[0], np.asarray(tokens[1:]), np.asarray(parents[1:]) - 1,
                                   np.asarray(scores[1:]), np.asarray(depth[1:]), cfg.total_tokens - 1)
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0}
        return tree

    def config(self) -> dict:
        return {"name": self.name, "tree": dataclasses.asdict(self.tree_cfg), "head": dataclasses.asdict(self.head.cfg)}
