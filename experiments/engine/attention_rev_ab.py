"""Is our decoding attention kernel (`dart_lab/csrc/attention.cpp`) faster than it was at another git revision,
and than torch's SDPA, per (rows, nodes a row)? The kernel's source at `--rev` is built under its own op
namespace beside the working tree's; 30 layers' caches of the embedded target's geometry (9 query heads, 3 key
heads, head size 64), each read from memory as in a step, 256 cached keys; the three alternate, best of 7 rounds.

    python experiments/engine/attention_rev_ab.py --rev HEAD~1 [--rows 1,8] [--nodes 1,2,4,5,8,16]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from dart_lab import attention  # noqa: E402


def build_at(rev: str):
    src = subprocess.run(["git", "show", f"{rev}:dart_lab/csrc/attention.cpp"], cwd=ROOT, check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("TORCH_LIBRARY_FRAGMENT(dart_lab", "TORCH_LIBRARY_FRAGMENT(attn_rev") \
             .replace("TORCH_LIBRARY_IMPL(dart_lab", "TORCH_LIBRARY_IMPL(attn_rev")
    folder = Path(tempfile.mkdtemp())
    (folder / "attn_rev.cpp").write_text(src)
    load(name="attn_rev", sources=[str(folder / "attn_rev.cpp")], extra_cflags=["-O3", "-fopenmp"],
         extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return torch.ops.attn_rev.decode_attn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--nodes", default="1,2,4,5,8,16")
    args = ap.parse_args(argv)
    if not attention.available():
        print(f"our attention kernel is not built here: {attention.reason()}")
        return 1
    old, new = build_at(args.rev), torch.ops.dart_lab.decode_attn
    g = torch.Generator().manual_seed(0)
    L, Hk, H, D, nk = 30, 3, 9, 64, 256
    for B in (int(b) for b in args.rows.split(",")):
        caches = [(torch.randn(B, Hk, 2 * nk, D, generator=g), torch.randn(B, Hk, 2 * nk, D, generator=g)) for _ in range(L)]
        for n in (int(x) for x in args.nodes.split(",")):
            q = torch.randn(B, H, n, D, generator=g)
            mask = torch.zeros(1, 1, n, nk)
            mask[..., nk - n:] = torch.zeros(n, n).masked_fill_(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
            fs = {args.rev: lambda: [old(q, K[:, :, :nk], V[:, :, :nk], mask, 0.125) for K, V in caches],
                  "now": lambda: [new(q, K[:, :, :nk], V[:, :, :nk], mask, 0.125) for K, V in caches],
                  "sdpa": lambda: [attention._sdpa(q, K, V, mask, nk, 0.125) for K, V in caches]}
            t = {k: [] for k in fs}
            for _ in range(8):
                for k, f in fs.items():
                    t0 = time.perf_counter()
                    f()
                    t[k].append((time.perf_counter() - t0) * 1e3)
            print(f"{B} rows x {n} nodes, 30 layers: ms  " + "  ".join(f"{k} {min(v[1:]):.3f}" for k, v in t.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
