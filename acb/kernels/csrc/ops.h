// Every op of acb's native CPU kernel library (one extension, acb/kernels/cpu.py), declared once:
// torch_bindings.cpp binds them for Python, and one kernel calls another through them as a plain C++
// function (the decode loops in int8_cpu.cpp and bf16_cpu.cpp call RoPE and the decode attention:
// decode_loop.h). Each source file defines its own namespace's ops, compiled with its own flags
// (acb/kernels/cpu.py's SOURCES): fused_cpu.cpp without FMA contraction, paged_decode_cpu.cpp with
// -ffast-math. The loops' classes are in decode_loop.h.
#pragma once
#include "torch_min.h"
#include <vector>

namespace acb {

// fused_cpu.cpp: the fused forward's elementwise ops, bit for bit transformers' modules
namespace fused {
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor rms_norm_f32w(const torch::Tensor& x, const torch::Tensor& w, double eps);
void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t d);
torch::Tensor glu(const torch::Tensor& gu, int64_t act);
torch::Tensor argmax_rows(const torch::Tensor& x);
}  // namespace fused

// paged_decode_cpu.cpp: attention over the paged KV cache (decode and prefill) and its cache writes
namespace attention {
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& pages, const torch::Tensor& lengths, torch::Tensor& out, int64_t page_size,
                  double scale, double softcap, int64_t window);
bool paged_decode_into(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new,
                       torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots,
                       const torch::Tensor& pages, const torch::Tensor& lengths, torch::Tensor& out,
                       int64_t page_size, double scale, double softcap, int64_t window, bool rotate);
bool prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& spans, torch::Tensor& out, double scale, double softcap, int64_t window,
                       bool bf16_weights);
void write_kv(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots);
void write_kv_int8(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots, bool rotate,
                   const c10::optional<torch::Tensor>& readback);
void hadamard(const torch::Tensor& x, torch::Tensor& out, double scale);
bool has_avx512();
bool decode_into();
bool prefill_f32();
bool prefill_bf16();
}  // namespace attention

// int8_cpu.cpp: W8A8 GEMMs (AVX-512 VNNI, or AVX2) and the activations' quantization
namespace int8 {
bool has_vnni();
bool available();
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                         bool gemma, double eps, int64_t group,
                                         const c10::optional<torch::Tensor>& mult, bool rotate);
torch::Tensor linear(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& xoff,
                     const torch::Tensor& w, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& other, torch::ScalarType dtype);
torch::Tensor glu(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& xoff,
                  const torch::Tensor& wg, const torch::Tensor& sg, const c10::optional<torch::Tensor>& bg,
                  const torch::Tensor& wu, const torch::Tensor& su, const c10::optional<torch::Tensor>& bu,
                  int64_t act, torch::ScalarType dtype);
}  // namespace int8

// bf16_cpu.cpp: bf16 GEMMs (AVX-512 BF16, or AVX2 widening the weights) and the norm feeding them
namespace bf16 {
bool available();
bool native();
torch::Tensor pack(const torch::Tensor& w);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n,
                     const c10::optional<torch::Tensor>& bias, const c10::optional<torch::Tensor>& other,
                     torch::ScalarType dtype);
torch::Tensor glu(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& bias,
                  int64_t act, torch::ScalarType dtype);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool gemma);
}  // namespace bf16

// lora_cpu.cpp: LoRA deltas per row group (float32, AVX-512)
namespace lora {
bool available();
void add_(const std::vector<torch::Tensor>& ys, const torch::Tensor& x, const torch::Tensor& at,
          const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& scales, const torch::Tensor& order,
          const torch::Tensor& groups);
torch::Tensor glu_add(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& x, const torch::Tensor& at,
                      const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& scales,
                      const torch::Tensor& order, const torch::Tensor& groups, int64_t act);
}  // namespace lora

}  // namespace acb
