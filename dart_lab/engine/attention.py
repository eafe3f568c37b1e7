"""A decoding step's attention against the K/V cache: our kernel (`csrc/attention.cpp`, `dart_lab::decode_attn`)
for steps of a few positions a row, torch's SDPA for everything else (a prompt, a wide tree, other devices).

Why: torch's CPU SDPA kernel is built for long queries; a step of 1-4 new positions a row spends most of
its time outside the arithmetic and reads the cache at a fraction of the memory's speed -- a visible share
of a one-token step, and the largest single cost of a batched one (docs/speed.md). Ours reads each row's
K and V once for all the query heads sharing them, from an fp32 or a bf16 cache (half the bytes: a batch's
step streams more K/V than weights), computing in fp32 with an exact softmax; it is used up to the
largest node count a row at which it measured faster than SDPA on this machine (`prepare`, once per
process and head geometry), so a CPU where it loses never takes it. Built on first use
(`kernels.build`); it needs AVX2 + FMA + F16C and runs its AVX-512 build where the CPU has one (`reason()` says
why it is absent).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import kernels

_state: dict = {}  # "reason": why the kernel is absent (None: built); (heads, kv_heads, head_dim, K/V dtype): max nodes
NODE_COUNTS = (1, 2, 4, 5, 6, 8, 16)  # nodes a row at which `prepare` times both (dense where SDPA overtakes ours)
HEAD_DIMS = (16, 32, 64, 128)  # the kernel's
KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches it reads


def _register_fake():
    @torch.library.register_fake("dart_lab::decode_attn")
    def _(q, k, v, mask, scale):  # shapes for torch.compile
        return torch.empty_like(q, memory_format=torch.contiguous_format)


def reason() -> str | None:
    """Why our kernel is not available here (None when it is)."""
    return kernels.reason(_state, "attention", kernels.EAGER_ISA, _register_fake)


def available() -> bool:
    return reason() is None


def _sdpa(q, K, V, mask, n_keys: int, scale: float, causal: bool = False) -> torch.Tensor:
    """torch's SDPA in q's dtype (a narrower cache's keys widened for the call)."""
    K, V = K[:, :, :n_keys], V[:, :, :n_keys]
    if K.dtype != q.dtype:
        K, V = K.to(q.dtype), V.to(q.dtype)
    return F.scaled_dot_product_attention(q, K, V, attn_mask=mask, is_causal=causal, scale=scale,
                                          enable_gqa=K.shape[1] != q.shape[1])


@torch.no_grad()
def prepare(heads: int, kv_heads: int, head_dim: int, device: torch.device, kv_dtype=torch.float32) -> int:
    """The most nodes a row for which our kernel is taken with this head geometry and K/V cache dtype (0:
    never), measured once per process: one row over 256 cached keys of 8 layers' caches (each read from
    memory, as in a step), both kernels interleaved, the faster of 3 rounds, at each of NODE_COUNTS; the
    kernel is kept up to the first count where SDPA (on the keys widened to fp32) is as fast."""
    key = (heads, kv_heads, head_dim, kv_dtype)
    if key in _state:
        return _state[key]
    if (torch.device(device).type != "cpu" or head_dim not in HEAD_DIMS or heads % kv_heads or not available()
            or kv_dtype not in KV_DTYPES):
        _state[key] = 0
        return 0
    g = torch.Generator().manual_seed(0)
    nk, layers = 256, 8
    caches = [(torch.randn(1, kv_heads, 2 * nk, head_dim, generator=g).to(kv_dtype),
               torch.randn(1, kv_heads, 2 * nk, head_dim, generator=g).to(kv_dtype)) for _ in range(layers)]
    best = 0
    for n in NODE_COUNTS:
        q = torch.randn(1, heads, n, head_dim, generator=g)
        mask = torch.zeros(1, 1, n, nk)
        mask[..., nk - n:] = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        ours = lambda: [torch.ops.dart_lab.decode_attn(q, K[:, :, :nk], V[:, :, :nk], mask, 0.125) for K, V in caches]  # noqa: E731
        sdpa = lambda: [_sdpa(q, K, V, mask, nk, 0.125) for K, V in caches]  # noqa: E731
        times = {ours: [], sdpa: []}
        for _ in range(4):
            for f in times:
                t0 = time.perf_counter()
                f()
                times[f].append(time.perf_counter() - t0)
        if min(times[ours][1:]) >= min(times[sdpa][1:]):  # round 0 warms up
            break
        best = n
    _state[key] = best
    return best


@torch.no_grad()
def prompt_dtype(heads: int, kv_heads: int, head_dim: int, device: torch.device) -> torch.dtype:
    """The dtype a prompt's causal attention computes in where its linears run on bf16 copies of the weights
    (`step.decoder_step`): bf16 where torch's SDPA measured faster in it than in fp32 on this CPU (bf16
    matrix units: about half the time), else fp32. Measured once per process and head geometry: 8 layers'
    attention over a 128-token prompt, both interleaved, the faster of 4 rounds each."""
    key = ("prompt", heads, kv_heads, head_dim)
    if key in _state:
        return _state[key]
    if torch.device(device).type != "cpu":
        return torch.float32
    g = torch.Generator().manual_seed(0)
    qkv = [(torch.randn(1, heads, 128, head_dim, generator=g), torch.randn(1, kv_heads, 128, head_dim, generator=g),
            torch.randn(1, kv_heads, 128, head_dim, generator=g)) for _ in range(8)]
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        args = [tuple(t.to(dt) for t in x) for x in qkv]
        times[dt] = (lambda args: lambda: [_sdpa(q, k, v, None, 128, 0.125, True) for q, k, v in args])(args)
    best = {dt: float("inf") for dt in times}
    for r in range(5):
        for dt, f in times.items():
            t0 = time.perf_counter()
            f()
            if r:  # round 0 warms up
                best[dt] = min(best[dt], time.perf_counter() - t0)
    _state[key] = torch.bfloat16 if best[torch.bfloat16] < best[torch.float32] else torch.float32
    return _state[key]


def override_prompt(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype | None) -> None:
    """Take `dtype` for a prompt's attention on bf16 copies with this head geometry, or None: forget it, so
    the next `prompt_dtype` measures again -- for A/B timings and tests."""
    if dtype is None:
        _state.pop(("prompt", heads, kv_heads, head_dim), None)
    else:
        _state[("prompt", heads, kv_heads, head_dim)] = dtype


def override(heads: int, kv_heads: int, head_dim: int, nodes: int | None) -> None:
    """Take our kernel up to `nodes` nodes a row for this head geometry, either cache dtype (0: SDPA for every
    step), or None: forget it, so the next `prepare` measures again -- for A/B timings and tests. A compiled
    step keeps what it was traced with."""
    for dt in KV_DTYPES:
        if nodes is None:
            _state.pop((heads, kv_heads, head_dim, dt), None)
        else:
            _state[(heads, kv_heads, head_dim, dt)] = nodes


def ours(heads: int, kv_heads: int, head_dim: int, nodes: int, kv_dtype: torch.dtype) -> bool:
    """Whether a step of `nodes` nodes a row takes our kernel (fp32 queries on a CPU; `prepare` measured it)."""
    return nodes <= _state.get((heads, kv_heads, head_dim, kv_dtype), 0)


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, mask: torch.Tensor | None, n_keys: int, scale: float,
           causal: bool = False, nodes: int | None = None) -> torch.Tensor:
    """softmax(q K^T * scale + mask) V over cache slots [0, n_keys): q (B, H, N, D); K, V (B, Hk, capacity, D),
    in q's dtype or narrower (a bf16 cache under fp32 attention); mask (B or 1, 1, N, n_keys) additive in q's
    dtype, or None (every key; `causal`: a prompt's causal mask). Returns (B, H, N, D) in q's dtype. Our
    kernel where `prepare` measured it faster for `nodes` nodes a row (default N; a batch whose rows are
    padded to N: its real nodes a row, on average -- our kernel skips a pad, SDPA computes it) and this cache
    dtype, else SDPA."""
    B, H, N, D = q.shape
    if (not causal and ours(H, K.shape[1], D, N if nodes is None else nodes, K.dtype) and q.dtype == torch.float32
            and q.device.type == "cpu"):
        return torch.ops.dart_lab.decode_attn(q, K[:, :, :n_keys], V[:, :, :n_keys], mask, scale)
    return _sdpa(q, K, V, mask, n_keys, scale, causal)
