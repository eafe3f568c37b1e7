// One row of RMSNorm: y = w * x / sqrt(mean(x^2) + eps) over n fp32 values -- the arithmetic of torch's F.rms_norm in
// one pass (squares summed on 16 lanes, then reduced). Its one home: csrc/norm.cpp's dart_lab::rms_norm and
// csrc/q4mm.cpp's `norm` argument (a layer's norm inside the 4-bit kernel) both call it, so their numbers are the
// same. A body for vec.h's two builds: include it inside DART_LAB_ISA_BEGIN / END (no include guard on purpose).
// kernels.py rebuilds a kernel when a header here changes.

inline void rms_norm_row(const float* xr, const float* wp, float* yr, int64_t n, double eps) {
  Vf acc = zero();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const Vf v = load(xr + j);
    acc = fmadd(v, v, acc);
  }
  if (j < n) {
    const Vf v = load_first(xr + j, n - j);
    acc = fmadd(v, v, acc);
  }
  const Vf s = set1(1.0f / std::sqrt(reduce_add(acc) / (float)n + (float)eps));
  for (j = 0; j + 16 <= n; j += 16) store(yr + j, mul(load(wp + j), mul(load(xr + j), s)));
  if (j < n) store_first(yr + j, mul(load_first(wp + j, n - j), mul(load_first(xr + j, n - j), s)), n - j);
}
