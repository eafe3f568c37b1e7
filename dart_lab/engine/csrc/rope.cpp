// dart_lab::rope_cache -- a decoding step's rotary embedding and K/V cache write in one op, fp32 (plain
// loops the compiler vectorises: every value is computed on its own, so any vector width gives the same numbers;
// built on first use: dart_lab/kernels.py). Why: between the q|k|v projection and attention an eager
// step spends ~15 small ops a layer (slices, the rotation's mul / neg / cat / mul / add, two casts, two
// index_copy_) on a few hundred numbers a row; their dispatch, not their arithmetic, is the cost.
//
// heads (B, N, H + 2 Hk, D) fp32 contiguous: q, k, v side by side as the fused projection writes them;
// cos, sin (B, N, D) fp32 contiguous; K, V (B, Hk, capacity, D), fp32 or bf16, D contiguous (a layer's view of
// the cache); slots (N,) int64: the cache slot of each position (the same for every row).
// Writes K[b, g, slots[n]] = rotate(k[b, n, g]) and V[b, g, slots[n]] = v[b, n, g] (bf16: rounded to nearest
// even, as a cast does) and returns q rotated, (B, H, N, D) contiguous.
// rotate(x) = x cos + [-x2, x1] sin (x1, x2 the halves of x), each product and the sum rounded separately --
// the arithmetic of the torch ops it replaces, bit for bit (no fused multiply-add: fp-contract off).
// dart_lab::rope_heads -- a prompt's rotary embedding (the K/V it attends over are its own, taken before the
// cache's rounding): heads as above -> q (B, H, N, D) and k (B, Hk, N, D) rotated, v (B, Hk, N, D), fp32 contiguous,
// the positions split over the threads; the rotation and transposes of the torch ops it replaces, bit for bit
// in one pass where the torch ops make five over a prompt's q and k a layer (each a full read and write).
// dart_lab::move_slots -- a batch step's cache compaction: every layer's K and V of row rows[j] at slot src[j]
// copied to slot dst[j], in order (what `K[:, rows, :, dst] = K[:, rows, :, src]` does, without its gather's
// index tensors and temporary: a move is a few hundred bytes, so indexing costs its setup, not the copying).
#pragma GCC optimize("fp-contract=off")
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

// out[0:D] = x cos + [-x2, x1] sin
inline void rotate(const float* x, const float* c, const float* s, float* out, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    out[i] = x[i] * c[i] + (-x[h + i]) * s[i];
    out[h + i] = x[h + i] * c[h + i] + x[i] * s[h + i];
  }
}

// fp32 -> bf16, round to nearest even (finite values: a step's K and V)
inline void store_bf16(const float* x, uint16_t* out, int64_t D) {
  for (int64_t i = 0; i < D; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    out[i] = (uint16_t)((u + ((u >> 16) & 1) + 0x7fff) >> 16);
  }
}

// the checks both rotation ops make of their heads (B, N, H + 2 Hk, D) and cos, sin (B, N, D)
void check_heads(const char* op, const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin, int64_t H,
                 int64_t Hk) {
  TORCH_CHECK(heads.dim() == 4 && heads.scalar_type() == at::kFloat && heads.is_contiguous() && heads.device().is_cpu(),
              op, ": heads must be a contiguous (B, N, H + 2 Hk, D) float32 CPU tensor");
  TORCH_CHECK(heads.size(2) == H + 2 * Hk && heads.size(3) % 2 == 0, op, ": heads must hold H + 2 Hk heads of even size");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous() && cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(0) == heads.size(0) &&
              cos.size(1) == heads.size(1) && cos.size(2) == heads.size(3),
              op, ": cos and sin must be contiguous (B, N, D) float32");
}

at::Tensor rope_cache(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin, at::Tensor K,
                      at::Tensor V, const at::Tensor& slots, int64_t H, int64_t Hk) {
  check_heads("rope_cache", heads, cos, sin, H, Hk);
  const int64_t B = heads.size(0), N = heads.size(1), D = heads.size(3);
  const bool bf16 = K.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || K.scalar_type() == at::kFloat) && V.scalar_type() == K.scalar_type() && K.dim() == 4 &&
              V.sizes() == K.sizes() && K.size(0) == B && K.size(1) == Hk && K.size(3) == D && K.stride(3) == 1 &&
              V.stride(3) == 1, "rope_cache: K and V must be (B, Hk, capacity, D), both float32 or both bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == N, "rope_cache: slots (N,) int64");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(sp[n] >= 0 && sp[n] < K.size(2), "rope_cache: a slot is outside the cache");
  auto q = at::empty({B, H, N, D}, heads.options());
  const float* hp = heads.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  std::vector<float> tmp(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t n = 0; n < N; ++n) {
      const float* row = hp + (b * N + n) * (H + 2 * Hk) * D;
      const float* c = cp + (b * N + n) * D;
      const float* s = snp + (b * N + n) * D;
      for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + ((b * H + h) * N + n) * D, D);
      for (int64_t g = 0; g < Hk; ++g) {
        const int64_t ko = b * K.stride(0) + g * K.stride(1) + sp[n] * K.stride(2);
        const int64_t vo = b * V.stride(0) + g * V.stride(1) + sp[n] * V.stride(2);
        const float* v = row + (H + Hk + g) * D;
        if (bf16) {
          rotate(row + (H + g) * D, c, s, tmp.data(), D);
          store_bf16(tmp.data(), (uint16_t*)K.data_ptr<at::BFloat16>() + ko, D);
          store_bf16(v, (uint16_t*)V.data_ptr<at::BFloat16>() + vo, D);
        } else {
          rotate(row + (H + g) * D, c, s, K.data_ptr<float>() + ko, D);
          std::copy(v, v + D, V.data_ptr<float>() + vo);
        }
      }
    }
  return q;
}

// positions p0..p1 of the B * N a prompt's heads hold
void rope_heads_range(const float* hp, const float* cp, const float* snp, float* qp, float* kp, float* vp, int64_t N,
                      int64_t H, int64_t Hk, int64_t D, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t b = p / N, n = p % N;
    const float* row = hp + p * (H + 2 * Hk) * D;
    const float* c = cp + p * D;
    const float* s = snp + p * D;
    for (int64_t h = 0; h < H; ++h) rotate(row + h * D, c, s, qp + ((b * H + h) * N + n) * D, D);
    for (int64_t g = 0; g < Hk; ++g) {
      rotate(row + (H + g) * D, c, s, kp + ((b * Hk + g) * N + n) * D, D);
      std::copy(row + (H + Hk + g) * D, row + (H + Hk + g + 1) * D, vp + ((b * Hk + g) * N + n) * D);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_heads(const at::Tensor& heads, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t H, int64_t Hk) {
  check_heads("rope_heads", heads, cos, sin, H, Hk);
  const int64_t B = heads.size(0), N = heads.size(1), D = heads.size(3);
  auto q = at::empty({B, H, N, D}, heads.options());
  auto k = at::empty({B, Hk, N, D}, heads.options());
  auto v = at::empty({B, Hk, N, D}, heads.options());
  const float *hp = heads.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  at::parallel_for(0, B * N, 16, [&](int64_t p0, int64_t p1) {
    rope_heads_range(hp, cp, snp, qp, kp, vp, N, H, Hk, D, p0, p1);
  });
  return {q, k, v};
}

// K, V (L, B, Hk, capacity, D) of one dtype, D contiguous; each move reads a slot no earlier move wrote (a
// compaction moves accepted nodes down to the row's end, src >= dst, in order)
void move_slots(at::Tensor K, at::Tensor V, at::IntArrayRef rows, at::IntArrayRef src, at::IntArrayRef dst) {
  TORCH_CHECK(K.dim() == 5 && V.sizes() == K.sizes() && V.scalar_type() == K.scalar_type() && K.stride(4) == 1 &&
              V.stride(4) == 1 && K.device().is_cpu() && V.device().is_cpu(),
              "move_slots: K and V must be (L, B, Hk, capacity, D) CPU tensors of one dtype, D contiguous");
  TORCH_CHECK(rows.size() == src.size() && src.size() == dst.size(), "move_slots: rows, src and dst of one length");
  const int64_t L = K.size(0), Hk = K.size(2), bytes = K.size(4) * K.element_size();
  for (size_t j = 0; j < rows.size(); ++j)
    TORCH_CHECK(rows[j] >= 0 && rows[j] < K.size(1) && src[j] >= 0 && src[j] < K.size(3) && dst[j] >= 0 &&
                dst[j] < K.size(3), "move_slots: a row or slot is outside the cache");
  for (at::Tensor* T : {&K, &V}) {
    char* base = static_cast<char*>(T->data_ptr());
    const int64_t es = T->element_size();
    for (size_t j = 0; j < rows.size(); ++j) {
      if (src[j] == dst[j]) continue;
      for (int64_t l = 0; l < L; ++l)
        for (int64_t g = 0; g < Hk; ++g) {
          char* at = base + (l * T->stride(0) + rows[j] * T->stride(1) + g * T->stride(2)) * es;
          std::memcpy(at + dst[j] * T->stride(3) * es, at + src[j] * T->stride(3) * es, bytes);
        }
    }
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("rope_cache(Tensor heads, Tensor cos, Tensor sin, Tensor(a!) K, Tensor(b!) V, Tensor slots, int H, int Hk) -> Tensor");
  m.def("rope_heads(Tensor heads, Tensor cos, Tensor sin, int H, int Hk) -> (Tensor, Tensor, Tensor)");
  m.def("move_slots(Tensor(a!) K, Tensor(b!) V, int[] rows, int[] src, int[] dst) -> ()");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("rope_cache", &rope_cache);
  m.impl("rope_heads", &rope_heads);
  m.impl("move_slots", &move_slots);
}
