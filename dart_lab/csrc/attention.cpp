// dart_lab::decode_attn -- attention of a few new positions per row against a K/V cache, for decoding
// steps and small trees on CPUs with AVX-512 (built on first use: dart_lab/attention.py).
//
// Why: torch's CPU SDPA kernel is written for long queries; for a step of 1-4 positions a row it spends
// most of its time outside the arithmetic, reading the cache at a fraction of the memory's speed. Here
// each (row, key head) reads its K and V once, for all the query heads that share them (grouped-query
// attention without repeating K/V): scores, an exact softmax (max subtracted, fp32), then the weighted sum
// of V. Masked keys (-inf) weigh exactly 0; a key that every query position of its row masks is not read, and a
// position that sees one key only (a batch's pad node) takes that key's V without a pass over the others.
//
// Shapes: q (B, H, N, D) fp32; k, v (B, Hk, n_keys, D) both fp32 or both bf16 (widened to fp32 exactly in
// registers: a bf16 cache is half the bytes a step streams) with D contiguous (views of a longer cache are
// fine); mask (B or 1, 1, N, n_keys) additive fp32 or none (every key visible); H a multiple of Hk; D = 16,
// 32, 64 or 128.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// e^x for x <= 0 (scores minus their max): 2^n e^r with r = x - n ln2, a degree-6 polynomial (Cephes'
// expf coefficients, ~1 ulp); below -87.3 (e^x under float's normal range, and -inf) exactly 0
__attribute__((target("avx512f")))
inline __m512 exp_nonpos(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// the sums of a, b, c and d's 16 lanes each, as one 4-lane vector
__attribute__((target("avx512f")))
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit quarters: ab = [a0+a2, a1+a3, b0+b2, b1+b3], cd alike; then [a, b, c, d] one quarter each
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xee));
  __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xdd));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0x4e));  // within each quarter: [x0+x2, x1+x3, ...]
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));  // element 0 of each quarter: its 4 lanes' sum
  const __m512i idx = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(idx, t));
}

constexpr int kRowsPerPass = 4;  // query rows sharing one pass over K and over V
// K and V rows are requested this many keys ahead of their use: a step's attention streams the cache at close
// to the memory's speed, and the hardware prefetcher alone left part of that on the table
// (experiments/engine/attention_prefetch_ab.py)
constexpr int64_t kAhead = 8;

struct Geometry {
  int64_t H, N, Hk, G, nk;
  int64_t kb, kh, kr, vb, vh, vr;  // K and V strides: row, head, key
  int64_t mb, mn;                  // mask strides: row (0: one mask for every row), query position
  float scale;                     // applied to q as it is loaded, as SDPA scales q (the same fp32 products)
};

// The keys of batch row b that at least one of its query positions sees, as spans [first, end) in order: a key
// every position masks (-inf) weighs exactly 0, so it is not read. In a batch a row's committed keys end where
// its own prompt and tokens do, before the longest row's: the slots between are masked for it, and reading
// them was a share of a batched step's attention that grows with the rows' differences in length.
__attribute__((target("avx512f")))
void live_spans(const Geometry& s, const float* M, std::vector<std::pair<int64_t, int64_t>>& spans) {
  spans.clear();
  if (!M) {
    spans.emplace_back(0, s.nk);
    return;
  }
  const __m512 dead = _mm512_set1_ps(-INFINITY);
  int64_t open = -1;  // first key of the span being built, -1: none
  for (int64_t j0 = 0; j0 < s.nk; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, s.nk - j0);
    const __mmask16 in = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
    __mmask16 seen = 0;
    for (int64_t p = 0; p < s.N && seen != in; ++p)
      seen |= _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, M + p * s.mn + j0), dead, _CMP_NEQ_UQ);
    if (seen == in && open >= 0) continue;  // the whole chunk extends the open span
    for (int64_t j = 0; j < n; ++j) {
      const bool live = (seen >> j) & 1;
      if (live && open < 0) open = j0 + j;
      if (!live && open >= 0) {
        spans.emplace_back(open, j0 + j);
        open = -1;
      }
    }
  }
  if (open >= 0) spans.emplace_back(open, s.nk);
}

// Per query position of batch row b: the one key it sees where it sees exactly one (else -1). Such a position's
// softmax is exactly 1 on that key, so its output is that key's V as it is; in a batch's step every row's tree is
// padded to the widest, and a pad position sees only its own slot -- left out of the passes below, a row with a
// smaller tree costs what its own tree does.
__attribute__((target("avx512f")))
void single_keys(const Geometry& s, const float* M, std::vector<int64_t>& single) {
  single.assign(s.N, -1);
  if (!M) return;
  const __m512 dead = _mm512_set1_ps(-INFINITY);
  for (int64_t p = 0; p < s.N; ++p) {
    int64_t seen = 0, at = -1;
    for (int64_t j0 = 0; j0 < s.nk && seen < 2; j0 += 16) {
      const int64_t n = std::min<int64_t>(16, s.nk - j0);
      const __mmask16 in = (__mmask16)(n == 16 ? 0xffff : (1u << n) - 1);
      const __mmask16 live = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, M + p * s.mn + j0), dead, _CMP_NEQ_UQ);
      if (live) {
        seen += __builtin_popcount(live);
        at = j0 + __builtin_ctz(live);
      }
    }
    if (seen == 1) single[p] = at;
  }
}

// K/V elements: fp32 as they are, or bf16 (an fp32's upper half) widened exactly
struct F32 {
  using T = float;
  __attribute__((target("avx512f"))) static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
};
struct BF16 {
  using T = uint16_t;
  __attribute__((target("avx512f"))) static inline __m512 load(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
  }
};

// one key's dot products with the 4 query rows held in qv (scaled), as a 4-lane vector; the K row kAhead keys on
// requested meanwhile (kr: the stride between keys)
template <int C, class E>
__attribute__((always_inline, target("avx512f")))
inline __m128 key_dots(const __m512 (&qv)[kRowsPerPass][C], const typename E::T* kj, int64_t kr) {
  constexpr int kLine = 64 / sizeof(typename E::T);  // elements a cache line: one prefetch each
  __m512 a[kRowsPerPass];
  for (int i = 0; i < kRowsPerPass; ++i) a[i] = _mm512_setzero_ps();
  for (int c = 0; c < C; ++c) {
    if (16 * c % kLine == 0) _mm_prefetch((const char*)(kj + kAhead * kr + 16 * c), _MM_HINT_T0);
    const __m512 kc = E::load(kj + 16 * c);
    for (int i = 0; i < kRowsPerPass; ++i) a[i] = _mm512_fmadd_ps(qv[i][c], kc, a[i]);
  }
  return sum4(a[0], a[1], a[2], a[3]);
}

// One (batch row b, key head g): rows [r_begin, r_end) of the G query heads sharing it x N positions (R = G N
// rows, contiguous in q and out; row r is position r % N) over the live keys `spans`; a row whose position sees
// one key only (`single`) takes that key's V. C = D / 16 vectors a head.
template <int C, class E>
__attribute__((target("avx512f")))
void head_group(const Geometry& s, const float* q, const typename E::T* k, const typename E::T* v, const float* mask,
                float* out,
                int64_t b, int64_t g, int64_t r_begin, int64_t r_end, std::vector<float>& sc,
                const std::vector<std::pair<int64_t, int64_t>>& spans, const std::vector<int64_t>& single) {
  constexpr int D = 16 * C;
  int64_t nk = 0;  // live keys; scores are stored for those only, in key order
  for (const auto& sp : spans) nk += sp.second - sp.first;
  const float* Q = q + (b * s.H + g * s.G) * s.N * D;
  float* O = out + (b * s.H + g * s.G) * s.N * D;
  const typename E::T* K = k + b * s.kb + g * s.kh;
  const typename E::T* V = v + b * s.vb + g * s.vh;
  constexpr int kLine = 64 / sizeof(typename E::T);  // elements a cache line: one prefetch each
  const float* M = mask ? mask + b * s.mb : nullptr;
  std::vector<int64_t> rows;  // the rows computed below, in order
  rows.reserve(r_end - r_begin);
  for (int64_t r = r_begin; r < r_end; ++r) {
    const int64_t j = single[r % s.N];
    if (j < 0) {
      rows.push_back(r);
      continue;
    }
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(O + r * D + 16 * c, E::load(V + j * s.vr + 16 * c));
  }
  const int64_t R = rows.size();
  sc.resize(R * nk);  // the i-th computed row's scores at i * nk
  std::vector<float> mx(R, -INFINITY), sum(R);
  // 1. scores: 4 query rows at a time held in registers (scaled as loaded), each key's 4 dot products summed
  // together (`sum4`)
  for (int64_t i0 = 0; i0 < R; i0 += kRowsPerPass) {
    const int64_t rn = std::min<int64_t>(kRowsPerPass, R - i0);
    __m512 qv[kRowsPerPass][C];
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int c = 0; c < C; ++c)
        qv[i][c] = i < rn ? _mm512_mul_ps(_mm512_loadu_ps(Q + rows[i0 + i] * D + 16 * c), _mm512_set1_ps(s.scale))
                          : _mm512_setzero_ps();
    // each row's mask row (a row past rn: row 0's, read and not used)
    const float* mrow[kRowsPerPass];
    for (int i = 0; i < kRowsPerPass; ++i)
      mrow[i] = M ? M + (rows[i0 + (i < rn ? i : 0)] % s.N) * s.mn : nullptr;
    // 4 keys at a time: their 4 x 4 scores transposed to rows' order in one vector, each row's mask added and its
    // running max kept in its 4 lanes, each row's 4 scores stored at once; the span's last keys one by one
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    float m4[kRowsPerPass] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    const __m512i by_row = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    int64_t at = 0;  // the key's place among the live ones
    for (const auto& sp : spans) {
      int64_t j = sp.first;
      for (; j + 4 <= sp.second; j += 4, at += 4) {
        __m512 z = _mm512_castps128_ps512(key_dots<C, E>(qv, K + j * s.kr, s.kr));
        z = _mm512_insertf32x4(z, key_dots<C, E>(qv, K + (j + 1) * s.kr, s.kr), 1);
        z = _mm512_insertf32x4(z, key_dots<C, E>(qv, K + (j + 2) * s.kr, s.kr), 2);
        z = _mm512_insertf32x4(z, key_dots<C, E>(qv, K + (j + 3) * s.kr, s.kr), 3);
        z = _mm512_permutexvar_ps(by_row, z);  // lane 4 i + u: row i, key j + u
        if (M) {
          __m512 m = _mm512_castps128_ps512(_mm_loadu_ps(mrow[0] + j));
          m = _mm512_insertf32x4(m, _mm_loadu_ps(mrow[1] + j), 1);
          m = _mm512_insertf32x4(m, _mm_loadu_ps(mrow[2] + j), 2);
          m = _mm512_insertf32x4(m, _mm_loadu_ps(mrow[3] + j), 3);
          z = _mm512_add_ps(z, m);
        }
        m16 = _mm512_max_ps(m16, z);
        _mm_storeu_ps(sc.data() + i0 * nk + at, _mm512_castps512_ps128(z));
        if (rn > 1) _mm_storeu_ps(sc.data() + (i0 + 1) * nk + at, _mm512_extractf32x4_ps(z, 1));
        if (rn > 2) _mm_storeu_ps(sc.data() + (i0 + 2) * nk + at, _mm512_extractf32x4_ps(z, 2));
        if (rn > 3) _mm_storeu_ps(sc.data() + (i0 + 3) * nk + at, _mm512_extractf32x4_ps(z, 3));
      }
      for (; j < sp.second; ++j, ++at) {
        float x[4];
        _mm_storeu_ps(x, key_dots<C, E>(qv, K + j * s.kr, s.kr));
        for (int i = 0; i < rn; ++i) {
          const float xi = M ? x[i] + mrow[i][j] : x[i];
          sc[(i0 + i) * nk + at] = xi;
          m4[i] = std::max(m4[i], xi);
        }
      }
    }
    alignas(64) float m16s[16];
    _mm512_store_ps(m16s, m16);
    for (int i = 0; i < rn; ++i)
      mx[i0 + i] = std::max(std::max(m4[i], std::max(m16s[4 * i], m16s[4 * i + 1])),
                            std::max(m16s[4 * i + 2], m16s[4 * i + 3]));
  }
  // 2. softmax numerators and sums
  for (int64_t r = 0; r < R; ++r) {
    float* sr = sc.data() + r * nk;
    const __m512 m = _mm512_set1_ps(mx[r]);
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= nk; j += 16) {
      const __m512 e = exp_nonpos(_mm512_sub_ps(_mm512_loadu_ps(sr + j), m));
      _mm512_storeu_ps(sr + j, e);
      acc = _mm512_add_ps(acc, e);
    }
    if (j < nk) {
      const __mmask16 tail = (__mmask16)((1u << (nk - j)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpos(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, sr + j), m)));
      _mm512_mask_storeu_ps(sr + j, tail, e);
      acc = _mm512_add_ps(acc, e);
    }
    sum[r] = _mm512_reduce_add_ps(acc);
  }
  // 3. out = softmax-weighted sum of V
  for (int64_t i0 = 0; i0 < R; i0 += kRowsPerPass) {
    const int64_t rn = std::min<int64_t>(kRowsPerPass, R - i0);
    __m512 o[kRowsPerPass][C];
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int c = 0; c < C; ++c) o[i][c] = _mm512_setzero_ps();
    int64_t at = 0;
    for (const auto& sp : spans) {
      for (int64_t j = sp.first; j < sp.second; ++j, ++at) {
        __m512 vj[C];
        for (int c = 0; c < C; ++c) {
          if (16 * c % kLine == 0) _mm_prefetch((const char*)(V + (j + kAhead) * s.vr + 16 * c), _MM_HINT_T0);
          vj[c] = E::load(V + j * s.vr + 16 * c);
        }
        for (int i = 0; i < rn; ++i) {
          const __m512 p = _mm512_set1_ps(sc[(i0 + i) * nk + at]);
          for (int c = 0; c < C; ++c) o[i][c] = _mm512_fmadd_ps(p, vj[c], o[i][c]);
        }
      }
    }
    for (int i = 0; i < rn; ++i) {
      const __m512 inv = _mm512_set1_ps(1.0f / sum[i0 + i]);
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(O + rows[i0 + i] * D + 16 * c, _mm512_mul_ps(o[i][c], inv));
    }
  }
}

template <class E>
void by_head_dim(int64_t D, const Geometry& s, const float* q, const typename E::T* k, const typename E::T* v,
                 const float* mask, float* out, int64_t b, int64_t g, int64_t r0, int64_t r1, std::vector<float>& sc,
                 const std::vector<std::pair<int64_t, int64_t>>& spans, const std::vector<int64_t>& single) {
  switch (D) {
    case 16: head_group<1, E>(s, q, k, v, mask, out, b, g, r0, r1, sc, spans, single); break;
    case 32: head_group<2, E>(s, q, k, v, mask, out, b, g, r0, r1, sc, spans, single); break;
    case 64: head_group<4, E>(s, q, k, v, mask, out, b, g, r0, r1, sc, spans, single); break;
    default: head_group<8, E>(s, q, k, v, mask, out, b, g, r0, r1, sc, spans, single);
  }
}

at::Tensor decode_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attn: q, k, v must be 4-D");
  const bool bf16 = k.scalar_type() == at::kBFloat16;
  TORCH_CHECK(q.scalar_type() == at::kFloat && (bf16 || k.scalar_type() == at::kFloat) && v.scalar_type() == k.scalar_type(),
              "decode_attn: q must be float32, k and v both float32 or both bfloat16");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "decode_attn: CPU tensors only");
  const int64_t B = q.size(0), H = q.size(1), N = q.size(2), D = q.size(3), Hk = k.size(1);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128, "decode_attn: head_dim must be 16, 32, 64 or 128");
  const int64_t n_keys = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && v.size(1) == Hk && v.size(2) == n_keys && k.size(3) == D &&
              v.size(3) == D, "decode_attn: k and v must be (B, Hk, n_keys, D) as q");
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "decode_attn: query heads must be a multiple of key heads");
  TORCH_CHECK(n_keys >= 1, "decode_attn: no keys");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "decode_attn: k and v need contiguous head_dim");
  const bool masked = mask.has_value() && mask->defined();
  at::Tensor m;
  if (masked) {
    m = mask->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kFloat && m.dim() == 4 && (m.size(0) == B || m.size(0) == 1) &&
                m.size(1) == 1 && m.size(2) == N && m.size(3) == n_keys,
                "decode_attn: mask must be (B or 1, 1, N, n_keys) float32");
  }
  const at::Tensor qs = q.contiguous();
  auto out = at::empty({B, H, N, D}, q.options());
  Geometry s{H, N, Hk, H / Hk, n_keys,
             k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
             masked && m.size(0) == B ? m.stride(0) : 0, masked ? m.stride(2) : 0, (float)scale};
  const float* qp = qs.data_ptr<float>();
  const float* mp = masked ? m.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // one task a (row, key head, block of its query rows). One block a (row, key head) reads its K and V once
  // for all its query heads, which measured faster for one-token steps even where it left a thread idle; a
  // tree's step has G N query rows a key head, arithmetic enough that with fewer (row, key head) pairs than
  // two a thread they are cut into blocks of whole passes, so every thread has work (K and V read once a block)
  const int64_t R = s.G * N, pairs = B * Hk, threads = at::get_num_threads();
  const int64_t passes = (R + kRowsPerPass - 1) / kRowsPerPass;
  const int64_t blocks = pairs >= 2 * threads ? 1 : std::min(passes, (2 * threads + pairs - 1) / pairs);
  const int64_t rows_per_block = (passes + blocks - 1) / blocks * kRowsPerPass;
  const int64_t n_blocks = (R + rows_per_block - 1) / rows_per_block;
  at::parallel_for(0, pairs * n_blocks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> sc;
    std::vector<std::pair<int64_t, int64_t>> spans;
    std::vector<int64_t> single;
    int64_t spans_of = -1;  // the batch row `spans` and `single` were found for (its key heads share its mask)
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t pair = t / n_blocks, r0 = t % n_blocks * rows_per_block, r1 = std::min(R, r0 + rows_per_block);
      const int64_t b = pair / Hk, g = pair % Hk;
      if (b != spans_of) {
        live_spans(s, mp ? mp + b * s.mb : nullptr, spans);
        single_keys(s, mp ? mp + b * s.mb : nullptr, single);
        spans_of = b;
      }
      if (bf16)
        by_head_dim<BF16>(D, s, qp, (const uint16_t*)k.data_ptr<at::BFloat16>(),
                          (const uint16_t*)v.data_ptr<at::BFloat16>(), mp, op, b, g, r0, r1, sc, spans, single);
      else
        by_head_dim<F32>(D, s, qp, k.data_ptr<float>(), v.data_ptr<float>(), mp, op, b, g, r0, r1, sc, spans, single);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("decode_attn(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("decode_attn", &decode_attn);
}
