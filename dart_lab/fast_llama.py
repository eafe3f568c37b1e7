"""A lean target runner for the Llama family (Llama, Mistral, Qwen2, Qwen3): the same `Target`
interface, a plain-PyTorch forward over the HF model's own weights and modules.

Why (issue "speed where the user is"): on a CPU most of the extra cost of verifying a big tree
through the HF public forward is overhead -- the 4D additive mask HF rebuilds, a DynamicCache that
grows by concatenation every step, the full hidden-states tuple -- not the matmuls. Here:
  - a preallocated KV cache (L, 1, kv_heads, capacity, head_dim) per K and V, written in place;
    compaction of the accepted path is ONE gather/scatter over all layers (`commit`);
  - tree attention with a boolean (N, P+N) mask built once per step, GQA inside SDPA;
  - the three aux states taken where they are produced (inputs of layers 2, L//2, L-3);
  - logits only where needed (prefill: the last row unless asked for all).
The weights are not copied: norms, rotary embedding and projections are the HF modules' own, so a
`model.to(dtype)` applies here too. `target.HFTarget` (the public forward) stays the reference:
tests/test_fast_runner.py checks logits, aux states and compaction against it on random trees.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .target import Target, TargetOutput
from .tree import Tree

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported_reason(model) -> str | None:
    """None if the fast runner can drive `model`, else why not (the HF runner is used then)."""
    cfg = model.config
    if getattr(cfg, "model_type", None) not in FAMILIES:
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not one of {', '.join(FAMILIES)}"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("layers", "embed_tokens", "norm", "rotary_emb")):
        return "unexpected module layout"
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True) and window is not None
    if uses_window and window < getattr(cfg, "max_position_embeddings", 1 << 30):
        return "sliding-window attention"
    att = inner.layers[0].self_attn
    if not all(hasattr(att, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "unexpected attention layout"
    return None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * sin


def _lin(m, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, m.weight, m.bias)


@dataclass
class FastTarget(Target):
    """`Target` with the lean forward (module docstring). Same protocol: prefill, verify, commit."""

    capacity_step: int = 512  # the cache grows in steps of this many positions (rarely: one reallocation)
    fp32_attention_max_nodes: int = 1  # CPU, half types: attention in fp32 up to this many queries

    def __post_init__(self) -> None:
        super().__post_init__()
        why = unsupported_reason(self.model)
        if why:
            raise ValueError(f"fast runner: {why}")
        inner, cfg = self.model.model, self.model.config
        att = inner.layers[0].self_attn
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(att, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scaling = getattr(att, "scaling", self.head_dim ** -0.5)
        self.qk_norm = hasattr(att, "q_norm")
        self.runner = "fast"
        self._k = self._v = None

    # -- cache
    def _ensure(self, n: int) -> None:
        """Capacity for n positions, in the model's current device and dtype (kept contents)."""
        dev, dt = self.device, self.dtype
        if self._k is not None and self._k.shape[3] >= n and self._k.dtype == dt and self._k.device == dev:
            return
        cap = min(max(n, 1) + self.capacity_step, max(self.max_context, n))
        shape = (self.num_layers, 1, self.n_kv, cap, self.head_dim)
        k, v = torch.empty(shape, dtype=dt, device=dev), torch.empty(shape, dtype=dt, device=dev)
        if self._k is not None and self.seq_len:
            k[:, :, :, :self.seq_len] = self._k[:, :, :, :self.seq_len].to(dt)
            v[:, :, :, :self.seq_len] = self._v[:, :, :, :self.seq_len].to(dt)
        self._k, self._v = k, v

    def reset(self) -> None:
        self.seq_len = 0
        self._pending = 0

    def tree_mask(self, tree: Tree) -> torch.Tensor:
        """(N, P+N) bool: True where attention is allowed (prefix, then the ancestor closure)."""
        N, P = len(tree), self.seq_len
        allowed = torch.ones(N, P + N, dtype=torch.bool)
        allowed[:, P:] = tree.ancestor_mask()
        return allowed.to(self.device)

    # -- forward
    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, want_aux: bool,
                 rows: slice | None = None) -> TargetOutput:
        """ids, positions (N,); mask (N, P+N) bool or None (causal prefill / a single token)."""
        P, N = self.seq_len, ids.numel()
        self._ensure(P + N)
        dev = self.device
        inner = self.model.model
        x = inner.embed_tokens(ids[None].to(dev))  # (1, N, H)
        cos, sin = inner.rotary_emb(x, positions[None].to(dev))
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, N, hd)
        nh, nkv, hd = self.n_heads, self.n_kv, self.head_dim
        taps = {}
        # one query in a half type on a CPU: SDPA in fp32 beats its bf16 kernel here (42 vs 122 us per
        # layer over 200 keys; one-token step 34.6 vs 36.6 ms, 2-core EPYC); trees keep the half kernel
        fp32_attn = (dev.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
                     and N <= self.fp32_attention_max_nodes)
        attn_mask = None if mask is None else mask[None, None]
        causal = mask is None and N > 1 and P == 0
        for i, layer in enumerate(inner.layers):
            if want_aux and i in self.aux_layers:
                taps[i] = x[0]
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = _lin(att.q_proj, h).view(1, N, nh, hd)
            k = _lin(att.k_proj, h).view(1, N, nkv, hd)
            v = _lin(att.v_proj, h).view(1, N, nkv, hd)
            if self.qk_norm:
                q, k = att.q_norm(q), att.k_norm(k)
            q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
            self._k[i, :, :, P:P + N] = k
            self._v[i, :, :, P:P + N] = v.transpose(1, 2)
            K, V = self._k[i, :, :, :P + N], self._v[i, :, :, :P + N]
            if fp32_attn:
                q, K, V = q.float(), K.float(), V.float()
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=attn_mask, is_causal=causal, scale=self.scaling,
                                               enable_gqa=nkv != nh).to(x.dtype)
            x = x + _lin(att.o_proj, o.transpose(1, 2).reshape(1, N, nh * hd))
            h = layer.post_attention_layernorm(x)
            mlp = layer.mlp
            x = x + _lin(mlp.down_proj, mlp.act_fn(_lin(mlp.gate_proj, h)) * _lin(mlp.up_proj, h))
        x = inner.norm(x[0] if rows is None else x[0, rows])
        logits = self.model.lm_head(x).float()
        aux = torch.cat([taps[i] for i in self.aux_layers], dim=-1) if want_aux else None
        return TargetOutput(logits, aux)

    def truncate(self, n: int) -> None:
        if n > self.seq_len or self._pending:
            raise RuntimeError("truncate keeps committed tokens only")
        self.seq_len = n

    def commit(self, path) -> None:
        P, k = self.seq_len, len(path)
        idx = torch.as_tensor(path, dtype=torch.long)
        if k == 0 or int(idx[0]) != 0:
            raise RuntimeError("an accepted path starts at the root (node 0)")
        if not torch.equal(idx, torch.arange(k)):  # move the accepted entries, all layers at once
            src = (P + idx).to(self.device)
            self._k[:, :, :, P:P + k] = self._k[:, :, :, src]
            self._v[:, :, :, P:P + k] = self._v[:, :, :, src]
        self.seq_len = P + k
        self._pending = 0
