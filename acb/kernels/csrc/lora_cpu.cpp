// LoRA deltas for acb's fused CPU forward (acb/lora.py, acb/fused.py): float32, AVX-512.
//
// One call adds the deltas of every projection that shares an input (q/k/v, gate/up, o, down):
//   t = x[rows] @ At[slot]                      the shrink: one GEMM over the group's concatenated
//                                               A ([in, C], C = projections x max rank)
//   y_p[row] += s_p[slot] * t[:, p R:(p+1) R] @ Bt_p[slot]     the expand, in place, per projection
// for each adapter row (``order``: the step's adapter token rows grouped by slot; ``groups``:
// (slot, start, count) runs of ``order``), every slot's rows in tiles of up to 4 that share its
// weights, no gather or scatter of the rows (punica's BGMV/SGMV, on the CPU). Rows outside
// ``order`` (the base model's, the padding) are not touched. A slot whose scale for a projection is
// 0 (its adapter does not target it) adds nothing there.
//
// glu_add: m = act(g + gate delta) * (u + up delta) over rows (SiLU or GELU-tanh) in one pass, for
// the MLP whose gate/up take a delta (the GEMM's fused epilogue cannot take it before the activation).
#include "ops.h"
#include <immintrin.h>
#include "vec.h"
#include <algorithm>
#include <cstdint>
#include <vector>

namespace acb::lora {
namespace {

constexpr int64_t MR = 4;  // rows of one slot per tile
// Below this many rows a call runs on the calling thread: a decode step's deltas are a few
// microseconds of work, less than waking the OpenMP pool (measured: docs/performance.md)
constexpr int64_t kParallelRows = 256;

// fn(0, units) on this thread when ``rows`` is small, else at::parallel_for over the units
template <typename F>
void run_units(int64_t rows, int64_t units, int64_t grain, const F& fn) {
  if (rows < kParallelRows)
    fn(0, units);
  else
    at::parallel_for(0, units, grain, fn);
}

struct Tile {
  int64_t slot, start, len;
};

std::vector<Tile> tiles_of(const torch::Tensor& groups, int64_t slots, int64_t n_order) {
  TORCH_CHECK(groups.scalar_type() == torch::kLong && groups.dim() == 2 && groups.size(1) == 3 &&
                  groups.is_contiguous(), "groups must be a contiguous int64 [g, 3]");
  const int64_t* g = groups.data_ptr<int64_t>();
  std::vector<Tile> out;
  for (int64_t i = 0; i < groups.size(0); ++i) {
    const int64_t slot = g[3 * i], start = g[3 * i + 1], len = g[3 * i + 2];
    TORCH_CHECK(slot >= 0 && slot < slots && start >= 0 && len >= 0 && start + len <= n_order, "bad group");
    for (int64_t s = start; s < start + len; s += MR) out.push_back({slot, s, std::min(MR, start + len - s)});
  }
  return out;
}

#if defined(__AVX512F__)
using acb_vec::act512;
inline __mmask16 tail(int64_t left) { return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1); }

// t[m, c0 : c0 + 16 NV] = sum_k x_m[k] at[k, c0 + ...], M rows, masked past C
template <int M, int NV>
void shrink_tile(const float* const* xr, const float* at, int64_t K, int64_t C, int64_t c0, float* t) {
  __m512 acc[M][NV];
  __mmask16 mask[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) mask[v] = tail(C - c0 - 16 * v);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* row = at + k * C + c0;
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 xv = _mm512_set1_ps(xr[m][k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_fmadd_ps(xv, b[v], acc[m][v]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(t + m * C + c0 + 16 * v, mask[v], acc[m][v]);
}

template <int M>
void shrink_rows(const float* const* xr, const float* at, int64_t K, int64_t C, float* t) {
  for (int64_t c0 = 0; c0 < C; c0 += 64) {
    switch (std::min<int64_t>(4, (C - c0 + 15) / 16)) {
      case 1: shrink_tile<M, 1>(xr, at, K, C, c0, t); break;
      case 2: shrink_tile<M, 2>(xr, at, K, C, c0, t); break;
      case 3: shrink_tile<M, 3>(xr, at, K, C, c0, t); break;
      default: shrink_tile<M, 4>(xr, at, K, C, c0, t); break;
    }
  }
}

// y_m[n0 : n0 + 64] += sum_r ts[m][r] bt[r, n0 + ...] (ts: t already times the scale)
template <int M>
void expand_tile(float* const* yr, const float (*ts)[64], const float* bt, int64_t R, int64_t N, int64_t n0) {
  __m512 acc[M][4];
  __mmask16 mask[4];
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) mask[v] = n0 + 16 * v < N ? tail(N - n0 - 16 * v) : __mmask16(0);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_maskz_loadu_ps(mask[v], yr[m] + n0 + 16 * v);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = bt + r * N + n0;
    __m512 b[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) b[v] = _mm512_maskz_loadu_ps(mask[v], row + 16 * v);
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      const __m512 tv = _mm512_set1_ps(ts[m][r]);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm512_fmadd_ps(tv, b[v], acc[m][v]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm512_mask_storeu_ps(yr[m] + n0 + 16 * v, mask[v], acc[m][v]);
}

// m_r[n0 : n0 + 32] = act(g_r + sum_q tg[r][q] btg[q, n0 + ...]) * (u_r + sum_q tu[r][q] btu[q, ...]) for M rows
// (M = 0 ... MR; with no tg the rows have no adapter: act(g) * u)
template <int M>
void glu_tile(const float* const* gr, const float* const* ur, float* const* mr, const float (*tg)[64],
              const float (*tu)[64], const float* btg, const float* btu, int64_t R, int64_t N, int64_t n0, int64_t act) {
  __m512 ag[M][2], au[M][2];
  __mmask16 mask[2];
  for (int v = 0; v < 2; ++v) mask[v] = n0 + 16 * v < N ? tail(N - n0 - 16 * v) : __mmask16(0);
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 2; ++v) {
      ag[m][v] = _mm512_maskz_loadu_ps(mask[v], gr[m] + n0 + 16 * v);
      au[m][v] = _mm512_maskz_loadu_ps(mask[v], ur[m] + n0 + 16 * v);
    }
  if (tg != nullptr) {
    for (int64_t r = 0; r < R; ++r) {
      __m512 bg[2], bu[2];
      for (int v = 0; v < 2; ++v) {
        bg[v] = _mm512_maskz_loadu_ps(mask[v], btg + r * N + n0 + 16 * v);
        bu[v] = _mm512_maskz_loadu_ps(mask[v], btu + r * N + n0 + 16 * v);
      }
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        const __m512 x = _mm512_set1_ps(tg[m][r]), y = _mm512_set1_ps(tu[m][r]);
        for (int v = 0; v < 2; ++v) {
          ag[m][v] = _mm512_fmadd_ps(x, bg[v], ag[m][v]);
          au[m][v] = _mm512_fmadd_ps(y, bu[v], au[m][v]);
        }
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < 2; ++v)
      _mm512_mask_storeu_ps(mr[m] + n0 + 16 * v, mask[v], _mm512_mul_ps(act512(ag[m][v], act), au[m][v]));
}
#endif

void check_f32_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, name,
              " must be a float32 2-D tensor with contiguous rows");
}

}  // namespace

#if defined(__AVX512F__)
// t[j] = x[order[j]] @ at[slot of j] for the rows of ``tiles`` (compact: one row of t per entry of order)
torch::Tensor shrink(const torch::Tensor& x, const torch::Tensor& at, const int64_t* op, const std::vector<Tile>& tiles) {
  const int64_t K = at.size(1), C = at.size(2);
  int64_t n = 0;
  for (const Tile& tile : tiles) n = std::max(n, tile.start + tile.len);
  auto t = torch::empty({n, C}, x.options());
  float* tp = t.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float* ap = at.data_ptr<float>();
  const int64_t xs = x.stride(0);
  run_units(n, static_cast<int64_t>(tiles.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Tile& tile = tiles[i];
      const float* xr[MR];
      for (int64_t m = 0; m < tile.len; ++m) xr[m] = xp + op[tile.start + m] * xs;
      const float* a = ap + tile.slot * K * C;
      float* out = tp + tile.start * C;
      switch (tile.len) {
        case 1: shrink_rows<1>(xr, a, K, C, out); break;
        case 2: shrink_rows<2>(xr, a, K, C, out); break;
        case 3: shrink_rows<3>(xr, a, K, C, out); break;
        default: shrink_rows<4>(xr, a, K, C, out); break;
      }
    }
  });
  return t;
}
#endif

bool available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// the arguments' shapes and types (see add_); the tiles of order
std::vector<Tile> check(const std::vector<torch::Tensor>& ys, const torch::Tensor& x, const torch::Tensor& at,
                        const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& scales,
                        const torch::Tensor& order, const torch::Tensor& groups) {
  TORCH_CHECK(available(), "acb's LoRA kernels were built without AVX-512");
  check_f32_rows(x, "x");
  TORCH_CHECK(at.scalar_type() == torch::kFloat32 && at.dim() == 3 && at.is_contiguous() && at.size(1) == x.size(1),
              "at must be a contiguous float32 [slots, in, C] matching x");
  TORCH_CHECK(order.scalar_type() == torch::kLong && order.dim() == 1 && order.is_contiguous(),
              "order must be a contiguous int64 [n]");
  TORCH_CHECK(ys.size() == bts.size() && ys.size() == scales.size() && !ys.empty(), "one bt and scale per y");
  const int64_t S = at.size(0), K = at.size(1), C = at.size(2), n = order.size(0);
  const int64_t R = bts[0].size(1);
  TORCH_CHECK(static_cast<int64_t>(ys.size()) * R <= C, "at has fewer columns than the projections' ranks");
  const int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(op[i] >= 0 && op[i] < x.size(0), "order holds a row out of range");
  for (size_t p = 0; p < ys.size(); ++p) {
    check_f32_rows(ys[p], "y");
    TORCH_CHECK(bts[p].scalar_type() == torch::kFloat32 && bts[p].is_contiguous() && bts[p].dim() == 3 &&
                    bts[p].size(0) == S && bts[p].size(1) == R && bts[p].size(2) == ys[p].size(1),
                "bt must be a contiguous float32 [slots, R, out] matching y");
    TORCH_CHECK(scales[p].scalar_type() == torch::kFloat32 && scales[p].is_contiguous() && scales[p].numel() == S,
                "scale must be a contiguous float32 [slots]");
    TORCH_CHECK(ys[p].size(0) >= x.size(0), "y has fewer rows than x");
  }
  TORCH_CHECK(R <= 64, "the kernel takes ranks up to 64");
  return tiles_of(groups, S, n);
}

// ys[p] (rows, N_p) += s_p[slot] * (x @ at[slot])[:, p R : (p + 1) R] @ bts[p][slot] for the rows of
// ``order`` (see the top of the file); at [S, K, C] with C >= len(ys) R, bts[p] [S, R, N_p].
void add_(const std::vector<torch::Tensor>& ys, const torch::Tensor& x, const torch::Tensor& at,
          const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& scales, const torch::Tensor& order,
          const torch::Tensor& groups) {
  const std::vector<Tile> tiles = check(ys, x, at, bts, scales, order, groups);
  if (tiles.empty()) return;
  const int64_t C = at.size(2), R = bts[0].size(1);
  const int64_t* op = order.data_ptr<int64_t>();
#if defined(__AVX512F__)
  auto t = shrink(x, at, op, tiles);
  const float* tp = t.data_ptr<float>();
  // one parallel region over (tile, projection, 64-column block): a tile's units side by side
  const int64_t np = static_cast<int64_t>(ys.size());
  std::vector<int64_t> first(np + 1, 0);  // each projection's first block among a tile's
  for (int64_t p = 0; p < np; ++p) first[p + 1] = first[p] + (ys[p].size(1) + 63) / 64;
  const int64_t blocks = first[np];
  run_units(order.size(0), static_cast<int64_t>(tiles.size()) * blocks, 4, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Tile& tile = tiles[i / blocks];
      const int64_t j = i % blocks;
      int64_t p = 0;
      while (first[p + 1] <= j) ++p;
      const float s = scales[p].data_ptr<float>()[tile.slot];
      if (s == 0.f) continue;
      const int64_t N = ys[p].size(1), ys_ = ys[p].stride(0), off = p * R;
      float* yp = ys[p].data_ptr<float>();
      float* yr[MR];
      float ts[MR][64];
      for (int64_t m = 0; m < tile.len; ++m) {
        yr[m] = yp + op[tile.start + m] * ys_;
        for (int64_t r = 0; r < R; ++r) ts[m][r] = tp[(tile.start + m) * C + off + r] * s;
      }
      const float* bt = bts[p].data_ptr<float>() + tile.slot * R * N;
      const int64_t n0 = (j - first[p]) * 64;
      switch (tile.len) {
        case 1: expand_tile<1>(yr, ts, bt, R, N, n0); break;
        case 2: expand_tile<2>(yr, ts, bt, R, N, n0); break;
        case 3: expand_tile<3>(yr, ts, bt, R, N, n0); break;
        default: expand_tile<4>(yr, ts, bt, R, N, n0); break;
      }
    }
  });
#endif
}


// act(g + gate delta) * (u + up delta) over every row of g and u, the deltas on the rows of ``order``
// (t = x @ at[slot]: its first R columns the gate's, the next R the up's), in one pass: the MLP whose
// gate/up take a delta, whose GEMMs cannot take it before their fused activation. act 0: SiLU, 1: GELU-tanh.
torch::Tensor glu_add(const torch::Tensor& g, const torch::Tensor& u, const torch::Tensor& x, const torch::Tensor& at,
                      const std::vector<torch::Tensor>& bts, const std::vector<torch::Tensor>& scales,
                      const torch::Tensor& order, const torch::Tensor& groups, int64_t act) {
  TORCH_CHECK(bts.size() == 2, "glu_add takes the gate's and the up's bt and scale");
  TORCH_CHECK(g.sizes() == u.sizes(), "g and u must have the same shape");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  const std::vector<Tile> tiles = check(std::vector<torch::Tensor>{g, u}, x, at, bts, scales, order, groups);
  const int64_t M = g.size(0), N = g.size(1), R = bts[0].size(1), C = at.size(2);
  auto out = torch::empty({M, N}, g.options());
#if defined(__AVX512F__)
  const int64_t* op = order.data_ptr<int64_t>();
  auto t = shrink(x, at, op, tiles);
  const float* tp = t.data_ptr<float>();
  std::vector<char> adapted(M, 0);
  for (int64_t i = 0; i < order.size(0); ++i) adapted[op[i]] = 1;
  std::vector<Tile> rest;  // the rows of no adapter, MR at a time
  for (int64_t r = 0; r < M;) {
    if (adapted[r]) { ++r; continue; }
    int64_t e = r;
    while (e < M && e - r < MR && !adapted[e]) ++e;
    rest.push_back({-1, r, e - r});
    r = e;
  }
  const float *gp = g.data_ptr<float>(), *up = u.data_ptr<float>(), *bg = bts[0].data_ptr<float>(),
              *bu = bts[1].data_ptr<float>(), *sg = scales[0].data_ptr<float>(), *su = scales[1].data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t gs = g.stride(0), us = u.stride(0), blocks = (N + 31) / 32;
  const int64_t nt = static_cast<int64_t>(tiles.size()), units = (nt + static_cast<int64_t>(rest.size())) * blocks;
  run_units(M, units, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t k = i / blocks, n0 = (i % blocks) * 32;
      const bool lora = k < nt;
      const Tile& tile = lora ? tiles[k] : rest[k - nt];
      const float* gr[MR];
      const float* ur[MR];
      float* mr[MR];
      float tg[MR][64], tu[MR][64];
      for (int64_t m = 0; m < tile.len; ++m) {
        const int64_t row = lora ? op[tile.start + m] : tile.start + m;
        gr[m] = gp + row * gs;
        ur[m] = up + row * us;
        mr[m] = o + row * N;
        if (lora)
          for (int64_t r = 0; r < R; ++r) {
            tg[m][r] = tp[(tile.start + m) * C + r] * sg[tile.slot];
            tu[m][r] = tp[(tile.start + m) * C + R + r] * su[tile.slot];
          }
      }
      const float* btg = lora ? bg + tile.slot * R * N : nullptr;
      const float* btu = lora ? bu + tile.slot * R * N : nullptr;
      const float(*pg)[64] = lora ? tg : nullptr;
      const float(*pu)[64] = lora ? tu : nullptr;
      switch (tile.len) {
        case 1: glu_tile<1>(gr, ur, mr, pg, pu, btg, btu, R, N, n0, act); break;
        case 2: glu_tile<2>(gr, ur, mr, pg, pu, btg, btu, R, N, n0, act); break;
        case 3: glu_tile<3>(gr, ur, mr, pg, pu, btg, btu, R, N, n0, act); break;
        default: glu_tile<4>(gr, ur, mr, pg, pu, btg, btu, R, N, n0, act); break;
      }
    }
  });
#endif
  return out;
}

}  // namespace acb::lora
