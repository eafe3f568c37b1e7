// dart_lab::q4mm -- y = x W^T for W held as 4-bit groups (w = q * scale + low per group of 32 inputs,
// the layout of a GGUF Q4_1 block), on CPUs with AVX512-BF16, else with AVX2 + FMA (below). Built on first use
// (dart_lab/q4.py).
//
// Why it is faster than torch's int4 CPU kernel: that kernel turns every weight into a float and applies
// its group's scale and zero before multiplying (two FMAs a weight, the unpacking repeated for every 4
// rows of x). Here the 4-bit values are looked up as bf16 numbers 0..15 (exact) and multiplied by x
// rounded to bf16 with VDPBF16PS, 32 products an instruction, each row's group sums kept apart; the scale
// and the low value are applied once per group: sum_k w_k x_k = scale * sum_k q_k x_k + low * sum_k x_k.
// Products and sums are in fp32, so the result is (bf16(x)) W^T to fp32 rounding.
//
// Layouts (dart_lab/q4.py packs them):
//   wp (N/16, K/4, 32) uint8: block b holds outputs 16b..16b+15; byte j of quad t is output lane i = j/2,
//      low nibble q[i, 4t + j%2], high nibble q[i, 4t + 2 + j%2] -- one 32-byte load gives two input pairs
//      for 16 outputs, laid out as VDPBF16PS pairs them.
//   sl (N/16, K/32, 2, 16) fp16: each block's scale and low for each group (the GGUF stores both in fp16).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cpuid.h>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sys/syscall.h>
#include <unistd.h>
#include <vector>

#include "vec.h"

DART_LAB_ISA_BEGIN(avx512, "avx512f")
#include "rms_norm.h"
DART_LAB_ISA_END
DART_LAB_ISA_BEGIN(avx2, "avx2,fma,f16c")
#include "rms_norm.h"
DART_LAB_ISA_END

namespace {

constexpr int kMaxRows = 8;  // rows sharing one unpacking of the weights (accumulators: 2 per row)

// one 32-byte quad of a block -> its two input pairs' 4-bit values as bf16 numbers (wl: the low nibbles, wh:
// the high ones), in the pair layout VDPBF16PS and TDPBF16PS read
__attribute__((always_inline, target("avx512f,avx512bw")))
inline void lookup_quad(const uint8_t* quad, __m512i& wl, __m512i& wh) {
  // bf16 bit patterns of 0.0, 1.0, ..., 15.0 (a 4-bit value is its own index)
  const __m512i lut = _mm512_set_epi16(
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
      0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
  const __m512i w16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)quad));
  wl = _mm512_permutexvar_epi16(_mm512_and_si512(w16, _mm512_set1_epi16(0x0f)), lut);
  wh = _mm512_permutexvar_epi16(_mm512_srli_epi16(w16, 4), lut);
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c")))
void q4_block(const uint32_t* xp, const float* xs, const uint8_t* wp, const uint16_t* sl, float* y,
              int64_t K, int64_t N, int64_t b) {
  const int64_t G = K / 32, Q = K / 4, P = K / 2;
  __m512 out[M];
  for (int r = 0; r < M; ++r) out[r] = _mm512_setzero_ps();
  const uint8_t* wb = wp + b * Q * 32;
  for (int64_t g = 0; g < G; ++g) {
    __m512 lo[M], hi[M];  // two accumulators a row: two independent chains
    for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int t = 0; t < 8; ++t) {
      const int64_t quad = g * 8 + t;
      // 2 KB ahead: with several rows a block's arithmetic is long enough that the hardware prefetcher alone
      // leaves loads waiting, and one row's stream keeps more reads in flight than at 1 KB (a prefetch past the
      // end is harmless; docs/speed.md, what was tried)
      _mm_prefetch((const char*)(wb + (quad + 64) * 32), _MM_HINT_T0);
      __m512i wl, wh;
      lookup_quad(wb + quad * 32, wl, wh);
      for (int r = 0; r < M; ++r) {
        lo[r] = _mm512_dpbf16_ps(lo[r], (__m512bh)wl, (__m512bh)_mm512_set1_epi32((int)xp[r * P + 2 * quad]));
        hi[r] = _mm512_dpbf16_ps(hi[r], (__m512bh)wh, (__m512bh)_mm512_set1_epi32((int)xp[r * P + 2 * quad + 1]));
      }
    }
    const uint16_t* s = sl + ((b * G + g) * 2) * 16;
    __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
    __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 16)));
    for (int r = 0; r < M; ++r) {
      out[r] = _mm512_fmadd_ps(_mm512_add_ps(lo[r], hi[r]), scale, out[r]);
      out[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + g]), out[r]);
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * N + b * 16, out[r]);
}

template <int M>
void q4_rows(const uint32_t* xp, const float* xs, const uint8_t* wp, const uint16_t* sl, float* y,
             int64_t K, int64_t N) {
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) q4_block<M>(xp, xs, wp, sl, y, K, N, b);
  });
}

using RowsFn = void (*)(const uint32_t*, const float*, const uint8_t*, const uint16_t*, float*, int64_t, int64_t);
constexpr RowsFn kRows[kMaxRows] = {q4_rows<1>, q4_rows<2>, q4_rows<3>, q4_rows<4>,
                                    q4_rows<5>, q4_rows<6>, q4_rows<7>, q4_rows<8>};

// ---- AMX (Intel's tile unit): several rows at once. The AVX-512 path above spends two VDPBF16PS a row for
// every 4 inputs of 16 outputs, so its cost grows with the rows; one TDPBF16PS multiplies up to 16 rows by a group's 32 inputs for 16 outputs. Each group's 4-bit
// values are looked up as bf16 (as above) into a 1 KB tile in the pair layout TDPBF16PS reads (the layout
// VDPBF16PS reads too), the rows' bf16 inputs are loaded as they are, and each group's product is stored
// and scaled apart (scale * sum q x + low * sum x): the same products and fp32 sums as the AVX-512 path.

// compilers that know the AMX intrinsics (GCC 11, clang 12); with an older one the kernel builds without them
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define DART_LAB_AMX 1
#else
#define DART_LAB_AMX 0
#endif

bool amx_usable() {
  static const bool ok = [] {
    if (!DART_LAB_AMX) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!((d >> 22) & 1) || !((d >> 24) & 1)) return false;  // AMX-BF16, AMX-TILE
    // Linux hands out the tile registers' state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

int64_t amx_from_rows = 2;  // steps of at least this many rows take the AMX path (0: never): from 2 rows it
                            // measured faster than the AVX-512 path (docs/speed.md)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kAmxRows = 16;  // rows of one tile

#if DART_LAB_AMX
// one group's 4-bit values of block wb as bf16 into bt (16 input pairs x 16 outputs), the pair layout
__attribute__((always_inline, target("avx512f,avx512bw")))
inline void group_tile(const uint8_t* wb, int64_t g, uint16_t* bt) {
  for (int t = 0; t < 8; ++t) {
    const int64_t quad = g * 8 + t;
    _mm_prefetch((const char*)(wb + (quad + 32) * 32), _MM_HINT_T0);
    __m512i wl, wh;
    lookup_quad(wb + quad * 32, wl, wh);
    _mm512_store_si512(bt + (2 * t) * 32, wl);
    _mm512_store_si512(bt + (2 * t + 1) * 32, wh);
  }
}

// groups g and g + 1 (those < G) of block b: their products c (two tiles' stores, one after the other) scaled
// into each row's sums, each group apart, in order: scale * sum q x + low * sum x
__attribute__((always_inline, target("avx512f,f16c")))
inline void scale_pair(__m512* out, const float* c, const uint16_t* sl, const float* xs, int64_t M, int64_t G,
                       int64_t b, int64_t g) {
  for (int64_t h = g; h < std::min<int64_t>(g + 2, G); ++h, c += kAmxRows * 16) {
    const uint16_t* s = sl + ((b * G + h) * 2) * 16;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
    const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 16)));
    for (int r = 0; r < M; ++r) {
      out[r] = _mm512_fmadd_ps(_mm512_load_ps(c + r * 16), scale, out[r]);
      out[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + h]), out[r]);
    }
  }
}

// blocks b0..b1 of 16 outputs, on one thread (its own tile configuration). Each group's 4-bit values are
// looked up once for all rows, which go through the tiles 16 at a time (xp padded to a multiple of 16 rows
// when M > 16); each row's sums in registers for one tile of rows, else in acc (M x 16 fp32). With one tile of
// rows, two groups go through two sets of tiles side by side: a tile register is not renamed, so with one set
// each group's product would wait for the previous group's store
__attribute__((target("avx512f,avx512bw,avx512bf16,f16c,amx-tile,amx-bf16")))
void q4_amx_blocks(const uint32_t* xp, const float* xs, const uint8_t* wp, const uint16_t* sl, float* y,
                   int64_t M, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t G = K / 32, Q = K / 4, P = K / 2, T = std::min<int64_t>(M, kAmxRows);
  TileConfig cfg;  // tmm0 / tmm3: C (T x 16 fp32), tmm1 / tmm4: A (T rows x 32 bf16), tmm2 / tmm5: B (16 pairs x 16)
  for (int set = 0; set < 2; ++set) {
    cfg.rows[3 * set] = cfg.rows[3 * set + 1] = (uint8_t)T;
    cfg.colsb[3 * set] = cfg.colsb[3 * set + 1] = 64;
    cfg.rows[3 * set + 2] = 16;
    cfg.colsb[3 * set + 2] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t bt[4][16 * 32];  // a group's 4-bit values as bf16, rows = input pairs (two pairs of groups)
  alignas(64) float ct[4][kAmxRows * 16];
  std::vector<float> acc(M > kAmxRows ? M * 16 : 0);
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* wb = wp + b * Q * 32;
    if (M <= kAmxRows) {  // one tile of rows: sums in registers, two groups at a time
      __m512 out[kAmxRows];
      for (int r = 0; r < kAmxRows; ++r) out[r] = _mm512_setzero_ps();
      // software-pipelined over pairs of groups: the 4-bit values of the next pair are looked up into one set
      // of buffers while the tiles multiply this pair from the other, and a pair's products are scaled one
      // pair later, so no tile load waits on the vector stores just made, nor a vector load on a tile store
      group_tile(wb, 0, bt[0]);
      if (G > 1) group_tile(wb, 1, bt[1]);
      for (int64_t g = 0; g < G; g += 2) {
        const int set = (g / 2) & 1;
        const bool two = g + 1 < G;
        if (g + 2 < G) group_tile(wb, g + 2, bt[2 * (1 - set)]);
        if (g + 3 < G) group_tile(wb, g + 3, bt[2 * (1 - set) + 1]);
        _tile_loadd(2, bt[2 * set], 64);
        _tile_zero(0);
        _tile_loadd(1, xp + g * 16, P * 4);
        _tile_dpbf16ps(0, 1, 2);
        if (two) {
          _tile_loadd(5, bt[2 * set + 1], 64);
          _tile_zero(3);
          _tile_loadd(4, xp + (g + 1) * 16, P * 4);
          _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, ct[2 * set], 64);
        if (two) _tile_stored(3, ct[2 * set + 1], 64);
        if (g >= 2) scale_pair(out, ct[2 * (1 - set)], sl, xs, M, G, b, g - 2);
      }
      scale_pair(out, ct[2 * (((G - 1) / 2) & 1)], sl, xs, M, G, b, (G - 1) / 2 * 2);
      for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * N + b * 16, out[r]);
      continue;
    }
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t g = 0; g < G; ++g) {
      group_tile(wb, g, bt[0]);
      _tile_loadd(2, bt[0], 64);
      const uint16_t* s = sl + ((b * G + g) * 2) * 16;
      const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)s));
      const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(s + 16)));
      for (int64_t r0 = 0; r0 < M; r0 += kAmxRows) {
        _tile_zero(0);
        _tile_loadd(1, xp + r0 * P + g * 16, P * 4);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, ct[0], 64);
        for (int64_t r = r0; r < std::min<int64_t>(r0 + kAmxRows, M); ++r) {
          __m512 a = _mm512_fmadd_ps(_mm512_load_ps(ct[0] + (r - r0) * 16), scale, _mm512_loadu_ps(&acc[r * 16]));
          _mm512_storeu_ps(&acc[r * 16], _mm512_fmadd_ps(low, _mm512_set1_ps(xs[r * G + g]), a));
        }
      }
    }
    for (int64_t r = 0; r < M; ++r) _mm512_storeu_ps(y + r * N + b * 16, _mm512_loadu_ps(&acc[r * 16]));
  }
  _tile_release();
}

#endif

void q4_amx(const uint32_t* xp, const float* xs, const uint8_t* wp, const uint16_t* sl, float* y,
            int64_t M, int64_t K, int64_t N) {
#if DART_LAB_AMX
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) { q4_amx_blocks(xp, xs, wp, sl, y, M, K, N, b0, b1); });
#endif
}

int64_t q4mm_amx_rows(int64_t rows) {
  // the AMX path's threshold (rows >= it; 0: never), set when rows >= 0: returns the one before, or -1 where
  // AMX is not usable
  if (!amx_usable()) return -1;
  const int64_t previous = amx_from_rows;
  if (rows >= 0) amx_from_rows = rows;
  return previous;
}

// ---- AVX2 (CPUs without AVX512-BF16): x's groups as 16-bit integers, multiplied by the 4-bit values with VPMADDWD
// (16 products an instruction, summed in pairs into 32-bit integers: exact), each group's integer sums then scaled
// in fp32: y = x' W^T to fp32 rounding, x' each group of 32 inputs of a row rounded to d * [-32767, 32767] with d =
// the group's largest |x| / 32767 -- closer to x than its bf16 rounding for the group's larger values (an error of at
// most d / 2, where bf16's is up to |x| / 256), and a third of the instructions a weight that widening each 4-bit
// value to fp32 for an FMA takes (one-row steps there are bound by those, not by the memory). The weights' layout is
// the AVX-512 path's: a quad's byte j holds output j / 2's inputs 4t + j % 2 (low nibble) and 4t + 2 + j % 2 (high),
// so widened to 16 bits each 32-bit lane holds one output's input pair, as VPMADDWD pairs them. Rows go 4 at a time
// (each row's two 8-output integer sums in registers), every pass over a block while it is in cache; up to 2 rows
// their outputs in registers too, else in memory, scaled into once a group.
constexpr int kMaxRows2 = 4;

template <int M>
__attribute__((target("avx2,fma,f16c")))
void q4_block_avx2(const uint32_t* xq, const float* xd, const float* xn, const uint8_t* wp, const uint16_t* sl,
                   float* y, int64_t K, int64_t N, int64_t b) {
  const int64_t G = K / 32, Q = K / 4, P = K / 2;
  const __m256i nib = _mm256_set1_epi16(0x0f);
  constexpr bool held = M <= 2;  // outputs in registers (reg), else in memory (out)
  alignas(32) float out[M][16] = {};
  __m256 reg[M][2];
  for (int r = 0; r < M; ++r) reg[r][0] = reg[r][1] = _mm256_setzero_ps();
  const uint8_t* wb = wp + b * Q * 32;
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int t = 0; t < 8; ++t) {
      const int64_t quad = g * 8 + t;
      _mm_prefetch((const char*)(wb + (quad + 32) * 32), _MM_HINT_T0);
      const __m256i w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + quad * 32)));       // outputs 0-7
      const __m256i w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(wb + quad * 32 + 16)));  // 8-15
      const __m256i lo0 = _mm256_and_si256(w0, nib), hi0 = _mm256_srli_epi16(w0, 4);  // inputs 4t, 4t + 1 / + 2, + 3
      const __m256i lo1 = _mm256_and_si256(w1, nib), hi1 = _mm256_srli_epi16(w1, 4);
      for (int r = 0; r < M; ++r) {
        const __m256i xa = _mm256_set1_epi32((int)xq[r * P + 2 * quad]), xb = _mm256_set1_epi32((int)xq[r * P + 2 * quad + 1]);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_add_epi32(_mm256_madd_epi16(lo0, xa), _mm256_madd_epi16(hi0, xb)));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_add_epi32(_mm256_madd_epi16(lo1, xa), _mm256_madd_epi16(hi1, xb)));
      }
    }
    // sum w x' = d (scale sum q n + low sum n) over the group, n = x' / d the integers
    const uint16_t* s = sl + ((b * G + g) * 2) * 16;
    const __m256 scale[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)),
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 8)))};
    const __m256 low[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 16))),
                           _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 24)))};
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h) {
        const __m256 o = held ? reg[r][h] : _mm256_load_ps(out[r] + 8 * h);
        const __m256 sum = _mm256_fmadd_ps(low[h], _mm256_set1_ps(xn[r * G + g]), _mm256_mul_ps(_mm256_cvtepi32_ps(acc[r][h]), scale[h]));
        const __m256 v = _mm256_fmadd_ps(sum, _mm256_set1_ps(xd[r * G + g]), o);
        if constexpr (held) reg[r][h] = v;
        else _mm256_store_ps(out[r] + 8 * h, v);
      }
  }
  if constexpr (held)
    for (int r = 0; r < M; ++r) {
      _mm256_store_ps(out[r], reg[r][0]);
      _mm256_store_ps(out[r] + 8, reg[r][1]);
    }
  for (int r = 0; r < M; ++r) std::copy_n(out[r], 16, y + r * N + b * 16);
}

using Block2Fn = void (*)(const uint32_t*, const float*, const float*, const uint8_t*, const uint16_t*, float*, int64_t,
                          int64_t, int64_t);
constexpr Block2Fn kBlock2[kMaxRows2] = {q4_block_avx2<1>, q4_block_avx2<2>, q4_block_avx2<3>, q4_block_avx2<4>};

// all M rows: each block of 16 outputs once from memory, its passes of 4 rows back to back
void q4_rows_avx2(const uint32_t* xq, const float* xd, const float* xn, const uint8_t* wp, const uint16_t* sl, float* y,
                  int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < M; r += kMaxRows2)
        kBlock2[std::min<int64_t>(kMaxRows2, M - r) - 1](xq + r * (K / 2), xd + r * (K / 32), xn + r * (K / 32), wp, sl,
                                                         y + r * N, K, N, b);
  });
}

// x's rows (all M, or rows ri[0..M)) fp32 -> per group of 32: the integers n = round(x / d) in [-32767, 32767] as
// int16 pairs (M, K/2), d = the group's largest |x| / 32767 (0 for a group of zeros) (M, K/32) and, where xn is
// given, the sum of the n (M, K/32: what a 4-bit group's low value multiplies; an 8-bit grid has none)
__attribute__((target("avx2,fma")))
void int16_rows(const float* x, const int64_t* ri, int64_t M, int64_t K, uint32_t* xq, float* xd, float* xn) {
  const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int64_t r = 0; r < M; ++r) {
    const float* src = x + (ri ? ri[r] : r) * K;
    for (int64_t g = 0; g < K / 32; ++g) {
      __m256 v[4], m = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(src + g * 32 + 8 * j);
        m = _mm256_max_ps(m, _mm256_and_ps(v[j], abs));
      }
      alignas(32) float part[8];
      _mm256_store_ps(part, m);
      const float amax = *std::max_element(part, part + 8);
      const __m256 inv = _mm256_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
      __m256i n[4];
      for (int j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // to nearest, ties to even
      // 16-bit pairs in input order: packs interleaves 128-bit lanes, the permute puts them back
      const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[0], n[1]), 0xd8);
      const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2], n[3]), 0xd8);
      _mm256_storeu_si256((__m256i*)(xq + r * (K / 2) + g * 16), lo);
      _mm256_storeu_si256((__m256i*)(xq + r * (K / 2) + g * 16 + 8), hi);
      xd[r * (K / 32) + g] = amax / 32767.0f;
      if (xn) {
        alignas(32) int32_t tp[8];
        _mm256_store_si256((__m256i*)tp, _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3])));
        int32_t t = 0;
        for (int j = 0; j < 8; ++j) t += tp[j];
        xn[r * (K / 32) + g] = (float)t;
      }
    }
  }
}

// ---- dart_lab::q8mm: y = x W^T for W an 8-bit grid, w = q d per group of 32 inputs (GGUF Q8_0: the embedded
// target's LM head), with x's groups as 16-bit integers (int16_rows) and VPMADDWD on the 8-bit values widened to 16
// bits: exact int32 sums a group, then d and x's d in fp32. Why: through q4mm an 8-bit grid runs as two 4-bit
// halves, twice the products; here each weight is one product, read at the same 8 bits. Layouts (q4.pack8):
//   wq (N/16, K/2, 32) int8: block b, input pair p: byte 2 i + j = q[16 b + i, 2 p + j] (widened to 16 bits, each
//      32-bit lane one output's input pair, as VPMADDWD pairs them)
//   sd (N/16, K/32, 16) fp16: each block's d for each group.
constexpr int kMaxRows8 = 8;

template <int M>
__attribute__((target("avx512f,avx512bw,f16c")))
void q8_block512(const uint32_t* xq, const float* xd, const int8_t* wq, const uint16_t* sd, float* y, int64_t K,
                 int64_t N, int64_t b) {
  const int64_t G = K / 32, P = K / 2;
  __m512 out[M];
  for (int r = 0; r < M; ++r) out[r] = _mm512_setzero_ps();
  const int8_t* wb = wq + b * P * 32;
  for (int64_t g = 0; g < G; ++g) {
    __m512i acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_si512();
    for (int t = 0; t < 16; ++t) {
      const int64_t p = g * 16 + t;
      _mm_prefetch((const char*)(wb + (p + 64) * 32), _MM_HINT_T0);
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(wb + p * 32)));
      for (int r = 0; r < M; ++r)
        acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(w, _mm512_set1_epi32((int)xq[r * P + p])));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sd + (b * G + g) * 16)));
    for (int r = 0; r < M; ++r)
      out[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_mul_ps(d, _mm512_set1_ps(xd[r * G + g])), out[r]);
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(y + r * N + b * 16, out[r]);
}

template <int M>
__attribute__((target("avx2,fma,f16c")))
void q8_block256(const uint32_t* xq, const float* xd, const int8_t* wq, const uint16_t* sd, float* y, int64_t K,
                 int64_t N, int64_t b) {
  const int64_t G = K / 32, P = K / 2;
  __m256 out[M][2];
  for (int r = 0; r < M; ++r) out[r][0] = out[r][1] = _mm256_setzero_ps();
  const int8_t* wb = wq + b * P * 32;
  for (int64_t g = 0; g < G; ++g) {
    __m256i acc[M][2];
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
    for (int t = 0; t < 16; ++t) {
      const int64_t p = g * 16 + t;
      _mm_prefetch((const char*)(wb + (p + 32) * 32), _MM_HINT_T0);
      const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wb + p * 32)));       // outputs 0-7
      const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(wb + p * 32 + 16)));  // 8-15
      for (int r = 0; r < M; ++r) {
        const __m256i xa = _mm256_set1_epi32((int)xq[r * P + p]);
        acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(w0, xa));
        acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(w1, xa));
      }
    }
    const uint16_t* s = sd + (b * G + g) * 16;
    const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)s)),
                         _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + 8)))};
    for (int r = 0; r < M; ++r)
      for (int h = 0; h < 2; ++h)
        out[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][h]), _mm256_mul_ps(d[h], _mm256_set1_ps(xd[r * G + g])),
                                    out[r][h]);
  }
  for (int r = 0; r < M; ++r) {
    _mm256_storeu_ps(y + r * N + b * 16, out[r][0]);
    _mm256_storeu_ps(y + r * N + b * 16 + 8, out[r][1]);
  }
}

using Block8Fn = void (*)(const uint32_t*, const float*, const int8_t*, const uint16_t*, float*, int64_t, int64_t,
                          int64_t);
constexpr Block8Fn kBlock512[kMaxRows8] = {q8_block512<1>, q8_block512<2>, q8_block512<3>, q8_block512<4>,
                                           q8_block512<5>, q8_block512<6>, q8_block512<7>, q8_block512<8>};
constexpr Block8Fn kBlock256[kMaxRows8 / 2] = {q8_block256<1>, q8_block256<2>, q8_block256<3>, q8_block256<4>};

bool avx512bw_here() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    return avx512_here() && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 30) & 1);
  }();
  return ok;
}

at::Tensor q8mm(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& sd, int64_t n) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "q8mm: x must be a contiguous (..., K) float32 CPU tensor");
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0;
  TORCH_CHECK(K > 0 && K % 32 == 0 && n % 16 == 0, "q8mm: K must be a positive multiple of 32 and N of 16");
  TORCH_CHECK(wq.scalar_type() == at::kChar && wq.numel() == n * K, "q8mm: wq is not (N/16, K/2, 32) int8");
  TORCH_CHECK(sd.scalar_type() == at::kHalf && sd.numel() == n * K / 32, "q8mm: sd is not (N/16, K/32, 16) fp16");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = at::empty(shape, x.options());
  if (M == 0) return y;
  std::vector<uint32_t> xq(M * K / 2);
  std::vector<float> xd(M * K / 32);
  int16_rows(x.data_ptr<float>(), nullptr, M, K, xq.data(), xd.data(), nullptr);
  const int8_t* w = wq.data_ptr<int8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sd.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  const bool wide = avx512bw_here();
  const int64_t step = wide ? kMaxRows8 : kMaxRows8 / 2;
  // each block of 16 outputs once from memory, its passes of rows back to back
  at::parallel_for(0, n / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < M; r += step) {
        const int64_t m = std::min<int64_t>(step, M - r);
        (wide ? kBlock512 : kBlock256)[m - 1](xq.data() + r * (K / 2), xd.data() + r * (K / 32), w, s, yp + r * n, K,
                                              n, b);
      }
  });
  return y;
}

// whether the CPU multiplies bf16 pairs (AVX512-BF16: VDPBF16PS); else the AVX2 path
bool bf16_dot_usable() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
    return ((a >> 5) & 1) != 0;
  }();
  return ok;
}

bool avx2_forced = false;  // the AVX2 path on a CPU that has the other (tests and A/B timings)

int64_t q4mm_avx2(int64_t on) {
  // on >= 0: force the AVX2 path (1) or not (0); returns the setting before (1 where the CPU offers no other)
  const int64_t previous = (avx2_forced || !bf16_dot_usable() || !avx512_here()) ? 1 : 0;
  if (on >= 0) avx2_forced = on != 0;
  return previous;
}

// x's rows (all M, or rows ri[0..M) where ri is given) fp32 -> their bf16 rounding as pairs (M, K/2) and each
// group's sum of the rounded values (M, K/32)
__attribute__((target("avx512f,avx512bw,avx512bf16")))
void round_rows(const float* x, const int64_t* ri, int64_t M, int64_t K, uint32_t* xp, float* xs) {
  for (int64_t r = 0; r < M; ++r) {
    for (int64_t g = 0; g < K / 32; ++g) {
      const float* src = x + (ri ? ri[r] : r) * K + g * 32;
      __m256bh a = _mm512_cvtneps_pbh(_mm512_loadu_ps(src));
      __m256bh c = _mm512_cvtneps_pbh(_mm512_loadu_ps(src + 16));
      _mm256_storeu_si256((__m256i*)(xp + r * (K / 2) + g * 16), (__m256i)a);
      _mm256_storeu_si256((__m256i*)(xp + r * (K / 2) + g * 16 + 8), (__m256i)c);
      xs[r * (K / 32) + g] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_cvtpbh_ps(a), _mm512_cvtpbh_ps(c)));
    }
  }
}

// x's rows (all M, or rows ri[0..M)) -> w * x / sqrt(mean(x^2) + eps) into xn (M, K): a decoder layer's norm
// before its first linear, without an op of its own between them (rms_norm.h: dart_lab::rms_norm's arithmetic)
void norm_rows(const float* x, const int64_t* ri, int64_t M, int64_t K, const float* w, double eps, float* xn) {
  const auto row = avx512_here() ? avx512::rms_norm_row : avx2::rms_norm_row;
  for (int64_t r = 0; r < M; ++r) row(x + (ri ? ri[r] : r) * K, w, xn + r * K, K, eps);
}

// rows of `width` written at the front of buf (M x width) -> each repeated `halves` times side by side (M x
// halves width), in place from the last row back (a row's first copy may overlap where it was read from)
template <class T>
void spread_halves(T* buf, int64_t M, int64_t width, int64_t halves) {
  if (halves == 1) return;
  for (int64_t r = M - 1; r >= 0; --r)
    for (int64_t h = halves - 1; h >= 0; --h) std::memmove(buf + (r * halves + h) * width, buf + r * width, width * sizeof(T));
}

// halves > 1: W is an 8-bit grid held as 4-bit halves side by side along the inputs (q = 16 hi + lo), x of
// K / halves inputs read as [x, x] (int4.Int4Linear.of_8bit builds the same groups for torch's kernel).
// rows (optional, int64): only these rows of x (flat indices) are computed, the others' outputs are 0 -- a batch
// step's pad nodes cost no arithmetic; a row's numbers do not depend on the rows beside it.
// norm (optional, fp32 (K,)): x's rows through that RMSNorm first (eps), as dart_lab::rms_norm computes it.
// residual (optional, fp32, y's shape): y = residual + x W^T (a decoder layer's residual add, the same sums as
// at::add after the product; a row not computed is the residual's).
at::Tensor q4mm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sl, int64_t n, int64_t halves,
                const c10::optional<at::Tensor>& rows, const c10::optional<at::Tensor>& norm, double eps,
                const c10::optional<at::Tensor>& residual) {
  // x (..., K): any leading shape, so a step's (B, N, K) activations need no reshape around the call
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(),
              "q4mm: x must be a contiguous (..., K) float32 CPU tensor");
  TORCH_CHECK(halves >= 1 && x.size(-1) > 0 && x.size(-1) % 32 == 0, "q4mm: halves >= 1 and x's width a positive multiple of 32");
  const int64_t Kx = x.size(-1), M = x.numel() / Kx, K = Kx * halves;
  TORCH_CHECK(K % 32 == 0 && n % 16 == 0, "q4mm: K must be a multiple of 32 and N of 16");
  TORCH_CHECK(wp.scalar_type() == at::kByte && wp.numel() == n * K / 2, "q4mm: wp is not (N/16, K/4, 32) uint8");
  TORCH_CHECK(sl.scalar_type() == at::kHalf && sl.numel() == n * K / 16, "q4mm: sl is not (N/16, K/32, 2, 16) fp16");
  const bool some = rows.has_value() && rows->defined();
  if (some)
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->dim() == 1 && rows->is_contiguous() && rows->device().is_cpu(),
                "q4mm: rows must be a 1-D int64 CPU tensor");
  const int64_t* ri = some ? rows->data_ptr<int64_t>() : nullptr;
  const int64_t Mc = some ? rows->numel() : M;  // rows computed
  for (int64_t r = 0; r < (some ? Mc : 0); ++r) TORCH_CHECK(ri[r] >= 0 && ri[r] < M, "q4mm: a row index out of range");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  auto y = at::empty(shape, x.options());
  if (some) {  // the rows not computed: 0
    std::vector<char> computed(M, 0);
    for (int64_t r = 0; r < Mc; ++r) computed[ri[r]] = 1;
    for (int64_t r = 0; r < M; ++r)
      if (!computed[r]) std::fill_n(y.data_ptr<float>() + r * n, n, 0.0f);
  }
  if (Mc == 0) return y;
  const bool normed = norm.has_value() && norm->defined();
  std::vector<float> xn;  // the computed rows normalized (then read in order: ri applied here)
  const float* xsrc = x.data_ptr<float>();
  if (normed) {
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->is_contiguous() && norm->dim() == 1 && norm->size(0) == Kx,
                "q4mm: norm must be a contiguous float32 (K,) weight");
    xn.resize(Mc * Kx);
    norm_rows(xsrc, ri, Mc, Kx, norm->data_ptr<float>(), eps, xn.data());
    xsrc = xn.data();
  }
  const int64_t* rsrc = normed ? nullptr : ri;  // rows of xsrc to read
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sl.data_ptr<at::Half>());
  // the computed rows, scattered to theirs in y below (every path stores each output once: no zero fill)
  std::unique_ptr<float[]> yc(some ? new float[Mc * n] : nullptr);
  float* yp = some ? yc.get() : y.data_ptr<float>();
  std::vector<float> xs(Mc * K / 32);
  if (avx2_forced || !bf16_dot_usable() || !avx512_here()) {  // x's groups as 16-bit integers
    std::vector<uint32_t> xq(Mc * K / 2);
    std::vector<float> xd(Mc * K / 32);
    int16_rows(xsrc, rsrc, Mc, Kx, xq.data(), xd.data(), xs.data());
    spread_halves(xq.data(), Mc, Kx / 2, halves);
    spread_halves(xd.data(), Mc, Kx / 32, halves);
    spread_halves(xs.data(), Mc, Kx / 32, halves);
    q4_rows_avx2(xq.data(), xd.data(), xs.data(), w, s, yp, Mc, K, n);
  } else {
    const bool amx = amx_from_rows > 0 && Mc >= amx_from_rows && amx_usable();
    // the tiles read 16 rows at a time: rows past Mc are zeros (their sums are not kept)
    std::vector<uint32_t> xp((amx && Mc > kAmxRows ? (Mc + kAmxRows - 1) / kAmxRows * kAmxRows : Mc) * K / 2);
    round_rows(xsrc, rsrc, Mc, Kx, xp.data(), xs.data());
    spread_halves(xp.data(), Mc, Kx / 2, halves);
    spread_halves(xs.data(), Mc, Kx / 32, halves);
    if (amx) {
      q4_amx(xp.data(), xs.data(), w, s, yp, Mc, K, n);
    } else {
      for (int64_t r = 0; r < Mc; r += kMaxRows) {
        const int64_t m = std::min<int64_t>(kMaxRows, Mc - r);
        kRows[m - 1](xp.data() + r * (K / 2), xs.data() + r * (K / 32), w, s, yp + r * n, K, n);
      }
    }
  }
  for (int64_t r = 0; r < (some ? Mc : 0); ++r) std::copy_n(yc.get() + r * n, n, y.data_ptr<float>() + ri[r] * n);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->numel() == M * n,
                "q4mm: residual must be a contiguous float32 tensor of the output's size");
    float* yp = y.data_ptr<float>();
    const float* rp = residual->data_ptr<float>();
    for (int64_t i = 0; i < M * n; ++i) yp[i] = rp[i] + yp[i];
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("q4mm(Tensor x, Tensor wp, Tensor sl, int n, int halves=1, Tensor? rows=None, Tensor? norm=None, "
        "float eps=0.0, Tensor? residual=None) -> Tensor");
  m.def("q4mm_amx_rows(int rows) -> int", &q4mm_amx_rows);
  m.def("q4mm_avx2(int on) -> int", &q4mm_avx2);
  m.def("q8mm(Tensor x, Tensor wq, Tensor sd, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("q4mm", &q4mm);
  m.impl("q8mm", &q8mm);
}
