"""Our 4-bit kernel with x rounded to int8 per group of 32 inputs (VPDPBUSD, AVX512-VNNI) against x rounded to
bf16 (VDPBF16PS, the kernel as it is): a variant of `dart_lab/csrc/q4mm.cpp` built beside it (its own op namespace;
`x8=1` in its `q4mm_x8` switches the variant's path on), timed on one sweep over the embedded target's 120 decoder
linear shapes per row count (alternating, median of each round's fastest of 3), and each side's error against
x W^T in fp32 on random linears whose input has a few large channels (as a normed hidden state does).

    python experiments/engine/q4_x8_ab.py [--rows 1,2,4,8,16]

Int8 x is the rounding of a GGUF Q8 block (d = max|x| / 127): the 4-bit values need no table lookup (a byte's two
nibbles spread into two bytes) and one instruction multiplies 64 pairs instead of 32, but each group's int32 sum
is converted and scaled apart for each row.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_ab import alternate, build_ops, q4_sweep, q4_weights, source  # noqa: E402

KERNEL = r"""
// ---- int8 x (AVX512-VNNI): x rounded to int8 per group of 32 inputs (d = max|x| / 127, q = round(x / d), the
// rounding of a GGUF Q8 block) instead of to bf16. The 4-bit values then need no lookup: a quad's two nibbles a
// byte are spread into two bytes (shift, or, mask) and VPDPBUSD multiplies 4 inputs x 16 outputs an instruction,
// twice VDPBF16PS's products, summed exactly in int32. Each group: scale * d * sum q qx + low * d * sum qx.
// A quad's bytes come out in input order 4t, 4t + 2, 4t + 1, 4t + 3 for each output: x is rounded into that order.
__attribute__((always_inline, target("avx512f,avx512bw")))
inline __m512i spread_quad(const uint8_t* quad) {
  const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)quad));
  // (w << 4 | w) & 0x0f0f: a byte's low nibble stays in the word's low byte, its high one moves to the high byte
  return _mm512_ternarylogic_epi32(_mm512_slli_epi16(w16, 4), w16, _mm512_set1_epi16(0x0f0f), 0xa8);
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
void q4_block_x8(const uint32_t* xq, const float* xd, const float* xs, const uint8_t* wp, const uint16_t* sl,
                 float* y, int64_t K, int64_t N, int64_t b) {
  const int64_t G = K / 32, Q = K / 4;
  __m512 out[M];
  for (int r = 0; r < M; ++r) out[r] = _mm512_setzero_ps();
  const uint8_t* wb = wp + b * Q * 32;
  for (int64_t g = 0; g < G; ++g) {
    __m512i even[M], odd[M];  // two accumulators a row: two independent chains
    for (int r = 0; r < M; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    for (int t = 0; t < 8; t += 2) {
      const int64_t quad = g * 8 + t;
      _mm_prefetch((const char*)(wb + (quad + 32) * 32), _MM_HINT_T0);
      const __m512i w0 = spread_quad(wb + quad * 32), w1 = spread_quad(wb + (quad + 1) * 32);
      for (int r = 0; r < M; ++r) {
        even[r] = _mm512_dpbusd_epi32(even[r], w0, _mm512_set1_epi32((int)xq[r * Q + quad]));
        odd[r] = _mm512_dpbusd_epi32(odd[r], w1, _mm512_set1_epi32((int)xq[r * Q + quad + 1]));
      }
    }
    const uint16_t* s = sl + ((b * G + g) * 2) * 16;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 16)));
    for (int r = 0; r < M; ++r) {
      const __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
      out[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scale, _mm512_set1_ps(xd[r * G + g])), out[r]);
      out[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + g]), out[r]);
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * N + b * 16, out[r]);
}

template <int M>
void q4_rows_x8(const uint32_t* xq, const float* xd, const float* xs, const uint8_t* wp, const uint16_t* sl,
                float* y, int64_t K, int64_t N) {
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) q4_block_x8<M>(xq, xd, xs, wp, sl, y, K, N, b);
  });
}

using RowsX8Fn = void (*)(const uint32_t*, const float*, const float*, const uint8_t*, const uint16_t*, float*,
                          int64_t, int64_t);
constexpr RowsX8Fn kRowsX8[kMaxRows] = {q4_rows_x8<1>, q4_rows_x8<2>, q4_rows_x8<3>, q4_rows_x8<4>,
                                        q4_rows_x8<5>, q4_rows_x8<6>, q4_rows_x8<7>, q4_rows_x8<8>};

// x's rows (all M, or rows ri[0..M)) fp32 -> int8 per group of 32 (M, K) in the quads' input order, each
// group's d (M, K/32) and d * the sum of its int8 values (M, K/32)
__attribute__((target("avx512f,avx512bw,avx512vl")))
void round_rows_x8(const float* x, const int64_t* ri, int64_t M, int64_t K, int8_t* xq, float* xd, float* xs) {
  // within each 4 bytes: inputs 0, 2, 1, 3
  const __m128i order = _mm_setr_epi8(0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15);
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* src = x + (ri ? ri[r] : r) * K + g * 32;
      const __m512 a = _mm512_loadu_ps(src), c = _mm512_loadu_ps(src + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(c)));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      // round to nearest even (MXCSR's default), as GGUF's quantizer rounds half away (a tie is rare; either
      // way the int8 values are what the sums below read)
      const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(id)));
      const __m512i qc = _mm512_cvtps_epi32(_mm512_mul_ps(c, _mm512_set1_ps(id)));
      _mm_storeu_si128((__m128i*)(xq + r * K + g * 32), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qa), order));
      _mm_storeu_si128((__m128i*)(xq + r * K + g * 32 + 16), _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(qc), order));
      xd[r * (K / 32) + g] = d;
      xs[r * (K / 32) + g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qc));
    }
  }
}

bool vnni_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((c >> 11) & 1) && ((b >> 30) & 1) && ((b >> 16) & 1);
  }();
  return ok;
}

int64_t x8_mode = 0;

int64_t q4mm_x8(int64_t on) {
  if (!vnni_usable()) return -1;
  const int64_t previous = x8_mode;
  if (on >= 0) x8_mode = on;
  return previous;
}

"""

DISPATCH = r"""  if (x8_mode && vnni_usable()) {
    std::vector<int8_t> xq(Mc * K);
    std::vector<float> xd(Mc * K / 32);
    round_rows_x8(xsrc, rsrc, Mc, Kx, xq.data(), xd.data(), xs.data());
    spread_halves(xq.data(), Mc, Kx, halves);
    spread_halves(xd.data(), Mc, Kx / 32, halves);
    spread_halves(xs.data(), Mc, Kx / 32, halves);
    const uint32_t* xq4 = reinterpret_cast<const uint32_t*>(xq.data());
    for (int64_t r = 0; r < Mc; r += kMaxRows) {
      const int64_t m = std::min<int64_t>(kMaxRows, Mc - r);
      kRowsX8[m - 1](xq4 + r * (K / 4), xd.data() + r * (K / 32), xs.data() + r * (K / 32), w, s, yp + r * n, K, n);
    }
  } else """

AMX = "// ---- AMX (Intel's tile unit)"
AVX2 = "  if (avx2_forced || !bf16_dot_usable()) {"
DEF = '  m.def("q4mm_avx2(int on) -> int", &q4mm_avx2);'


def variant():
    src = source("q4mm")
    assert AMX in src and AVX2 in src and DEF in src, "the kernel changed: update this experiment"
    src = src.replace(AMX, KERNEL + AMX, 1).replace(AVX2, DISPATCH + AVX2.lstrip(), 1)
    src = src.replace(DEF, DEF + '\n  m.def("q4mm_x8(int on) -> int", &q4mm_x8);', 1)
    return build_ops(src, "q4x8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    ops = variant()
    if ops.q4mm_x8(-1) < 0:
        print("no AVX512-VNNI here")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)

    def side(x8: int):
        def sweep(m):
            ops.q4mm_x8(x8)
            return q4_sweep(ops.q4mm, xs[m], weights)
        return sweep

    # error: random 4-bit groups (q, fp16 scale and low) of the real shapes, x with 3 channels 20x the others,
    # against x W^T in float64
    from dart_lab import q4
    errs = {0: 0.0, 1: 0.0}
    for k, n in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
        scale = (torch.rand(n, k // 32, 1, generator=g) * 0.01 + 1e-3).half().float()
        low = (-8 * scale).half().float()
        wp, sl = q4.pack(q, scale, low)
        dense = (q.double().reshape(n, k // 32, 32) * scale.double() + low.double()).reshape(n, k)
        x = torch.randn(4, k, generator=g)
        x[:, :3] *= 20
        ref = x.double() @ dense.T
        for x8 in errs:
            ops.q4mm_x8(x8)
            y = ops.q4mm(x, wp, sl, n, 1).double()
            errs[x8] = max(errs[x8], float((y - ref).abs().max() / ref.abs().max()))
    ops.q4mm_x8(0)
    print(f"max |y - x W^T| / max |x W^T|: bf16 x {errs[0]:.2e}, int8 x {errs[1]:.2e}")
    weights = q4_weights(g)
    xs = {m: {k: torch.randn(m, k, generator=g) for k in (576, 1536)} for m in rows}
    ms = alternate({"bf16 x": side(0), "int8 x": side(1)}, rows, args.rounds)
    ops.q4mm_x8(0)
    print("| rows | bf16 x ms | int8 x ms | ratio |\n|---|---|---|---|")
    for m in rows:
        a, b = ms[("bf16 x", m)], ms[("int8 x", m)]
        print(f"| {m} | {a:.3f} | {b:.3f} | {a / b:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
