"""The draft heads: DART (paper section 3.1; paper/METHOD.md "Draft head") and the EAGLE-3 baseline, one
decoder layer (`MidLayer`) that both run, at inference and in training.

    aux (n, 3H) --fc--> g (n, H)                       three target layers fused, bias-free
    x_i = concat(RMSNorm(embed(token_{i+1})), RMSNorm(g_i))   (n, 2H), the "shift": position i
                                                        pairs g_i with the NEXT token's embedding
    + draft_length copies of one learned mask vector (2H) -> (n + d, 2H); the first H of the mask
      is also its residual. Masks differ only by their RoPE position.
    one decoder layer: causal attention over [draft KV cache | prefix | masks], q/k/v from 2H,
      residual = g (prefix) / mask[:H] (masks); MLP on the last d+1 positions only
    final RMSNorm -> lm_head over the draft vocabulary (draft id + d2t[id] = target id)

One forward returns d+1 logits: the last prefix position predicts the token after the tree root
(level 0), mask j predicts level j. The head's KV cache keeps prefix positions only; mask K/V are
recomputed every round.

State-dict keys and config.json fields follow the official release (fvliang/qwen*-dart):
fc, midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, hidden_norm, input_layernorm,
post_attention_layernorm, mask_rep}, norm, lm_head, d2t, t2d, embed_tokens. `save` leaves out
embed_tokens (we share the target's frozen embedding; the shipped heads stay small);
`save(..., with_embedding=True)` (`dart-lab export-head`) writes it, because the released loaders
load with strict=False and would otherwise draft with a random embedding, silently.

Final norm: the released inference code applies `norm` twice (end of forward and again in
compute_logits) and has no switch. New heads are trained and run the same way
(`final_norm_twice=True`, the default), so a head exported by dart_lab drafts identically in the
released engine. `final_norm_twice=False` loads heads trained with one norm (the heads shipped
before the fidelity fix record it in their config.json; their model card says which).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from . import fast
from .atomic import atomic_dir
from .errors import DartLabError


@dataclass(frozen=True)
class HeadConfig:
    """Widths follow the target; draft_length = number of mask tokens appended at inference."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int  # target vocabulary
    draft_vocab_size: int
    target_hidden_size: int | None = None
    head_dim: int | None = None
    draft_length: int = 7
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    final_norm_twice: bool = True  # the released forward (paper/METHOD.md "Draft head"); False for older heads
    shifted: bool = True  # level 0 from the last prefix position (paper); False: from the first mask (Table 3)

    @property
    def n_masks(self) -> int:
        """Mask tokens appended at inference: levels 0..draft_length need one more when unshifted."""
        return self.draft_length + (0 if self.shifted else 1)

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def for_target(cls, model_config, draft_vocab_size: int | None = None, draft_length: int = 7,
                   shifted: bool = True) -> "HeadConfig":
        """Widths copied from a HF target config."""
        c = model_config
        return cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                   num_attention_heads=c.num_attention_heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", c.num_attention_heads),
                   vocab_size=c.vocab_size, draft_vocab_size=draft_vocab_size or c.vocab_size,
                   target_hidden_size=c.hidden_size, head_dim=getattr(c, "head_dim", None), draft_length=draft_length,
                   rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6), rope_theta=_rope_theta(c),
                   max_position_embeddings=getattr(c, "max_position_embeddings", 8192),
                   hidden_act=getattr(c, "hidden_act", "silu"), shifted=shifted)

    def to_official_json(self, architecture: str = "LlamaForCausalLMDart") -> dict:
        """config.json in the official layout (LlamaForCausalLMDart / LlamaForCausalLMEagle3)."""
        d = asdict(self)
        d.update(architectures=[architecture], model_type="llama", head_dim=self.hd,
                 target_hidden_size=self.target_hidden_size or self.hidden_size, tie_word_embeddings=False,
                 pretraining_tp=1, num_hidden_layers=1, bias=False)  # bias: the released EAGLE loader defaults to True
        return d

    @classmethod
    def from_official_json(cls, d: dict) -> "HeadConfig":
        names = {f for f in cls.__dataclass_fields__}
        kw = {k: v for k, v in d.items() if k in names}
        scaling = d.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":  # the head would draft off-position
            raise DartLabError(f"rope_scaling {scaling} is not supported (plain RoPE only)")
        if "rope_theta" not in kw:
            kw["rope_theta"] = float((d.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        # heads written by dart_lab record their norm choice; the official ones do not (twice)
        kw.setdefault("final_norm_twice", True)
        if "vocab_size" in kw:  # the released EAGLE-3 loader drops d2t / t2d when the two vocabularies are one
            kw.setdefault("draft_vocab_size", kw["vocab_size"])
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size", "draft_vocab_size")
                   if k not in kw]
        if missing:
            raise DartLabError(f"DART config.json lacks {', '.join(missing)}")
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        return cls(**kw)


def _rope_theta(c) -> float:
    if getattr(c, "rope_theta", None) is not None:
        return float(c.rope_theta)
    params = getattr(c, "rope_parameters", None) or {}
    return float(params.get("rope_theta", 10000.0))


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        """x * rsqrt(mean(x^2) + eps) in float32, back to x's dtype, times the weight (the Llama order).
        One fused op instead of six: the head runs five norms per draft step; without gradients on fp32 CPU
        tensors the engine's one-pass op (`fast`: the same formula, its sum of squares in another order, to fp32
        rounding; `engine.step._rms_norm`)."""
        y = fast.call("rms_norm", x, self.weight, self.eps)  # the engine's one-pass op, where it runs
        if y is not None:
            return y
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (T,) -> cos, sin (T, head_dim) for the standard half-rotation RoPE."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    ang = positions.float()[:, None] * inv[None]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


_ROPE_TABLES: dict = {}


def rope_lookup(positions: torch.Tensor, head_dim: int, theta: float, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` read from a table of positions 0..n-1 (the same arithmetic per entry, so the same
    values), grown when a position exceeds it. Why: drafting runs one head forward per decode step, and
    computing the angles is ~10 small ops, a visible share of a small head's forward on a CPU."""
    key = (head_dim, float(theta), positions.device, dtype)
    cos, sin = _ROPE_TABLES.get(key, (None, None))
    need = int(positions.max()) + 1 if positions.numel() else 0
    if cos is None or cos.shape[0] < need:
        n = max(need, 2 * (cos.shape[0] if cos is not None else 1024))
        cos, sin = _ROPE_TABLES[key] = rope_cos_sin(torch.arange(n, device=positions.device), head_dim, theta, dtype)
    return cos[positions], sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd)."""
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        hd, nh, nkv = cfg.hd, cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(2 * cfg.hidden_size, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, cfg.hidden_size, bias=False)
        self.nh, self.nkv, self.hd, self.theta = nh, nkv, hd, cfg.rope_theta
        self.qkv = None  # inference: q|k|v as one fused projection (int4.PackedProjection), set by the drafter

    def forward(self, x, positions, mask, past_kv=None):
        """x (B, T, 2H); positions (T,) or (B, T); mask (T, S) or (B, 1, T, S) bool (True = attend) or None
        for causal;
        past_kv: (k, v) each (B, nkv, P, hd). Returns out (B, T, H), new (k, v) of the T inputs."""
        B, T, _ = x.shape
        if self.qkv is not None:
            q, k, v = self.qkv(x).split([self.nh * self.hd, self.nkv * self.hd, self.nkv * self.hd], -1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(B, T, self.nh, self.hd).transpose(1, 2)
        k = k.reshape(B, T, self.nkv, self.hd).transpose(1, 2)
        v = v.reshape(B, T, self.nkv, self.hd).transpose(1, 2)
        cos, sin = rope_lookup(positions, self.hd, self.theta, q.dtype)
        if positions.dim() == 2:  # per-row positions (B, T): a batch of rows at different lengths
            cos, sin = cos[:, None], sin[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        new_kv = (k, v)
        if past_kv is not None and past_kv[0].shape[-2] > 0:
            k = torch.cat([past_kv[0], k], dim=-2)
            v = torch.cat([past_kv[1], v], dim=-2)
        if mask is None:  # causal over the new positions, everything cached is visible
            P = k.shape[-2] - T
            mask = torch.ones(T, P + T, dtype=torch.bool, device=x.device).tril(P)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.nkv != self.nh)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.hd)), new_kv


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = None  # inference: gate|up as one fused projection, set by the drafter

    def forward(self, x):
        if self.gate_up is not None:
            g, u = self.gate_up(x).chunk(2, -1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The single decoder layer shared by DART (with the learned mask vector) and EAGLE-3 (without).
    Both heads, at inference and in training, run it through `inputs` + `forward`."""

    def __init__(self, cfg: HeadConfig, with_mask: bool = True):
        super().__init__()
        if with_mask:
            self.mask_rep = nn.Parameter(torch.randn(2 * cfg.hidden_size) * 0.02)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def inputs(self, emb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """emb, g (B, n, H) token embeddings and fused states -> attention input (B, n, 2H)."""
        return torch.cat([self.input_layernorm(emb.to(g.dtype)), self.hidden_norm(g)], dim=-1)

    def forward(self, x: torch.Tensor, resid: torch.Tensor, positions: torch.Tensor, mask=None, past_kv=None,
                rows: slice | None = None):
        """x (B, T, 2H) attention input, resid (B, T, H) residual stream, positions (T,), mask and
        past_kv as `Attention.forward`. rows: the positions that need the MLP (those whose output
        is used; default all). Returns the pre-norm output (B, T', H) and the (k, v) of the T inputs."""
        attn, kv = self.self_attn(x, positions, mask, past_kv)
        h = resid + attn
        if rows is not None:
            h = h[:, rows]
        return h + self.mlp(self.post_attention_layernorm(h)), kv


class HeadBase(nn.Module):
    """What DART and EAGLE-3 heads share: fc over the 3 aux states, one MidLayer, final norm,
    lm_head over the draft vocabulary with d2t / t2d, the target's frozen embedding, checkpoints."""

    architecture = "LlamaForCausalLMDart"
    with_mask = True

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.fc = nn.Linear(3 * (cfg.target_hidden_size or H), H, bias=False)
        self.midlayer = MidLayer(cfg, with_mask=self.with_mask)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None  # the target's, attached by `attach_embedding`

    # -- vocabulary
    def set_vocab(self, draft_to_target: torch.Tensor) -> None:
        """draft_to_target (Vd,) target ids of the draft vocabulary, in draft-id order."""
        ids = torch.as_tensor(draft_to_target, dtype=torch.long)
        if ids.numel() != self.cfg.draft_vocab_size:
            raise DartLabError(f"draft vocabulary has {ids.numel()} ids, the head expects {self.cfg.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(ids.numel()))
        self.t2d.zero_()
        self.t2d[ids] = True

    def draft_to_target(self) -> torch.Tensor:
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t

    def attach_embedding(self, embedding: nn.Embedding) -> None:
        """Share the target's token embedding (frozen; not part of the head's state dict)."""
        if embedding.weight.shape[1] != self.cfg.hidden_size or embedding.weight.shape[0] != self.cfg.vocab_size:
            raise DartLabError(f"target embedding is {tuple(embedding.weight.shape)}, the head expects "
                               f"({self.cfg.vocab_size}, {self.cfg.hidden_size})")
        object.__setattr__(self, "embed_tokens", embedding)  # not registered: stays out of state_dict()

    # -- checkpoints (official layout)
    def save(self, out_dir: str | Path, extra_card: str | None = None, with_embedding: bool = False) -> Path:
        """Atomically write model.safetensors + config.json (official layout). with_embedding: also
        write the attached target embedding as `embed_tokens.weight` (what the released loaders need)."""

        out = Path(out_dir)
        if with_embedding and self.embed_tokens is None:
            raise DartLabError("export needs the target's embedding: load the head with its target")
        with atomic_dir(out) as tmp:
            sd = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
            if with_embedding:
                sd["embed_tokens.weight"] = self.embed_tokens.weight.detach().to(self.fc.weight.dtype).contiguous().cpu()
            save_file(sd, str(tmp / "model.safetensors"))
            (tmp / "config.json").write_text(json.dumps(self.cfg.to_official_json(self.architecture), indent=1))
            if extra_card:
                (tmp / "README.md").write_text(extra_card)
        return out

    # the files a released loader reads, in the order it tries them (dart_lab/hub.py: DART reads only
    # model.safetensors; EAGLE-3 tries pytorch_model.bin first)
    weight_files = ("model.safetensors",)
    title = "DART head"

    @classmethod
    def load(cls, path: str | Path, target=None, device=None, dtype=None):
        """Load a head from a folder with config.json and the weights as the released loader reads them (official
        or ours; `hub.py`: any `architectures` / `model_type`, extra keys ignored, embed_tokens from the target).
        A file that lacks any other weight is refused: strict=False would leave it random. With `target`, check
        that it fits (hidden size, vocabulary) and attach its embedding."""

        path = Path(path)
        what = f"{cls.title} {path}"
        if not (path / "config.json").is_file():
            raise DartLabError(f"{what}: no config.json (not a draft head folder)")
        weights = next((path / f for f in cls.weight_files if (path / f).is_file()), None)
        if weights is None:
            raise DartLabError(f"{what}: no weights (looked for {' or '.join(cls.weight_files)})")
        try:
            raw = json.loads((path / "config.json").read_text())
            cfg = HeadConfig.from_official_json(raw)
        except (ValueError, TypeError) as e:
            raise DartLabError(f"{what}: config.json is not a head config ({e})") from None
        head = cls(cfg)
        sd = _read_weights(weights, what)
        sd.pop("embed_tokens.weight", None)
        if cfg.draft_vocab_size == cfg.vocab_size and "d2t" not in sd:  # the released loaders' identity mapping
            sd["d2t"], sd["t2d"] = head.d2t.clone(), torch.ones_like(head.t2d)
        missing, _ = head.load_state_dict(sd, strict=False)
        if missing:
            raise DartLabError(f"{what}: {weights.name} lacks {len(missing)} weight(s) of the head, e.g. "
                               f"{', '.join(missing[:3])} (not a {cls.architecture} checkpoint)")
        if target is not None:
            check_fits(cfg.target_hidden_size or cfg.hidden_size, cfg.vocab_size, target, cls.architecture)
            head.attach_embedding(target.model.get_input_embeddings())
            device, dtype = device or target.device, dtype or target.dtype
        return head.to(device=device, dtype=dtype).eval() if device or dtype else head.eval()


def _read_weights(path: Path, what: str) -> dict:
    """A state dict from .safetensors or a torch pickle (.bin, read with weights_only: tensors, no code)."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: safetensors and torch raise many types
        raise DartLabError(f"{what}: cannot read {path.name} ({(str(e).strip().splitlines() or [type(e).__name__])[0][:160]})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise DartLabError(f"{what}: {path.name} is not a state dict of tensors")
    return sd


class DartHead(HeadBase):
    """See the module docstring. All shapes are batch-first; inference uses B = 1."""

    # -- forward
    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                past_kv=None, n_masks: int | None = None, attn_mask: torch.Tensor | None = None,
                return_all: bool = False, return_hidden: bool = False):
        """aux (B, n, 3H') target aux states; next_ids (B, n) the token AFTER each position (shift);
        positions (n + n_masks,) RoPE ids, or (B, n + n_masks) per row; past_kv: cached prefix (k, v) or None.
        attn_mask: (n + m, P + n + m) bool, or (B, 1, n + m, P + n + m) per row, default causal (training
        passes its block mask; a batch of drafters its padding, `drafters.draft_logits_batch`).
        Returns logits (B, 1 + n_masks, Vd) for the last prefix position and the masks (or for every
        position if return_all; the final-normed hidden states instead if return_hidden), and the
        (k, v) of the n prefix positions to append to the cache. An unshifted head (Table 3 ablation)
        returns the masks' rows only: (B, n_masks, Vd), level j from mask j+1."""
        m = self.cfg.n_masks if n_masks is None else n_masks
        lay = self.midlayer
        B, n, _ = aux.shape
        g = self.fc(aux)  # (B, n, H)
        x = lay.inputs(self.embed_tokens(next_ids), g)  # (B, n, 2H)
        H = self.cfg.hidden_size
        resid = g
        if m:
            mask_vec = lay.mask_rep.to(x.dtype)
            x = torch.cat([x, mask_vec.expand(B, m, 2 * H)], dim=1)
            resid = torch.cat([g, mask_vec[:H].expand(B, m, H)], dim=1)
        # MLP only where logits are needed: the last prefix position + masks (masks only if unshifted)
        rows = None if return_all else slice(n - 1 if self.cfg.shifted else n, None)
        h, kv = lay(x, resid, positions, attn_mask, past_kv, rows=rows)
        h = self.norm(h)
        if self.cfg.final_norm_twice:
            h = self.norm(h)
        if return_hidden:  # training applies lm_head only on the supervised rows
            return h, (kv[0][:, :, :n], kv[1][:, :, :n])
        return self.lm_head(h), (kv[0][:, :, :n], kv[1][:, :, :n])


def check_fits(hidden: int, vocab: int, target, what: str) -> None:
    if hidden != target.hidden_size:
        raise DartLabError(f"{what} expects target hidden size {hidden}, the target has {target.hidden_size}")
    if vocab != target.model.get_input_embeddings().weight.shape[0]:
        raise DartLabError(f"{what} expects a target vocabulary of {vocab}, the target has "
                           f"{target.model.get_input_embeddings().weight.shape[0]}")


class Eagle3Head(HeadBase):
    """EAGLE-3 (Li et al. 2025): the same layer, drafting autoregressively. Step j feeds the head its
    own pre-norm output of step j-1 with the embedding of the token chosen at step j-1; one final
    norm. State-dict layout of released heads (e.g. AngelSlim/Qwen3-*_eagle3)."""

    architecture = "LlamaForCausalLMEagle3"
    with_mask = False
    weight_files = ("pytorch_model.bin", "model.safetensors")
    title = "EAGLE-3 head"

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor, past_kv=None,
                attn_mask: torch.Tensor | None = None, from_target: bool = True, logits: bool = True):
        """hidden (B, n, 3H') target aux states (from_target) or (B, n, H) the head's own previous
        outputs; next_ids (B, n) the token after each position. positions (n,).
        Returns logits (B, n, Vd) (None if not `logits`: training applies lm_head on supervised rows
        only), out hidden (B, n, H) (pre-norm, fed to the next step), (k, v)."""
        g = self.fc(hidden) if from_target else hidden
        h, kv = self.midlayer(self.midlayer.inputs(self.embed_tokens(next_ids), g), g, positions, attn_mask, past_kv)
        return (self.lm_head(self.norm(h)) if logits else None), h, kv

