// Peak throughput of the three dot-product instructions acb's CPU GEMMs use, one core:
// float32 FMA (oneDNN's fp32 and acb's float paths), VDPBF16PS (acb's bf16 GEMMs and attention),
// VPDPBUSD (acb's int8 GEMMs). Twelve independent accumulator chains each, so latency does not
// bound them. What the GEMM figures in docs/performance.md are measured against.
//
//     g++ -O3 -march=native -o /tmp/cpu_peaks benchmarks/cpu_peaks.cpp && /tmp/cpu_peaks
//
// (2026-12-04, the Zen 5 host: 257 GFLOP/s fp32, 472 bf16, 1010 GOP/s int8 per core.)
#include <immintrin.h>

#include <chrono>
#include <cstdio>

// Instructions per nanosecond of op over twelve independent accumulators (V: their vector type).
template <typename V, typename Op>
static double rate(V init, Op op, long n) {
  V a[12];
  for (int i = 0; i < 12; ++i) a[i] = init;
  const auto t0 = std::chrono::steady_clock::now();
  for (long k = 0; k < n / 12; ++k)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = op(a[i]);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  volatile char sink = 0;
  for (int i = 0; i < 12; ++i) sink ^= reinterpret_cast<const char*>(&a[i])[0];  // the chains are used
  return n / s / 1e9;
}

int main() {
  const long n = 200000000;  // instructions per kind
  double r = rate(_mm512_set1_ps(0.001f), [](__m512 a) {
    return _mm512_fmadd_ps(a, _mm512_set1_ps(0.999f), _mm512_set1_ps(0.0001f));
  }, n);
  std::printf("float32 FMA (zmm):  %.2f instructions/ns, %.0f GFLOP/s\n", r, r * 32);
#if defined(__AVX512BF16__)
  r = rate(_mm512_set1_ps(0.001f), [](__m512 a) {
    return _mm512_dpbf16_ps(a, (__m512bh)_mm512_set1_epi16(0x3f80), (__m512bh)_mm512_set1_epi16(0x3f00));
  }, n);
  std::printf("VDPBF16PS (zmm):    %.2f instructions/ns, %.0f GFLOP/s\n", r, r * 64);
#endif
#if defined(__AVX512VNNI__)
  r = rate(_mm512_set1_epi32(1), [](__m512i a) {
    return _mm512_dpbusd_epi32(a, _mm512_set1_epi8(3), _mm512_set1_epi8(5));
  }, n);
  std::printf("VPDPBUSD (zmm):     %.2f instructions/ns, %.0f GOP/s\n", r, r * 128);
#endif
  return 0;
}
