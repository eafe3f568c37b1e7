"""Shared by the kernel A/B timings (`q4_*_ab.py`, `attention_*_ab.py`): a `dart_lab/csrc/` kernel built from
other source (a variant, or a git revision) under its own op namespace beside the working tree's, the
alternating timing loop, and the 4-bit sweep over the embedded target's decoder linear shapes."""
from __future__ import annotations

import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
Q4_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (K, N): qkv, o, gate|up, down x 30 layers


def build_ops(src: str, ns: str):
    """torch.ops.<ns>: kernel source `src` with its ops renamed out of the `dart_lab` namespace."""
    src = src.replace("TORCH_LIBRARY_FRAGMENT(dart_lab", f"TORCH_LIBRARY_FRAGMENT({ns}") \
             .replace("TORCH_LIBRARY_IMPL(dart_lab", f"TORCH_LIBRARY_IMPL({ns}")
    folder = Path(tempfile.mkdtemp())
    (folder / f"{ns}.cpp").write_text(src)
    load(name=ns, sources=[str(folder / f"{ns}.cpp")], extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
         extra_include_paths=[str(ROOT / "dart_lab" / "csrc")],  # its headers (the working tree's)
         is_python_module=False, verbose=False)
    return getattr(torch.ops, ns)


def source(stem: str) -> str:
    """The working tree's `csrc/<stem>.cpp`."""
    return (ROOT / "dart_lab" / "csrc" / f"{stem}.cpp").read_text()


def ops_at(stem: str, rev: str):
    """torch.ops.<stem>_rev: `csrc/<stem>.cpp` as it was at git revision `rev`."""
    src = subprocess.run(["git", "show", f"{rev}:dart_lab/csrc/{stem}.cpp"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    return build_ops(src, f"{stem}_rev")


def alternate(timers: dict, sizes, rounds: int) -> dict:
    """{(name, size): median ms}: per round every timer (name -> size -> wall ms of one call) at every size,
    the order reversed every other round, each a warm-up call then the fastest of 3."""
    res = {(name, s): [] for name in timers for s in sizes}
    for r in range(rounds):
        for name in (list(timers) if r % 2 == 0 else list(timers)[::-1]):
            for s in sizes:
                timers[name](s)
                res[(name, s)].append(min(timers[name](s) for _ in range(3)))
    return {k: statistics.median(v) for k, v in res.items()}


def wall_ms(f) -> float:
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def q4_weights(g: torch.Generator) -> list:
    """Random packed 4-bit weights (wp, sl, N, K) of Q4_SHAPES, as `dart_lab::q4mm` reads them (its time does
    not depend on their values)."""
    return [(torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g),
             torch.randn(n * k // 16, generator=g).half(), n, k) for k, n in Q4_SHAPES]


def q4_sweep(op, x_by_k: dict, weights: list) -> float:
    """Wall ms of one `q4mm`-shaped op over every weight, x (M, K) taken from x_by_k by the weight's K; each
    output dropped before the next call, as in a step (held, their memory is handed back and faulted in again)."""
    def sweep():
        for wp, sl, n, k in weights:
            op(x_by_k[k], wp, sl, n, 1)
    return wall_ms(sweep)
