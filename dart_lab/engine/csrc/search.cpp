// dart_lab::beam_candidates -- the level loop of DART's tree search (paper section 3.2, Algorithm 1; the
// released code's C++ Searcher; dart_lab/search.py `_levels` is the reference this equals, bit for bit), with the
// 3-gram lookups of `ngram.NGram.prob`. Why: in numpy a level is ~40 small array calls and a few hundred binary
// searches into tables of millions of keys, each its own walk from the top, so a small tree's search costs about
// as much as the head's forward that drafts it. Built on first use (dart_lab/kernels.py); plain C++.
//
// logp (D, K) float32: each level's log(p + eps) of its top-K draft tokens; tokens (D, K) int64 their target ids;
// eos (E,) int64: the EOS ids; a, b: the context's last two tokens (-1 where absent); w_level, w_logit (D,)
// float32 each level's weights; beam_width; ng: whether the n-gram term applies at levels > 0 (ng0: at level 0
// too), w_ng, eps its weight and eps (float32, passed as double); the n-gram's tables (`NGram`): uni (V,) float64
// dense unigram counts, bi_keys / tri_keys (sorted int64 keys a V + b, (a V + b) V + c) and their uint32 counts
// (passed as int32 of the same bits), V; for dart-ctx's mixed n-gram (w_local > 0) the request's own tables in the
// same layout (luni, lbi_*, ltri_*) and p = (1 - w_local) corpus + w_local local, as `dart_ctx.MixedNGram.prob`.
// Returns every candidate in the reference's order (per level, beam entry j's K expansions): parent (the
// candidate index of its parent, -1 = the root), score (float32), level, column (top-K rank) and the n-gram p
// (float32, NaN where the term does not apply).
//
// Arithmetic as the reference's: float32 products and sums in the same order (no fused multiply-add), the n-gram
// p in float64 rounded to float32, its log taken in float64 and rounded to float32 (search.log32), the beam cut
// by (non-EOS first, score desc, candidate index asc).
#pragma GCC optimize("fp-contract=off")
#include <torch/library.h>
#include <ATen/ATen.h>
#include <algorithm>
#include <functional>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <tuple>
#include <vector>

namespace {

struct Table {
  const int64_t* keys;
  const uint32_t* counts;
  int64_t n;
  // [lo, hi) of the keys in [first, last): one walk from the top per context, then short walks inside it
  std::pair<int64_t, int64_t> range(int64_t first, int64_t last) const {
    const int64_t lo = std::lower_bound(keys, keys + n, first) - keys;
    return {lo, std::lower_bound(keys + lo, keys + n, last) - keys};
  }
  double count(std::pair<int64_t, int64_t> r, int64_t key) const {
    const int64_t* it = std::lower_bound(keys + r.first, keys + r.second, key);
    return (it != keys + r.second && *it == key) ? (double)counts[it - keys] : 0.0;
  }
};

// p(t | a, b) for K tokens t of one context, as NGram.prob: the bigram estimate count(b, t) / max(count(b), 1),
// a seen trigram's count(a, b, t) / count(a, b) instead where (a, b) and (b, t) were both seen
void prob_row(const Table& bi, const Table& tri, const double* uni, int64_t V, int64_t a, int64_t b,
              const int64_t* t, int64_t K, double* out) {
  if (b < 0) {
    std::fill(out, out + K, 0.0);
    return;
  }
  const double c_b = uni[b];
  const auto r_b = bi.range(b * V, (b + 1) * V);
  const double c_ab = a >= 0 ? bi.count(bi.range(a * V + b, a * V + b + 1), a * V + b) : 0.0;
  const auto r_ab = c_ab > 0 ? tri.range((a * V + b) * V, (a * V + b + 1) * V) : std::pair<int64_t, int64_t>{0, 0};
  for (int64_t k = 0; k < K; ++k) {
    const double c_bt = bi.count(r_b, b * V + t[k]);
    double p = c_bt > 0 ? c_bt / std::max(c_b, 1.0) : 0.0;
    if (c_ab > 0 && c_bt > 0) {
      const double c_abt = tri.count(r_ab, (a * V + b) * V + t[k]);
      if (c_abt > 0) p = c_abt / c_ab;
    }
    out[k] = p;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> beam_candidates(
    const at::Tensor& logp, const at::Tensor& tokens, const at::Tensor& eos, int64_t a, int64_t b,
    const at::Tensor& w_level, const at::Tensor& w_logit, int64_t beam_width, bool ng, bool ng0, double w_ng,
    double eps, const at::Tensor& uni, const at::Tensor& bi_keys, const at::Tensor& bi_counts,
    const at::Tensor& tri_keys, const at::Tensor& tri_counts, int64_t V, const at::Tensor& luni,
    const at::Tensor& lbi_keys, const at::Tensor& lbi_counts, const at::Tensor& ltri_keys,
    const at::Tensor& ltri_counts, double w_local) {
  TORCH_CHECK(logp.dim() == 2 && logp.scalar_type() == at::kFloat && logp.is_contiguous() &&
              tokens.sizes() == logp.sizes() && tokens.scalar_type() == at::kLong && tokens.is_contiguous() &&
              eos.dim() == 1 && eos.scalar_type() == at::kLong && eos.is_contiguous(),
              "beam_candidates: logp (D, K) float32, tokens (D, K) int64 and eos (E,) int64, contiguous");
  const int64_t D = logp.size(0), K = logp.size(1);
  TORCH_CHECK(w_level.numel() >= D && w_logit.numel() >= D && w_level.scalar_type() == at::kFloat &&
              w_logit.scalar_type() == at::kFloat && w_level.is_contiguous() && w_logit.is_contiguous(),
              "beam_candidates: w_level, w_logit (D,) float32");
  const Table bi{bi_keys.data_ptr<int64_t>(), reinterpret_cast<const uint32_t*>(bi_counts.data_ptr<int32_t>()),
                 bi_keys.numel()};
  const Table tri{tri_keys.data_ptr<int64_t>(), reinterpret_cast<const uint32_t*>(tri_counts.data_ptr<int32_t>()),
                  tri_keys.numel()};
  TORCH_CHECK(!ng || (uni.scalar_type() == at::kDouble && uni.numel() == V && bi_counts.numel() == bi.n &&
                      tri_counts.numel() == tri.n), "beam_candidates: the n-gram tables do not match");
  // dart-ctx's mixed n-gram: (1 - w) corpus + w local, the local tables over the request's own tokens (same V)
  const bool mixed = ng && w_local > 0.0;
  const Table lbi{mixed ? lbi_keys.data_ptr<int64_t>() : nullptr,
                  mixed ? reinterpret_cast<const uint32_t*>(lbi_counts.data_ptr<int32_t>()) : nullptr,
                  mixed ? lbi_keys.numel() : 0};
  const Table ltri{mixed ? ltri_keys.data_ptr<int64_t>() : nullptr,
                   mixed ? reinterpret_cast<const uint32_t*>(ltri_counts.data_ptr<int32_t>()) : nullptr,
                   mixed ? ltri_keys.numel() : 0};
  TORCH_CHECK(!mixed || (luni.scalar_type() == at::kDouble && luni.numel() == V && lbi_counts.numel() == lbi.n &&
                         ltri_counts.numel() == ltri.n), "beam_candidates: the local n-gram's tables do not match");
  const double* lun = mixed ? luni.data_ptr<double>() : nullptr;
  std::vector<double> pl(mixed ? logp.size(1) : 0);
  const float* lp = logp.data_ptr<float>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  std::vector<char> is_eos(D * K);  // which candidates are EOS
  const int64_t* ep_ids = eos.data_ptr<int64_t>();
  for (int64_t i = 0; i < D * K; ++i) is_eos[i] = std::find(ep_ids, ep_ids + eos.numel(), tok[i]) != ep_ids + eos.numel();
  const float *wl = w_level.data_ptr<float>(), *wg = w_logit.data_ptr<float>();
  const double* un = ng ? uni.data_ptr<double>() : nullptr;
  const float wn = (float)w_ng, ep = (float)eps;
  if (ng)
    for (int64_t i = 0; i < D * K; ++i)
      TORCH_CHECK(tok[i] >= 0 && tok[i] < V, "beam_candidates: a token is outside the n-gram's vocabulary");
  TORCH_CHECK(!ng || (a < V && b < V), "beam_candidates: a context token is outside the n-gram's vocabulary");

  std::vector<int64_t> c_par, c_lvl, c_col;
  std::vector<float> c_score, c_ng;
  // the current beam: candidate index, score, the last two tokens of context + path
  std::vector<int64_t> b_idx{-1}, b_c0{a}, b_c1{b};
  std::vector<float> b_score{0.0f};
  std::vector<double> p(K);
  std::vector<float> inc(K), score;
  std::vector<int64_t> order;
  int64_t n_cand = 0;
  for (int64_t l = 0; l < D && !b_idx.empty(); ++l) {
    const int64_t B = (int64_t)b_idx.size();
    const float* lp_l = lp + l * K;
    const int64_t* tok_l = tok + l * K;
    const bool term = ng && (l > 0 || ng0);
    score.resize(B * K);
    for (int64_t e = 0; e < B; ++e) {
      if (term) {
        prob_row(bi, tri, un, V, b_c0[e], b_c1[e], tok_l, K, p.data());
        if (mixed) {  // as MixedNGram.prob: (1 - w) corpus + w local, in float64
          prob_row(lbi, ltri, lun, V, b_c0[e], b_c1[e], tok_l, K, pl.data());
          for (int64_t k = 0; k < K; ++k) p[k] = (1.0 - w_local) * p[k] + w_local * pl[k];
        }
      }
      for (int64_t k = 0; k < K; ++k) {
        float x = lp_l[k] * wg[l];
        float pk = std::numeric_limits<float>::quiet_NaN();
        if (term) {
          pk = (float)p[k];
          const float lg = (float)std::log((double)(pk + ep));
          x = x + lg * wn;
        }
        const float s = b_score[e] + wl[l] * x;
        score[e * K + k] = s;
        c_par.push_back(b_idx[e]);
        c_score.push_back(s);
        c_lvl.push_back(l);
        c_col.push_back(k);
        c_ng.push_back(pk);
      }
    }
    // the next beam: non-EOS first, then score desc, then candidate index; EOS paths are never expanded
    order.resize(B * K);
    std::iota(order.begin(), order.end(), 0);
    const int64_t take = std::min<int64_t>(beam_width, B * K);
    std::partial_sort(order.begin(), order.begin() + take, order.end(), [&](int64_t i, int64_t j) {
      const bool ei = is_eos[l * K + i % K], ej = is_eos[l * K + j % K];
      if (ei != ej) return !ei;
      if (score[i] != score[j]) return score[i] > score[j];
      return i < j;
    });
    std::vector<int64_t> n_idx, n_c0, n_c1;
    std::vector<float> n_score;
    for (int64_t r = 0; r < take; ++r) {
      const int64_t j = order[r];
      if (is_eos[l * K + j % K]) continue;
      n_idx.push_back(n_cand + j);
      n_score.push_back(score[j]);
      n_c0.push_back(b_c1[j / K]);
      n_c1.push_back(tok_l[j % K]);
    }
    b_idx.swap(n_idx), b_score.swap(n_score), b_c0.swap(n_c0), b_c1.swap(n_c1);
    n_cand += B * K;
  }
  const int64_t M = (int64_t)c_score.size();
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  const auto fopt = at::TensorOptions().dtype(at::kFloat);
  auto par = at::empty({M}, lopt), lvl = at::empty({M}, lopt), col = at::empty({M}, lopt);
  auto sc = at::empty({M}, fopt), pn = at::empty({M}, fopt);
  std::copy(c_par.begin(), c_par.end(), par.data_ptr<int64_t>());
  std::copy(c_lvl.begin(), c_lvl.end(), lvl.data_ptr<int64_t>());
  std::copy(c_col.begin(), c_col.end(), col.data_ptr<int64_t>());
  std::copy(c_score.begin(), c_score.end(), sc.data_ptr<float>());
  std::copy(c_ng.begin(), c_ng.end(), pn.data_ptr<float>());
  return {par, sc, lvl, col, pn};
}


// dart_lab::closed_tree -- tree.best_closed_tree's selection (its reference, equal to it; tests/test_tree.py): the
// best max_nodes of M scored candidates, ranked by (score desc, depth asc, index asc), each kept only once its
// parent is (parents index the candidates, -1 = the root's child). scores (M,) float64 (a float32 search's scores
// widened exactly), depths, parents (M,) int64. Returns the kept candidates in the tree's node order (by depth,
// then rank), their ranks (the order they were taken in) and each one's parent as a tree node (0 = the root).
std::tuple<at::Tensor, at::Tensor, at::Tensor> closed_tree(const at::Tensor& parents, const at::Tensor& scores,
                                                           const at::Tensor& depths, int64_t max_nodes) {
  TORCH_CHECK(parents.dim() == 1 && parents.scalar_type() == at::kLong && parents.is_contiguous() &&
              scores.sizes() == parents.sizes() && scores.scalar_type() == at::kDouble && scores.is_contiguous() &&
              depths.sizes() == parents.sizes() && depths.scalar_type() == at::kLong && depths.is_contiguous(),
              "closed_tree: parents, scores (float64) and depths (M,), contiguous");
  const int64_t M = parents.numel();
  const int64_t* par = parents.data_ptr<int64_t>();
  const double* sc = scores.data_ptr<double>();
  const int64_t* dep = depths.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) TORCH_CHECK(par[i] >= -1 && par[i] < M, "closed_tree: a parent is outside");
  const auto better = [&](int64_t i, int64_t j) {
    if (sc[i] != sc[j]) return sc[i] > sc[j];
    if (dep[i] != dep[j]) return dep[i] < dep[j];
    return i < j;
  };
  std::vector<int64_t> pool;
  if (M > max_nodes && max_nodes > 0) {  // only the candidates that can make the cut need a full sort
    std::vector<double> s(sc, sc + M);
    std::nth_element(s.begin(), s.begin() + (max_nodes - 1), s.end(), std::greater<double>());
    const double kth = s[max_nodes - 1];
    for (int64_t i = 0; i < M; ++i)
      if (sc[i] >= kth) pool.push_back(i);
  } else {
    pool.resize(M);
    std::iota(pool.begin(), pool.end(), 0);
  }
  std::vector<char> taken(M, 0);
  std::vector<int64_t> chosen;
  while (true) {
    std::sort(pool.begin(), pool.end(), better);
    for (int64_t i : pool) {
      if ((int64_t)chosen.size() >= max_nodes) break;
      if (!taken[i] && (par[i] < 0 || taken[par[i]])) {
        taken[i] = 1;
        chosen.push_back(i);
      }
    }
    if ((int64_t)chosen.size() >= max_nodes || (int64_t)pool.size() == M) break;
    pool.resize(M);  // a closure skip left room: rank every candidate (exact ties only)
    std::iota(pool.begin(), pool.end(), 0);
  }
  const int64_t n = (int64_t)chosen.size();
  std::vector<int64_t> rank_of(M, -1), by(n);
  for (int64_t r = 0; r < n; ++r) rank_of[chosen[r]] = r;
  std::iota(by.begin(), by.end(), 0);  // tree order: depth, then rank
  std::sort(by.begin(), by.end(), [&](int64_t x, int64_t y) {
    const int64_t dx = dep[chosen[x]], dy = dep[chosen[y]];
    return dx != dy ? dx < dy : x < y;
  });
  const auto lopt = at::TensorOptions().dtype(at::kLong);
  auto out = at::empty({n}, lopt), ranks = at::empty({n}, lopt), tpar = at::empty({n}, lopt);
  int64_t *o = out.data_ptr<int64_t>(), *rk = ranks.data_ptr<int64_t>(), *tp = tpar.data_ptr<int64_t>();
  std::vector<int64_t> pos(M, 0);  // candidate -> its tree node (1..n)
  for (int64_t j = 0; j < n; ++j) {
    o[j] = chosen[by[j]];
    rk[j] = by[j];
    pos[o[j]] = j + 1;
  }
  for (int64_t j = 0; j < n; ++j) tp[j] = par[o[j]] < 0 ? 0 : pos[par[o[j]]];
  return {out, ranks, tpar};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("beam_candidates(Tensor logp, Tensor tokens, Tensor eos, int a, int b, Tensor w_level, Tensor w_logit, "
        "int beam_width, bool ng, bool ng0, float w_ng, float eps, Tensor uni, Tensor bi_keys, Tensor bi_counts, "
        "Tensor tri_keys, Tensor tri_counts, int V, Tensor luni, Tensor lbi_keys, Tensor lbi_counts, Tensor ltri_keys, "
        "Tensor ltri_counts, float w_local) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("closed_tree(Tensor parents, Tensor scores, Tensor depths, int max_nodes) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("beam_candidates", &beam_candidates);
  m.impl("closed_tree", &closed_tree);
}
