// int8 GEMMs for acb's quantized CPU forward (acb/quantization.py): W8A8 on AVX-512 VNNI (an AVX2
// form below gives the same outputs where VNNI is missing).
//
// Weights: int8, symmetric, one scale per output channel and group of G input channels (G = 32:
//   GGUF Q8_0's blocks), stored as unsigned bytes w + 128 and packed once into VNNI's layout
//   [N/16][K/4][16][4]: a 64-byte load holds 4 consecutive k of 16 output channels, the
//   operand order of vpdpbusd (unsigned bytes times signed bytes). N is a multiple of 16 and K
//   of 4 (acb.quantization checks). Scales: float32 [N/16][K/G][16].
// Activations: quantized per row (token) and per group of the same G channels at run time,
//   symmetric: q = round(x * 127 / max|x over the group|) as signed bytes, with each group's
//   scale and offset 128 * sum(q) * scale (the weights' +128 taken back out: sum((w+128) q) -
//   128 sum(q) = sum(w q)), so no per-weight column sums are stored. One outlier channel
//   flattens only its own group's precision (SmolLM2-135M top-1 agreement with float32:
//   docs/performance.md, benchmarks/int8_smoothing.py).
// out[m, n] = sum over groups g of wscale[g, n] * (acc_g[m, n] * xscale[m, g] - xoff[m, g])
//   (+ bias[n]): int32 within a group, float32 across groups (one fused multiply-subtract and
//   one multiply-add per group); then an epilogue in float32: none, + other[m, n] (the
//   residual add), or act(gate) * up for the MLP's two projections (SiLU or GELU-tanh), stored
//   as float32 or bfloat16.
//
// Tiles: 6 rows x 32 columns (12 zmm accumulators); the threads split (column tile, row
// chunk) pairs, column tiles outermost so each thread keeps its weight panels in its L2.
#include "decode_loop.h"
#include <immintrin.h>
#include "vec.h"
#include "tile_prefetch.h"
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace acb::int8 {
namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
#else
constexpr bool kVnni = false;
#if defined(__AVX2__) && defined(__FMA__)
#define ACB_INT8_AVX2 1  // the GEMMs below in their AVX2 form
#endif
#endif
#if defined(__AVX512VNNI__) || defined(ACB_INT8_AVX2)
constexpr bool kGemm = true;
#else
constexpr bool kGemm = false;
#endif

using acb_bf16::widen;  // bf16 -> float32 by bits (vec_scalar.h)

enum Epilogue : int64_t { kNone = 0, kAdd = 1 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1 };

#if defined(__AVX512F__)
using acb_vec::act512;  // SiLU (kSilu) / GELU-tanh (kGeluTanh), vec_avx512.h

// float32 or bf16 lanes (masked, too) in, float32 or rounded bf16 out (activations are finite here;
// vec_avx512.h)
using acb_vec::load16;
using acb_vec::store16;
#endif

struct Weight {
  const uint8_t* w;  // packed [N/16][K/4][16][4], w + 128 (a low-bit weight: see "Low-bit weights" below)
  const float* scale;  // [N/16][ng][16]: one per output channel and group ([N/16][ng][32] for low-bit ones)
  const float* bias;  // or null
  int kind = 0;  // LowKind: 0 int8 (this file's format), 1 nibbles, 2 bytes (low-bit codes)
  bool half = false;  // low-bit scales as float16 (`scale` then points at uint16_t), offsets 128 c
};

// The quantized activations (acb_int8.quantize_rows): q [M, K] signed bytes, scale and offset [M, ng]
struct Rows {
  const int8_t* q;
  const float* scale;
  const float* off;
  int64_t k, ng;
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// acc + a (unsigned bytes: the weights + 128) . b (signed bytes: the activations), as _mm512_dpbusd_epi32, written as one instruction:
// GCC 12 compiles the intrinsic in dot_tile's loop with two register copies per accumulator and
// k step (24 vmovdqa beside 12 vpdpbusd in the 6 x 32 tile)
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
#if defined(ACB_EMULATED_AVX512)  // avx512_emulated.h: the intrinsic, portable
  return _mm512_dpbusd_epi32(acc, a, b);
#else
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
#endif
}

// acc[r][j] = sum over the ng groups of wscale_g * (int32 dot of the group * xscale[r, g] - xoff[r, g]):
// MR rows, NB 16-column blocks, g4 = G / 4 steps of 4 channels per group. wscale points at the
// tile's first block in the [N/16][ng][16] layout; xscale and xoff at the tile's first row ([M][ng]).
// PF: also fetch blocks [pj0, pj1) of the next column tile (NB blocks on: its weights and scales) into
// L2, one line per k step and group, as this tile's own lines are read (see gemm()).
template <int MR, int NB, bool PF = false>
inline void dot_tile(const int8_t* x, int64_t xs, const uint8_t* w, int64_t panel, int64_t ng, int64_t g4,
                     const float* wscale, const float* xscale, const float* xoff, __m512 (&acc)[MR][NB],
                     int pj0 = 0, int pj1 = 0) {
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
      if constexpr (PF)
        for (int j = pj0; j < pj1; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (NB + j) * panel + k * 64),
                                                     _MM_HINT_T1);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t a32;
        std::memcpy(&a32, x + r * xs + 4 * k, 4);
        const __m512i a = _mm512_set1_epi32(a32);
#pragma GCC unroll 4
        for (int j = 0; j < NB; ++j) iacc[r][j] = dpbusd(iacc[r][j], b[j], a);
      }
    }
    if constexpr (PF)
      for (int j = pj0; j < pj1; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(wscale + ((NB + j) * ng + g) * 16), _MM_HINT_T1);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 s = _mm512_set1_ps(xscale[r * ng + g]), z = _mm512_set1_ps(xoff[r * ng + g]);
#pragma GCC unroll 4
      for (int j = 0; j < NB; ++j)
        acc[r][j] = _mm512_fmadd_ps(_mm512_fmsub_ps(_mm512_cvtepi32_ps(iacc[r][j]), s, z),
                                    _mm512_loadu_ps(wscale + (j * ng + g) * 16), acc[r][j]);
    }
  }
}

inline __m512 biased(__m512 acc, const float* bias) { return bias ? _mm512_add_ps(acc, _mm512_loadu_ps(bias)) : acc; }

// One tile: rows [m0, m0 + MR) x 16-column blocks [b0, b0 + NB) of the output; prefetching blocks
// [pj0, pj1) of the next column tile (of the gate's and the up's weights) where pj0 < pj1.
template <typename T, int MR, int NB>
void tile(const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi, const T* other,
          int64_t other_stride, T* out, int64_t out_stride, int64_t m0, int64_t b0, int pj0 = 0, int pj1 = 0) {
  const int64_t k = x.k, ng = x.ng, k4 = k / 4, panel = k4 * 64, g4 = k4 / ng;
  const int8_t* xq = x.q + m0 * k;
  const float* xs = x.scale + m0 * ng;
  const float* xo = x.off + m0 * ng;
  __m512 acc[MR][NB];
  // the epilogue's residual and output rows, fetched while the tile's dot products run (tile_prefetch.h)
  if (epi == kAdd) acb_tiles::prefetch_rows(other, other_stride, m0, MR, b0 * 16, (b0 + NB) * 16, false);
  acb_tiles::prefetch_rows(out, out_stride, m0, MR, b0 * 16, (b0 + NB) * 16, true);
  auto dot = [&](const Weight& wt) {
    if (pj0 < pj1)
      dot_tile<MR, NB, true>(xq, k, wt.w + b0 * panel, panel, ng, g4, wt.scale + b0 * ng * 16, xs, xo, acc, pj0, pj1);
    else
      dot_tile<MR, NB>(xq, k, wt.w + b0 * panel, panel, ng, g4, wt.scale + b0 * ng * 16, xs, xo, acc);
  };
  dot(w);
  __m512 v[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) v[r][j] = biased(acc[r][j], w.bias ? w.bias + (b0 + j) * 16 : nullptr);
  if (up != nullptr) {  // v holds the gate: act(gate) * up
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j) v[r][j] = act512(v[r][j], act);
    dot(*up);
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NB; ++j)
        v[r][j] = _mm512_mul_ps(v[r][j], biased(acc[r][j], up->bias ? up->bias + (b0 + j) * 16 : nullptr));
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (b0 + j) * 16;
      __m512 o = v[r][j];
      if (epi == kAdd) o = _mm512_add_ps(o, load16(other + (m0 + r) * other_stride + n));
      store16(out + (m0 + r) * out_stride + n, o);
    }
}

template <typename T, int NB>
void tile_rows(int64_t rows, const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi,
               const T* other, int64_t os, T* out, int64_t ostride, int64_t m0, int64_t b0, int pj0 = 0,
               int pj1 = 0) {
  switch (rows) {
    case 6: tile<T, 6, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
    case 5: tile<T, 5, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
    case 4: tile<T, 4, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
    case 3: tile<T, 3, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
    case 2: tile<T, 2, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
    default: tile<T, 1, NB>(x, w, up, act, epi, other, os, out, ostride, m0, b0, pj0, pj1); break;
  }
}

template <typename T>
void gemm(const Rows& x, int64_t m, const Weight& w, const Weight* up, int64_t act, int64_t epi,
          const torch::Tensor* other, torch::Tensor& out, int64_t n) {
  const int64_t blocks = n / 16;
  constexpr int64_t kMR = 6;
  // column tiles of 2 blocks (32 columns: 12 accumulators; tiles of 64 columns, 24 accumulators,
  // spilled registers and ran at about half the rate: 731 against 1320 GOPS at 1024 x 576 x 1536;
  // with dpbusd's register copies gone, no faster than 2 blocks either; 6 x 48, 2026-12-04 on the
  // Zen 5 host: 3-5 % faster with one weight reused, the same with distinct gate/up weights cycled as
  // an engine reads them, and the same in the engine's tokens/s);
  // row chunks of 96 rows, so a tile's weight panel is reused from L2 across 16 row tiles.
  // The next column tile's weights are prefetched into L2 while a chunk's first row tiles read theirs
  // (row tile i of the chunk fetches block i of them, the chunk's last row tile the rest): without, a
  // decode step's GEMMs (30 layers' weights, read from memory) waited on each tile's first loads. SmolLM2's
  // shapes, 45 rows: 295-317 us a layer without, 227-229 with; 16 rows 182-184 -> 108-111
  // (benchmarks/decode_gemms.py, alternated, 2026-12-05); prefill shapes the same either way.
  constexpr int64_t nb = 2;
  const int64_t col_tiles = (blocks + nb - 1) / nb, chunk = 96, row_chunks = (m + chunk - 1) / chunk;
  const T* op = other ? reinterpret_cast<const T*>(other->data_ptr()) : nullptr;
  const int64_t os = other ? other->stride(0) : 0;
  T* outp = reinterpret_cast<T*>(out.data_ptr());
  const int64_t ostride = out.stride(0);
  at::parallel_for(0, col_tiles * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ct = item / row_chunks, rc = item % row_chunks;
      const int64_t b0 = ct * nb, nbs = std::min(nb, blocks - b0);
      const int64_t first = rc * chunk, stop = std::min(m, first + chunk);
      // this thread's next item is the next column tile, a whole one
      const bool ahead = item + 1 < end && rc == row_chunks - 1 && b0 + 2 * nb <= blocks;
      for (int64_t m0 = first; m0 < stop; m0 += kMR) {
        const int64_t rows = std::min(kMR, m - m0);
        const auto [pj0, pj1] = acb_tiles::next_tile_share(ahead, (m0 - first) / kMR, m0 + kMR >= stop, nb);
        for (int64_t b = b0; b < b0 + nbs;) {  // a whole tile, or the one block left at the end
          const int64_t left = b0 + nbs - b;
          if (left >= 2) {
            tile_rows<T, 2>(rows, x, w, up, act, epi, op, os, outp, ostride, m0, b, pj0, pj1);
            b += 2;
          }
          else { tile_rows<T, 1>(rows, x, w, up, act, epi, op, os, outp, ostride, m0, b); b += 1; }
        }
      }
    }
  });
}
#endif

#if defined(ACB_INT8_AVX2)
// The same GEMM on AVX2 (no VNNI, no AVX-512: Zen 2/3, Haswell to Alder Lake): the same packed
// weights, the same int32 sums per group and the same float32 flush, so the same outputs bit for bit.
// vpmaddubsw (unsigned times signed bytes, pairs summed in int16) would saturate on the packed weights
// w + 128 (255 * 127 * 2 > 32767), so the sign trick llama.cpp's AVX2 dot products use: the signed
// weight w = (w + 128) ^ 0x80, its magnitude |w| as the unsigned operand and the activation with w's
// sign as the signed one (vpsignb): |w| sign(w) x = w x, and a pair sums to at most 2 * 128 * 127 =
// 32,512, exact in int16; vpmaddwd by ones then widens the pairs to int32 lanes, one column per lane.
// That gives sum(w x); the kernel adds the +128's share back, 128 sum(x) per row and group (summed
// once per call), to reach the VNNI form's int32 sums. Four vector instructions per 32 products,
// against the int16-widened form's vpmaddwd and vpaddd per 16 (AMD Zen 3: vpmaddwd issues once a
// cycle, so that form ran no faster than float32's FMAs; this one runs 1.2-1.4x it, docs/journal).
// Tiles: MR rows x 16 columns (a packed block): 2 MR int32 accumulators, the block's two 8-column
// halves as signed weights and magnitudes, the broadcast, ones.
using acb_vec::act256;  // SiLU / GELU-tanh on 8 lanes (vec_avx2.h)

using acb_vec::load8;  // 8 float32 or bf16 lanes in, float32 or rounded bf16 out (vec_avx2.h)
using acb_vec::store8;

// acc + the int32 sums of w x over each lane's 4 bytes: aw = |w| (unsigned), w the signed weights, x the
// activations (signed), written as four instructions: GCC 12 compiles the intrinsics with a register copy
// per accumulator and k step (as dpbusd above)
inline __m256i dot_add(__m256i acc, __m256i aw, __m256i w, __m256i x, __m256i ones) {
  __m256i t;
  __asm__("vpsignb %3, %2, %1\n\tvpmaddubsw %1, %4, %1\n\tvpmaddwd %5, %1, %1\n\tvpaddd %1, %0, %0"
          : "+x"(acc), "=&x"(t)
          : "x"(x), "x"(w), "x"(aw), "x"(ones));
  return acc;
}

// acc[r][h] (columns 8h to 8h + 7 of the block) = sum over the ng groups of wscale_g * ((xsum[r, g] + int32
// dot of the group) * xscale[r, g] - xoff[r, g]), as dot_tile computes it (each group's int32 sums start
// from xsum, the +128's share). x: the int8 rows (stride xs);
// w: the block's first weight bytes (its k steps 64 bytes apart); wscale: the block's first scale ([ng][16]);
// xsum: 128 sum(x) per row and group. G4: the group's k steps when known at compile time (0: g4).
template <int MR, int G4>
inline void dot_tile16(const int8_t* x, int64_t xs, const uint8_t* w, int64_t ng, int64_t g4, const float* wscale,
                       const float* xscale, const float* xoff, const int32_t* xsum, __m256 (&acc)[MR][2]) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t steps = G4 ? G4 : g4;
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256i ia[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) ia[r][0] = ia[r][1] = _mm256_set1_epi32(xsum[r * ng + g]);
    const uint8_t* wg = w + g * steps * 64;
    const int8_t* xg = x + g * steps * 4;
#pragma GCC unroll 16
    for (int64_t k = 0; k < steps; ++k) {
      __m256i sw[2], aw[2];
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        sw[h] = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + k * 64 + h * 32)), flip);
        aw[h] = _mm256_abs_epi8(sw[h]);
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t a32;
        std::memcpy(&a32, xg + r * xs + 4 * k, 4);
        const __m256i a = _mm256_set1_epi32(a32);
        ia[r][0] = dot_add(ia[r][0], aw[0], sw[0], a, ones);
        ia[r][1] = dot_add(ia[r][1], aw[1], sw[1], a, ones);
      }
    }
    const __m256 ws0 = _mm256_loadu_ps(wscale + g * 16), ws1 = _mm256_loadu_ps(wscale + g * 16 + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 s = _mm256_set1_ps(xscale[r * ng + g]), z = _mm256_set1_ps(xoff[r * ng + g]);
      acc[r][0] = _mm256_fmadd_ps(_mm256_fmsub_ps(_mm256_cvtepi32_ps(ia[r][0]), s, z), ws0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(_mm256_fmsub_ps(_mm256_cvtepi32_ps(ia[r][1]), s, z), ws1, acc[r][1]);
    }
  }
}

inline __m256 biased8(__m256 acc, const float* bias) { return bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc; }

// One tile: rows [m0, m0 + MR) x the 16 columns of block b of the output
template <typename T, int MR>
void tile16(const int32_t* xsum, const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi,
            const T* other, int64_t other_stride, T* out, int64_t out_stride, int64_t m0, int64_t b) {
  const int64_t k = x.k, ng = x.ng, k4 = k / 4, panel = k4 * 64, g4 = k4 / ng, c0 = b * 16;
  const int8_t* xr = x.q + m0 * k;
  const float* xs = x.scale + m0 * ng;
  const float* xo = x.off + m0 * ng;
  const int32_t* xb = xsum + m0 * ng;
  __m256 acc[MR][2], v[MR][2];
  auto dot = [&](const Weight& wt) {
    if (g4 == 16)  // acb's groups of 64 channels (int8_weights.GROUP): the k loop unrolled whole
      dot_tile16<MR, 16>(xr, k, wt.w + b * panel, ng, g4, wt.scale + b * ng * 16, xs, xo, xb, acc);
    else
      dot_tile16<MR, 0>(xr, k, wt.w + b * panel, ng, g4, wt.scale + b * ng * 16, xs, xo, xb, acc);
  };
  dot(w);
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) v[r][h] = biased8(acc[r][h], w.bias ? w.bias + c0 + 8 * h : nullptr);
  if (up != nullptr) {  // v holds the gate: act(gate) * up
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) v[r][h] = act256(v[r][h], act);
    dot(*up);
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h)
        v[r][h] = _mm256_mul_ps(v[r][h], biased8(acc[r][h], up->bias ? up->bias + c0 + 8 * h : nullptr));
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      __m256 o = v[r][h];
      if (epi == kAdd) o = _mm256_add_ps(o, load8(other + (m0 + r) * other_stride + c0 + 8 * h));
      store8(out + (m0 + r) * out_stride + c0 + 8 * h, o);
    }
}

constexpr int64_t kMR16 = 4;  // rows per AVX2 tile: 8 accumulators, 4 weight registers, the broadcast, ones

template <typename T>
void tile16_rows(int64_t rows, const int32_t* xsum, const Rows& x, const Weight& w, const Weight* up, int64_t act,
                 int64_t epi, const T* other, int64_t os, T* out, int64_t ostride, int64_t m0, int64_t b) {
  switch (rows) {
    case 4: tile16<T, 4>(xsum, x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 3: tile16<T, 3>(xsum, x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 2: tile16<T, 2>(xsum, x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    default: tile16<T, 1>(xsum, x, w, up, act, epi, other, os, out, ostride, m0, b); break;
  }
}

template <typename T>
void gemm(const Rows& x, int64_t m, const Weight& w, const Weight* up, int64_t act, int64_t epi,
          const torch::Tensor* other, torch::Tensor& out, int64_t n) {
  const int64_t k = x.k, ng = x.ng, group = k / ng;
  // 128 sum(x) per row and group, once per call (kept per calling thread)
  thread_local std::vector<int32_t> sums;
  if (static_cast<int64_t>(sums.size()) < m * ng) sums.resize(m * ng);
  int32_t* xsum = sums.data();
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b * ng; i < e * ng; ++i) {
      const int8_t* q = x.q + i * group;
      int32_t s = 0;
      for (int64_t j = 0; j < group; ++j) s += q[j];
      xsum[i] = 128 * s;
    }
  });
  // (16-column block, row chunk) items, blocks outermost as in the AVX-512 gemm: a block's weights
  // (16 K bytes) stay in L1/L2 across the chunk's row tiles
  const int64_t blocks = n / 16, chunk = 96, row_chunks = (m + chunk - 1) / chunk;
  const T* op = other ? reinterpret_cast<const T*>(other->data_ptr()) : nullptr;
  const int64_t os = other ? other->stride(0) : 0;
  T* outp = reinterpret_cast<T*>(out.data_ptr());
  const int64_t ostride = out.stride(0);
  at::parallel_for(0, blocks * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_chunks, rc = item % row_chunks;
      const int64_t first = rc * chunk, stop = std::min(m, first + chunk);
      for (int64_t m0 = first; m0 < stop; m0 += kMR16)
        tile16_rows<T>(std::min(kMR16, stop - m0), xsum, x, w, up, act, epi, op, os, outp, ostride, m0, b);
    }
  });
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// Low-bit weights (quantization="gguf": GGUF's Q4_0/Q4_1/Q4_K as nibbles, Q5_0/Q5_1/Q5_K in 5 bits, Q6_K as bytes;
// acb.model.gguf_native packs them). Each weight is an unsigned code q (0-15 in a nibble, 0-63 in a byte)
// with one scale d and one offset per output channel and group of G input channels: w = d q - 128 c
// (c = (d z + m) / 128 for GGUF's w = d (q - z) - m). Codes: nibbles [N/16][K/4][32] (byte j of a k step:
// its low nibble is column j / 4 of the block's first 8, input channel 4k + j % 4; its high nibble the
// same of column 8 + j / 4) or bytes [N/16][K/4][16][4] (the int8 layout). Scales [N/16][ng][32]: the
// group's 16 d, then its 16 c; as float32, or as float16 where the file's own float16 scales hold them
// exactly (Q4_0/Q4_1/Q5_0/Q5_1: d, and 128 c = d z + m), so the weights take the file's bytes.
// With the activations as quantize_rows gives them (q_x, xscale s, xoff o = 128 s sum(q_x)):
//   sum over the group of w x = d s sum(q q_x) - c o.
// The codes are unsigned and small, so vpmaddubsw (unsigned x signed bytes, pairs summed in int16) cannot
// saturate, and its int16 sums of several k steps are added in int16 before one vpmaddwd by ones widens
// them (nibbles: a group's 8 k steps, 16 products of at most 15 x 127 = 30,480; bytes: 2 steps, 4 x 63 x
// 127 = 32,004): ~2 instructions per 16 products, against 2 for the int8 weights' AVX2 form above.
// The AVX2 form; on AVX-512 VNNI CPUs the same layout through vpdpbusd (low_dot512).
enum LowKind : int { kInt8 = 0, kNibble = 1, kByte = 2, kNibble5 = 3 };

template <int KIND>
struct LowCodes;

template <>
struct LowCodes<kNibble> {
  static constexpr int64_t kRun = 8;  // k steps summed in int16
  static inline void at(const uint8_t* w, int64_t k, __m256i mask, __m256i& lo, __m256i& hi) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 32));
    lo = _mm256_and_si256(v, mask);
    hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
  }
  static constexpr int64_t kStep = 32;  // bytes per k step of a block
};

template <>
struct LowCodes<kByte> {
  static constexpr int64_t kRun = 2;
  static inline void at(const uint8_t* w, int64_t k, __m256i, __m256i& lo, __m256i& hi) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 64 + 32));
  }
  static constexpr int64_t kStep = 64;
};

// 5-bit codes in 5 bits: per 4 k steps (160 bytes), their 4 x 32 bytes of low nibbles as kNibble's, then
// 32 bytes of the fifth bits: bit 2i of byte j is the fifth bit of the low register's byte j at step i of
// the four, bit 2i + 1 the high register's
template <>
struct LowCodes<kNibble5> {
  static constexpr int64_t kRun = 4;  // 4 steps x 2 products x 31 x 127 = 31,496
  static inline void at(const uint8_t* w, int64_t k, __m256i mask, __m256i& lo, __m256i& hi) {
    const uint8_t* q = w + (k >> 2) * 160;
    const int i = static_cast<int>(k & 3);
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * 32));
    // step i's two bits of every byte at bits 0 and 1 (the bits a 16-bit shift brings in from the next
    // byte land above bit 1: never read)
    const __m256i h = _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 128)),
                                       _mm_cvtsi32_si128(2 * i));
    const __m256i bit4 = _mm256_set1_epi8(0x10);
    lo = _mm256_or_si256(_mm256_and_si256(v, mask), _mm256_and_si256(_mm256_slli_epi16(h, 4), bit4));
    hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), mask),
                         _mm256_and_si256(_mm256_slli_epi16(h, 3), bit4));
  }
  static constexpr int64_t kStep = 40;
};

// acc + the int16 pair sums of codes (unsigned bytes) times a (signed bytes), written as two instructions:
// from the intrinsics GCC 12 made a register copy per accumulator and k step and kept one accumulator in
// memory, a store and a load in its dependency chain every step (as madd_add and dpbusd above)
inline __m256i maddubs_add(__m256i acc, __m256i codes, __m256i a) {
  __m256i t;
  __asm__("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" : "+x"(acc), "=&x"(t) : "x"(codes), "x"(a));
  return acc;
}

// acc[r][h] (columns 8h..8h+7 of one 16-column block) = sum over the ng groups of the rows' dot products
// with the block's weights; w: the block's codes, wscale: its [ng][32] scales
// 8 scales from float32, or from float16 (F16C: every AVX2 CPU has it)
template <bool HALF>
inline __m256 scales8(const float* p, int64_t i) {
  if constexpr (HALF)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(reinterpret_cast<const uint16_t*>(p) + i)));
  else
    return _mm256_loadu_ps(p + i);
}

template <int KIND, int MR, bool HALF>
inline void low_dot(const int8_t* x, int64_t xs, const uint8_t* w, int64_t ng, int64_t g4, const float* wscale,
                    const float* xscale, const float* xoff, __m256 (&acc)[MR][2]) {
  using L = LowCodes<KIND>;
  const __m256i mask = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m256i s32[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) s32[r][0] = s32[r][1] = _mm256_setzero_si256();
    const int64_t end = (g + 1) * g4;
    for (int64_t k0 = g * g4; k0 < end; k0 += L::kRun) {
      const int64_t k1 = std::min(k0 + L::kRun, end);
      __m256i s16[MR][2];
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      for (int64_t k = k0; k < k1; ++k) {
        __m256i lo, hi;
        L::at(w, k, mask, lo, hi);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          int32_t a32;
          std::memcpy(&a32, x + r * xs + 4 * k, 4);
          const __m256i a = _mm256_set1_epi32(a32);
          s16[r][0] = maddubs_add(s16[r][0], lo, a);
          s16[r][1] = maddubs_add(s16[r][1], hi, a);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        s32[r][0] = _mm256_add_epi32(s32[r][0], _mm256_madd_epi16(s16[r][0], ones));
        s32[r][1] = _mm256_add_epi32(s32[r][1], _mm256_madd_epi16(s16[r][1], ones));
      }
    }
    const __m256 d0 = scales8<HALF>(wscale, g * 32), d1 = scales8<HALF>(wscale, g * 32 + 8);
    const __m256 c0 = scales8<HALF>(wscale, g * 32 + 16), c1 = scales8<HALF>(wscale, g * 32 + 24);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 s = _mm256_set1_ps(xscale[r * ng + g]);
      // float16 offsets hold 128 c: o / 128 (exact) in their place
      const __m256 o = _mm256_set1_ps(HALF ? xoff[r * ng + g] * 0.0078125f : xoff[r * ng + g]);
      acc[r][0] = _mm256_fnmadd_ps(c0, o, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32[r][0]), s), d0,
                                                          acc[r][0]));
      acc[r][1] = _mm256_fnmadd_ps(c1, o, _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s32[r][1]), s), d1,
                                                          acc[r][1]));
    }
  }
}

inline __m256 low_biased(__m256 acc, const float* bias) {
  return bias ? _mm256_add_ps(acc, _mm256_loadu_ps(bias)) : acc;
}

// One tile: rows [m0, m0 + MR) x the 16 columns of block b, with the epilogues of the int8 tiles
template <typename T, int KIND, int MR, bool HALF>
void low_tile(const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi, const T* other,
              int64_t other_stride, T* out, int64_t out_stride, int64_t m0, int64_t b) {
  const int64_t k = x.k, ng = x.ng, k4 = k / 4, g4 = k4 / ng, panel = k4 * LowCodes<KIND>::kStep;
  const int8_t* xq = x.q + m0 * k;
  const float* xs = x.scale + m0 * ng;
  const float* xo = x.off + m0 * ng;
  __m256 acc[MR][2], v[MR][2];
  auto dot = [&](const Weight& wt) {
    // (a float16 scale is half a float32: the block's first scale is b * ng * 16 floats in)
    low_dot<KIND, MR, HALF>(xq, k, wt.w + b * panel, ng, g4, wt.scale + b * ng * (HALF ? 16 : 32), xs, xo, acc);
  };
  dot(w);
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) v[r][h] = low_biased(acc[r][h], w.bias ? w.bias + b * 16 + 8 * h : nullptr);
  if (up != nullptr) {  // v holds the gate: act(gate) * up
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h) v[r][h] = acb_vec::act256(v[r][h], act);
    dot(*up);
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h)
        v[r][h] = _mm256_mul_ps(v[r][h], low_biased(acc[r][h], up->bias ? up->bias + b * 16 + 8 * h : nullptr));
  }
  for (int r = 0; r < MR; ++r)
    for (int h = 0; h < 2; ++h) {
      const int64_t n = b * 16 + 8 * h;
      __m256 o = v[r][h];
      if (epi == kAdd) o = _mm256_add_ps(o, acb_vec::load8(other + (m0 + r) * other_stride + n));
      acb_vec::store8(out + (m0 + r) * out_stride + n, o);
    }
}

constexpr int64_t kLowMR = 4;  // rows per tile: 8 int16 sums, 2 code registers, the broadcast, the mask

template <typename T, int KIND, bool HALF>
void low_tile_rows(int64_t rows, const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi,
                   const T* other, int64_t os, T* out, int64_t ostride, int64_t m0, int64_t b) {
  switch (rows) {
    case 4: low_tile<T, KIND, 4, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 3: low_tile<T, KIND, 3, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 2: low_tile<T, KIND, 2, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    default: low_tile<T, KIND, 1, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// The same GEMM on AVX-512 VNNI: a 16-column block's codes of a k step as one register of 16 x 4 unsigned
// bytes (the two halves the AVX2 form unpacks, side by side), vpdpbusd summing each row's products straight
// into int32 (no int16 step: nothing to saturate), then the same flush per group.
template <int KIND>
inline __m512i codes512(const uint8_t* w, int64_t k, __m256i mask) {
  __m256i lo, hi;
  LowCodes<KIND>::at(w, k, mask, lo, hi);
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

template <bool HALF>
inline __m512 scales16(const float* p, int64_t i) {
  if constexpr (HALF)
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(reinterpret_cast<const uint16_t*>(p) + i)));
  else
    return _mm512_loadu_ps(p + i);
}

template <int KIND, int MR, bool HALF>
inline void low_dot512(const int8_t* x, int64_t xs, const uint8_t* w, int64_t ng, int64_t g4, const float* wscale,
                       const float* xscale, const float* xoff, __m512 (&acc)[MR]) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < ng; ++g) {
    __m512i iacc[MR];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) iacc[r] = _mm512_setzero_si512();
    for (int64_t k = g * g4; k < (g + 1) * g4; ++k) {
      const __m512i b = codes512<KIND>(w, k, mask);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        int32_t a32;
        std::memcpy(&a32, x + r * xs + 4 * k, 4);
        iacc[r] = dpbusd(iacc[r], b, _mm512_set1_epi32(a32));
      }
    }
    const __m512 d = scales16<HALF>(wscale, g * 32), c = scales16<HALF>(wscale, g * 32 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 s = _mm512_set1_ps(xscale[r * ng + g]);
      const __m512 o = _mm512_set1_ps(HALF ? xoff[r * ng + g] * 0.0078125f : xoff[r * ng + g]);
      acc[r] = _mm512_fnmadd_ps(c, o, _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(iacc[r]), s), d, acc[r]));
    }
  }
}

template <typename T, int KIND, int MR, bool HALF>
void low_tile512(const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi, const T* other,
                 int64_t other_stride, T* out, int64_t out_stride, int64_t m0, int64_t b) {
  const int64_t k = x.k, ng = x.ng, k4 = k / 4, g4 = k4 / ng, panel = k4 * LowCodes<KIND>::kStep;
  const int8_t* xq = x.q + m0 * k;
  const float* xs = x.scale + m0 * ng;
  const float* xo = x.off + m0 * ng;
  __m512 acc[MR], v[MR];
  auto dot = [&](const Weight& wt) {
    low_dot512<KIND, MR, HALF>(xq, k, wt.w + b * panel, ng, g4, wt.scale + b * ng * (HALF ? 16 : 32), xs, xo, acc);
  };
  dot(w);
  for (int r = 0; r < MR; ++r) v[r] = biased(acc[r], w.bias ? w.bias + b * 16 : nullptr);
  if (up != nullptr) {  // v holds the gate: act(gate) * up
    for (int r = 0; r < MR; ++r) v[r] = act512(v[r], act);
    dot(*up);
    for (int r = 0; r < MR; ++r) v[r] = _mm512_mul_ps(v[r], biased(acc[r], up->bias ? up->bias + b * 16 : nullptr));
  }
  for (int r = 0; r < MR; ++r) {
    __m512 o = v[r];
    if (epi == kAdd) o = _mm512_add_ps(o, load16(other + (m0 + r) * other_stride + b * 16));
    store16(out + (m0 + r) * out_stride + b * 16, o);
  }
}

constexpr int64_t kLowMR512 = 8;  // rows per tile: 8 int32 and 8 float32 sums, the codes, the broadcast

template <typename T, int KIND, bool HALF>
void low_tile512_rows(int64_t rows, const Rows& x, const Weight& w, const Weight* up, int64_t act, int64_t epi,
                      const T* other, int64_t os, T* out, int64_t ostride, int64_t m0, int64_t b) {
  switch (rows) {
    case 8: low_tile512<T, KIND, 8, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 7: low_tile512<T, KIND, 7, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 6: low_tile512<T, KIND, 6, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 5: low_tile512<T, KIND, 5, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 4: low_tile512<T, KIND, 4, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 3: low_tile512<T, KIND, 3, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    case 2: low_tile512<T, KIND, 2, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
    default: low_tile512<T, KIND, 1, HALF>(x, w, up, act, epi, other, os, out, ostride, m0, b); break;
  }
}
#endif

// (16-column block, row chunk) items, blocks outermost: a block's codes stay in L1/L2 across a chunk's
// row tiles (as the int8 GEMMs)
template <typename T, int KIND, bool HALF>
void low_gemm_kind(const Rows& x, int64_t m, const Weight& w, const Weight* up, int64_t act, int64_t epi,
                   const torch::Tensor* other, torch::Tensor& out, int64_t n) {
  const int64_t blocks = n / 16, chunk = 96, row_chunks = (m + chunk - 1) / chunk;
  const T* op = other ? reinterpret_cast<const T*>(other->data_ptr()) : nullptr;
  const int64_t os = other ? other->stride(0) : 0;
  T* outp = reinterpret_cast<T*>(out.data_ptr());
  const int64_t ostride = out.stride(0);
  at::parallel_for(0, blocks * row_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / row_chunks, rc = item % row_chunks;
      const int64_t first = rc * chunk, stop = std::min(m, first + chunk);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
      for (int64_t m0 = first; m0 < stop; m0 += kLowMR512)
        low_tile512_rows<T, KIND, HALF>(std::min(kLowMR512, stop - m0), x, w, up, act, epi, op, os, outp, ostride, m0,
                                        b);
#else
      for (int64_t m0 = first; m0 < stop; m0 += kLowMR)
        low_tile_rows<T, KIND, HALF>(std::min(kLowMR, stop - m0), x, w, up, act, epi, op, os, outp, ostride, m0, b);
#endif
    }
  });
}

template <typename T>
void low_gemm(const Rows& x, int64_t m, const Weight& w, const Weight* up, int64_t act, int64_t epi,
              const torch::Tensor* other, torch::Tensor& out, int64_t n) {
  if (w.kind == kNibble5 && w.half)
    low_gemm_kind<T, kNibble5, true>(x, m, w, up, act, epi, other, out, n);
  else if (w.kind == kNibble5)
    low_gemm_kind<T, kNibble5, false>(x, m, w, up, act, epi, other, out, n);
  else if (w.kind == kNibble && w.half)
    low_gemm_kind<T, kNibble, true>(x, m, w, up, act, epi, other, out, n);
  else if (w.kind == kNibble)
    low_gemm_kind<T, kNibble, false>(x, m, w, up, act, epi, other, out, n);
  else if (w.half)
    low_gemm_kind<T, kByte, true>(x, m, w, up, act, epi, other, out, n);
  else
    low_gemm_kind<T, kByte, false>(x, m, w, up, act, epi, other, out, n);
}
#define ACB_LOWBIT 1
#endif

// A low-bit weight's kind (LowKind) from its tensors' shapes, 0 for an int8 one: scales [N/16, ng, 32]
// (16 scales, 16 offsets) mark a low-bit weight, its codes' [.., 8, 4] nibbles, [.., 16, 4] bytes
int kind_of(const torch::Tensor& w, const torch::Tensor& scale) {
  if (!(scale.dim() == 3 && scale.size(2) == 32)) return 0;
  return w.dim() == 4 && w.size(2) == 8 ? 1 : w.dim() == 4 && w.size(2) == 10 ? 3 : 2;
}

// ng: the activations' groups per row; the weight's scales hold ng per output channel
void check_weight(const torch::Tensor& w, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                  int64_t k, int64_t ng) {
  const int kind = kind_of(w, scale);
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 && w.dim() == 4 && w.size(2) == (kind == 1 ? 8 : kind == 3 ? 10 : 16)
                  && w.size(3) == 4 && w.is_contiguous() && (kind != 3 || w.size(1) % 4 == 0),
              "the weight must be a contiguous packed uint8 [N/16, K/4, 16, 4] (int8 + 128, or low-bit codes with "
              "[N/16, groups, 32] scales), low-bit nibbles [N/16, K/4, 8, 4] or 5-bit codes [N/16, K/4, 10, 4]");
  TORCH_CHECK(w.size(1) * 4 == k, "the weight's K (", w.size(1) * 4, ") is not the input's (", k, ")");
  const int64_t n = w.size(0) * 16, per = kind ? 2 : 1;
  TORCH_CHECK((scale.scalar_type() == torch::kFloat32 || (kind && scale.scalar_type() == torch::kHalf)) &&
                  scale.is_contiguous() && scale.numel() == per * n * ng,
              "the weight's scales must be a contiguous float32 (or, low-bit, float16) [N/16, groups, ", per * 16,
              "] with the input's ", ng, " group(s) per row (it has ", scale.numel() / std::max<int64_t>(per * n, 1),
              ")");
#if !defined(ACB_LOWBIT)
  TORCH_CHECK(kind == 0, "acb's low-bit (GGUF) kernels need AVX2 and FMA");
#endif
  if (bias) TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == n,
                        "bias must be a contiguous float32 [N]");
}

// The activations (quantize_rows' three outputs) as the GEMM reads them
Rows check_input(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& xoff) {
  TORCH_CHECK(xq.scalar_type() == torch::kInt8 && xq.dim() == 2 && xq.is_contiguous(),
              "xq must be a contiguous int8 [M, K] (acb_int8.quantize_rows)");
  TORCH_CHECK(xq.size(1) % 4 == 0, "K must be a multiple of 4");
  for (const torch::Tensor* t : {&xscale, &xoff})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == xq.size(0) && t->size(1) >= 1 && t->size(1) == xscale.size(1),
                "xscale and xoff must be contiguous float32 [M, groups]");
  const int64_t ng = xscale.size(1);
  TORCH_CHECK(xq.size(1) % (4 * ng) == 0, "K (", xq.size(1), ") must split into ", ng, " groups of a multiple of 4");
  return Rows{xq.data_ptr<int8_t>(), xscale.data_ptr<float>(), xoff.data_ptr<float>(), xq.size(1), ng};
}

Weight weight_of(const torch::Tensor& w, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias) {
  return Weight{w.data_ptr<uint8_t>(), reinterpret_cast<const float*>(scale.data_ptr()),
                bias ? bias->data_ptr<float>() : nullptr, kind_of(w, scale), scale.scalar_type() == torch::kHalf};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// x <- x H in place: the Walsh-Hadamard transform (Sylvester's order, entries +-1, not normalised)
// in blocks of b = the largest power of two dividing k (vec_avx512.h's sums, in memory for
// blocks too large for registers). The four stages within 16 lanes in registers, then the stages
// across them; the scalar loop where b < 16.
inline void hadamard_row(float* x, int64_t k) {
  const int64_t b = k & -k;
  if (b < 16) return acb_vec::hadamard_scalar(x, k);
  for (int64_t i = 0; i < k; i += 16) _mm512_storeu_ps(x + i, acb_vec::hadamard_lanes(_mm512_loadu_ps(x + i)));
  for (int64_t len = 16; len < b; len <<= 1)  // pairs (j, j + len) never cross a block: 2 len <= b and b | k
    for (int64_t i = 0; i < k; i += 2 * len)
      for (int64_t j = i; j < i + len; j += 16) {
        const __m512 u = _mm512_loadu_ps(x + j), v = _mm512_loadu_ps(x + j + len);
        _mm512_storeu_ps(x + j, _mm512_add_ps(u, v));
        _mm512_storeu_ps(x + j + len, _mm512_sub_ps(u, v));
      }
}

// A row's values quantized group by group (groups of 16 nv values): vals, the row's k values (normed,
// multiplied, rotated); amax (16 floats a group), each group's |max| so far lane by lane. Per group
// q = round(v * 127 / max|v|) (signed bytes, to nearest even as nearbyint), scale max|v| / 127 and
// offset 128 * sum(q) * scale. Sixteen groups at a time: their maxima reduced into one vector (a
// tree of shuffles), their scales and 127 / max in one division each, each group's values rounded,
// then their sums reduced alike. Group by group, two chains of shuffles and two divisions each
// left a row's quantization waiting on their latency (1,667 x 576, smoothed and rotated: 145 us).
inline void quantize_groups(const float* vals, int64_t k, int64_t nv, const float* amax, int8_t* q, float* scales,
                            float* offs) {
  const int64_t group = 16 * nv, ng = k / group;
  for (int64_t g0 = 0; g0 < ng; g0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, ng - g0));
    const __mmask16 lanes = static_cast<__mmask16>((1u << n) - 1);
    __m512 t[16];
    for (int i = 0; i < 16; ++i) t[i] = i < n ? _mm512_loadu_ps(amax + (g0 + i) * 16) : _mm512_setzero_ps();
    const __m512 top = acb_vec::reduce16_max(t), s = _mm512_div_ps(top, _mm512_set1_ps(127.f));
    const __m512 qs = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(top, _mm512_setzero_ps(), _CMP_GT_OQ),
                                          _mm512_div_ps(_mm512_set1_ps(127.f), top));
    alignas(64) float qa[16];
    _mm512_store_ps(qa, qs);
    for (int i = 0; i < n; ++i) {
      const __m512 f = _mm512_set1_ps(qa[i]);
      const float* v = vals + (g0 + i) * group;
      int8_t* qg = q + (g0 + i) * group;
      __m512i sum = _mm512_setzero_si512();
      for (int64_t j = 0; j < nv; ++j) {
        const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16 * j), f));
        sum = _mm512_add_epi32(sum, r);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qg + 16 * j), _mm512_cvtsepi32_epi8(r));
      }
      t[i] = _mm512_cvtepi32_ps(sum);  // integers of at most 127 nv: the float sums below are exact
    }
    for (int i = n; i < 16; ++i) t[i] = _mm512_setzero_ps();
    const __m512 total = acb_vec::reduce16(t);
    _mm512_mask_storeu_ps(scales + g0, lanes, s);
    _mm512_mask_storeu_ps(offs + g0, lanes, _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(128.f), total), s));
  }
}

// 16 of a row's values from x + i, widened to float32, normed (w * (x * inv); w null: not normed) and
// times the multiplier (null: none): what quantize_row's paths below compute before rotating or rounding
template <typename T>
inline __m512 prepared16(const T* x, int64_t i, const float* w, const float* mult, __m512 vinv) {
  __m512 u = load16(x + i);
  if (w) u = _mm512_mul_ps(_mm512_loadu_ps(w + i), _mm512_mul_ps(u, vinv));
  if (mult) u = _mm512_mul_ps(u, _mm512_loadu_ps(mult + i));
  return u;
}

// quantize_row's rotated blocks of NB registers (b = 16 NB values; NB known at compile time, so the
// block stays in registers): each loaded (normed with inv and w, times mult), rotated (hadamard16:
// hadamard_row's sums in its order, so the same bits), then stored to buf with each group's |max|
// (groups of nv registers) into amax, for quantize_groups. Not inlined (nor rotated_wide): inlined into
// quantize_row<uint16_t>, bf16 rows ran ~25 % slower than float32 ones (1,667 x 576 on one thread: 254
// against 186 us; 205 not inlined).
template <int NB, typename T>
__attribute__((noinline)) void rotated_blocks(const T* x, int64_t k, int64_t nv, const float* w, const float* mult,
                                              float inv, float* buf, float* amax) {
  const __m512 vinv = _mm512_set1_ps(inv);
  const int64_t group = 16 * nv;
  for (int64_t b0 = 0; b0 < k; b0 += 16 * NB) {
    __m512 v[NB];
#pragma GCC unroll 32
    for (int c = 0; c < NB; ++c) v[c] = prepared16(x, b0 + 16 * c, w, mult, vinv);
    acb_vec::hadamard16(v, NB, 16 * NB);
    for (int64_t g0 = 0; g0 < 16 * NB; g0 += group) {
      __m512 m = _mm512_setzero_ps();
      for (int64_t j = 0; j < nv; ++j) {
        const __m512 u = v[g0 / 16 + j];
        _mm512_storeu_ps(buf + b0 + g0 + 16 * j, u);
        m = _mm512_max_ps(m, _mm512_abs_ps(u));
      }
      _mm512_storeu_ps(amax + (b0 + g0) / group * 16, m);
    }
  }
}

// hadamard_row's stages across registers of len values and on, SPAN registers (log2 SPAN stages) at a
// time: each (the row's values at p, k of them, blocks of SPAN len) loaded SPAN at a time len apart,
// the stages in registers, stored back. The same sums in the same order, so the same bits.
template <int SPAN>
inline void cross_stages(float* p, int64_t k, int64_t len) {
  for (int64_t base = 0; base < k; base += SPAN * len)
    for (int64_t o = base; o < base + len; o += 16) {
      __m512 v[SPAN];
#pragma GCC unroll 8
      for (int c = 0; c < SPAN; ++c) v[c] = _mm512_loadu_ps(p + o + c * len);
#pragma GCC unroll 4
      for (int st = 1; st < SPAN; st <<= 1)
#pragma GCC unroll 8
        for (int i = 0; i < SPAN; i += 2 * st)
#pragma GCC unroll 8
          for (int j = i; j < i + st; ++j) {
            const __m512 u = v[j], t = v[j + st];
            v[j] = _mm512_add_ps(u, t);
            v[j + st] = _mm512_sub_ps(u, t);
          }
#pragma GCC unroll 8
      for (int c = 0; c < SPAN; ++c) _mm512_storeu_ps(p + o + c * len, v[c]);
    }
}

// quantize_row's rotation over blocks of b > 64 values (SmolLM2's down projection: 512): each 64
// values loaded, normed and multiplied, rotated within (hadamard16 on four registers) and stored to
// buf, then the stages across the 64-value chunks three at a time (cross_stages: eight registers),
// then each group's |max| into amax, for quantize_groups. (The whole block in registers, 32 of them,
// spilled: 1,667 x 1,536 smoothed and rotated took 352 us against 330 through hadamard_row.)
template <typename T>
__attribute__((noinline)) void rotated_wide(const T* x, int64_t k, int64_t b, int64_t nv, const float* w,
                                            const float* mult, float inv, float* buf, float* amax) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i0 = 0; i0 < k; i0 += 64) {
    __m512 v[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) v[c] = prepared16(x, i0 + 16 * c, w, mult, vinv);
    acb_vec::hadamard16(v, 4, 64);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(buf + i0 + 16 * c, v[c]);
  }
  for (int64_t len = 64; len < b;) {
    if (b / len >= 8) { cross_stages<8>(buf, k, len); len *= 8; }
    else if (b / len == 4) { cross_stages<4>(buf, k, len); len *= 4; }
    else { cross_stages<2>(buf, k, len); len *= 2; }
  }
  const int64_t group = 16 * nv;
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = g0; i < g0 + group; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(buf + i)));
    _mm512_storeu_ps(amax + g0 / group * 16, m);
  }
}

// One row: optional RMSNorm (w * (x * r), r = 1 / sqrt(mean(x^2) + eps); the product is
// commutative, so Llama's and Gemma's orders give the same float), then optionally times the
// per-channel multiplier m (acb.quantization's smoothing 1/s, applied after the norm's product as
// the model's own forward applies it to the norm's output), then per group
// of `group` channels q = round(v * 127 / max|v|) (round to nearest even, as nearbyint), scale =
// max|v| / 127 and offset = 128 * sum(q) * scale (see the GEMM above). rotate: v <- v H
// (hadamard_row; acb.quantization's input rotation, the weight's columns rotated alike) before the
// groups are quantized. buf: 2 k floats (the row's values, then its groups' maxima).
template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, const float* w, const float* mult, float eps, int8_t* q,
                  float* scales, float* offs, float* buf, bool rotate = false) {
  const bool norm = w != nullptr;
  auto mask = [](int64_t i, int64_t end) {
    return static_cast<__mmask16>(end - i >= 16 ? 0xffff : (1u << (end - i)) - 1);
  };
  float inv = 1.f;
  if (norm) {  // four sums: one chain of k / 16 dependent FMAs was ~30 % of a 576-wide row's time
    __m512 ss[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int64_t i = 0;
    for (; i + 64 <= k; i += 64)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512 v = load16(x + i + 16 * c);
        ss[c] = _mm512_fmadd_ps(v, v, ss[c]);
      }
    for (; i < k; i += 16) {
      const __m512 v = load16(x + i, mask(i, k));
      ss[0] = _mm512_fmadd_ps(v, v, ss[0]);
    }
    const __m512 sum = _mm512_add_ps(_mm512_add_ps(ss[0], ss[1]), _mm512_add_ps(ss[2], ss[3]));
    inv = 1.f / std::sqrt(_mm512_reduce_add_ps(sum) / static_cast<float>(k) + eps);
  }
  const int64_t b = k & -k;  // the rotation's block
  if (rotate && b % 16 == 0 && group % 16 == 0 && b % group == 0) {
    const int64_t nv = group / 16;
    float* amax = buf + k;
    switch (b / 16) {  // blocks of up to 64 values in registers
      case 1: rotated_blocks<1>(x, k, nv, w, mult, inv, buf, amax); break;
      case 2: rotated_blocks<2>(x, k, nv, w, mult, inv, buf, amax); break;
      case 4: rotated_blocks<4>(x, k, nv, w, mult, inv, buf, amax); break;
      default: rotated_wide(x, k, b, nv, w, mult, inv, buf, amax); break;
    }
    return quantize_groups(buf, k, nv, amax, q, scales, offs);
  }
  if (rotate) {  // any other shape: through buf
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 m = mask(i, k);
      __m512 v = load16(x + i, m);
      if (norm) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_mul_ps(v, _mm512_set1_ps(inv)));
      if (mult) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, mult + i));
      _mm512_mask_storeu_ps(buf + i, m, v);
    }
    hadamard_row(buf, k);
    // buf read as the row (no norm, no multiplier); the general path's rewrite of buf stores the values it read
    quantize_row<float>(buf, k, group, nullptr, nullptr, eps, q, scales, offs, buf);
    return;
  }
  if (group % 16 == 0) {  // the groups acb uses: the values through buf, each group's |max| into amax
    const __m512 vinv = _mm512_set1_ps(inv);
    float* amax = buf + k;
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      __m512 m = _mm512_setzero_ps();
      for (int64_t i = g0; i < g0 + group; i += 16) {
        const __m512 v = prepared16(x, i, w, mult, vinv);
        _mm512_storeu_ps(buf + i, v);
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
      }
      _mm512_storeu_ps(amax + g0 / group * 16, m);
    }
    return quantize_groups(buf, k, group / 16, amax, q, scales, offs);
  }
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    const int64_t end = g0 + group;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = g0; i < end; i += 16) {
      const __mmask16 m = mask(i, end);
      __m512 v = load16(x + i, m);
      if (norm) v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_mul_ps(v, _mm512_set1_ps(inv)));
      if (mult) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, mult + i));
      _mm512_mask_storeu_ps(buf + i, m, v);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    const float top = _mm512_reduce_max_ps(amax), scale = top / 127.f;
    const __m512 qs = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t i = g0; i < end; i += 16) {
      const __mmask16 m = mask(i, end);
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, buf + i), qs));
      sum = _mm512_add_epi32(sum, r);  // masked lanes hold zeros
      _mm_mask_storeu_epi8(q + i, m, _mm512_cvtsepi32_epi8(r));
    }
    scales[g0 / group] = scale;
    offs[g0 / group] = 128.f * static_cast<float>(_mm512_reduce_add_epi32(sum)) * scale;
  }
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__))
// quantize_row without AVX-512 (the same steps: the norm, the multiplier, the rotation, then per group
// q = round(v * 127 / max|v|), scale and offset), through buf: 8 lanes at a time on AVX2 where the
// row, its groups and its rotation blocks are multiples of 8, scalar otherwise. The norm's sum runs
// in another order than the AVX-512 kernel's (a last-bit difference in its scale at most).
template <typename T>
inline float wide(const T* p, int64_t i) {
  if constexpr (std::is_same_v<T, float>) return p[i]; else return widen(p[i]);
}

template <typename T>
void quantize_row(const T* x, int64_t k, int64_t group, const float* w, const float* mult, float eps, int8_t* q,
                  float* scales, float* offs, float* buf, bool rotate = false) {
  float inv = 1.f;
  if (w) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < k; ++i) {
      const float v = wide(x, i);
      ss += v * v;
    }
    inv = 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
  }
#pragma omp simd
  for (int64_t i = 0; i < k; ++i) {
    float u = wide(x, i);
    if (w) u = w[i] * (u * inv);
    if (mult) u = u * mult[i];
    buf[i] = u;
  }
  const int64_t b = k & -k;
#if defined(__AVX2__) && defined(__FMA__)
  const bool lanes = k % 8 == 0 && group % 8 == 0;
  if (rotate) {
    if (b >= 8) acb_vec::hadamard_row8(buf, k); else acb_vec::hadamard_scalar(buf, k);
  }
  if (lanes) {
    for (int64_t g0 = 0; g0 < k; g0 += group) {
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 amax = _mm256_setzero_ps();
      for (int64_t i = g0; i < g0 + group; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(buf + i)));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float top = _mm_cvtss_f32(m4), s = top / 127.f;
      const __m256 qs = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
      __m256i sum = _mm256_setzero_si256();
      for (int64_t i = g0; i < g0 + group; i += 8) {
        const __m256i r = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(buf + i), qs));  // to nearest even
        sum = _mm256_add_epi32(sum, r);
        const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(h, h));
      }
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
      scales[g0 / group] = s;
      offs[g0 / group] = 128.f * static_cast<float>(_mm_cvtsi128_si32(s4)) * s;
    }
    return;
  }
#else
  if (rotate) acb_vec::hadamard_scalar(buf, k);
#endif
  for (int64_t g0 = 0; g0 < k; g0 += group) {
    float top = 0.f;
    for (int64_t i = g0; i < g0 + group; ++i) top = std::max(top, std::fabs(buf[i]));
    const float s = top / 127.f, qs = top > 0.f ? 127.f / top : 0.f;
    int32_t sum = 0;
    for (int64_t i = g0; i < g0 + group; ++i) {
      const int32_t r = static_cast<int32_t>(std::nearbyint(buf[i] * qs));
      sum += r;
      q[i] = static_cast<int8_t>(std::clamp<int32_t>(r, -128, 127));
    }
    scales[g0 / group] = s;
    offs[g0 / group] = 128.f * static_cast<float>(sum) * s;
  }
}
#endif

// A per-channel float32 multiplier as a pointer (widened into `keep` when it is bf16), or null
const float* channel_weights(const c10::optional<torch::Tensor>& w, int64_t k, const char* what,
                             std::vector<float>& keep) {
  if (!w) return nullptr;
  TORCH_CHECK(w->numel() == k && w->is_contiguous(), what, " must be a contiguous [K]");
  if (w->scalar_type() == torch::kFloat32) return w->data_ptr<float>();
  TORCH_CHECK(w->scalar_type() == torch::kBFloat16, what, " must be float32 or bfloat16");
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w->data_ptr());
  keep.resize(k);
  for (int64_t i = 0; i < k; ++i) keep[i] = widen(src[i]);
  return keep.data();
}

template <typename T>
std::vector<torch::Tensor> quantize_any(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                        double eps, int64_t group, const c10::optional<torch::Tensor>& mult,
                                        bool rotate) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be a 2-D tensor with contiguous rows");
  const int64_t m = x.size(0), k = x.size(1), xs = x.stride(0);
  TORCH_CHECK(k % 4 == 0, "the row width must be a multiple of 4");
  if (group <= 0) group = k;
  TORCH_CHECK(k % group == 0 && group % 4 == 0, "the group (", group, ") must be a multiple of 4 dividing the row width (",
              k, ")");
  const int64_t ng = k / group;
  auto q = torch::empty({m, k}, x.options().dtype(torch::kInt8));
  auto s = torch::empty({m, ng}, x.options().dtype(torch::kFloat32));
  auto o = torch::empty({m, ng}, x.options().dtype(torch::kFloat32));
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  int8_t* qp = q.data_ptr<int8_t>();
  float* sp = s.data_ptr<float>();
  float* op = o.data_ptr<float>();
  std::vector<float> widened, widened_mult;  // bf16 ones widened once per call
  const float* w = channel_weights(norm_w, k, "the norm weight", widened);
  const float* mp = channel_weights(mult, k, "mult", widened_mult);
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t b, int64_t e) {
    std::vector<float> buf(2 * k);  // the row's values, then (AVX-512) each group's |max| lanes
    for (int64_t t = b; t < e; ++t) {
      quantize_row(xp + t * xs, k, group, w, mp, static_cast<float>(eps), qp + t * k, sp + t * ng, op + t * ng,
                   buf.data(), rotate);
    }
  });
  return {q, s, o};
}


}  // namespace

bool has_vnni() { return kVnni; }
bool available() { return kGemm; }

// x: [M, K] float32 or bfloat16 -> (q: int8 [M, K], scale and offset: float32 [M, K / group]);
// group <= 0: the whole row (one scale per token). With norm_w ([K], float32 or bf16), each row
// is RMS-normalised first (Llama's w * (x * r); Gemma's (x * r) * (1 + w) when norm_w is the
// float32 1 + w; `gemma` is kept for callers: the two orders are one float); with mult ([K]),
// then multiplied by it (acb.quantization's smoothing); with rotate, then rotated (x H in blocks of
// the largest power of two dividing K, +-1 entries: hadamard_row) before it is quantized.
std::vector<torch::Tensor> quantize_rows(const torch::Tensor& x, const c10::optional<torch::Tensor>& norm_w,
                                         bool gemma, double eps, int64_t group,
                                         const c10::optional<torch::Tensor>& mult, bool rotate) {
  TORCH_CHECK(kGemm, "acb's int8 kernels were built without AVX-512 VNNI or AVX2");
  (void)gemma;
  if (x.scalar_type() == torch::kFloat32) return quantize_any<float>(x, norm_w, eps, group, mult, rotate);
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be float32 or bfloat16");
  return quantize_any<uint16_t>(x, norm_w, eps, group, mult, rotate);
}

// out [M, N] (of `dtype`'s kind: float32 or bfloat16) = dequantized xq @ W^T (+ bias), + other when given
torch::Tensor linear(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& xoff,
                     const torch::Tensor& w, const torch::Tensor& scale, const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& other, torch::ScalarType dtype) {
  TORCH_CHECK(kGemm, "acb's int8 kernels were built without AVX-512 VNNI or AVX2");
  const Rows x = check_input(xq, xscale, xoff);
  check_weight(w, scale, bias, x.k, x.ng);
  const int64_t n = w.size(0) * 16, m = xq.size(0);
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  auto out = torch::empty({m, n}, xq.options().dtype(dtype));
  if (other) TORCH_CHECK(other->scalar_type() == dtype && other->dim() == 2 && other->size(0) == m &&
                             other->size(1) == n && other->stride(1) == 1,
                         "other must be [M, N] of the output's dtype with contiguous rows");
  const Weight wt = weight_of(w, scale, bias);
#if defined(ACB_LOWBIT)
  if (wt.kind != kInt8) {
    if (m > 0 && dtype == torch::kFloat32)
      low_gemm<float>(x, m, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
    else if (m > 0)
      low_gemm<uint16_t>(x, m, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
    return out;
  }
#endif
#if defined(__AVX512VNNI__) || defined(ACB_INT8_AVX2)
  if (m > 0) {
    if (dtype == torch::kFloat32)
      gemm<float>(x, m, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
    else
      gemm<uint16_t>(x, m, wt, nullptr, 0, other ? kAdd : kNone, other ? &*other : nullptr, out, n);
  }
#endif
  return out;
}

// out [M, N] = act(xq @ Wgate^T) * (xq @ Wup^T); act 0: SiLU, 1: GELU-tanh
torch::Tensor glu(const torch::Tensor& xq, const torch::Tensor& xscale, const torch::Tensor& xoff,
                  const torch::Tensor& wg, const torch::Tensor& sg, const c10::optional<torch::Tensor>& bg,
                  const torch::Tensor& wu, const torch::Tensor& su, const c10::optional<torch::Tensor>& bu,
                  int64_t act, torch::ScalarType dtype) {
  TORCH_CHECK(kGemm, "acb's int8 kernels were built without AVX-512 VNNI or AVX2");
  const Rows x = check_input(xq, xscale, xoff);
  check_weight(wg, sg, bg, x.k, x.ng);
  check_weight(wu, su, bu, x.k, x.ng);
  TORCH_CHECK(wg.sizes() == wu.sizes(), "gate and up must have the same shape");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "the output must be float32 or bfloat16");
  const int64_t n = wg.size(0) * 16, m = xq.size(0);
  auto out = torch::empty({m, n}, xq.options().dtype(dtype));
  const Weight g = weight_of(wg, sg, bg), u = weight_of(wu, su, bu);
  TORCH_CHECK(g.kind == u.kind && g.half == u.half && sg.sizes() == su.sizes(),
              "gate and up must have the same weight format");
#if defined(ACB_LOWBIT)
  if (g.kind != kInt8) {
    if (m > 0 && dtype == torch::kFloat32)
      low_gemm<float>(x, m, g, &u, act, kNone, nullptr, out, n);
    else if (m > 0)
      low_gemm<uint16_t>(x, m, g, &u, act, kNone, nullptr, out, n);
    return out;
  }
#endif
#if defined(__AVX512VNNI__) || defined(ACB_INT8_AVX2)
  if (m > 0) {
    if (dtype == torch::kFloat32)
      gemm<float>(x, m, g, &u, act, kNone, nullptr, out, n);
    else
      gemm<uint16_t>(x, m, g, &u, act, kNone, nullptr, out, n);
  }
#endif
  return out;
}

// A decode-only step's layers in one call: acb.model.quantization.Int8Forward's loop for the models it
// takes whole here (q/k/v joined in one GEMM, no Gemma norms, no q/k norms, one rotary embedding,
// no soft-capping), with the same kernel calls, in the same order, on the same tensors as that
// Python loop, so the same outputs bit for bit. From Python the loop cost ~1.3-1.7 ms of a ~25 ms
// SmolLM2 decode step (~330 calls through pybind11, each taking the GIL back between kernels while
// the event loop's thread plans the next step); here the GIL stays released for the whole step.
// RoPE and the decode attention are fused_cpu.cpp's and paged_decode_cpu.cpp's functions (decode_loop.h).
DecodeLoop::DecodeLoop(torch::ScalarType dtype) : dtype_(dtype) {
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "DecodeLoop: the model's dtype must be "
              "float32 or bfloat16");
}

// One layer, in order: its norms (weight, eps; norm 0 before attention, 1 before the MLP), the
// four GEMM inputs' quantization (group, smoothing multiplier or none, rotated), the five packed
// weights (q/k/v joined, o, gate, up, down: packed, scales, bias or none), then the attention's
// shape (query and key columns of the joined output, heads, kv heads, head dim), its scale and
// sliding window (0: none), and the MLP's activation (0 SiLU, 1 GELU-tanh).
void DecodeLoop::add_layer(const std::vector<torch::Tensor>& norms, const std::vector<double>& eps,
                           const std::vector<int64_t>& groups, const std::vector<c10::optional<torch::Tensor>>& mults,
                           const std::vector<bool>& rotated, const std::vector<torch::Tensor>& weights,
                           const std::vector<torch::Tensor>& scales,
                           const std::vector<c10::optional<torch::Tensor>>& biases, int64_t nq, int64_t nk,
                           int64_t heads, int64_t kv_heads, int64_t head_dim, double scaling, int64_t window,
                           int64_t act) {
  TORCH_CHECK(norms.size() == 2 && eps.size() == 2 && groups.size() == 4 && mults.size() == 4 &&
                  rotated.size() == 4 && weights.size() == 5 && scales.size() == 5 && biases.size() == 5,
              "DecodeLoop.add_layer: 2 norms and eps, 4 groups, multipliers and rotations, 5 weights, scales "
              "and biases");
  TORCH_CHECK(nq == heads * head_dim && nk == kv_heads * head_dim && weights[0].size(0) * 16 == nq + 2 * nk,
              "DecodeLoop.add_layer: the joined q/k/v columns do not match the heads");
  Layer l;
  for (int i = 0; i < 2; ++i) l.norm[i] = norms[i], l.eps[i] = eps[i];
  for (int i = 0; i < 4; ++i) l.group[i] = groups[i], l.mult[i] = mults[i], l.rot[i] = rotated[i];
  for (int i = 0; i < 5; ++i) l.w[i] = weights[i], l.s[i] = scales[i], l.b[i] = biases[i];
  l.attn = {nq, nk, heads, kv_heads, head_dim, window, scaling};
  l.act = act;
  layers_.push_back(std::move(l));
}

// Layer i of run() (decode_loop.h's DecodeLayers): the stream x [T, hidden] float32 after it
torch::Tensor DecodeLoop::layer(int64_t i, const Layer& l, torch::Tensor x, const torch::Tensor& cos,
                                const torch::Tensor& sin, const DecodeStep& step) const {
  const c10::optional<torch::Tensor> none;
  auto h = quantize_rows(x, l.norm[0], false, l.eps[0], l.group[0], l.mult[0], l.rot[0]);
  const torch::Tensor a = attend_(i, linear(h[0], h[1], h[2], l.w[0], l.s[0], l.b[0], none, dtype_), l.attn, cos,
                                  sin, step);
  if (!a.defined()) return a;
  h = quantize_rows(a, none, false, 1e-6, l.group[1], l.mult[1], l.rot[1]);
  x = linear(h[0], h[1], h[2], l.w[1], l.s[1], l.b[1], x, torch::kFloat32);  // the residual add fused
  h = quantize_rows(x, l.norm[1], false, l.eps[1], l.group[2], l.mult[2], l.rot[2]);
  torch::Tensor m = glu(h[0], h[1], h[2], l.w[2], l.s[2], l.b[2], l.w[3], l.s[3], l.b[3], l.act, torch::kFloat32);
  h = quantize_rows(m, none, false, 1e-6, l.group[3], l.mult[3], l.rot[3]);
  return linear(h[0], h[1], h[2], l.w[4], l.s[4], l.b[4], x, torch::kFloat32);
}

}  // namespace acb::int8

template class acb::DecodeLayers<acb::int8::DecodeLoop, acb::int8::Layer>;
