// Forced in front of a kernel source (-include) when ACB_CPU_KERNEL_EMULATE is set (acb/kernels/cpu.py):
// the kernels' AVX-512 paths compiled against SIMDe's portable implementations of the intrinsics
// (https://github.com/simd-everywhere/simde; Debian's libsimde-dev), so a machine without AVX-512
// runs, slowly, exactly the code an AVX-512 one runs natively. For correctness tests only
// (scripts/test-avx512-emulated.sh): never for speed. The ISA macros defined: AVX-512 F, BW, VL and
// DQ, with VNNI and BF16 unless -DACB_EMULATE_NO_VNNI / -DACB_EMULATE_NO_BF16 leave them out
// (the CPU kinds: Sapphire Rapids and Zen 4 have all; Cascade Lake and Ice Lake no BF16;
// Skylake-X neither).
#pragma once
#include <immintrin.h>  // the native (AVX2) header first: its guard keeps the sources' own include a no-op
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#define ACB_EMULATED_AVX512 1

// What the kernels use that SIMDe 0.7.4 (Debian 12's) lacks, written lane by lane from Intel's
// definitions (masked loads and stores touch only the lanes their masks select, as the hardware's)
namespace acb_emu {
// a vector's lanes as a plain array and back (memcpy: no aliasing questions)
template <typename T, int N, typename V>
inline void lanes(T (&out)[N], const V& v) {
  static_assert(sizeof(out) == sizeof(V), "lane count");
  std::memcpy(out, &v, sizeof(V));
}
template <typename V, typename T, int N>
inline V vec(const T (&in)[N]) {
  static_assert(sizeof(in) == sizeof(V), "lane count");
  V v;
  std::memcpy(&v, in, sizeof(V));
  return v;
}

inline simde__m512 maskz_loadu_ps(uint16_t k, const void* p) {
  float r[16];
  for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? static_cast<const float*>(p)[i] : 0.0f;
  return vec<simde__m512>(r);
}
inline void mask_storeu_ps(void* p, uint16_t k, simde__m512 a) {
  float v[16];
  lanes(v, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) static_cast<float*>(p)[i] = v[i];
}
inline __m256i maskz_loadu_epi16(uint16_t k, const void* p) {
  int16_t r[16];
  for (int i = 0; i < 16; ++i) r[i] = (k >> i) & 1 ? static_cast<const int16_t*>(p)[i] : 0;
  return vec<__m256i>(r);
}
inline void mask_storeu_epi16(void* p, uint16_t k, __m256i a) {
  int16_t v[16];
  lanes(v, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) static_cast<int16_t*>(p)[i] = v[i];
}
inline void mask_storeu_epi8(void* p, uint16_t k, __m128i a) {
  int8_t v[16];
  lanes(v, a);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) static_cast<int8_t*>(p)[i] = v[i];
}
// 16 lanes of a (elements From), each through f, as a vector R of 16 To
template <typename R, typename To, typename From, typename A, typename F>
inline R map16(const A& a, F f) {
  From v[16];
  To r[16];
  lanes(v, a);
  for (int i = 0; i < 16; ++i) r[i] = f(v[i]);
  return vec<R>(r);
}
inline __m256i cvtepi32_epi16(simde__m512i a) {  // vpmovdw: truncation
  return map16<__m256i, int16_t, int32_t>(a, [](int32_t x) { return static_cast<int16_t>(x); });
}
inline __m128i cvtepi32_epi8(simde__m512i a) {  // vpmovdb: truncation
  return map16<__m128i, int8_t, int32_t>(a, [](int32_t x) { return static_cast<int8_t>(x); });
}
inline simde__m512 cvtepi32_ps(simde__m512i a) {
  return map16<simde__m512, float, int32_t>(a, [](int32_t x) { return static_cast<float>(x); });
}
inline simde__m512i cvtps_epi32(simde__m512 a) {  // the current rounding mode: nearest, ties to even
  return map16<simde__m512i, int32_t, float>(a, [](float x) { return static_cast<int32_t>(std::nearbyint(x)); });
}
inline simde__m512i cvtepi8_epi32(__m128i a) {
  return map16<simde__m512i, int32_t, int8_t>(a, [](int8_t x) { return static_cast<int32_t>(x); });
}
inline simde__m512i cvtepu16_epi32(__m256i a) {
  return map16<simde__m512i, int32_t, uint16_t>(a, [](uint16_t x) { return static_cast<int32_t>(x); });
}
inline simde__m512 cvtph_ps(__m256i a) {
  float r[16];
  _mm256_storeu_ps(r, _mm256_cvtph_ps(_mm256_castsi256_si128(a)));
  _mm256_storeu_ps(r + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1)));
  return vec<simde__m512>(r);
}
inline uint16_t to_bf16(float f) {  // vcvtne2ps2bf16: nearest, ties to even; a NaN stays a (quiet) NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline simde__m512bh cvtne2ps_pbh(simde__m512 a, simde__m512 b) {  // lanes 0-15 from b, 16-31 from a
  float va[16], vb[16];
  uint16_t r[32];
  lanes(va, a);
  lanes(vb, b);
  for (int i = 0; i < 16; ++i) {
    r[i] = to_bf16(vb[i]);
    r[16 + i] = to_bf16(va[i]);
  }
  return vec<simde__m512bh>(r);
}
inline simde__m512 permute_ps(simde__m512 a, int imm) {  // within each 128-bit lane
  float v[16], r[16];
  lanes(v, a);
  for (int l = 0; l < 4; ++l)
    for (int i = 0; i < 4; ++i) r[4 * l + i] = v[4 * l + ((imm >> (2 * i)) & 3)];
  return vec<simde__m512>(r);
}
// the reductions in GCC's order (avx512fintrin.h: halves, then quarters, then pairs)
template <typename T, typename Op>
inline T reduce16(const T (&v)[16], Op op) {
  T t3[8], t6[4];
  for (int i = 0; i < 8; ++i) t3[i] = op(v[8 + i], v[i]);
  for (int i = 0; i < 4; ++i) t6[i] = op(t3[4 + i], t3[i]);
  return op(op(t6[0], t6[2]), op(t6[1], t6[3]));
}
inline float reduce_add_ps(simde__m512 a) {
  float v[16];
  lanes(v, a);
  return reduce16(v, [](float x, float y) { return x + y; });
}
inline float reduce_max_ps(simde__m512 a) {
  float v[16];
  lanes(v, a);
  return reduce16(v, [](float x, float y) { return x > y ? x : y; });
}
inline int reduce_add_epi32(simde__m512i a) {
  int32_t v[16];
  lanes(v, a);
  return reduce16(v, [](int32_t x, int32_t y) {
    return static_cast<int32_t>(static_cast<uint32_t>(x) + static_cast<uint32_t>(y));
  });
}
}  // namespace acb_emu

#define _mm512_maskz_loadu_ps acb_emu::maskz_loadu_ps
#define _mm512_mask_storeu_ps acb_emu::mask_storeu_ps
#define _mm256_maskz_loadu_epi16 acb_emu::maskz_loadu_epi16
#define _mm256_mask_storeu_epi16 acb_emu::mask_storeu_epi16
#define _mm_mask_storeu_epi8 acb_emu::mask_storeu_epi8
#define _mm512_cvtepi32_epi16 acb_emu::cvtepi32_epi16
#define _mm512_cvtepi32_epi8 acb_emu::cvtepi32_epi8
#define _mm512_cvtepi32_ps acb_emu::cvtepi32_ps
#define _mm512_cvtps_epi32 acb_emu::cvtps_epi32
#define _mm512_cvtepi8_epi32 acb_emu::cvtepi8_epi32
#define _mm512_cvtepu16_epi32 acb_emu::cvtepu16_epi32
#define _mm512_cvtph_ps acb_emu::cvtph_ps
#define _mm512_cvtne2ps_pbh acb_emu::cvtne2ps_pbh
#define _mm512_permute_ps acb_emu::permute_ps
#define _mm512_reduce_add_ps acb_emu::reduce_add_ps
#define _mm512_reduce_max_ps acb_emu::reduce_max_ps
#define _mm512_reduce_add_epi32 acb_emu::reduce_add_epi32
#define _mm512_shuffle_f32x4 simde_mm512_shuffle_f32x4
// the ISA macros the kernels' preprocessor choices read, now that the intrinsics behind them exist
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#if !defined(ACB_EMULATE_NO_VNNI)
#define __AVX512VNNI__ 1
#endif
#if !defined(ACB_EMULATE_NO_BF16)
#define __AVX512BF16__ 1
#endif
