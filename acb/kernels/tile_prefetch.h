// Which part of the next column tile's weights a row tile of acb's CPU GEMMs prefetches
// (acb/kernels/int8_cpu.cpp, acb/kernels/bf16_cpu.cpp): both split a GEMM into (column tile, row chunk)
// items and fetch the next tile's blocks into L2 while a chunk's first row tiles read their own.
#pragma once
#include <cstdint>
#include <utility>

namespace acb_tiles {

// Blocks [first, second) of the next column tile (nb blocks) for row tile i of a chunk: block i for
// the chunk's first nb row tiles, everything from i on for its last one (`last`); none (an empty
// range) when the thread's next item is not the next, whole, column tile (`ahead` false).
inline std::pair<int, int> next_tile_share(bool ahead, int64_t i, bool last, int nb) {
  if (!ahead || i >= nb) return {0, 0};
  const int j = static_cast<int>(i);
  return {j, last ? nb : j + 1};
}

}  // namespace acb_tiles
