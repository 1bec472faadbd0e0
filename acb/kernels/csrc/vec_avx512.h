// acb's vector helpers on AVX-512 (float32 in 16 lanes): bf16 widening and rounding, loads and stores of
// float32 or bf16 rows, exp and the MLP activations (written with explicit FMAs, so they compute the same
// with or without -ffp-contract / -ffast-math), reductions across 16 vectors and the Walsh-Hadamard
// stages. One header per ISA (vec_scalar.h, vec_avx2.h, this), all included through vec.h. Everything
// is `static inline`: each source file compiles its own copy with its own flags (acb/kernels/cpu.py's
// SOURCES), none shared between them at link time.
#pragma once
#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>

namespace acb_vec {

// bfloat16 <-> float32 on 16 lanes, what acb_bf16::widen / to_bf16 (vec_scalar.h) do to one value: a
// bf16 is the top half of a float32's bits (widening is exact); rounding is to nearest, ties to even,
// as PyTorch rounds. Every kernel reading or writing bf16 rows on AVX-512 uses these.
static inline __m512 widen16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// the rounded bits of finite lanes (a NaN may round to an infinity: the callers' values are finite)
static inline __m256i round16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}
// the same with NaN lanes 0x7fc0 (a quiet NaN), exactly acb_bf16::to_bf16 on every value
static inline __m256i round16_nan(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

// 16 lanes of float32, or of bfloat16 (uint16_t: its bits), loaded as float32; float32 lanes stored
// as float32 or rounded to bfloat16 (round16)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) { return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
static inline void store16(uint16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), round16(v)); }
#if defined(__AVX512BW__) && defined(__AVX512VL__)
// the same on the lanes of mask m only: the others read as 0 and are not written
static inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load16(const uint16_t* p, __mmask16 m) { return widen16(_mm256_maskz_loadu_epi16(m, p)); }
static inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
static inline void store16(uint16_t* p, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(p, m, round16(v)); }
#endif

// exp(x) for float32 lanes: x = n ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, 2^n by
// scalef (relative error ~2e-7 over the range an activation meets; as int8_cpu.cpp)
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
// (int8_cpu.cpp), the loops unroll and the row stays in registers.
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
