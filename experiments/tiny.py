"""Not an experiment: what the scripts' smallest mode (`--smoke`, or DART_LAB_SMOKE=1) runs on instead of the
embedded SmolLM2 target -- tiny random Llama / Qwen3 models (fp32, CPU, milliseconds a forward), random prompts
and a random n-gram table. tests/test_experiments.py runs every script so."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: its dart_lab, run by path
from dart_lab.loading import make_target  # noqa: E402
from dart_lab.ngram import NGram  # noqa: E402
from dart_lab.smoke import SMOKE  # noqa: E402

VOCAB = 256


def smoke_default() -> bool:
    """`--smoke`'s default: on when DART_LAB_SMOKE is set (`dart_lab.smoke`)."""
    return SMOKE


def tiny_model(arch: str = "llama", vocab: int = VOCAB, layers: int = 4, hidden: int = 64, seed: int = 0):
    """A random HF causal LM (4 query heads, 2 K/V heads), its LM head sharpened so greedy paths are not flat."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=0, eos_token_id=1, pad_token_id=1, tie_word_embeddings=False)
    model = (LlamaForCausalLM(LlamaConfig(**common)) if arch == "llama"
             else Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common)))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval().float()


def as_4bit_grids(model, group: int = 32, seed: int = 0) -> None:
    """Every decoder linear on a Q4_1-like grid (per group of inputs w = q d + m, q in 0..15) and the LM head on a
    Q8_0-like one (w = q d, q in -127..127), as the embedded target's GGUF weights are: what `int4_groups` /
    `int8_groups` recover exactly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        N, K = model.lm_head.weight.shape
        q = torch.randint(-127, 128, (N, K // group, group), generator=g).float()
        q[..., 0] = 127 * torch.where(torch.rand(N, K // group, generator=g) < 0.5, -1.0, 1.0)
        d = (torch.rand(N, K // group, 1, generator=g) * 1e-3 + 1e-4).half().float()  # fp16 scales, as a GGUF's
        model.lm_head.weight.copy_((q * d).reshape(N, K))
        for layer in model.model.layers:
            for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                      layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                N, K = m.weight.shape
                q = torch.randint(0, 16, (N, K // group, group), generator=g).float()
                q[..., 0], q[..., 1] = 0, 15
                d = (torch.rand(N, K // group, 1, generator=g) * 0.02 + 0.005).half().float()
                lo = (-7.5 * d + torch.randn(N, K // group, 1, generator=g) * 0.01).half().float()
                m.weight.copy_((q * d + lo).reshape(N, K))


def tiny_target(arch: str = "llama", runner: str = "fast", **kw):
    """`tiny_model` behind dart_lab's runner ("fast": `FastTarget`, "hf": the public forward)."""
    return make_target(tiny_model(arch, **kw), None, name=f"tiny-{arch}", runner=runner)


def prompts(n: int, vocab: int = VOCAB, lo: int = 12, hi: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """n random prompts of lo..hi tokens, each repeating a stretch of itself (something for copies to find)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(3, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
        out.append(torch.cat([p, p[: len(p) // 2]]))
    return out


def ngram(vocab: int = VOCAB, tokens: int = 20_000, seed: int = 0) -> NGram:
    """A random n-gram table over the tiny vocabulary (the shipped one needs the embedded tokenizer)."""
    return NGram.from_sequences([np.random.default_rng(seed).integers(0, vocab, tokens).tolist()], vocab)
