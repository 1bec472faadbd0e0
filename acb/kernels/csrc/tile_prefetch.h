// Which part of the next column tile's weights a row tile of acb's CPU GEMMs prefetches
// (int8_cpu.cpp, bf16_cpu.cpp): both split a GEMM into (column tile, row chunk)
// items and fetch the next tile's blocks into L2 while a chunk's first row tiles read their own. And
// the rows a tile's epilogue reads and writes, fetched before its dot products.
#pragma once
#include <cstdint>
#include <utility>
#include <xmmintrin.h>

namespace acb_tiles {

// Blocks [first, second) of the next column tile (nb blocks) for row tile i of a chunk: block i for
// the chunk's first nb row tiles, everything from i on for its last one (`last`); none (an empty
// range) when the thread's next item is not the next, whole, column tile (`ahead` false).
inline std::pair<int, int> next_tile_share(bool ahead, int64_t i, bool last, int nb) {
  if (!ahead || i >= nb) return {0, 0};
  const int j = static_cast<int>(i);
  return {j, last ? nb : j + 1};
}

// Rows [m0, m0 + rows) x columns [c0, c1) of a row-major matrix of T (row stride `stride`), into L1:
// a tile's residual rows (`write` false) or its output rows (`write` true: fetched to be written),
// before its dot products. Its epilogue otherwise waited on them from memory after them: a prefill's
// residual stream (1,667 x 576 float32) is not in cache when the o and down projections add into it,
// and the int8 GEMM took 1,010 against 750 us a call (576 -> 576) and 2,270 against 1,870 (1,536 ->
// 576) over a cold residual than over none; with the rows fetched first 745-775 and 1,860-2,000.
template <typename T>
inline void prefetch_rows(const T* p, int64_t stride, int64_t m0, int rows, int64_t c0, int64_t c1, bool write) {
  for (int r = 0; r < rows; ++r) {
    const char* a = reinterpret_cast<const char*>(p + (m0 + r) * stride + c0);
    const char* b = reinterpret_cast<const char*>(p + (m0 + r) * stride + c1);
    for (const char* line = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(a) & ~uintptr_t{63}); line < b;
         line += 64) {
      if (write) _mm_prefetch(line, _MM_HINT_ET0);
      else _mm_prefetch(line, _MM_HINT_T0);
    }
  }
}

}  // namespace acb_tiles
