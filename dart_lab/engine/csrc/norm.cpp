// dart_lab::rms_norm -- y = w * x / sqrt(mean(x^2) + eps) over the last dimension, fp32, on CPUs with AVX2 + FMA +
// F16C, built for AVX-512 too (csrc/vec.h; built on first use: dart_lab/kernels.py). The arithmetic of torch's
// F.rms_norm in one pass a row; why: an eager decoding step normalises 2 x layers + 1 times a few rows, where
// F.rms_norm's several internal ops cost ~5x the arithmetic (docs/speed.md). dart_lab::silu_mul -- the MLP's
// silu(gate) * up from the fused gate|up projection's output in one pass (fp32; other dtypes by torch's ops):
// torch's fp32 silu as its CPU kernel computes it (x / (1 + exp(-x)) two of its vectors at a time with the Sleef exp
// libtorch exports for the ISA, each row's last values by the scalar formula), then the product -- the numbers of
// F.silu(gate) * up without the intermediate or its dispatches (each layer of an eager step).
// dart_lab::silu_mul_bf16 -- the same from a bf16 gate|up to a bf16 result (a prompt's MLP on bf16 copies of the
// weights): each value widened exactly, the product rounded as torch's cast rounds -- the numbers of .float(),
// silu_mul, .to(bf16) without their fp32 intermediates and seven ops a block of rows (a packed batch of prompts:
// tens of MB a layer). dart_lab::top2 -- each row's largest value, its first index and the second largest value
// (equal to the largest where it occurs twice) in one pass over the logits: what a greedy step reads of them
// (argmax and the near-tie margin), where torch's max and topk(2) read the rows twice and topk's selection costs ~3x
// a max. The arithmetic is in norm_isa.h, built once per instruction set; the ops below pick one at run time.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "vec.h"

DART_LAB_ISA_BEGIN(avx512, "avx512f")
#include "norm_isa.h"
DART_LAB_ISA_END
DART_LAB_ISA_BEGIN(avx2, "avx2,fma,f16c")
#include "norm_isa.h"
DART_LAB_ISA_END

namespace {

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
  const auto row = avx512_here() ? avx512::rms_norm_row : avx2::rms_norm_row;
  // a step's few rows on the calling thread; a prompt's hundreds over the threads (each row's arithmetic alike)
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(xp + r * n, wp, yp + r * n, n, eps);
  });
  return y;
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
  const auto rows_of = avx512_here() ? avx512::silu_mul_rows<T> : avx2::silu_mul_rows<T>;
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(I, 1)), [&](int64_t begin, int64_t end) {
    rows_of(gp, op, I, begin, end);
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
  const auto row = avx512_here() ? avx512::top2_row : avx2::top2_row;
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(xp + r * V, V, vp + 2 * r, ip + r);
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
