// One row of RMSNorm on CPUs with AVX-512: y = w * x / sqrt(mean(x^2) + eps) over n fp32 values -- the arithmetic
// of torch's F.rms_norm in one pass (squares summed on 16 lanes, then reduced). Its one home: csrc/norm.cpp's
// dart_lab::rms_norm and csrc/q4mm.cpp's `norm` argument (a layer's norm inside the 4-bit kernel) both call it, so
// their numbers are the same. kernels.py rebuilds a kernel when a header here changes.
#pragma once
#include <immintrin.h>
#include <cmath>
#include <cstdint>

__attribute__((target("avx512f")))
inline void rms_norm_row(const float* xr, const float* wp, float* yr, int64_t n, double eps) {
  const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
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
