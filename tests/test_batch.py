"""Batched speculation is lossless per row: in fp32 every row of a batch decodes exactly what batch-1 AR
decodes on its prompt, for every method, both runners, mixed prompt lengths and rows that stop at
different steps (EOS, max_new_tokens); sampling keeps each row on the target's law."""
import pytest
import torch

from conftest import tiny_target
from drafters_for_tests import OracleDrafter, RandomDrafter
from test_drafters import all_drafters
from test_generate import chi2_pvalue, exact_two_token_law
from dart_lab import GenerationConfig, generate
from dart_lab.engine.batch_target import BatchTarget
from dart_lab.engine.batch import generate_batch
from dart_lab.tree import Tree

LENGTHS = (3, 11, 6, 20, 9, 4, 15, 7)


def prompts_for(target, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, target.vocab_size, (n,), generator=g) for n in LENGTHS]


def with_eos_mid_answer(target, prompts, cfg):
    """Make a token that AR emits part-way through some answers the EOS, so rows stop at different steps."""
    ar = [generate(target, p, None, cfg).tokens for p in prompts]
    def stop_lengths(tok):
        return {a.index(tok) if tok in a else len(a) for a in ar}

    target.eos_ids = frozenset({max(range(2, target.vocab_size), key=lambda tok: len(stop_lengths(tok)))})
    return [generate(target, p, None, cfg) for p in prompts]


@pytest.mark.parametrize("runner", ["hf", "fast"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_every_row_equals_batch1_ar(arch, runner):
    target = tiny_target(arch, runner=runner)
    cfg = GenerationConfig(max_new_tokens=24)
    prompts = prompts_for(target)
    ar = with_eos_mid_answer(target, prompts, cfg)
    stops = {a.stop_reason for a in ar}
    assert stops == {"eos", "max_new_tokens"} and len({a.new_tokens for a in ar}) > 2  # rows end at different steps
    for B in (1, 2, 3, 8):
        want = [a.tokens for a in ar[:B]]
        assert [r.tokens for r in generate_batch(target, prompts[:B], None, cfg).rows] == want, ("ar", B)
        rand = [RandomDrafter(target.vocab_size, seed=b) for b in range(B)]
        assert [r.tokens for r in generate_batch(target, prompts[:B], rand, cfg).rows] == want, ("random", B)
        oracle = [OracleDrafter(p.tolist() + a.tokens, target.vocab_size) for p, a in zip(prompts[:B], ar)]
        res = generate_batch(target, prompts[:B], oracle, cfg)
        assert [r.tokens for r in res.rows] == want, ("oracle", B)
        assert [r.stop_reason for r in res.rows] == [a.stop_reason for a in ar[:B]]
    assert max(s["rows"] for s in res.steps) == 8 and min(s["rows"] for s in res.steps) < 8  # finished rows leave
    # continuous batching: at most 3 rows at once over all 8 prompts, waiting prompts admitted as rows finish
    for name, ds in (("ar", None), ("random", [RandomDrafter(target.vocab_size, seed=b) for b in range(8)])):
        res = generate_batch(target, prompts, ds, cfg, max_rows=3)
        assert [r.tokens for r in res.rows] == [a.tokens for a in ar], (name, "max_rows=3")
        assert [r.stop_reason for r in res.rows] == [a.stop_reason for a in ar]
        assert max(s["rows"] for s in res.steps) == 3 and res.batch_size == 3
        live = [s["rows"] for s in res.steps]  # full while prompts wait, then the last rows drain
        assert live[0] == 3 and live == sorted(live, reverse=True)


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_every_method_batched_equals_batch1_ar(runner):
    target = tiny_target("llama", runner=runner)
    cfg = GenerationConfig(max_new_tokens=20)
    prompts = prompts_for(target, seed=2)[:3]
    ar = with_eos_mid_answer(target, prompts, cfg)
    for name in ("dart", "dart-no-ngram", "eagle3", "pld", "dart-ctx", "dart-ctx-branch", "sps"):
        drafters = [all_drafters(target)[name] for _ in prompts]
        res = generate_batch(target, prompts, drafters, cfg)
        assert [r.tokens for r in res.rows] == [a.tokens for a in ar], name
        drafters = [all_drafters(target)[name] for _ in prompts]  # two rows at once, the third joins later
        res = generate_batch(target, prompts, drafters, cfg, max_rows=2)
        assert [r.tokens for r in res.rows] == [a.tokens for a in ar], (name, "max_rows=2")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_packed_prefill_equals_each_prompt_alone(arch):
    """The compact runner's prefill packs a batch's prompts end to end into one forward (`pack_tokens`): each
    row's last logits, aux states and cache slots equal its prompt run alone, also when the prompts split
    over several packs."""
    target = tiny_target(arch, runner="fast")
    prompts = prompts_for(target)
    alone = BatchTarget(target, pack_tokens=1)
    ref = alone.prefill(prompts, want_aux=True)
    for most in (2048, 30):  # one pack; packs of at most 30 tokens (and the 20-token prompt in one alone)
        bt = BatchTarget(target, pack_tokens=most)
        out = bt.prefill(prompts, want_aux=True)
        assert bt.lens == alone.lens == [p.numel() for p in prompts]
        for b, n in enumerate(bt.lens):
            torch.testing.assert_close(out.logits[b], ref.logits[b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out.aux[b], ref.aux[b], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bt._k[:, b, :, :n], alone._k[:, b, :, :n], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(bt._v[:, b, :, :n], alone._v[:, b, :, :n], atol=1e-5, rtol=1e-5)


def test_batched_verify_logits_equal_each_row_alone(monkeypatch):
    """Tree logits of a batch = each row's tree verified alone (mixed sizes, padding, holes in the cache); on
    the fast runner every linear sees the real nodes only (pads skipped)."""
    for runner in ("hf", "fast"):
        target = tiny_target("qwen3", runner=runner)
        prompts = prompts_for(target)[:4]
        g = torch.Generator().manual_seed(5)
        trees = []
        for n in (1, 7, 3, 12):
            parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
            trees.append(Tree(torch.randint(2, target.vocab_size, (n,), generator=g), torch.tensor(parents)))
        bt = BatchTarget(target)
        bt.prefill(prompts)
        bt.verify([Tree.single(int(p[-1])) for p in prompts])
        bt.commit([[0]] * 4)
        bt.verify([Tree.from_paths(int(p[-1]), [[3, 4, 5]]) for p in prompts])
        bt.commit([[0], [0, 1, 2], [0, 1], [0]])  # rows of different lengths: holes before the next nodes
        seen = []
        if runner == "fast":
            projections = target.projections

            def spy(prefill=False):
                layers, head = projections(prefill)
                wrap = lambda f: lambda h: seen.append(h.numel() // h.shape[-1]) or f(h)  # noqa: E731
                return [tuple(wrap(f) for f in layer) for layer in layers], head
            monkeypatch.setattr(target, "projections", spy)
        out = bt.verify(trees)
        monkeypatch.undo()
        assert set(seen) == ({1 + 7 + 3 + 12} if runner == "fast" else set())
        for b, (p, tree) in enumerate(zip(prompts, trees)):
            extra = [[int(p[-1])], [int(p[-1]), 3, 4], [int(p[-1]), 3], [int(p[-1])]][b]
            target.prefill(torch.cat([p, torch.tensor([int(p[-1])]), torch.tensor(extra)]))
            alone = target.verify(tree)
            target.commit([0])
            torch.testing.assert_close(out.logits[b], alone.logits, atol=2e-4, rtol=1e-4)


def test_rows_kept_in_any_order_verify_as_alone():
    """`keep` (rows leaving the batch): moved up in place (ascending rows) or gathered (any order), each kept
    row's next verify still equals its row verified alone."""
    for runner in ("hf", "fast"):
        target = tiny_target("llama", runner=runner)
        prompts = prompts_for(target)[:4]
        for rows in ([1, 3], [3, 0, 2], []):
            bt = BatchTarget(target)
            bt.prefill(prompts)
            bt.verify([Tree.from_paths(int(p[-1]), [[3, 4]]) for p in prompts])
            bt.commit([[0, 1], [0], [0, 1, 2], [0]])
            bt.keep(rows)
            assert bt.batch_size == len(rows)
            if not rows:
                continue
            out = bt.verify([Tree.from_paths(5, [[6]]) for _ in rows])
            for i, b in enumerate(rows):
                kept = [int(prompts[b][-1]), 3, 4][:[2, 1, 3, 1][b]]
                target.prefill(torch.cat([prompts[b], torch.tensor(kept)]))
                alone = target.verify(Tree.from_paths(5, [[6]]))
                target.commit([0])
                torch.testing.assert_close(out.logits[i], alone.logits, atol=2e-4, rtol=1e-4)


def test_rows_joining_a_running_batch_verify_as_alone(monkeypatch):
    """`join` (continuous batching: prompts prefilled ahead join as places free), a subset at a time, into the
    store's spare rows and past them: each row's next verify equals its row verified alone -- with fresh
    memory full of NaN, so a hole a mask hides that was never zeroed would show."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan"))
                        if (k.get("dtype") or torch.get_default_dtype()).is_floating_point else empty(*a, **k))
    for runner in ("hf", "fast"):
        target = tiny_target("llama", runner=runner)
        prompts = prompts_for(target)[:5]
        bt = BatchTarget(target, rows_room=4)
        bt.prefill(prompts[:2])
        bt.verify([Tree.from_paths(int(p[-1]), [[3, 4]]) for p in prompts[:2]])
        bt.commit([[0, 1, 2], [0]])
        staged = BatchTarget(target)
        staged.prefill(prompts[2:])
        store = bt._store[0].data_ptr() if bt.fast else None
        bt.join(staged, [1])  # into the room
        assert bt.lens == [prompts[0].numel() + 3, prompts[1].numel() + 1, prompts[3].numel()]
        if bt.fast:
            assert bt._store[0].data_ptr() == store  # copied into place, not reallocated
        bt.join(staged, [2, 0])  # past the room: a wider store
        out = bt.verify([Tree.from_paths(5, [[6]]) for _ in range(5)])
        done = [[int(prompts[0][-1]), 3, 4], [int(prompts[1][-1])], [], [], []]
        for i, b in enumerate([0, 1, 3, 4, 2]):
            target.prefill(torch.cat([prompts[b], torch.tensor(done[i], dtype=torch.long)]))
            alone = target.verify(Tree.from_paths(5, [[6]]))
            target.commit([0])
            assert torch.isfinite(out.logits[i]).all(), (runner, i)
            torch.testing.assert_close(out.logits[i], alone.logits, atol=2e-4, rtol=1e-4)


def test_sampling_rows_follow_the_target_law():
    """T > 0: every row of a batch draws its first two tokens from the target's exact law (chi-square)."""
    target = tiny_target("llama", runner="fast")
    cfg = GenerationConfig(max_new_tokens=2, temperature=1.0, stop_on_eos=False)
    prompts = [torch.tensor([5, 17, 33]), torch.tensor([8, 2, 64, 11, 40])]
    laws = [exact_two_token_law(target, p, cfg) for p in prompts]
    samples = [[], []]
    for seed in range(300):
        c = GenerationConfig(max_new_tokens=2, temperature=1.0, stop_on_eos=False, seed=seed)
        drafters = [RandomDrafter(target.vocab_size, n_nodes=6, seed=seed + b) for b in range(2)]
        for b, r in enumerate(generate_batch(target, prompts, drafters, c).rows):
            samples[b].append(tuple(r.tokens))
    for b in range(2):
        assert chi2_pvalue(samples[b], laws[b]) > 1e-3, b


def test_batched_head_forward_equals_each_drafter_alone():
    """One DART head forward for several rows (left-padded pending positions, padded caches) gives each
    row the logits and the head cache its drafter computes alone."""
    from dart_lab.drafters import DartDrafter, draft_logits_batch
    from dart_lab.methods import random_head

    target = tiny_target("llama", runner="fast")
    head = random_head(target, "dart")
    g = torch.Generator().manual_seed(3)
    H3 = 3 * target.hidden_size
    alone, batched = [DartDrafter(head) for _ in range(3)], [DartDrafter(head) for _ in range(3)]
    for b, n in enumerate((5, 9, 2)):  # prompts of different lengths
        ids = torch.randint(2, target.vocab_size, (n,), generator=g).tolist()
        aux = torch.randn(n, H3, generator=g)
        for d in (alone[b], batched[b]):
            d.begin(target, ids, aux)
    for step, accepted in enumerate(((1, 3, 2), (4, 1, 1))):  # then different accepted lengths per row
        want = [d.draft_logits() for d in alone]
        got = draft_logits_batch(batched)
        for b in range(3):
            torch.testing.assert_close(got[b], want[b], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(batched[b].kv[0], alone[b].kv[0], atol=1e-5, rtol=1e-5)
            assert batched[b].n_cached == alone[b].n_cached
        for b, k in enumerate(accepted):
            ids = torch.randint(2, target.vocab_size, (k + 4,), generator=g).tolist()
            aux = torch.randn(k, H3, generator=g)
            alone[b].observe(ids, aux)
            batched[b].observe(ids, aux)


def test_dart_rows_searched_together_draft_each_rows_own_tree(monkeypatch):
    """A batch step's DART rows search in one `tree_search_batch` (`drafters.propose_rows`, grouped in
    `batch._draft`): every row gets the tree its drafter's own `propose` gives on the same logits, and a
    batched decode goes through it (and stays lossless)."""
    from dart_lab.drafters import DartDrafter, propose_rows
    from dart_lab.methods import random_head
    from dart_lab.ngram import NGram

    target = tiny_target("llama", runner="fast")
    head = random_head(target, "dart")
    g = torch.Generator().manual_seed(5)
    ng = NGram.from_sequences([torch.randint(2, 60, (40,), generator=g).tolist() for _ in range(20)], target.vocab_size)
    ds = [DartDrafter(head, ng) for _ in range(4)]
    for d in ds:
        d.set_budget(12)
        d.eos = frozenset({3})
    ids = [torch.randint(2, 60, (n,), generator=g).tolist() for n in (1, 4, 7, 3)]
    logits = [torch.randn(head.cfg.n_masks + 1, head.cfg.draft_vocab_size, generator=g) for _ in ds]
    for got, d, i, lg in zip(propose_rows(ds, ids, logits), ds, ids, logits):
        want = d.propose(i, lg)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    calls = []
    monkeypatch.setattr("dart_lab.drafters.propose_rows", lambda *a: calls.append(len(a[0])) or propose_rows(*a))
    prompts = prompts_for(target)[:3]
    cfg = GenerationConfig(max_new_tokens=6, stop_on_eos=False)
    rows = [DartDrafter(head, ng) for _ in prompts]
    res = generate_batch(target, prompts, rows, cfg)
    assert calls and max(calls) == len(prompts)
    assert [r.tokens for r in res.rows] == [generate(target, p, None, cfg).tokens for p in prompts]


def test_a_greedy_batch_step_accepts_and_records_margins_as_each_row_alone():
    """Step 3 of a batch (`batch._accept`) takes every node's argmax and margin in one op over the flat logits
    (one copy to the host per step): the same paths, bonus tokens and near-tie margins as `accept` and `_margins`
    per row, greedy and sampled (the same generator draws)."""
    from dart_lab.acceptance import accept
    from dart_lab.engine.batch_target import BatchOutput
    from dart_lab.engine.batch import _accept
    from dart_lab.generate import _margins, make_generator

    g = torch.Generator().manual_seed(0)
    trees = [Tree(torch.randint(0, 5, (n,), generator=g), torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                                                             for i in range(1, n)]))
             for n in (1, 6, 9)]
    flat = torch.randn(16, 5, generator=g) * 3
    vo = BatchOutput(list(flat.split([1, 6, 9])), flat=flat)
    for cfg in (GenerationConfig(), GenerationConfig(temperature=1.0)):
        gens = [make_generator(torch.device("cpu"), 7) for _ in trees]
        paths, margins = _accept(trees, vo, cfg, gens)
        gens = [make_generator(torch.device("cpu"), 7) for _ in trees]
        assert paths == [accept(tr, lg, cfg, gen) for tr, lg, gen in zip(trees, vo.logits, gens)]
        assert margins == [_margins(lg[p]) for lg, (p, _) in zip(vo.logits, paths)]
