// bfloat16 GEMMs for acb's fused CPU forward (acb/fused.py) on AVX-512 BF16 (vdpbf16ps):
// bf16 inputs and weights, float32 accumulation, and a float32 *or* bf16 output.
//
// Why not oneDNN's prepacked bf16 linear (what the bf16 forward ran before): it writes its output
// in bf16 only. Rounding the logits to bf16 (steps of 0.125 at 16-32) and the residual stream's
// updates changed 2.7 % of SmolLM2's greedy next tokens against float32; with float32 logits and a
// float32 residual stream 1 % (benchmarks/bf16_sensitivity.py). And on decode-sized GEMMs (48
// rows x 576-1536) this kernel runs 1.4-2x oneDNN's there (docs/performance.md).
//
// Weights: packed once into [ceil(N/16)][K/2][16][2]: a 64-byte load holds 2 consecutive k of 16
//   output channels, vdpbf16ps's operand order; columns past N are zero. K must be even.
// out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) (+ other[m, n]), summed in float32 (pairs of
//   products, then the accumulator), stored as float32 or rounded to bf16 (nearest even).
// Tiles: 8 rows x 48 columns (24 zmm accumulators, 3 weight loads and 8 broadcasts per 24
//   vdpbf16ps); the threads split (column tile, row chunk) pairs, column tiles outermost, so each
//   keeps its weight panels in its L2 across a chunk's rows. On this Zen 5 host 6 x 32 (12
//   accumulators) ran ~870 GFLOP/s on SmolLM2's shapes, 8 x 48 ~1,000 (oneDNN's bf16: ~1,010),
//   7 x 48 ~1,000, 6 x 64 ~980, 12 x 32 and 9 x 48 ~600 (spilled): benchmarks/int8_gemm.py's
//   shapes, 46 and 1,667 rows.
#include "decode_loop.h"
#include "vec.h"
#include "tile_prefetch.h"
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace acb::bf16 {
namespace {

using acb_bf16::to_bf16;  // bf16 <-> float32 by bits (vec_scalar.h)
using acb_bf16::widen;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
constexpr bool kBf16 = true;
using acb_vec::act512;  // SiLU (0) / GELU-tanh (1), vec_avx512.h

// acc + a . b over bf16 pairs, written as one instruction (as int8_cpu.cpp's dpbusd: no register
// copies per accumulator and k step)
inline __m512 dpbf16(__m512 acc, __m512 a, __m512 b) {
#if defined(ACB_EMULATED_AVX512)  // avx512_emulated.h: the intrinsic, portable
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#endif
}

using acb_vec::load16;  // float32 or bf16 lanes (masked) in, float32 or rounded bf16 out (vec_avx512.h)
using acb_vec::store16;
inline __mmask16 tail(int64_t left) { return left >= 16 ? 0xffff : static_cast<__mmask16>((1u << left) - 1); }

// PF: also fetch blocks [pj0, pj1) of the next column tile (NB blocks on) into L2, one line per k step,
// as this tile's own lines are read (see gemm())
template <int MR, int NB, bool PF = false>
inline void dot_tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t panel, int64_t k2,
                     __m512 (&acc)[MR][NB], int pj0 = 0, int pj1 = 0) {
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k) {
    __m512 b[NB];
#pragma GCC unroll 4
    for (int j = 0; j < NB; ++j) b[j] = _mm512_castsi512_ps(_mm512_loadu_si512(w + j * panel + k * 32));
    if constexpr (PF)
      for (int j = pj0; j < pj1; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * panel + k * 32), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t a32;
      std::memcpy(&a32, x + r * xs + 2 * k, 4);
      const __m512 a = _mm512_castsi512_ps(_mm512_set1_epi32(a32));
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j) acc[r][j] = dpbf16(acc[r][j], a, b[j]);
    }
  }
}

template <int MR, int NB>
inline void dot_any(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t panel, int64_t k2,
                    __m512 (&acc)[MR][NB], int pj0, int pj1) {
  if (pj0 < pj1) dot_tile<MR, NB, true>(x, xs, w, panel, k2, acc, pj0, pj1);
  else dot_tile<MR, NB>(x, xs, w, panel, k2, acc);
}

struct Gemm {
  const uint16_t* x;
  int64_t xs, k;
  const uint16_t* w;  // packed
  const float* bias;  // or null
  const void* other;  // or null: [M, n] of the output's type, row stride os
  int64_t os;
  void* out;  // [M, n], row stride ostride
  int64_t ostride, n;
};

template <typename T, int MR, int NB>
void tile(const Gemm& g, int64_t m0, int64_t b0, int pj0, int pj1) {
  const int64_t k2 = g.k / 2, panel = k2 * 32;
  __m512 acc[MR][NB];
  const T* other = static_cast<const T*>(g.other);
  T* out = static_cast<T*>(g.out);
  // the epilogue's residual and output rows, fetched while the dot products run (tile_prefetch.h)
  const int64_t c1 = std::min(g.n, (b0 + NB) * 16);
  if (other) acb_tiles::prefetch_rows(other, g.os, m0, MR, b0 * 16, c1, false);
  acb_tiles::prefetch_rows(out, g.ostride, m0, MR, b0 * 16, c1, true);
  dot_any<MR, NB>(g.x + m0 * g.xs, g.xs, g.w + b0 * panel, panel, k2, acc, pj0, pj1);
  for (int j = 0; j < NB; ++j) {
    const int64_t c = (b0 + j) * 16;
    const __mmask16 m = tail(g.n - c);
    const __m512 bias = g.bias ? _mm512_maskz_loadu_ps(m, g.bias + c) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) {
      __m512 o = _mm512_add_ps(acc[r][j], bias);
      if (other) o = _mm512_add_ps(o, load16(other + (m0 + r) * g.os + c, m));
      store16(out + (m0 + r) * g.ostride + c, m, o);
    }
  }
}

// The MLP's act(gate) * up for one tile: the gate's blocks are [b0, b0 + NB) of g.w, the up's the
// same blocks `up` blocks further on (gate and up packed side by side); both stay float32 until
// the product is stored (rounding them to bf16 first cost SmolLM2 0.2 points of top-1 agreement
// with float32, benchmarks/bf16_sensitivity.py).
template <typename T, int MR, int NB>
void glu_tile(const Gemm& g, int64_t up, int64_t act, int64_t m0, int64_t b0, int pj0, int pj1) {
  const int64_t k2 = g.k / 2, panel = k2 * 32;
  __m512 acc[MR][NB], v[MR][NB];
  acb_tiles::prefetch_rows(static_cast<T*>(g.out), g.ostride, m0, MR, b0 * 16, (b0 + NB) * 16, true);
  dot_any<MR, NB>(g.x + m0 * g.xs, g.xs, g.w + b0 * panel, panel, k2, acc, pj0, pj1);
  for (int j = 0; j < NB; ++j) {
    const __m512 bias = g.bias ? _mm512_loadu_ps(g.bias + (b0 + j) * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) v[r][j] = act512(_mm512_add_ps(acc[r][j], bias), act);
  }
  dot_any<MR, NB>(g.x + m0 * g.xs, g.xs, g.w + (b0 + up) * panel, panel, k2, acc, pj0, pj1);
  T* out = static_cast<T*>(g.out);
  for (int j = 0; j < NB; ++j) {
    const int64_t c = (b0 + j) * 16;
    const __m512 bias = g.bias ? _mm512_loadu_ps(g.bias + up * 16 + c) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r)
      store16(out + (m0 + r) * g.ostride + c, 0xffff, _mm512_mul_ps(v[r][j], _mm512_add_ps(acc[r][j], bias)));
  }
}

// up < 0: the plain GEMM (tile); else the MLP's act(gate) * up (glu_tile), up blocks apart; prefetching
// blocks [pj0, pj1) of the next column tile where pj0 < pj1
template <typename T, int MR, int NB>
inline void any_tile(const Gemm& g, int64_t up, int64_t act, int64_t m0, int64_t b0, int pj0, int pj1) {
  if (up < 0) tile<T, MR, NB>(g, m0, b0, pj0, pj1);
  else glu_tile<T, MR, NB>(g, up, act, m0, b0, pj0, pj1);
}

constexpr int kMR = 8, kNB = 3;  // a tile's rows and 16-column blocks

// a tile of `rows` (1..R) rows: R, else one row fewer
template <typename T, int NB, int R = kMR>
inline void tile_rows(int64_t rows, const Gemm& g, int64_t up, int64_t act, int64_t m0, int64_t b0, int pj0 = 0,
                      int pj1 = 0) {
  if constexpr (R == 1) {
    any_tile<T, 1, NB>(g, up, act, m0, b0, pj0, pj1);
  } else {
    if (rows == R) any_tile<T, R, NB>(g, up, act, m0, b0, pj0, pj1);
    else tile_rows<T, NB, R - 1>(rows, g, up, act, m0, b0, pj0, pj1);
  }
}

// blocks: the output's 16-column blocks; up >= 0: the GLU (act, the up's offset in blocks)
template <typename T>
void gemm(const Gemm& g, int64_t m, int64_t blocks, int64_t up = -1, int64_t act = 0) {
  constexpr int64_t chunk = 96;
  // A few rows over a large weight (the lm_head of a decode step of 1-6 rows) are bound by reading the
  // weight: one block a tile streams one packed panel at a time, which this host's prefetchers follow
  // better than three panels 18 KB apart (SmolLM2's lm_head, 1 row: ~770 against ~1,100 us; with a
  // 1,536-column weight one block a tile is twice as slow, so only there).
  // The next column tile's weights are prefetched into L2 while a chunk's first row tiles read theirs
  // (row tile i fetches block i, the chunk's last row tile the rest): a decode step reads 30 layers'
  // weights from memory and waited on each tile's first loads. SmolLM2's shapes, 45 rows: 422-431 us a
  // layer without, 344-360 with, the lm_head 3.3-3.8 -> 2.4-3.0 ms (benchmarks/decode_gemms.py --dtype
  // bf16, alternated, 2026-12-05). With the prefetch, 48-column tiles still lose on a 1-6-row lm_head.
  const int64_t nb = m <= 6 && blocks >= 512 ? 1 : kNB;
  const int64_t col_tiles = (blocks + nb - 1) / nb, row_chunks = (m + chunk - 1) / chunk;
  at::parallel_for(0, col_tiles * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ct = item / row_chunks, rc = item % row_chunks;
      const int64_t b0 = ct * nb, nbs = std::min<int64_t>(nb, blocks - b0);
      const int64_t first = rc * chunk, stop = std::min(m, first + chunk);
      // this thread's next item is the next column tile, a whole one of kNB blocks
      const bool ahead = nb == kNB && item + 1 < end && rc == row_chunks - 1 && b0 + 2 * kNB <= blocks;
      for (int64_t m0 = first; m0 < stop; m0 += kMR) {
        const int64_t rows = std::min<int64_t>(kMR, m - m0);
        const auto [pj0, pj1] = acb_tiles::next_tile_share(ahead, (m0 - first) / kMR, m0 + kMR >= stop, kNB);
        if (nbs == kNB) tile_rows<T, kNB>(rows, g, up, act, m0, b0, pj0, pj1);
        else  // the last tile's one or two blocks (or a one-block tile), one at a time
          for (int64_t b = b0; b < b0 + nbs; ++b) tile_rows<T, 1>(rows, g, up, act, m0, b);
      }
    }
  });
}
#else
constexpr bool kBf16 = false;
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
// The same GEMMs on CPUs without AVX-512 BF16 (AVX2: Zen 2/3, Haswell on), "widened": the same
// packed bf16 weights, each pair of k widened to float32 by bits as it is loaded (k even: a word's
// low half shifted up; k odd: its high half masked), the activations widened once per call, float32
// FMAs (a bf16 x bf16 product is exact in float32: only the order of the float32 sums differs from
// vdpbf16ps's), the same epilogues. Half the bytes of a float32 weight, at float32's arithmetic rate.
// Tiles: 4 rows x 16 columns (8 accumulators, 4 widened weight registers, 2 broadcasts).
constexpr bool kWidened = true;
using acb_vec::act256;  // SiLU (0) / GELU-tanh (1) on 8 lanes, vec_avx2.h

using acb_vec::load8;  // 8 float32 or bf16 lanes in, float32 or rounded bf16 out (vec_avx2.h)
using acb_vec::store8;

// acc[r][h] (columns 8h..8h+7 of the block) = rows m0.. of x (float32, stride k) . the block's columns
template <int MR>
inline void widened_dot(const float* x, int64_t k, const uint32_t* w, __m256 (&acc)[MR][2]) {
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t p = 0; p < k / 2; ++p) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16 + 8));
    const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16)), o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, high));
    const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16)), o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, high));
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const __m256 xe = _mm256_broadcast_ss(x + r * k + 2 * p), xo = _mm256_broadcast_ss(x + r * k + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(o0, xo, _mm256_fmadd_ps(e0, xe, acc[r][0]));
      acc[r][1] = _mm256_fmadd_ps(o1, xo, _mm256_fmadd_ps(e1, xe, acc[r][1]));
    }
  }
}

// One tile: rows [m0, m0 + MR) x the 16 columns of block b (of n: the last block may be partial);
// up: glu's up block (the gate's in w), else null
template <typename T, int MR>
void widened_tile(const float* x, int64_t k, const uint32_t* w, const uint32_t* up, const float* bias,
                  const float* up_bias, int64_t act, const T* other, int64_t os, T* out, int64_t ostride, int64_t m0,
                  int64_t c0, int64_t n) {
  __m256 acc[MR][2], v[MR][2];
  widened_dot<MR>(x + m0 * k, k, w, acc);
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) v[r][h] = bias ? _mm256_add_ps(acc[r][h], _mm256_loadu_ps(bias + c0 + 8 * h)) : acc[r][h];
  if (up != nullptr) {
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) v[r][h] = act256(v[r][h], act);
    widened_dot<MR>(x + m0 * k, k, up, acc);
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h)
        v[r][h] = _mm256_mul_ps(v[r][h], up_bias ? _mm256_add_ps(acc[r][h], _mm256_loadu_ps(up_bias + c0 + 8 * h))
                                                 : acc[r][h]);
  }
  const bool whole = c0 + 16 <= n;
  for (int r = 0; r < MR; ++r) {
    T* o = out + (m0 + r) * ostride + c0;
    const T* a = other ? other + (m0 + r) * os + c0 : nullptr;
    if (whole) {
      for (int h = 0; h < 2; ++h) store8(o + 8 * h, a ? _mm256_add_ps(v[r][h], load8(a + 8 * h)) : v[r][h]);
    } else {  // the last block: columns past n are the packing's zeros
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, v[r][0]);
      _mm256_store_ps(tmp + 8, v[r][1]);
      for (int64_t c = 0; c < n - c0; ++c) {
        const float y = a ? tmp[c] + (std::is_same_v<T, float> ? static_cast<float>(a[c]) : widen(a[c])) : tmp[c];
        if constexpr (std::is_same_v<T, float>) o[c] = y; else o[c] = to_bf16(y);
      }
    }
  }
}

// out [m, n] = x @ W^T (+ bias) (+ other), or with up_blocks > 0 act(x Wg^T + bg) * (x Wu^T + bu), the
// up's blocks following the gate's in w
template <typename T>
void widened_gemm(const uint16_t* xb, int64_t xs, int64_t m, int64_t k, const uint16_t* wb, int64_t n,
                  int64_t blocks, const float* bias, const void* other, int64_t os, void* out, int64_t ostride,
                  int64_t up_blocks = 0, int64_t act = 0) {
  thread_local std::vector<float> widened;  // the activations in float32, once per call
  if (static_cast<int64_t>(widened.size()) < m * k) widened.resize(m * k);
  float* x = widened.data();
  at::parallel_for(0, m, std::max<int64_t>(1, 8192 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t)
#pragma omp simd
      for (int64_t i = 0; i < k; ++i) x[t * k + i] = widen(xb[t * xs + i]);
  });
  const uint32_t* w = reinterpret_cast<const uint32_t*>(wb);
  const int64_t panel = (k / 2) * 16, chunk = 64, row_chunks = (m + chunk - 1) / chunk;
  const T* op = static_cast<const T*>(other);
  T* outp = static_cast<T*>(out);
  at::parallel_for(0, blocks * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_chunks, rc = item % row_chunks;
      const uint32_t* wg = w + b * panel;
      const uint32_t* wu = up_blocks > 0 ? w + (b + up_blocks) * panel : nullptr;
      const float* ub = up_blocks > 0 && bias ? bias + n : nullptr;
      for (int64_t m0 = rc * chunk; m0 < std::min(m, rc * chunk + chunk); m0 += 4) {
        switch (std::min<int64_t>(4, m - m0)) {
          case 4: widened_tile<T, 4>(x, k, wg, wu, bias, ub, act, op, os, outp, ostride, m0, b * 16, n); break;
          case 3: widened_tile<T, 3>(x, k, wg, wu, bias, ub, act, op, os, outp, ostride, m0, b * 16, n); break;
          case 2: widened_tile<T, 2>(x, k, wg, wu, bias, ub, act, op, os, outp, ostride, m0, b * 16, n); break;
          default: widened_tile<T, 1>(x, k, wg, wu, bias, ub, act, op, os, outp, ostride, m0, b * 16, n); break;
        }
      }
    }
  });
}
#else
constexpr bool kWidened = false;
#endif

}  // namespace

bool available() { return kBf16 || kWidened; }
bool native() { return kBf16; }

// w: bf16 [N, K] (K even) -> packed [ceil(N/16), K/2, 16, 2], zero past N
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2, "w must be a bfloat16 [N, K]");
  const int64_t n = w.size(0), k = w.size(1), nb = (n + 15) / 16;
  TORCH_CHECK(k % 2 == 0, "K (", k, ") must be even");
  const auto wc = w.contiguous();
  auto out = torch::empty({nb, k / 2, 16, 2}, w.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(wc.data_ptr());  // pairs of k
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  const int64_t k2 = k / 2;
  at::parallel_for(0, nb, 1, [&](int64_t b, int64_t e) {
    for (int64_t blk = b; blk < e; ++blk) {
      uint32_t* d = dst + blk * k2 * 16;
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t row = blk * 16 + c;
        if (row < n) {
          const uint32_t* s = src + row * k2;
          for (int64_t kk = 0; kk < k2; ++kk) d[kk * 16 + c] = s[kk];
        } else {
          for (int64_t kk = 0; kk < k2; ++kk) d[kk * 16 + c] = 0;
        }
      }
    }
  });
  return out;
}

// The checks linear() and glu() share: x a bf16 [M, K] with contiguous rows, w packed by pack() for K
void check_operands(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(kBf16 || kWidened, "acb's bf16 GEMMs were built without AVX-512 BF16 or AVX2");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a bfloat16 [M, K] with contiguous rows");
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 4 && w.size(2) == 16 && w.size(3) == 2 &&
                  w.is_contiguous(),
              "w must be a packed bfloat16 [N/16, K/2, 16, 2] (pack())");
  TORCH_CHECK(w.size(1) * 2 == x.size(1), "the weight's K (", w.size(1) * 2, ") is not the input's (", x.size(1),
              ")");
}

// out [M, n] (float32 or bfloat16, `dtype`) = x (bf16 [M, K], rows contiguous) @ W^T (+ bias, float32 [n])
// (+ other, [M, n] of `dtype` with contiguous rows); w packed by pack() from an [n, K] weight
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& other, torch::ScalarType dtype) {
  check_operands(x, w);
  const int64_t m = x.size(0), k = x.size(1), blocks = w.size(0);
  TORCH_CHECK(n > (blocks - 1) * 16 && n <= blocks * 16, "n (", n, ") does not match the packed weight");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                        "bias must be a contiguous float32 [n]");
  if (other) TORCH_CHECK(other->scalar_type() == dtype && other->dim() == 2 && other->size(0) == m &&
                             other->size(1) == n && other->stride(1) == 1,
                         "other must be [M, n] of the output's dtype with contiguous rows");
  auto out = torch::empty({m, n}, x.options().dtype(dtype));
#if defined(__AVX512BF16__)
  if (m > 0) {
    const Gemm g{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), k,
                 reinterpret_cast<const uint16_t*>(w.data_ptr()), bias ? bias->data_ptr<float>() : nullptr,
                 other ? other->data_ptr() : nullptr, other ? other->stride(0) : 0, out.data_ptr(), n, n};
    if (dtype == torch::kFloat32) gemm<float>(g, m, blocks);
    else gemm<uint16_t>(g, m, blocks);
  }
#elif !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
  if (m > 0) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.data_ptr());
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    const void* op = other ? other->data_ptr() : nullptr;
    const int64_t os = other ? other->stride(0) : 0;
    if (dtype == torch::kFloat32)
      widened_gemm<float>(xb, x.stride(0), m, k, wb, n, blocks, bp, op, os, out.data_ptr(), out.stride(0));
    else
      widened_gemm<uint16_t>(xb, x.stride(0), m, k, wb, n, blocks, bp, op, os, out.data_ptr(), out.stride(0));
  }
#endif
  return out;
}

// out [M, n] (float32 or bfloat16) = act(x @ Wg^T (+ bg)) * (x @ Wu^T (+ bu)), summed and multiplied in
// float32, rounded once; w packs gate and up side by side ([2n, K] -> [2n/16, K/2, 16, 2]: n must be a
// multiple of 16), bias the float32 [2n] of both or none; act 0: SiLU, 1: GELU-tanh
torch::Tensor glu(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const c10::optional<torch::Tensor>& bias,
                  int64_t act, torch::ScalarType dtype) {
  check_operands(x, w);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(n > 0 && n % 16 == 0 && w.size(0) * 16 == 2 * n,
              "w must pack gate and up ([2n, K]) side by side with n (", n, ") a multiple of 16");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == 2 * n,
                        "bias must be a contiguous float32 [2n] (gate's, then up's)");
  auto out = torch::empty({m, n}, x.options().dtype(dtype));
#if defined(__AVX512BF16__)
  if (m > 0) {
    const Gemm g{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), k,
                 reinterpret_cast<const uint16_t*>(w.data_ptr()), bias ? bias->data_ptr<float>() : nullptr,
                 nullptr, 0, out.data_ptr(), n, n};
    if (dtype == torch::kFloat32) gemm<float>(g, m, n / 16, n / 16, act);
    else gemm<uint16_t>(g, m, n / 16, n / 16, act);
  }
#elif !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
  if (m > 0) {
    const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
    const uint16_t* wb = reinterpret_cast<const uint16_t*>(w.data_ptr());
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    if (dtype == torch::kFloat32)
      widened_gemm<float>(xb, x.stride(0), m, k, wb, n, n / 16, bp, nullptr, 0, out.data_ptr(), out.stride(0), n / 16, act);
    else
      widened_gemm<uint16_t>(xb, x.stride(0), m, k, wb, n, n / 16, bp, nullptr, 0, out.data_ptr(), out.stride(0), n / 16, act);
  }
#endif
  return out;
}

// RMSNorm of float32 rows into bfloat16: (x * r) * w, rounded once, r = 1 / sqrt(mean(x^2) + eps);
// w the bf16 weight (Llama's) or the float32 1 + weight (Gemma's, gemma). transformers' bf16 Llama
// norm rounds twice (the normalised row, then its product with the weight); rounding once, as a
// float32 forward feeding a bf16 GEMM would, moved SmolLM2's top-1 agreement with float32 from
// 98.87 to 98.96 % (benchmarks/quality.py, 24,000 held-out tokens).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, bool gemma) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a float32 [T, D] with contiguous rows");
  const int64_t t_ = x.size(0), d = x.size(1), xs = x.stride(0);
  TORCH_CHECK(w.is_contiguous() && w.numel() == d &&
                  w.scalar_type() == (gemma ? torch::kFloat32 : torch::kBFloat16),
              gemma ? "w must be a contiguous float32 [D]" : "w must be a contiguous bfloat16 [D]");
  auto out = torch::empty({t_, d}, x.options().dtype(torch::kBFloat16));
  const float* xp = x.data_ptr<float>();
  const void* wp = w.data_ptr();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const float feps = static_cast<float>(eps), fd = static_cast<float>(d);
  at::parallel_for(0, t_, std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* xr = xp + t * xs;
      uint16_t* orow = op + t * d;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / fd + feps);
      if (gemma) {
        const float* wf = static_cast<const float*>(wp);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) orow[i] = to_bf16((xr[i] * inv) * wf[i]);
      } else {
        const uint16_t* wb = static_cast<const uint16_t*>(wp);
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) orow[i] = to_bf16((xr[i] * inv) * widen(wb[i]));
      }
    }
  });
  return out;
}

// A decode-only step's layers in one call: acb.model.fused.FusedForward's loop on acb's bf16 GEMMs for the
// models it takes whole here (q/k/v and gate/up joined, no Gemma norms, no q/k norms, one rotary
// embedding, no soft-capping, no LoRA rows, one device), with the same calls, in the same order, on
// the same tensors as that Python loop, so the same outputs bit for bit, without returning to Python
// (and taking the GIL back) between kernels: int8_cpu.cpp's DecodeLoop, for bf16. RoPE and the
// decode attention are fused_cpu.cpp's and paged_decode_cpu.cpp's functions (decode_loop.h).
// One layer: its two norms' weights and eps (before attention, before the MLP), its three packed
// weights (q/k/v joined, o, gate/up joined: packed, columns, bias or none) and down's, the
// attention's shape (query and key columns of the joined output, heads, kv heads, head dim), its
// scale and sliding window (0: none), and the MLP's activation (0 SiLU, 1 GELU-tanh).
void DecodeLoop::add_layer(const std::vector<torch::Tensor>& norms, const std::vector<double>& eps,
                           const std::vector<torch::Tensor>& weights, const std::vector<int64_t>& columns,
                           const std::vector<c10::optional<torch::Tensor>>& biases, int64_t nq, int64_t nk,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, int64_t window,
                           int64_t act) {
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2 && weights.size() == 4 && columns.size() == 4 &&
                  biases.size() == 4,
              "DecodeLoop.add_layer: 2 norms and eps, 4 weights, column counts and biases");
  TORCH_CHECK(nq == heads * head_dim && nk == kv_heads * head_dim && columns[0] == nq + 2 * nk &&
                  columns[2] % 32 == 0,
              "DecodeLoop.add_layer: the joined q/k/v or gate/up columns do not match");
  Layer l;
  for (int i = 0; i < 2; ++i) l.norm[i] = norms[i], l.eps[i] = eps[i];
  for (int i = 0; i < 4; ++i) l.w[i] = weights[i], l.n[i] = columns[i], l.b[i] = biases[i];
  l.attn = {nq, nk, heads, kv_heads, head_dim, window, scaling};
  l.act = act;
  layers_.push_back(std::move(l));
}

// Layer i of run() (decode_loop.h's DecodeLayers): the stream x [T, hidden] float32 after it
torch::Tensor DecodeLoop::layer(int64_t i, const Layer& l, torch::Tensor x, const torch::Tensor& cos,
                                const torch::Tensor& sin, const DecodeStep& step) const {
  const c10::optional<torch::Tensor> none;
  torch::Tensor h = rms_norm(x, l.norm[0], l.eps[0], false);
  // RoPE in float32, then q, k and v each rounded once for the bf16 attention and pages
  const torch::Tensor a = attend_(i, linear(h, l.w[0], l.n[0], l.b[0], none, torch::kFloat32), l.attn, cos, sin,
                                  step, torch::kBFloat16);
  if (!a.defined()) return a;
  x = linear(a, l.w[1], l.n[1], l.b[1], x, torch::kFloat32);  // the residual add fused
  h = rms_norm(x, l.norm[1], l.eps[1], false);
  torch::Tensor m = glu(h, l.w[2], l.n[2] / 2, l.b[2], l.act, torch::kBFloat16);
  return linear(m, l.w[3], l.n[3], l.b[3], x, torch::kFloat32);
}

}  // namespace acb::bf16

template class acb::DecodeLayers<acb::bf16::DecodeLoop, acb::bf16::Layer>;
