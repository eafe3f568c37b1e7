"""A prompt's small ops against another git revision, and what holding a sweep's outputs costs.

1. `dart_lab::silu_mul_bf16` and `dart_lab::rms_norm` (csrc/norm.cpp) at a packed prefill's shapes (150 and
   1,158 rows; 30 layers' inputs, each read from memory) against the same ops built from `--rev` under their own
   namespace; outputs compared bit for bit first.
2. Our 4-bit kernel's 120 decoder linears at 1 / 8 / 16 rows as one sweep, each output dropped before the next
   call (as a step does) against all held until the sweep ends (as path tables were once timed).

Both alternate over 7 rounds (median of each round's fastest of 3).

    python experiments/engine/prompt_ops_ab.py --rev <before>
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import kernels, q4  # noqa: E402
from kernel_ab import alternate, ops_at, q4_sweep, q4_weights, wall_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True)
    args = ap.parse_args(argv)
    if not kernels.rms_norm_here():
        print("our norm ops are not built here")
        return 1
    rev, now = ops_at("norm", args.rev), torch.ops.dart_lab
    g = torch.Generator().manual_seed(0)
    w = torch.randn(576, generator=g)
    for rows in (150, 1158):
        gu = [(torch.randn(rows, 3072, generator=g) * 3).to(torch.bfloat16) for _ in range(30)]
        xs = [torch.randn(rows, 576, generator=g) for _ in range(30)]
        assert all(torch.equal(rev.silu_mul_bf16(x), now.silu_mul_bf16(x)) for x in gu[:3])
        assert all(torch.equal(rev.rms_norm(x, w, 1e-5), now.rms_norm(x, w, 1e-5)) for x in xs[:3])
        timers = {}
        for name, ops in ((args.rev, rev), ("now", now)):
            timers[f"silu_mul_bf16 {name}"] = (lambda ops: lambda _: wall_ms(lambda: [ops.silu_mul_bf16(x) for x in gu]))(ops)
            timers[f"rms_norm {name}"] = (lambda ops: lambda _: wall_ms(lambda: [ops.rms_norm(x, w, 1e-5) for x in xs]))(ops)
        ms = alternate(timers, [rows], 7)
        print(f"{rows} rows, 30 layers: " + "; ".join(f"{k} {v:.2f} ms" for (k, _), v in ms.items()), flush=True)
    if not q4.available():
        return 0
    weights = q4_weights(g)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in (1, 8, 16)}
    op = torch.ops.dart_lab.q4mm
    held = lambda m: wall_ms(lambda: [op(xs[m][k], wp, sl, n, 1) for wp, sl, n, k in weights])  # noqa: E731
    ms = alternate({"held": held, "dropped": lambda m: q4_sweep(op, xs[m], weights)}, [1, 8, 16], 7)
    for m in (1, 8, 16):
        print(f"4-bit kernel, 120 linears, {m} rows: outputs held {ms[('held', m)]:.2f} ms, dropped "
              f"{ms[('dropped', m)]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
