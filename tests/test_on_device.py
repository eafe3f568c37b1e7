"""The search and greedy acceptance as batched tensor ops (`engine.on_device`) equal the references: the numpy
search (`search.tree_search_batch` with the engine unplugged, and `tree_search` row by row) bit for bit, the golden
vectors of the released search, and `acceptance.greedy_accept` node for node."""
import json

import numpy as np
import pytest
import torch

from dart_lab import fast
from dart_lab.acceptance import greedy_accept
from dart_lab.engine.on_device import DeviceNGram, greedy_accept_batch, search_batch, trees
from dart_lab.ngram import NGram
from dart_lab.search import TreeSearchConfig, topk_levels, tree_search, tree_search_batch
from dart_lab.tree import Tree


def _inputs(rng, R: int, L: int, K: int, V: int):
    logits = torch.from_numpy(rng.standard_normal((R, L, V)).astype(np.float32) * 3)
    vals, idx = torch.topk(logits, K, dim=-1)
    logp = np.log(torch.softmax(vals, -1).numpy() + np.float32(1e-10))
    return logp, idx.numpy().astype(np.int64)


def _last2(contexts) -> torch.Tensor:
    return torch.tensor([[c[-2] if len(c) >= 2 else -1, c[-1]] for c in contexts])


def _same(a: Tree, b: Tree) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("tokens", "parents", "ranks", "scores"))


@pytest.mark.parametrize("seed", range(4))
def test_the_batched_search_is_the_reference_bit_for_bit(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    V = 40
    ng = NGram.from_sequences([rng.integers(0, V, 400).tolist() for _ in range(3)], V)
    for trial in range(12):
        R, L, K = (int(rng.integers(lo, hi)) for lo, hi in ((1, 7), (1, 9), (1, 9)))
        cfg = TreeSearchConfig(max_nodes=int(rng.integers(1, 70)), beam_width=int(rng.integers(1, 25)),
                               w_ngram=float(rng.choice([0.0, 0.3, 1.0])), ngram_at_level0=bool(trial % 2))
        logp, toks = _inputs(rng, R, L, K, V)
        contexts = [rng.integers(0, V, int(rng.integers(1, 5))).tolist() for _ in range(R)]
        eos = frozenset(rng.integers(0, V, int(rng.integers(0, 3))).tolist())
        table = ng if trial % 3 else None
        with monkeypatch.context() as m:
            m.setattr(fast, "_OPS", {})  # the numpy reference
            ref = tree_search_batch(logp, toks, contexts, table, cfg, eos)
        rows = [tree_search(logp[r], toks[r], contexts[r], table, cfg, eos) for r in range(R)]
        got = trees(search_batch(torch.from_numpy(logp), torch.from_numpy(toks), _last2(contexts),
                                 DeviceNGram(table, "cpu") if table is not None else None, cfg, eos))
        assert len(got) == R
        for r in range(R):
            assert _same(got[r], ref[r]) and _same(got[r], rows[r]), (seed, trial, r, cfg)


def test_the_device_ngram_is_the_ngram():
    rng = np.random.default_rng(1)
    V = 30
    ng = NGram.from_sequences([rng.integers(0, V, 500).tolist()], V)
    ctx = rng.integers(-1, V, (200, 2))
    tok = rng.integers(0, V, (200, 5))
    want = ng.prob(ctx, tok)
    got = DeviceNGram(ng, "cpu").prob(torch.from_numpy(ctx), torch.from_numpy(tok)).numpy()
    assert np.array_equal(got, want) and (want > 0).mean() > 0.2  # the tables are hit, not only missed


def test_the_batched_search_reproduces_the_released_search():
    from test_conformance import DIR, _config, _logits, _paths, _sets, _trie

    sets = _sets("search")
    if not sets:
        pytest.skip(f"no conformance folder at {DIR}")
    for path in sets:
        spec = json.loads(path.read_text())
        ng = _trie(spec)
        dev_ng = DeviceNGram(ng, "cpu")
        groups: dict = {}
        for case in spec["cases"]:
            cfg = _config(case["config"])
            logp, toks = topk_levels(_logits(case, spec["vocab_size"]), cfg.topk, eps=cfg.eps)
            groups.setdefault((cfg, logp.shape, frozenset(case["eos_ids"])), []).append((case, logp, toks))
        assert sum(len(g) for g in groups.values()) == len(spec["cases"]) and any(len(g) > 1 for g in groups.values())
        for (cfg, _, eos), group in groups.items():  # the cases of one config, shape and EOS set as one batch
            out = trees(search_batch(torch.from_numpy(np.stack([g[1] for g in group])),
                                     torch.from_numpy(np.stack([g[2] for g in group])),
                                     _last2([g[0]["context"] for g in group]), dev_ng, cfg, eos))
            for (case, _, _), tree in zip(group, out):
                assert _paths(tree) == {tuple(p) for p in case["expected_paths"]}, case["id"]


def _random_tree(rng, n: int, vocab: int) -> Tree:
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    return Tree(torch.from_numpy(rng.integers(0, vocab, n)), torch.tensor(parents))


@pytest.mark.parametrize("seed", range(3))
def test_batched_greedy_acceptance_is_greedy_accept(seed):
    """Several padded trees at once; a small vocabulary makes sibling tokens repeat and long paths likely."""
    rng = np.random.default_rng(seed)
    for _ in range(40):
        ts = [_random_tree(rng, int(rng.integers(1, 24)), int(rng.integers(1, 5))) for _ in range(int(rng.integers(1, 6)))]
        bests = [rng.integers(0, 4, len(t)) for t in ts]
        N = max(len(t) for t in ts) + int(rng.integers(0, 3))
        tok, par, best = (torch.full((len(ts), N), v, dtype=torch.long) for v in (0, -1, 0))
        for r, (t, b) in enumerate(zip(ts, bests)):
            tok[r, :len(t)], par[r, :len(t)], best[r, :len(t)] = t.tokens, t.parents, torch.from_numpy(b)
        path, length, bonus = greedy_accept_batch(tok, par, best)
        for r, (t, b) in enumerate(zip(ts, bests)):
            want, want_bonus = greedy_accept(t, b.tolist())
            assert path[r, :length[r] + 1].tolist() == want and int(bonus[r]) == want_bonus
            assert (path[r, length[r] + 1:] == -1).all()


def test_tree_layouts_built_from_parents_are_the_ancestor_closure():
    from dart_lab.engine.on_device import tree_layout

    rng = np.random.default_rng(5)
    ts = [_random_tree(rng, int(rng.integers(1, 40)), 9) for _ in range(7)]
    N = max(len(t) for t in ts) + 2
    par = torch.full((len(ts), N), -1, dtype=torch.long)
    for r, t in enumerate(ts):
        par[r, :len(t)] = t.parents
    depth, mask = tree_layout(par)
    for r, t in enumerate(ts):
        n = len(t)
        assert torch.equal(mask[r, :n, :n], t.ancestor_mask()) and torch.equal(depth[r, :n], t.depths)
        assert torch.equal(mask[r, n:], torch.eye(N, dtype=torch.bool)[n:])  # pads see only themselves


def test_a_batch_searching_on_the_device_drafts_the_reference_trees_and_stays_lossless(monkeypatch):
    """`drafters.propose_rows` through the device search (on a GPU; forced here on the CPU): the same trees as the
    host search, and batched DART equals AR row for row."""
    from conftest import tiny_target
    from dart_lab import GenerationConfig, generate, generate_batch
    from dart_lab.drafters import DartDrafter, draft_logits_batch, propose_rows
    from dart_lab.engine import ops
    from dart_lab.methods import random_head

    target = tiny_target("llama", runner="fast")
    g = torch.Generator().manual_seed(3)
    ng = NGram.from_sequences([torch.randint(3, target.vocab_size, (300,), generator=g).tolist()], target.vocab_size)
    head = random_head(target, "dart")
    prompts = [torch.randint(3, target.vocab_size, (n,), generator=g).tolist() for n in (9, 14, 5)]
    cfg = GenerationConfig(max_new_tokens=20)

    def drafters():
        return [DartDrafter(head, ng, TreeSearchConfig(max_nodes=16)) for _ in prompts]

    ds, ids = drafters(), []
    for d, p in zip(ds, prompts):
        out = target.prefill(torch.tensor(p), want_aux=True, all_logits=False)
        ids.append(p + [int(out.logits[-1].argmax())])  # the prompt and its first new token: the first root
        d.begin(target, ids[-1], out.aux)
    logits = draft_logits_batch(ds)
    host = propose_rows(ds, ids, logits)
    monkeypatch.setattr(ops, "SEARCH_ON_DEVICE", ("cpu", "cuda"))
    device = propose_rows(ds, ids, logits)
    assert all(torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents) for a, b in zip(host, device))
    batched = generate_batch(target, prompts, drafters(), cfg)
    for p, row in zip(prompts, batched.rows):
        assert row.tokens == generate(target, p, None, cfg).tokens
