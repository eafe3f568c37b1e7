// Reading the released DART n-gram trie (fvliang/DART dart/tree_search/cpplib/cpp_ngram/trie_ngram.cpp,
// TrieNgram::load): native little-endian, size_t order, size_t node_count, then per node
//   int32 token, size_t parent, int32 freq, size_t n_children, n_children x (int32 token, size_t id).
// Records have variable length (the children lists), so finding node i means walking nodes 0..i-1: one pass
// in C++ over the mapped file (the Python loop it replaces reads ~1 M nodes/s; the paper's trie has 1.3 B).
// The children records are skipped: each node's parent link says the same.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <cstring>

namespace {

template <typename T>
T read_at(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));  // records are not aligned
  return v;
}

// bytes: (file size,) uint8, the whole file. Returns token (n,) int32, parent (n,) int64, freq (n,) int32, order.
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> trie_nodes(const at::Tensor& bytes) {
  TORCH_CHECK(bytes.scalar_type() == at::kByte && bytes.dim() == 1 && bytes.is_contiguous(), "trie_nodes: uint8 bytes");
  const uint8_t* p = bytes.data_ptr<uint8_t>();
  const uint64_t size = bytes.numel();
  TORCH_CHECK(size >= 16, "truncated: ", size, " bytes, shorter than the 16-byte header");
  const uint64_t order = read_at<uint64_t>(p), n = read_at<uint64_t>(p + 8);
  const uint64_t head = 4 + 8 + 4 + 8, child = 4 + 8;
  TORCH_CHECK(n <= (size - 16) / head, "truncated: the header says ", n, " nodes, the file holds at most ",
              (size - 16) / head);
  auto token = at::empty({(int64_t)n}, at::kInt), freq = at::empty({(int64_t)n}, at::kInt);
  auto parent = at::empty({(int64_t)n}, at::kLong);
  int32_t* tk = token.data_ptr<int32_t>();
  int32_t* fq = freq.data_ptr<int32_t>();
  int64_t* pa = parent.data_ptr<int64_t>();
  uint64_t off = 16;
  for (uint64_t i = 0; i < n; ++i) {
    TORCH_CHECK(off + head <= size, "truncated: node ", i, " of ", n, " starts at byte ", off, " of ", size);
    tk[i] = read_at<int32_t>(p + off);
    const uint64_t par = read_at<uint64_t>(p + off + 4);
    TORCH_CHECK(i == 0 || par < n, "node ", i, " has parent ", par, " outside the ", n, " nodes");
    pa[i] = (int64_t)par;
    fq[i] = read_at<int32_t>(p + off + 12);
    const uint64_t nc = read_at<uint64_t>(p + off + 16);
    TORCH_CHECK(nc <= (size - off - head) / child, "truncated: node ", i, " of ", n, " lists ", nc,
                " children past the end of the file");
    off += head + child * nc;
  }
  TORCH_CHECK(off == size, size - off, " trailing bytes after ", n, " nodes");
  return {token, parent, freq, (int64_t)order};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(dart_lab, m) {
  m.def("trie_nodes(Tensor bytes) -> (Tensor, Tensor, Tensor, int)");
}

TORCH_LIBRARY_IMPL(dart_lab, CPU, m) {
  m.impl("trie_nodes", &trie_nodes);
}
