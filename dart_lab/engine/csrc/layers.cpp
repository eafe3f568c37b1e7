// dart_lab::q4_layers -- an eager fp32 step's decoder layers in one op, where every linear of the step takes
// our 4-bit kernel and attention our kernel (built on first use: dart_lab/kernels.py). Why: a one-token step
// of a 30-layer model makes ~15 op calls a layer; dispatched from Python (several us each) they are a large
// share of a step whose arithmetic is small (docs/speed.md). Here the same ops are called in the same order
// from C++ through the dispatcher (dart_lab::q4mm, rope_cache, decode_attn, silu_mul and ATen's reshape; each
// layer's two norms and two residual adds inside the q4mm that reads or writes them, with dart_lab::rms_norm's and
// at::add's arithmetic), so the numbers are those of step.decoder_step's eager loop, bit for bit; only the
// Python and the ops between them are gone.
//
// x (B, N, hidden) fp32 contiguous; per layer i: norms[2i], norms[2i+1] (the input and post-attention RMSNorm
// weights, fp32), linears 4i..4i+3 (q|k|v, o, gate|up, down) as q4mm's (wp, sl, n_out, halves) and an
// optional bias; cos, sin (B, N, head_dim); K[i], V[i] the layer's cache (B, Hk, capacity, head_dim); slots
// (N,) int64; mask (B or 1, 1, N, n_keys) additive or None; taps: the layers whose input is an aux state;
// rows (optional): the flat indices into B * N of the nodes the linears compute (a batch step's real nodes: a pad
// node's linears give 0, and it sees only itself). Returns x after the last layer and the taps' inputs in order.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace {

using Opt = c10::optional<at::Tensor>;

at::Tensor q4mm(const at::Tensor& x, const at::Tensor& wp, const at::Tensor& sl, int64_t n, int64_t halves,
                const Opt& bias, const Opt& rows, const Opt& norm, double eps, const Opt& residual) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("dart_lab::q4mm", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                         const Opt&, const Opt&, double, const Opt&)>();
  if (bias.has_value()) {  // x W^T + b first, then the residual, as the eager loop adds them
    auto y = op.call(x, wp, sl, n, halves, rows, norm, eps, c10::nullopt).add_(*bias);
    return residual.has_value() ? at::add(*residual, y) : y;
  }
  return op.call(x, wp, sl, n, halves, rows, norm, eps, residual);
}

at::Tensor rope_cache(const at::Tensor& heads, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& K,
                      const at::Tensor& V, const at::Tensor& slots, int64_t H, int64_t Hk) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("dart_lab::rope_cache", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor,
                                         at::Tensor, const at::Tensor&, int64_t, int64_t)>();
  return op.call(heads, cos, sin, K, V, slots, H, Hk);
}

at::Tensor decode_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Opt& mask, double scale) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("dart_lab::decode_attn", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, double)>();
  return op.call(q, k, v, mask, scale);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("dart_lab::silu_mul", "")
                       .typed<at::Tensor(const at::Tensor&)>();
  return op.call(gate_up);
}

std::tuple<at::Tensor, std::vector<at::Tensor>> q4_layers(
    const at::Tensor& x0, at::TensorList norms, double eps, at::TensorList wp, at::TensorList sl,
    at::IntArrayRef n_out, at::IntArrayRef halves, const c10::List<Opt>& bias, const at::Tensor& cos,
    const at::Tensor& sin, at::TensorList K, at::TensorList V, const at::Tensor& slots, const Opt& mask,
    int64_t n_keys, double scale, int64_t H, int64_t Hk, at::IntArrayRef taps, const Opt& rows) {
  const int64_t L = (int64_t)K.size();
  TORCH_CHECK(x0.dim() == 3 && x0.scalar_type() == at::kFloat && x0.is_contiguous(),
              "q4_layers: x must be a contiguous (B, N, hidden) float32 tensor");
  TORCH_CHECK((int64_t)V.size() == L && (int64_t)norms.size() == 2 * L && (int64_t)wp.size() == 4 * L &&
              (int64_t)sl.size() == 4 * L && (int64_t)n_out.size() == 4 * L && (int64_t)halves.size() == 4 * L &&
              (int64_t)bias.size() == 4 * L, "q4_layers: per layer 2 norms, 4 linears and one K, V");
  const int64_t B = x0.size(0), N = x0.size(1), D = K.empty() ? 0 : K[0].size(3);
  std::map<int64_t, at::Tensor> tapped;
  at::Tensor x = x0;
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t t : taps)
      if (t == i) tapped[i] = x;
    // a linear of layer i; its input through the RMSNorm `norm` first and `residual` added to its output where given
    // (inside q4mm: no op between)
    const auto lin = [&](const at::Tensor& in, int64_t j, const Opt& norm, const Opt& residual) {
      return q4mm(in, wp[4 * i + j], sl[4 * i + j], n_out[4 * i + j], halves[4 * i + j], bias.get(4 * i + j), rows,
                  norm, eps, residual);
    };
    auto heads = lin(x, 0, norms[2 * i], c10::nullopt).view({B, N, H + 2 * Hk, D});
    const auto q = rope_cache(heads, cos, sin, K[i], V[i], slots, H, Hk);
    const auto o = decode_attn(q, K[i].narrow(2, 0, n_keys), V[i].narrow(2, 0, n_keys), mask, scale);
    x = lin(o.transpose(1, 2).reshape({B, N, H * D}), 1, c10::nullopt, x);
    x = lin(silu_mul(lin(x, 2, norms[2 * i + 1], c10::nullopt)), 3, c10::nullopt, x);
  }
  std::vector<at::Tensor> out;
  for (int64_t t : taps) out.push_back(tapped.at(t));
  return {x, out};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("q4_layers(Tensor x, Tensor[] norms, float eps, Tensor[] wp, Tensor[] sl, int[] n_out, int[] halves, "
        "Tensor?[] bias, Tensor cos, Tensor sin, Tensor(a!)[] K, Tensor(b!)[] V, Tensor slots, Tensor? mask, "
        "int n_keys, float scale, int H, int Hk, int[] taps, Tensor? rows=None) -> (Tensor, Tensor[])");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("q4_layers", &q4_layers);
}
