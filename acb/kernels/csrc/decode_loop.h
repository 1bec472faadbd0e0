// The decode loops: a whole decode-only step's layers in one native call, on the int8 GEMMs (int8_cpu.cpp)
// or the bf16 ones (bf16_cpu.cpp), calling RoPE (fused_cpu.cpp) and the one-call decode attention
// (paged_decode_cpu.cpp) as the functions they are (ops.h): one library, so no addresses pass through
// Python. What the two loops share is here; each defines its Layer and its layer() in its own file.
#pragma once
#include "ops.h"
#include <vector>
#include <algorithm>
#include <atomic>
#include <ATen/Parallel.h>

namespace acb {

// A layer's attention shape: the query and key columns of its joined q/k/v projection, its heads, kv
// heads and head dim, its sliding window (0: none) and its scale
struct AttentionShape {
  int64_t nq, nk, heads, kv_heads, d, window;
  double scaling;
};

// A decode-only step's rows as paged_decode_into takes them: each row's new slot, its pages and its
// context length, the page size, whether the pages hold rotated keys (int8 pages), and the caches
struct DecodeStep {
  const torch::Tensor& slots;
  const torch::Tensor& pages;
  const torch::Tensor& lengths;
  int64_t page_size;
  bool rotate;
  std::vector<torch::Tensor>& k_caches;
  std::vector<torch::Tensor>& v_caches;
};

// One layer's attention in a decode loop, as the Python forwards run it: RoPE in place on q and k (column
// views of the joined projection qkv [T, nq + 2 nk]), each of q, k, v rounded to `round_to` where given
// (the bf16 forward's float32 projection), then the one-call decode attention: the rows' keys and values
// written into layer i's caches, the output a new [T, heads * d] of q's dtype. An undefined tensor where
// the attention declines (at layer 0 only, having written nothing: nothing that decides it changes
// between a step's layers).
struct DecodeAttention {
  static void check(const DecodeStep& s, int64_t layers) {
    TORCH_CHECK(static_cast<int64_t>(s.k_caches.size()) >= layers &&
                    static_cast<int64_t>(s.v_caches.size()) >= layers,
                "DecodeLoop.run: a key and a value cache per layer");
  }

  torch::Tensor operator()(int64_t i, const torch::Tensor& qkv, const AttentionShape& a, const torch::Tensor& cos,
                           const torch::Tensor& sin, const DecodeStep& s,
                           c10::optional<torch::ScalarType> round_to = c10::nullopt) const {
    const int64_t T = qkv.size(0);
    torch::Tensor q = qkv.narrow(1, 0, a.nq), k = qkv.narrow(1, a.nq, a.nk), v = qkv.narrow(1, a.nq + a.nk, a.nk);
    fused::rope_(q, cos, sin, a.d);
    fused::rope_(k, cos, sin, a.d);
    if (round_to) q = q.to(*round_to), k = k.to(*round_to), v = v.to(*round_to);
    torch::Tensor out = torch::empty({T, a.heads * a.d}, q.options());
    torch::Tensor out3 = out.view({T, a.heads, a.d});
    if (!attention::paged_decode_into(q.view({T, a.heads, a.d}), k.view({T, a.kv_heads, a.d}),
                                      v.view({T, a.kv_heads, a.d}), s.k_caches[i], s.v_caches[i], s.slots, s.pages,
                                      s.lengths, out3, s.page_size, a.scaling, 0.0, a.window, s.rotate)) {
      TORCH_CHECK(i == 0, "DecodeLoop.run: the decode attention declined layer ", i, " after taking layer 0");
      return torch::Tensor();
    }
    return out;
  }
};

// What the two DecodeLoops share: the layers they hold (Layer: each loop's own), the attention step, and
// run(): the float32 residual stream x [T, hidden] through every layer of a decode-only step, each by
// Derived::layer(i, layer, x, cos, sin, step), which returns the stream after it, or an undefined tensor
// where the attention declined (at layer 0, having written nothing): run then returns None.
//
// On two threads, a step of at least split_rows() rows runs as two halves, one per thread, each through
// every layer on its own (every kernel call inside runs on its thread alone: ATen runs a parallel_for
// inline within a parallel region). A row's outputs do not depend on which other rows share its call
// (the GEMMs, the quantization, RoPE and the attention compute row by row), so the halves give the same
// bits as the whole. What it saves: each kernel call's fork and join and its wait for the slower thread
// (~10 calls a layer). SmolLM2 at 45 rows a decode step: a few percent of an int8 step, nothing
// measurable for bf16, whose GEMMs read twice the weight bytes and now read them once per half
// (benchmarks/decode_halves.py; docs/performance.md). The halves hold about equal work: a row costs its
// context length plus kSplitRowKeys, its GEMM work counted as keys of attention (SmolLM2 int8 on the
// 2-core Zen 5 host: ~5 us of GEMMs a row and layer, ~23 ns of attention a key and layer).
//
// Each loop's file instantiates it for its loop (the `extern template` below keeps torch_bindings.cpp
// from compiling another copy).
template <typename Derived, typename Layer>
class DecodeLayers {
 public:
  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

  // The fewest rows a step is split at (0: never); tests set it to cover both ways
  int64_t split_rows() const { return split_rows_; }
  void set_split_rows(int64_t rows) {
    TORCH_CHECK(rows >= 0, "DecodeLoop.split_rows must be >= 0 (0: never split)");
    split_rows_ = rows;
  }
  // The steps run as two halves so far
  int64_t split_steps() const { return split_steps_.load(); }

  c10::optional<torch::Tensor> run(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                   std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                                   const torch::Tensor& slots, const torch::Tensor& pages,
                                   const torch::Tensor& lengths, int64_t page_size, bool rotate) const {
    const DecodeStep step{slots, pages, lengths, page_size, rotate, k_caches, v_caches};
    DecodeAttention::check(step, size());
    const int64_t T = x.size(0);
    if (split_rows_ > 0 && T >= std::max<int64_t>(split_rows_, 2) && at::get_num_threads() == 2 &&
        !at::in_parallel_region() && lengths.numel() == T && slots.numel() == T && pages.size(0) == T)
      return halves(x, cos, sin, step, T);
    return rows(x, cos, sin, step);
  }

 protected:
  DecodeAttention attend_;
  std::vector<Layer> layers_;

 private:
  static constexpr int64_t kSplitRowKeys = 220;
  int64_t split_rows_ = 16;
  mutable std::atomic<int64_t> split_steps_{0};

  c10::optional<torch::Tensor> rows(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                    const DecodeStep& step) const {
    for (int64_t i = 0; i < size(); ++i) {
      x = static_cast<const Derived&>(*this).layer(i, layers_[i], x, cos, sin, step);
      if (!x.defined()) return c10::nullopt;
    }
    return x;
  }

  // The step as two halves of rows [0, h) and [h, T), one per thread (see above)
  c10::optional<torch::Tensor> halves(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                      const DecodeStep& s, int64_t T) const {
    const torch::Tensor len = s.lengths.to(torch::kInt64).contiguous();
    const int64_t* l = len.data_ptr<int64_t>();
    int64_t total = 0;
    for (int64_t b = 0; b < T; ++b) total += l[b] + kSplitRowKeys;
    int64_t h = 0;
    for (int64_t before = 0; h < T && 2 * (before + l[h] + kSplitRowKeys) <= total; ++h) before += l[h] + kSplitRowKeys;
    h = std::clamp<int64_t>(h, 1, T - 1);
    c10::optional<torch::Tensor> out[2];
    at::parallel_for(0, 2, 1, [&](int64_t begin, int64_t end) {
      for (int64_t part = begin; part < end; ++part) {
        const int64_t first = part ? h : 0, n = part ? T - h : h;
        const torch::Tensor slots = s.slots.narrow(0, first, n), pages = s.pages.narrow(0, first, n),
                            lengths = s.lengths.narrow(0, first, n);
        const DecodeStep step{slots, pages, lengths, s.page_size, s.rotate, s.k_caches, s.v_caches};
        out[part] = rows(x.narrow(0, first, n), cos.narrow(cos.dim() - 2, first, n),
                         sin.narrow(sin.dim() - 2, first, n), step);
      }
    });
    if (!out[0] || !out[1]) return c10::nullopt;  // declined (at layer 0: the same for both halves)
    ++split_steps_;
    // the halves one after the other (at::cat's headers cost a source file ~5 s of compiling)
    torch::Tensor whole = torch::empty({T, out[0]->size(1)}, out[0]->options());
    whole.narrow(0, 0, h).copy_(*out[0]);
    whole.narrow(0, h, T - h).copy_(*out[1]);
    return whole;
  }
};

// int8_cpu.cpp's loop: acb.model.quantization.Int8Forward's decode-only step (int8_cpu.cpp says which
// models it takes whole)
namespace int8 {
struct Layer {
  c10::optional<torch::Tensor> norm[2];
  double eps[2];
  int64_t group[4];
  c10::optional<torch::Tensor> mult[4];
  bool rot[4];
  torch::Tensor w[5], s[5];
  c10::optional<torch::Tensor> b[5];
  AttentionShape attn;
  int64_t act;
};

class DecodeLoop : public DecodeLayers<DecodeLoop, Layer> {
 public:
  explicit DecodeLoop(torch::ScalarType dtype);
  void add_layer(const std::vector<torch::Tensor>& norms, const std::vector<double>& eps,
                 const std::vector<int64_t>& groups, const std::vector<c10::optional<torch::Tensor>>& mults,
                 const std::vector<bool>& rotated, const std::vector<torch::Tensor>& weights,
                 const std::vector<torch::Tensor>& scales, const std::vector<c10::optional<torch::Tensor>>& biases,
                 int64_t nq, int64_t nk, int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling,
                 int64_t window, int64_t act);
  torch::Tensor layer(int64_t i, const Layer& l, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                      const DecodeStep& step) const;

 private:
  torch::ScalarType dtype_;
};
}  // namespace int8
extern template class DecodeLayers<int8::DecodeLoop, int8::Layer>;

// bf16_cpu.cpp's loop: acb.model.fused.FusedForward's decode-only step on acb's bf16 GEMMs
namespace bf16 {
struct Layer {
  torch::Tensor norm[2];
  double eps[2];
  torch::Tensor w[4];
  int64_t n[4];
  c10::optional<torch::Tensor> b[4];
  AttentionShape attn;
  int64_t act;
};

class DecodeLoop : public DecodeLayers<DecodeLoop, Layer> {
 public:
  void add_layer(const std::vector<torch::Tensor>& norms, const std::vector<double>& eps,
                 const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& columns,
                 const std::vector<c10::optional<torch::Tensor>>& biases, int64_t nq, int64_t nk, int64_t heads,
                 int64_t kv_heads, int64_t head_dim, double scaling, int64_t window, int64_t act);
  torch::Tensor layer(int64_t i, const Layer& l, torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                      const DecodeStep& step) const;
};
}  // namespace bf16
extern template class DecodeLayers<bf16::DecodeLoop, bf16::Layer>;

}  // namespace acb
