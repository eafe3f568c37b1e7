"""Every drafting method is lossless at T=0 (untrained heads are fine: correctness must not depend
on training), the DART head's incremental cache equals recomputation, official layouts load."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import tiny_model, tiny_target
from dart_lab import DartLabError, GenerationConfig, generate
from dart_lab.draft_head import DartHead, Eagle3Head, HeadConfig
from dart_lab.dart_ctx import ContextConfig, ContextDrafter, CopyOrAR
from dart_lab.policy import policy_for
from dart_lab.drafters import CopyIndex, DartDrafter, Eagle3Drafter, Eagle3TreeConfig, PLDDrafter, SPSDrafter, copy_chain, copy_match
from dart_lab.methods import MethodOptions, make_drafter, random_head
from dart_lab.ngram import NGram
from dart_lab.search import TreeSearchConfig


def tiny_ngram(target, seed=0):
    rng = np.random.default_rng(seed)
    return NGram.from_sequences([rng.integers(0, target.vocab_size, 200).tolist()], target.vocab_size)


def all_drafters(target):
    return {
        "dart": DartDrafter(random_head(target, "dart"), tiny_ngram(target), TreeSearchConfig(max_nodes=20)),
        "dart-no-ngram": DartDrafter(random_head(target, "dart"), None, TreeSearchConfig(w_ngram=0.0, max_nodes=20)),
        "dart-unshifted": DartDrafter(random_head(target, "dart", shifted=False), tiny_ngram(target),
                                      TreeSearchConfig(max_nodes=20)),
        "eagle3": Eagle3Drafter(random_head(target, "eagle3"), Eagle3TreeConfig(total_tokens=20, depth=4, topk=4)),
        "pld": PLDDrafter(),
        "dart-ctx": ContextDrafter(random_head(target, "dart"), tiny_ngram(target), TreeSearchConfig(max_nodes=20)),
        "dart-ctx-no-corpus": ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=20)),
        "dart-ctx-pooled": ContextDrafter(random_head(target, "dart"), tiny_ngram(target), TreeSearchConfig(max_nodes=20),
                                          ContextConfig(copy_match_buckets=1, copy_max_ngram=3)),
        "dart-ctx-branch": ContextDrafter(random_head(target, "dart"), tiny_ngram(target), TreeSearchConfig(max_nodes=20),
                                          ContextConfig(copy_branches=2)),
        "sps": SPSDrafter(tiny_model("llama", seed=7), draft_len=3),
    }


def test_all_methods_match_ar_on_tiny_targets(tiny):
    cfg = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    ar = generate(tiny, prompt, None, cfg)
    for name, d in all_drafters(tiny).items():
        assert generate(tiny, prompt, d, cfg).tokens == ar.tokens, name


def test_sampling_runs_for_every_method():
    target = tiny_target("llama")
    cfg = GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, stop_on_eos=False, seed=3)
    for name, d in all_drafters(target).items():
        out = generate(target, torch.tensor([4, 5, 6]), d, cfg)
        assert len(out.tokens) == 12, name


def test_embedded_methods_match_ar(embedded):
    cfg = GenerationConfig(max_new_tokens=16)
    opts = MethodOptions(random_heads=True, ngram_max_tokens=100_000, tree_nodes=24)
    cache = {}
    for prompt in ("Write a Python function that adds two numbers.",):
        ids = embedded.encode_prompt(prompt)
        ar = generate(embedded, ids, None, cfg)
        for name in ("dart", "dart-no-ngram", "eagle3", "pld"):
            out = generate(embedded, ids, make_drafter(name, embedded, opts, cache), cfg)
            assert out.tokens == ar.tokens, (name, prompt)
            assert all(s["tree_size"] <= 25 for s in out.steps)


@pytest.mark.parametrize("shifted", [True, False])
def test_dart_incremental_cache_equals_recompute(shifted):
    target = tiny_target("qwen3")
    head = random_head(target, "dart", draft_length=4, shifted=shifted)
    drafter = DartDrafter(head, None, TreeSearchConfig(w_ngram=0.0, max_nodes=8))
    prompt = torch.tensor([3, 4, 5, 6, 7])
    res = generate(target, prompt, drafter, GenerationConfig(max_new_tokens=20, stop_on_eos=False))
    ids = prompt.tolist() + res.tokens
    # after the loop the drafter holds a cache for ids[:-1] positions minus the pending ones; feed
    # the pending rows and compare with one forward over the whole prefix from scratch
    incremental = drafter.draft_logits()
    torch.testing.assert_close(incremental, head_logits_from_scratch(target, head, ids), atol=1e-4, rtol=1e-4)
    assert incremental.shape == (5, head.cfg.draft_vocab_size)  # draft_length + 1 levels


def head_logits_from_scratch(target, head, ids):
    """The head's draft logits after `ids` from one forward over the whole prefix (no cache)."""
    T = len(ids) - 1
    with torch.no_grad():
        out = target.model(torch.tensor(ids[:-1])[None], output_hidden_states=True)
        aux = torch.cat([out.hidden_states[i][0] for i in target.aux_layers], -1)
        full, _ = head(aux[None], torch.tensor(ids[1:])[None], torch.arange(T + head.cfg.n_masks))
    return full[0]


OFFICIAL_KEYS = ["fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
                 "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                 "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.hidden_norm.weight",
                 "midlayer.input_layernorm.weight", "midlayer.post_attention_layernorm.weight", "midlayer.mask_rep",
                 "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight"]


def write_official_checkpoint(path, H=64, V=96, Vd=32, heads=4, kv=2, inter=128, draft_length=5, eagle=False):
    """A synthetic checkpoint written key by key in the released layout (not by our save())."""
    hd = H // heads
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    sd = {"fc.weight": r(H, 3 * H), "midlayer.self_attn.q_proj.weight": r(heads * hd, 2 * H),
          "midlayer.self_attn.k_proj.weight": r(kv * hd, 2 * H), "midlayer.self_attn.v_proj.weight": r(kv * hd, 2 * H),
          "midlayer.self_attn.o_proj.weight": r(H, heads * hd), "midlayer.mlp.gate_proj.weight": r(inter, H),
          "midlayer.mlp.up_proj.weight": r(inter, H), "midlayer.mlp.down_proj.weight": r(H, inter),
          "midlayer.hidden_norm.weight": torch.ones(H), "midlayer.input_layernorm.weight": torch.ones(H),
          "midlayer.post_attention_layernorm.weight": torch.ones(H), "norm.weight": torch.ones(H),
          "lm_head.weight": r(Vd, H), "d2t": torch.arange(Vd) * 2 - torch.arange(Vd),  # draft i -> target 2i
          "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, torch.arange(Vd) * 2, True),
          "embed_tokens.weight": r(V, H)}
    if not eagle:
        sd["midlayer.mask_rep"] = r(2 * H)
    path.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path / "model.safetensors"))
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if eagle else "LlamaForCausalLMDart"], "hidden_size": H,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": V,
           "draft_vocab_size": Vd, "target_hidden_size": H, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "max_position_embeddings": 512, "hidden_act": "silu", "pretraining_tp": 1, "tie_word_embeddings": False}
    if not eagle:
        cfg["draft_length"] = draft_length
    (path / "config.json").write_text(json.dumps(cfg))
    return sd


def test_official_dart_checkpoint_loads_unchanged(tmp_path):
    target = tiny_target("llama")
    sd = write_official_checkpoint(tmp_path / "dart")
    head = DartHead.load(tmp_path / "dart", target=target)
    assert head.cfg.draft_length == 5 and head.cfg.final_norm_twice  # released inference behaviour
    assert set(head.state_dict()) | {"embed_tokens.weight"} == set(OFFICIAL_KEYS)
    torch.testing.assert_close(head.midlayer.mask_rep, sd["midlayer.mask_rep"])
    assert head.draft_to_target().tolist() == (torch.arange(32) * 2).tolist()
    # it drafts and decoding stays lossless with it
    cfg = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    ar = generate(target, torch.tensor([3, 4, 5]), None, cfg)
    assert generate(target, torch.tensor([3, 4, 5]), DartDrafter(head, None), cfg).tokens == ar.tokens
    # our save() round-trips to the same layout (one final norm, recorded in config.json)
    head.cfg = HeadConfig(**{**head.cfg.__dict__, "final_norm_twice": False})
    head.save(tmp_path / "ours")
    again = DartHead.load(tmp_path / "ours", target=target)
    assert not again.cfg.final_norm_twice


def test_final_norm_twice_changes_logits_only_by_the_extra_norm():
    target = tiny_target("llama")
    head = random_head(target, "dart", draft_length=3)
    aux = torch.randn(1, 4, 3 * target.hidden_size)
    nxt = torch.tensor([[3, 4, 5, 6]])
    assert head.cfg.final_norm_twice  # new heads run the released forward
    twice, _ = head(aux, nxt, torch.arange(7))
    head.cfg = HeadConfig(**{**head.cfg.__dict__, "final_norm_twice": False})
    once, _ = head(aux, nxt, torch.arange(7))
    head.cfg = HeadConfig(**{**head.cfg.__dict__, "final_norm_twice": True})
    assert not torch.allclose(once, twice)
    with torch.no_grad():  # with a unit norm weight, RMSNorm is idempotent: the extra norm is a no-op
        head.norm.weight.fill_(1.0)
        a, _ = head(aux, nxt, torch.arange(7))
        head.cfg = HeadConfig(**{**head.cfg.__dict__, "final_norm_twice": False})
        b, _ = head(aux, nxt, torch.arange(7))
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_official_eagle3_checkpoint_loads(tmp_path):
    target = tiny_target("llama")
    write_official_checkpoint(tmp_path / "e3", eagle=True)
    head = Eagle3Head.load(tmp_path / "e3", target=target)
    cfg = GenerationConfig(max_new_tokens=16, stop_on_eos=False)
    ar = generate(target, torch.tensor([3, 4, 5]), None, cfg)
    assert generate(target, torch.tensor([3, 4, 5]), Eagle3Drafter(head), cfg).tokens == ar.tokens
    # read as a DART head (the released DART loader builds one whatever `architectures` says): no mask vector
    with pytest.raises(DartLabError, match="lacks 1 weight.*mask_rep"):
        DartHead.load(tmp_path / "e3", target=target)


def test_head_that_does_not_fit_the_target_is_refused(tmp_path):
    write_official_checkpoint(tmp_path / "h", H=32, V=96)
    with pytest.raises(DartLabError, match="hidden size"):
        DartHead.load(tmp_path / "h", target=tiny_target("llama"))
    write_official_checkpoint(tmp_path / "v", H=64, V=200)
    with pytest.raises(DartLabError, match="vocabulary"):
        DartHead.load(tmp_path / "v", target=tiny_target("llama"))
    with pytest.raises(DartLabError, match="not a draft head folder"):
        DartHead.load(tmp_path / "missing", target=tiny_target("llama"))


def test_unknown_method():
    with pytest.raises(DartLabError, match="unknown method"):
        make_drafter("medusa", tiny_target("llama"))
    with pytest.raises(DartLabError, match="no dart head"):
        make_drafter("dart", tiny_target("llama"))


# config.json fields the released loaders read (DartConfig / EConfig are LlamaConfig subclasses)
RELEASED_CONFIG_FIELDS = ["architectures", "hidden_size", "intermediate_size", "num_attention_heads",
                          "num_key_value_heads", "head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
                          "rms_norm_eps", "rope_theta", "max_position_embeddings", "hidden_act", "num_hidden_layers"]


@pytest.mark.parametrize("kind", ["dart", "eagle3"])
def test_exported_head_has_what_the_released_loader_needs(tmp_path, kind):
    """The released loaders call load_state_dict(strict=False) on a module that owns embed_tokens:
    a missing key is not an error there, it is a silently random tensor. So: every key of the
    released module is in the file, with its shape, and embed_tokens is the target's."""
    from safetensors.torch import load_file

    target = tiny_target("llama")
    head = random_head(target, kind)
    head.save(tmp_path / "h", with_embedding=True)
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    released = type(head)(HeadConfig.from_official_json(cfg))  # the released module: our layout + embed_tokens
    released.embed_tokens = torch.nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
    missing, unexpected = released.load_state_dict(sd, strict=False)
    assert missing == [] and unexpected == []
    want = set(OFFICIAL_KEYS) - ({"midlayer.mask_rep"} if kind == "eagle3" else set())
    assert set(sd) == want
    torch.testing.assert_close(sd["embed_tokens.weight"], target.model.get_input_embeddings().weight)
    assert not [f for f in RELEASED_CONFIG_FIELDS if f not in cfg]
    assert cfg["architectures"] == [type(head).architecture] and cfg["bias"] is False
    # a new DART head runs the released forward (final norm twice); our own loader reads the export
    assert cfg["final_norm_twice"] is (kind == "dart") or kind == "eagle3"
    type(head).load(tmp_path / "h", target=target)
    # without the embedding attached there is nothing to export: a one-line error, nothing written
    bare = type(head)(head.cfg)
    with pytest.raises(DartLabError, match="embedding"):
        bare.save(tmp_path / "bare", with_embedding=True)
    assert not (tmp_path / "bare").exists()


def test_eagle3_tree_counts_as_the_released_builder():
    """total_token counts the root (60 -> 59 drafted nodes); `depth` counts the forwards after the
    root's, so with everything kept the tree holds topk + depth * topk^2 candidates, depth + 1 deep."""
    target = tiny_target("llama")
    head = random_head(target, "eagle3")
    ids = [3, 4, 5, 6]
    aux = torch.randn(4, 3 * target.hidden_size)

    def tree_for(cfg):
        d = Eagle3Drafter(head, cfg)
        d.begin(target, ids, aux)
        return d.propose(ids)

    t = tree_for(Eagle3TreeConfig())
    assert len(t) == 60 and int(t.depths.max()) <= 8
    t = tree_for(Eagle3TreeConfig(total_tokens=10_000, depth=3, topk=4))
    assert len(t) == 1 + 4 + 3 * 16 and int(t.depths.max()) == 4


def test_eagle3_skips_the_levels_its_budget_cannot_keep():
    """With theta drafted nodes no node deeper than theta makes the cut, so the forwards for deeper
    levels are skipped: the same tree, cheaper (and the budget prices drafting per theta)."""
    target = tiny_target("llama")
    head = random_head(target, "eagle3")
    ids = [3, 4, 5, 6, 7, 8]
    aux = torch.randn(6, 3 * target.hidden_size)
    for nodes in (1, 2, 4, 7, 12):
        trees = []
        for cut in (True, False):
            d = Eagle3Drafter(head, Eagle3TreeConfig())
            d.set_budget(nodes)
            if not cut:
                d.head_forwards = lambda n, d=d: d.tree_cfg.depth
            d.begin(target, ids, aux)
            trees.append(d.propose(ids))
        assert len(trees[0]) == nodes + 1
        assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
        assert trees[0].parents.tolist() == trees[1].parents.tolist()
    d = Eagle3Drafter(head, Eagle3TreeConfig())
    scale = policy_for(d).cost_scale
    assert scale(3, 64) == pytest.approx(3 / (1 + d.tree_cfg.depth)) and scale(64, 64) == 1.0


def test_context_that_adds_nothing_drafts_exactly_what_dart_drafts():
    target = tiny_target("qwen3")
    head, ng = random_head(target, "dart"), tiny_ngram(target)
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    a = generate(target, prompt, DartDrafter(head, ng, TreeSearchConfig(max_nodes=20)), cfg)
    b = generate(target, prompt, ContextDrafter(head, ng, TreeSearchConfig(max_nodes=20),
                                                ContextConfig(w_context=0.0, copy=False)), cfg)
    assert [(s["tree_size"], s["accept_len"], s["path_ranks"]) for s in a.steps] == \
        [(s["tree_size"], s["accept_len"], s["path_ranks"]) for s in b.steps]


def _copy_match_reference(ids, max_ngram, length):
    """The naive prompt lookup: one scan of the context per match length, longest first."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        hits = [i for i in range(len(ids) - n) if ids[i:i + n] == ids[len(ids) - n:]]
        if hits and ids[hits[-1] + n:hits[-1] + n + length]:
            return ids[hits[-1] + n:hits[-1] + n + length], n
    return [], 0


def test_copy_match_equals_the_naive_lookup():
    rng = np.random.default_rng(0)
    for trial in range(300):
        ids = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()  # small vocab: many matches
        for max_ngram in (1, 3, 8):
            assert copy_match(ids, max_ngram, 5) == _copy_match_reference(ids, max_ngram, 5), (ids, max_ngram)


def test_periodic_copy_runs_on_with_the_period_of_its_match():
    """copy_periodic: a match that ends d tokens back continues as the same period would: the plain
    copy first, then every token k equals the token d positions before it in ids + copy."""
    assert copy_match([7, 1, 2, 3, 1, 2, 3, 1, 2], 8, 7) == ([3, 1, 2], 5)  # plain: stops at the end
    assert copy_match([7, 1, 2, 3, 1, 2, 3, 1, 2], 8, 7, periodic=True) == ([3, 1, 2, 3, 1, 2, 3], 5)
    assert copy_match([4, 5, 5, 5], 8, 4, periodic=True) == ([5, 5, 5, 5], 2)  # a run: period 1
    rng = np.random.default_rng(1)
    for trial in range(300):
        ids = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 40))).tolist()
        plain, n = copy_match(ids, 8, 12)
        chain, m = copy_match(ids, 8, 12, periodic=True)
        assert m == n and chain[:len(plain)] == plain and len(chain) == (12 if plain else 0)
        if plain:
            d = len(plain) if len(plain) < 12 else None
            full = ids + chain
            assert d is None or all(full[len(ids) + k] == full[len(ids) + k - d] for k in range(12)), (ids, chain)


def test_copy_candidates_come_on_top_of_the_budget_and_learn_from_the_request():
    target = tiny_target("llama")
    ids = [10, 11, 12, 13, 14, 15, 16, 40, 41, 10, 11, 12]
    assert copy_chain(ids, 3, 10) == [13, 14, 15, 16, 40, 41, 10, 11, 12]
    out = target.prefill(torch.tensor(ids[:-1]), want_aux=True)
    d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=16),
                       ContextConfig(w_context=0.0, copy_branches=0))
    d.begin(target, ids, out.aux)
    tree = d.propose(ids)

    def paths(tree):
        toks = tree.tokens.tolist()
        return {tuple(toks[j] for j in tree.path_to(i)[1:]) for i in range(1, len(tree))}

    # prior p = 0.5 and copy_min_prob 0.1 keep 3 copy nodes (0.5^3 >= 0.1 > 0.5^4), on top of the 16
    assert d.copy_prob() == 0.5 and len(tree) == 1 + 16 + 3
    assert (13, 14, 15) in paths(tree)  # the copy wins places on the search's own scale ...
    assert sum(1 for p in paths(tree) if p[0] != 13) >= 4  # ... without taking over the head's guesses
    # the target kept all 3 copy tokens: p = (4 * 0.5 + 3) / (4 + 3), and the next copy reaches deeper
    ids = ids + [13, 14, 15, 16]
    d.observe(ids, out.aux[-4:])
    assert d.copy_prob() == pytest.approx(5 / 7)
    tree = d.propose(ids)
    assert len(tree) == 1 + 16 + 6  # (5/7)^6 >= 0.1 > (5/7)^7
    assert (40, 41, 10, 11, 12, 13) in paths(tree)
    # it rejected the first copy token: one failed trial, p falls
    d.observe(ids + [99], out.aux[-1:])
    assert d.copy_prob() == pytest.approx(5 / 8)
    # per match length: that copy came from a 7-token match (bucket 4+), the first from a 3-token one;
    # each bucket starts from the pooled rate worth copy_prior_weight trials
    assert copy_match(ids, 8, 16) == ([40, 41, 10, 11, 12, 13, 14, 15, 16], 7)
    assert d.copy_prob(7) == pytest.approx((4 * 5 / 8 + 0) / (4 + 1))
    assert d.copy_prob(3) == pytest.approx((4 * 5 / 8 + 3) / (4 + 3))
    assert d.copy_prob(1) == pytest.approx(5 / 8)  # no one-token match seen yet: the pooled rate


def test_branch_copies_follow_the_heads_first_tokens_and_learn_only_when_taken():
    """copy_branches: under each of the head's likeliest first tokens (not the copy's own) goes the copy
    that follows context + that token, scored from the head's level-0 score and cut by head p x p^depth;
    its tokens are copy trials only when the target took the head's token."""
    target = tiny_target("llama")
    ids = [10, 11, 12, 13, 14, 15, 16, 40, 41, 10, 11, 12]
    out = target.prefill(torch.tensor(ids[:-1]), want_aux=True)
    d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=16),
                       ContextConfig(w_context=0.0, copy_branches=2))
    d.begin(target, ids, out.aux)
    toks = np.array([[13, 99, 15, 11, 40]])  # 13: the copy's own first token; 99 never occurs
    logp = np.log(np.array([[0.35, 0.25, 0.3, 0.25, 0.2]], dtype=np.float32))
    paths, extra = d.branch_paths(ids, None, logp, toks, skip=13)
    # prior p = 0.5: head p 0.3 (0.25) keeps one copy node (0.15 >= 0.1 > 0.075); two branches at most
    assert [p for p, _ in paths] == [[15, 16], [11, 12]] and extra == 2
    (_, s15), _ = paths
    assert s15[0] == logp[0, 2] and s15[1] < s15[0]  # the head's own level-0 score, then the copy's
    # the target took 15 and kept the copy's 16; the branch under 11 was not taken: no trial
    d.observe(ids + [15, 16, 41], out.aux[-3:])
    assert d.copy_kept == [1, 0, 0, 0] and d.copy_trials == [1, 0, 0, 0]
    d1 = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=16),
                        ContextConfig(w_context=0.0, copy_branches=1))
    d1.begin(target, ids, out.aux)
    assert [p for p, _ in d1.branch_paths(ids, None, logp, toks, skip=13)[0]] == [[15, 16]]


def test_copy_match_reliability_is_learned_across_requests():
    """copy_history: a new request starts each match-length bucket from the earlier requests' pooled
    rate times that bucket's relative reliability (ContextConfig)."""
    target = tiny_target("llama")
    ids = [10, 11, 12, 13, 14, 15, 16, 40, 41, 10, 11, 12]
    out = target.prefill(torch.tensor(ids[:-1]), want_aux=True)
    for history, p1, p8 in ((2048, None, None), (0, 0.5, 0.5)):
        d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=16),
                           ContextConfig(w_context=0.0, copy_history=history))
        d.begin(target, ids, out.aux)
        d.copy_kept[:], d.copy_trials[:] = [2, 0, 0, 9], [10, 0, 0, 10]  # one-token matches poor, long ones good
        d.begin(target, ids, out.aux)  # the next request
        h = (4 * 0.5 + 11) / (4 + 20)
        if history:
            p1, p8 = (4 * h + 2) / 14, (4 * h + 9) / 14
        assert d.copy_prob() == pytest.approx(h if history else 0.5)
        assert d.copy_prob(1) == pytest.approx(p1) and d.copy_prob(8) == pytest.approx(p8)


def test_the_heads_norm_on_our_op_is_the_torch_norm_and_training_keeps_autograd():
    """The draft head's RMSNorm: without gradients on fp32 CPU tensors our one-pass op (`dart_lab::rms_norm`),
    `w * F.rms_norm(x)` to fp32 rounding (its sum of squares in another order); with gradients the torch ops, so
    training's backward is unchanged."""
    from dart_lab.engine import kernels
    from dart_lab.draft_head import RMSNorm
    if not kernels.rms_norm_here():
        pytest.skip(f"our norm kernel is not built here: {kernels._norm['reason']}")
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(96, generator=g) + 0.5)
    x = torch.randn(3, 5, 96, generator=g) * 4
    want = norm.weight * torch.nn.functional.rms_norm(x, (96,), eps=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(norm(x), want, rtol=2e-6, atol=1e-6)
    y = norm(x.requires_grad_())
    y.sum().backward()
    assert y.grad_fn is not None and x.grad is not None and norm.weight.grad is not None


def test_copy_offers_from_the_request_index_equal_the_lookup_on_the_list():
    """dart-ctx indexes its request's token list as it grows (`CopyIndex`): every offer equals `copy_match` on
    the list itself, while the list grows by 1-3 tokens a step, for another list (a branch's ids + [t]), after
    the list was rewritten, and for the next request's list."""
    target = tiny_target("llama")
    g = torch.Generator().manual_seed(3)
    d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=16), ContextConfig(w_context=0.0))
    c = d.ctx
    for request in range(2):
        ids = torch.randint(2, 9, (12,), generator=g).tolist()
        d.begin_copies(ids)
        for step in range(60):
            for probe in (ids, ids + [5]):
                got = d.copy_candidate(probe)
                want = copy_match(probe, c.copy_max_ngram, c.copy_len, c.copy_periodic)
                assert got[0] == want[0][:len(got[0])] and got[1] == want[1]
            ids.extend(torch.randint(2, 9, (1 + step % 3,), generator=g).tolist())
            if step == 30:
                ids[-2:] = [7, 7]  # earlier tokens rewritten in place: indexed again from the start


def test_copy_index_equals_the_lookup_as_a_list_grows():
    """`CopyIndex.match` on a growing list = `copy_match` on the list, plain and periodic, at every length,
    also when the list shrinks or is replaced (indexed again)."""
    rng = np.random.default_rng(2)
    for trial in range(60):
        for max_ngram in (1, 3, 8):
            index = CopyIndex(max_ngram)
            ids: list[int] = []
            vocab = int(rng.integers(2, 6))  # small vocab: many matches of every length
            for step in range(50):
                ids = ids + rng.integers(0, vocab, int(rng.integers(1, 4))).tolist()
                if step == 25:
                    ids = ids[:int(rng.integers(1, len(ids)))]  # shorter: not a continuation
                for length, periodic in ((5, False), (12, True), (0, False)):
                    assert index.match(ids, length, periodic) == copy_match(ids, max_ngram, length, periodic), \
                        (ids, max_ngram, length, periodic)


def test_copy_only_steps_skip_the_head_stay_lossless_and_the_head_catches_up():
    """dart-ctx verifies the copy chain alone when the cost model says that is the faster step; the
    skipped positions reach the head at its next forward (its cache = one forward from scratch)."""
    target = tiny_target("qwen3")
    head = random_head(target, "dart", draft_length=4)
    cfg = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 5, 9, 14, 5, 9, 22])
    ar = generate(target, prompt, None, cfg)
    d = ContextDrafter(head, None, TreeSearchConfig(w_ngram=0.0, max_nodes=8), ContextConfig(w_context=0.0))
    flat = {1: 10.0, 64: 10.0}
    d.set_cost_model(flat, 1000.0, [1.0] * 65)  # drafting "costs" 1 s: every step with a copy goes copy-only
    res = generate(target, prompt, d, cfg)
    assert res.tokens == ar.tokens
    assert 0 < d.copy_only_steps < len(res.steps)  # some steps had no copy: the head drafted those
    assert sum(1 for s in res.steps if s.get("copy_only")) == d.copy_only_steps  # recorded per step
    ids = prompt.tolist() + res.tokens
    torch.testing.assert_close(d.draft_logits(), head_logits_from_scratch(target, head, ids), atol=1e-4, rtol=1e-4)


def test_copy_only_is_chosen_by_expected_speed():
    target = tiny_target("llama")
    d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=8), ContextConfig(w_context=0.0))
    ids = [10, 11, 12, 13, 14, 15, 16, 40, 41, 10, 11, 12]
    d.begin(target, ids, target.prefill(torch.tensor(ids[:-1]), want_aux=True).aux)
    assert not d.copy_only_pays(3, 0.9)  # no cost model (fixed budget): always a tree step
    curve = {1: 20.0, 4: 21.0, 16: 26.0, 32: 40.0}
    tau = [1.0 + 0.1 * k for k in range(65)]  # tau(8) = 1.8: the head adds 0.8 tokens
    d.set_cost_model(curve, 5.0, tau)
    # a likely copy of 8: 1 + sum 0.9^i = 6.1 tokens in verify(9) = 23.1 ms beats 6.9 in verify(17) + 5 = 31.9 ms
    assert d.copy_only_pays(8, 0.9)
    # an unlikely copy: 1.3 tokens in 20.7 ms loses to 2.1 in 23.9 + 5 ms
    assert not d.copy_only_pays(2, 0.25)
    d.set_cost_model(curve, 50.0, tau)  # the same unlikely copy when drafting is very slow
    assert d.copy_only_pays(2, 0.25)


def test_without_a_tree_dart_ctx_copies_only_where_a_copy_beats_a_one_token_step():
    """The budget's AR fallback: dart-ctx verifies its copy chain alone when E_copy / verify(L + 1) beats
    1 / verify(1), else a one-token step; lossless; its copy trials go on (also for copies not proposed)."""
    target = tiny_target("qwen3")
    cfg = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 5, 9, 14, 5, 9, 22])
    ar = generate(target, prompt, None, cfg)
    d = ContextDrafter(random_head(target, "dart"), None, TreeSearchConfig(max_nodes=8), ContextConfig(w_context=0.0))
    for curve, copies in (({1: 10.0, 64: 10.0}, True), ({1: 10.0, 64: 640.0}, False)):  # flat / one token per 10 ms
        fb = policy_for(d).without_tree(curve)
        assert isinstance(fb, CopyOrAR) and not fb.needs_aux
        res = generate(target, prompt, fb, cfg)
        assert res.tokens == ar.tokens
        copy_steps = [s for s in res.steps if s.get("copy_only")]
        assert len(copy_steps) == fb.copy_only_steps and (len(copy_steps) > 0) == copies
        assert all(s["tree_size"] > 1 for s in copy_steps) and all(s["tree_size"] == 1 for s in res.steps if not s.get("copy_only"))
        if not copies:  # no copy proposed, yet every step that had one scored its first token
            assert 0 < sum(d.copy_trials) <= len(res.steps)
    sampled = generate(target, prompt, policy_for(d).without_tree({1: 10.0, 64: 10.0}), GenerationConfig(max_new_tokens=40, temperature=1.0))
    assert len(sampled.tokens) > 0
    assert policy_for(ContextDrafter(random_head(target, "dart"), None, ctx=ContextConfig(copy=False))).without_tree({1: 1.0}) is None
    assert policy_for(DartDrafter(random_head(target, "dart"))).without_tree({1: 1.0}) is None  # dart: plain AR steps


@pytest.mark.parametrize("kind", ["dart", "eagle3"])
def test_drafting_head_with_packed_fused_projections_computes_the_plain_forward(kind):
    """A head drafter packs the head's linears and fuses q|k|v and gate|up (CPU inference): the same
    logits and cache entries as the head's plain modules; training (autograd) takes the plain path."""
    target = tiny_target("llama")
    head = random_head(target, kind)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, 5, head.fc.in_features, generator=g)
    nxt = torch.randint(0, target.vocab_size, (1, 5), generator=g)
    if kind == "dart":
        run = lambda: head(aux, nxt, torch.arange(8), n_masks=3)  # noqa: E731
    else:
        run = lambda: head(aux, nxt, torch.arange(5))  # noqa: E731
    with torch.no_grad():
        ref = run()
        (DartDrafter if kind == "dart" else Eagle3Drafter)(head)
        assert head.midlayer.self_attn.qkv is not None and head.midlayer.mlp.gate_up is not None
        got = run()
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    head.requires_grad_(True)
    out = run()
    torch.utils._pytree.tree_leaves(out)[0].float().sum().backward()
    assert head.midlayer.self_attn.q_proj.weight.grad is not None and head.midlayer.mlp.up_proj.weight.grad is not None


def test_head_linears_on_an_8bit_grid_and_the_head_dtype_chosen_by_its_speed(monkeypatch):
    """`drafters.linears_in_8bit`: every linear of a DART head through an 8-bit grid of its weights on our 4-bit
    kernel drafts what the exact head drafts up to that grid (logits about as close as the bf16 head's),
    still trains through the exact weights, and `dense_linears` restores the exact forward. `methods.
    fastest_head_dtype` keeps the arithmetic whose draft forward it timed fastest when that is 1.1x fp32's
    (here a stand-in clock), else fp32 with its weights exact."""
    from dart_lab import budget
    from dart_lab.engine import q4
    from dart_lab.engine.head import dense_linears, linears_in_8bit
    from dart_lab.engine.int4 import can_pack
    from dart_lab.methods import fastest_head_dtype

    if not q4.available():
        pytest.skip(f"our 4-bit kernel is not built here: {q4.reason()}")
    target = tiny_target("llama", runner="fast")
    head = random_head(target, "dart")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, target.vocab_size, (9,), generator=g).tolist()
    aux = torch.randn(9, 3 * target.hidden_size, generator=g)

    def draft() -> torch.Tensor:
        d = DartDrafter(head)
        d.begin(target, ids, aux)
        return d.draft_logits()

    exact = draft()
    head.to(torch.bfloat16)
    bf16 = draft().float()
    head.to(torch.float32).load_state_dict(random_head(target, "dart").state_dict())
    assert torch.equal(draft(), exact)
    assert linears_in_8bit(head) and head.linears_8bit
    q8 = draft()
    err, err_bf16 = float((q8 - exact).abs().max()), float((bf16 - exact).abs().max())
    assert 0 < err < 2 * err_bf16  # as close to the exact head as the bf16 head is
    x = torch.randn(2, 3 * target.hidden_size, requires_grad=True)
    head.fc(x).sum().backward()  # autograd recording: the exact weights
    assert head.fc.weight.grad is not None
    dense_linears(head)
    assert torch.equal(draft(), exact)
    if not can_pack(torch.device("cpu"), torch.bfloat16):
        return
    for clock, want in (({"q8": 1.0, "bf16": 2.0, "fp32": 3.0}, "q8"), ({"q8": 2.9, "bf16": 2.8, "fp32": 3.0}, "torch.float32")):
        def timed(new_drafter, target, rows, repeats, clock=clock):
            h = new_drafter().head
            return clock["q8" if getattr(h, "linears_8bit", False) else
                         "bf16" if h.fc.weight.dtype == torch.bfloat16 else "fp32"]
        monkeypatch.setattr(budget, "head_forward_ms", timed)
        fastest_head_dtype(target, head)
        assert head.chosen_dtype["dtype"].startswith(want) and set(head.chosen_dtype["draft_forward_ms"]) == {
            "float32", "bfloat16", "q8"}
        if want == "q8":
            assert head.linears_8bit and torch.equal(draft(), q8)
        else:
            assert not head.linears_8bit and head.fc.weight.dtype == torch.float32 and torch.equal(draft(), exact)
