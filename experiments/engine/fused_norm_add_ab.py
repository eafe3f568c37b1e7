"""Does a decoder layer's RMSNorm and residual add cost less inside our 4-bit kernel (`dart_lab::q4mm`'s `norm` and
`residual` arguments, as `dart_lab::q4_layers` calls it) than as ops of their own around it (`dart_lab::rms_norm`,
`torch.add`)? 30 layers' four linears (random 4-bit groups of the embedded target's shapes), two norms and two adds
a layer, either way; the two alternate over 9 rounds, median of each round's fastest of 3. The numbers are the same
either way (tests: `test_q4_kernel_is_the_4bit_grid_to_fp32_rounding`, `test_layers_in_one_op_are_the_eager_loop`).

    python experiments/engine/fused_norm_add_ab.py [--rows 1,8]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dart_lab import kernels, q4  # noqa: E402
from kernel_ab import alternate, q4_weights, wall_ms  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8")
    args = ap.parse_args(argv)
    if not (q4.available() and kernels.rms_norm_here()):
        print("our 4-bit kernel or norm is not built here")
        return 1
    g = torch.Generator().manual_seed(0)
    weights = q4_weights(g)  # per layer: q|k|v, o, gate|up, down
    nw = torch.rand(576, generator=g) + 0.5
    op, norm = torch.ops.dart_lab.q4mm, torch.ops.dart_lab.rms_norm

    def layers(fused: bool, M: int):
        x, heads, act = (torch.randn(M, k, generator=g) for k in (576, 576, 1536))

        def run():
            h = x
            for i in range(0, len(weights), 4):
                (wq, sq, nq, _), (wo, so, no, _), (wg, sg, ng, _), (wd, sd, nd, _) = weights[i:i + 4]
                if fused:
                    op(h, wq, sq, nq, 1, None, nw, 1e-5)
                    h = op(heads, wo, so, no, 1, None, None, 0.0, h)
                    op(h, wg, sg, ng, 1, None, nw, 1e-5)
                    h = op(act, wd, sd, nd, 1, None, None, 0.0, h)
                else:
                    op(norm(h, nw, 1e-5), wq, sq, nq, 1)
                    h = torch.add(h, op(heads, wo, so, no, 1))
                    op(norm(h, nw, 1e-5), wg, sg, ng, 1)
                    h = torch.add(h, op(act, wd, sd, nd, 1))
        return lambda: wall_ms(run)

    rows = [int(r) for r in args.rows.split(",")]
    runs = {(f, M): layers(f, M) for f in (False, True) for M in rows}
    ms = alternate({name: (lambda f: lambda M: runs[(f, M)]())(f) for name, f in (("ops", False), ("inside", True))},
                   rows, 9)
    for M in rows:
        print(f"{M} rows: ms for 30 layers' linears, norms and adds  ops {ms[('ops', M)]:.3f}  inside {ms[('inside', M)]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
