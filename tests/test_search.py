"""Tree search (Algorithm 1) invariants and equality with a naive reference implementation."""
import math
from collections import Counter

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_lab.ngram import NGram
from dart_lab.search import TreeSearchConfig, _search, topk_levels, tree_search

V = 40


def make_ngram(seed=0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, V, size=rng.integers(5, 60)).tolist() for _ in range(40)]
    return NGram.from_sequences(seqs, V), seqs


def naive_search(logits, context, seqs, cfg, eos):
    """Straightforward restatement of the released rules: python lists, brute-force n-gram counts
    with per-token back-off, float32 scores in the released order of operations, every expansion
    of the beam a candidate, the tree = the best max_nodes candidates."""
    f32 = np.float32
    c3 = Counter(tuple(s[i:i + 3]) for s in seqs for i in range(len(s) - 2))
    c2 = Counter(tuple(s[i:i + 2]) for s in seqs for i in range(len(s) - 1))
    c1 = Counter(t for s in seqs for t in s)

    def p_ng(a, b, t):
        if a is not None and c3[(a, b, t)] > 0:
            return c3[(a, b, t)] / c2[(a, b)]
        if c2[(b, t)] > 0:
            return c2[(b, t)] / c1[b]
        return 0.0

    levels = []
    for row in logits:
        vals, idx = torch.topk(row.float(), cfg.topk)
        p = torch.softmax(vals, -1).numpy()
        levels.append([(t, np.log(p[j] + f32(cfg.eps))) for j, t in enumerate(idx.tolist())])
    nodes = []  # (score, level, token, parent node id)
    beam = [(-1, f32(0.0), [])]  # (node id, score, path)
    for lvl, cands in enumerate(levels):
        wl, wg = f32((lvl + 1) ** -cfg.level_exponent), f32(cfg.logit_decay ** lvl)
        pool = []
        for nid, sc, path in beam:
            full = context + path
            for tok, lp in cands:
                inc = lp * wg
                if cfg.w_ngram and (lvl > 0 or cfg.ngram_at_level0):
                    a = full[-2] if len(full) >= 2 else None
                    # the float32 log as the float64 log rounded once (search.log32)
                    inc = inc + f32(math.log(f32(p_ng(a, full[-1], tok)) + f32(cfg.eps))) * f32(cfg.w_ngram)
                pool.append((sc + wl * inc, nid, tok, path))
        base = len(nodes)
        for sc, parent, tok, _ in pool:
            nodes.append((sc, lvl, tok, parent))
        ranked = sorted(range(len(pool)), key=lambda i: (pool[i][2] in eos, -pool[i][0], i))[: cfg.beam_width]
        beam = [(base + i, pool[i][0], pool[i][3] + [pool[i][2]]) for i in ranked if pool[i][2] not in eos]
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))[: cfg.max_nodes]

    def path(i):
        out = []
        while i != -1:
            out.append(nodes[i][2])
            i = nodes[i][3]
        return tuple(out[::-1])
    return {path(i) for i in order}


def tree_paths(tree):
    toks = tree.tokens.tolist()
    return {tuple(toks[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.5]), st.integers(1, 6), st.integers(1, 12))
@settings(max_examples=40, deadline=None)
def test_matches_naive_reference(seed, w_ng, depth, max_nodes):
    """Also for budgets below the beam width, where the search runs a beam of max_nodes (exact)."""
    ng, seqs = make_ngram(seed % 7)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(depth, V, generator=g) * 3
    cfg = TreeSearchConfig(topk=8, beam_width=5, max_nodes=max_nodes, w_ngram=w_ng)
    context = torch.randint(0, V, (5,), generator=g).tolist()
    eos = frozenset({3})
    logp, toks = topk_levels(logits, cfg.topk)
    tree = tree_search(logp, toks, context, ng, cfg, eos)
    assert tree_paths(tree) == naive_search(logits, context, seqs, cfg, eos)


@given(st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_invariants(seed):
    ng, _ = make_ngram(seed % 5)
    g = torch.Generator().manual_seed(seed)
    # ties on purpose: quantised logits make equal scores common
    logits = torch.randint(0, 3, (8, V), generator=g).float()
    cfg = TreeSearchConfig(topk=25, beam_width=20, max_nodes=60)
    ctx = [1, 2, 5]
    logp, toks = topk_levels(logits, cfg.topk)
    t1 = tree_search(logp, toks, ctx, ng, cfg, frozenset({0}))
    t2 = tree_search(logp, toks, ctx, ng, cfg, frozenset({0}))
    assert torch.equal(t1.tokens, t2.tokens) and torch.equal(t1.parents, t2.parents)  # deterministic
    assert len(t1) <= cfg.max_nodes + 1 and t1.tokens[0] == 5
    par = t1.parents.tolist()
    assert all(0 <= p < i for i, p in enumerate(par[1:], 1))  # ancestor-closed, topological
    toks_ = t1.tokens.tolist()
    for i in range(1, len(t1)):  # nothing is ever drafted after an EOS
        assert toks_[par[i]] != 0 or par[i] == 0
    for kids in t1.children():  # siblings are distinct tokens
        assert len({toks_[k] for k in kids}) == len(kids)
    sc = t1.scores.tolist()
    assert all(sc[i] <= sc[par[i]] + 1e-12 for i in range(1, len(t1)))
    assert len(t1) == cfg.max_nodes + 1  # 25 + 7 x 500 candidates: the budget is always filled


@given(st.integers(0, 10_000))
@settings(max_examples=20, deadline=None)
def test_small_budget_beam_is_exact_with_ties(seed):
    """A budget N below the beam width searches with a beam of N: the same tree node for node as the
    full beam cut at N, also with many equal scores (quantised logits) and EOS candidates."""
    ng, _ = make_ngram(seed % 5)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (8, V), generator=g).float()
    logp, toks = topk_levels(logits, 25)
    for n in range(1, 21):
        cfg = TreeSearchConfig(topk=25, beam_width=20, max_nodes=n)
        a = _search(logp, toks, [1, 2, 5], ng, cfg, frozenset({0}), nodes=False)
        b = _search(logp, toks, [1, 2, 5], ng, cfg, frozenset({0}), nodes=False, prune=False)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), n


@given(st.integers(0, 10_000))
@settings(max_examples=30, deadline=None)
def test_small_budget_beam_is_exact_with_extra_paths(seed):
    """The same with copy paths merged into the candidates (dart-ctx): continuous scores, random paths
    that share prefixes with the head's candidates or not."""
    ng, _ = make_ngram(seed % 5)
    g = torch.Generator().manual_seed(seed)
    logp, toks = topk_levels(torch.randn(8, V, generator=g) * 3, 25)
    rng = np.random.default_rng(seed)
    for n in range(1, 21):
        L = int(rng.integers(1, 8))
        path = [int(toks[0, rng.integers(0, 3)])] + rng.integers(0, V, L - 1).tolist()
        scores = np.cumsum(-rng.exponential(1.0, L)).astype(np.float32)
        cfg = TreeSearchConfig(topk=25, beam_width=20, max_nodes=n)
        a = _search(logp, toks, [1, 2, 5], ng, cfg, frozenset({0}), nodes=False, extra_paths=[(path, scores)])
        b = _search(logp, toks, [1, 2, 5], ng, cfg, frozenset({0}), nodes=False, extra_paths=[(path, scores)],
                    prune=False)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents), n


def test_eos_paths_rank_last_in_beam():
    logits = torch.full((3, V), -10.0)
    logits[0, 7] = 10.0  # EOS is by far the most likely level-0 token
    logits[0, 8] = 5.0
    logits[1, 9] = 10.0
    cfg = TreeSearchConfig(topk=4, beam_width=1, max_nodes=10, w_ngram=0.0)
    logp, toks = topk_levels(logits, cfg.topk)
    tree = tree_search(logp, toks, [1, 2], None, cfg, frozenset({7}))
    # with beam width 1 the non-EOS token 8 survives level 0 and is expanded; EOS never is, but it
    # stays a candidate and, being the best level-0 token, is drafted as a leaf (released behaviour)
    paths = tree_paths(tree)
    assert (8, 9) in paths and (7,) in paths
    assert not any(p[0] == 7 and len(p) > 1 for p in paths)


def test_draft_vocab_mapping():
    logits = torch.randn(2, 10)
    d2t = torch.arange(10) * 3 + 1
    logp, toks = topk_levels(logits, 4, d2t)
    _, raw = topk_levels(logits, 4)
    assert (toks == (raw * 3 + 1)).all()
    assert logp.dtype == np.float32
    assert np.allclose(np.exp(logp).sum(-1), 1.0, atol=1e-5)


def test_missed_beam_candidate_can_be_a_leaf():
    """Level 1 has one near-certain token: its 2nd best expansion of the best level-0 path outscores
    every beam survivor's deeper expansions, though beam_width 1 drops it from the beam."""
    logits = torch.full((3, V), -20.0)
    logits[0, 5], logits[0, 6] = 5.0, 4.0
    logits[1, 10], logits[1, 11] = 5.0, 4.9
    logits[2, 12] = 5.0
    cfg = TreeSearchConfig(topk=3, beam_width=1, max_nodes=5, w_ngram=0.0)
    logp, toks = topk_levels(logits, cfg.topk)
    paths = tree_paths(tree_search(logp, toks, [1, 2], None, cfg))
    assert (5, 11) in paths  # a candidate of level 1 that was not the beam survivor
    assert (5, 10, 12) in paths


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.5]), st.sampled_from([1, 3, 8, 20, 60]))
@settings(max_examples=30, deadline=None)
def test_a_batch_of_rows_searches_each_row_as_alone(seed, w_ng, max_nodes):
    """`tree_search_batch` gives every row the tree `tree_search` gives it alone, node for node: rows with
    other contexts (short ones too), many equal scores (quantised logits) and EOS candidates; the rows' shared
    numpy loop against each row's search alone (compiled where built)."""
    from dart_lab.search import tree_search_batch

    ng, _ = make_ngram(seed % 5)
    g = torch.Generator().manual_seed(seed)
    R = 1 + seed % 6
    logits = torch.randint(0, 4, (R, 6, V), generator=g).float() + torch.rand(R, 6, V, generator=g) * (seed % 2)
    logp, toks = topk_levels(logits, 25)
    contexts = [torch.randint(0, V, (1 + (seed + r) % 5,), generator=g).tolist() for r in range(R)]
    cfg = TreeSearchConfig(topk=25, beam_width=20, max_nodes=max_nodes, w_ngram=w_ng)
    eos = frozenset({0, 3})
    from dart_lab.engine import kernels

    with kernels.turned_off("search"):  # the rows' shared numpy loop, against each row's compiled search
        batch = tree_search_batch(logp, toks, contexts, ng, cfg, eos)
    for r, tree in enumerate(batch):
        alone = tree_search(logp[r], toks[r], contexts[r], ng, cfg, eos)
        assert torch.equal(tree.tokens, alone.tokens) and torch.equal(tree.parents, alone.parents), r
        assert torch.equal(tree.scores, alone.scores) and torch.equal(tree.ranks, alone.ranks), r


@given(st.integers(0, 10_000), st.sampled_from([0.0, 0.5]), st.sampled_from([1, 2, 4, 8, 20]), st.booleans())
@settings(max_examples=60, deadline=None)
def test_the_compiled_level_loop_equals_the_numpy_loop(seed, w_ng, beam, ng0):
    """`dart_lab::beam_candidates` (csrc/search.cpp) returns the numpy loop's candidates bit for bit: parents,
    float32 scores, levels, ranks and n-gram p, with n-gram hits at every order (a small vocabulary), many equal
    scores (quantised logits), EOS candidates, short contexts, an n-gram term at level 0 or not, no n-gram, and
    dart-ctx's mix of the corpus n-gram with a request's own."""
    from dart_lab.engine import kernels
    from dart_lab.dart_ctx import MixedNGram
    from dart_lab.ngram import LocalNGram
    from dart_lab.search import _levels

    assert kernels.search_here(), kernels._search.get("reason")
    ng, _ = make_ngram(seed % 5)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 4, (7, V), generator=g).float() + torch.rand(7, V, generator=g) * (seed % 2)
    logp, toks = topk_levels(logits, 12)
    cfg = TreeSearchConfig(topk=12, beam_width=beam, max_nodes=60, w_ngram=w_ng, ngram_at_level0=ng0)
    context = torch.randint(0, V, (1 + seed % 4,), generator=g).tolist()
    local = LocalNGram(torch.randint(0, V, (30,), generator=g).tolist() + context)  # a request's own tokens
    mixed = MixedNGram(ng, local, 0.3)  # dart-ctx's mix of the corpus n-gram and the request's
    assert mixed.compiles
    for ngram in (ng, None, mixed):
        a = _levels(logp, toks, context, ngram, cfg, frozenset({0, 3}), 7, beam, compiled=True)
        b = _levels(logp, toks, context, ngram, cfg, frozenset({0, 3}), 7, beam, compiled=False)
        assert a[0].size == b[0].size > 0
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=x.dtype.kind == "f")
