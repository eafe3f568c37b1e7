"""The draft head's fast paths for inference: its linears oneDNN-packed (q|k|v and gate|up as one matmul each), or
all of them through an 8-bit grid of their weights on our kernels (`linears_in_8bit`). The head's own weights stay
as they are: training reads them, and `dense_linears` restores the exact forward.
"""
from __future__ import annotations

import torch

from .. import fast
from .int4 import Int4Linear, PackedProjection, pack_linears
from .q4 import Q4Linear, Q8Linear, available


def q8_linear(*mods: torch.nn.Linear) -> "Q8Linear | Q4Linear | None":
    """nn.Linears reading the same input, side by side along their outputs, rounded to an 8-bit grid per group of 32
    inputs (GGUF Q8_0's rule: the group's scale = its largest |w| / 127, here held in fp16) and run as that grid
    (`Q8Linear`: one product a weight, x's groups as 16-bit integers; where `pack8` cannot take it, two 4-bit halves
    on `q4mm`, twice the products): 8 bits a weight read instead of bf16's 16. Another arithmetic, for a draft head
    (what it drafts moves speed only: the target verifies every token). None where the kernel is absent or a shape
    does not fit it (outputs a multiple of 16, inputs of 32)."""
    N, K = sum(m.out_features for m in mods), mods[0].in_features
    if not available() or N % 16 or K % 32:
        return None
    q, d, bias = int8_grid(*mods)
    return Q8Linear.of_grid(q, d, bias) or Q4Linear.of_groups(Int4Linear.halves_of(q, d), bias, halves=2)


def int8_grid(*mods: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The weights of `mods` side by side rounded to an 8-bit grid per group of 32 inputs (`q8_linear`'s rule):
    q (N, K) int32 in -127..127, d (N, K/32, 1) fp16 values as fp32 (w ~ q d), and the biases side by side or None."""
    w = torch.cat([m.weight.detach().float() for m in mods])
    N, K = w.shape
    g = w.reshape(N, K // 32, 32)
    d = (g.abs().amax(-1, keepdim=True) / 127).clamp_min(2.0 ** -24).to(torch.float16).float()
    q = (g / d).round().clamp(-127, 127).reshape(N, K).to(torch.int32)
    bias = None if mods[0].bias is None else torch.cat([m.bias.detach().float() for m in mods])
    return q, d, bias


class _Q8Forward:
    """x -> the outputs of `mods` through their 8-bit copy `q8` (`q4.q8_linear`); while autograd records (training
    the head), the modules' own weights."""

    def __init__(self, q8, *mods: torch.nn.Linear):
        self.q8, self.mods = q8, mods

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in self.mods):
            ys = [torch.nn.functional.linear(x, m.weight, m.bias) for m in self.mods]
            return ys[0] if len(ys) == 1 else torch.cat(ys, -1)
        return self.q8(x)


def linears_in_8bit(head) -> bool:
    """Every linear of a draft head through an 8-bit grid of its weights on our kernels (`q4.q8_linear`; q|k|v
    and gate|up fused): a draft forward reads ~1 byte a weight instead of bf16's 2. The head's own weights stay
    as they are. False, and the head unchanged, where the kernel is absent or a shape does not fit."""
    lay = head.midlayer
    att, mlp = lay.self_attn, lay.mlp
    fused = {"qkv": (att.q_proj, att.k_proj, att.v_proj), "gate_up": (mlp.gate_proj, mlp.up_proj)}
    singles = [m for m in head.modules() if isinstance(m, torch.nn.Linear)]
    built = {id(m): q8_linear(m) for m in singles}
    both = {k: q8_linear(*mods) for k, mods in fused.items()}
    if any(q is None for q in [*built.values(), *both.values()]):
        return False
    for m in singles:
        m.forward = _Q8Forward(built[id(m)], m)
    att.qkv, mlp.gate_up = _Q8Forward(both["qkv"], *fused["qkv"]), _Q8Forward(both["gate_up"], *fused["gate_up"])
    head.linears_8bit = True
    return True


def dense_linears(head) -> None:
    """Undo `linears_in_8bit` and any packing: every linear computes from the head's weights again (a drafter
    made next packs them)."""
    for m in head.modules():
        if isinstance(m, torch.nn.Linear):
            m.__dict__.pop("forward", None)
    head.midlayer.self_attn.qkv = head.midlayer.mlp.gate_up = None
    head.linears_8bit = False


def pack_head(head) -> bool:
    """CPU inference: the head's linears oneDNN-packed (a faster head forward, docs/speed.md), and q|k|v, gate|up as
    one matmul each (fewer small-M calls: ~0.1 ms a draft); a head whose linears run in 8 bits
    (`linears_in_8bit`) keeps those."""
    if getattr(head, "linears_8bit", False):
        return True
    pack_linears(head)
    lay = head.midlayer
    lay.self_attn.qkv = PackedProjection(lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj)
    lay.mlp.gate_up = PackedProjection(lay.mlp.gate_proj, lay.mlp.up_proj)
    return True


fast.plug("pack_head", pack_head)
