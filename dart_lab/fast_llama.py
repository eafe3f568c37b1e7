"""A lean target runner for the Llama family (Llama, Mistral, Qwen2, Qwen3): the same `Target`
interface, a plain-PyTorch forward over the HF model's own weights and modules.

Why (issue "speed where the user is"): on a CPU most of the extra cost of verifying a big tree
through the HF public forward is overhead -- the 4D additive mask HF rebuilds, a DynamicCache that
grows by concatenation every step, the full hidden-states tuple -- not the matmuls. Here:
  - a preallocated KV cache (L, 1, kv_heads, capacity, head_dim) per K and V, written in place;
    compaction of the accepted path is ONE gather/scatter over all layers (`commit`);
  - tree attention with a boolean (N, P+N) mask built once per step, GQA inside SDPA; for a half
    type on a CPU the cache and the attention are fp32 (SDPA's CPU kernel is faster there);
  - the three aux states taken where they are produced (inputs of layers 2, L//2, L-3);
  - logits only where needed (prefill: the last row unless asked for all);
  - on a CPU, the projections as oneDNN-packed fused weights (q|k|v and gate|up as one matmul each):
    the packed layout lets oneDNN skip re-blocking the weight at every call, which is most of a
    small-M matmul's time here (all 30 layers' matmuls at M=1 in bf16: 22 -> 15 ms, 2-core EPYC).
Norms and rotary embedding are the HF modules' own; the packed copies are rebuilt when the model's
dtype or device changes, so a `model.to(dtype)` applies here too. `target.HFTarget` (the public forward) stays the reference:
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


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed linears: CPU, fp32 or bf16, a torch built with oneDNN."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear:
    """y = x W^T + b with W (out, in) in oneDNN's blocked layout; several HF linears fused along `out`."""

    def __init__(self, *mods):
        w = torch.cat([m.weight.detach() for m in mods])
        self.b = None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods])
        self.w, self.in_features = torch.ops.mkldnn._reorder_linear_weight(w), w.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., sum of out)."""
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.w, self.b, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


def pack_linears(root: torch.nn.Module) -> int:
    """Inference on a CPU: every nn.Linear under `root` computes through a PackedLinear, built on first
    use and rebuilt when its weight's dtype, device, storage or version changes; with autograd recording
    (training) or where packing does not apply, the module's own forward. The state dict is untouched.
    Used for the draft heads (drafters.HeadDrafter). Returns how many linears were wrapped."""
    n = 0
    for m in root.modules():
        if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__:
            m.forward = PackedProjection(m)
            n += 1
    return n


class PackedProjection:
    """x -> the outputs of `mods` (nn.Linears reading the same input) concatenated along the last dim:
    one PackedLinear when packing applies (inference on a CPU), rebuilt when any weight's dtype, device,
    storage or version changes; else (autograd recording, other devices) one F.linear per module.
    Several modules: fused projections for the draft head (q|k|v and gate|up, drafters.HeadDrafter)."""

    def __init__(self, *mods: torch.nn.Linear):
        self.mods, self.key, self.pack = mods, None, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ws = [m.weight for m in self.mods]
        w = ws[0]
        if (torch.is_grad_enabled() and any(v.requires_grad for v in ws)) or x.dtype != w.dtype \
                or not can_pack(w.device, w.dtype):
            ys = [F.linear(x, m.weight, m.bias) for m in self.mods]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        key = tuple((v.dtype, v.data_ptr(), v._version) for v in ws)
        if key != self.key:
            with torch.no_grad():
                self.pack, self.key = PackedLinear(*self.mods), key
        return self.pack(x)


@dataclass
class FastTarget(Target):
    """`Target` with the lean forward (module docstring). Same protocol: prefill, verify, commit."""

    capacity_step: int = 512  # the cache grows in steps of this many positions (rarely: one reallocation)
    fp32_attention: bool = True  # CPU, half types: K/V cache and attention in fp32 (see _forward)
    pack_weights: bool = True  # CPU, fp32/bf16: oneDNN-packed fused projections (module docstring)
    # part of the cost curve's cache key (budget.fingerprint): raised when a change moves verify cost, so
    # a curve measured with older code is not reused (2: the additive tree mask)
    runner_revision = 2

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
        self._packed, self._packed_key, self._params = None, None, None

    @property
    def packs_weights(self) -> bool:
        """Whether the forward uses oneDNN-packed projections (part of the cost curve's cache key)."""
        return self.pack_weights and can_pack(self.device, self.dtype)

    def _packs(self):
        """Per layer (qkv, o, gate_up, down) PackedLinears and the lm_head's, or None (plain F.linear).
        Built on first use and again whenever the model's dtype, device or weights change."""
        if not self.packs_weights:
            return None
        inner = self.model.model
        if self._params is None:  # listed once: walking the module tree every step cost ~0.6 ms
            self._params = list(self.model.parameters())
        # a weight replaced (new storage) or edited in place (version bump) changes the key
        key = (self.dtype, self.device, [p.data_ptr() for p in self._params], sum(p._version for p in self._params))
        if key != self._packed_key:
            with torch.no_grad():
                layers = [(PackedLinear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj),
                           PackedLinear(l.self_attn.o_proj), PackedLinear(l.mlp.gate_proj, l.mlp.up_proj),
                           PackedLinear(l.mlp.down_proj)) for l in inner.layers]
                self._packed, self._packed_key = (layers, PackedLinear(self.model.lm_head)), key
        return self._packed

    # -- cache
    @property
    def cache_dtype(self) -> torch.dtype:
        half = self.dtype in (torch.bfloat16, torch.float16)
        return torch.float32 if (self.fp32_attention and half and self.device.type == "cpu") else self.dtype

    def _ensure(self, n: int) -> None:
        """Capacity for n positions, on the model's current device, in `cache_dtype` (kept contents)."""
        dev, dt = self.device, self.cache_dtype
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
        # a half type on a CPU: the K/V cache is kept in fp32 (the bf16-rounded values, so the same
        # numbers) and attention runs in fp32 -- SDPA's CPU kernel is faster there than in bf16, and no
        # cast of the cache per call (9 heads, 300 keys: 1 query 38 vs 188 us bf16 / 124 us cast at
        # use; 8 queries 90 vs 123 us; 2-core EPYC)
        fp32_attn = self.cache_dtype != self.dtype
        attn_mask = None
        if mask is not None:  # additive, built once per forward: a bool mask is converted by SDPA in every
            # layer (2 ops each; ~9 us of a ~80 us tree attention per layer, 2-core EPYC, 300 keys)
            at_dt = torch.float32 if fp32_attn else self.dtype
            attn_mask = torch.zeros(mask.shape, dtype=at_dt, device=dev).masked_fill_(~mask.to(dev), float("-inf"))[None, None]
        causal = mask is None and N > 1 and P == 0
        packs = self._packs()
        for i, layer in enumerate(inner.layers):
            if want_aux and i in self.aux_layers:
                taps[i] = x[0]
            att = layer.self_attn
            h = layer.input_layernorm(x)
            if packs:  # one matmul for q|k|v
                q, k, v = packs[0][i][0](h).view(1, N, nh + 2 * nkv, hd).split((nh, nkv, nkv), dim=2)
            else:
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
                q = q.float()
            o = F.scaled_dot_product_attention(q, K, V, attn_mask=attn_mask, is_causal=causal, scale=self.scaling,
                                               enable_gqa=nkv != nh).to(x.dtype)
            o = o.transpose(1, 2).reshape(1, N, nh * hd)
            mlp = layer.mlp
            if packs:
                x = x + packs[0][i][1](o)
                gate, up = packs[0][i][2](layer.post_attention_layernorm(x)).chunk(2, dim=-1)
                x = x + packs[0][i][3](mlp.act_fn(gate) * up)
            else:
                x = x + _lin(att.o_proj, o)
                h = layer.post_attention_layernorm(x)
                x = x + _lin(mlp.down_proj, mlp.act_fn(_lin(mlp.gate_proj, h)) * _lin(mlp.up_proj, h))
        x = inner.norm(x[0] if rows is None else x[0, rows])
        logits = (packs[1](x) if packs else self.model.lm_head(x)).float()
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
