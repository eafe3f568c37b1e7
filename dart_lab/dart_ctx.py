"""dart-ctx: beyond the paper. DART's tree plus what the request's own text offers: a request-local
n-gram mixed into the search's n-gram term, and copy candidates (the continuation of the longest
suffix match, as prompt lookup finds it) scored into the tree with a copy probability learned per match
length; a copy-only step when the copy alone is expected to beat a tree step, and copy-or-AR when no
tree pays (`CopyOrAR`). The faithful drafters are in drafters.py; the measurements behind each choice
in docs/dart_ctx.md.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from .cost import copy_cap, expected_copy_tokens, interpolate
from .drafters import CopyIndex, DartDrafter, copy_match
from .generate import Drafter
from .policy import DraftPolicy, register
from .ngram import LocalNGram, NGram
from .search import TreeSearchConfig, topk_levels, tree_search_with_paths
from .tree import Tree


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
        pooled): a copy found by a long match is far more often right (docs/dart_ctx.md, on
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
        re-joins the text); experiments/dart_ctx/copy_headroom.py bounds it: on copy_edit, tau 2.31 copying
        alone, 3.81 with a head that is always right at the failed token and the copy that follows
        it. Branch nodes whose path probability (head p x p^depth) is at least copy_min_prob come on
        top of the budget, like the copy's. Off by default (0): on a small CPU it measured level
        with dart-ctx without it (copy_edit, docs/dart_ctx.md); `dart-ctx-branch` turns it on, for
        devices where tree nodes are cheap.
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
    """p(t | a, b) = (1 - w) corpus(t | a, b) + w local(t | a, b); the `NGram.prob` interface. With a corpus
    `NGram`, the compiled search reads both (`compiles`, `tables`, `local_tables`: csrc/search.cpp)."""

    def __init__(self, corpus, local, w: float):
        self.corpus, self.local, self.w = corpus, local, w

    @property
    def compiles(self) -> bool:
        return type(self.corpus) is NGram and isinstance(self.local, LocalNGram) and self.local.max_id < self.corpus.V

    def tables(self) -> tuple:
        return self.corpus.tables()

    def local_tables(self) -> tuple:
        return (*self.local.tables(self.corpus.V), float(self.w))

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
        self._ids_src = None  # the request's token list, indexed by `_copy_lookup` (from begin_copies)

    def begin(self, target, ids, aux):
        self.begin_copies(ids)
        self._tree_step = False  # was the last step a tree step (head + search)?
        self.copy_only_steps = 0
        self.gain_sum, self.gain_steps = 0.0, 0  # head tokens beyond the copy, over tree steps with a copy
        self.overhead_sum, self.overhead_steps = 0.0, 0  # drafting + search ms of this request's tree steps
        self.local = LocalNGram(ids) if self.ctx.w_context > 0 else None  # grown in place each tree step
        self._offered = None  # (len(ids), chain, p) from `wants_head`, for the `propose` of the same step
        super().begin(target, ids, aux)

    def begin_copies(self, ids) -> None:
        """A new request for the copy bookkeeping: the last one joins the history (copy_history)."""
        self._remember()
        c, b = self.ctx, max(1, self.ctx.copy_match_buckets)
        # copy tokens kept / tried per match length, Python numbers (`copy_prob` runs for every row every step): whole
        # numbers, so their sums are exact in any order; the history's pooled p and each bucket's reliability are
        # fixed for the request
        self.copy_kept, self.copy_trials = [0.0] * b, [0.0] * b
        w = c.copy_prior_weight
        self._hist = float((w * c.copy_p + self.hist_kept.sum()) / (w + self.hist_trials.sum()))  # earlier requests
        self._rel = [float((w * self._hist + self.hist_kept[i]) / (w + self.hist_trials[i]) / self._hist)
                     for i in range(b)]
        self.last_copies = []  # (len(ids) at the proposal, head token before it ([] or [t]), copy chain, match bucket)
        self._ids_src = None  # the request's token list, indexed by `_copy_lookup`

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
        for at, prefix, chain, bucket in self.last_copies:
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
        self.last_copies = []
        return kept

    def set_cost_model(self, verify_ms, overhead_ms, tau) -> None:
        self.cost_model = (verify_ms, overhead_ms, tau)

    def without_tree(self, verify_ms):
        """No tree beats AR (the automatic budget fell back; seen at T=1 on a CPU where nodes are dear):
        dart-ctx still verifies a copy where it beats a one-token step (`CopyOrAR`)."""
        return CopyOrAR(self, verify_ms) if self.ctx.copy else None

    def copy_only_pays(self, L: int, p: float) -> bool:
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
        self.hist_kept += np.asarray(self.copy_kept)
        self.hist_trials += np.asarray(self.copy_trials)
        total = self.hist_trials.sum()
        if total > self.ctx.copy_history:
            keep = self.ctx.copy_history / total
            self.hist_kept *= keep
            self.hist_trials *= keep

    def copy_prob(self, match_len: int | None = None) -> float:
        """p: the estimated chance that the target keeps the next copy token of a copy found by a
        suffix match of `match_len` tokens (None: pooled over all matches) (ContextConfig)."""
        w = self.ctx.copy_prior_weight
        pooled = (w * self._hist + sum(self.copy_kept)) / (w + sum(self.copy_trials))
        if match_len is None or len(self.copy_kept) == 1:
            return pooled
        b = self.match_bucket(match_len)
        prior = min(pooled * self._rel[b], 0.99)  # the bucket's reliability over earlier requests
        return (w * prior + self.copy_kept[b]) / (w + self.copy_trials[b])

    def match_bucket(self, match_len: int) -> int:
        return min(max(match_len, 1), len(self.copy_kept)) - 1

    def copy_candidate(self, ids: list[int], head_p: float = 1.0) -> tuple[list[int], int, np.float32]:
        """The copy continuation of `ids` and its p, cut where the path probability head_p x p^depth
        falls below copy_min_prob; ([], 0, p) without one."""
        c = self.ctx
        chain, n = self._copy_lookup(ids) if c.copy else ([], 0)
        p = np.float32(self.copy_prob(n if chain else None))  # fixed for the step
        keep = int(np.sum(head_p * p ** np.arange(1, len(chain) + 1) >= c.copy_min_prob)) if chain else 0
        return chain[:keep], n, p

    def _copy_lookup(self, ids: list[int]) -> tuple[list[int], int]:
        """`copy_match` of ids: the request's own list (the first one asked about since `begin_copies`, which the
        decode loop extends step by step) through its `CopyIndex`, grown by its new tokens alone; any other list
        (a branch's ids + [t]) looked up whole."""
        c = self.ctx
        if self._ids_src is None:
            self._ids_src, self._copy_index = ids, CopyIndex(c.copy_max_ngram)
        elif ids is not self._ids_src:
            return copy_match(ids, c.copy_max_ngram, c.copy_len, c.copy_periodic)
        return self._copy_index.match(ids, c.copy_len, c.copy_periodic)

    def copy_offer(self, ids: list[int]) -> tuple[list[int], float]:
        """Without a tree (a theta-0 batch step), the copy chain is what this drafter can verify (none when
        `ContextConfig.copy` is off: `copy_candidate` finds no chain then)."""
        return self.offer_copy(ids)

    def offer_copy(self, ids: list[int]) -> tuple[list[int], np.float32]:
        """This step's copy chain and its p (`copy_candidate`), recorded so that `score_copies` scores it
        against what the target produces, whether or not the step verifies it."""
        chain, n, p = self.copy_candidate(ids)
        self.last_copies = [(len(ids), [], chain, self.match_bucket(n))] if chain else []
        return chain, p

    def copy_path(self, ids: list[int], ngram, chain: list[int], p: np.float32,
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

    def branch_paths(self, ids: list[int], ngram, logp: np.ndarray, toks: np.ndarray, skip: int | None):
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
            chain, n, p = self.copy_candidate(ids + [t], head_p)
            if not chain:
                continue
            self.last_copies.append((len(ids), [t], chain, self.match_bucket(n)))
            paths += self.copy_path(ids, ngram, chain, p, head=(t, logp[0, j]))
            extra += len(chain)
        return paths, extra

    def wants_head(self, ids) -> bool:
        chain, p = self.offer_copy(ids)
        self._offered = (len(ids), chain, p)  # the batch loop's next call is `propose` for the same step
        return not (chain and self.copy_only_pays(len(chain), p))

    def propose(self, ids, logits: torch.Tensor | None = None):
        t0 = time.perf_counter()
        offered, self._offered = self._offered, None
        chain, p = offered[1:] if offered and offered[0] == len(ids) else self.offer_copy(ids)
        if logits is None and chain and self.copy_only_pays(len(chain), p):
            self._tree_step = False
            self.copy_only_steps += 1
            self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0, "copy_only": True}
            return Tree.from_paths(ids[-1], [chain])
        self._tree_step = True
        logits = self.draft_logits() if logits is None else logits
        logp, toks = topk_levels(logits, self.search.topk, self.vocab_map)
        t1 = time.perf_counter()
        ngram = self.ngram
        if self.local is not None:
            self.local.sync(ids)
            ngram = MixedNGram(self.ngram, self.local, self.ctx.w_context if self.ngram is not None else 1.0)
        paths = self.copy_path(ids, ngram, chain, p)
        extra = len(chain)
        if self.ctx.copy and self.ctx.copy_branches:
            more, n_more = self.branch_paths(ids, ngram, logp, toks, chain[0] if chain else None)
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
    step verifies the copy chain alone, cut to the length that gives the most expected tokens per ms by
    the cost curve (`cost.copy_cap`: E_copy = 1 + sum_{i<=L} p^i tokens in verify(L + 1) ms against 1
    token in verify(1) ms), else the root alone (an AR step). So the copies that pay still run where the
    head does not. The copy bookkeeping (p per match length, the history) is the ContextDrafter's, and a
    copy not proposed is scored too (one trial: the token the AR step produced), so p keeps following the
    text and copies come back when it starts repeating. In a batch the rows' offers are priced together
    (`ContextDrafter.copy_offer`, batch.generate_batch)."""

    def __init__(self, drafter: ContextDrafter, verify_ms: dict[int, float]):
        super().__init__()
        self.drafter, self.verify_ms = drafter, verify_ms
        self.name = drafter.name
        self.copy_only_steps = 0

    def begin(self, target, ids, aux):
        self.drafter.begin_copies(ids)
        self.copy_only_steps = 0

    def propose(self, ids):
        t0 = time.perf_counter()
        chain, p = self.drafter.offer_copy(ids)
        L = copy_cap([(chain, p)], self.verify_ms)
        self.copy_only_steps += L > 0
        self.last_timing = {"draft_ms": (time.perf_counter() - t0) * 1e3, "search_ms": 0.0,
                            **({"copy_only": True} if L else {})}
        return Tree.from_paths(ids[-1], [chain[:L]]) if L else Tree.single(ids[-1])

    def observe(self, ids, aux):
        self.drafter.score_copies(ids)

    def config(self) -> dict:
        return {**self.drafter.config(), "without_tree": "copy or AR"}


class ContextPolicy(DraftPolicy):
    """dart-ctx's drafting policy: it decides per step between a tree, a copy and AR, from the budget's cost model
    (`ContextDrafter.set_cost_model`), falls back to copies rather than plain AR, and keeps greedy theta at the
    calibration's while copy-only steps are on (`adapts_budget`)."""

    def adapts(self, sampled: bool) -> bool:
        return True if sampled else self.drafter.adapts_budget

    def wants_head(self, ids: list[int]) -> bool:
        return self.drafter.wants_head(ids)

    def set_cost_model(self, verify_ms, overhead_ms, tau) -> None:
        self.drafter.set_cost_model(verify_ms, overhead_ms, tau)

    def without_tree(self, verify_ms):
        return self.drafter.without_tree(verify_ms)

    def copy_offer(self, ids: list[int]) -> tuple[list[int], float]:
        return self.drafter.copy_offer(ids)


register(ContextDrafter, ContextPolicy)
