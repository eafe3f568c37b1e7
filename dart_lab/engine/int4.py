"""The projections of the lean runner: oneDNN-packed fused linears, 4-bit and 8-bit weight grids (GGUF Q4_1 /
Q8_0 layouts) on torch's int4 kernel or ours, and the per-row-count choice among them (`int4_by_rows`).
"""
from __future__ import annotations


import functools
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .q4 import Q4Linear, Q8Linear

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
        return side_by_side(*mods)

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
# prompts (`batch_target.BatchTarget`), where a path that wins at 256 rows may not at a thousand
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


def bf16_path(f, rows: int) -> "BF16Linear | None":
    """The bf16 copy linear `f` takes for `rows` rows (`ByRows`), else None."""
    g = f.paths[f.path(rows)] if isinstance(f, ByRows) else f
    return g if isinstance(g, BF16Linear) else None


def bf16_mlp(projs, rows: int) -> tuple[str, str] | None:
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
        paths = {"int4": [row[j] for row in layers4], dtype_name(dt): [row[j] for row in layers_d]}
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
    head_paths[dtype_name(dt)] = [head_d]
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


def dtype_name(dt: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, str(dt))

def side_by_side(*mods: torch.nn.Linear):
    """x -> the outputs of `mods` (reading the same input) concatenated, each through its own weights."""
    return lambda x: torch.cat([F.linear(x, m.weight, m.bias) for m in mods], dim=-1)
