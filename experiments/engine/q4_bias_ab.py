"""Whether our 4-bit kernel's AVX-512 path should look its 4-bit values up as bf16 0..15 (two VPERMW a quad)
or read them as bf16 128 + q (the value OR'd into the mantissa of 128.0: exact, no lookup), the 128 taken out
once a group with the input sums it already keeps (low' = low - 128 scale): variants of
`dart_lab/csrc/q4mm.cpp` built side by side and timed on one sweep over the embedded target's 120 decoder linear
shapes (random 4-bit weights), alternating rounds, median of each round's fastest of 3; and each variant's
largest difference from the reference product at every row count.

    python experiments/engine/q4_bias_ab.py [--rows 1,2,4,8] [--rounds 9]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_ops, q4_sweep, q4_weights, source  # noqa: E402

CALL = "      lookup_quad(wb + quad * 32, wl, wh);\n      for (int r = 0; r < M; ++r) {"
LOW = "    __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 16)));\n    for (int r = 0; r < M; ++r) {"
BIASED = """
__attribute__((always_inline, target("avx512f,avx512bw")))
inline void lookup_quad_biased(const uint8_t* quad, __m512i& wl, __m512i& wh) {
  const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)quad));
  const __m512i one28 = _mm512_set1_epi16(0x4300);
  wl = _mm512_ternarylogic_epi32(w16, _mm512_set1_epi16(0x0f), one28, 0xEA);  // (w & 15) | 128.0
  wh = _mm512_or_si512(_mm512_srli_epi16(w16, 4), one28);
}
"""


def variant_source(kind: str) -> str:
    src = source("q4mm")
    if kind == "lut":
        return src
    assert CALL in src and LOW in src, "the kernel's AVX-512 block changed: update this experiment"
    src = src.replace("template <int M>\n__attribute__((target(\"avx512f,avx512bw,avx512bf16,f16c\")))",
                      BIASED + "\ntemplate <int M>\n__attribute__((target(\"avx512f,avx512bw,avx512bf16,f16c\")))", 1)
    src = src.replace(CALL, CALL.replace("lookup_quad(", "lookup_quad_biased("))
    return src.replace(LOW, LOW.replace("));\n", "));\n    low = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale, low);\n", 1))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")]
    ops = {k: build_ops(variant_source(k), "v_" + k).q4mm for k in ("lut", "bias128")}
    g = torch.Generator().manual_seed(0)
    # accuracy: a real-looking Q4_1 matrix against the product of bf16(x) with its dequantised values in fp64
    from dart_lab.q4 import pack
    N, K = 576, 1536
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = (torch.rand(N, K // 32, 1, generator=g) * 0.02).half().float()
    low = (-8 * scale + torch.randn(N, K // 32, 1, generator=g) * 0.01).half().float()
    wp, sl = pack(q, scale, low)
    w = (q.reshape(N, K // 32, 32) * scale + low).reshape(N, K).double()
    for m in rows:
        x = torch.randn(m, K, generator=g)
        ref = x.bfloat16().double() @ w.T
        print(f"rows {m}: max |y - ref| / max |ref|  " + "  ".join(
            f"{k} {float((op(x, wp, sl, N, 1).double() - ref).abs().max() / ref.abs().max()):.2e}"
            for k, op in ops.items()))
    weights = q4_weights(g)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    ms = alternate({v: (lambda op: lambda m: q4_sweep(op, xs[m], weights))(op) for v, op in ops.items()}, rows,
                   args.rounds)
    for m in rows:
        print(f"rows {m}: ms a sweep  " + "  ".join(f"{v} {ms[(v, m)]:.2f}" for v in ops)
              + f"  ratio {ms[('lut', m)] / ms[('bias128', m)]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
