"""Every drafting method, plugged into the shared decode loop (`generate.Drafter` interface).

dart           DART head: one forward -> per-level logits -> n-gram-guided tree search
dart-no-ngram  the same with w_ng = 0 (paper Table 2 ablation)
eagle3         EAGLE-3 head with its dynamic tree (EAGLE-2 section 4)
pld            prompt lookup decoding: copy the continuation of the last matching n-gram
sps            standard speculative sampling with a smaller draft LM (greedy chain of its argmax)
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from .errors import DartLabError
from .fast_llama import PackedProjection, pack_linears
from .budget import interpolate
from .generate import Drafter
from .ngram import LocalNGram
from .search import TreeSearchConfig, topk_levels, tree_search, tree_search_with_paths
from .target import Target, sync
from .tree import Tree, best_closed_tree


class HeadDrafter(Drafter):
    """What the head drafters (DART, EAGLE-3) share: the head's KV cache of every committed prefix
    position, and the aux states of newly accepted positions, fed at the next `propose`."""

    needs_aux = True

    def __init__(self, head):
        super().__init__()
        self.head = head
        self._d2t = head.draft_to_target()
        pack_linears(head)  # CPU inference: oneDNN-packed weights (head forward ~10 % faster here)
        lay = head.midlayer  # and q|k|v, gate|up as one matmul each (fewer small-M calls: ~0.1 ms a draft)
        lay.self_attn.qkv = PackedProjection(lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj)
        lay.mlp.gate_up = PackedProjection(lay.mlp.gate_proj, lay.mlp.up_proj)

    def begin(self, target, ids, aux):
        self.eos = target.eos_ids
        self.kv = None
        self.n_cached = 0
        self.pending = None
        self.observe(ids, aux)

    def observe(self, ids, aux):
        """Queue the accepted positions' aux (n, 3H) and the token after each position for the next head
        forward; positions a step did not feed (a drafter may skip the head) stay queued in order."""
        nxt = ids[-aux.shape[0]:]
        if self.pending is not None:
            aux, nxt = torch.cat([self.pending[0], aux]), list(self.pending[1]) + list(nxt)
        self.pending = (aux, nxt)

    def feed_inputs(self, extra_positions: int = 0):
        """The pending prefix as head inputs: aux (1, n, 3H) in the head's dtype, next ids (1, n),
        positions (n + extra_positions,) continuing the head's cache."""
        aux, nxt = self.pending
        dev = aux.device
        n = aux.shape[0]
        positions = torch.arange(self.n_cached, self.n_cached + n + extra_positions, device=dev)
        return aux[None].to(self.head.fc.weight.dtype), torch.as_tensor(nxt, dtype=torch.long, device=dev)[None], positions

    def keep_prefix_kv(self, kv) -> None:
        """Append the fed prefix positions' (k, v) to the head's cache for good."""
        self.kv = kv if self.kv is None else (torch.cat([self.kv[0], kv[0]], -2), torch.cat([self.kv[1], kv[1]], -2))
        self.n_cached += kv[0].shape[-2]
        self.pending = None


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

    def wants_head(self, ids) -> bool:
        return True

    def propose(self, ids, logits: torch.Tensor | None = None):
        """The tree for this step; `logits` = this drafter's `draft_logits()` computed in a batch."""
        t0 = time.perf_counter()
        logits = self.draft_logits() if logits is None else logits
        logp, toks = topk_levels(logits, self.search.topk, self._d2t)  # host copy = sync point
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
                "ngram": getattr(self.ngram, "meta", None)}


def copy_match(ids: list[int], max_ngram: int, length: int, periodic: bool = False) -> tuple[list[int], int]:
    """Prompt lookup: the `length` tokens that followed the most recent earlier occurrence of the last
    n tokens of `ids` (n = max_ngram..1, longest match first), and n; ([], 0) if none.
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


def copy_chain(ids: list[int], max_ngram: int, length: int) -> list[int]:
    """`copy_match`'s chain alone (what PLD proposes)."""
    return copy_match(ids, max_ngram, length)[0]


def expected_copy_tokens(p: float, L: int) -> float:
    """Tokens a step verifying a copy chain of L tokens alone emits on average, each copy token kept
    with probability p given its predecessors: 1 (the bonus) + p + p^2 + ... + p^L."""
    return 1.0 + float(np.sum(p ** np.arange(1, L + 1)))


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

    def _forwards(self, nodes: int) -> int:
        """Tree-level head forwards a budget of `nodes` can use: a node at depth d needs d - 1 kept
        ancestors (scores never rise along a path), so levels deeper than `nodes` cannot make the cut
        and their forwards are skipped (exact: the same tree)."""
        return min(self.tree_cfg.depth, max(nodes - 1, 0))

    def draft_cost_scale(self, nodes: int, widest: int) -> float:
        return (1 + self._forwards(nodes)) / (1 + self._forwards(widest))  # head forwards dominate

    def _topk(self, logits: torch.Tensor, k: int):
        lp = torch.log_softmax(logits.float(), dim=-1)
        v, i = torch.topk(lp, k, dim=-1)
        return v, self._d2t[i]

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
        for d in range(1, self._forwards(cfg.total_tokens - 1) + 1):
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


# ----------------------------------------------------------------------------- beyond the paper
@dataclass(frozen=True)
class ContextConfig:
    """dart-ctx: DART that also reads the text in front of it.
    w_context: the search's n-gram = (1 - w) corpus table + w request-local table (prompt + every
        committed token, same order and back-off); 0 = the corpus table alone.
    copy: the prompt-lookup continuation of the last match joins the candidate list as a path scored
        by the search's own formula, with draft probability p at every level (so it competes on the
        same scale as the head's guesses instead of replacing them). p is this request's measured
        rate of copy tokens the target kept (each copy token whose predecessors were kept is one
        trial), starting from the prior `copy_p` worth `copy_prior_weight` trials: a text that is
        being copied earns its copies a high score, a free answer stops paying for them. The rate is
        kept per length n of the matched suffix (n = 1, 2, ..., `copy_match_buckets`, longer matches
        pooled): a copy found by a long match is far more often right (reproduce/copy_match_stats.py on
        the target's greedy answers, first copy token kept: 0.15 / 0.37 / 0.62 / 0.86 for n = 1 / 2 / 3 /
        4+ on MT-bench, 0.26 / 0.55 / 0.65 / 0.84 on copy_edit), so it earns a deeper chain and
        copy-only steps, a one-token match a short one or a tree step. Each bucket starts from the
        request's pooled rate times that bucket's reliability relative to all copies, learned over the
        previous requests this drafter decoded (`copy_history` trials remembered; 0 = every bucket
        starts from the pooled rate): the ratios are a property of the target, which a new request
        should not have to learn again in its first steps. `copy_max_ngram`: the longest suffix
        matched (the longest match picks the occurrence that agrees with the most context).
    copy_min_prob: copy nodes whose path probability p^depth is at least this come ON TOP of the
        tree budget theta (up to copy_len); the rest are dropped. Why on top: on a CPU, one more tree
        node costs ~2.5 % of a step (fast runner, 8 -> 16 nodes), a copy node at depth i earns p^i
        tokens, and theta was chosen for the head's guesses alone.
    copy_periodic: a copy from a match that ends d tokens back runs on with period d past the end of
        the text (`copy_match`): a loop of d tokens is copied copy_len deep, not d tokens deep.
    copy_branches: in a tree step, the head's `copy_branches` most likely first tokens (other than the
        copy's own first token) each get a copy too: the continuation that follows context + that
        token (`copy_match`), joined under the head's node as a path scored by the search's formula
        (the head's level-0 score, then p per copied token). Why: where the copy's first token is
        wrong, the target often says the head's word and then goes on copying (a paraphrase that
        re-joins the text); reproduce/copy_headroom.py bounds it: on copy_edit, tau 2.31 copying
        alone, 3.81 with a head that is always right at the failed token and the copy that follows
        it. Branch nodes whose path probability (head p x p^depth) is at least copy_min_prob come on
        top of the budget, like the copy's. Off by default (0): on a 2-core CPU it measured level
        with dart-ctx without it (copy_edit, README "Beyond the paper"); `dart-ctx-branch` turns it
        on, for devices where tree nodes are cheap.
    copy_only: a step verifies the copy chain alone (no head forward, no search: PLD's cost) when
        that is the faster step by the runner's cost model (methods.Runner with an automatic
        budget; without one every step is a tree step):
            E_copy = 1 + sum_{i<=L} p^i tokens in verify(L + 1) ms, against
            E_copy + g tokens in verify(theta + L + 1) + draft + search ms,
        g = the head's measured tokens beyond the copy's in this request's tree steps (prior:
        tau(theta) - 1 worth `copy_gain_prior_steps` steps); draft + search = this request's mean
        over its tree steps (prior: the runner's calibration figure, worth one step).
        The head catches up on the skipped positions at its next forward (HeadDrafter.observe).
        When no tree beats AR at all (the budget's fallback), `CopyOrAR` prices the copy against a
        one-token step instead."""

    w_context: float = 0.5
    copy: bool = True
    copy_p: float = 0.5
    copy_prior_weight: float = 4.0
    copy_min_prob: float = 0.1
    copy_max_ngram: int = 8
    copy_match_buckets: int = 4
    copy_history: int = 2048
    copy_len: int = 16
    copy_periodic: bool = True
    copy_branches: int = 0
    copy_only: bool = True
    copy_gain_prior_steps: float = 2.0


class MixedNGram:
    """p(t | a, b) = (1 - w) corpus(t | a, b) + w local(t | a, b); the `NGram.prob` interface."""

    def __init__(self, corpus, local, w: float):
        self.corpus, self.local, self.w = corpus, local, w

    def prob(self, ctx, tokens):
        p = self.local.prob(ctx, tokens)
        return p if self.corpus is None else (1.0 - self.w) * self.corpus.prob(ctx, tokens) + self.w * p


class ContextDrafter(DartDrafter):
    """The DART head and the released search, plus a request-local n-gram and copy candidates
    (ContextConfig). With w_context = 0 and copy off it drafts exactly what `dart` drafts."""

    name = "dart-ctx"

    def __init__(self, head, ngram=None, search: TreeSearchConfig = TreeSearchConfig(),
                 ctx: ContextConfig = ContextConfig(), name: str | None = None):
        super().__init__(head, ngram, search, name=name)
        self.ctx = ctx
        # Copy-only steps leave the tree to the steps where copying looks weak: tau(theta) measured on
        # those alone would be biased low against the calibration's ranks and drag theta around (seen:
        # 6 -> 15 on MT-bench). With copy-only steps on, greedy theta stays the calibration's choice.
        # Sampling's theta still adapts (from the tree steps; copy-only steps carry no ranks): sampled
        # copies rarely win a whole step (2-16 % of T=1 steps in the engine bench), and the greedy
        # calibration's acceptance, where sampling's theta starts, is too optimistic at T > 0.
        self.adapts_budget = not (ctx.copy and ctx.copy_only)
        self.cost_model = None  # (verify_ms, overhead_ms, tau) from an automatic budget (set_cost_model)
        b = max(1, ctx.copy_match_buckets)
        self.hist_kept, self.hist_trials = np.zeros(b), np.zeros(b)  # over earlier requests (copy_history)
        self.copy_trials = None  # per request, from begin()

    def begin(self, target, ids, aux):
        self.begin_copies(ids)
        self._tree_step = False  # was the last step a tree step (head + search)?
        self.copy_only_steps = 0
        self.gain_sum, self.gain_steps = 0.0, 0  # head tokens beyond the copy, over tree steps with a copy
        self.overhead_sum, self.overhead_steps = 0.0, 0  # drafting + search ms of this request's tree steps
        self.local = LocalNGram(ids) if self.ctx.w_context > 0 else None  # grown in place each tree step
        super().begin(target, ids, aux)

    def begin_copies(self, ids) -> None:
        """A new request for the copy bookkeeping: the last one joins the history (copy_history)."""
        self._remember()
        b = max(1, self.ctx.copy_match_buckets)
        self.copy_kept, self.copy_trials = np.zeros(b), np.zeros(b)  # copy tokens kept / tried, per match length
        self._last_copies = []  # (len(ids) at the proposal, head token before it ([] or [t]), copy chain, match bucket)

    def observe(self, ids, aux):
        kept = self.score_copies(ids)
        if self._tree_step:  # what the head's nodes added on top of the copy (all of it when none)
            self.gain_sum += aux.shape[0] - 1 - kept
            self.gain_steps += 1
            self._tree_step = False
        super().observe(ids, aux)

    def score_copies(self, ids) -> int:
        """Score the last step's copies against what the target produced (the copy trials behind p);
        returns how many tokens of the main copy were kept."""
        kept = 0
        for at, prefix, chain, bucket in self._last_copies:
            if ids[at:at + len(prefix)] != prefix:  # a branch whose head token was not taken: no trial
                continue
            k = n = 0
            for c, t in zip(chain, ids[at + len(prefix):]):  # tokens beyond what was committed: no trial
                n += 1
                if c != t:
                    break
                k += 1
            self.copy_kept[bucket] += k
            self.copy_trials[bucket] += n
            if not prefix:
                kept = k
        self._last_copies = []
        return kept

    def set_cost_model(self, verify_ms, overhead_ms, tau) -> None:
        self.cost_model = (verify_ms, overhead_ms, tau)

    def without_tree(self, verify_ms):
        """No tree beats AR (the automatic budget fell back; seen at T=1 on a CPU where nodes are dear):
        dart-ctx still verifies a copy where it beats a one-token step (`CopyOrAR`)."""
        return CopyOrAR(self, verify_ms) if self.ctx.copy else None

    def _copy_only_pays(self, L: int, p: float) -> bool:
        """ContextConfig.copy_only: is verifying the copy chain alone the faster step?"""
        if not self.ctx.copy_only or self.cost_model is None or not self.search.max_nodes:
            return False
        verify_ms, overhead_ms, tau = self.cost_model
        theta = self.search.max_nodes
        w = self.ctx.copy_gain_prior_steps
        g = (w * (tau[min(theta, len(tau) - 1)] - 1.0) + self.gain_sum) / (w + self.gain_steps)
        overhead_ms = (overhead_ms + self.overhead_sum) / (1 + self.overhead_steps)
        e_copy = expected_copy_tokens(p, L)
        copy_speed = e_copy / interpolate(verify_ms, L + 1)
        tree_speed = (e_copy + g) / (interpolate(verify_ms, theta + L + 1) + overhead_ms)
        return copy_speed > tree_speed

    def _remember(self) -> None:
        """Fold the request just decoded into the drafter's history (ContextConfig.copy_history),
        forgetting the oldest trials proportionally beyond that many."""
        if self.ctx.copy_history <= 0 or self.copy_trials is None:  # no request decoded yet
            return
        self.hist_kept += self.copy_kept
        self.hist_trials += self.copy_trials
        total = self.hist_trials.sum()
        if total > self.ctx.copy_history:
            keep = self.ctx.copy_history / total
            self.hist_kept *= keep
            self.hist_trials *= keep

    def copy_prob(self, match_len: int | None = None) -> float:
        """p: the estimated chance that the target keeps the next copy token of a copy found by a
        suffix match of `match_len` tokens (None: pooled over all matches) (ContextConfig)."""
        c = self.ctx
        w = c.copy_prior_weight
        hist = (w * c.copy_p + self.hist_kept.sum()) / (w + self.hist_trials.sum())  # earlier requests, pooled
        pooled = (w * hist + self.copy_kept.sum()) / (w + self.copy_trials.sum())
        if match_len is None or self.copy_kept.size == 1:
            return float(pooled)
        b = self._bucket(match_len)
        rel = (w * hist + self.hist_kept[b]) / (w + self.hist_trials[b]) / hist  # the bucket's reliability
        prior = min(pooled * rel, 0.99)
        return float((w * prior + self.copy_kept[b]) / (w + self.copy_trials[b]))

    def _bucket(self, match_len: int) -> int:
        return min(max(match_len, 1), self.copy_kept.size) - 1

    def _copy_chain(self, ids: list[int], head_p: float = 1.0) -> tuple[list[int], int, np.float32]:
        """The copy continuation of `ids` and its p, cut where the path probability head_p x p^depth
        falls below copy_min_prob; ([], 0, p) without one."""
        c = self.ctx
        chain, n = copy_match(ids, c.copy_max_ngram, c.copy_len, c.copy_periodic) if c.copy else ([], 0)
        p = np.float32(self.copy_prob(n if chain else None))  # fixed for the step
        keep = int(np.sum(head_p * p ** np.arange(1, len(chain) + 1) >= c.copy_min_prob)) if chain else 0
        return chain[:keep], n, p

    def _offer_copy(self, ids: list[int]) -> tuple[list[int], np.float32]:
        """This step's copy chain and its p (`_copy_chain`), recorded so that `score_copies` scores it
        against what the target produces, whether or not the step verifies it."""
        chain, n, p = self._copy_chain(ids)
        self._last_copies = [(len(ids), [], chain, self._bucket(n))] if chain else []
        return chain, p

    def _copy_path(self, ids: list[int], ngram, chain: list[int], p: np.float32,
                   head: tuple[int, np.float32] | None = None) -> list[tuple[list[int], np.ndarray]]:
        """The copy chain as a scored candidate path (ContextConfig.copy); with head = (token, its
        level-0 search score), the path [token] + chain (ContextConfig.copy_branches)."""
        cfg = self.search
        if not chain:
            return []
        f32 = np.float32
        path = ([head[0]] if head else []) + chain
        lvl = np.arange(len(path))
        inc = np.log(p + f32(cfg.eps)) * (cfg.logit_decay ** lvl).astype(f32)
        if head:
            inc[0] = head[1]  # level 0 carries w_level = 1 and no n-gram term (search.py)
        if ngram is not None and cfg.w_ngram and len(path) > 1:
            full = ids + path
            L = len(ids)
            rows = np.array([[full[L + i - 2], full[L + i - 1]] for i in range(1, len(path))], dtype=np.int64)
            q = ngram.prob(rows, np.asarray(path[1:], dtype=np.int64)[:, None])[:, 0].astype(f32)
            inc[1:] += np.log(q + f32(cfg.eps)) * f32(cfg.w_ngram)
        score = np.cumsum(((lvl + 1.0) ** -cfg.level_exponent).astype(f32) * inc, dtype=np.float32)
        return [(path, score)]

    def _branch_paths(self, ids: list[int], ngram, logp: np.ndarray, toks: np.ndarray, skip: int | None):
        """ContextConfig.copy_branches: the head's most likely first tokens (not `skip`), each followed
        by its own copy. Returns (scored paths, copy nodes they add)."""
        paths, extra = [], 0
        for j in range(toks.shape[1]):
            if len(paths) == self.ctx.copy_branches:
                break
            t = int(toks[0, j])
            if t == skip or t in self.eos:
                continue
            head_p = float(np.exp(logp[0, j]))
            chain, n, p = self._copy_chain(ids + [t], head_p)
            if not chain:
                continue
            self._last_copies.append((len(ids), [t], chain, self._bucket(n)))
            paths += self._copy_path(ids, ngram, chain, p, head=(t, logp[0, j]))
            extra += len(chain)
        return paths, extra

    def wants_head(self, ids) -> bool:
        chain, p = self._offer_copy(ids)
        return not (chain and self._copy_only_pays(len(chain), p))

    def propose(self, ids, logits: torch.Tensor | None = None):
        t0 = time.perf_counter()
        chain, p = self._offer_copy(ids)
        if logits is None and chain and self._copy_only_pays(len(chain), p):
            self._tree_step = False
            self.copy_only_steps += 1
            self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0, "copy_only": True}
            return Tree.from_paths(ids[-1], [chain])
        self._tree_step = True
        logits = self.draft_logits() if logits is None else logits
        logp, toks = topk_levels(logits, self.search.topk, self._d2t)
        t1 = time.perf_counter()
        ngram = self.ngram
        if self.local is not None:
            self.local.sync(ids)
            ngram = MixedNGram(self.ngram, self.local, self.ctx.w_context if self.ngram is not None else 1.0)
        paths = self._copy_path(ids, ngram, chain, p)
        extra = len(chain)
        if self.ctx.copy and self.ctx.copy_branches:
            more, n_more = self._branch_paths(ids, ngram, logp, toks, chain[0] if chain else None)
            paths, extra = paths + more, extra + n_more
        search = self.search
        if paths and search.max_nodes:  # copy nodes come on top of the budget (ContextConfig)
            search = dataclasses.replace(search, max_nodes=search.max_nodes + extra)
        tree = tree_search_with_paths(logp, toks, ids, ngram, search, self.eos, paths)
        self.last_timing = {"draft_ms": (t1 - t0) * 1e3, "search_ms": (time.perf_counter() - t1) * 1e3}
        self.overhead_sum += self.last_timing["draft_ms"] + self.last_timing["search_ms"]
        self.overhead_steps += 1
        return tree

    def config(self) -> dict:
        return {**super().config(), "context": dataclasses.asdict(self.ctx)}


class CopyOrAR(Drafter):
    """dart-ctx when the automatic budget finds no tree that beats AR: no head forward, no search; each
    step verifies the copy chain alone when that is faster than a one-token step by the cost curve,
        E_copy = 1 + sum_{i<=L} p^i tokens in verify(L + 1) ms  >  1 token in verify(1) ms,
    else the root alone (an AR step). Before, such a request ran as plain AR and dropped the copies
    that pay even where the head does not. The copy bookkeeping (p per match length, the history) is
    the ContextDrafter's, and a copy not proposed is scored too (one trial: the token the AR step
    produced), so p keeps following the text and copies come back when it starts repeating."""

    def __init__(self, drafter: ContextDrafter, verify_ms: dict[int, float]):
        super().__init__()
        self.drafter, self.verify_ms = drafter, verify_ms
        self.ar_speed = 1.0 / interpolate(verify_ms, 1)  # tokens per ms of a one-token step
        self.name = drafter.name
        self.copy_only_steps = 0

    def begin(self, target, ids, aux):
        self.drafter.begin_copies(ids)
        self.copy_only_steps = 0

    def propose(self, ids):
        t0 = time.perf_counter()
        chain, p = self.drafter._offer_copy(ids)
        L = len(chain)
        pays = L > 0 and expected_copy_tokens(p, L) / interpolate(self.verify_ms, L + 1) > self.ar_speed
        self.copy_only_steps += pays
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0,
                            **({"copy_only": True} if pays else {})}
        return Tree.from_paths(ids[-1], [chain]) if pays else Tree.single(ids[-1])

    def observe(self, ids, aux):
        self.drafter.score_copies(ids)

    def config(self) -> dict:
        return {**self.drafter.config(), "without_tree": "copy or AR"}
