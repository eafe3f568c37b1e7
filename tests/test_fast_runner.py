"""The lean Llama-family runner: chosen automatically where it applies, refused in one line where
not; its cache grows and follows dtype changes without changing results. (Its logits, aux states and
compaction are held against the model's own forward in test_target.py, like the HF runner's.)"""
import os

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from conftest import rerun_as_avx2, tiny_model
from drafters_for_tests import OracleDrafter
from dart_lab import DartLabError, GenerationConfig, Tree, generate
from dart_lab.engine import q4
from dart_lab.engine.runner import FastTarget
from dart_lab.loading import make_target
from dart_lab.target import Target


def test_auto_picks_the_fast_runner_for_the_llama_family_only():
    for arch in ("llama", "qwen3", "qwen2"):
        assert isinstance(make_target(tiny_model(arch)), FastTarget)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                                max_position_embeddings=512, sliding_window=16))
    t = make_target(windowed)
    assert type(t) is Target and t.runner == "hf"
    with pytest.raises(DartLabError, match="sliding-window"):
        make_target(windowed, runner="fast")


def test_cache_growth_and_dtype_change_keep_results():
    from dart_lab.engine import attention
    model = tiny_model("llama")
    fast, ref = make_target(model, runner="fast"), make_target(model, runner="hf")
    fast.capacity_step = 4  # force several reallocations
    cfg = GenerationConfig(max_new_tokens=40, stop_on_eos=False)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    assert generate(fast, prompt, None, cfg).tokens == generate(ref, prompt, None, cfg).tokens
    out = fast.prefill(prompt, all_logits=False)
    assert out.logits.shape == (1, fast.vocab_size)
    torch.testing.assert_close(out.logits[0], ref.prefill(prompt).logits[-1], atol=1e-4, rtol=1e-4)
    model.to(torch.bfloat16)  # the runner follows the model's dtype (cache reallocated)
    out = fast.prefill(prompt)
    # CPU, a bf16 model: attention in fp32 over a bf16 cache where our attention kernel reads one, else fp32
    assert fast.attention_dtype == torch.float32
    assert fast.kv_cache[0].dtype == fast.cache_dtype == (torch.bfloat16 if attention.available() else torch.float32)
    with torch.no_grad():
        want = model(prompt[None]).logits[0].float()
    torch.testing.assert_close(out.logits, want, atol=0.1, rtol=0.05)
    step = fast.verify(Tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))).logits
    with torch.no_grad():
        want = model(torch.cat([prompt, torch.tensor([7])])[None]).logits[0, -1].float()
    torch.testing.assert_close(step[0], want, atol=0.1, rtol=0.05)
    # a bf16 model's K/V are bf16 values: the bf16 cache gives exactly the fp32 cache's logits
    fast.bf16_cache = False
    fast.prefill(prompt)
    assert fast.kv_cache[0].dtype == torch.float32
    assert torch.equal(fast.verify(Tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))).logits, step)


def test_truncate_drops_speculative_entries():
    t = make_target(tiny_model("qwen3"), runner="fast")
    t.prefill(torch.tensor([3, 4, 5]))
    t.verify(Tree(torch.tensor([6, 7]), torch.tensor([-1, 0])))
    t.commit([0, 1])
    t.truncate(3)
    a = t.verify(Tree.single(9)).logits[0]
    t.commit([0])
    t.prefill(torch.tensor([3, 4, 5]))
    torch.testing.assert_close(a, t.verify(Tree.single(9)).logits[0])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v projections with bias
def test_packed_projections_equal_the_modules_and_follow_weight_edits(arch):
    """The oneDNN-packed fused projections (CPU) compute what the HF modules compute, and an in-place
    weight edit after packing reaches the forward (the packs are rebuilt, never stale)."""
    from dart_lab.engine.int4 import can_pack
    if not can_pack(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no oneDNN linear")
    model = tiny_model(arch)
    t = make_target(model, runner="fast")
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    tree = Tree(torch.tensor([7, 8, 9]), torch.tensor([-1, 0, 0]))

    def run(pack):
        t.pack_weights = pack
        t.prefill(prompt)
        return t.verify(tree).logits

    packed = run(True)
    assert t.packs_weights
    torch.testing.assert_close(packed, run(False), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(3.0)
    edited = run(True)
    assert not torch.allclose(edited, packed, atol=1e-3)
    torch.testing.assert_close(edited, run(False), atol=1e-5, rtol=1e-5)


def _eager_reference(target):
    """A prompt, a 4-node tree and a decode config, with the eager runner's tree verify and greedy AR decode: what the
    compiled and graphed steps must equal."""
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    tree = Tree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))
    cfg = GenerationConfig(max_new_tokens=30, stop_on_eos=False)
    target.prefill(prompt)
    eager = target.verify(tree, want_aux=True)
    ar = generate(target, prompt, None, cfg)
    return prompt, tree, cfg, eager, ar


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device (the capture is CUDA-only)")
def test_graphed_steps_equal_eager_and_every_method_stays_lossless_on_cuda():
    """`compile_mode="reduce-overhead"` (the compiled steps replayed as CUDA graphs): tree logits equal the eager
    forward's (fp32) and every method stays token-identical to eager AR."""
    from test_drafters import all_drafters

    target = make_target(tiny_model("qwen3").cuda(), runner="fast")
    prompt, tree, cfg, eager, ar = _eager_reference(target)
    target.compile, target.compile_mode, target.node_buckets, target.compile_capacity = True, "reduce-overhead", (1, 4, 32), 128
    target.prefill(prompt)
    graphed = target.verify(tree, want_aux=True)
    torch.testing.assert_close(graphed.logits, eager.logits, atol=1e-4, rtol=1e-4)
    for name, d in {k: v for k, v in all_drafters(target).items() if k in ("dart", "eagle3", "pld")}.items():
        assert generate(target, prompt, d, cfg).tokens == ar.tokens, name


@pytest.mark.slow  # torch.compile: tens of seconds
def test_compiled_steps_equal_eager_and_compile_once_per_shape():
    """torch.compile of the steps (FastTarget.compile, static shapes but the key count): tree logits equal
    the eager forward's (fp32), every method stays token-identical to eager AR, each node bucket compiles
    exactly once whatever number of keys its steps read, and a second pass over the same work compiles
    nothing."""
    from torch._dynamo.utils import counters

    from test_drafters import all_drafters

    target = make_target(tiny_model("qwen3"), runner="fast")  # q/k norms; head_dim != hidden / heads
    prompt, tree, cfg, eager, ar = _eager_reference(target)
    target.compile, target.node_buckets, target.compile_capacity = True, (1, 32), 128
    graphs = counters["stats"]["unique_graphs"]
    target.prefill(prompt)
    compiled = target.verify(tree, want_aux=True)
    torch.testing.assert_close(compiled.logits, eager.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(compiled.aux, eager.aux, atol=1e-4, rtol=1e-4)
    drafters = {k: v for k, v in all_drafters(target).items() if k in ("dart", "eagle3", "pld", "dart-ctx")}
    for name, d in drafters.items():
        assert generate(target, prompt, d, cfg).tokens == ar.tokens, name
    shapes = target.compiled_shapes
    assert shapes == {(1, None), (32, None)}  # contexts of 8-69 keys: one graph per node bucket
    assert counters["stats"]["unique_graphs"] - graphs == len(shapes)  # each shape compiled once
    warm = counters["stats"]["unique_graphs"]
    for name, d in drafters.items():
        generate(target, prompt, d, cfg)
    assert target.compiled_shapes == shapes and counters["stats"]["unique_graphs"] == warm
    assert target.compile_seconds > 0
    # precompile (what a bench runs before timing): every shape a decode within the context can meet
    target.node_buckets = (1, 4, 32)
    every = {(nb, None) for nb in (1, 4, 32)}
    assert target.precompile(128) == len(every - shapes) and target.compiled_shapes == every
    warm = counters["stats"]["unique_graphs"]
    for name, d in drafters.items():
        assert generate(target, prompt, d, cfg).tokens == ar.tokens, name
    assert counters["stats"]["unique_graphs"] == warm  # nothing compiled while decoding
    # new weights (frozen into a new module's graphs) after decoding on the old ones: the compiled steps
    # follow them, though steps of compiled shapes skip the guards that do not tell graphs apart
    with torch.no_grad():
        for p in target.model.parameters():
            p.mul_(1.01)
    for _ in range(2):  # the first call compiles the new module's graph, the second skips guards
        target.prefill(prompt)
        compiled = target.verify(tree, want_aux=True).logits
    target.compile = False
    target.prefill(prompt)
    torch.testing.assert_close(compiled, target.verify(tree).logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(compiled, eager.logits, atol=1e-3)


def _as_4bit_grids(model, group: int = 32, seed: int = 0) -> None:
    """Every decoder linear's weight replaced by a Q4_1-like grid: per group of `group` inputs,
    w = q * d + m with q in 0..15 (the shape of the embedded target's GGUF layers), and the LM head by a
    Q8_0-like one: w = q * d with q in -127..127, the group's largest |q| 127 (as the embedded target's)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        N, K = model.lm_head.weight.shape
        q = torch.randint(-127, 128, (N, K // group, group), generator=g).float()
        q[..., 0] = 127 * torch.where(torch.rand(N, K // group, generator=g) < 0.5, -1.0, 1.0)
        model.lm_head.weight.copy_((q * (torch.rand(N, K // group, 1, generator=g) * 1e-3 + 1e-4)).reshape(N, K))
        for layer in model.model.layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                N, K = m.weight.shape
                q = torch.randint(0, 16, (N, K // group, group), generator=g).float()
                q[..., 0], q[..., 1] = 0, 15  # each group spans the whole grid, as a quantizer's min/max do
                # scale and low are fp16 numbers, as a GGUF's Q4_1 blocks store them
                d = (torch.rand(N, K // group, 1, generator=g) * 0.02 + 0.005).half().float()
                lo = (-7.5 * d + torch.randn(N, K // group, 1, generator=g) * 0.01).half().float()
                m.weight.copy_((q * d + lo).reshape(N, K))


def test_int4_weights_are_the_same_values_through_another_kernel():
    """dtype "int4" (int4.Int4Linear): a 4-bit grid is recovered exactly from its dequantised values
    (and a weight that is no grid is refused: it stays dense); through torch's int4 kernel the runner's
    logits and aux states match the dense fp32 runner within bf16 arithmetic, and greedy speculation equals
    greedy AR wherever the top two logits are not near-tied (here: every step)."""
    from dart_lab.engine.int4 import Int4Linear, can_int4, int4_groups, int8_groups
    if not can_int4(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    model = tiny_model("llama")
    assert int4_groups(model.model.layers[0].mlp.up_proj.weight) is None  # random weights: not a 4-bit grid
    assert int8_groups(model.lm_head.weight) is None  # nor an 8-bit one
    _as_4bit_grids(model)
    head = model.lm_head.weight
    q, d = int8_groups(head)
    assert int(q.abs().max()) == 127
    torch.testing.assert_close((q.reshape(*d.shape[:2], -1) * d).reshape(head.shape), head, atol=0, rtol=1e-6)
    x = torch.randn(3, head.shape[1])
    # the 8-bit head through the 4-bit kernel (two halves): the same values, scales rounded to bf16
    torch.testing.assert_close(Int4Linear.of_8bit(model.lm_head)(x), x @ head.T, atol=0.02, rtol=0.02)
    w = model.model.layers[0].mlp.down_proj.weight
    q, scale, low = int4_groups(w)
    assert int(q.min()) == 0 and int(q.max()) == 15
    torch.testing.assert_close((q.reshape(*scale.shape[:2], -1) * scale + low).reshape(w.shape), w, atol=1e-7, rtol=0)
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(Int4Linear.of(model.model.layers[0].mlp.down_proj)(x), x @ w.T, atol=0.05, rtol=0.02)

    dense, packed = make_target(model, runner="fast"), make_target(model, runner="fast")
    packed.weights, packed.int4_paths = "int4", "4bit"  # 4 bits at every width (the measured paths: below)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    dense.prefill(prompt[:1]), packed.prefill(prompt[:1])
    tree = Tree(prompt[1:], torch.arange(-1, len(prompt) - 2))  # the rest of the prompt as a chain: a decoding step
    a, b = dense.verify(tree, want_aux=True), packed.verify(tree, want_aux=True)
    assert packed.dtype_report["int4"]["int4_linears"] == packed.dtype_report["int4"]["linears"] == 4 * 6
    # a tree's rows through the 8-bit head; one row in fp16 (the head's range bound holds for this model)
    assert packed.dtype_report["int4"]["lm_head"].startswith("fp16 (1 row), int8")
    assert packed.precision == "int4" and dense.precision == "torch.float32"
    torch.testing.assert_close(b.logits, a.logits, atol=0.15, rtol=0.02)
    torch.testing.assert_close(b.aux, a.aux, atol=0.05, rtol=0.02)
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    ar = generate(packed, prompt, None, cfg).tokens
    spec = generate(packed, prompt, OracleDrafter(prompt.tolist() + ar, packed.vocab_size, depth=5), cfg)
    assert spec.tokens == ar and len(spec.steps) < len(ar) / 2  # drafts accepted, same tokens
    torch.testing.assert_close(packed.prefill(prompt).logits, dense.prefill(prompt).logits)  # prompts run dense


def test_the_one_row_head_runs_in_fp16_only_where_its_range_provably_holds():
    """int4's one-row LM head: fp16 (finer than bf16 over the same bytes) when the final norm's gain and
    the head's rows bound every input and logit inside fp16's range, else bf16."""
    from dart_lab.engine.int4 import _fp16_holds_head, int4_projections
    model = tiny_model("llama")
    assert _fp16_holds_head(model)
    x = torch.randn(2, 1, model.config.hidden_size)
    _, head, report = int4_projections(model)
    assert report["lm_head"] == "fp16"  # random weights: no 8-bit grid, so every row count reads fp16
    torch.testing.assert_close(head(x[0]).float(), x[0] @ model.lm_head.weight.T, atol=2e-3, rtol=2e-3)
    with torch.no_grad():
        model.model.norm.weight.fill_(5e3)  # a gain whose normed states could pass 65504
    assert not _fp16_holds_head(model)
    assert int4_projections(model)[2]["lm_head"] == "bf16"


class _Quiet:
    """machine.LoadMeter's stand-in: a measurement on a quiet machine."""

    def __enter__(self):
        self.load = {"contended": False}
        return self

    def __exit__(self, *exc):
        pass


def _grid_model_on_clock(monkeypatch, tmp_path, cost: dict, arch: str = "llama"):
    """A tiny Llama with 4-bit grids (`_as_4bit_grids`) whose int4 paths are timed by a stand-in clock
    (`cost`: path name -> rows -> ms; any other path 1e3), the run counted as a quiet machine's, into a fresh
    cache folder."""
    from dart_lab import machine
    from dart_lab.engine import int4
    monkeypatch.setattr(int4, "_time_path", lambda name, fn, x: cost.get(name, lambda r: 1e3)(x.shape[0]))
    monkeypatch.setattr(machine, "LoadMeter", _Quiet)
    monkeypatch.setenv("DART_LAB_CACHE", str(tmp_path))
    model = tiny_model(arch)
    _as_4bit_grids(model)
    return model


def test_a_prompt_on_bf16_copies_attends_in_bf16_where_that_measures_faster(monkeypatch, tmp_path):
    """A prompt whose MLP takes the bf16 copies (`int4_by_rows`, here a stand-in clock where they win from 8 rows)
    attends in bf16 when `attention.prompt_dtype` measured it faster (forced here both ways): SDPA sees bf16
    queries, keys and values, the logits stay within bf16 arithmetic of the fp32-attention prompt's with the
    same argmax; a prompt on the dense fp32 weights ("4bit": prompts dense) keeps fp32 attention, exactly."""
    from dart_lab.engine import attention
    from dart_lab.engine import int4
    if not int4.can_int4(torch.device("cpu")) or not int4.can_pack(torch.device("cpu"), torch.bfloat16):
        pytest.skip("no CPU int4 kernel or no packed bf16 here")
    cost = {"int4": lambda r: r, "fp16": lambda r: r, "int8 halves": lambda r: r + 0.5, "bf16": lambda r: 4 + r / 8,
            "bf16 packed": lambda r: 4 + r / 8}
    model = _grid_model_on_clock(monkeypatch, tmp_path, cost)
    dense, measured = make_target(model, runner="fast"), make_target(model, runner="fast")
    measured.weights = "int4"
    measured._int4()
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2, 7, 11])
    geometry, seen = (measured.n_heads, measured.n_kv, measured.head_dim), []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda q, *a, **k: seen.append(q.dtype) or sdpa(q, *a, **k))
    out = {}
    try:
        for dt in (torch.float32, torch.bfloat16):
            attention.override_prompt(*geometry, dt)
            seen.clear()
            out[dt] = measured.prefill(prompt).logits
            assert set(seen) == {dt}
            measured.weights, measured.int4_paths = "int4", "4bit"  # prompts on the dense fp32 weights
            seen.clear()
            torch.testing.assert_close(measured.prefill(prompt).logits, dense.prefill(prompt).logits, atol=0, rtol=0)
            assert set(seen) <= {torch.float32}
            measured.int4_paths = "measured"
    finally:
        attention.override_prompt(*geometry, None)
    assert not torch.equal(out[torch.bfloat16], out[torch.float32])
    torch.testing.assert_close(out[torch.bfloat16], out[torch.float32], atol=0.05, rtol=0.02)
    assert torch.equal(out[torch.bfloat16].argmax(-1), out[torch.float32].argmax(-1))


def test_a_path_table_times_a_stalled_reading_again(monkeypatch):
    """`fastest_by_rows`: a median out of proportion with its path's previous one (a stall while it was timed)
    is timed again, so one bad moment does not hand a prompt's rows to a slower path; a path that really costs
    that much at those rows keeps its reading."""
    from dart_lab.engine import int4
    calls = {}

    def clock(name, fn, x):  # "narrow" costs 1 + r/3, "wide" 2 + r/4; at 1024 rows "wide" stalls for `stalled` calls
        r = x.shape[0]
        calls[(name, r)] = calls.get((name, r), 0) + 1
        if name == "narrow":
            return 1 + r / 3
        return 1e5 if r == 1024 and calls[(name, r)] <= stalled else 2 + r / 4

    monkeypatch.setattr(int4, "_time_path", clock)
    paths = {"narrow": [lambda x: x], "wide": [lambda x: x]}
    for stalled, timed, want in ((0, 5, ((1, "narrow"), (256, "wide"))),
                                 (5, 10, ((1, "narrow"), (256, "wide"))),  # one sweep stalled: timed again
                                 (99, 15, ((1, "narrow"), (256, "wide"), (1024, "narrow")))):  # always: kept
        calls.clear()
        table, times = int4.fastest_by_rows(paths, 4, torch.float32, (1, 2, 8, 256, 1024))
        assert table == want and calls[("wide", 1024)] == timed
        assert times[1024]["wide"] == (1e5 if stalled == 99 else 258.0)


def test_int4_steps_take_the_path_measured_fastest_for_their_rows(monkeypatch, tmp_path):
    """int4_paths "measured" (`int4.int4_by_rows`): each linear runs, per row count, the path timed
    fastest -- here a stand-in clock where 4 bits cost r and the dense weights 4 + r/8 -- so narrow steps
    read 4 bits and wide ones the dense weights: a one-token step equals the all-4-bit target's, an 8-node
    tree the dense fp32 runner's; AR and speculation then run two arithmetics and part only at near-ties."""
    from dart_lab.engine import int4
    from dart_lab.bench import NEAR_TIE_LOGITS
    if not int4.can_int4(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    cost = {"int4": lambda r: r, "fp16": lambda r: r, "int8 halves": lambda r: r + 0.5, "fp32": lambda r: 4 + r / 8}
    model = _grid_model_on_clock(monkeypatch, tmp_path, cost)
    dense, four, measured = (make_target(model, runner="fast") for _ in range(3))
    four.weights, four.int4_paths = "int4", "4bit"
    measured.weights = "int4"
    for t in (four, measured):  # the paths alone: the K/V cache as the dense runner's (a bf16 one rounds it)
        t.bf16_cache = False
    layers, head = measured._int4()
    assert all(p.table == ((1, "int4"), (8, "fp32")) for row in layers for p in row)
    assert head.table == ((1, "fp16"), (8, "fp32")) and head.path(5) == "fp16" and head.path(64) == "fp32"
    assert measured.dtype_report["int4"]["by_rows"]["qkv"]["paths"] == "int4 (1-7 rows), fp32 (8+ rows)"
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2])
    one = Tree(torch.tensor([7]), torch.tensor([-1]))
    chain = Tree(torch.arange(20, 28), torch.arange(-1, 7))
    # a prompt takes the path of its row count too (9 rows: fp32 here), "4bit" prompts always dense
    pre = [t.prefill(prompt).logits for t in (dense, four, measured)]
    torch.testing.assert_close(pre[2], pre[0], atol=0, rtol=0)
    torch.testing.assert_close(pre[1], pre[0], atol=0, rtol=0)
    path, taken = int4.ByRows.path, []
    with monkeypatch.context() as m:
        m.setattr(int4.ByRows, "path", lambda self, r: taken.append(path(self, r)) or taken[-1])
        for p, want in ((prompt[:5], {"int4", "fp16"}), (prompt, {"fp32"})):
            taken.clear()
            measured.prefill(p)
            assert set(taken) == want
    torch.testing.assert_close(measured.verify(chain).logits, dense.verify(chain).logits, atol=1e-5, rtol=1e-5)
    for t in (four, measured):
        t.prefill(prompt)
    torch.testing.assert_close(measured.verify(one).logits, four.verify(one).logits, atol=0, rtol=0)
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    ar = generate(measured, prompt, None, cfg)
    spec = generate(measured, prompt, OracleDrafter(prompt.tolist() + ar.tokens, measured.vocab_size, depth=9), cfg)
    assert max(s["tree_size"] for s in spec.steps) >= 8  # trees wide enough for the dense path
    i = next((j for j, (a, b) in enumerate(zip(ar.tokens, spec.tokens)) if a != b), None)
    assert i is None or ar.margins[i] <= NEAR_TIE_LOGITS
    # the tables are cached per machine: another build reads them, whatever its clock would say
    cost["int4"] = lambda r: 0.0
    again = make_target(model, runner="fast")
    again.weights, again.bf16_cache = "int4", False
    assert again._int4()[0][0][0].table == ((1, "int4"), (8, "fp32"))
    assert again.dtype_report["int4"]["by_rows"]["cached"] and not measured.dtype_report["int4"]["by_rows"]["cached"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q|k|v with biases
def test_layers_in_one_op_are_the_eager_loop(monkeypatch, tmp_path, arch):
    """`dart_lab::q4_layers` (csrc/layers.cpp): where every linear of a step takes our 4-bit kernel and attention
    ours, the decoder layers run as one op calling the same kernels -- the eager loop's numbers bit for bit
    (logits, aux states, the K/V cache; one row and a batch, 1 and 4 nodes, fp32 and bf16 caches); and the
    steps do take it."""
    from dart_lab.engine import attention
    from dart_lab.engine import kernels
    from dart_lab.engine import step
    from dart_lab.engine.batch_target import BatchTarget
    if not (q4.available() and attention.available() and kernels.rope_cache_here() and kernels.rms_norm_here()
            and kernels.layers_here()):
        pytest.skip("our kernels are not built here")
    model = _grid_model_on_clock(monkeypatch, tmp_path, {"q4": lambda r: 0.0}, arch)  # our 4-bit kernel at every width
    taken = []
    stack = step._q4_stack
    monkeypatch.setattr(step, "_q4_stack", lambda *a: taken.append(stack(*a)) or taken[-1])
    prompts = [torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2]), torch.tensor([3, 8, 8, 17]), torch.tensor([11] * 6)]
    chain = Tree(torch.arange(20, 24), torch.arange(-1, 3))

    def steps(bf16: bool) -> list[torch.Tensor]:
        t = make_target(model, runner="fast")
        t.weights, t.bf16_cache = "int4", bf16
        t.prefill(prompts[0])
        monkeypatch.setitem(attention._state, (t.n_heads, t.n_kv, t.head_dim, t.cache_dtype), 4)
        taken.clear()
        one = t.verify(Tree.single(7), want_aux=True)
        t.commit([0])
        four = t.verify(chain, want_aux=True)
        t.commit([0, 1])
        bt = BatchTarget(t)
        bt.prefill(prompts)
        rows = bt.verify([Tree.single(3), chain, Tree.from_paths(4, [[6, 7]])], want_aux=True)
        bt.commit([[0], [0, 1, 2], [0, 1]])
        return [one.logits, one.aux, four.logits, four.aux, *t.kv_cache, *rows.logits, *rows.aux,  # each row's own slots
                *(c[:, b, :, :n] for b, n in enumerate(bt.lens) for c in (bt._k, bt._v))]

    for bf16 in (False, True):
        on = steps(bf16)
        assert len(taken) == 3 and all(s is not None for s in taken)
        with kernels.turned_off("layers"):
            off = steps(bf16)
        assert not taken
        assert all(torch.equal(a, b) for a, b in zip(on, off))


def test_q4_kernel_is_the_4bit_grid_to_fp32_rounding():
    """Our 4-bit kernel (`q4.Q4Linear`, csrc/q4mm.cpp): y = x' W^T with W = q * scale + low exactly, within the
    fp32 rounding bound of the path that ran (`q4.reference`), for any row count, x' = bf16(x) on its AVX-512 paths
    (rows 8 at a time; on AMX tiles 16 at a time, both checked where the CPU has AMX) and x's groups of 32 as 16-bit
    integers times a scale on its AVX2 path (4 rows at a time, checked on every CPU) -- torch's int4 kernel rounds
    scale and zero to bf16 too; asked for some rows only, those rows' numbers as computed alone and 0 for the
    others. An 8-bit grid (a Q8_0 LM head) as two 4-bit halves, and as itself through `q8mm` (x's groups as 16-bit
    integers on every CPU). `pack` and `pack8` refuse what the kernels cannot hold."""
    if not q4.available():
        pytest.skip(f"our 4-bit kernel is not built here: {q4.reason()}")
    default = q4.amx_rows()
    try:
        for amx in ([None] if default < 0 else [1, 1 << 30]):  # with AMX: every row count on the tiles, then none
            if amx is not None:
                q4.amx_rows(amx)
            _q4_kernel_checks(q4.path())
        with q4.taking("avx2-int16"):  # the AVX2 path (a CPU without AVX512-BF16 takes it), here as well
            _q4_kernel_checks("avx2-int16")
    finally:
        if default >= 0:
            q4.amx_rows(default)


def test_the_4bit_reference_is_each_paths_arithmetic():
    """`q4.reference`, the one reference every check of a 4-bit product reads: on each path its x is the path's
    reading of x (bf16, or 16-bit integers per group that differ from bf16), torch's int4 kernel lands within its
    bound, and a result off by more than the bound anywhere fails `check` in one line naming the path."""
    from dart_lab.engine.int4 import Int4Linear, can_int4
    g = torch.Generator().manual_seed(3)
    N, K = 32, 128
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 0.005).half().float()
    low = (torch.randn(N, K // 32, 1, generator=g) * 0.05).half().float()
    x = torch.randn(3, K, generator=g)
    bf, i16 = q4.x_as_read(x, "avx512-bf16"), q4.x_as_read(x, "avx2-int16")
    assert torch.equal(bf, x.to(torch.bfloat16).double()) and not torch.equal(bf, i16)
    assert (i16 - x.double()).abs().max() < (bf - x.double()).abs().max()  # 16 bits a group: closer than bf16's 8
    if can_int4(torch.device("cpu")):
        ref = q4.reference(x, (q, scale, low), name="torch-int4")
        ref.check(Int4Linear(q, scale, low)(x), "torch's int4 kernel")
        # the bf16 path's reference is not torch's: its scale and zero are not rounded, its result not in bf16
        assert not torch.equal(ref.want, q4.reference(x, (q, scale, low), name="avx512-bf16").want)
    ref = q4.reference(x, (q, scale, low), name="avx2-int16")
    ref.check(ref.want)
    off = ref.want.clone()
    off[1, 5] += 3 * ref.tol[1, 5]
    with pytest.raises(AssertionError, match="avx2-int16"):
        ref.check(off)
    with pytest.raises(ValueError, match="unknown 4-bit path"):
        q4.reference(x, (q, scale, low), name="avx10")


def _q4_kernel_checks(path: str):
    from dart_lab.engine.int4 import Int4Linear
    g = torch.Generator().manual_seed(0)
    for N, K in ((48, 96), (32, 64)):
        q = torch.randint(0, 16, (N, K), generator=g)
        scale = (torch.rand(N, K // 32, 1, generator=g) * 0.02 + 0.005).half().float()
        low = (torch.randn(N, K // 32, 1, generator=g) * 0.05).half().float()
        bias = torch.randn(N, generator=g)
        lin = q4.Q4Linear.of_groups((q, scale, low), bias)
        for M in (1, 2, 5, 8, 9, 16, 19, 33):
            x = torch.randn(M, K, generator=g)
            q4.reference(x, (q, scale, low), bias, path).check(lin(x))
            # some rows only (a batch step's real nodes): those rows' numbers exactly, the others 0
            some = torch.arange(0, M, 2)
            y = torch.ops.dart_lab.q4mm(x, lin.wp, lin.sl, N, 1, some) + bias
            full = torch.ops.dart_lab.q4mm(x[some], lin.wp, lin.sl, N, 1) + bias
            assert torch.equal(y[some], full) and not y[1::2].sub(bias).any()
        from dart_lab.engine import kernels
        if kernels.rms_norm_here():  # x through a layer's RMSNorm inside the kernel (`norm`): dart_lab::rms_norm's numbers
            nw = torch.rand(K, generator=g) + 0.5
            for M in (1, 5, 9, 19):
                x = torch.randn(M, K, generator=g) * 3
                ref = torch.ops.dart_lab.q4mm(torch.ops.dart_lab.rms_norm(x, nw, 1e-5), lin.wp, lin.sl, N, 1)
                assert torch.equal(torch.ops.dart_lab.q4mm(x, lin.wp, lin.sl, N, 1, None, nw, 1e-5), ref)
                some = torch.arange(0, M, 2)
                y = torch.ops.dart_lab.q4mm(x, lin.wp, lin.sl, N, 1, some, nw, 1e-5)
                assert torch.equal(y[some], ref[some]) and not y[1::2].any()
                # a residual added to the product inside the kernel: at::add's numbers, the rows not computed its own
                res = torch.randn(M, N, generator=g)
                assert torch.equal(torch.ops.dart_lab.q4mm(x, lin.wp, lin.sl, N, 1, None, nw, 1e-5, res), res + ref)
                y = torch.ops.dart_lab.q4mm(x, lin.wp, lin.sl, N, 1, some, nw, 1e-5, res)
                assert torch.equal(y[some], res[some] + ref[some]) and torch.equal(y[1::2], res[1::2])
        x = torch.randn(2, 3, K, generator=g).to(torch.bfloat16)  # any leading shape and dtype: x's back
        assert lin(x).shape == (2, 3, N) and lin(x).dtype == torch.bfloat16
        q4.reference(x.float().reshape(6, K), (q, scale, low), bias, path, out_dtype=torch.bfloat16).check(
            lin(x).reshape(6, N), "the kernel with bf16 inputs")
        # an 8-bit grid (a GGUF Q8_0 LM head) as two 4-bit halves over [x, x]
        q8 = torch.randint(-127, 128, (N, K), generator=g)
        d = (torch.rand(N, K // 32, 1, generator=g) * 1e-3 + 1e-4).half().float()
        head = q4.Q4Linear.of_groups(Int4Linear.halves_of(q8, d), halves=2)
        # and as itself (`q8mm`: one product a weight, x's groups as 16-bit integers on every CPU), bias and any
        # leading shape and dtype as above
        q8lin = q4.Q8Linear.of_grid(q8, d, bias)
        for M in (1, 5, 9, 17):
            x = torch.randn(M, K, generator=g)
            halves = Int4Linear.halves_of(q8, d)
            q4.reference(x, halves, None, path, halves=2).check(head(x), "the 8-bit grid as two 4-bit halves")
            q4.reference(x, halves, bias, "avx2-int16", halves=2).check(q8lin(x), "q8mm")
        assert q8lin(torch.randn(2, 3, K, generator=g).to(torch.bfloat16)).shape == (2, 3, N)
    assert q4.pack(q[:24], scale[:24], low[:24]) is None  # outputs not a multiple of 16
    assert q4.pack(q, scale + 1e-4, low) is None  # scales that are no fp16 numbers
    assert q4.pack8(q8[:24], d[:24]) is None and q4.pack8(q8, d + 1e-6) is None


def test_int4_steps_on_our_kernel_are_the_grid_with_bf16_inputs(monkeypatch, tmp_path):
    """Where our kernel measures fastest (stand-in clock) every 4-bit linear takes it: a one-token step and an
    8-node tree equal the dense fp32 runner's within x's bf16 rounding alone (tighter than torch's int4
    kernel allows), and greedy speculation equals greedy AR but at near-ties."""
    from dart_lab.bench import NEAR_TIE_LOGITS
    if not q4.available():
        pytest.skip(f"our 4-bit kernel is not built here: {q4.reason()}")
    cost = {"q4": lambda r: r, "fp16": lambda r: r}
    model = _grid_model_on_clock(monkeypatch, tmp_path, cost)
    dense, measured = make_target(model, runner="fast"), make_target(model, runner="fast")
    measured.weights = "int4"
    layers, _ = measured._int4()
    assert all(p.table == ((1, "q4"),) for row in layers for p in row)
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2])
    for tree in (Tree(torch.tensor([7]), torch.tensor([-1])), Tree(torch.arange(20, 28), torch.arange(-1, 7))):
        dense.prefill(prompt), measured.prefill(prompt)
        a, b = dense.verify(tree, want_aux=True), measured.verify(tree, want_aux=True)
        torch.testing.assert_close(b.logits, a.logits, atol=0.05, rtol=0.01)
        torch.testing.assert_close(b.aux, a.aux, atol=0.02, rtol=0.01)
    cfg = GenerationConfig(max_new_tokens=24, stop_on_eos=False)
    ar = generate(measured, prompt, None, cfg)
    spec = generate(measured, prompt, OracleDrafter(prompt.tolist() + ar.tokens, measured.vocab_size, depth=5), cfg)
    i = next((j for j, (x, y) in enumerate(zip(ar.tokens, spec.tokens)) if x != y), None)
    assert i is None or ar.margins[i] <= NEAR_TIE_LOGITS


def test_int4_without_our_kernel_runs_on_torchs(monkeypatch, tmp_path):
    """Where our kernel cannot be built (a CPU without AVX2 and F16C, no compiler: `q4.reason()` says why), it is
    never offered, however fast a clock would call it: every 4-bit linear takes torch's kernel, as the
    all-4-bit target does, with the same logits."""
    from dart_lab.engine import int4
    if not int4.can_int4(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    monkeypatch.setitem(q4._state, "reason", "stand-in: this CPU lacks avx2")
    cost = {"int4": lambda r: r, "q4": lambda r: r / 10, "q4 halves": lambda r: r / 10, "fp16": lambda r: r,
            "fp32": lambda r: 4 + r / 8}  # wide forwards (the prompt) dense, as the all-4-bit target runs them
    model = _grid_model_on_clock(monkeypatch, tmp_path, cost)
    four, measured = make_target(model, runner="fast"), make_target(model, runner="fast")
    four.weights, four.int4_paths = "int4", "4bit"
    measured.weights = "int4"
    for t in (four, measured):  # the paths alone: the K/V cache as the dense runner's (a bf16 one rounds it)
        t.bf16_cache = False
    layers, head = measured._int4()
    assert not q4.available() and all(p.table == ((1, "int4"), (8, "fp32")) for row in layers for p in row)
    assert "q4 halves" not in head.paths and head.path(1) == "fp16"
    prompt, one = torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2]), Tree(torch.tensor([7]), torch.tensor([-1]))
    for t in (four, measured):
        t.prefill(prompt)
    torch.testing.assert_close(measured.verify(one).logits, four.verify(one).logits, atol=0, rtol=0)


@pytest.mark.slow  # torch.compile: tens of seconds
def test_compiled_int4_steps_take_the_paths_measured_for_their_rows(monkeypatch, tmp_path):
    """Compiled 4-bit steps with int4_paths "measured" follow the same per-row-count tables as eager ones
    (`StepGraph._measured_paths`): with a stand-in clock where 8+ rows run the dense fp32 weights, an 8-node
    verify compiled equals the eager one (fp32, not the 4-bit kernel's bf16 arithmetic) and a one-token
    step stays in 4 bits."""
    from dart_lab.engine import int4
    if not int4.can_int4(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    # narrow steps in 4 bits: our kernel (q4.py) where this CPU builds it, else torch's
    cost = {"int4": lambda r: r, "q4": lambda r: r - 0.5, "fp16": lambda r: r, "int8 halves": lambda r: r + 0.5,
            "fp32": lambda r: 4 + r / 8}
    model = _grid_model_on_clock(monkeypatch, tmp_path, cost)
    target = make_target(model, runner="fast")
    target.weights = "int4"
    narrow = "q4" if q4.available() else "int4"
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31, 40, 2])
    one, chain = Tree(torch.tensor([7]), torch.tensor([-1])), Tree(torch.arange(20, 28), torch.arange(-1, 7))
    eager = {}
    for name, tree in (("one", one), ("chain", chain)):
        target.prefill(prompt)
        eager[name] = target.verify(tree).logits
    target.compile, target.node_buckets, target.key_bucket, target.compile_capacity = True, (1, 8), 64, 128
    compiled = {}
    for name, tree in (("one", one), ("chain", chain)):
        target.prefill(prompt)
        compiled[name] = target.verify(tree).logits
    assert target.compiled_shapes == {(1, 64), (8, 64)}
    torch.testing.assert_close(compiled["chain"], eager["chain"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled["one"], eager["one"], atol=1e-3, rtol=1e-3)
    graph = target._graph()
    assert graph.int4[1].path(8) == "fp32" and graph.int4[1].path(1) == "fp16"
    assert all(p.path(1) == narrow and p.path(8) == "fp32" for row in graph.int4[0] for p in row)


@pytest.mark.slow  # torch.compile: tens of seconds
def test_compiled_int4_steps_equal_eager_int4():
    """4-bit weights compiled (`StepGraph` over the `Int4Linear` calls, the ops between them fused): the same
    arithmetic as the eager int4 step up to float reordering, so the same greedy tokens."""
    from dart_lab.engine.int4 import can_int4
    if not can_int4(torch.device("cpu")):
        pytest.skip("this torch has no CPU int4 kernel")
    model = tiny_model("llama")
    _as_4bit_grids(model)
    target = make_target(model, runner="fast")
    target.weights, target.int4_paths = "int4", "4bit"  # compiled steps run 4 bits at every width
    prompt = torch.tensor([5, 9, 14, 5, 9, 22, 31])
    tree = Tree(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))
    cfg = GenerationConfig(max_new_tokens=20, stop_on_eos=False)
    target.prefill(prompt)
    eager = target.verify(tree).logits
    ar = generate(target, prompt, None, cfg).tokens
    # one shape for everything (a token and the tree padded to 8 nodes, 128 keys): one compilation
    target.compile, target.node_buckets, target.key_bucket, target.compile_capacity = True, (8,), 128, 128
    target.prefill(prompt)
    torch.testing.assert_close(target.verify(tree).logits, eager, atol=1e-3, rtol=1e-3)
    assert generate(target, prompt, None, cfg).tokens == ar
    assert target.compiled_shapes == {(8, 128)} and target.compile_seconds > 0


def test_attention_kernel_is_sdpa_to_fp32_rounding():
    """Our decoding attention (`dart_lab::decode_attn`, csrc/attention.cpp) against torch's SDPA: grouped
    query heads, 1-8 nodes a row, a mask per row, one for every row or none, keys read from a longer cache
    (strided), every head size the kernel has, fp32 or bf16 caches; masked keys weigh exactly 0 (a key masked out cannot move
    the output, however large its value)."""
    from dart_lab.engine import attention
    if not attention.available():
        pytest.skip(f"our attention kernel is not built here: {attention.reason()}")
    g = torch.Generator().manual_seed(0)
    # the last three: fewer (row, key head) pairs than two a thread, their query rows cut into blocks (one partial)
    for B, H, Hk, D, N, nk in ((3, 9, 3, 64, 1, 37), (2, 16, 8, 128, 4, 129), (1, 4, 4, 16, 2, 16), (2, 8, 1, 32, 5, 21),
                               (1, 9, 3, 64, 8, 50), (1, 6, 2, 32, 3, 30)):
        q = torch.randn(B, H, N, D, generator=g)
        K, V = torch.randn(B, Hk, nk + 7, D, generator=g), torch.randn(B, Hk, nk + 7, D, generator=g)
        allowed = torch.rand(B, 1, N, nk, generator=g) > 0.3
        allowed[..., 0] = True
        mask = torch.zeros(B, 1, N, nk).masked_fill_(~allowed, float("-inf"))
        for m in (mask, mask[:1], None):
            got = torch.ops.dart_lab.decode_attn(q, K[:, :, :nk], V[:, :, :nk], m, D ** -0.5)
            torch.testing.assert_close(got, attention._sdpa(q, K, V, m, nk, D ** -0.5), atol=2e-6, rtol=1e-5)
            # a bf16 cache is read as its values widened to fp32: exactly the fp32 kernel on those values
            Kb, Vb = K.bfloat16(), V.bfloat16()
            assert torch.equal(torch.ops.dart_lab.decode_attn(q, Kb[:, :, :nk], Vb[:, :, :nk], m, D ** -0.5),
                               torch.ops.dart_lab.decode_attn(q, Kb[:, :, :nk].float(), Vb[:, :, :nk].float(), m,
                                                              D ** -0.5))
        V2 = V.clone()
        V2[:, :, :nk][~allowed[:, 0, 0, None, :, None].expand(B, Hk, nk, D)] = 1e30  # row 0's masked keys
        one = lambda V: torch.ops.dart_lab.decode_attn(q[:, :, :1], K[:, :, :nk], V[:, :, :nk], mask[:, :, :1], 0.1)  # noqa: E731
        assert torch.equal(one(V2), one(V))
    # a batch row's slots past its own keys (up to the longest row's) masked for every position are not read:
    # the row computes exactly what it computes alone over its keys and its tree's
    B, H, Hk, D, N, nk = 3, 9, 3, 64, 3, 90
    q = torch.randn(B, H, N, D, generator=g)
    K, V = torch.randn(B, Hk, nk, D, generator=g), torch.randn(B, Hk, nk, D, generator=g)
    lens, P = (70, 41, 19), nk - N
    allowed = torch.zeros(B, 1, N, nk, dtype=torch.bool)
    allowed[..., P:] = torch.ones(N, N, dtype=torch.bool).tril()
    for b, n in enumerate(lens):
        allowed[b, ..., :n] = True
    mask = torch.zeros(B, 1, N, nk).masked_fill_(~allowed, float("-inf"))
    got = torch.ops.dart_lab.decode_attn(q, K, V, mask, 0.125)
    for b, n in enumerate(lens):
        keys = torch.cat([torch.arange(n), torch.arange(P, nk)])
        alone = torch.ops.dart_lab.decode_attn(q[b:b + 1], K[b:b + 1, :, keys], V[b:b + 1, :, keys],
                                               mask[b:b + 1, ..., keys], 0.125)
        assert torch.equal(got[b:b + 1], alone)
    # trees padded to the step's widest: a pad position sees its own slot only and takes its V exactly; the row's
    # real positions compute exactly what its own tree alone does
    sizes = (3, 1, 2)
    for b, n in enumerate(sizes):
        allowed[b, 0, n:] = False
        allowed[b, 0, n:, P:] = torch.eye(N, dtype=torch.bool)[n:]
    mask = torch.zeros(B, 1, N, nk).masked_fill_(~allowed, float("-inf"))
    got = torch.ops.dart_lab.decode_attn(q, K, V, mask, 0.125)
    for b, (n, ln) in enumerate(zip(sizes, lens)):
        keys = torch.cat([torch.arange(ln), torch.arange(P, P + n)])
        alone = torch.ops.dart_lab.decode_attn(q[b:b + 1, :, :n], K[b:b + 1, :, keys], V[b:b + 1, :, keys],
                                               mask[b:b + 1, :, :n][..., keys], 0.125)
        assert torch.equal(got[b:b + 1, :, :n], alone)
        for p in range(n, N):  # the pad position's one key: slot P + p, its V for each query head of the key head
            assert torch.equal(got[b, :, p], V[b, :, P + p].repeat_interleave(H // Hk, 0))


def test_rope_cache_op_is_the_torch_ops_it_replaces():
    """`dart_lab::rope_cache` (csrc/rope.cpp): q rotated, k rotated and v written to their cache slots, fp32 or
    bf16 caches, bit for bit what the eager step's torch ops compute (rotation, casts, index_copy_)."""
    from dart_lab.engine import kernels
    from dart_lab.engine.step import _rotate
    if not kernels.rope_cache_here():
        pytest.skip(f"our rope kernel is not built here: {kernels._rope['reason']}")
    g = torch.Generator().manual_seed(0)
    for B, N, H, Hk, D, dt in ((1, 1, 9, 3, 64, torch.float32), (3, 4, 9, 3, 64, torch.bfloat16),
                               (2, 3, 4, 2, 40, torch.float32), (2, 2, 4, 1, 40, torch.bfloat16)):
        heads = torch.randn(B, N, H + 2 * Hk, D, generator=g)
        cos, sin = torch.randn(B, N, D, generator=g), torch.randn(B, N, D, generator=g)
        K, V = torch.randn(B, Hk, 12, D, generator=g).to(dt), torch.randn(B, Hk, 12, D, generator=g).to(dt)
        slots = torch.tensor([7, 2, 9, 5][:N])
        qk = _rotate(heads[:, :, :H + Hk].transpose(1, 2), cos[:, None], sin[:, None])
        K2, V2 = K.clone(), V.clone()
        K2.index_copy_(2, slots, qk[:, H:].to(dt))
        V2.index_copy_(2, slots, heads[:, :, H + Hk:].transpose(1, 2).to(dt))
        q = torch.ops.dart_lab.rope_cache(heads, cos, sin, K, V, slots, H, Hk)
        assert torch.equal(q, qk[:, :H]) and torch.equal(K, K2) and torch.equal(V, V2)


def test_rope_heads_op_is_the_torch_ops_it_replaces():
    """`dart_lab::rope_heads` (csrc/rope.cpp): a prompt's q and k rotated and v transposed, bit for bit what the
    torch ops compute (`_rotate` over the transposed heads), one row and several, head sizes of 64 and 40."""
    from dart_lab.engine import kernels
    from dart_lab.engine.step import _rotate
    if not kernels.rope_cache_here():
        pytest.skip(f"our rope kernel is not built here: {kernels._rope['reason']}")
    g = torch.Generator().manual_seed(0)
    for B, N, H, Hk, D in ((1, 37, 9, 3, 64), (2, 5, 4, 2, 40)):
        heads = torch.randn(B, N, H + 2 * Hk, D, generator=g)
        cos, sin = torch.randn(B, N, D, generator=g), torch.randn(B, N, D, generator=g)
        qk = _rotate(heads[:, :, :H + Hk].transpose(1, 2), cos[:, None], sin[:, None])
        q, k, v = torch.ops.dart_lab.rope_heads(heads, cos, sin, H, Hk)
        assert torch.equal(q, qk[:, :H]) and torch.equal(k, qk[:, H:])
        assert torch.equal(v, heads[:, :, H + Hk:].transpose(1, 2)) and v.is_contiguous()


def test_top2_op_is_torch_max_and_topk():
    """`dart_lab::top2` (csrc/norm.cpp): each row's argmax (its first maximum, as torch's max) and two largest
    values (topk(2)), ties and widths that are not a multiple of 16 included; `generate.top2` agrees with the
    torch path it replaces."""
    from dart_lab.engine import kernels
    from dart_lab.generate import top2
    if not kernels.top2_here():
        pytest.skip(f"our norm kernels are not built here: {kernels._norm['reason']}")
    g = torch.Generator().manual_seed(0)
    for R, V in ((1, 49152), (8, 4096), (5, 37), (3, 2), (2, 100)):
        x = torch.randn(R, V, generator=g)
        x[0, V // 3] = x[0, V - 1] = x[0].max() + 1  # a tie: the first of them, a margin of 0
        if R > 1:
            x[1, 0] = float("-inf")
        values, index = torch.ops.dart_lab.top2(x)
        assert torch.equal(values, torch.topk(x, 2, -1).values) and torch.equal(index, x.max(-1).indices)
        best, margins = top2(x)
        assert best == x.max(-1).indices.tolist() and margins[0] == 0.0
        with kernels.turned_off("norm"):
            assert top2(x) == (best, margins)


def test_move_slots_op_is_the_indexed_copy():
    """`dart_lab::move_slots` (csrc/rope.cpp): a batch's cache compaction, bit for bit the advanced-indexing
    copy `BatchTarget.commit` makes without it (fp32 and bf16 caches; several rows, moves in place skipped)."""
    from dart_lab.engine import kernels
    if not kernels.move_slots_here():
        pytest.skip(f"our rope kernel is not built here: {kernels._rope['reason']}")
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        K, V = (torch.randn(3, 4, 2, 40, 16, generator=g).to(dt) for _ in range(2))
        rows, src, dst = [0, 0, 2, 3, 3, 3], [30, 33, 20, 31, 34, 36], [20, 21, 20, 10, 11, 12]
        K2, V2 = K.clone(), V.clone()
        r, s, d = torch.tensor(rows), torch.tensor(src), torch.tensor(dst)
        K2[:, r, :, d], V2[:, r, :, d] = K2[:, r, :, s], V2[:, r, :, s]
        torch.ops.dart_lab.move_slots(K, V, rows, src, dst)
        assert torch.equal(K, K2) and torch.equal(V, V2)
        with pytest.raises(RuntimeError, match="outside the cache"):
            torch.ops.dart_lab.move_slots(K, V, [0], [40], [0])


@pytest.mark.parametrize("nodes", [0, 16])  # SDPA for every step; our kernel up to 16 nodes a row
def test_steps_on_either_attention_equal_the_public_forward(monkeypatch, nodes):
    """Whichever attention `attention.prepare` picks, the lean runner's tree verifies (one row and a batch)
    equal the model's own forward, and greedy speculation equals AR; with the kernel picked, no step of up
    to 16 nodes a row goes through SDPA (only prompts and wider trees)."""
    from conftest import tiny_target
    from dart_lab.engine import attention
    from dart_lab.engine.batch_target import BatchTarget
    if nodes and not attention.available():
        pytest.skip(f"our attention kernel is not built here: {attention.reason()}")
    ref, fast = tiny_target("qwen3", runner="hf"), tiny_target("qwen3", runner="fast")
    monkeypatch.setitem(attention._state, (fast.n_heads, fast.n_kv, fast.head_dim, fast.cache_dtype), nodes)  # restored after
    sdpa = attention._sdpa
    def only_prompts(q, K, V, mask, n_keys, scale, causal=False):
        assert causal or q.shape[2] > nodes, "a decoding step of the kernel's size went through SDPA"
        return sdpa(q, K, V, mask, n_keys, scale, causal)
    monkeypatch.setattr(attention, "_sdpa", only_prompts)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, ref.vocab_size, (11,), generator=g)
    for n in (1, 3, 9):
        tree = Tree(torch.randint(2, ref.vocab_size, (n,), generator=g),
                    torch.tensor([-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]))
        for t in (ref, fast):
            t.prefill(prompt)
        torch.testing.assert_close(fast.verify(tree).logits, ref.verify(tree).logits, atol=2e-4, rtol=1e-4)
    prompts = [prompt, prompt[:6], torch.randint(2, ref.vocab_size, (15,), generator=g)]
    bt = BatchTarget(fast)
    bt.prefill(prompts)
    out = bt.verify([Tree.single(int(p[-1])) for p in prompts])
    for p, logits in zip(prompts, out.logits):
        ref.prefill(p)
        torch.testing.assert_close(logits, ref.verify(Tree.single(int(p[-1]))).logits, atol=2e-4, rtol=1e-4)
    cfg = GenerationConfig(max_new_tokens=16)
    ar = generate(fast, prompt, None, cfg)
    oracle = OracleDrafter(prompt.tolist() + ar.tokens, fast.vocab_size)
    assert generate(fast, prompt, oracle, cfg).tokens == ar.tokens == generate(ref, prompt, None, cfg).tokens


def test_rms_norm_op_is_torchs_to_fp32_rounding():
    """Our one-pass norm (`dart_lab::rms_norm`, csrc/norm.cpp; an eager step's norms where it builds) against
    F.rms_norm: any width (a partial last vector too), any leading shape; contiguous fp32 only. And the MLP's
    silu(gate) * up in one dispatch (`silu_mul`), exactly torch's, and its bf16 -> bf16 form."""
    import torch.nn.functional as F
    from dart_lab.engine import kernels
    if not kernels.rms_norm_here():
        pytest.skip(f"our norm is not built here: {kernels._norm['reason']}")
    g = torch.Generator().manual_seed(0)
    for shape in ((1, 1, 576), (3, 5, 64), (2, 1000), (4, 7)):
        x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g)
        torch.testing.assert_close(torch.ops.dart_lab.rms_norm(x, w, 1e-5), F.rms_norm(x, (shape[-1],), w, 1e-5),
                                   atol=1e-6, rtol=1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.dart_lab.rms_norm(torch.randn(8, 6).T, torch.randn(8), 1e-5)
    # the MLP's silu(gate) * up from the fused projection's output (`silu_mul`, one pass in fp32): torch's own ops'
    # numbers, bit for bit -- any row count and width (each row's last I % 32 values on the scalar path; gates far
    # into silu's tails), any leading shape; another dtype by torch's ops
    for shape in ((37, 2 * 1536), (2, 3, 2 * 48), (2, 5, 2 * 40), (1, 2 * 8), (0, 2 * 16), (300, 2 * 96)):
        for scale in (4, 40):
            gu = torch.randn(*shape, generator=g) * scale
            gate, up = gu.chunk(2, dim=-1)
            assert torch.equal(torch.ops.dart_lab.silu_mul(gu), F.silu(gate) * up)
    gate, up = gu.half().chunk(2, dim=-1)
    assert torch.equal(torch.ops.dart_lab.silu_mul(gu.half()), F.silu(gate) * up)
    # from bf16 to bf16 (`silu_mul_bf16`, a prompt's MLP on bf16 copies): the fp32 op on the widened values, rounded
    # once -- any row count (blocks of rows over the threads, a partial last block) and width, any leading shape
    # (each row's last I % 32 values on the scalar path; gates far into silu's tails)
    for shape in ((37, 2 * 1536), (2, 5, 2 * 40), (1, 2 * 8), (0, 2 * 16), (300, 2 * 96)):
        for scale in (4, 40):
            gu = (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
            assert torch.equal(torch.ops.dart_lab.silu_mul_bf16(gu), torch.ops.dart_lab.silu_mul(gu.float()).to(torch.bfloat16))


# the kernel tests above that run our C++ kernels: again under their AVX2 builds where this CPU has AVX-512
KERNEL_TESTS = ("layers_in_one_op or q4_kernel or attention_kernel or rope_cache or rope_heads or top2 or move_slots "
                "or either_attention or rms_norm_op or int4_steps_on_our or isa_variable or 4bit_reference")


def test_the_isa_variable_picks_the_kernels_build():
    """DART_LAB_ISA=avx2 runs every kernel's AVX2 build (`kernels.isa()`, the 4-bit kernel's AVX2 path) on a CPU
    that has AVX-512 too; unset, the AVX-512 builds run where the CPU has them."""
    from dart_lab.engine import kernels
    flags = kernels.cpu_flags()
    if not kernels.EAGER_ISA <= flags:
        pytest.skip("this CPU lacks AVX2 + FMA + F16C: no kernel build runs")
    if os.environ.get("DART_LAB_ISA") == "avx2":
        assert kernels.isa() == "avx2" and not any(f.startswith("avx512") for f in flags)
        assert not q4.available() or q4.avx2_path()
    else:
        assert kernels.isa() == ("avx512" if "avx512f" in flags else "avx2")


def test_the_kernels_avx2_builds_pass_the_kernel_tests(tmp_path):
    """The eager-step kernels are written once for 16 lanes and built for AVX-512 and for AVX2 (csrc/vec.h; most
    laptops' CPUs have AVX2 only). On a CPU with AVX-512 the tests above run the AVX-512 builds; here they run
    again in a process with DART_LAB_ISA=avx2 and torch's own AVX2 kernels (ATEN_CPU_CAPABILITY), against the same
    references (torch's ops, SDPA, the public forward), and must all pass, none skipped."""
    rerun_as_avx2(__file__, KERNEL_TESTS, tmp_path)
