"""Every drafting method, plugged into the shared decode loop (`generate.Drafter` interface).

dart           DART head: one forward -> per-level logits -> n-gram-guided tree search
dart-no-ngram  the same with w_ng = 0 (paper Table 2 ablation)
eagle3         EAGLE-3 head with its dynamic tree (EAGLE-2 section 4)
pld            prompt lookup decoding: copy the continuation of the last matching n-gram
sps            standard speculative sampling with a smaller draft LM (greedy chain of its argmax)
(dart-ctx, beyond the paper, builds on DartDrafter in dart_ctx.py.)
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from . import fast
from .builders import build
from .errors import DartLabError
from .generate import Drafter
from .search import TreeSearchConfig, topk_levels, tree_search, tree_search_batch
from .target import Target, sync
from .tree import Tree, best_closed_tree


class HeadDrafter(Drafter):
    """What the head drafters (DART, EAGLE-3) share: the head's KV cache of every committed prefix
    position, and the aux states of newly accepted positions, fed at the next `propose`."""

    needs_aux = True

    def __init__(self, head):
        super().__init__()
        self.head = head
        self.vocab_map = head.draft_to_target()
        fast.call("pack_head", head)  # the engine's packed weights for inference, where it runs (engine/head.py)

    def begin(self, target, ids, aux):
        self.eos = target.eos_ids
        self.n_cached = 0
        self._kv = None  # the head's cache: (k, v) buffers (1, kv_heads, capacity, hd), [:n_cached] filled
        self._aux, self._n_aux, self._next = None, 0, []  # queued positions: aux buffer (capacity, 3H), ids
        self.observe(ids, aux)

    @property
    def kv(self):
        """The head's cached prefix (k, v), (1, kv_heads, n_cached, hd) each, or None before the first feed."""
        return None if self._kv is None else (self._kv[0][:, :, :self.n_cached], self._kv[1][:, :, :self.n_cached])

    def observe(self, ids, aux):
        """Queue the accepted positions' aux (n, 3H) and the token after each position for the next head
        forward; positions a step did not feed (a drafter may skip the head: a batch without trees) stay
        queued in order. Both the queue and the head's cache are buffers that grow by doubling, so a long
        run of steps without a head forward keeps no tensor per step alive and copies nothing per step."""
        k = aux.shape[0]
        self._aux = _grown(self._aux, self._n_aux, self._n_aux + k, aux, self.head.fc.weight.dtype, dim=0)
        self._aux[self._n_aux:self._n_aux + k] = aux
        self._n_aux += k
        self._next.extend(ids[-k:])

    def feed_inputs(self, extra_positions: int = 0):
        """The queued prefix as head inputs: aux (1, n, 3H) in the head's dtype, next ids (1, n),
        positions (n + extra_positions,) continuing the head's cache."""
        n, dev = self._n_aux, self._aux.device
        positions = torch.arange(self.n_cached, self.n_cached + n + extra_positions, device=dev)
        return self._aux[None, :n], torch.as_tensor(self._next, dtype=torch.long, device=dev)[None], positions

    def keep_prefix_kv(self, kv) -> None:
        """Append the fed prefix positions' (k, v) (1, kv_heads, n, hd) to the head's cache for good."""
        end = self.n_cached + kv[0].shape[-2]
        self._kv = tuple(_grown(None if self._kv is None else self._kv[i], self.n_cached, end, kv[i], kv[i].dtype, dim=2)
                         for i in range(2))
        self._kv[0][:, :, self.n_cached:end], self._kv[1][:, :, self.n_cached:end] = kv
        self.n_cached = end
        self._n_aux, self._next = 0, []


def _grown(buf: torch.Tensor | None, filled: int, need: int, like: torch.Tensor, dtype: torch.dtype, dim: int
           ) -> torch.Tensor:
    """`buf` if it holds `need` entries along `dim`, else a buffer of twice that (at least 64), shaped as
    `like` elsewhere, in `dtype`, with buf's first `filled` entries copied over."""
    if buf is not None and buf.shape[dim] >= need and buf.dtype == dtype and buf.device == like.device:
        return buf
    shape = list(like.shape)
    shape[dim] = max(2 * need, 64)
    out = torch.empty(shape, dtype=dtype, device=like.device)
    if buf is not None and filled:
        out.narrow(dim, 0, filled).copy_(buf.narrow(dim, 0, filled))
    return out


class DartDrafter(HeadDrafter):
    """Paper section 3: draft (one head forward) -> tree search. The head's KV cache holds every
    committed prefix position; each round feeds the newly accepted positions plus the masks."""

    name = "dart"

    def __init__(self, head, ngram=None, search: TreeSearchConfig = TreeSearchConfig(), name: str | None = None):
        super().__init__(head)
        self.ngram, self.search = ngram, search
        if name:
            self.name = name

    def n_masks(self) -> int:
        """MASK positions of this budget's head forward."""
        m = self.head.cfg.n_masks
        if self.search.max_nodes:  # exact: masks beyond the deepest level a tree of this budget can hold
            m = min(m, self.search.max_nodes - (1 if self.head.cfg.shifted else 0))
        return m

    @torch.no_grad()
    def draft_logits(self) -> torch.Tensor:
        """(draft_length + 1, Vd) logits for levels 0..draft_length; feeds the pending prefix."""
        m = self.n_masks()
        aux, nxt, positions = self.feed_inputs(m)
        logits, kv = self.head(aux, nxt, positions, past_kv=self.kv, n_masks=m)
        self.keep_prefix_kv(kv)
        return logits[0]

    def propose(self, ids, logits: torch.Tensor | None = None):
        """The tree for this step; `logits` = this drafter's `draft_logits()` computed in a batch."""
        t0 = time.perf_counter()
        logits = self.draft_logits() if logits is None else logits
        if self.search.builder != "dart":  # another builder over the same levels (builders.py)
            t1 = time.perf_counter()
            tree = build(self.search.builder, logits, ids, self.search.max_nodes, self.ngram, self.search,
                         self.vocab_map, self.eos)
            self.last_timing = {"draft_ms": (t1 - t0) * 1e3, "search_ms": (time.perf_counter() - t1) * 1e3}
            return tree
        logp, toks = topk_levels(logits, self.search.topk, self.vocab_map)  # host copy = sync point
        t1 = time.perf_counter()
        tree = tree_search(logp, toks, ids, self.ngram, self.search, self.eos)
        t2 = time.perf_counter()
        self.last_timing = {"draft_ms": (t1 - t0) * 1e3, "search_ms": (t2 - t1) * 1e3}
        return tree

    def set_budget(self, nodes: int) -> None:
        """Draft trees of `nodes` nodes (root excluded): the same search, a different final cut."""
        self.search = dataclasses.replace(self.search, max_nodes=nodes)

    def config(self) -> dict:
        return {"name": self.name, "search": dataclasses.asdict(self.search), "head": dataclasses.asdict(self.head.cfg),
                "head_dtype": getattr(self.head, "chosen_dtype", {"dtype": str(self.head.fc.weight.dtype)}),
                "ngram": getattr(self.ngram, "meta", None)}


def propose_rows(drafters: list[DartDrafter], ids: list[list[int]], logits: list[torch.Tensor]) -> list[Tree]:
    """`DartDrafter.propose` for the rows of a batch step whose head logits came from one batched forward
    (`draft_logits_batch`): one top-k over the stacked logits (one device->host copy, not one per row) and
    one `search.tree_search_batch`. Row i's tree is `drafters[i].propose(ids[i], logits[i])`'s; the
    drafters share one head, n-gram and search config (`batch._draft` groups them so). Each drafter's
    `last_timing` carries its share of the time."""
    d0 = drafters[0]
    if d0.search.builder != "dart":  # the other builders build row by row
        return [d.propose(i, lg) for d, i, lg in zip(drafters, ids, logits)]
    t0 = time.perf_counter()
    stacked = torch.stack(logits)
    trees = fast.call("propose_rows", stacked, ids, d0)  # on a GPU: top-k and search on the device (the engine's)
    t1 = t0  # there both count as search
    if trees is None:
        logp, toks = topk_levels(stacked, d0.search.topk, d0.vocab_map)
        t1 = time.perf_counter()
        trees = tree_search_batch(logp, toks, ids, d0.ngram, d0.search, d0.eos)
    t2 = time.perf_counter()
    for d in drafters:
        d.last_timing = {"draft_ms": (t1 - t0) * 1e3 / len(drafters), "search_ms": (t2 - t1) * 1e3 / len(drafters)}
    return trees


def copy_match(ids: list[int], max_ngram: int, length: int, periodic: bool = False) -> tuple[list[int], int]:
    """Prompt lookup: the `length` tokens that followed the most recent earlier occurrence of the last
    n tokens of `ids` (a list, or an int64 array) (n = max_ngram..1, longest match first), and n; ([], 0) if none.
    periodic: when that occurrence ends d < length tokens before the end (text repeating itself with
    period d, as small targets do at T=0), the copy goes on past the end of `ids` as the same period
    would (token k = ids[e + 1 + k mod d]) instead of stopping after d tokens.
    Runs every dart-ctx step: only the earlier positions holding the last token are extended backwards
    (one pass over the context, not one per n: 8-token matches cost ~8 passes otherwise)."""
    a = np.asarray(ids, dtype=np.int64)
    L = a.size
    if L < 2 or max_ngram < 1 or length < 1:
        return [], 0
    ends = np.flatnonzero(a[:L - 1] == a[-1])  # where an earlier occurrence of the suffix would end
    if ends.size == 0:
        return [], 0
    lens = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, max_ngram):
        ok = ends >= k
        ok[ok] = a[ends[ok] - k] == a[L - 1 - k]
        alive &= ok
        if not alive.any():
            break
        lens += alive
    n = int(lens.max())
    e = int(ends[lens == n].max())  # the most recent of the longest matches
    d = L - 1 - e
    if periodic and d < length:
        return a[e + 1 + np.arange(length) % d].tolist(), n
    return a[e + 1:e + 1 + length].tolist(), n


class CopyIndex:
    """`copy_match` over one token list that grows step by step (a request's, as the decode loop extends it):
    for each n = 1..max_ngram, every n tokens of the list -> the latest position where they end, grown by the new
    positions alone, so a lookup is max_ngram dictionary reads instead of a pass over the context (a batch of
    dart-ctx rows looks up every row every step). The same answer as `copy_match` on the list: the longest
    suffix match first, the most recent of those. A list that is not a continuation of the one held (shorter,
    or its last held token changed) is indexed again from the start."""

    def __init__(self, max_ngram: int):
        self.max_ngram = max_ngram
        self.seq: list[int] = []
        self.ends = [{} for _ in range(max_ngram)]  # ends[n - 1]: n tokens (a tuple) -> latest end position
        self.indexed = 0  # positions e < indexed are in `ends` (the last token's own position never is)

    def match(self, ids: list[int], length: int, periodic: bool = False) -> tuple[list[int], int]:
        seq, held = self.seq, len(self.seq)
        if held > len(ids) or (held and ids[held - 1] != seq[-1]):
            seq[:], self.indexed = [], 0
            for d in self.ends:
                d.clear()
            held = 0
        seq.extend(ids[held:])
        L = len(seq)
        for e in range(self.indexed, L - 1):  # an earlier occurrence must be followed by a token
            for n in range(1, min(self.max_ngram, e + 1) + 1):
                self.ends[n - 1][tuple(seq[e - n + 1:e + 1])] = e
        self.indexed = max(self.indexed, L - 1)
        if length < 1:
            return [], 0
        for n in range(min(self.max_ngram, L - 1), 0, -1):
            e = self.ends[n - 1].get(tuple(seq[L - n:]))
            if e is not None:
                d = L - 1 - e
                if periodic and d < length:
                    return [seq[e + 1 + k % d] for k in range(length)], n
                return seq[e + 1:e + 1 + length], n
        return [], 0


def copy_chain(ids: list[int], max_ngram: int, length: int) -> list[int]:
    """`copy_match`'s chain alone (what PLD proposes)."""
    return copy_match(ids, max_ngram, length)[0]


class PLDDrafter(Drafter):
    """Prompt lookup decoding (Saxena 2023): find the most recent earlier occurrence of the last
    n tokens (n = max_ngram..1) and propose the `num_pred` tokens that followed it, as a chain."""

    name = "pld"

    def __init__(self, max_ngram: int = 3, num_pred: int = 10):
        super().__init__()
        self.max_ngram, self.num_pred = max_ngram, num_pred

    def propose(self, ids):
        t0 = time.perf_counter()
        chain = copy_chain(ids, self.max_ngram, self.num_pred)
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
        self.draft = draft_model if isinstance(draft_model, Target) else Target(draft_model)
        self.draft_len = draft_len

    def begin(self, target, ids, aux):
        if self.draft.vocab_size > target.vocab_size:
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
        d.truncate(base)  # drop the speculative entries: keep only committed tokens in the draft cache
        sync(d.device)
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0}
        return Tree.from_paths(ids[-1], [chain])

    def config(self) -> dict:
        return {"name": self.name, "draft_len": self.draft_len, "draft_model": self.draft.name}


@torch.no_grad()
def draft_logits_batch(drafters: list[DartDrafter]) -> list[torch.Tensor]:
    """`draft_logits()` of several rows' DART drafters in ONE head forward (the same head and number of
    masks; batch.py). Row b's pending n_b positions are left-padded to the longest, so every row's last
    prefix position and its masks sit at the same indices; its cached prefix (P_b positions) is padded to
    the longest cache. A row attends to its own cache, its own pending positions (causally) and its masks;
    a pad position to itself only. Each drafter's cache then gains its own n_b positions."""
    head, m = drafters[0].head, drafters[0].n_masks()
    feeds = [d.feed_inputs(m) for d in drafters]  # aux (1, n_b, 3H), next ids (1, n_b), positions (n_b + m,)
    B, dev = len(drafters), feeds[0][0].device
    ns = [f[0].shape[1] for f in feeds]
    Ps = [d.n_cached for d in drafters]
    n, P = max(ns), max(Ps)
    T = n + m
    aux = feeds[0][0].new_zeros(B, n, feeds[0][0].shape[-1])
    nxt = torch.zeros(B, n, dtype=torch.long, device=dev)
    pos = torch.zeros(B, T, dtype=torch.long, device=dev)
    q, k = torch.arange(T, device=dev)[:, None], torch.arange(T, device=dev)[None]
    mask = torch.zeros(B, 1, T, P + T, dtype=torch.bool, device=dev)
    kv_dtype = next((d.kv[0].dtype for d in drafters if d.kv is not None), aux.dtype)
    shape = next((d.kv[0].shape for d in drafters if d.kv is not None), None)
    past = None
    if shape is not None:
        past = tuple(torch.zeros(B, shape[1], P, shape[3], dtype=kv_dtype, device=dev) for _ in range(2))
    for b, (d, (a, x, p)) in enumerate(zip(drafters, feeds)):
        off = n - ns[b]
        aux[b, off:], nxt[b, off:], pos[b, off:], pos[b, :off] = a[0], x[0], p, Ps[b]
        mask[b, 0, :, :Ps[b]] = True
        mask[b, 0, :, P:] = (k <= q) & ((k >= off) | (k == q))
        if d.kv is not None:
            past[0][b, :, :Ps[b]], past[1][b, :, :Ps[b]] = d.kv[0][0], d.kv[1][0]
    logits, kv = head(aux, nxt, pos, past_kv=past, n_masks=m, attn_mask=mask)
    for b, d in enumerate(drafters):
        d.keep_prefix_kv((kv[0][b:b + 1, :, n - ns[b]:], kv[1][b:b + 1, :, n - ns[b]:]))
    return list(logits)


@dataclass(frozen=True)
class Eagle3TreeConfig:
    """EAGLE-3 demo settings used by the DART paper: total_token 60, depth 7, top_k 10, meaning
    what they mean in the released code: 60 nodes including the root (59 drafted), depth 7
    forwards after the root's (trees up to depth 8)."""

    total_tokens: int = 60  # tree nodes including the root
    depth: int = 7  # head forwards after the first one
    topk: int = 10


def _frontier_mask(frontier: list[int], parents: list[int], processed: list[int], P: int, dev) -> torch.Tensor:
    """EAGLE-3's tree-level attention mask (F, P + len(processed) + F): each frontier node sees the committed prefix
    (P positions), its processed ancestors and itself."""
    F = len(frontier)
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
    return mask


class Eagle3Drafter(HeadDrafter):
    """EAGLE-2/3 dynamic tree, counted as the released builder counts (paper/METHOD.md "EAGLE-3 baseline"):
    one head forward from the root gives its `topk` children; then `depth` more forwards, each
    expanding the `topk` best frontier nodes by cumulative log-prob (all frontier nodes in ONE head
    forward, with tree attention inside the draft) -> trees reach depth `depth` + 1. Every candidate
    enters the final selection; the tree keeps the best `total_tokens` - 1 (the released
    `total_token` counts the root) via `tree.best_closed_tree`, ancestor-closed also on exact ties,
    where the released builder (closure check commented out) can attach a node to a parent it did
    not keep -- the one documented difference."""

    name = "eagle3"

    def __init__(self, head, tree: Eagle3TreeConfig = Eagle3TreeConfig()):
        super().__init__(head)
        self.tree_cfg = tree

    def set_budget(self, nodes: int) -> None:
        """Draft trees of `nodes` nodes (root excluded; the released total_token counts the root)."""
        self.tree_cfg = dataclasses.replace(self.tree_cfg, total_tokens=nodes + 1)

    def head_forwards(self, nodes: int) -> int:
        """Tree-level head forwards a budget of `nodes` can use: a node at depth d needs d - 1 kept
        ancestors (scores never rise along a path), so levels deeper than `nodes` cannot make the cut
        and their forwards are skipped (exact: the same tree)."""
        return min(self.tree_cfg.depth, max(nodes - 1, 0))

    def _topk(self, logits: torch.Tensor, k: int):
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, i = torch.topk(lp, k, dim=-1)
        return v, self.vocab_map[i]

    @torch.no_grad()
    def propose(self, ids):
        t0 = time.perf_counter()
        cfg, head = self.tree_cfg, self.head
        aux, nxt, pos = self.feed_inputs()
        dev = aux.device
        # step 0: feed the newly committed prefix; its K/V join the head's cache for good
        logits, h, kv = head(aux, nxt, pos, past_kv=self.kv)
        self.keep_prefix_kv(kv)
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
        for d in range(1, self.head_forwards(cfg.total_tokens - 1) + 1):
            hid = torch.stack([parent_hidden[i] for i in frontier])[None]
            tk = torch.tensor([tokens[i] for i in frontier], device=dev)[None]
            pos = torch.tensor([P - 1 + depth[i] for i in frontier], device=dev)
            mask = _frontier_mask(frontier, parents, processed, P, dev)
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
