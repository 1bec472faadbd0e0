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

template <typename F>
static double seconds(F f, long iters) {
  const auto t0 = std::chrono::steady_clock::now();
  f(iters);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int main() {
  const long n = 200000000;  // instructions per kind
  volatile float fsink;
  volatile int isink;
  double t = seconds([&](long iters) {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(i * 0.001f);
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.0001f);
    for (long k = 0; k < iters; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    fsink = _mm512_reduce_add_ps(s);
  }, n / 12);
  std::printf("float32 FMA (zmm):  %.2f instructions/ns, %.0f GFLOP/s\n", n / t / 1e9, n / t / 1e9 * 32);
#if defined(__AVX512BF16__)
  t = seconds([&](long iters) {
    __m512 a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(i * 0.001f);
    const __m512i b = _mm512_set1_epi16(0x3f80), c = _mm512_set1_epi16(0x3f00);
    for (long k = 0; k < iters; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)b, (__m512bh)c);
    __m512 s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, a[i]);
    fsink = _mm512_reduce_add_ps(s);
  }, n / 12);
  std::printf("VDPBF16PS (zmm):    %.2f instructions/ns, %.0f GFLOP/s\n", n / t / 1e9, n / t / 1e9 * 64);
#endif
#if defined(__AVX512VNNI__)
  t = seconds([&](long iters) {
    __m512i a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
    const __m512i b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
    for (long k = 0; k < iters; ++k)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
    __m512i s = a[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_epi32(s, a[i]);
    isink = _mm512_reduce_add_epi32(s);
  }, n / 12);
  std::printf("VPDPBUSD (zmm):     %.2f instructions/ns, %.0f GOP/s\n", n / t / 1e9, n / t / 1e9 * 128);
#endif
  return 0;
}
