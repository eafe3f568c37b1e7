"""How far ahead our 4-bit kernel should prefetch, on this CPU: variants of `dart_lab/csrc/q4mm.cpp` with the
prefetch distance (1, 2, 4 KB) and hint (L1 / L2) changed, or no prefetch, built side by side (each under its
own op namespace) and timed on one sweep over the embedded target's 120 decoder linear shapes (random 4-bit
weights: the kernel's time does not depend on their values), 9 alternating rounds, median of each round's
fastest of 3.

    python experiments/engine/q4_prefetch_ab.py [--rows 1,4,8]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

SRC = Path(__file__).resolve().parents[2] / "dart_lab" / "csrc" / "q4mm.cpp"
LINE = "_mm_prefetch((const char*)(wb + (quad + 32) * 32), _MM_HINT_T0);"
VARIANTS = {"1KB": (32, "_MM_HINT_T0"), "2KB": (64, "_MM_HINT_T0"), "4KB": (128, "_MM_HINT_T0"),
            "2KB-L2": (64, "_MM_HINT_T1"), "4KB-L2": (128, "_MM_HINT_T1"), "none": None}
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (K, N): qkv, o, gate|up, down x 30 layers


def build(name: str, spec, folder: Path):
    src = SRC.read_text()
    assert LINE in src, "the kernel's prefetch line changed: update this experiment"
    line = "" if spec is None else f"_mm_prefetch((const char*)(wb + (quad + {spec[0]}) * 32), {spec[1]});"
    ns = "v_" + name.replace("-", "_")
    src = src.replace(LINE, line).replace("TORCH_LIBRARY_FRAGMENT(dart_lab", f"TORCH_LIBRARY_FRAGMENT({ns}") \
             .replace("TORCH_LIBRARY_IMPL(dart_lab", f"TORCH_LIBRARY_IMPL({ns}")
    path = folder / f"{ns}.cpp"
    path.write_text(src)
    load(name=ns, sources=[str(path)], extra_cflags=["-O3"], is_python_module=False, verbose=False)
    return getattr(torch.ops, ns).q4mm


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ops = {name: build(name, spec, Path(tmp)) for name, spec in VARIANTS.items()}
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randint(0, 256, (n * k // 2,), dtype=torch.uint8, generator=g),
                torch.randn(n * k // 16, generator=g).half(), n, k) for k, n in SHAPES]
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}

    def sweep(op, m: int) -> float:
        t = time.perf_counter()
        for wp, sl, n, k in weights:
            op(xs[m][k], wp, sl, n, 1)
        return (time.perf_counter() - t) * 1e3

    res = {(v, m): [] for v in ops for m in rows}
    for r in range(args.rounds):
        for v in (list(ops) if r % 2 == 0 else list(ops)[::-1]):
            for m in rows:
                sweep(ops[v], m)
                res[(v, m)].append(min(sweep(ops[v], m) for _ in range(3)))
    for m in rows:
        print(f"rows {m}: ms a sweep  " + "  ".join(f"{v} {statistics.median(res[(v, m)]):.2f}" for v in ops))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
