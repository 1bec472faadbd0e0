// acb's scalar helpers, on every CPU: bfloat16 <-> float32 one value at a time, by bits (vectorises under
// omp simd, unlike c10::BFloat16's class), and the Walsh-Hadamard transform of a row.
#pragma once
#include <cstdint>
#include <cstring>

namespace acb_bf16 {

static inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest, ties to even, as PyTorch rounds; NaN stays NaN
static inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace acb_bf16

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
