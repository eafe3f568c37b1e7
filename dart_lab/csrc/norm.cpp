// dart_lab::rms_norm -- y = w * x / sqrt(mean(x^2) + eps) over the last dimension, fp32, on CPUs with AVX-512
// (built on first use: dart_lab/kernels.py). The arithmetic of torch's F.rms_norm in one pass a row; why: an eager
// decoding step normalises 2 x layers + 1 times a few rows, where F.rms_norm's several internal ops cost ~5x
// the arithmetic (docs/speed.md). dart_lab::silu_mul -- the MLP's silu(gate) * up from the fused gate|up
// projection's output, torch's own silu and mul called from here: the same numbers, one dispatch from Python
// instead of three (chunk, silu, mul) a layer.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <immintrin.h>
#include <cmath>

namespace {

__attribute__((target("avx512f")))
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
  const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = xp + r * n;
    float* yr = yp + r * n;
    __m512 acc = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_loadu_ps(xr + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (j < n) {
      const __m512 v = _mm512_maskz_loadu_ps(tail, xr + j);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const __m512 s = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)n + (float)eps));
    for (j = 0; j + 16 <= n; j += 16)
      _mm512_storeu_ps(yr + j, _mm512_mul_ps(_mm512_loadu_ps(wp + j), _mm512_mul_ps(_mm512_loadu_ps(xr + j), s)));
    if (j < n)
      _mm512_mask_storeu_ps(yr + j, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, wp + j),
                                                        _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, xr + j), s)));
  }
  return y;
}

// gate_up (..., 2 I) -> silu(gate_up[..., :I]) * gate_up[..., I:]
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: the last dimension must be 2 I");
  const int64_t I = gate_up.size(-1) / 2;
  return at::silu(gate_up.narrow(-1, 0, I)).mul_(gate_up.narrow(-1, I, I));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
}
