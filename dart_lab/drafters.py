"""Drafting methods plugged into the shared decode loop (`generate.Drafter` interface).

dart           DART head: one forward -> per-level logits -> n-gram-guided tree search
dart-no-ngram  the same with w_ng = 0 (paper Table 2 ablation)
pld            prompt lookup decoding: copy the continuation of the last matching n-gram
eagle3         EAGLE-3 head (see eagle3.py) with its dynamic tree
sps            standard speculative sampling with a smaller draft LM (greedy chain of its argmax)
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from .generate import Drafter
from .search import TreeSearchConfig, topk_levels, tree_search
from .tree import Tree


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class DartDrafter(Drafter):
    """Paper section 3: draft (one head forward) -> tree search. The head's KV cache holds every
    committed prefix position; each round feeds the newly accepted positions plus the masks."""

    name = "dart"
    needs_aux = True

    def __init__(self, head, ngram=None, search: TreeSearchConfig = TreeSearchConfig(), name: str | None = None):
        super().__init__()
        self.head, self.ngram, self.search = head, ngram, search
        if name:
            self.name = name
        self._d2t = head.draft_to_target()

    def begin(self, target, ids, aux):
        self.eos = target.eos_ids
        self.kv = None
        self.n_cached = 0
        self.pending = (aux, ids[-aux.shape[0]:])

    def observe(self, ids, aux):
        self.pending = (aux, ids[-aux.shape[0]:])

    @torch.no_grad()
    def draft_logits(self) -> torch.Tensor:
        """(draft_length + 1, Vd) logits for levels 0..draft_length; feeds the pending prefix."""
        aux, nxt = self.pending
        dev = aux.device
        n, m = aux.shape[0], self.head.cfg.n_masks
        positions = torch.arange(self.n_cached, self.n_cached + n + m, device=dev)
        nxt = torch.as_tensor(nxt, dtype=torch.long, device=dev)
        logits, kv = self.head(aux[None].to(self.head.fc.weight.dtype), nxt[None], positions, past_kv=self.kv)
        self.kv = kv if self.kv is None else (torch.cat([self.kv[0], kv[0]], -2), torch.cat([self.kv[1], kv[1]], -2))
        self.n_cached += n
        self.pending = None
        return logits[0]

    def propose(self, ids):
        t0 = time.perf_counter()
        logits = self.draft_logits()
        logp, toks = topk_levels(logits, self.search.topk, self._d2t)  # host copy = sync point
        t1 = time.perf_counter()
        tree = tree_search(logp, toks, ids, self.ngram, self.search, self.eos)
        t2 = time.perf_counter()
        self.last_timing = {"draft_ms": (t1 - t0) * 1e3, "search_ms": (t2 - t1) * 1e3}
        return tree

    def config(self) -> dict:
        return {"name": self.name, "search": dataclasses.asdict(self.search), "head": dataclasses.asdict(self.head.cfg),
                "ngram": getattr(self.ngram, "meta", None)}


class PLDDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): find the most recent earlier occurrence of the last
    n tokens (n = max_ngram..1) and propose the `num_pred` tokens that followed it, as a chain."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, num_pred: int = 10):
        super().__init__()
        self.max_ngram, self.num_pred = max_ngram, num_pred

    def propose(self, ids):
        t0 = time.perf_counter()
        a = np.asarray(ids, dtype=np.int64)
        L = a.size
        chain: list[int] = []
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            suffix = a[L - n:]
            win = np.lib.stride_tricks.sliding_window_view(a[:L - 1], n)  # windows ending before the suffix
            hits = np.flatnonzero((win == suffix).all(axis=1))
            if hits.size:
                start = hits[-1] + n
                chain = a[start:start + self.num_pred].tolist()
                if chain:
                    break
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0}
        return Tree.from_paths(ids[-1], [chain]) if chain else Tree.single(ids[-1])

    def config(self) -> dict:
        return {"name": self.name, "max_ngram": self.max_ngram, "num_pred": self.num_pred}


class SPSDrafter(Drafter):
    """Speculative sampling with a smaller draft LM sharing the target's tokenizer: the draft model
    proposes a greedy chain of `draft_len` tokens (deterministic draft, so the shared verifier
    stays lossless at any temperature). The draft keeps its own KV cache of committed tokens."""

    name = "sps"

    def __init__(self, draft_model, draft_len: int = 5):
        super().__init__()
        from .target import Target

        self.draft = draft_model if isinstance(draft_model, Target) else Target(draft_model)
        self.draft_len = draft_len

    def begin(self, target, ids, aux):
        if self.draft.vocab_size > target.vocab_size:
            from .errors import DartLabError

            raise DartLabError(f"SPS draft vocabulary ({self.draft.vocab_size}) exceeds the target's ({target.vocab_size})")
        self.draft.prefill(torch.tensor(ids[:-1]))
        self.committed = len(ids) - 1  # tokens in the draft cache

    @torch.no_grad()
    def propose(self, ids):
        t0 = time.perf_counter()
        d = self.draft
        # bring the draft cache up to date with what was accepted (all but the new root)
        if self.committed < len(ids) - 1:
            new = torch.tensor(ids[self.committed:len(ids) - 1])
            d.verify(Tree(new, torch.arange(-1, new.numel() - 1)))
            d.commit(list(range(new.numel())))
            self.committed = len(ids) - 1
        base = d.seq_len
        chain, tok = [], ids[-1]
        for _ in range(self.draft_len):
            out = d.verify(Tree.single(tok))
            d.commit([0])
            tok = int(out.logits[0].argmax())
            chain.append(tok)
        # drop the speculative entries: keep only committed tokens in the draft cache
        for layer in d.cache.layers:
            layer.keys, layer.values = layer.keys[..., :base, :], layer.values[..., :base, :]
        d.seq_len = base
        _sync(d.device)
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0}
        return Tree.from_paths(ids[-1], [chain])

    def config(self) -> dict:
        return {"name": self.name, "draft_len": self.draft_len, "draft_model": self.draft.name}
