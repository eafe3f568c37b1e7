// csrc/attention.cpp's arithmetic, a body for vec.h's two builds (included inside DART_LAB_ISA_BEGIN / END after
// attention.cpp's Geometry and constants; no include guard on purpose).

// e^x for x <= 0 (scores minus their max): 2^n e^r with r = x - n ln2, a degree-6 polynomial (Cephes'
// expf coefficients, ~1 ulp); below -87.3 (e^x under float's normal range, and -inf) exactly 0
inline Vf exp_nonpos(Vf x) {
  const Vf floor_x = set1(-87.3f), x0 = x;
  x = max(x, floor_x);
  const Vf n = round_even(mul(x, set1(1.44269504088896341f)));
  Vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  Vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return keep_ge(scale2(p, n), x0, floor_x);
}

// The keys of batch row b that at least one of its query positions sees, as spans [first, end) in order: a key
// every position masks (-inf) weighs exactly 0, so it is not read. In a batch a row's committed keys end where
// its own prompt and tokens do, before the longest row's: the slots between are masked for it, and reading
// them was a share of a batched step's attention that grows with the rows' differences in length.
inline void live_spans(const Geometry& s, const float* M, std::vector<std::pair<int64_t, int64_t>>& spans) {
  spans.clear();
  if (!M) {
    spans.emplace_back(0, s.nk);
    return;
  }
  int64_t open = -1;  // first key of the span being built, -1: none
  for (int64_t j0 = 0; j0 < s.nk; j0 += 16) {
    const int64_t n = std::min<int64_t>(16, s.nk - j0);
    const unsigned in = n == 16 ? 0xffffu : (1u << n) - 1;
    unsigned seen = 0;
    for (int64_t p = 0; p < s.N && seen != in; ++p) seen |= live_lanes(M + p * s.mn + j0, n);
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
inline void single_keys(const Geometry& s, const float* M, std::vector<int64_t>& single) {
  single.assign(s.N, -1);
  if (!M) return;
  for (int64_t p = 0; p < s.N; ++p) {
    int64_t seen = 0, at = -1;
    for (int64_t j0 = 0; j0 < s.nk && seen < 2; j0 += 16) {
      const unsigned live = live_lanes(M + p * s.mn + j0, std::min<int64_t>(16, s.nk - j0));
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
  static inline Vf in(const float* p) { return load(p); }
};
struct BF16 {
  using T = uint16_t;
  static inline Vf in(const uint16_t* p) { return load_bf16(p); }
};

// one key's dot products with the 4 query rows held in qv (scaled), as a 4-lane vector; the K row kAhead keys on
// requested meanwhile (kr: the stride between keys)
template <int C, class E>
__attribute__((always_inline)) inline __m128 key_dots(const Vf (&qv)[kRowsPerPass][C], const typename E::T* kj,
                                                     int64_t kr) {
  constexpr int kLine = 64 / sizeof(typename E::T);  // elements a cache line: one prefetch each
  Vf a[kRowsPerPass];
  for (int i = 0; i < kRowsPerPass; ++i) a[i] = zero();
  for (int c = 0; c < C; ++c) {
    if (16 * c % kLine == 0) _mm_prefetch((const char*)(kj + kAhead * kr + 16 * c), _MM_HINT_T0);
    const Vf kc = E::in(kj + 16 * c);
    for (int i = 0; i < kRowsPerPass; ++i) a[i] = fmadd(qv[i][c], kc, a[i]);
  }
  return sum4(a[0], a[1], a[2], a[3]);
}

// One (batch row b, key head g): rows [r_begin, r_end) of the G query heads sharing it x N positions (R = G N
// rows, contiguous in q and out; row r is position r % N) over the live keys `spans`; a row whose position sees
// one key only (`single`) takes that key's V. C = D / 16 vectors a head.
template <int C, class E>
void head_group(const Geometry& s, const float* q, const typename E::T* k, const typename E::T* v, const float* mask,
                float* out, int64_t b, int64_t g, int64_t r_begin, int64_t r_end, std::vector<float>& sc,
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
    for (int c = 0; c < C; ++c) store(O + r * D + 16 * c, E::in(V + j * s.vr + 16 * c));
  }
  const int64_t R = rows.size();
  sc.resize(R * nk);  // the i-th computed row's scores at i * nk
  std::vector<float> mx(R, -INFINITY), sum(R);
  // 1. scores: 4 query rows at a time held in registers (scaled as loaded), each key's 4 dot products summed
  // together (`sum4`)
  for (int64_t i0 = 0; i0 < R; i0 += kRowsPerPass) {
    const int64_t rn = std::min<int64_t>(kRowsPerPass, R - i0);
    Vf qv[kRowsPerPass][C];
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int c = 0; c < C; ++c)
        qv[i][c] = i < rn ? mul(load(Q + rows[i0 + i] * D + 16 * c), set1(s.scale)) : zero();
    // each row's mask row (a row past rn: row 0's, read and not used)
    const float* mrow[kRowsPerPass];
    for (int i = 0; i < kRowsPerPass; ++i)
      mrow[i] = M ? M + (rows[i0 + (i < rn ? i : 0)] % s.N) * s.mn : nullptr;
    // 4 keys at a time: their 4 x 4 scores in rows' order (`Keys4`), each row's mask added and its running max kept
    // in its 4 lanes, each row's 4 scores stored at once; a span's last keys one by one
    Keys4 m16 = keys4_neg_inf();
    float m4[kRowsPerPass] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    int64_t at = 0;  // the key's place among the live ones
    for (const auto& sp : spans) {
      int64_t j = sp.first;
      for (; j + 4 <= sp.second; j += 4, at += 4) {
        Keys4 z = keys4(key_dots<C, E>(qv, K + j * s.kr, s.kr), key_dots<C, E>(qv, K + (j + 1) * s.kr, s.kr),
                        key_dots<C, E>(qv, K + (j + 2) * s.kr, s.kr), key_dots<C, E>(qv, K + (j + 3) * s.kr, s.kr));
        if (M) z = keys4_add(z, mrow[0] + j, mrow[1] + j, mrow[2] + j, mrow[3] + j);
        m16 = keys4_max(m16, z);
        for (int i = 0; i < rn; ++i) _mm_storeu_ps(sc.data() + (i0 + i) * nk + at, keys4_row(z, i));
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
    for (int i = 0; i < rn; ++i) {
      float l[4];
      _mm_storeu_ps(l, keys4_row(m16, i));
      mx[i0 + i] = std::max(std::max(m4[i], std::max(l[0], l[1])), std::max(l[2], l[3]));
    }
  }
  // 2. softmax numerators and sums
  for (int64_t r = 0; r < R; ++r) {
    float* sr = sc.data() + r * nk;
    const Vf m = set1(mx[r]);
    Vf acc = zero();
    int64_t j = 0;
    for (; j + 16 <= nk; j += 16) {
      const Vf e = exp_nonpos(sub(load(sr + j), m));
      store(sr + j, e);
      acc = add(acc, e);
    }
    if (j < nk) {
      const Vf e = keep_first(exp_nonpos(sub(load_first(sr + j, nk - j), m)), nk - j);
      store_first(sr + j, e, nk - j);
      acc = add(acc, e);
    }
    sum[r] = reduce_add(acc);
  }
  // 3. out = softmax-weighted sum of V
  for (int64_t i0 = 0; i0 < R; i0 += kRowsPerPass) {
    const int64_t rn = std::min<int64_t>(kRowsPerPass, R - i0);
    Vf o[kRowsPerPass][C];
    for (int i = 0; i < kRowsPerPass; ++i)
      for (int c = 0; c < C; ++c) o[i][c] = zero();
    int64_t at = 0;
    for (const auto& sp : spans) {
      for (int64_t j = sp.first; j < sp.second; ++j, ++at) {
        Vf vj[C];
        for (int c = 0; c < C; ++c) {
          if (16 * c % kLine == 0) _mm_prefetch((const char*)(V + (j + kAhead) * s.vr + 16 * c), _MM_HINT_T0);
          vj[c] = E::in(V + j * s.vr + 16 * c);
        }
        for (int i = 0; i < rn; ++i) {
          const Vf p = set1(sc[(i0 + i) * nk + at]);
          for (int c = 0; c < C; ++c) o[i][c] = fmadd(p, vj[c], o[i][c]);
        }
      }
    }
    for (int i = 0; i < rn; ++i) {
      const Vf inv = set1(1.0f / sum[i0 + i]);
      for (int c = 0; c < C; ++c) store(O + rows[i0 + i] * D + 16 * c, mul(o[i][c], inv));
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

// the attention of tasks [t0, t1) (one a (row, key head, block of its query rows)), on one thread
inline void tasks(const Geometry& s, const float* qp, const void* kp, const void* vp, bool bf16, const float* mp,
                  float* op, int64_t D, int64_t n_blocks, int64_t rows_per_block, int64_t R, int64_t t0, int64_t t1) {
  std::vector<float> sc;
  std::vector<std::pair<int64_t, int64_t>> spans;
  std::vector<int64_t> single;
  int64_t spans_of = -1;  // the batch row `spans` and `single` were found for (its key heads share its mask)
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t pair = t / n_blocks, r0 = t % n_blocks * rows_per_block, r1 = std::min(R, r0 + rows_per_block);
    const int64_t b = pair / s.Hk, g = pair % s.Hk;
    if (b != spans_of) {
      live_spans(s, mp ? mp + b * s.mb : nullptr, spans);
      single_keys(s, mp ? mp + b * s.mb : nullptr, single);
      spans_of = b;
    }
    if (bf16)
      by_head_dim<BF16>(D, s, qp, (const uint16_t*)kp, (const uint16_t*)vp, mp, op, b, g, r0, r1, sc, spans, single);
    else
      by_head_dim<F32>(D, s, qp, (const float*)kp, (const float*)vp, mp, op, b, g, r0, r1, sc, spans, single);
  }
}
