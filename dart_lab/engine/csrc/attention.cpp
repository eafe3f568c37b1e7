// dart_lab::decode_attn -- attention of a few new positions per row against a K/V cache, for decoding
// steps and small trees on CPUs with AVX2 + FMA + F16C, built for AVX-512 too (csrc/vec.h; built on first use:
// dart_lab/attention.py). The arithmetic is in attention_isa.h, built once per instruction set; the op picks one.
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
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "vec.h"

namespace {

constexpr int kRowsPerPass = 4;  // query rows sharing one pass over K and over V
// K and V rows are requested this many keys ahead of their use: a step's attention streams the cache at close
// to the memory's speed, and the hardware prefetcher alone left part of that on the table
// (docs/speed.md, what was tried)
constexpr int64_t kAhead = 8;

struct Geometry {
  int64_t H, N, Hk, G, nk;
  int64_t kb, kh, kr, vb, vh, vr;  // K and V strides: row, head, key
  int64_t mb, mn;                  // mask strides: row (0: one mask for every row), query position
  float scale;                     // applied to q as it is loaded, as SDPA scales q (the same fp32 products)
};

}  // namespace

// the arithmetic, once per instruction set (vec.h)
DART_LAB_ISA_BEGIN(avx512, "avx512f")
#include "attention_isa.h"
DART_LAB_ISA_END
DART_LAB_ISA_BEGIN(avx2, "avx2,fma,f16c")
#include "attention_isa.h"
DART_LAB_ISA_END

namespace {

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
  const auto run = avx512_here() ? avx512::tasks : avx2::tasks;
  const void* kp = bf16 ? (const void*)k.data_ptr<at::BFloat16>() : (const void*)k.data_ptr<float>();
  const void* vp = bf16 ? (const void*)v.data_ptr<at::BFloat16>() : (const void*)v.data_ptr<float>();
  at::parallel_for(0, pairs * n_blocks, 1, [&](int64_t t0, int64_t t1) {
    run(s, qp, kp, vp, bf16, mp, op, D, n_blocks, rows_per_block, R, t0, t1);
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
