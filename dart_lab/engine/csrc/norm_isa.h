// csrc/norm.cpp's arithmetic, a body for vec.h's two builds (included inside DART_LAB_ISA_BEGIN / END; no include
// guard on purpose): one row of RMSNorm (rms_norm.h), silu(gate) * up, a row's two largest logits.
#include "rms_norm.h"

// 16 values of a row as fp32 (bf16 widened exactly) and back (bf16 rounded as torch's cast rounds)
template <class T> struct Lanes;
template <> struct Lanes<float> {
  static inline Vf in(const float* p) { return load(p); }
  static inline void out(float* p, Vf v) { store(p, v); }
};
template <> struct Lanes<at::BFloat16> {
  static inline Vf in(const at::BFloat16* p) { return load_bf16((const uint16_t*)p); }
  static inline void out(at::BFloat16* p, Vf v) { store_bf16((uint16_t*)p, v); }
};

// rows [begin, end) of silu_mul: gate_up (rows, 2 I) -> out (rows, I), silu and the product in fp32
template <class T>
void silu_mul_rows(const T* gp, T* op, int64_t I, int64_t begin, int64_t end) {
  // torch's float kernel: two of its vectors a step (32 values with AVX-512, 16 with AVX2), the rest of a row scalar
  const int64_t vec = I / (2 * kNative) * (2 * kNative);
  const Vf one = set1(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = gp + r * 2 * I;
    const T* up = gate + I;
    T* o = op + r * I;
    for (int64_t j = 0; j < vec; j += 16) {
      const Vf x = Lanes<T>::in(gate + j);
      Lanes<T>::out(o + j, mul(div(x, add(one, exp_sleef(neg(x)))), Lanes<T>::in(up + j)));
    }
    for (int64_t j = vec; j < I; ++j) {
      const float x = static_cast<float>(gate[j]);
      const float s = x / (1.f + std::exp(-x));
      o[j] = static_cast<T>(s * static_cast<float>(up[j]));
    }
  }
}

// one row of V logits -> its largest value, the first position of it and the second largest
inline void top2_row(const float* row, int64_t V, float* values, int64_t* index) {
  const float ninf = -std::numeric_limits<float>::infinity();
  // per lane: the largest value, its first position (a float: exact below 2^24) and the second largest (strict >
  // keeps the first); a partial last vector's missing lanes read as -inf, never larger
  Vf m1 = set1(ninf), m2 = m1, i1 = zero(), at = iota();
  const Vf step = set1(16.f);
  for (int64_t j = 0; j < V; j += 16) {
    const Vf v = V - j >= 16 ? load(row + j) : select(gt(iota(), set1((float)(V - j - 1))), set1(ninf),
                                                      load_first(row + j, V - j));
    const Vm up = gt(v, m1);
    m2 = select(up, m1, max(m2, v));
    m1 = select(up, v, m1);
    i1 = select(up, at, i1);
    at = add(at, step);
  }
  float a1[16], a2[16], ai[16];
  store(a1, m1);
  store(a2, m2);
  store(ai, i1);
  int best = 0;
  for (int l = 1; l < 16; ++l)
    if (a1[l] > a1[best] || (a1[l] == a1[best] && ai[l] < ai[best])) best = l;
  float second = ninf;
  for (int l = 0; l < 16; ++l) second = std::max(second, l == best ? a2[l] : a1[l]);
  values[0] = a1[best];
  values[1] = second;
  *index = (int64_t)ai[best];
}
