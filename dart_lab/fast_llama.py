"""A lean target runner for the Llama family (Llama, Mistral, Qwen2, Qwen3): the same `Target`
interface, a plain-PyTorch forward over the HF model's own weights and modules.

Why: on a CPU most of the extra cost of verifying a big tree
through the HF public forward is overhead -- the 4D additive mask HF rebuilds, a DynamicCache that
grows by concatenation every step, the full hidden-states tuple -- not the matmuls. Here:
  - a preallocated KV cache (L, 1, kv_heads, capacity, head_dim) per K and V, written in place;
    compaction of the accepted path is ONE gather/scatter over all layers (`commit`);
  - tree attention with an additive (N, P+N) mask built once per step, GQA without repeating K/V; for a
    half type on a CPU the attention is fp32 (the CPU kernels are faster there), over a bf16 K/V cache where
    our kernel reads one (`cache_dtype`: half the bytes a step streams), else fp32; steps of a
    few nodes a row on our attention kernel where it measured faster than SDPA (`attention.attend`);
  - the three aux states taken where they are produced (inputs of layers 2, L//2, L-3);
  - logits only where needed (prefill: the last row unless asked for all);
  - on a CPU, the projections as oneDNN-packed fused weights (q|k|v and gate|up as one matmul each):
    the packed layout lets oneDNN skip re-blocking the weight at every call, which is most of a
    small-M matmul's time (docs/speed.md);
  - `weights="int4"` (`--dtype int4`): 4-bit weight-only matmuls (torch's CPU int4 kernel) over the same
    values where the weights are 4-bit grids, as the embedded target's GGUF Q4_1 layers are: a one-token
    step reads ~4.5 bits per weight instead of 32 (`Int4Linear`; docs/speed.md for what it measures).
    The 4-bit kernel's cost grows with a step's rows faster than a 16-bit matmul's, so each linear takes,
    per row count, the path measured fastest on this machine (`int4_by_rows`: 4 bits, the dense weights,
    bf16 copies where oneDNN packs bf16): AR's one-token steps in 4 bits, a wide tree or batch dense.
  - optionally (`compile=True`, `--compile`), one-token steps and tree verifies through `torch.compile`
    with static shapes (`StepGraph`: nodes padded to a few buckets, attention over the cache in fixed
    multiples of slots under the additive mask, inductor's freezing packing the weights): fused small
    ops and a cheaper step, but tens of seconds of compiling per shape on a small CPU, so off by default
    (experiments/engine/compile_bench.py).
Norms and rotary embedding are the HF modules' own; the packed copies are rebuilt when the model's
dtype or device changes, so a `model.to(dtype)` applies here too. `target.Target` (the public forward) stays the reference:
tests/test_fast_runner.py checks logits, aux states and compaction against it on random trees.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import time
import warnings
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from . import kernels
from .attention import attend, available as attention_available, ours as attention_ours, prepare as prepare_attention
from .attention import prompt_dtype as prompt_attention
from .q4 import Q4Linear, Q8Linear
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


def _rms_norm(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm module applied to x (every family in FAMILIES computes w * x / rms(x) in fp32,
    then casts x back before the weight): for fp32 activations and weight the same arithmetic as torch's
    one-op `F.rms_norm` (bit-equal in our checks at the embedded model's width), one dispatch instead of
    the module's eight small ops -- a visible share of an eager one-token step (docs/speed.md); eagerly, on
    a CPU where it builds, our one-pass op (`kernels.rms_norm_here`: ~2 us a call against F.rms_norm's ~10)."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        if (x.device.type == "cpu" and x.is_contiguous() and not torch.compiler.is_compiling()
                and kernels.rms_norm_here()):
            return torch.ops.dart_lab.rms_norm.default(x, norm.weight, norm.variance_epsilon)
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    return norm(x)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN-packed linears: CPU, fp32 or bf16 (where this CPU can pack it), a torch built with oneDNN."""
    return (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and _packs_here(dtype))


@functools.lru_cache(maxsize=None)
def _packs_here(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a `dtype` weight on this CPU, tried once on a tiny one: bf16 needs AVX-512
    (bw/vl/dq) or AVX-NE-CONVERT, and an AVX2-only CPU raises; without packing the runner uses plain
    F.linear."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype))
        return True
    except RuntimeError:
        return False


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


def can_int4(device: torch.device) -> bool:
    """4-bit weight-only matmuls (`Int4Linear`): torch's CPU kernel for int4-packed weights."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def int4_groups(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """w (N, K) -> (q (N, K) int32 in 0..15, scale, low (N, K/group, 1)) with w == q * scale + low per group of
    `group` inputs, or None when w is not such a grid (max error > 1e-5 of the group's range).

    A GGUF Q4_1 block is exactly this (paper-independent: the embedded target ships its layers so), and its
    dequantised values are what the HF loader gives us; the grid is recovered from the values alone: low = the
    group's minimum (its q is 0), scale = the smallest step between distinct values (q's run 0..15 with no
    gap in practice; the range over that step gives how many steps the group spans)."""
    N, K = w.shape
    if K % group:
        return None
    g = w.detach().float().reshape(N, K // group, group)
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    span = (high - low).clamp_min(1e-30)
    d = g.sort(-1).values.diff(dim=-1)
    d = torch.where(d > 1e-4 * span, d, torch.full_like(d, float("inf"))).amin(-1, keepdim=True)
    steps = torch.where(torch.isfinite(d), (span / d).round().clamp(1, 15), torch.ones_like(d))
    scale = span / steps
    q = ((g - low) / scale).round().clamp(0, 15)
    if ((q * scale + low - g).abs() > 1e-5 * span).any():
        return None
    return q.reshape(N, K).to(torch.int32), scale, low


def int8_groups(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w (N, K) -> (q (N, K) int32 in -127..127, scale (N, K/group, 1)) with w == q * scale per group of
    `group` inputs, or None when w is not such a grid (max error > 1e-5 of the group's largest |w|).

    A GGUF Q8_0 block is exactly this (the embedded target's LM head): its quantizer sets scale = the
    group's max |w| / 127, so the scale is recovered from the values alone."""
    N, K = w.shape
    if K % group:
        return None
    g = w.detach().float().reshape(N, K // group, group)
    amax = g.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    scale = amax / 127
    q = (g / scale).round().clamp(-127, 127)
    if ((q * scale - g).abs() > 1e-5 * amax).any():
        return None
    return q.reshape(N, K).to(torch.int32), scale


class Int4Linear:
    """y = x W^T + b with W held as 4-bit groups (torch's int4-packed CPU layout): W's own values when W is a
    4-bit grid (`int4_groups`; the embedded target's layers are GGUF Q4_1), read at ~4.5 bits per weight
    instead of 32. The kernel multiplies in bf16 (x and each group's scale and zero rounded to bf16), so it
    is another arithmetic over the same weights, like a dtype: `dtype="int4"`, chosen by measured speed
    under the argmax-agreement guard (loading.choose_dtype). x and y stay in x's dtype.

    `halves=2` holds an 8-bit grid (`int8_groups`, GGUF Q8_0) as two 4-bit ones side by side along the
    inputs: q = 16 hi + lo with hi in -8..7 and lo in 0..15, so x W^T = [x, x] [16 d hi | d lo]^T -- one call
    of the same kernel over x repeated, reading 8 bits per weight instead of bf16's 16 (the LM head is
    the largest single matrix a step reads)."""

    group = 32

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, bias: torch.Tensor | None = None,
                 halves: int = 1):
        """q (N, K) in 0..15 and per group scale, low (N, K/group, 1): w = q * scale + low; K = halves x the
        layer's inputs."""
        self.out_features, self.halves = q.shape[0], halves
        self.in_features = q.shape[1] // halves
        self.b = bias
        self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        # the kernel's dequantisation is (q - 8) * scale + zero; (K/group, N, 2)
        self.sz = torch.cat([scale, low + 8 * scale], -1).transpose(0, 1).contiguous().to(torch.bfloat16)

    @classmethod
    def of(cls, *mods: torch.nn.Linear, groups: tuple | None = None) -> "Int4Linear":
        """The linears' weights side by side (q|k|v, gate|up), a 4-bit grid (`int4_groups`)."""
        w = torch.cat([m.weight.detach() for m in mods])
        q, scale, low = groups or int4_groups(w, cls.group)
        return cls(q, scale, low, None if mods[0].bias is None else torch.cat([m.bias.detach() for m in mods]))

    @staticmethod
    def halves_of(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """An 8-bit grid (`int8_groups`' q, d) as 4-bit groups (q, scale, low) over [x, x]: q = 16 hi + lo,
        hi + 8 and lo in 0..15; the hi half's w = (hi + 8) * 16d - 128d, the lo half's w = lo * d + 0."""
        hi = torch.div(q, 16, rounding_mode="floor")
        both = torch.cat([hi + 8, q - 16 * hi], 1)
        return both, torch.cat([16 * d, d], 1), torch.cat([-128 * d, torch.zeros_like(d)], 1)

    @classmethod
    def of_8bit(cls, mod: torch.nn.Linear, groups: tuple | None = None) -> "Int4Linear":
        """A linear whose weight is an 8-bit grid (`int8_groups`), as two 4-bit halves (class docstring)."""
        both, scale, low = cls.halves_of(*(groups or int8_groups(mod.weight, cls.group)))
        return cls(both, scale, low, None if mod.bias is None else mod.bias.detach(), halves=2)

    @property
    def weight_bytes(self) -> int:
        return self.w.numel() * self.w.element_size() + self.sz.numel() * self.sz.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) -> (..., sum of out)."""
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.halves > 1:
            x2 = torch.cat([x2] * self.halves, -1)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.w, self.group, self.sz).to(x.dtype)
        if self.b is not None:
            y = y + self.b
        return y.view(*x.shape[:-1], self.out_features)


def _fp16_holds_head(model) -> bool:
    """Whether the LM head's input and every logit stay inside fp16's range for any input: the head reads
    the final RMSNorm's output x, whose norm is at most sqrt(H) max|gamma|, so |x_i| and every logit
    |w_j . x| + |b_j| are bounded by the weights alone."""
    norm = getattr(model.model, "norm", None)
    gamma = getattr(norm, "weight", None)
    if gamma is None:
        return False
    w, b = model.lm_head.weight.detach().float(), model.lm_head.bias
    x_norm = w.shape[1] ** 0.5 * float(gamma.detach().abs().max())
    logit = x_norm * float(w.norm(dim=1).max()) + (0.0 if b is None else float(b.detach().abs().max()))
    return max(x_norm, logit, float(w.abs().max())) < torch.finfo(torch.float16).max / 2


def int4_projections(model) -> tuple[list, object, dict]:
    """Per layer (qkv, o, gate_up, down) as `Int4Linear`s where the weights are 4-bit grids (else F.linear on
    the module's weights), the LM head (below; the embedded target's is Q8_0), and a report: how many
    linears run in 4 bits, what a one-token step reads."""
    n4 = n = read = 0

    def proj(*mods):
        nonlocal n4, n, read
        n += 1
        w = torch.cat([m.weight.detach() for m in mods])
        grid = int4_groups(w, Int4Linear.group)
        if grid is not None:
            n4 += 1
            lin = Int4Linear.of(*mods, groups=grid)
            lin.q4 = Q4Linear.of_groups(grid, lin.b)  # our kernel over the same groups: a path `int4_by_rows` times
            read += lin.weight_bytes
            return lin
        read += w.numel() * w.element_size()
        return _side_by_side(*mods)

    layers = [(proj(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), proj(l.self_attn.o_proj),
               proj(l.mlp.gate_proj, l.mlp.up_proj), proj(l.mlp.down_proj)) for l in model.model.layers]
    # the LM head: 16-bit for one row (a GEMV that runs at memory speed, faster than the 4-bit kernel's
    # unpacking there) and, where it is an 8-bit grid, two 4-bit halves for 2+ rows (a tree or a batch:
    # half-type matmuls grow about linearly in rows on a CPU without such instructions, the 4-bit kernel
    # slowly; where it has them, `int4_by_rows` measures which wins per row count). fp16 where its range
    # provably holds: 3 more mantissa bits than bf16 over the same bytes
    half = torch.float16 if _fp16_holds_head(model) else torch.bfloat16
    head_w = model.lm_head.weight.detach().to(half)
    head_b = None if model.lm_head.bias is None else model.lm_head.bias.detach().to(half)
    grid8 = int8_groups(model.lm_head.weight, Int4Linear.group)
    rows8 = Int4Linear.of_8bit(model.lm_head, groups=grid8) if grid8 is not None else None

    name = "fp16" if half == torch.float16 else "bf16"
    one_row = {name: lambda x: F.linear(x.to(half), head_w, head_b)}
    head = ByRows(one_row, ((1, name),)) if rows8 is None else \
        ByRows({**one_row, "int8 halves": rows8}, ((1, name), (2, "int8 halves")))
    q4_head = None if rows8 is None else Q4Linear.of_groups(Int4Linear.halves_of(*grid8), rows8.b, halves=2)
    if q4_head is not None:  # the same halves through our kernel: a path `int4_by_rows` times
        head.paths["q4 halves"] = q4_head
    q8_head = None if rows8 is None else Q8Linear.of_grid(*grid8, rows8.b)
    if q8_head is not None:  # the grid itself, one product a weight (csrc/q4mm.cpp's q8mm): another path timed
        head.paths["q8"] = q8_head
    head_kind = name if rows8 is None else f"{name} (1 row), int8 as two 4-bit halves (2+ rows)"
    read += head_w.numel() * head_w.element_size()
    # what a one-token step reads of the weights (norms and one embedding row aside)
    return layers, head, {"int4_linears": n4, "linears": n, "lm_head": head_kind, "step_weight_bytes": read}


class ByRows:
    """A linear computed by whichever of several paths (same weights, other arithmetic or layout) measured
    fastest for the step's row count -- one row per node and batch row: `table` is ((from_rows, name), ...)
    ascending, a step of r rows takes the path of the last entry with from_rows <= r."""

    def __init__(self, paths: dict, table: tuple):
        self.paths, self.table = paths, table

    def path(self, rows: int) -> str:
        name = self.table[0][1]
        for r, n in self.table:
            if rows >= r:
                name = n
        return name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.paths[self.path(x.numel() // x.shape[-1])](x)

    def describe(self) -> str:
        """e.g. "int4 (1-8 rows), bf16 (16+ rows)"."""
        ends = [r for r, _ in self.table[1:]]
        parts = []
        for (r, n), end in zip(self.table, ends + [None]):
            span = f"{r}+" if end is None else (f"{r}" if end - 1 == r else f"{r}-{end - 1}")
            parts.append(f"{n} ({span} row{'' if span == '1' else 's'})")
        return ", ".join(parts)


def _time_path(name: str, fn, x: torch.Tensor) -> float:
    """Wall ms of one call fn(x) (`name`: which path, for a test's stand-in clock)."""
    t0 = time.perf_counter()
    fn(x)
    return (time.perf_counter() - t0) * 1e3


# row counts a linear's paths are timed at: a step's nodes (trees, batches); the layers' also a batch's packed
# prompts (`batch.BatchTarget`), where a path that wins at 256 rows may not at a thousand
STEP_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PROMPT_ROWS = STEP_ROWS + (1024,)


def _sweep(fns: list):
    """x -> every fn(x) in turn, each output dropped before the next call, as a step consumes a linear's output
    before the next (holding them all makes the allocator hand their memory back and fault it in again: a cost
    that grows with the outputs, which a step does not pay)."""
    def run(x):
        for f in fns:
            f(x)
    return run


def fastest_by_rows(paths: dict, in_features: int, dtype: torch.dtype, rows=STEP_ROWS, rounds: int = 5) -> tuple[tuple, dict]:
    """paths: name -> the callables of that path, one per layer (or one). Time each path at each row count
    as one sweep through all its callables -- every layer's weights read from memory, as a step reads
    them (one linear timed alone stays in the cache, where 4 bits lose their edge) -- in interleaved
    rounds after a warm-up sweep; from 8 rows on, a path more than 3x the best is not timed again (its
    cost grows faster than the others'). A linear's cost grows at most in proportion to its rows, so a median
    more than 1.5x its path's previous one scaled by the rows (a stall while it was timed) is timed again, all
    paths interleaved, at most twice, and each path keeps its lowest median. Returns the table for `ByRows`
    and the medians {rows: {name: ms}}; ties go to the path listed first."""
    import statistics

    times, table, dropped, prev = {}, [], set(), None
    g = torch.Generator().manual_seed(0)
    for r in rows:
        x = torch.randn(r, in_features, generator=g).to(dtype)
        live = [n for n in paths if n not in dropped]
        sweeps = {n: _sweep(paths[n]) for n in live}
        for n in live:
            sweeps[n](x)
        times[r] = {}
        for _ in range(3):
            got = {n: [] for n in live}
            for _ in range(rounds):
                for n in live:
                    got[n].append(_time_path(n, sweeps[n], x))
            times[r] = {n: round(min(statistics.median(v), times[r].get(n, float("inf"))), 3) for n, v in got.items()}
            if prev is None or all(times[r][n] <= 1.5 * times[prev][n] * r / prev for n in live if n in times[prev]):
                break
        prev = r
        best = min(live, key=lambda n: (times[r][n], live.index(n)))
        if r >= 8:
            dropped |= {n for n in live if times[r][n] > 3 * times[r][best]}
        if not table or table[-1][1] != best:
            table.append((r, best))
    return tuple(table), times


class BF16Linear:
    """x -> x W^T + b through a oneDNN-packed bf16 copy of W (and b), returned in x's dtype; `raw` takes and
    returns bf16 (a prompt's MLP on these copies keeps its intermediate in bf16, `decoder_step`)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None):
        self.raw = PackedLinear(SimpleNamespace(weight=w.to(torch.bfloat16),
                                                bias=None if b is None else b.to(torch.bfloat16)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.raw(x.to(torch.bfloat16)).to(x.dtype)


def _bf16_path(f, rows: int) -> "BF16Linear | None":
    """The bf16 copy linear `f` takes for `rows` rows (`ByRows`), else None."""
    g = f.paths[f.path(rows)] if isinstance(f, ByRows) else f
    return g if isinstance(g, BF16Linear) else None


def _bf16_mlp(projs, rows: int) -> tuple[str, str] | None:
    """The path names of gate|up and down where both take their bf16 copies (`BF16Linear`) for `rows` rows, else
    None. One table per kind of linear (`int4_by_rows`), so layer 0 answers for every layer, once a step."""
    g, d = projs[0][2], projs[0][3]
    if isinstance(g, ByRows) and isinstance(d, ByRows):
        names = g.path(rows), d.path(rows)
        if isinstance(g.paths[names[0]], BF16Linear) and isinstance(d.paths[names[1]], BF16Linear):
            return names
    return None


def int4_by_rows(model, int4: tuple, dense: tuple, tables: dict | None = None) -> tuple[list, object, dict]:
    """The 4-bit target with every linear's path measured per row count (`fastest_by_rows`, `ByRows`):
    `int4` = `int4_projections(model)[:2]`, `dense` = the model's own (layers, head) in its dtype (packed
    where that applies); where the model is fp32 and oneDNN packs bf16 on this CPU, bf16 copies are a third
    path; where our 4-bit kernel builds (`q4.py`), it is a fourth over the same groups (`q4`, `q4 halves`).
    torch's 4-bit kernel's cost grows with the rows much faster than a 16-bit matmul's on CPUs with bf16
    units, so a tree or a batch can be cheaper dense than in 4 bits; every path reads the same weights (the
    dense ones exactly, 4 bits their own grid), so this is the int4 arithmetic's near-tie contract. One
    table per kind of linear (q|k|v, o, gate|up, down: every layer's alike), one for the LM head; `tables`
    (kind -> table, as a report's "tables") skips the timing. Returns (layers, head, report)."""
    (layers4, head4), (layers_d, head_d) = int4, dense
    dt = model.lm_head.weight.dtype
    bf16 = dt == torch.float32 and can_pack(model.lm_head.weight.device, torch.bfloat16)
    mods = [_layer_mods(l) for l in model.model.layers]
    kinds, report, layers = ("qkv", "o", "gate_up", "down"), {}, [[None] * 4 for _ in mods]
    for j, kind in enumerate(kinds):
        paths = {"int4": [row[j] for row in layers4], _dt_name(dt): [row[j] for row in layers_d]}
        if all(getattr(row[j], "q4", None) is not None for row in layers4) and (not tables or any(
                n == "q4" for _, n in tables[kind])):
            paths["q4"] = [row[j].q4 for row in layers4]
        if bf16 and (not tables or any(n == "bf16" for _, n in tables[kind])):  # copies only where timed or taken
            paths["bf16"] = [BF16Linear(torch.cat([m.weight.detach() for m in ms[j]]),
                                          None if ms[j][0].bias is None else torch.cat([m.bias.detach() for m in ms[j]]))
                             for ms in mods]
        table, times = ((tables[kind], None) if tables
                        else fastest_by_rows(paths, mods[0][j][0].in_features, dt, PROMPT_ROWS))
        used = {n for _, n in table}  # paths no row count takes are dropped (their copies freed)
        for i in range(len(mods)):
            layers[i][j] = ByRows({n: paths[n][i] for n in used}, table)
        report[kind] = {"paths": layers[0][j].describe(), "ms_by_rows": times}
    head_paths = {n: [f] for n, f in head4.paths.items()}
    head_paths[_dt_name(dt)] = [head_d]
    if bf16 and (not tables or any(n == "bf16 packed" for _, n in tables["lm_head"])):
        head_paths["bf16 packed"] = [BF16Linear(model.lm_head.weight.detach(), model.lm_head.bias)]
    table, times = ((tables["lm_head"], None) if tables
                    else fastest_by_rows(head_paths, model.lm_head.in_features, dt))
    head = ByRows({n: head_paths[n][0] for _, n in table}, table)
    report["lm_head"] = {"paths": head.describe(), "ms_by_rows": times}
    report["tables"] = {**{k: layers[0][j].table for j, k in enumerate(kinds)}, "lm_head": head.table}
    return [tuple(row) for row in layers], head, report


def _layer_mods(l) -> tuple:
    return ((l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), (l.self_attn.o_proj,),
            (l.mlp.gate_proj, l.mlp.up_proj), (l.mlp.down_proj,))


def _dt_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))


def decoder_step(model, projs, head, geometry: tuple, ids: torch.Tensor, positions: torch.Tensor,
                 slots: torch.Tensor, caches: tuple[list, list], n_keys: int, attn_mask: torch.Tensor | None,
                 causal: bool = False, rows: slice | torch.Tensor | None = None,
                 segments: list[tuple[int, int]] | None = None,
                 live: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The Llama-family decoder over N new nodes of B rows: the one home of the layer math, run eagerly
    by `FastTarget` and `batch.BatchTarget`, and compiled by `StepGraph`.

    ids, positions (N,) for one row, or (B, N) for a batch; slots (N,): the cache slots the nodes' K/V
    are written to (the same for every row); caches: per-layer K and V, (B, kv_heads, capacity, head_dim)
    each; attention reads slots [0, n_keys) under `attn_mask` (B, 1, N, n_keys) additive, or causally;
    projs: per layer (qkv, o, gate_up, down) callables; head: the LM head. Returns logits fp32 and the aux
    states (the inputs of the aux layers, paper Sec. 3.1, in `geometry`'s order): one row -> (N or the
    `rows` slice, V) and (N, 3H); a batch -> logits of the flat node indices `rows` into B * N (all when
    None), (M, V), and aux (B, N, 3H).
    segments (causal only): several prompts packed end to end in one row, prompt r at [start, end) of N,
    its K/V written to slots [0, end - start) of cache row r and each attending causally to its own tokens
    only; the linears run once over all of them (more rows a matmul: a batch's prefill).
    live (a batch): the flat indices into B * N of its real nodes, where the others are pads that see only
    themselves (`batch.BatchTarget.verify`): the linears skip the pads (their outputs 0; in the layers-in-one-op
    path by its rows, eagerly by gathering the real nodes around each linear, which then takes the path of
    that many rows), so a row padded to the step's widest tree costs about what its own tree does.
    """
    nh, nkv, hd, scaling, qk_norm, aux_layers, attention_dtype = geometry
    inner = model.model
    batched = ids.dim() == 2
    if not batched:
        ids, positions = ids[None], positions[None]
    B, N = ids.shape
    x = inner.embed_tokens(ids)  # (B, N, H)
    rows_cos, rows_sin = inner.rotary_emb(x, positions)  # (B, N, hd)
    cos, sin = rows_cos[:, None], rows_sin[:, None]  # (B, 1, N, hd)
    # an eager fp32 step on a CPU with our kernel: rotation and cache write as one op (csrc/rope.cpp), the
    # same arithmetic as the torch ops below; a prompt attends over its own K/V (below), a compiled graph
    # fuses the torch ops itself
    rope_op = (not qk_norm and x.dtype == torch.float32 and x.device.type == "cpu"
               and rows_cos.dtype == torch.float32 and rows_cos.is_contiguous() and rows_sin.is_contiguous()
               and not torch.compiler.is_compiling() and kernels.rope_cache_here())
    fused = rope_op and not causal
    # a prompt's rotation as one op too (csrc/rope.cpp: q, k rotated and v transposed, the same numbers), its own
    # K/V then written to the cache and attended over below
    prompt_rope = rope_op and causal
    fused_mlp = (x.device.type == "cpu" and getattr(model.config, "hidden_act", None) in ("silu", "swish")
                 and not torch.compiler.is_compiling() and kernels.rms_norm_here())
    skip = batched and live is not None and live.numel() < B * N and x.device.type == "cpu"
    mlp_bf16 = _bf16_mlp(projs, live.numel() if skip else B * N) if fused_mlp else None
    nodes = -(-live.numel() // B) if skip else N  # real nodes a row (rounded up): what attention's choice weighs
    # a prompt whose MLP runs on bf16 copies of the weights attends in bf16 too where torch's SDPA measured
    # faster in it on this CPU (`attention.prompt_dtype`; bf16 matrix units: about half the time); K and V are
    # then the values a bf16 cache keeps
    prompt_dtype = (prompt_attention(nh, nkv, hd, x.device) if causal and mlp_bf16 is not None
                    and attention_dtype == torch.float32 else attention_dtype)
    stack = (_q4_stack(model, projs, live.numel() if skip else B * N) if fused and fused_mlp
             and attention_dtype == torch.float32 and attention_ours(nh, nkv, hd, nodes, caches[0][0].dtype)
             and kernels.layers_here() else None)
    if stack is not None:  # every linear on our 4-bit kernel, attention on ours: the layers in one op, same numbers
        x, tapped = torch.ops.dart_lab.q4_layers.default(x, *stack, rows_cos, rows_sin, caches[0], caches[1], slots,
                                                         attn_mask, n_keys, scaling, nh, nkv, list(aux_layers),
                                                         live if skip else None)
        taps = dict(zip(aux_layers, tapped))
    else:
        taps = {}
    if skip and stack is None:  # the eager layers skip the pads too: each linear over the real nodes only
        flat = B * N

        def real(f):
            def run(h):
                y = f(h.reshape(flat, -1)[live])
                return y.new_zeros(flat, y.shape[-1]).index_copy_(0, live, y).view(B, N, -1)
            return run
    else:
        def real(f):
            return f
    for i, layer in enumerate(inner.layers if stack is None else ()):
        if i in aux_layers:
            taps[i] = x
        att, (qkv, o_proj, gate_up, down) = layer.self_attn, projs[i]
        heads = real(qkv)(_rms_norm(layer.input_layernorm, x)).view(B, N, nh + 2 * nkv, hd)
        K, V = caches[0][i], caches[1][i]
        if fused and heads.is_contiguous():
            q = torch.ops.dart_lab.rope_cache(heads, rows_cos, rows_sin, K, V, slots, nh, nkv)
        else:
            if prompt_rope and heads.is_contiguous():  # vt: v as (B, kv heads, N, hd)
                q, k, vt = torch.ops.dart_lab.rope_heads(heads, rows_cos, rows_sin, nh, nkv)
            elif qk_norm:
                q, k = _rms_norm(att.q_norm, heads[:, :, :nh]), _rms_norm(att.k_norm, heads[:, :, nh:nh + nkv])
                q, k = _rotate(q.transpose(1, 2), cos, sin), _rotate(k.transpose(1, 2), cos, sin)
                vt = heads[:, :, nh + nkv:].transpose(1, 2)
            else:  # q and k side by side in the projection's output: rotated in one pass
                qk = _rotate(heads[:, :, :nh + nkv].transpose(1, 2), cos, sin)
                q, k, vt = qk[:, :nh], qk[:, nh:], heads[:, :, nh + nkv:].transpose(1, 2)
            if segments is None:
                K.index_copy_(2, slots, k.to(K.dtype))
                V.index_copy_(2, slots, vt.to(V.dtype))
            else:  # prompt r into cache row r (copy_ rounds to the cache's dtype as .to does)
                for r, (s, e) in enumerate(segments):
                    K[r, :, :e - s].copy_(k[0, :, s:e])
                    V[r, :, :e - s].copy_(vt[0, :, s:e])
        if causal:  # a prompt into an empty cache: its own K/V are every key
            qa, ka, va = q.to(prompt_dtype), k.to(prompt_dtype), vt.to(prompt_dtype)
            if segments is None:
                o = attend(qa, ka, va, None, n_keys, scaling, causal).transpose(1, 2)
            else:  # each prompt's heads written straight into the (1, N, heads, hd) the o projection reads
                o = torch.empty(1, N, nh, hd, dtype=qa.dtype, device=qa.device)
                for s, e in segments:
                    o[0, s:e] = attend(qa[:, :, s:e], ka[:, :, s:e], va[:, :, s:e], None, e - s, scaling, causal)[0].transpose(0, 1)
        else:
            o = attend(q.to(attention_dtype), K, V, attn_mask, n_keys, scaling, causal, nodes).transpose(1, 2)
        o_bf16 = _bf16_path(o_proj, B * N) if o.dtype == torch.bfloat16 and not skip else None
        if o_bf16 is not None:  # a bf16 prompt's heads straight into the o projection's bf16 copy (no round trip)
            x = x + o_bf16.raw(o.reshape(B, N, nh * hd)).to(x.dtype)
        else:
            x = x + real(o_proj)(o.to(x.dtype).reshape(B, N, nh * hd))
        h = _rms_norm(layer.post_attention_layernorm, x)
        if mlp_bf16 is not None:  # both on bf16 copies: silu * up from bf16 to bf16, the same numbers (csrc/norm.cpp)
            g, d = gate_up.paths[mlp_bf16[0]], down.paths[mlp_bf16[1]]
            mlp = lambda h: d.raw(torch.ops.dart_lab.silu_mul_bf16.default(g.raw(h.to(torch.bfloat16)))).to(h.dtype)  # noqa: E731
        elif fused_mlp:  # one dispatch for torch's silu and mul (csrc/norm.cpp)
            mlp = lambda h: down(torch.ops.dart_lab.silu_mul.default(gate_up(h)))  # noqa: E731
        else:
            def mlp(h):
                gate, up = gate_up(h).chunk(2, dim=-1)
                return down(layer.mlp.act_fn(gate) * up)
        x = x + real(mlp)(h)
    aux = torch.cat([taps[i] for i in aux_layers], dim=-1)
    if not batched:
        return head(_rms_norm(inner.norm, x[0] if rows is None else x[0, rows])).float(), aux[0]
    h = x.reshape(B * N, -1) if rows is None else x.reshape(B * N, -1)[rows]  # only the rows whose logits are read
    return head(_rms_norm(inner.norm, h)).float(), aux


_stacks = weakref.WeakKeyDictionary()  # a step's first linear -> {rows' paths: q4_layers' weight arguments}


def _q4_stack(model, projs, rows: int) -> tuple | None:
    """`dart_lab::q4_layers`' per-layer arguments (norm weights, eps, and q4mm's wp, sl, n_out, halves, bias for
    q|k|v, o, gate|up, down) where each linear takes our 4-bit kernel (`Q4Linear`) for `rows` rows and every
    norm is an fp32 RMSNorm of one eps; else None. Built once per projections and paths, kept as long as the
    projections live."""
    def q4(f):
        f = f.paths[f.path(rows)] if isinstance(f, ByRows) else f
        return f if isinstance(f, Q4Linear) else None

    sig = tuple(f.path(rows) if isinstance(f, ByRows) else type(f).__name__ for f in projs[0])
    try:
        held = _stacks.setdefault(projs[0][0], {})
    except TypeError:  # a linear that cannot be weakly referenced: not one of ours
        return None
    if sig not in held:
        lins = [q4(f) for row in projs for f in row]
        norms = [n for l in model.model.layers for n in (l.input_layernorm, l.post_attention_layernorm)]
        eps = {getattr(n, "variance_epsilon", None) for n in norms}
        ok = (all(lins) and len(eps) == 1 and None not in eps
              and all(getattr(n, "weight", None) is not None and n.weight.dtype == torch.float32 for n in norms))
        held[sig] = (([n.weight for n in norms], float(eps.pop()), [f.wp for f in lins], [f.sl for f in lins],
                      [f.out_features for f in lins], [f.halves for f in lins], [f.b for f in lins])
                     if ok else None)
    return held[sig]


def _side_by_side(*mods: torch.nn.Linear):
    """x -> the outputs of `mods` (reading the same input) concatenated, each through its own weights."""
    return lambda x: torch.cat([F.linear(x, m.weight, m.bias) for m in mods], dim=-1)


def _fused_linear(*mods: torch.nn.Linear) -> torch.nn.Linear:
    """One nn.Linear computing `mods` (reading the same input) side by side: a copy of their weights."""
    w = torch.cat([m.weight.detach() for m in mods])
    out = torch.nn.Linear(w.shape[1], w.shape[0], bias=mods[0].bias is not None, dtype=w.dtype, device=w.device)
    out.weight = torch.nn.Parameter(w, requires_grad=False)
    if mods[0].bias is not None:
        out.bias = torch.nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
    return out


# whether this torch can check only the guards that tell a function's cached graphs apart (2.7+); asked
# once, not at every step
_CAN_SKIP_GUARDS = "skip_guard_eval_unsafe" in inspect.signature(
    getattr(torch.compiler, "set_stance", lambda: None)).parameters


def _skipping_guards():
    """A context in which dynamo checks only the guards that tell a function's cached graphs apart
    (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`), where this torch has it; else nothing."""
    return torch.compiler.set_stance(skip_guard_eval_unsafe=True) if _CAN_SKIP_GUARDS else contextlib.nullcontext()


class StepGraph(torch.nn.Module):
    """`decoder_step` for `torch.compile` (FastTarget.compile): q|k|v and gate|up as fused nn.Linear
    copies, compiled with inductor's freezing (the weights become constants; on a CPU inductor packs
    them for oneDNN, as PackedLinear does eagerly) and static shapes but the number of keys attention
    reads: one graph per node bucket, the key count a symbol (`n_keys` None), or static too, one graph per
    (node bucket, key bucket) (`n_keys` the bucket). Compiled on first use; `shapes` lists the
    (node bucket, key bucket or None) seen (tests count real compilations)."""

    graphs_allowed = 0  # dynamo's recompile limit, summed over the modules built in this process

    def __init__(self, target: "FastTarget", key) -> None:
        super().__init__()
        layers = target.model.model.layers
        self.target_model = target.model
        self.qkv = torch.nn.ModuleList(_fused_linear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj)
                                       for l in layers)
        self.gate_up = torch.nn.ModuleList(_fused_linear(l.mlp.gate_proj, l.mlp.up_proj) for l in layers)
        self.geometry, self.key, self.shapes = target._geometry(), key, set()
        # 4-bit weights: the int4 kernel's calls stay as they are in the graph, the ops between them fuse;
        # with `int4_paths` "measured" each linear takes the path its table measured fastest for the
        # bucket's rows, as an eager step does (`_measured_paths`), else 4 bits at every width
        self.int4 = None
        if target.weights == "int4":
            self.int4 = (self._measured_paths(target) if target.int4_paths == "measured"
                         else target._int4(by_rows=False))
        self.eval()
        # kept out of the module registry (a compiled module holding itself would loop in .modules())
        object.__setattr__(self, "_compiled", torch.compile(self, dynamic=False, fullgraph=True))
        # one graph per shape: allow as many as the buckets can make without falling back to eager, for this
        # module and every one built before it in this process (their graphs share dynamo's code objects)
        key_buckets = target.compile_capacity // target.key_bucket + 1 if target.key_bucket else 1
        StepGraph.graphs_allowed += len(target.node_buckets) * key_buckets
        need = StepGraph.graphs_allowed
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, need)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4 * need)

    def _measured_paths(self, target: "FastTarget") -> tuple[list, "ByRows"]:
        """The 4-bit target's (layers, head) for a graph: every linear a `ByRows` over the tables `int4_by_rows`
        measured (cached per machine), its paths written so inductor can compile them -- the 4-bit kernel
        as is, the dense weights as the fused nn.Linear copies, bf16 as nn.Linear copies that freezing packs
        for oneDNN (what `PackedLinear` does eagerly). A wide tree's LM head, for one, is 2-3x cheaper in
        packed bf16 than in 4-bit halves on a CPU with bf16 units (docs/speed.md)."""
        layers4, head4 = target._int4(by_rows=False)
        target._int4(by_rows=True)  # the tables: measured once per machine, then read from the cache
        tables = target.dtype_report["int4"]["by_rows"]["tables"]
        dense_name = _dt_name(target.model.lm_head.weight.dtype)
        self.bf16 = torch.nn.ModuleList()  # bf16 copies, only of what some row count takes

        def bf16(lin: torch.nn.Linear):
            copy = _fused_linear(lin).to(torch.bfloat16)
            self.bf16.append(copy)
            return lambda x: copy(x.to(torch.bfloat16)).to(x.dtype)

        def by_rows(table, paths: dict, bf16_name: str, dense: torch.nn.Linear) -> ByRows:
            used = {n for _, n in table}
            return ByRows({n: bf16(dense) if n == bf16_name else paths[n] for n in used}, tuple(table))

        layers = []
        for i, l in enumerate(target.model.model.layers):
            dense = (self.qkv[i], l.self_attn.o_proj, self.gate_up[i], l.mlp.down_proj)
            layers.append(tuple(by_rows(tables[kind], {"int4": layers4[i][j], "q4": getattr(layers4[i][j], "q4", None),
                                                       dense_name: dense[j]}, "bf16", dense[j])
                                for j, kind in enumerate(("qkv", "o", "gate_up", "down"))))
        head = by_rows(tables["lm_head"], {**head4.paths, dense_name: target.model.lm_head}, "bf16 packed",
                       target.model.lm_head)
        return layers, head

    def forward(self, ids, positions, slots, attn_mask, ks, vs, n_keys: int | None):
        if n_keys is None:  # the mask's width, a symbol in the graph (`run`)
            n_keys = attn_mask.shape[-1]
        if self.int4 is not None:
            projs, head = self.int4
        else:
            projs = [(self.qkv[i], l.self_attn.o_proj, self.gate_up[i], l.mlp.down_proj)
                     for i, l in enumerate(self.target_model.model.layers)]
            head = self.target_model.lm_head
        return decoder_step(self.target_model, projs, head, self.geometry, ids, positions, slots, (ks, vs), n_keys,
                            attn_mask)

    def run(self, ids, positions, slots, attn_mask, ks, vs, n_keys: int | None):
        """(logits (Nb, V), aux (Nb, 3H)) for a padded step; Nb = ids.numel(). attn_mask (1, 1, Nb, K):
        attention reads cache slots [0, K); n_keys None: K varies from call to call in one graph, else
        n_keys == K, a static shape."""
        shape = (ids.numel(), n_keys)
        if shape in self.shapes:
            # a shape this module already compiled: dynamo checks only the guards that tell its cached graphs
            # apart (checking every guard is a visible share of a small compiled step: docs/speed.md).
            # Safe here because nothing else a guard watches changes between calls: the caches are allocated
            # once at `compile_capacity`, the weights are frozen into this module's graphs and a weight
            # change builds a new module (`FastTarget._graph`), whose first call of each shape compiles with
            # every guard checked (tests/test_fast_runner.py)
            with _skipping_guards():
                return self._compiled(ids, positions, slots, attn_mask, ks, vs, n_keys)
        self.shapes.add(shape)
        if n_keys is None:  # compiled with the key count symbolic: any K up to the cache's slots reuses it
            torch._dynamo.mark_dynamic(attn_mask, 3)
        # freezing is read while compiling (passed through torch.compile's `options` it did not reach the
        # compiler: the linears stayed aten::mm, unpacked), so it is set around the call that compiles
        # int4's head mixes fp16 (one row) and bf16 (the 4-bit kernel's activations) by design
        with torch._inductor.config.patch(freezing=True), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed")
            return self._compiled(ids, positions, slots, attn_mask, ks, vs, n_keys)


@dataclass
class FastTarget(Target):
    """`Target` with the lean forward (module docstring). Same protocol: prefill, verify, commit."""

    capacity_step: int = 512  # the cache grows in steps of this many positions (rarely: one reallocation)
    fp32_attention: bool = True  # CPU, half types: attention in fp32 (see _forward)
    # CPU with our attention kernel, bf16 or 4-bit weights: the K/V cache stored in bf16, half the bytes a step
    # streams (a batch's step reads more K/V than weights); exact for bf16 weights (their K/V are bf16 values),
    # for 4-bit ones part of that arithmetic (its matmuls already take bf16 inputs). fp32 weights keep fp32.
    bf16_cache: bool = True
    pack_weights: bool = True  # CPU, fp32/bf16: oneDNN-packed fused projections (module docstring)
    # torch.compile of one-token steps and tree verifies (StepGraph; prefill stays eager): off by default,
    # compiling costs tens of seconds per shape on a small CPU and pays only over long runs
    # (experiments/engine/compile_bench.py)
    compile: bool = False
    node_buckets: tuple = (1, 2, 4, 8, 16, 32, 64)  # a step of N nodes runs padded to the next of these
    # compiled attention reads exactly the cached keys, their number a symbol in the graph (None), or a
    # multiple of this many slots (one graph per multiple, the padding read too: dearer, and compiling
    # more; experiments/engine/compiled_ab.py --variant keys)
    key_bucket: int | None = None
    compile_capacity: int = 4096  # cache slots allocated at once when compiling (longer: eager steps)
    # part of the cost curve's cache key (budget.fingerprint): raised when a change moves verify cost, so
    # a curve measured with older code is not reused (2: the additive tree mask; 3: decoder_step, cache
    # writes by index_copy_; 4: fused norms and one-pass rotation for fp32 activations; 5: steps of a few
    # nodes a row on our attention kernel where it measures faster, attention.py; 6: eager fp32 norms on our
    # one-pass op, csrc/norm.cpp; 7: the attention kernel prefetches K and V; 8: it cuts a tree's query rows
    # into blocks over the threads; 9: it skips the keys every position of a row masks; 10: bf16 K/V caches; 11:
    # rotation and cache write in one op, csrc/rope.cpp; 12: the MLP's silu * up in one dispatch; 13: a step's
    # layers in one op where every linear takes our 4-bit kernel, csrc/layers.cpp; 14: a step's argmaxes and margins
    # in one pass over the logits, a batch's compaction as plain copies, a prompt's rotation in one op; 15: a batch
    # step's pad nodes skipped by the linears and the attention kernel; 16: the eager layers skip them too, and the
    # weights' key is taken once a request; 17: the attention kernel's scores 4 keys at a time, each row's mask and
    # max on vectors; 18: q scaled as the attention kernel loads it, the MLP's fp32 silu * up in one pass; 19: a
    # layer's norms and residual adds inside the 4-bit kernel that reads or writes them; 20: the eager-step kernels
    # built for AVX2 too)
    runner_revision = 20
    # the same for the 4-bit path alone, so a change there leaves dense curves valid (2: the LM head in
    # 4-bit halves for 2+ rows and in fp16 for one row; 3: each linear's path measured per row count;
    # 4: a prompt on its rows' path; 5: compiled steps on the measured paths too; 6: our 4-bit kernel, q4.py,
    # one more measured path; 7: the LM head's halves on it too; 8: 128 rows in the sweep, where prompts
    # of 100-200 tokens cross from 4 bits to bf16; 9: our kernel prefetches, several rows cheaper; 10: several
    # rows on AMX tiles where the CPU has them; 11: two groups at a time through two sets of tiles, AMX from 2 rows; 12:
    # 1024 rows in the layers' sweep, a batch's prompts packed in one forward; 13: our kernel on CPUs with AVX2 only;
    # 14: a median out of proportion with its path's previous one timed again, each output dropped in a sweep;
    # 15: the AMX tiles' groups software-pipelined, 2-16 rows cheaper; 16: the AVX-512 path prefetches 2 KB ahead;
    # 17: the AVX2 path multiplies x's groups as 16-bit integers; 18: the Q8_0 LM head one product a weight, q8mm)
    int4_revision = 18
    # int4 steps: "measured" = each linear takes the path measured fastest for the step's rows (4 bits,
    # the dense weights, bf16 copies: `int4_by_rows`), compiled or not; "4bit" = 4 bits at every width (one
    # arithmetic for AR and trees)
    int4_paths: str = "measured"

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
        self._packed, self._packed_key, self._params, self._key = None, None, None, None
        self._int4_packed, self._int4_key, self._int4_rows = None, None, None
        self._kv_views, self._step_graph = None, None
        self.compile_seconds = 0.0  # time spent in first calls of new shapes (compiling), this target's life

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
        key = self._weights_key()
        if key != self._packed_key:
            with torch.no_grad():
                layers = [(PackedLinear(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj),
                           PackedLinear(l.self_attn.o_proj), PackedLinear(l.mlp.gate_proj, l.mlp.up_proj),
                           PackedLinear(l.mlp.down_proj)) for l in inner.layers]
                self._packed, self._packed_key = (layers, PackedLinear(self.model.lm_head)), key
        return self._packed

    @property
    def compiled_shapes(self) -> set:
        """(node bucket, key bucket or None: any) shapes compiled so far (`compile=True`), each once."""
        return set(self._step_graph.shapes) if self._step_graph is not None else set()

    @property
    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The K and V caches (L, 1, kv_heads, capacity, head_dim), None before the first forward."""
        return None if self._k is None else (self._k, self._v)

    def _weights_key(self) -> tuple:
        """What the weights are: a weight replaced (new storage) or edited in place (version bump) changes it.
        Taken at a request's prompt (`_fresh_weights`) and kept for its steps -- an edit reaches the next
        prompt's forward -- since reading ~270 tensors' pointers and versions every step cost ~0.25 ms."""
        if self._key is None:
            if self._params is None:
                self._params = list(self.model.parameters())
            self._key = (self.dtype, self.device, [p.data_ptr() for p in self._params],
                         sum(p._version for p in self._params))
        return self._key

    def _fresh_weights(self) -> None:
        """A new request: list the parameters again and take the weights' key anew at the next forward."""
        self._params, self._key = None, None

    @property
    def dtype(self) -> torch.dtype:
        # read every step several times: the listed parameters' first, not a walk of the module tree
        params = getattr(self, "_params", None)  # (None until listed, absent during __post_init__)
        return params[0].dtype if params else super().dtype

    @property
    def device(self) -> torch.device:
        params = getattr(self, "_params", None)
        return params[0].device if params else super().device

    def _int4(self, by_rows: bool | None = None) -> tuple[list, object]:
        """`int4_projections` of the current weights (by_rows: each linear's path measured per row count,
        `int4_by_rows`; default: `int4_paths`), built on first use and when the weights change."""
        if not can_int4(self.device):
            raise RuntimeError(f"int4 weights need torch's CPU int4 kernel (device {self.device.type})")
        by_rows = self.int4_paths == "measured" if by_rows is None else by_rows
        key = self._weights_key()
        if key != self._int4_key:
            with torch.no_grad():
                layers, head, report = int4_projections(self.model)
            self._int4_packed, self._int4_key, self._int4_rows = (layers, head), key, None
            self.dtype_report = {**self.dtype_report, "int4": report}
        if not by_rows:
            return self._int4_packed
        if self._int4_rows is None:
            self._int4_rows = self._int4_by_rows()
        return self._int4_rows

    def _int4_by_rows(self) -> tuple[list, object]:
        """`int4_by_rows`, its tables cached per machine like a cost curve (`budget.fingerprint`; served only
        when measured on a quiet machine, and a contended measurement is not written)."""
        from .atomic import write_json
        from .budget import cost_file, fingerprint, read_quiet
        from .machine import LoadMeter

        path, tables = cost_file("int4_paths_", fingerprint(self)), None
        d = read_quiet(path)
        if d is not None:
            try:
                tables = {k: tuple((int(r), n) for r, n in t) for k, t in d["tables"].items()}
            except (KeyError, TypeError, ValueError, AttributeError):
                tables = None
        with torch.no_grad(), LoadMeter() as meter:
            try:
                layers, head, report = int4_by_rows(self.model, self._int4_packed, self._dense(),
                                                    tables)
            except KeyError:  # a cached table names a path this build lacks: measure again
                tables = None
                layers, head, report = int4_by_rows(self.model, self._int4_packed, self._dense())
        if tables is None and not meter.load["contended"]:
            write_json(path, {"tables": report["tables"], "ms_by_rows": {k: v["ms_by_rows"] for k, v in report.items()
                                                                          if k != "tables"},
                              "machine_load": meter.load, "measured_at": time.time()})
        report["cached"] = tables is not None
        self.dtype_report = {**self.dtype_report, "int4": {**self.dtype_report["int4"], "by_rows": report}}
        return layers, head

    # -- cache
    @property
    def attention_dtype(self) -> torch.dtype:
        """The dtype attention computes in (queries, additive masks)."""
        dt = self.dtype
        half = dt in (torch.bfloat16, torch.float16)
        return torch.float32 if (self.fp32_attention and half and self.device.type == "cpu") else dt

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype the K/V cache is stored in (`bf16_cache`). Asked at every forward: the model's dtype read once."""
        dt, attention = self.dtype, self.attention_dtype
        narrow = dt == torch.bfloat16 or self.weights == "int4"
        if (self.bf16_cache and narrow and attention == torch.float32 and self.device.type == "cpu"
                and attention_available()):
            return torch.bfloat16
        return attention

    @property
    def attention_nodes(self) -> int:
        """The most nodes a row a step takes our attention kernel for (attention.py), measured once per process,
        head geometry and cache dtype -- asked before a forward, not inside a compiled graph's tracing."""
        return prepare_attention(self.n_heads, self.n_kv, self.head_dim, self.device, self.cache_dtype)

    def _ensure(self, n: int) -> None:
        """Capacity for n positions, on the model's current device, in `cache_dtype` (kept contents)."""
        dev, dt = self.device, self.cache_dtype
        if self._k is not None and self._k.shape[3] >= n and self._k.dtype == dt and self._k.device == dev:
            return
        self.attention_nodes  # measured before the first step with this cache
        cap = min(max(n, 1) + self.capacity_step, max(self.max_context, n))
        shape = (self.num_layers, 1, self.n_kv, cap, self.head_dim)
        # zeros, not empty: a compiled step attends over whole blocks of slots with the unused ones masked,
        # and a masked slot's weight 0 times a NaN left in uninitialised memory is still NaN
        k, v = torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev)
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
    def projections(self, prefill: bool = False) -> tuple[list, object]:
        """Per layer (qkv, o, gate_up, down) callables and the LM head for an eager forward. When `weights`
        is "int4": with `int4_paths` "measured", every forward (a prompt too) takes each linear's path
        measured fastest for its row count (`int4_by_rows`: a prompt's hundreds of rows go where a wide
        tree goes: bf16 copies on a CPU with bf16 units, faster than fp32 there); with "4bit", decoding
        steps in 4 bits at every width (one arithmetic) and a prompt through the dense weights, since the
        4-bit CPU kernel's cost grows about linearly in rows. Else `_dense`."""
        if prefill:
            self._fresh_weights()
        if self.weights == "int4" and (not prefill or self.int4_paths == "measured"):
            return self._int4()
        return self._dense()

    def _dense(self) -> tuple[list, object]:
        """The model's own weights in its dtype: oneDNN-packed where that applies, else the HF modules'
        weights through F.linear (q|k|v, gate|up side by side)."""
        packs = self._packs()
        if packs:
            return packs
        return [(_side_by_side(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), l.self_attn.o_proj,
                 _side_by_side(l.mlp.gate_proj, l.mlp.up_proj), l.mlp.down_proj)
                for l in self.model.model.layers], self.model.lm_head

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, want_aux: bool,
                 rows: slice | None = None) -> TargetOutput:
        """ids, positions (N,); mask (N, P+N) bool or None (causal prefill / a single token)."""
        P, N = self.seq_len, ids.numel()
        if P == 0:
            self._fresh_weights()
        if self.compile and (P > 0 or N == 1):
            out = self._compiled_step(ids, positions, mask, want_aux)
            if out is not None:
                return out
        self._ensure(P + N)
        dev = self.device
        # a half type on a CPU: a step's attention runs in fp32 -- SDPA's CPU kernel is faster there than in bf16
        # for a few query rows (a prompt on bf16 copies: `decoder_step`'s choice); the
        # K/V cache is bf16 where our kernel reads it (`cache_dtype`), else fp32 (docs/speed.md)
        attn_mask = None
        if mask is not None:  # additive, built once per forward: a bool mask is converted by SDPA in every
            # layer (2 ops each, a tenth of a tree attention's time)
            attn_mask = torch.zeros(mask.shape, dtype=self.attention_dtype, device=dev).masked_fill_(
                ~mask.to(dev), float("-inf"))[None, None]
        slots = torch.arange(P, P + N, device=dev)
        logits, aux = decoder_step(self.model, *self.projections(prefill=P == 0), self._geometry(), ids.to(dev),
                                   positions.to(dev), slots, self._layer_caches(), P + N, attn_mask,
                                   causal=mask is None and N > 1 and P == 0, rows=rows)
        return TargetOutput(logits, aux if want_aux else None)

    def _geometry(self) -> tuple:
        return (self.n_heads, self.n_kv, self.head_dim, self.scaling, self.qk_norm, self.aux_layers,
                self.attention_dtype)

    def _layer_caches(self) -> tuple[list, list]:
        """Per-layer views (1, kv_heads, capacity, head_dim) of the K and V caches."""
        if self._kv_views is None or self._kv_views[0][0]._base is not self._k:
            self._kv_views = (list(self._k.unbind(0)), list(self._v.unbind(0)))
        return self._kv_views

    # -- compiled steps
    def _compiled_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                       want_aux: bool) -> TargetOutput | None:
        """A one-token step or tree verify through `torch.compile` with static shapes: N nodes padded to
        the next of `node_buckets` (dummy nodes attend only to themselves and write cache slots past the
        tree, which nothing reads), attention over the P + nb cache slots in use (or the first
        `key_bucket`-multiple of slots, an additive mask hiding the rest). None when the step does not fit
        (more nodes than the largest bucket, or past `compile_capacity`): the eager forward runs then."""
        P, N = self.seq_len, ids.numel()
        nb = next((b for b in self.node_buckets if b >= N), None)
        nk = P + nb if nb else None  # the slots in use, or with static key buckets the next multiple
        if nk and self.key_bucket:
            nk = -(-nk // self.key_bucket) * self.key_bucket
        cap = min(self.compile_capacity, self.max_context)
        if nb is None or nk > cap:
            return None
        self._ensure(cap)  # one allocation: a new cache shape would recompile every graph
        dev = self.device
        allowed = torch.zeros(nb, nk, dtype=torch.bool)
        allowed[:N, :P] = True
        allowed[:N, P:P + N] = mask[:, P:] if mask is not None else True  # mask None: N == 1
        allowed[N:, P + N:P + nb] = torch.eye(nb - N, dtype=torch.bool)
        attn_mask = torch.zeros(nb, nk, dtype=self.attention_dtype).masked_fill_(~allowed, float("-inf"))
        slots = torch.arange(P, P + nb)
        pad_ids = torch.cat([ids.cpu(), ids.new_zeros(nb - N).cpu()])
        pad_pos = torch.cat([positions.cpu(), slots[N:]])
        graph = self._graph()
        static_keys = nk if self.key_bucket else None
        new_shape, t0 = (nb, static_keys) not in graph.shapes, time.perf_counter()
        logits, aux = graph.run(pad_ids.to(dev), pad_pos.to(dev), slots.to(dev), attn_mask[None, None].to(dev),
                                *self._layer_caches(), static_keys)
        if new_shape:  # the first call of a shape compiles it
            self.compile_seconds += time.perf_counter() - t0
        return TargetOutput(logits[:N], aux[:N] if want_aux else None)

    @torch.no_grad()
    def precompile(self, context: int) -> int:
        """Compile now every (node bucket, key bucket) shape a decode within `context` tokens can meet
        (`compile=True`; else nothing), so that timed decodes do not compile: one verify of a chain of each
        bucket's size (after a prompt that puts it in each key bucket, where keys are bucketed). Returns the
        shapes compiled now."""
        if not self.compile:
            return 0
        before = set(self.compiled_shapes)
        g = torch.Generator().manual_seed(0)
        V = min(self.vocab_size, 1000)
        kb, cap = self.key_bucket, min(self.compile_capacity, self.max_context)
        key_counts = range(kb, min(-(-context // kb) * kb, cap) + 1, kb) if kb else [min(context, cap)]
        for nk in key_counts:
            for nb in self.node_buckets:
                P = nk - nb  # P + nb cached slots: the last of key bucket nk (exact keys: any count compiles it)
                if P < 1 or (nb, nk if kb else None) in before:
                    continue
                self.prefill(torch.randint(3, V, (P,), generator=g))  # P committed; the chain's root is new
                self.verify(Tree(torch.randint(3, V, (nb,), generator=g), torch.arange(-1, nb - 1)))
                self.commit([0])
        return len(self.compiled_shapes - before)

    def _graph(self) -> "StepGraph":
        """The compiled step for the model's current weights (rebuilt, and recompiled, when they change)."""
        key = (self._weights_key(), self.weights)
        if self._step_graph is None or self._step_graph.key != key:
            self._step_graph = StepGraph(self, key)
        return self._step_graph

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
