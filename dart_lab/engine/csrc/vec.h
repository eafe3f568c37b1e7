// 16 fp32 lanes, for the eager-step kernels written once and built for two instruction sets: namespace `avx512`
// (one __m512) and namespace `avx2` (two __m256: CPUs with AVX2 + FMA + F16C and no AVX-512, most laptops'). A
// kernel's arithmetic lives in a body header included once inside each namespace, between `#pragma GCC target`
// lines (DART_LAB_ISA_BEGIN / END below), and its op picks the build at run time (`avx512_here`). Lane i of a
// vector holds element i of 16 either way, so per-lane arithmetic gives the same numbers in both builds, and
// `reduce_add` pairs lanes alike; `sum4` (attention's dot products) adds them in another order on AVX2, and the
// Sleef exp a silu calls is torch's own for each ISA.
//
// DART_LAB_ISA=avx2 in the environment runs the AVX2 builds on a CPU that has AVX-512 (tests, A/B timings;
// dart_lab/kernels.py reads the same variable).
#pragma once
#include <immintrin.h>
#include <cpuid.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// whether the AVX-512 builds run here: the CPU has AVX-512 F and DART_LAB_ISA does not ask for AVX2
inline bool avx512_here() {
  static const bool ok = [] {
    const char* isa = std::getenv("DART_LAB_ISA");
    if (isa && std::strcmp(isa, "avx2") == 0) return false;
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 16) & 1);
  }();
  return ok;
}

#define DART_LAB_PRAGMA(x) _Pragma(#x)
// inside the unnamed namespace, as vec.h's own: each kernel's library keeps its builds to itself
#define DART_LAB_ISA_BEGIN(ns, isa) \
  DART_LAB_PRAGMA(GCC push_options) DART_LAB_PRAGMA(GCC target(isa)) namespace { namespace ns {
#define DART_LAB_ISA_END } } DART_LAB_PRAGMA(GCC pop_options)

extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's Vectorized<float>::exp, AVX-512 (libtorch_cpu exports it)
extern "C" __m256 Sleef_expf8_u10(__m256);   // the same, AVX2

#define DART_LAB_V512 __attribute__((always_inline, target("avx512f"))) inline
#define DART_LAB_V256 __attribute__((always_inline, target("avx2,fma,f16c"))) inline

namespace {
namespace avx512 {

using Vf = __m512;
constexpr int kNative = 16;  // lanes of the ISA's own vector (torch's Vectorized<float>::size())

DART_LAB_V512 Vf zero() { return _mm512_setzero_ps(); }
DART_LAB_V512 Vf set1(float x) { return _mm512_set1_ps(x); }
DART_LAB_V512 Vf load(const float* p) { return _mm512_loadu_ps(p); }
DART_LAB_V512 void store(float* p, Vf v) { _mm512_storeu_ps(p, v); }
// the first n (< 16) lanes: loaded (the rest 0) / stored
DART_LAB_V512 Vf load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
DART_LAB_V512 void store_first(float* p, Vf v, int64_t n) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
// lanes >= n (n < 16) set to 0
DART_LAB_V512 Vf keep_first(Vf v, int64_t n) { return _mm512_maskz_mov_ps((__mmask16)((1u << n) - 1), v); }
// lanes 0..15 as numbers
DART_LAB_V512 Vf iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
using Vm = __mmask16;  // a lane mask
DART_LAB_V512 Vm gt(Vf a, Vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }  // a > b, false for NaN
DART_LAB_V512 Vf select(Vm m, Vf yes, Vf no) { return _mm512_mask_blend_ps(m, no, yes); }
DART_LAB_V512 Vf add(Vf a, Vf b) { return _mm512_add_ps(a, b); }
DART_LAB_V512 Vf sub(Vf a, Vf b) { return _mm512_sub_ps(a, b); }
DART_LAB_V512 Vf mul(Vf a, Vf b) { return _mm512_mul_ps(a, b); }
DART_LAB_V512 Vf div(Vf a, Vf b) { return _mm512_div_ps(a, b); }
DART_LAB_V512 Vf max(Vf a, Vf b) { return _mm512_max_ps(a, b); }
DART_LAB_V512 Vf fmadd(Vf a, Vf b, Vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c, one rounding
DART_LAB_V512 Vf fnmadd(Vf a, Vf b, Vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b, one rounding
DART_LAB_V512 Vf neg(Vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN))); }
DART_LAB_V512 float reduce_add(Vf a) { return _mm512_reduce_add_ps(a); }
DART_LAB_V512 Vf exp_sleef(Vf a) { return Sleef_expf16_u10(a); }
// round to the nearest integer (ties to even) / times 2^n for integral n
DART_LAB_V512 Vf round_even(Vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
DART_LAB_V512 Vf scale2(Vf p, Vf n) { return _mm512_scalef_ps(p, n); }
// lanes where a >= b kept, the others 0
DART_LAB_V512 Vf keep_ge(Vf v, Vf a, Vf b) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, b, _CMP_GE_OQ), v); }
// bit i: lane i of a (of the first n) is not -inf
DART_LAB_V512 unsigned live_lanes(const float* p, int64_t n) {
  const __mmask16 in = (__mmask16)(n >= 16 ? 0xffff : (1u << n) - 1);
  return _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, p), _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
}
// 16 bf16 (an fp32's upper half) widened exactly / fp32 rounded to nearest even as torch's cast rounds (NaN 0xffff)
DART_LAB_V512 Vf load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
DART_LAB_V512 void store_bf16(uint16_t* p, Vf v) {
  const __m512i b = _mm512_castps_si512(v);
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                                _mm512_set1_epi32(0x7fff)), b);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), _mm512_srli_epi32(r, 16));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtusepi32_epi16(r));
}
// the sums of a, b, c and d's 16 lanes each, as one 4-lane vector
DART_LAB_V512 __m128 sum4(Vf a, Vf b, Vf c, Vf d) {
  // 128-bit quarters: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd alike; then [a, b, c, d] one quarter each
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));  // within each quarter: [x0+x2, x1+x3, ...]
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));  // element 0 of each quarter: its 4 lanes' sum
  const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, t));
}


// attention's scores 4 keys x 4 query rows at a time (csrc/attention_isa.h): Keys4 holds them in rows' order, lane
// 4 i + u = row i, key u, from each key's 4 rows (key_dots' sums); the rows' masks added, a running max per lane
using Keys4 = __m512;
DART_LAB_V512 Keys4 keys4(__m128 k0, __m128 k1, __m128 k2, __m128 k3) {
  __m512 z = _mm512_insertf32x4(_mm512_castps128_ps512(k0), k1, 1);
  z = _mm512_insertf32x4(_mm512_insertf32x4(z, k2, 2), k3, 3);
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), z);
}
DART_LAB_V512 Keys4 keys4_neg_inf() { return _mm512_set1_ps(-INFINITY); }
DART_LAB_V512 Keys4 keys4_add(Keys4 z, const float* m0, const float* m1, const float* m2, const float* m3) {
  __m512 m = _mm512_insertf32x4(_mm512_castps128_ps512(_mm_loadu_ps(m0)), _mm_loadu_ps(m1), 1);
  return _mm512_add_ps(z, _mm512_insertf32x4(_mm512_insertf32x4(m, _mm_loadu_ps(m2), 2), _mm_loadu_ps(m3), 3));
}
DART_LAB_V512 Keys4 keys4_max(Keys4 a, Keys4 b) { return _mm512_max_ps(a, b); }
DART_LAB_V512 __m128 keys4_row(Keys4 z, int i) {  // row i's 4 lanes
  switch (i) {
    case 0: return _mm512_castps512_ps128(z);
    case 1: return _mm512_extractf32x4_ps(z, 1);
    case 2: return _mm512_extractf32x4_ps(z, 2);
    default: return _mm512_extractf32x4_ps(z, 3);
  }
}

}  // namespace avx512
}  // namespace

namespace {
namespace avx2 {

struct Vf {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
constexpr int kNative = 8;

DART_LAB_V256 Vf zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
DART_LAB_V256 Vf set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
DART_LAB_V256 Vf load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
DART_LAB_V256 void store(float* p, Vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
DART_LAB_V256 __m256i first_mask(int64_t n) {  // lanes < n of 8 set (n may be <= 0 or >= 8)
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::max<int64_t>(0, std::min<int64_t>(n, 8))),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
DART_LAB_V256 Vf load_first(const float* p, int64_t n) {
  return {_mm256_maskload_ps(p, first_mask(n)), _mm256_maskload_ps(p + 8, first_mask(n - 8))};
}
DART_LAB_V256 void store_first(float* p, Vf v, int64_t n) {
  _mm256_maskstore_ps(p, first_mask(n), v.lo);
  _mm256_maskstore_ps(p + 8, first_mask(n - 8), v.hi);
}
DART_LAB_V256 Vf keep_first(Vf v, int64_t n) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(first_mask(n))), _mm256_and_ps(v.hi, _mm256_castsi256_ps(first_mask(n - 8)))};
}
DART_LAB_V256 Vf iota() { return {_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15)}; }
using Vm = Vf;  // all-ones lanes where true
DART_LAB_V256 Vm gt(Vf a, Vf b) { return {_mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ), _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ)}; }
DART_LAB_V256 Vf select(Vm m, Vf yes, Vf no) { return {_mm256_blendv_ps(no.lo, yes.lo, m.lo), _mm256_blendv_ps(no.hi, yes.hi, m.hi)}; }
DART_LAB_V256 Vf add(Vf a, Vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
DART_LAB_V256 Vf sub(Vf a, Vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
DART_LAB_V256 Vf mul(Vf a, Vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
DART_LAB_V256 Vf div(Vf a, Vf b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
DART_LAB_V256 Vf max(Vf a, Vf b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
DART_LAB_V256 Vf fmadd(Vf a, Vf b, Vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
DART_LAB_V256 Vf fnmadd(Vf a, Vf b, Vf c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
DART_LAB_V256 Vf neg(Vf a) {
  const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  return {_mm256_xor_ps(a.lo, s), _mm256_xor_ps(a.hi, s)};
}
// as _mm512_reduce_add_ps pairs the lanes: halves, then quarters, then pairs
DART_LAB_V256 float reduce_add(Vf a) {
  const __m256 h = _mm256_add_ps(a.lo, a.hi);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
DART_LAB_V256 Vf exp_sleef(Vf a) { return {Sleef_expf8_u10(a.lo), Sleef_expf8_u10(a.hi)}; }
DART_LAB_V256 Vf round_even(Vf a) {
  return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
          _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
// p 2^n for integral n in [-126, 127] (2^n a normal number, built in its exponent field): the product rounds as
// VSCALEFPS's does
DART_LAB_V256 __m256 pow2(__m256 n) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
}
DART_LAB_V256 Vf scale2(Vf p, Vf n) { return {_mm256_mul_ps(p.lo, pow2(n.lo)), _mm256_mul_ps(p.hi, pow2(n.hi))}; }
DART_LAB_V256 Vf keep_ge(Vf v, Vf a, Vf b) {
  return {_mm256_and_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ), v.lo), _mm256_and_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ), v.hi)};
}
DART_LAB_V256 unsigned live_lanes(const float* p, int64_t n) {
  const Vf v = load_first(p, n);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  const unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v.lo, ninf, _CMP_NEQ_UQ)) |
                        ((unsigned)_mm256_movemask_ps(_mm256_cmp_ps(v.hi, ninf, _CMP_NEQ_UQ)) << 8);
  return bits & (n >= 16 ? 0xffffu : (1u << n) - 1);
}
DART_LAB_V256 __m256 widen8(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
DART_LAB_V256 Vf load_bf16(const uint16_t* p) {
  return {widen8(_mm_loadu_si128((const __m128i*)p)), widen8(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
DART_LAB_V256 __m128i round8(__m256 v) {  // 8 fp32 -> bf16, as avx512::store_bf16
  const __m256i b = _mm256_castps_si256(v);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16),
                                _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7fff)), b), 16);
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0xffff), r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));  // each value < 2^16: exact
}
DART_LAB_V256 void store_bf16(uint16_t* p, Vf v) {
  _mm_storeu_si128((__m128i*)p, round8(v.lo));
  _mm_storeu_si128((__m128i*)(p + 8), round8(v.hi));
}
DART_LAB_V256 __m128 sum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {  // [sum a, sum b, sum c, sum d]
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);  // [a01 a23 b01 b23 | a45 a67 b45 b67], cd alike
  const __m256 t = _mm256_hadd_ps(ab, cd);                            // [a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7]
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}
DART_LAB_V256 __m128 sum4(Vf a, Vf b, Vf c, Vf d) {
  return sum8x4(_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi), _mm256_add_ps(c.lo, c.hi), _mm256_add_ps(d.lo, d.hi));
}


// attention's 4 x 4 scores (as avx512's Keys4): row i's 4 keys in r[i]
struct Keys4 {
  __m128 r[4];
};
DART_LAB_V256 Keys4 keys4(__m128 k0, __m128 k1, __m128 k2, __m128 k3) {
  _MM_TRANSPOSE4_PS(k0, k1, k2, k3);
  return {{k0, k1, k2, k3}};
}
DART_LAB_V256 Keys4 keys4_neg_inf() {
  const __m128 n = _mm_set1_ps(-INFINITY);
  return {{n, n, n, n}};
}
DART_LAB_V256 Keys4 keys4_add(Keys4 z, const float* m0, const float* m1, const float* m2, const float* m3) {
  return {{_mm_add_ps(z.r[0], _mm_loadu_ps(m0)), _mm_add_ps(z.r[1], _mm_loadu_ps(m1)),
           _mm_add_ps(z.r[2], _mm_loadu_ps(m2)), _mm_add_ps(z.r[3], _mm_loadu_ps(m3))}};
}
DART_LAB_V256 Keys4 keys4_max(Keys4 a, Keys4 b) {
  return {{_mm_max_ps(a.r[0], b.r[0]), _mm_max_ps(a.r[1], b.r[1]), _mm_max_ps(a.r[2], b.r[2]), _mm_max_ps(a.r[3], b.r[3])}};
}
DART_LAB_V256 __m128 keys4_row(Keys4 z, int i) { return z.r[i]; }

}  // namespace avx2
}  // namespace
