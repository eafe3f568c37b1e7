"""The tree builders (`builders.py`) against their definitions, by brute force over every path of small cases; the
rank-prefix property the budget reads tau(theta) from; and fp32 identity with AR for every builder."""
import itertools

import numpy as np
import pytest
import torch

from dart_lab import GenerationConfig, generate
from dart_lab.builders import BUILDERS, best_first, best_first_scored, build, chain
from dart_lab.drafters import DartDrafter
from dart_lab.ngram import NGram
from dart_lab.search import TreeSearchConfig, log32, topk_levels, tree_search


def _paths(tree) -> list[tuple[int, ...]]:
    """Each drafted node's token path, in the order the builder took them (rank)."""
    toks = tree.tokens.tolist()
    order = sorted(range(1, len(tree)), key=lambda i: int(tree.ranks[i]))
    return [tuple(toks[j] for j in tree.path_to(i)[1:]) for i in order]


@pytest.mark.parametrize("seed", range(6))
def test_best_first_takes_the_most_probable_prefixes_in_order(seed):
    """DDTree's rule: the theta prefixes of highest prod_l p_l(x_l) (full softmax), ties to the smaller rank tuple,
    taken in that order; brute force over every rank tuple."""
    g = torch.Generator().manual_seed(seed)
    D, V = int(torch.randint(1, 5, (), generator=g)), int(torch.randint(2, 6, (), generator=g))
    logits = torch.randn(D, V, generator=g) * 2
    if seed % 2:
        logits[:, 0] = logits[:, 1]  # exact ties between tokens
    lp = torch.log_softmax(logits, -1)
    vals, idx = torch.sort(lp, dim=-1, descending=True, stable=True)
    for theta in (1, 3, 7, 20, 200):
        k = min(theta, V)
        paths = []
        for d in range(1, D + 1):
            for ranks in itertools.product(range(k), repeat=d):
                w = 0.0
                for lvl, r in enumerate(ranks):
                    w += float(vals[lvl, r].double())
                paths.append((-w, ranks))
        want = [tuple(int(idx[lvl, r]) for lvl, r in enumerate(ranks)) for _, ranks in sorted(paths)[:theta]]
        assert _paths(best_first(logits, 7, theta)) == want, (seed, theta)


def _released_score(logp, tokens, path_ranks, context, ngram, cfg):
    """The released search's score of one path (search._levels' float32 arithmetic), path by path."""
    f32 = np.float32
    score, a, b = f32(0.0), (context[-2] if len(context) >= 2 else -1), context[-1]
    for d, r in enumerate(path_ranks):
        t = int(tokens[d, r])
        inc = f32(logp[d, r]) * f32(cfg.logit_decay ** d)
        if ngram is not None and cfg.w_ngram and (d > 0 or cfg.ngram_at_level0):
            p = f32(ngram.prob(np.array([[a, b]]), np.array([[t]]))[0, 0])
            inc = inc + log32(np.array([p + f32(cfg.eps)], dtype=f32))[0] * f32(cfg.w_ngram)
        score = score + f32((d + 1) ** -cfg.level_exponent) * inc
        a, b = b, t
    return float(score)


@pytest.mark.parametrize("seed", range(6))
def test_best_first_with_the_ngram_takes_the_best_released_scores_in_order(seed):
    rng = np.random.default_rng(seed)
    V, D, K = 12, int(rng.integers(1, 4)), int(rng.integers(2, 5))
    ng = NGram.from_sequences([rng.integers(0, V, 200).tolist()], V)
    logits = torch.from_numpy(rng.standard_normal((D, V)).astype(np.float32) * 2)
    cfg = TreeSearchConfig(topk=K, w_ngram=float(rng.choice([0.0, 0.5, 1.0])), ngram_at_level0=bool(seed % 2))
    logp, toks = topk_levels(logits, K)
    context = rng.integers(0, V, 3).tolist()
    scored = sorted((-_released_score(logp, toks, ranks, context, ng, cfg), len(ranks), ranks)
                    for d in range(1, D + 1) for ranks in itertools.product(range(K), repeat=d))
    for theta in (1, 4, 10, 100):
        want = [tuple(int(toks[lvl, r]) for lvl, r in enumerate(ranks)) for *_, ranks in scored[:theta]]
        got = _paths(best_first_scored(logp, toks, context, theta, ng, cfg))
        assert sorted(got) == sorted(want) and len(got) == min(theta, len(scored)), (seed, theta)
        assert [s for s, *_ in scored[:theta]] == sorted(-_released_score(logp, toks, _ranks(p, toks), context, ng, cfg)
                                                         for p in got)  # taken best first


def _ranks(path, toks):
    return tuple(int(np.flatnonzero(toks[d] == t)[0]) for d, t in enumerate(path))


def test_the_chain_is_the_top1_of_each_level_and_dart_is_the_released_search():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 30, generator=g)
    assert _paths(chain(logits, 3, 4)) == [tuple(logits.argmax(-1)[:d].tolist()) for d in range(1, 5)]
    assert len(chain(logits, 3, 99)) == 6  # no deeper than the levels
    ng = NGram.from_sequences([torch.randint(0, 30, (300,), generator=g).tolist()], 30)
    cfg = TreeSearchConfig(max_nodes=12)
    logp, toks = topk_levels(logits, cfg.topk)
    ref = tree_search(logp, toks, [4, 3], ng, cfg)
    got = build("dart", logits, [4, 3], 12, ng, cfg)
    assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.parents, ref.parents)


@pytest.mark.parametrize("name", BUILDERS)
def test_a_smaller_budget_is_the_first_ranks_of_a_bigger_one(name):
    """What the tree budget reads tau(theta) from: the tree of theta nodes = the widest tree's nodes of rank < theta."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 40, generator=g) * 2
    ng = NGram.from_sequences([torch.randint(0, 40, (400,), generator=g).tolist()], 40)
    cfg = TreeSearchConfig()
    wide = _paths(build(name, logits, [5, 9], 60, ng, cfg))
    for theta in (1, 2, 4, 8, 16, 32):
        assert _paths(build(name, logits, [5, 9], theta, ng, cfg)) == wide[:theta] or \
            sorted(_paths(build(name, logits, [5, 9], theta, ng, cfg))) == sorted(wide[:theta]), (name, theta)


@pytest.mark.parametrize("name", BUILDERS)
def test_every_builder_is_lossless_in_fp32(name):
    from conftest import tiny_target
    from dart_lab.methods import random_head

    target = tiny_target("llama", runner="fast")
    g = torch.Generator().manual_seed(2)
    ng = NGram.from_sequences([torch.randint(3, target.vocab_size, (300,), generator=g).tolist()], target.vocab_size)
    prompt = torch.randint(3, target.vocab_size, (12,), generator=g)
    cfg = GenerationConfig(max_new_tokens=24)
    d = DartDrafter(random_head(target, "dart"), ng, TreeSearchConfig(max_nodes=16, builder=name))
    res = generate(target, prompt, d, cfg)
    assert res.tokens == generate(target, prompt, None, cfg).tokens
    assert max(s["tree_size"] for s in res.steps) > 1  # it drafted trees
