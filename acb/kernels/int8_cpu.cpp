// int8 GEMMs for acb's quantized CPU forward (acb/quantization.py): W8A8 on AVX-512 VNNI.
//
// Weights: int8, symmetric, one scale per output channel, packed once into VNNI's layout
//   [N/16][K/4][16][4]: a 64-byte load holds 4 consecutive k of 16 output channels, the
//   operand order of vpdpbusd. N is a multiple of 16 and K of 4 (acb.quantization checks).
// Activations: quantized per row (token) and per group of G consecutive channels at run time,
//   symmetric: q = round(x * 127 / max|x over the group|), stored as unsigned bytes q + 128
//   (vpdpbusd multiplies unsigned by signed bytes); the +128 is taken back out with each
//   weight column's sum over the group: sum((q+128) w) - 128 sum(w). G = K is one scale per
//   token; smaller groups keep one outlier channel from flattening a whole token's precision
//   (SmolLM2-135M: perplexity +4.9 % per token, +0.95 % per group of 64; docs/performance.md).
// out[m, n] = wscale[n] * sum over groups g of (acc_g[m, n] - 128 colsum_g[n]) * xscale[m, g]
//   (+ bias[n]): int32 within a group, float32 across groups; then an epilogue in float32:
//   none, + other[m, n] (the residual add), or act(gate) * up for the MLP's two projections
//   (SiLU or GELU-tanh), stored as float32 or bfloat16.
//
// Tiles: 6 rows x 32 columns (12 zmm accumulators); the threads split (column tile, row
// chunk) pairs, column tiles outermost so each thread keeps its weight panels in its L2.
#include "torch_min.h"
#include "bf16_scalar.h"
#include <immintrin.h>
#include "vec_math.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#endif

using acb_bf16::to_bf16;  // bf16 <-> float32 by bits (acb/kernels/bf16_scalar.h)
using acb_bf16::widen;

enum Epilogue : int64_t { kNone = 0, kAdd = 1 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

#if defined(__AVX512F__)
using acb_vec::act512;  // SiLU (kSilu) / GELU-tanh (kGeluTanh), acb/kernels/vec_math.h

inline __m512 load_row(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_row(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store_row(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store_row(uint16_t* p, __m512 v) {
  // round to nearest even, as PyTorch rounds (activations are finite here)
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// acc + a (unsigned bytes) . b (signed bytes), as _mm512_dpbusd_epi32, written as one instruction:
// GCC 12 compiles the intrinsic in dot_tile's loop with two register copies per accumulator and
// k step (24 vmovdqa beside 12 vpdpbusd in the 6 x 32 tile)
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// acc[r][j] = sum over the ng groups of (int32 dot of the group - 128 colsum) * xscale[r, g]:
// MR rows, NB 16-column blocks, g4 = G / 4 steps of 4 channels per group. colsum points at the
// tile's first block in the [N/16][ng][16] layout; xscale at the tile's first row ([M][ng]).
template <int MR, int NB>
inline void dot_tile(const uint8_t* x, int64_t xs, const int8_t* w, int64_t panel, int64_t ng, int64_t g4,
                     const int32_t* colsum, const float* xscale, __m512 (&acc)[MR][NB]) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i iacc[MR][NB];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) iacc[r][j] = _mm512_setzero_si512();
    for (int64_t k = g * g4; k < (g + 1) * g4; ++k) {
      __m512i b[NB];
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) b[j] = _mm512_loadu_si512(w + j * panel + k * 64);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t a32;
        std::memcpy(&a32, x + r * xs + 4 * k, 4);
        const __m512i a = _mm512_set1_epi32(a32);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) iacc[r][j] = dpbusd(iacc[r][j], a, b[j]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) {
      const __m512i c = _mm512_slli_epi32(_mm512_loadu_si512(colsum + (j * ng + g) * 16), 7);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iacc[r][j], c)),
                                    _mm512_set1_ps(xscale[r * ng + g]), acc[r][j]);
    }
  }
}

// The float value of acc[r][j] (already summed over the groups with their activation scales): acc * wscale (+ bias)
inline __m512 dequant(__m512 acc, const float* ws, const float* bias) {
  const __m512 v = _mm512_mul_ps(acc, _mm512_loadu_ps(ws));
  return bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias)) : v;
}

struct Weight {
  const int8_t* w;  // packed [N/16][K/4][16][4]
  const int32_t* colsum;  // [N/16][ng][16]: each group's column sums
  const float* scale;
  const float* bias;  // or null
};

// One tile: rows [m0, m0 + MR) x 16-column blocks [b0, b0 + NB) of the output; ng activation groups.
template <typename T, int MR, int NB>
void tile(const uint8_t* xq, int64_t k, int64_t ng, const float* xscale, const Weight& w, const Weight* up,
          int64_t act, int64_t epi, const T* other, int64_t other_stride, T* out, int64_t out_stride, int64_t m0,
          int64_t b0) {
  const int64_t k4 = k / 4, panel = k4 * 64, g4 = k4 / ng;
  const uint8_t* x = xq + m0 * k;
  const float* xs = xscale + m0 * ng;
  __m512 acc[MR][NB];
  dot_tile<MR, NB>(x, k, w.w + b0 * panel, panel, ng, g4, w.colsum + b0 * ng * 16, xs, acc);
  __m512 v[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (b0 + j) * 16;
      v[r][j] = dequant(acc[r][j], w.scale + n, w.bias ? w.bias + n : nullptr);
    }
  if (up != nullptr) {  // v holds the gate: act(gate) * up
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) v[r][j] = act512(v[r][j], act);
    dot_tile<MR, NB>(x, k, up->w + b0 * panel, panel, ng, g4, up->colsum + b0 * ng * 16, xs, acc);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) {
        const int64_t n = (b0 + j) * 16;
        v[r][j] = _mm512_mul_ps(v[r][j], dequant(acc[r][j], up->scale + n, up->bias ? up->bias + n : nullptr));
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (b0 + j) * 16;
      __m512 o = v[r][j];
      if (epi == kAdd) o = _mm512_add_ps(o, load_row(other + (m0 + r) * other_stride + n));
      store_row(out + (m0 + r) * out_stride + n, o);
    }
}

template <typename T, int NB>
void tile_rows(int64_t rows, const uint8_t* xq, int64_t k, int64_t ng, const float* xscale, const Weight& w, const Weight* up,
               int64_t act, int64_t epi, const T* other, int64_t os, T* out, int64_t ostride, int64_t m0, int64_t b0) {
  switch (rows) {
    case 6: tile<T, 6, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
    case 5: tile<T, 5, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
    case 4: tile<T, 4, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
    case 3: tile<T, 3, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
    case 2: tile<T, 2, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
    default: tile<T, 1, NB>(xq, k, ng, xscale, w, up, act, epi, other, os, out, ostride, m0, b0); break;
  }
}

template <typename T>
void gemm(const torch::Tensor& xq, const torch::Tensor& xscale, const Weight& w, const Weight* up, int64_t act,
          int64_t epi, const torch::Tensor* other, torch::Tensor& out, int64_t n) {
  const int64_t m = xq.size(0), k = xq.size(1), blocks = n / 16, ng = xscale.numel() / std::max<int64_t>(m, 1);
  constexpr int64_t kMR = 6;
  // column tiles of 2 blocks (32 columns: 12 accumulators; tiles of 64 columns, 24 accumulators,
  // spilled registers and ran at about half the rate: 731 against 1320 GOPS at 1024 x 576 x 1536;
  // with dpbusd's register copies gone, no faster than 2 blocks either);
  // row chunks of 96 rows, so a tile's weight panel is reused from L2 across 16 row tiles
  constexpr int64_t nb = 2;
  const int64_t col_tiles = (blocks + nb - 1) / nb, chunk = 96, row_chunks = (m + chunk - 1) / chunk;
  const uint8_t* xp = xq.data_ptr<uint8_t>();
  const float* sp = xscale.data_ptr<float>();
  const T* op = other ? reinterpret_cast<const T*>(other->data_ptr()) : nullptr;
  const int64_t os = other ? other->stride(0) : 0;
  T* outp = reinterpret_cast<T*>(out.data_ptr());
  const int64_t ostride = out.stride(0);
  at::parallel_for(0, col_tiles * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ct = item / row_chunks, rc = item % row_chunks;
      const int64_t b0 = ct * nb, nbs = std::min(nb, blocks - b0);
      for (int64_t m0 = rc * chunk; m0 < std::min(m, (rc + 1) * chunk); m0 += kMR) {
        const int64_t rows = std::min(kMR, m - m0);
        for (int64_t b = b0; b < b0 + nbs;) {  // a whole tile, or the one block left at the end
          const int64_t left = b0 + nbs - b;
          if (left >= 2) { tile_rows<T, 2>(rows, xp, k, ng, sp, w, up, act, epi, op, os, outp, ostride, m0, b); b += 2; }
          else { tile_rows<T, 1>(rows, xp, k, ng, sp, w, up, act, epi, op, os, outp, ostride, m0, b); b += 1; }
        }
      }
    }
  });
}
#endif

// ng: the activations' groups per row (xscale [M, ng]); the weight's colsum holds ng sums per column
void check_weight(const torch::Tensor& w, const torch::Tensor& colsum, const torch::Tensor& scale,
                  const c10::optional<torch::Tensor>& bias, int64_t k, int64_t ng) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.dim() == 4 && w.size(2) == 16 && w.size(3) == 4 && w.is_contiguous(),
              "the weight must be a contiguous packed int8 [N/16, K/4, 16, 4]");
  TORCH_CHECK(w.size(1) * 4 == k, "the weight's K (", w.size(1) * 4, ") is not the input's (", k, ")");
  const int64_t n = w.size(0) * 16;
  TORCH_CHECK(colsum.scalar_type() == torch::kInt32 && colsum.is_contiguous() && colsum.numel() == n * ng,
              "colsum must be a contiguous int32 [N/16, groups, 16] with the input's ", ng,
              " group(s) per row (it has ", colsum.numel() / std::max<int64_t>(n, 1), ")");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == n,
              "scale must be a contiguous float32 [N]");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                        "bias must be a contiguous float32 [N]");
}

// The activations' groups per row: xscale is [M, groups], each group a multiple of 4 channels
int64_t check_input(const torch::Tensor& xq, const torch::Tensor& xscale) {
  TORCH_CHECK(xq.scalar_type() == torch::kUInt8 && xq.dim() == 2 && xq.is_contiguous(),
              "xq must be a contiguous uint8 [M, K] (acb_int8.quantize_rows)");
  TORCH_CHECK(xq.size(1) % 4 == 0, "K must be a multiple of 4");
  TORCH_CHECK(xscale.scalar_type() == torch::kFloat32 && xscale.is_contiguous() && xscale.dim() == 2 &&
                  xscale.size(0) == xq.size(0) && xscale.size(1) >= 1,
              "xscale must be a contiguous float32 [M, groups]");
  const int64_t ng = xscale.size(1);
  TORCH_CHECK(xq.size(1) % (4 * ng) == 0, "K (", xq.size(1), ") must split into ", ng, " groups of a multiple of 4");
  return ng;
}

Weight weight_of(const torch::Tensor& w, const torch::Tensor& colsum, const torch::Tensor& scale,
                 const c10::optional<torch::Tensor>& bias) {
  return Weight{w.data_ptr<int8_t>(), colsum.data_ptr<int32_t>(), scale.data_ptr<float>(),
                bias ? bias->data_ptr<float>() : nullptr};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_masked(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// One row: optional RMSNorm (w * (x * r), r = 1 / sqrt(mean(x^2) + eps); the product is
// commutative, so Llama's and Gemma's orders give the same float), then per group of `group`
// channels q = round(v * 127 / max|v|) + 128 (round to nearest even, as nearbyint) and
// scale = max|v| / 127 (scales: one per group).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, const float* w, float eps, bool norm, uint8_t* q,
                  float* scales, float* buf) {
  auto mask = [](int64_t i, int64_t end) {
    return static_cast<__mmask16>(end - i >= 16 ? 0xffff : (1u << (end - i)) - 1);
  };
  float inv = 1.f;
  if (norm) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += 16) {
      const __m512 v = load_masked(x + i, mask(i, k));
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    inv = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(k) + eps);
  }
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    const int64_t end = g0 + group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = g0; i < end; i += 16) {
      const __mmask16 m = mask(i, end);
      __m512 v = load_masked(x + i, m);
      if (norm) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_mul_ps(v, _mm512_set1_ps(inv)));
      _mm512_mask_storeu_ps(buf + i, m, v);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax);
    scales[g0 / group] = top / 127.f;
    const __m512 qs = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    for (int64_t i = g0; i < end; i += 16) {
      const __mmask16 m = mask(i, end);
      const __m512i r = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), qs)),
                                         _mm512_set1_epi32(128));
      _mm_mask_storeu_epi8(q + i, m, _mm512_cvtusepi32_epi8(r));
    }
  }
}
#endif

template <typename T>
std::vector<torch::Tensor> quantize_any(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                        bool gemma, double eps, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be a 2-D tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0);
  TORCH_CHECK(k % 4 == 0, "the row width must be a multiple of 4");
  if (group <= 0) group = k;
  TORCH_CHECK(k % group == 0 && group % 4 == 0, "the group (", group, ") must be a multiple of 4 dividing the row width (",
              k, ")");
  const int64_t ng = k / group;
  auto q = torch::empty({m, k}, x.options().dtype(torch::kUInt8));
  auto s = torch::empty({m, ng}, x.options().dtype(torch::kFloat32));
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  (void)gemma;  // the norm's two orders of the product are one float (see quantize_row)
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = s.data_ptr<float>();
  // the norm's weight as float32: read in place when it is, else (bf16) widened once per call through one
  // pointer (it was read through data_ptr() with a dtype check per element)
  std::vector<float> widened;
  const float* w = nullptr;
  const bool norm = norm_w.has_value();
  if (norm) {
    TORCH_CHECK(norm_w->numel() == k && norm_w->is_contiguous(), "the norm weight must be a contiguous [K]");
    if (norm_w->scalar_type() == torch::kFloat32) {
      w = norm_w->data_ptr<float>();
    } else {
      TORCH_CHECK(norm_w->scalar_type() == torch::kBFloat16, "the norm weight must be float32 or bfloat16");
      const uint16_t* src = reinterpret_cast<const uint16_t*>(norm_w->data_ptr());
      widened.resize(k);
      for (int64_t i = 0; i < k; ++i) widened[i] = widen(src[i]);
      w = widened.data();
    }
  }
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> buf(k);
    for (int64_t t = b; t < e; ++t) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
      quantize_row(xp + t * xs, k, group, w, static_cast<float>(eps), norm, qp + t * k, sp + t * ng,
                   buf.data());
#endif
    }
  });
  return {q, s};
}


}  // namespace

bool has_vnni() { return kVnni; }

// x: [M, K] float32 or bfloat16 -> (q: uint8 [M, K] (q + 128), scale: float32 [M, K / group]);
// group <= 0: the whole row (one scale per token); with norm_w, the row is RMS-normalised
// first (Llama's w * (x * r), or Gemma's (x * r) * (1 + w) when gemma, norm_w then being the
// float32 1 + w)
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                         bool gemma, double eps, int64_t group) {
  TORCH_CHECK(kVnni, "acb's int8 kernels were built without AVX-512 VNNI");
  if (x.scalar_type() == torch::kFloat32) return quantize_any<float>(x, norm_w, gemma, eps, group);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  return quantize_any<uint16_t>(x, norm_w, gemma, eps, group);
}

// out [M, N] (of `dtype`'s kind: float32 or bfloat16) = dequantized xq @ W^T (+ bias), + other when given
torch::Tensor linear(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& w,
                     const torch::Tensor& colsum, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& other, torch::ScalarType dtype) {
  TORCH_CHECK(kVnni, "acb's int8 kernels were built without AVX-512 VNNI");
  const int64_t ng = check_input(xq, xscale), k = xq.size(1);
  check_weight(w, colsum, scale, bias, k, ng);
  const int64_t n = w.size(0) * 16;
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  auto out = torch::empty({xq.size(0), n}, xq.options().dtype(dtype));
  if (other) TORCH_CHECK(other->scalar_type() == dtype && other->dim() == 2 && other->size(0) == xq.size(0) &&
                             other->size(1) == n && other->stride(1) == 1,
                         "other must be [M, N] of the output's dtype with contiguous rows");
  const Weight wt = weight_of(w, colsum, scale, bias);
#if defined(__AVX512VNNI__)
  if (xq.size(0) > 0) {
    if (dtype == torch::kFloat32)
      gemm<float>(xq, xscale, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
    else
      gemm<uint16_t>(xq, xscale, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
  }
#endif
  return out;
}

// out [M, N] = act(xq @ Wgate^T) * (xq @ Wup^T); act 0: SiLU, 1: GELU-tanh
torch::Tensor glu(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& wg,
                  const torch::Tensor& cg, const torch::Tensor& sg, const c10::optional<torch::Tensor>& bg,
                  const torch::Tensor& wu, const torch::Tensor& cu, const torch::Tensor& su,
                  const c10::optional<torch::Tensor>& bu, int64_t act, torch::ScalarType dtype) {
  TORCH_CHECK(kVnni, "acb's int8 kernels were built without AVX-512 VNNI");
  const int64_t ng = check_input(xq, xscale), k = xq.size(1);
  check_weight(wg, cg, sg, bg, k, ng);
  check_weight(wu, cu, su, bu, k, ng);
  TORCH_CHECK(wg.sizes() == wu.sizes(), "gate and up must have the same shape");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  const int64_t n = wg.size(0) * 16;
  auto out = torch::empty({xq.size(0), n}, xq.options().dtype(dtype));
  const Weight g = weight_of(wg, cg, sg, bg), u = weight_of(wu, cu, su, bu);
#if defined(__AVX512VNNI__)
  if (xq.size(0) > 0) {
    if (dtype == torch::kFloat32)
      gemm<float>(xq, xscale, g, &u, act, kNone, nullptr, out, n);
    else
      gemm<uint16_t>(xq, xscale, g, &u, act, kNone, nullptr, out, n);
  }
#endif
  return out;
}

// rows `ids` of a packed weight, dequantized: out[t] = W[ids[t]] * scale[ids[t]] * mult
// (the tied embedding read from the lm_head's packed int8 weight)
torch::Tensor embed(const torch::Tensor& w, const torch::Tensor& scale, const torch::Tensor& ids, double mult,
                    torch::ScalarType dtype) {
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.dim() == 4 && w.is_contiguous(), "w must be a packed int8 weight");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1 && ids.is_contiguous(), "ids must be a long [T]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.numel() == w.size(0) * 16, "scale must be float32 [N]");
  const int64_t t_ = ids.size(0), k4 = w.size(1), k = k4 * 4, n = w.size(0) * 16;
  auto out = torch::empty({t_, k}, w.options().dtype(dtype));
  const int8_t* wp = w.data_ptr<int8_t>();
  const int64_t* ip = ids.data_ptr<int64_t>();
  const float* sp = scale.data_ptr<float>();
  const float fm = static_cast<float>(mult);
  for (int64_t t = 0; t < t_; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < n, "token id ", ip[t], " out of range");
  at::parallel_for(0, t_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const int64_t row = ip[t];
      const int8_t* base = wp + (row / 16) * k4 * 64 + (row % 16) * 4;
      const float s = sp[row] * fm;
      if (dtype == torch::kFloat32) {
        float* o = out.data_ptr<float>() + t * k;
        for (int64_t kk = 0; kk < k; ++kk) o[kk] = static_cast<float>(base[(kk / 4) * 64 + (kk % 4)]) * s;
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + t * k;
        for (int64_t kk = 0; kk < k; ++kk) o[kk] = to_bf16(static_cast<float>(base[(kk / 4) * 64 + (kk % 4)]) * s);
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("has_vnni", &has_vnni, "whether the GEMMs were built with AVX-512 VNNI");
  m.def("quantize_rows", &quantize_rows, "per-row (per-group) int8 quantization, optionally after an RMSNorm",
        py::arg("x"), py::arg("norm_w") = py::none(), py::arg("gemma") = false, py::arg("eps") = 1e-6,
        py::arg("group") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &linear, "W8A8 linear (+ residual)", py::arg("xq"), py::arg("xscale"), py::arg("w"),
        py::arg("colsum"), py::arg("scale"), py::arg("bias") = py::none(), py::arg("other") = py::none(),
        py::arg("dtype") = torch::kFloat32, py::call_guard<py::gil_scoped_release>());
  m.def("glu", &glu, "W8A8 act(x Wg) * (x Wu)", py::call_guard<py::gil_scoped_release>());
  m.def("embed", &embed, "rows of a packed int8 weight, dequantized", py::call_guard<py::gil_scoped_release>());
}
