// bfloat16 <-> float32 one value at a time, by bits (vectorises under omp simd, unlike
// c10::BFloat16's class); shared by acb's native CPU kernels.
#pragma once
#include <cstdint>
#include <cstring>

namespace acb_bf16 {

inline float widen(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// round to nearest, ties to even, as PyTorch rounds; NaN stays NaN
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace acb_bf16
