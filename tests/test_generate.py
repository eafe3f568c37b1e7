"""Lossless contract: greedy speculative output == greedy AR output; sampling keeps the target law."""
import dataclasses
import math

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_target
from drafters_for_tests import OracleDrafter, RandomDrafter
from dart_lab import GenerationConfig, Tree, generate
from dart_lab.acceptance import accept, sample_accept, sample_token, target_probs


def test_greedy_oracle_and_random_drafts_match_ar(tiny):
    cfg = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = torch.tensor([5, 17, 33, 2, 8, 64])
    ar = generate(tiny, prompt, None, cfg)
    assert ar.new_tokens == 40 and ar.tau == 1.0
    oracle = generate(tiny, prompt, OracleDrafter(prompt.tolist() + ar.tokens, tiny.vocab_size), cfg)
    assert oracle.tokens == ar.tokens
    assert oracle.tau > 4.0  # depth-4 oracle path + bonus accepted at (almost) every step
    assert len(oracle.steps) < len(ar.steps) / 4
    rand = generate(tiny, prompt, RandomDrafter(tiny.vocab_size), cfg)
    assert rand.tokens == ar.tokens
    assert len(rand.steps) > 1


def test_stop_rule_counts_tokens_identically():
    target = tiny_target("llama")
    prompt = torch.tensor([5, 17, 33])
    ar = generate(target, prompt, None, GenerationConfig(max_new_tokens=60, stop_on_eos=False))
    # make the 10th generated token an EOS for this target, then both methods must stop right after it
    target.eos_ids = frozenset({ar.tokens[9]})
    first = ar.tokens.index(ar.tokens[9])
    cfg = GenerationConfig(max_new_tokens=60)
    a = generate(target, prompt, None, cfg)
    o = generate(target, prompt, OracleDrafter(prompt.tolist() + ar.tokens, target.vocab_size, depth=6), cfg)
    assert a.tokens == o.tokens == ar.tokens[:first + 1]
    assert a.stop_reason == o.stop_reason == "eos"


def test_embedded_greedy_oracle_matches_ar(embedded):
    cfg = GenerationConfig(max_new_tokens=24)
    prompt = embedded.encode_prompt("List three colours.")
    ar = generate(embedded, prompt, None, cfg)
    assert embedded.decode(ar.tokens).strip()
    oracle = generate(embedded, prompt, OracleDrafter(prompt.tolist() + ar.tokens, embedded.vocab_size, depth=5), cfg)
    rand = generate(embedded, prompt, RandomDrafter(embedded.vocab_size, seed=1), cfg)
    assert oracle.tokens == ar.tokens == rand.tokens
    assert oracle.tau > 3.0


# ----------------------------------------------------------------------------- sampling
def exact_two_token_law(target, prompt, cfg):
    """P(t1, t2) under AR sampling, from exact target probabilities: (V, V)."""
    V = target.vocab_size
    with torch.no_grad():
        p1 = target_probs(target.model(prompt[None]).logits[0, -1:], cfg)[0]
        seqs = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
        p2 = target_probs(target.model(seqs).logits[:, -1], cfg)
    return p1[:, None] * p2


def chi2_pvalue(samples, law):
    counts = torch.zeros_like(law).flatten()
    for a, b in samples:
        counts[a * law.shape[1] + b] += 1
    expected = law.flatten() * len(samples)
    # pool rare cells so the chi-square approximation holds
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue


@pytest.mark.slow  # a statistical test: many sampled decodes
@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=5)])
def test_sampling_is_lossless_on_two_tokens(sampling):
    target = tiny_target("llama", vocab=8, layers=4, hidden=32, seed=3)
    with torch.no_grad():  # a law with both likely and unlikely tokens: accepts AND rejects happen
        target.model.lm_head.weight.mul_(2.0)
    prompt = torch.tensor([2, 5, 3, 7])
    base = GenerationConfig(max_new_tokens=2, stop_on_eos=False, **sampling)
    law = exact_two_token_law(target, prompt, base)
    n = 2500
    drafter = RandomDrafter(8, n_nodes=10, seed=1)
    spec = [tuple(generate(target, prompt, drafter, dataclasses.replace(base, seed=s)).tokens) for s in range(n)]
    assert all(len(s) == 2 for s in spec)
    assert chi2_pvalue(spec, law) > 1e-3
    # the test has power: the same samples are clearly incompatible with a different temperature
    other = exact_two_token_law(target, prompt, GenerationConfig(temperature=base.temperature * 2.0,
                                                                 top_p=base.top_p, top_k=base.top_k))
    assert chi2_pvalue(spec, other) < 1e-6


def test_sample_accept_marginals_with_fixed_probs():
    """Verification alone: with a fixed 2-level tree and fixed target probs, the first emitted token
    follows probs[root] and, after accepting child c, the second follows probs[c]."""
    V = 6
    g = torch.Generator().manual_seed(0)
    tree = Tree(torch.tensor([0, 1, 2, 1, 3, 4]), torch.tensor([-1, 0, 0, 1, 1, 2]))  # child tokens 1,2 / 1,3 / 4
    probs = torch.softmax(torch.randn(len(tree), V, generator=g), dim=-1)
    n, first, second = 20000, torch.zeros(V), torch.zeros(V)
    for _ in range(n):
        path, bonus = sample_accept(tree, probs, g)
        emitted = tree.tokens[path[1:]].tolist() + [bonus]
        first[emitted[0]] += 1
        if len(path) > 1 and path[1] == 1:  # accepted child token 1 at node 1
            second[emitted[1]] += 1
    assert chisquare(first.numpy(), probs[0].numpy() * n).pvalue > 1e-3
    assert chisquare(second.numpy(), probs[1].numpy() * second.sum().item()).pvalue > 1e-3
    assert math.isclose(second.sum().item() / n, probs[0, 1].item(), abs_tol=0.015)


def test_sample_token_follows_p_and_never_draws_a_zero():
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0]) * 3  # unnormalised, zeros inside and at the end
    n = 20000
    counts = torch.bincount(torch.tensor([sample_token(p, g) for _ in range(n)]), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    keep = [1, 3, 4]
    assert chisquare(counts[keep].numpy(), (p[keep] / p.sum() * n).numpy()).pvalue > 1e-3


def test_accept_computes_only_the_visited_rows_with_the_same_result():
    """`accept` hands sample_accept a per-node probability function (rows computed on demand): the same
    paths and bonus tokens, draw for draw, as the full (N, V) probabilities."""
    g = torch.Generator().manual_seed(2)
    tree = Tree(torch.tensor([0, 1, 2, 1, 3, 4, 2]), torch.tensor([-1, 0, 0, 1, 1, 2, 3]))
    logits = torch.randn(len(tree), 8, generator=g) * 2
    logits[:, 1:5] += 2.0  # the drafted tokens are likely: walks go deep
    cfg = GenerationConfig(temperature=0.9, top_p=0.95)
    for seed in range(200):
        got = accept(tree, logits, cfg, torch.Generator().manual_seed(seed))
        assert got == sample_accept(tree, target_probs(logits, cfg), torch.Generator().manual_seed(seed))


def test_target_probs_match_hf_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    cfg = GenerationConfig(temperature=0.8, top_k=10, top_p=0.7)
    x = TemperatureLogitsWarper(0.8)(None, logits.clone())
    x = TopKLogitsWarper(10)(None, x)
    x = TopPLogitsWarper(0.7)(None, x)
    torch.testing.assert_close(target_probs(logits, cfg), torch.softmax(x, -1))
