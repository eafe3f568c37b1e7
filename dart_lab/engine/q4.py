"""A 4-bit weight-only matmul of our own (`dart_lab/csrc/q4mm.cpp`): the same 4-bit groups as
`int4.Int4Linear` (GGUF Q4_1: w = q * scale + low per 32 inputs), multiplied by x rounded to bf16 with
fp32 sums (bf16 lookups and VDPBF16PS) on CPUs with AVX512-BF16; on CPUs with AVX2 only (`avx2_path`) by each
group of 32 inputs as 16-bit integers times a scale (VPMADDWD, exact integer sums, then fp32: closer to x than
bf16 for a group's larger values, and a third of the instructions a weight that fp32 FMAs took). Faster than torch's int4 CPU kernel and closer to the weights (torch's
rounds each group's scale and zero to bf16; this keeps the GGUF's own fp16 values). It is one more path
`int4.int4_by_rows` times per row count: taken only where it measures faster. On CPUs with AMX (Intel
Xeon since Sapphire Rapids) steps of several rows multiply on the tile unit (`amx_rows`).

Built on first use (`kernels.build`); where it cannot be built or the CPU lacks AVX2, FMA and F16C,
`available()` is False and says why (`reason()`)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import kernels

_state: dict = {}


def _register_fake():
    @torch.library.register_fake("dart_lab::q4mm")
    def _(x, wp, sl, n, halves=1, rows=None, norm=None, eps=0.0, residual=None):  # shapes for torch.compile
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.register_fake("dart_lab::q8mm")
    def _(x, wq, sd, n):
        return x.new_empty(*x.shape[:-1], n)


def reason() -> str | None:
    """Why the kernel is not available here (None when it is)."""
    return kernels.reason(_state, "q4mm", {"avx2", "fma", "f16c"}, _register_fake)


def available() -> bool:
    return reason() is None


def amx_rows(rows: int | None = None) -> int:
    """The row count from which the kernel multiplies on Intel's AMX tiles instead of AVX-512 (0: never); -1
    where the CPU has no AMX-BF16 or Linux does not grant the tiles. rows: set it (the previous one is
    returned), for tests and A/B timings; the same products and fp32 sums either way."""
    return torch.ops.dart_lab.q4mm_amx_rows(-1 if rows is None else rows) if available() else -1


def avx2_path(on: bool | None = None) -> bool:
    """Whether the kernel takes its AVX2 path (the one a CPU without AVX512-BF16 has, and DART_LAB_ISA=avx2 asks
    for); on: force it or not, for tests and A/B timings on a CPU that has both (the setting before is returned).
    y = x' W^T there with x' each group of x as 16-bit integers times a scale, not bf16(x)."""
    return bool(torch.ops.dart_lab.q4mm_avx2(-1 if on is None else int(on))) if available() else False


# The arithmetic a 4-bit layer's product takes here, by name; each has its own reference (`reference`). A CPU with
# AVX512-BF16 takes the first (AMX tiles multiply the same bf16 products with the same fp32 sums), one with AVX2 only
# the second, and where our kernel is not built the layers run on torch's (`int4.Int4Linear`).
PATHS = {
    "avx512-bf16": "x rounded to bf16, the 4-bit values looked up as bf16 numbers, each group's products summed in fp32 "
                   "(VDPBF16PS, or AMX tiles), then scale and low applied per group in fp32",
    "avx2-int16": "each group of 32 inputs of x as 16-bit integers n times d = the group's largest |x| / 32767, "
                  "q * n summed exactly as integers (VPMADDWD), then scale, low and d applied per group in fp32",
    "torch-int4": "torch's int4 CPU kernel: x and each group's scale and zero rounded to bf16, the result in bf16",
}
U32 = 2.0 ** -24  # fp32's unit roundoff
U_BF16 = 2.0 ** -8  # bf16's unit roundoff


def path() -> str:
    """Which of `PATHS` a 4-bit layer takes here: our kernel's bf16 or int16 path, or torch's kernel where ours
    is not built (`reason()`)."""
    if not available():
        return "torch-int4"
    return "avx2-int16" if avx2_path() else "avx512-bf16"


class NotHere(ValueError):
    """A 4-bit path this CPU cannot take (`taking`)."""


@contextlib.contextmanager
def taking(name: str):
    """Within: 4-bit layers take path `name` of `PATHS` (tests, and the notebook's cell on each path); `NotHere`
    where this CPU cannot take it (our kernel's paths need it built, the bf16 path AVX512-BF16 too)."""
    if name not in PATHS:
        raise ValueError(f"unknown 4-bit path {name!r}; the paths are {', '.join(PATHS)}")
    if name != "torch-int4" and not available():
        raise NotHere(f"the 4-bit path {name!r} needs our kernel, which is not built here: {reason()}")
    saved_reason = _state.get("reason", ...)
    saved_avx2 = avx2_path() if available() else None
    try:
        if name == "torch-int4":
            _state["reason"] = "turned off (q4.taking)"
        else:
            avx2_path(name == "avx2-int16")
            if path() != name:
                raise NotHere(f"this CPU cannot take the 4-bit path {name!r} (it lacks AVX512-BF16)")
        yield
    finally:
        if saved_reason is ...:
            _state.pop("reason", None)
        else:
            _state["reason"] = saved_reason
        if saved_avx2 is not None:
            avx2_path(saved_avx2)


def x_as_read(x: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """x (..., K) as path `name` (default: this CPU's, `path()`) multiplies it, in fp64: rounded to bf16, or on the
    int16 path each group of 32 inputs as integers round(x * (32767 / t)) times t / 32767, t the group's largest
    |x|, in the kernel's fp32 steps: 32767 / t one fp32 division, tensor by tensor (torch computes a scalar over a
    tensor as a reciprocal times the scalar, an ulp away, which can move an integer by one), rounded to nearest even."""
    name = name or path()
    if name in ("avx512-bf16", "torch-int4"):
        return x.to(torch.bfloat16).double()
    if name != "avx2-int16":
        raise ValueError(f"unknown 4-bit path {name!r}; the paths are {', '.join(PATHS)}")
    g = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 32767.0) / amax, 0.0)
    return (torch.round(g * inv).double() * (amax / 32767.0).double()).reshape(x.shape)


@dataclass(frozen=True)
class Reference:
    """What path `path` computes for y = x W^T + b (`want`, fp32 of an fp64 product over x as that path reads it)
    and the bound `tol` (per element) on how far its fp32 (or bf16) arithmetic may land from it; `rule` says how
    the bound is derived."""
    path: str
    want: torch.Tensor
    tol: torch.Tensor
    rule: str

    def check(self, y: torch.Tensor, what: str = "the 4-bit kernel") -> None:
        """AssertionError, one line, where y is outside the bound anywhere."""
        if y.shape != self.want.shape:
            raise AssertionError(f"{what}: shape {tuple(y.shape)}, the {self.path} reference {tuple(self.want.shape)}")
        diff = (y.double() - self.want.double()).abs()
        e, worst = float((diff / self.tol).max()), float(diff.max())
        if not e <= 1.0:
            raise AssertionError(f"{what} on the {self.path} path is {e:.2f}x its bound from the reference "
                                 f"(max |diff| {worst:.2e}; {self.rule})")


def reference(x: torch.Tensor, groups: tuple, bias: torch.Tensor | None = None, name: str | None = None,
              halves: int = 1, out_dtype: torch.dtype = torch.float32) -> Reference:
    """The reference of a 4-bit layer's product on path `name` (default: the one this CPU takes, `path()`).

    x (M, K); groups (q (N, halves K) in 0..15, scale, low (N, halves K / 32, 1)): w = q * scale + low per group
    of 32 inputs (`int4.int4_groups`; halves=2: an 8-bit grid as two 4-bit halves over [x, x],
    `Int4Linear.halves_of`); bias (N,) or None. The bound is the classic one for a sum computed in floating point:
    c roundings of unit u along the longest chain of operations, times the sum of the terms' magnitudes
    T = sum |scale q x'| + |low x'| (+ |b|), with c from the path's arithmetic (`PATHS`):
    - avx512-bf16: 32 (a group's 32 products summed in pairs, two roundings a pair) + G (the groups' running sum) + 4
      (scale, low, bias, the fp32 result);
    - avx2-int16: the integer sums are exact (below 2^24, so their fp32 conversion too): G + 4 (scale, low, d, bias);
    - torch-int4: K + 4 (its accumulation order is its own), with scale and zero rounded to bf16 in the weights,
      plus the bf16 result's own rounding u_bf16 |y|.
    A result in bf16 (x in bf16) adds u_bf16 |y| for its last rounding."""
    name = name or path()
    q, scale, low = groups
    N, Kh = q.shape
    K, G = Kh // halves, Kh // 32
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} inputs, the groups {Kh} over {halves} half(s)")
    xr = torch.cat([x_as_read(x, name)] * halves, -1)
    s, lo = scale.double(), low.double()
    if name == "torch-int4":  # the kernel's dequantisation: (q - 8) * bf16(scale) + bf16(low + 8 scale)
        s = scale.to(torch.bfloat16).double()
        lo = (low + 8 * scale).to(torch.bfloat16).double() - 8 * s
    qg = q.double().reshape(N, G, 32)
    w = (qg * s + lo).reshape(N, Kh)
    want = xr @ w.T
    terms = xr.abs() @ (qg * s.abs() + lo.abs()).reshape(N, Kh).T
    if bias is not None:
        want, terms = want + bias.double(), terms + bias.double().abs()
    c = {"avx512-bf16": 32 + G + 4, "avx2-int16": G + 4, "torch-int4": Kh + 4}[name]
    tol = c * U32 * terms
    rule = f"tol = {c} x 2^-24 x sum|terms|"
    if name == "torch-int4" or out_dtype == torch.bfloat16:
        tol = tol + U_BF16 * want.abs()
        rule += " + 2^-8 |y| (a bf16 result)"
    return Reference(name, want.float(), tol.clamp_min(torch.finfo(torch.float32).tiny), rule)


def pack(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """q (N, K) in 0..15, scale and low (N, K/32, 1) -> (wp, sl) in the kernel's layouts (csrc/q4mm.cpp), or
    None when N is not a multiple of 16 or scale and low are not fp16 numbers (the kernel reads them in fp16;
    a GGUF's Q4_1 blocks store them so)."""
    N, K = q.shape
    G = K // 32
    if N % 16 or K % 32:
        return None
    s16, l16 = scale.to(torch.float16), low.to(torch.float16)
    span = (15 * scale).abs().clamp_min(1e-30)
    if ((s16.float() - scale).abs() * 15 > 1e-5 * span).any() or ((l16.float() - low).abs() > 1e-5 * span).any():
        return None
    q4 = q.to(torch.uint8).view(N // 16, 16, K // 4, 4)
    wp = (q4[..., :2] | (q4[..., 2:] << 4)).permute(0, 2, 1, 3).reshape(N // 16, K // 4, 32).contiguous()
    sl = torch.stack([s16.reshape(N // 16, 16, G).permute(0, 2, 1), l16.reshape(N // 16, 16, G).permute(0, 2, 1)], 2)
    return wp, sl.contiguous()


class Q4Linear:
    """y = x W^T + b through `dart_lab::q4mm`; x and y in x's dtype (computed from fp32 x). halves=2: an 8-bit
    grid as two 4-bit halves along the inputs (`int4.Int4Linear.of_8bit`'s groups), x read twice."""

    def __init__(self, packed: tuple[torch.Tensor, torch.Tensor], out_features: int, in_features: int,
                 bias: torch.Tensor | None = None, halves: int = 1):
        self.wp, self.sl = packed
        self.out_features, self.in_features, self.b, self.halves = out_features, in_features, bias, halves

    @classmethod
    def of_groups(cls, groups: tuple, bias: torch.Tensor | None = None, halves: int = 1) -> "Q4Linear | None":
        """From 4-bit groups (q (N, K), scale, low: `int4.int4_groups`, or two halves side by side);
        None where `pack` declines or the kernel is absent."""
        if not available():
            return None
        q = groups[0]
        packed = pack(*groups)
        return None if packed is None else cls(packed, q.shape[0], q.shape[1] // halves, bias, halves)

    @property
    def weight_bytes(self) -> int:
        return self.wp.numel() + 2 * self.sl.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _through(torch.ops.dart_lab.q4mm.default, x, self.b, self.wp, self.sl, self.out_features, self.halves)


def _through(op, x: torch.Tensor, bias: torch.Tensor | None, *weights) -> torch.Tensor:
    """op(x, *weights) + bias, x and y in x's dtype (the op computes from fp32 x). A one-token step makes 120 such
    calls: only the ops needed (the op takes x's leading shape as it is, a cast or a copy only where x's dtype or
    layout asks for it, the op's overload called directly)."""
    fp32 = x.dtype == torch.float32
    y = op(x if fp32 and x.is_contiguous() else x.float().contiguous(), *weights)
    if bias is not None:
        y = y.add_(bias)
    return y if fp32 else y.to(x.dtype)


def pack8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An 8-bit grid (q (N, K) in -127..127, d (N, K/32, 1): w = q d, `int4.int8_groups`) -> (wq, sd) in
    `dart_lab::q8mm`'s layouts (csrc/q4mm.cpp), or None when N is not a multiple of 16, K not of 32, or d no fp16
    numbers (a GGUF's Q8_0 blocks store them so)."""
    N, K = q.shape
    if N % 16 or K % 32:
        return None
    d16 = d.to(torch.float16)
    if ((d16.float() - d).abs() > 1e-5 * d.abs().clamp_min(1e-30)).any():
        return None
    wq = q.to(torch.int8).view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).reshape(N // 16, K // 2, 32).contiguous()
    sd = d16.reshape(N // 16, 16, K // 32).permute(0, 2, 1).contiguous()
    return wq, sd


class Q8Linear:
    """y = x W^T + b through `dart_lab::q8mm` for W an 8-bit grid (the embedded target's Q8_0 LM head): each weight
    one product at 8 bits, x's groups as 16-bit integers (what `q4mm`'s AVX2 path does; `Q4Linear` with halves=2 runs
    the same grid as twice the 4-bit products). One more path the per-row tables time (`q8`)."""

    def __init__(self, packed: tuple[torch.Tensor, torch.Tensor], out_features: int, bias: torch.Tensor | None = None):
        self.wq, self.sd = packed
        self.out_features, self.in_features, self.b = out_features, self.wq.shape[1] * 2, bias

    @classmethod
    def of_grid(cls, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None) -> "Q8Linear | None":
        if not available():
            return None
        packed = pack8(q, d)
        return None if packed is None else cls(packed, q.shape[0], bias)

    @property
    def weight_bytes(self) -> int:
        return self.wq.numel() + 2 * self.sd.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _through(torch.ops.dart_lab.q8mm.default, x, self.b, self.wq, self.sd, self.out_features)
