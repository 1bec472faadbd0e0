// Vector math shared by acb's native CPU kernels (AVX-512, float32 lanes): exp and the MLP
// activations, written with explicit FMAs so they compute the same with or without
// -ffp-contract / -ffast-math.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>

namespace acb_vec {

// exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n by
// scalef (relative error ~2e-7 over the range an activation meets; as acb/kernels/int8_cpu.cpp)
static inline __m512 exp512(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 act512(__m512 g, int64_t act) {
  const __m512 one = _mm512_set1_ps(1.f);
  if (act == 0) return _mm512_div_ps(g, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  // GELU-tanh: 0.5 g (1 + tanh(u)), tanh(u) = 1 - 2 / (exp(2u) + 1)
  const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
  const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp512(_mm512_add_ps(u, u)), one)));
  return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, t));
}

// 16 vectors -> one: lane j = op over v[j]'s 16 lanes (a tree of 15 shuffle-ops, not 16 horizontal
// reductions; op is _mm512_add_ps or _mm512_max_ps). Always inlined: GCC kept it a call, so the 16
// vectors went through the stack each time (the bf16 decode kernel over pages read from memory, 45
// rows x ~380 keys: 400 -> 372 us a call, 2026-12-06).
template <__m512 (*op)(__m512, __m512)>
__attribute__((always_inline)) static inline __m512 reduce16_with(const __m512* v) {
  __m512 s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)  // lanes 0-7: v[2i]'s two halves combined, 8-15: v[2i+1]'s
    s[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)  // quarter k: v[4j + k]'s partial results (4 lanes)
    t[j] = op(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88), _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
  for (int j = 0; j < 2; ++j)
    u[j] = op(_mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
              _mm512_shuffle_ps(t[2 * j], t[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // lane 4k + l: the result of v[4l + k]; put lane j at j
  const __m512 w = op(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                      _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}
static inline __m512 add512(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
static inline __m512 max512(__m512 a, __m512 b) { return _mm512_max_ps(a, b); }
__attribute__((always_inline)) static inline __m512 reduce16(const __m512* v) { return reduce16_with<add512>(v); }
__attribute__((always_inline)) static inline __m512 reduce16_max(const __m512* v) { return reduce16_with<max512>(v); }

// The Walsh-Hadamard transform's first four butterfly stages (Sylvester's order, entries +-1, not
// normalised) within 16 lanes: lanes j and j ^ 1, then j ^ 2, j ^ 4, j ^ 8; each stage's lanes with
// the bit set take partner - self, the others self + partner. The stages across registers follow in
// hadamard16 below.
static inline __m512 hadamard_stage(__m512 self, __m512 partner, __mmask16 upper) {
  return _mm512_mask_sub_ps(_mm512_add_ps(self, partner), upper, partner, self);
}
static inline __m512 hadamard_lanes(__m512 v) {
  v = hadamard_stage(v, _mm512_permute_ps(v, 0xB1), 0xAAAA);         // lanes j, j ^ 1
  v = hadamard_stage(v, _mm512_permute_ps(v, 0x4E), 0xCCCC);         // j, j ^ 2
  v = hadamard_stage(v, _mm512_shuffle_f32x4(v, v, 0xB1), 0xF0F0);  // j, j ^ 4
  return hadamard_stage(v, _mm512_shuffle_f32x4(v, v, 0x4E), 0xFF00);  // j, j ^ 8
}

// hadamard_scalar (below) on a row held in n registers (16 n values, blocks of b >= 16 values):
// the four stages within each register, then the stages across registers. The same sums as the
// scalar one, stage by stage, so the same bits. Inlined with n and b known at compile time
// (acb/kernels/int8_cpu.cpp), the loops unroll and the row stays in registers.
static inline void hadamard16(__m512* x, int64_t n, int64_t b) {
#pragma GCC unroll 32
  for (int64_t c = 0; c < n; ++c) x[c] = hadamard_lanes(x[c]);
#pragma GCC unroll 8
  for (int64_t len = 1; len < b / 16; len <<= 1)
    for (int64_t base = 0; base < n; base += b / 16)
#pragma GCC unroll 32
      for (int64_t i = base; i < base + b / 16; i += 2 * len)
#pragma GCC unroll 32
        for (int64_t j = i; j < i + len; ++j) {
          const __m512 u = x[j], v = x[j + len];
          x[j] = _mm512_add_ps(u, v);
          x[j + len] = _mm512_sub_ps(u, v);
        }
}

}  // namespace acb_vec
#endif

#include <cstdint>

namespace acb_vec {

// The Walsh-Hadamard transform (Sylvester's order, entries +-1, not normalised) of a row of n
// values in place, in blocks of b = the largest power of two dividing n: x <- x H. int8 pages store
// keys so rotated (acb/kv_quant.py), int8 GEMMs their inputs (acb/quantization.py).
static inline void hadamard_scalar(float* x, int64_t n) {
  const int64_t b = n & -n;
  for (int64_t base = 0; base < n; base += b)
    for (int64_t len = 1; len < b; len <<= 1)
      for (int64_t i = base; i < base + b; i += 2 * len)
        for (int64_t j = i; j < i + len; ++j) {
          const float u = x[j], v = x[j + len];
          x[j] = u + v;
          x[j + len] = u - v;
        }
}

}  // namespace acb_vec

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <cstdint>

namespace acb_vec {

// exp512 on 8 lanes (AVX2: 2^n built in the exponent bits, n in [-127, 127]; exp(-88) and below
// come out 0, as a float32 subnormal would round to for the callers here)
static inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// 8 lanes of float32, or of bfloat16 bits widened to float32 (the top half of a float's bits)
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// 8 float32 lanes stored as float32, or rounded to bfloat16 (to nearest even, as PyTorch rounds finite values)
static inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
static inline void store8(uint16_t* p, __m256 v) {
  __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  u = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  _mm_storeu_si128((__m128i*)p, _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)));
}

// act512 on 8 lanes: SiLU (act 0) or GELU-tanh (1)
static inline __m256 act256(__m256 g, int64_t act) {
  const __m256 one = _mm256_set1_ps(1.f);
  if (act == 0) return _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                                 _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
  const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp256(_mm256_add_ps(u, u)), one)));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(one, t));
}

// hadamard_scalar's sums on a row of n values (n a multiple of 8, blocks of b >= 8): the three stages
// within 8 lanes in registers (lanes j and j ^ 1, j ^ 2, j ^ 4; the lane with the bit set takes
// partner - self), then the stages across registers in memory. The same sums, so the same bits.
static inline __m256 hadamard_lanes8(__m256 v) {
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0xB1)), _mm256_sub_ps(_mm256_permute_ps(v, 0xB1), v), 0xAA);
  v = _mm256_blend_ps(_mm256_add_ps(v, _mm256_permute_ps(v, 0x4E)), _mm256_sub_ps(_mm256_permute_ps(v, 0x4E), v), 0xCC);
  const __m256 swapped = _mm256_permute2f128_ps(v, v, 0x01);
  return _mm256_blend_ps(_mm256_add_ps(v, swapped), _mm256_sub_ps(swapped, v), 0xF0);
}
static inline void hadamard_row8(float* x, int64_t n) {
  const int64_t b = n & -n;
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, hadamard_lanes8(_mm256_loadu_ps(x + i)));
  for (int64_t len = 8; len < b; len <<= 1)
    for (int64_t i = 0; i < n; i += 2 * len)
      for (int64_t j = i; j < i + len; j += 8) {
        const __m256 u = _mm256_loadu_ps(x + j), v = _mm256_loadu_ps(x + j + len);
        _mm256_storeu_ps(x + j, _mm256_add_ps(u, v));
        _mm256_storeu_ps(x + j + len, _mm256_sub_ps(u, v));
      }
}

}  // namespace acb_vec
#endif
