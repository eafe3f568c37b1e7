// dart_lab::rms_norm -- y = w * x / sqrt(mean(x^2) + eps) over the last dimension, fp32, on CPUs with AVX-512
// (built on first use: dart_lab/kernels.py). The arithmetic of torch's F.rms_norm in one pass a row; why: an eager
// decoding step normalises 2 x layers + 1 times a few rows, where F.rms_norm's several internal ops cost ~5x
// the arithmetic (docs/speed.md). dart_lab::silu_mul -- the MLP's silu(gate) * up from the fused gate|up
// projection's output, torch's own silu and mul called from here: the same numbers, one dispatch from Python
// instead of three (chunk, silu, mul) a layer. dart_lab::silu_mul_bf16 -- the same from a bf16 gate|up to a bf16
// result (a prompt's MLP on bf16 copies of the weights): each block of rows widened exactly, torch's fp32 silu and
// mul, rounded once as a cast does -- the numbers of .float(), silu_mul, .to(bf16), without the full fp32
// intermediates (a packed batch of prompts: tens of MB a layer written and read back).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
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

// gate_up (..., 2 I) bf16 -> bf16 (silu(gate) * up computed in fp32), blocks of rows over the threads
at::Tensor silu_mul_bf16(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0,
              "silu_mul_bf16: a bf16 gate_up whose last dimension is 2 I");
  const int64_t I = gate_up.size(-1) / 2, rows = I ? gate_up.numel() / (2 * I) : 0;
  const auto g = gate_up.reshape({rows, 2 * I});
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, gate_up.options());
  const auto o = out.view({rows, I});
  // rows a block: its fp32 copy (64 x 2 I floats, under 1 MB for I = 1536) stays in the core's L2, and the
  // five ops a block are few beside the arithmetic
  constexpr int64_t block = 64;
  at::parallel_for(0, rows, block, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; r += block) {  // inside a parallel region the ops below run on this thread
      const int64_t n = std::min(block, end - r);
      const auto f = g.narrow(0, r, n).to(at::kFloat);
      o.narrow(0, r, n).copy_(at::silu(f.narrow(-1, 0, I)).mul_(f.narrow(-1, I, I)));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("silu_mul_bf16(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("silu_mul_bf16", &silu_mul_bf16);
}
