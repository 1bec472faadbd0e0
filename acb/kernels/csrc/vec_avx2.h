// acb's vector helpers on AVX2 + FMA (float32 in 8 lanes): exp, bf16 loads and stores, the MLP
// activations and the Walsh-Hadamard stages, as vec_avx512.h has them on 16 lanes (see there; vec.h
// includes both).
#pragma once
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
