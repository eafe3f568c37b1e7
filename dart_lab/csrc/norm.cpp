// dart_lab::rms_norm -- y = w * x / sqrt(mean(x^2) + eps) over the last dimension, fp32, on CPUs with AVX-512
// (built on first use: dart_lab/kernels.py). The arithmetic of torch's F.rms_norm in one pass a row; why: an eager
// decoding step normalises 2 x layers + 1 times a few rows, where F.rms_norm's several internal ops cost ~5x
// the arithmetic (docs/speed.md). dart_lab::silu_mul -- the MLP's silu(gate) * up from the fused gate|up
// projection's output in one pass (fp32; other dtypes by torch's ops): torch's fp32 silu as its CPU kernel computes
// it (x / (1 + exp(-x)) on 32 lanes with the Sleef exp libtorch exports, each row's last I % 32 values by the scalar
// formula), then the product -- the numbers of F.silu(gate) * up without the intermediate or its dispatches (each
// layer of an eager step). dart_lab::silu_mul_bf16 -- the same from a bf16 gate|up to a bf16 result (a prompt's MLP
// on bf16 copies of the weights): each value widened exactly, the product rounded as torch's cast rounds -- the
// numbers of .float(), silu_mul, .to(bf16) without their fp32 intermediates and seven ops a block of rows (a packed
// batch of prompts: tens of MB a layer). dart_lab::top2 -- each row's largest value, its first index and the second
// largest value (equal to the largest where it occurs twice) in one pass over the logits: what a greedy step reads
// of them (argmax and the near-tie margin), where torch's max and topk(2) read the rows twice and topk's selection
// costs ~3x a max.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "rms_norm.h"

namespace {

// rows [begin, end) of rms_norm
__attribute__((target("avx512f")))
void rms_norm_rows(const float* xp, const float* wp, float* yp, int64_t n, double eps, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * n, wp, yp + r * n, n, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
              w.device().is_cpu(), "rms_norm: x and w must be float32 CPU tensors");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: contiguous x (..., n) and w (n,)");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // a step's few rows on the calling thread; a prompt's hundreds over the threads (each row's arithmetic alike)
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    rms_norm_rows(xp, wp, yp, n, eps, begin, end);
  });
  return y;
}

}  // namespace

extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's Vectorized<float>::exp (libtorch_cpu exports it)

namespace {

__attribute__((target("avx512f")))
inline __m512 widen_bf16(const at::BFloat16* p) {  // 16 bf16 -> fp32, exact
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

__attribute__((target("avx512f")))
inline void store_bf16(at::BFloat16* p, __m512 v) {  // round to nearest even as torch's vectorized cast (NaN 0xffff)
  const __m512i b = _mm512_castps_si512(v);
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                                                _mm512_set1_epi32(0x7fff)), b);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xffff), _mm512_srli_epi32(r, 16));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtusepi32_epi16(r));
}

// 16 values of a row as fp32 (bf16 widened exactly) and back (bf16 rounded as torch's cast rounds)
template <class T> struct Lanes;
template <> struct Lanes<float> {
  __attribute__((target("avx512f"))) static inline __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  __attribute__((target("avx512f"))) static inline void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};
template <> struct Lanes<at::BFloat16> {
  __attribute__((target("avx512f"))) static inline __m512 load(const at::BFloat16* p) { return widen_bf16(p); }
  __attribute__((target("avx512f"))) static inline void store(at::BFloat16* p, __m512 v) { store_bf16(p, v); }
};

// rows [begin, end) of silu_mul: gate_up (rows, 2 I) -> out (rows, I), silu and the product in fp32
template <class T>
__attribute__((target("avx512f")))
void silu_mul_rows(const T* gp, T* op, int64_t I, int64_t begin, int64_t end) {
  const int64_t vec = I / 32 * 32;  // torch's float kernel: 2 vectors a step, the rest of a row scalar
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512i sign = _mm512_set1_epi32(0x80000000);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gp + r * 2 * I;
    const T* up = gate + I;
    T* o = op + r * I;
    for (int64_t j = 0; j < vec; j += 16) {
      const __m512 x = Lanes<T>::load(gate + j);
      const __m512 e = Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(sign, _mm512_castps_si512(x))));
      Lanes<T>::store(o + j, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), Lanes<T>::load(up + j)));
    }
    for (int64_t j = vec; j < I; ++j) {
      const float x = static_cast<float>(gate[j]);
      const float s = x / (1.f + std::exp(-x));
      o[j] = static_cast<T>(s * static_cast<float>(up[j]));
    }
  }
}

// gate_up (..., 2 I) fp32 or bf16 -> the same dtype (silu(gate) * up computed in fp32), rows over the threads
template <class T>
at::Tensor silu_mul_of(const at::Tensor& gate_up) {
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  const auto g = gate_up.reshape({rows, 2 * I}).contiguous();
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  const T* gp = g.data_ptr<T>();
  T* op = out.data_ptr<T>();
  // a few thousand values a task: one row of a prompt's MLP is already worth a thread, a step's few rows are not
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    silu_mul_rows<T>(gp, op, I, begin, end);
  });
  return out;
}

// gate_up (..., 2 I) -> silu(gate_up[..., :I]) * gate_up[..., I:]: fp32 in one pass, other dtypes by torch's ops
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be 2 I");
  const int64_t I = gate_up.size(-1) / 2;
  if (gate_up.scalar_type() == at::kFloat && gate_up.device().is_cpu()) return silu_mul_of<float>(gate_up);
  return at::silu(gate_up.narrow(-1, 0, I)).mul_(gate_up.narrow(-1, I, I));
}

at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul_bf16: a bf16 gate_up whose last dimension is 2 I");
  return silu_mul_of<at::BFloat16>(gate_up);
}

// one row of V logits -> its largest value, the first position of it and the second largest
__attribute__((target("avx512f")))
void top2_row(const float* row, int64_t V, float* values, int64_t* index) {
  const float ninf = -std::numeric_limits<float>::infinity();
  // per lane: the largest value, its first position and the second largest (strict > keeps the first)
  __m512 m1 = _mm512_set1_ps(ninf), m2 = m1;
  __m512i i1 = _mm512_set1_epi32(0), at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t j = 0; j < V; j += 16) {
    const __mmask16 m = (__mmask16)(V - j >= 16 ? 0xffff : (1u << (V - j)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(ninf), m, row + j);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(m, v, m1, _CMP_GT_OQ);
    m2 = _mm512_mask_blend_ps(gt, _mm512_max_ps(m2, v), m1);
    m1 = _mm512_mask_blend_ps(gt, m1, v);
    i1 = _mm512_mask_blend_epi32(gt, i1, at);
    at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
  }
  alignas(64) float a1[16], a2[16];
  alignas(64) int32_t ai[16];
  _mm512_store_ps(a1, m1);
  _mm512_store_ps(a2, m2);
  _mm512_store_si512(ai, i1);
  int best = 0;
  for (int l = 1; l < 16; ++l)
    if (a1[l] > a1[best] || (a1[l] == a1[best] && ai[l] < ai[best])) best = l;
  float second = ninf;
  for (int l = 0; l < 16; ++l) second = std::max(second, l == best ? a2[l] : a1[l]);
  values[0] = a1[best];
  values[1] = second;
  *index = ai[best];
}

// x (R, V) fp32 -> values (R, 2): largest and second largest; index (R,): the first position of the largest
std::tuple<at::Tensor, at::Tensor> top2(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu() &&
              x.size(1) >= 2, "top2: x must be a contiguous (R, V) float32 CPU tensor with V >= 2");
  const int64_t R = x.size(0), V = x.size(1);
  auto values = at::empty({R, 2}, x.options());
  auto index = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) top2_row(xp + r * V, V, vp + 2 * r, ip + r);
  });
  return {values, index};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
  m.def("top2(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
  m.impl("top2", &top2);
}
