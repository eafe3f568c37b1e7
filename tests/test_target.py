"""Tree verification equals sequential decoding; cache compaction equals recomputation."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_target
from dart_lab import Tree

# the HF public-forward runner and the lean runner, each held against the model's own forward
TARGETS = {f"{arch}-{runner}": tiny_target(arch, runner=runner)
           for arch in ("llama", "qwen3", "qwen2") for runner in ("hf", "fast")}


@st.composite
def prompt_and_tree(draw):
    prompt = draw(st.lists(st.integers(2, 95), min_size=1, max_size=24))
    n = draw(st.integers(1, 24))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = draw(st.lists(st.integers(0, 95), min_size=n, max_size=n))
    return prompt, Tree(torch.tensor(tokens), torch.tensor(parents))


def sequential_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)[None]).logits[0].float()


@given(st.sampled_from(sorted(TARGETS)), prompt_and_tree())
@settings(max_examples=25, deadline=None)
def test_tree_logits_equal_path_logits(arch, case):
    prompt, tree = case
    target = TARGETS[arch]
    target.prefill(torch.tensor(prompt))
    out = target.verify(tree)
    for path in tree.leaf_paths():
        ref = sequential_logits(target.model, prompt + tree.tokens[path].tolist())[len(prompt):]
        torch.testing.assert_close(out.logits[path], ref, atol=1e-4, rtol=1e-4)
    target.commit([0])


@given(st.sampled_from(sorted(TARGETS)), prompt_and_tree(), st.data())
@settings(max_examples=25, deadline=None)
def test_commit_equals_recompute(arch, case, data):
    """After keeping one root-to-node path, the next logits equal a fresh forward of the sequence."""
    prompt, tree = case
    target = TARGETS[arch]
    target.prefill(torch.tensor(prompt))
    target.verify(tree)
    path = tree.path_to(data.draw(st.integers(0, len(tree) - 1)))
    target.commit(path)
    assert target.seq_len == len(prompt) + len(path)
    nxt = data.draw(st.integers(0, 95))
    out = target.verify(Tree.single(nxt), want_aux=True)
    seq = prompt + tree.tokens[path].tolist() + [nxt]
    with torch.no_grad():
        ref = target.model(torch.tensor(seq)[None], output_hidden_states=True)
    torch.testing.assert_close(out.logits[0], ref.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
    ref_aux = torch.cat([ref.hidden_states[i][0, -1] for i in target.aux_layers])
    torch.testing.assert_close(out.aux[0], ref_aux, atol=1e-4, rtol=1e-4)
    target.commit([0])


def test_aux_layers_are_inputs_of_layers_2_mid_and_L_minus_3():
    target = TARGETS["llama-hf"]  # a pre-hook on the decoder layer: the HF runner calls it
    L = target.num_layers
    assert target.aux_layers == (2, L // 2, L - 3)
    # hidden_states[i] is the input of decoder layer i: check with a forward pre-hook on layer L//2
    seen = {}
    layer = target.model.model.layers[L // 2]

    def hook(mod, args, kwargs):
        seen["x"] = args[0] if args else kwargs["hidden_states"]

    h = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        out = target.prefill(torch.tensor([3, 4, 5]), want_aux=True)
    finally:
        h.remove()
    H = target.hidden_size
    torch.testing.assert_close(out.aux[:, H:2 * H], seen["x"][0])


def test_auto_dtype_times_interleaved_rounds_and_keeps_exact_fp32_weights(monkeypatch):
    """dtype="auto" (loading.choose_dtype): each dtype keeps its fastest reading over interleaved rounds
    (a host whose speed drifts once picked fp32 in one process and bf16 in the next), and when fp32 wins
    the model's weights are its exact fp32 ones, not rounded through a half type by the probe."""
    from dart_lab import loading
    target = tiny_target("llama", runner="fast")  # the fast runner: int4 is a candidate too
    calls = []

    def timing(t, sizes, repeats, prompt_len):  # bf16 reads 1.5x slow in round 1 only (a slow moment), fp16 always
        dt = "int4" if t.weights == "int4" else t.model.lm_head.weight.dtype
        calls.append(dt)
        slow = {torch.float32: 1.0, torch.bfloat16: 1.5 if calls.count(dt) == 1 else 0.5, torch.float16: 9.0,
                "int4": 0.99}[dt]
        return {n: 10.0 * slow for n in sizes}
    monkeypatch.setattr(loading, "measure_verify", timing)
    dt, report = loading.choose_dtype(target, torch.tensor([5, 9, 14, 5, 9, 22]))
    assert dt == torch.bfloat16 and report["choice"] == "torch.bfloat16" and report["torch.bfloat16_speedup"] == 2.0
    assert calls.count(torch.float16) == 1 and calls.count(torch.float32) == 3  # fp16: timed once, 9x slower
    assert target.model.lm_head.weight.dtype == torch.bfloat16 and target.weights == "dense"
    assert calls.count("int4") == 3 and report["int4_speedup"] < 1.03  # timed, 1 % faster: not taken

    monkeypatch.setattr(loading, "measure_verify", lambda t, sizes, repeats, prompt_len: {n: 10.0 for n in sizes})
    target = tiny_target("llama")  # fp32, as loaded
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    dt, report = loading.choose_dtype(target, torch.tensor([5, 9, 14, 5, 9, 22]))  # none is 1.03x faster
    assert dt == torch.float32 and report["choice"] == "torch.float32"
    after = target.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
