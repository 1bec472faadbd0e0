// Decode attention over acb's paged KV cache, on CPU, in one pass per (row, kv head).
//
// Reads each key and value once, straight from its page (no gather copy), and
// serves all query heads of a kv head (GQA) from that single read. Numerically
// it is the same masked softmax as the PyTorch path: scores * scale, optional
// tanh soft-capping, sliding window (key pos > query pos - window), then the
// weighted sum of values.
//
// The pages may hold float32, bfloat16 or float16 keys and values (the cache has the
// model's dtype): each row is widened to float32 as it is read, and queries, scores,
// the softmax and the accumulators are float32 whatever the pages hold, so a bf16 cache
// reads half the bytes of a float32 one and loses nothing more than its storage did.
//
// int8 pages (EngineConfig.kv_cache_dtype="int8", acb/kv_quant.py): each cached row is
// D int8 values followed by its float32 scale (D + 4 bytes; value = q * scale), written by
// write_kv_int8 below; the kernels widen q * scale to float32 and compute as above. Keys are
// stored rotated by a Walsh-Hadamard matrix (write_kv_int8 and paged_decode_into rotate each key
// row in registers before rounding it, paged_decode_into rotates its queries; `hadamard` rotates
// the queries of every other path that reads the pages).
#include "ops.h"
#include <cstring>
#include <algorithm>
#include <climits>
#include <cmath>
#include <type_traits>
#include <vector>
#include "vec.h"  // hadamard_scalar on every CPU; exp512, hadamard16 and the bf16 lanes where AVX-512 is
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace acb::attention {

// A decode call's items (row b and kv head kh: item b * KVH + kh), split between the threads by the keys
// they read rather than by their count: a step's rows differ in length, and in equal-count halves the
// larger half held 15-20 % more keys than the mean in SmolLM2's decode steps on the benchmarks' prompts
// (its thread kept the other waiting at the end of every call). Each item goes to the thread whose share
// holds its middle key (an item's fixed work counted as 16 keys); body(begin, end) runs items [begin, end)
// on one thread, in order. The items compute as they would on any thread: the outputs do not change.
template <typename F>
static void parallel_items(int64_t B, int64_t KVH, const int64_t* len, int64_t window, const F& body) {
  const int64_t N = B * KVH;
  const int64_t T = std::min<int64_t>(at::get_num_threads(), N);
  if (T <= 1) {
    if (N > 0) body(0, N);
    return;
  }
  auto cost = [&](int64_t b) { return (window > 0 ? std::min(len[b], window) : len[b]) + 16; };
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) total += KVH * cost(b);
  std::vector<int64_t> bounds(T + 1, 0);  // thread t runs items [bounds[t], bounds[t + 1])
  int64_t before = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t c = cost(i / KVH);
    const int64_t owner = std::min<int64_t>(T - 1, (2 * before + c) * T / (2 * total));
    bounds[owner + 1] = i + 1;
    before += c;
  }
  for (int64_t t = 1; t <= T; ++t) bounds[t] = std::max(bounds[t], bounds[t - 1]);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (bounds[t] < bounds[t + 1]) body(bounds[t], bounds[t + 1]);
  });
}

#if defined(__AVX512F__)

// The cache slot of position pos in a sequence whose pages are `pages`: a shift and a mask when
// page_size is a power of two (the default 16), a division otherwise (~5 % of the float32 decode
// kernel's time at 57 rows x 200 keys went to the divisions).
static inline int64_t slot_of(const int64_t* pages, int64_t page_size, int64_t pos) {
  if ((page_size & (page_size - 1)) == 0) {
    const int shift = __builtin_ctzll(static_cast<unsigned long long>(page_size));
    return (pages[pos >> shift] << shift) + (pos & (page_size - 1));
  }
  return pages[pos / page_size] * page_size + pos % page_size;
}

// exp on 16 lanes (inputs here are scores minus their max: <= 0): vec_avx512.h's
static inline __m512 exp16(__m512 x) { return acb_vec::exp512(x); }

// 16 lanes of a cached row, widened to float32 (bf16: the top half of a float's bits; vec_avx512.h).
using acb_vec::load16;
using acb_vec::store16;
static inline __m512 load16(const at::BFloat16* p) { return load16(reinterpret_cast<const uint16_t*>(p)); }
static inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 float32 lanes stored as float32, or rounded to bfloat16 (to nearest, ties to even: what
// PyTorch's float -> bfloat16 conversion does for every non-NaN value)
static inline void store16(at::BFloat16* p, __m512 v) { store16(reinterpret_cast<uint16_t*>(p), v); }
static inline __m512 load16(const int8_t* p) {  // int8 values, their row's scale applied by the caller
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// A cached row: D values, then (int8 pages only) its float32 scale. STRIDE: elements per row.
template <typename T> struct RowOf { static constexpr int64_t EXTRA = 0; };
template <> struct RowOf<int8_t> { static constexpr int64_t EXTRA = 4; };
template <typename T> static inline float row_scale(const T*, int64_t) { return 1.f; }
static inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  std::memcpy(&s, row + D, sizeof s);
  return s;
}

// Keys in int8 pages are stored rotated by the Walsh-Hadamard matrix (blocks of the largest power of
// two dividing D; acb_vec::hadamard_scalar / hadamard16 in vec_scalar.h, vec_avx512.h), and the queries that read them
// rotated alike (acb/kv_quant.py says why).
using acb_vec::hadamard_scalar;
#if defined(__AVX512F__)
using acb_vec::hadamard16;
#endif

// A row of D values widened to float32 (on the stack up to 256 values), rotated when asked: the
// scalar paths of rotate_row and quantize_kv_row
struct WideRow {
  float stack[256];
  std::vector<float> heap;
  float* x;
  template <typename T>
  WideRow(const T* src, int64_t D, bool rotate) : heap(D > 256 ? D : 0), x(D > 256 ? heap.data() : stack) {
    for (int64_t d = 0; d < D; ++d) x[d] = static_cast<float>(src[d]);
    if (rotate) hadamard_scalar(x, D);
  }
};

// dst <- src H * scale, a row of D values (float32 arithmetic, rounded once to T)
template <typename S, typename T>
static inline void rotate_row(const S* src, T* dst, int64_t D, float scale) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 256) {
    __m512 x[16];
    for (int64_t c = 0; c < D / 16; ++c) x[c] = load16(src + c * 16);
    hadamard16(x, D / 16, D & -D);
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < D / 16; ++c) store16(dst + c * 16, _mm512_mul_ps(x[c], s));
    return;
  }
#endif
  const WideRow row(src, D, true);
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(row.x[d] * scale);
}

// One key or value row of D values -> its int8 cache row: D values, then the float32 scale
// (max |x| / 127; round to nearest, ties to even; a row of zeros: scale 0). write_kv_int8 and
// paged_decode_into's int8 writes share it, so both store the same bytes for the same row.
// rotate: a key, rotated (hadamard16 / hadamard_scalar) before it is rounded.
template <typename T>
static inline void quantize_kv_row(const T* row, int64_t D, int8_t* dst, bool rotate = false) {
#if defined(__AVX512F__)
  if (D % 16 == 0 && D <= 256) {  // the same arithmetic on 16 lanes (cvtps rounds to nearest even, as nearbyint)
    __m512 x[16];
    __m512 mx = _mm512_setzero_ps();
    for (int64_t c = 0; c < D / 16; ++c) x[c] = load16(row + c * 16);
    if (rotate) hadamard16(x, D / 16, D & -D);
    for (int64_t c = 0; c < D / 16; ++c) mx = _mm512_max_ps(mx, _mm512_abs_ps(x[c]));
    const float amax = _mm512_reduce_max_ps(mx);
    const float scale = amax * (1.f / 127.f), inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m512 vinv = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    for (int64_t c = 0; c < D / 16; ++c) {
      const __m512 r = _mm512_min_ps(hi, _mm512_max_ps(lo, _mm512_roundscale_ps(_mm512_mul_ps(x[c], vinv),
                                                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c * 16), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
    std::memcpy(dst + D, &scale, sizeof scale);
    return;
  }
#endif
  const WideRow wide(row, D, rotate);
  const float* x = wide.x;
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax * (1.f / 127.f), inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t d = 0; d < D; ++d)
    dst[d] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[d] * inv))));
  std::memcpy(dst + D, &scale, sizeof scale);
}

#if defined(__AVX512F__)

// The cache lines of `bytes` bytes at p, fetched into L1 (T0) or L2 (T1)
template <int HINT = _MM_HINT_T0>
static inline void prefetch_lines(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, static_cast<_mm_hint>(HINT));
  if (bytes % 64 != 0) _mm_prefetch(c + bytes - 1, static_cast<_mm_hint>(HINT));  // an unaligned row's last line
}

// Pages are scattered, so hardware prefetch stops at each one: fetch a key's (or value's)
// row ahead of its use.
template <int D, typename T, int HINT = _MM_HINT_T0>
static inline void prefetch_row(const T* base, const int64_t* pages, int64_t page_size, int64_t pos) {
  constexpr int64_t STRIDE = D + RowOf<T>::EXTRA;
  prefetch_lines<HINT>(base + slot_of(pages, page_size, pos) * STRIDE, STRIDE * sizeof(T));
}

// The row at position first + i (of n) of one head's paged keys or values, fetching the
// row 8 positions ahead into L1 and the one 32 ahead into L2 (the kernel was bound by
// memory latency without the far one: 15 -> 25 GB/s at 64 rows x 1000 tokens).
template <int D, typename T>
static inline const T* paged_row(const T* base, const int64_t* pages, int64_t page_size, int64_t first,
                                 int64_t i, int64_t n) {
  constexpr int64_t AHEAD = 8, FAR = 32;
  const int64_t pos = first + i;
  if (i + AHEAD < n) prefetch_row<D, T>(base, pages, page_size, pos + AHEAD);
  if (i + FAR < n) prefetch_row<D, T, _MM_HINT_T1>(base, pages, page_size, pos + FAR);
  return base + slot_of(pages, page_size, pos) * (D + RowOf<T>::EXTRA);
}

// The first rows [first, first + m) of one head's paged keys or values into L2, for the item after
// the current one: each item starts where no prefetch ran ahead of it, and a thread's items are
// short (~200 keys: a few microseconds), so a cold start per pass cost a third of the bandwidth.
template <typename T>
static inline void prefetch_start(const T* base, const int64_t* pages, int64_t page_size, int64_t stride,
                                  int64_t first, int64_t m) {
  const int64_t bytes = stride * static_cast<int64_t>(sizeof(T));
  for (int64_t pos = first; pos < first + m; ++pos)
    prefetch_lines<_MM_HINT_T1>(base + slot_of(pages, page_size, pos) * stride, bytes);
}

// prefetch_start for item `item` (= row * KVH + kv head) of a decode call: its first keys and
// values, fetched while the item before it runs
template <typename T>
static inline void prefetch_item(const T* kp, const T* vp, const int64_t* pg, const int64_t* len, int64_t item,
                                 int64_t KVH, int64_t S, int64_t stride, int64_t P, int64_t page_size,
                                 int64_t window) {
  const int64_t b = item / KVH, kh = item % KVH, L = len[b];
  const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
  const int64_t m = std::min<int64_t>(32, L - first);
  prefetch_start(kp + kh * S * stride, pg + b * P, page_size, stride, first, m);
  prefetch_start(vp + kh * S * stride, pg + b * P, page_size, stride, first, m);
}

using acb_vec::reduce16;  // 16 vectors -> one vector of their sums (vec_avx512.h)

// Scores of G query heads against keys [i0, i0 + nk) (nk <= 16): the keys are widened
// once into kf (16 x D floats, L1), then each head's 16 dot products are reduced
// together. scores[g * n + i] = q_g . k_i * scale (* the row's scale on int8 pages).
template <int G, int DC, typename T>
static inline void scores16(const __m512* q, const T* kbase, const T* vbase, const int64_t* pages, int64_t page_size,
                            int64_t first, int64_t i0, int nk, int64_t n, float scale, float* kf, float* scores) {
  constexpr int D = DC * 16;
  alignas(64) float ks[16];
  for (int j = 0; j < nk; ++j) {
    const T* kp = paged_row<D>(kbase, pages, page_size, first, i0 + j, n);
    // the value pass follows this one over the same positions: bring the values into L2 now
    if (i0 + j + 32 < n) prefetch_row<D, T, _MM_HINT_T1>(vbase, pages, page_size, first + i0 + j + 32);
    for (int c = 0; c < DC; ++c) _mm512_store_ps(kf + j * D + c * 16, load16(kp + c * 16));
    ks[j] = row_scale(kp, D) * scale;
  }
  for (int j = nk; j < 16; ++j) {  // a short last block: zero keys, scores not stored
    for (int c = 0; c < DC; ++c) _mm512_store_ps(kf + j * D + c * 16, _mm512_setzero_ps());
    ks[j] = 0.f;
  }
  const __mmask16 keep = nk == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nk) - 1);
  const __m512 kscale = _mm512_load_ps(ks);
  for (int g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_mul_ps(q[g * DC], _mm512_load_ps(kf + j * D));
    for (int c = 1; c < DC; ++c)
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(q[g * DC + c], _mm512_load_ps(kf + j * D + c * 16), acc[j]);
    _mm512_mask_storeu_ps(scores + g * n + i0, keep, _mm512_mul_ps(reduce16(acc), kscale));
  }
}

// G rows of n scores (row g at scores + g * n) -> exp(score - the row's max), in place; denom[g]:
// the row's sum (the softmax's denominator)
template <int G>
static inline void exp_rows(float* scores, int64_t n, float* denom) {
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * n;
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mxv = _mm512_max_ps(mxv, _mm512_loadu_ps(sg + i));
    float mx = _mm512_reduce_max_ps(mxv);
    for (; i < n; ++i) mx = std::max(mx, sg[i]);
    const __m512 mx16 = _mm512_set1_ps(mx);
    __m512 sumv = _mm512_setzero_ps();
    for (i = 0; i + 16 <= n; i += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), mx16));
      _mm512_storeu_ps(sg + i, e);
      sumv = _mm512_add_ps(sumv, e);
    }
    if (i < n) {
      const __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + i), mx16));
      _mm512_mask_storeu_ps(sg + i, m, e);
      sumv = _mm512_add_ps(sumv, _mm512_maskz_mov_ps(m, e));
    }
    denom[g] = _mm512_reduce_add_ps(sumv);
  }
}

// One (row, kv head): G query heads of DC*16 dims over n keys starting at position
// `first`. Queries and the G x D accumulator live in registers (G, DC compile-time).
template <int G, int DC, typename T, typename Q = float, typename O = Q>
static void decode_item_avx512(const Q* qrow, const T* kbase, const T* vbase, const int64_t* pages,
                               int64_t page_size, int64_t first, int64_t n, float scale, float* scores,
                               O* out) {
  constexpr int D = DC * 16;
  __m512 q[G * DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) q[g * DC + c] = load16(qrow + g * D + c * 16);
  alignas(64) float kf[16 * D];
  for (int64_t i0 = 0; i0 < n; i0 += 16)
    scores16<G, DC, T>(q, kbase, vbase, pages, page_size, first, i0, static_cast<int>(std::min<int64_t>(16, n - i0)), n,
                       scale, kf, scores);
  float denom[G];
  exp_rows<G>(scores, n, denom);
  __m512 acc[G * DC];
  for (int j = 0; j < G * DC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const T* vp = paged_row<D>(vbase, pages, page_size, first, i, n);
    const float vs = row_scale(vp, D);
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(vp + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + i] * vs);
      for (int c = 0; c < DC; ++c) acc[g * DC + c] = _mm512_fmadd_ps(w, v[c], acc[g * DC + c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[g]);
    for (int c = 0; c < DC; ++c) store16(out + g * D + c * 16, _mm512_mul_ps(acc[g * DC + c], inv));
  }
}

// an item reading queries of Q and writing outputs of O (the model's dtype)
template <typename T, typename Q = float, typename O = Q>
using ItemFn = void (*)(const Q*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, float, float*, O*);

template <int DC, typename T, typename Q = float, typename O = Q>
static ItemFn<T, Q, O> pick_g(int64_t G) {
  switch (G) {
    case 1: return decode_item_avx512<1, DC, T, Q, O>;
    case 2: return decode_item_avx512<2, DC, T, Q, O>;
    case 3: return decode_item_avx512<3, DC, T, Q, O>;
    case 4: return decode_item_avx512<4, DC, T, Q, O>;
    case 5: return decode_item_avx512<5, DC, T, Q, O>;
    case 6: return decode_item_avx512<6, DC, T, Q, O>;
    case 7: return decode_item_avx512<7, DC, T, Q, O>;
    case 8: return decode_item_avx512<8, DC, T, Q, O>;
    default: return nullptr;
  }
}

template <typename T, typename Q = float, typename O = Q>
static ItemFn<T, Q, O> pick_item(int64_t G, int64_t D) {
  switch (D) {
    case 16: return pick_g<1, T, Q, O>(G);
    case 32: return pick_g<2, T, Q, O>(G);
    case 64: return pick_g<4, T, Q, O>(G);
    case 128: return pick_g<8, T, Q, O>(G);
    case 256: return pick_g<16, T, Q, O>(G);
    default: return nullptr;
  }
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// paged_decode's item on AVX2 (no AVX-512: Zen 2/3, Haswell to Alder Lake), for head dims that are
// multiples of 8 and no soft-capping: the same masked softmax in float32, 8 lanes at a time. Scores
// over blocks of 8 keys (each block's rows widened once into kf, then each query head's 8 dot
// products reduced together: no horizontal sum per key), exp on 8 lanes (vec_avx2.h's exp256, as the
// AVX-512 kernel's exp512), the weighted values summed per query head in registers, 64 dims at a time.
// The portable loop below took ~1.2 ms a layer at 45 rows x ~300 keys (9 heads over 3, D 64).
using acb_vec::load8;  // float32 (and bf16 bits) to float32 lanes, vec_avx2.h
static inline __m256 load8(const at::BFloat16* p) { return load8(reinterpret_cast<const uint16_t*>(p)); }
static inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
#else
  alignas(32) float f[8];
  for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
  return _mm256_load_ps(f);
#endif
}
static inline __m256 load8(const int8_t* p) {  // int8 values, their row's scale applied by the caller
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// 8 vectors -> one: lane j = the sum of v[j]'s lanes
static inline __m256 reduce8(const __m256* v) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

template <typename T>
static void decode_item_avx2(const float* q, const T* kbase, const T* vbase, const int64_t* pages, int64_t page_size,
                             int64_t first, int64_t n, int64_t G, int64_t D, int64_t stride, float scale,
                             std::vector<float>& scores, std::vector<int64_t>& slots, std::vector<float>& kf,
                             float* out) {
  const int64_t DV = D / 8;
  scores.resize(G * n);
  slots.resize(n);
  kf.resize(8 * D);
  const bool pow2 = (page_size & (page_size - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<unsigned long long>(page_size)) : 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    slots[i] = (pow2 ? (pages[pos >> shift] << shift) + (pos & (page_size - 1))
                     : pages[pos / page_size] * page_size + pos % page_size) * stride;
  }
  const int64_t row_bytes = stride * static_cast<int64_t>(sizeof(T));
  auto fetch = [&](const T* base, int64_t i) {  // a row's lines into L1, ahead of its use (pages scatter)
    const char* p = reinterpret_cast<const char*>(base + slots[i]);
    for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
  };
  for (int64_t i = 0; i < std::min<int64_t>(n, 16); ++i) fetch(kbase, i);
  // scores[g * n + i] = q_g . k_i * scale (* the row's scale on int8 pages)
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const int64_t nk = std::min<int64_t>(8, n - i0);
    for (int64_t i = i0 + 16; i < std::min(n, i0 + 24); ++i) fetch(kbase, i);  // two blocks ahead
    if (i0 < 16)  // the first values, while the scores run
      for (int64_t i = i0; i < std::min(n, i0 + 8); ++i) fetch(vbase, i);
    alignas(32) float ks[8];
    for (int64_t j = 0; j < 8; ++j) {
      float* dst = kf.data() + j * D;
      if (j < nk) {
        const T* row = kbase + slots[i0 + j];
        for (int64_t c = 0; c < DV; ++c) _mm256_storeu_ps(dst + 8 * c, load8(row + 8 * c));
        ks[j] = row_scale(row, D) * scale;
      } else {
        std::memset(dst, 0, sizeof(float) * D);
        ks[j] = 0.f;
      }
    }
    const __m256 kscale = _mm256_load_ps(ks);
    for (int64_t g = 0; g < G; ++g) {
      __m256 v[8];
      for (int j = 0; j < 8; ++j) v[j] = _mm256_setzero_ps();
      for (int64_t c = 0; c < DV; ++c) {
        const __m256 qv = _mm256_loadu_ps(q + g * D + 8 * c);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) v[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kf.data() + j * D + 8 * c), v[j]);
      }
      alignas(32) float s[8];
      _mm256_store_ps(s, _mm256_mul_ps(reduce8(v), kscale));
      std::memcpy(scores.data() + g * n + i0, s, sizeof(float) * nk);
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores.data() + g * n;
    // softmax numerators in place, the denominator their sum
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sg + i));
    alignas(32) float m8[8];
    _mm256_store_ps(m8, mx8);
    float mx = *std::max_element(m8, m8 + 8);
    for (; i < n; ++i) mx = std::max(mx, sg[i]);
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) {
      const __m256 e = acb_vec::exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vmx));
      _mm256_storeu_ps(sg + i, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    if (i < n) {  // the tail through a padded block (-inf: exp 0)
      alignas(32) float t[8];
      for (int64_t j = 0; j < 8; ++j) t[j] = i + j < n ? sg[i + j] : -INFINITY;
      const __m256 e = acb_vec::exp256(_mm256_max_ps(_mm256_sub_ps(_mm256_load_ps(t), vmx), _mm256_set1_ps(-88.f)));
      _mm256_store_ps(t, e);
      for (int64_t j = 0; i + j < n; ++j) {
        sg[i + j] = t[j];
        sum8 = _mm256_add_ps(sum8, _mm256_setr_ps(t[j], 0, 0, 0, 0, 0, 0, 0));
      }
    }
    alignas(32) float s8[8];
    _mm256_store_ps(s8, sum8);
    float denom = 0.f;
    for (int j = 0; j < 8; ++j) denom += s8[j];
    const __m256 inv = _mm256_set1_ps(1.f / denom);
    // the weighted values, 64 dims (8 registers) at a time
    for (int64_t c0 = 0; c0 < DV; c0 += 8) {
      const int64_t cn = std::min<int64_t>(8, DV - c0);
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_setzero_ps();
      for (int64_t k = 0; k < n; ++k) {
        if (g == 0 && c0 == 0 && k + 16 < n) fetch(vbase, k + 16);
        const T* row = vbase + slots[k];
        const __m256 w = _mm256_set1_ps(sg[k] * row_scale(row, D));
        if (cn == 8) {
#pragma GCC unroll 8
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(row + 8 * (c0 + c)), acc[c]);
        } else {
          for (int64_t c = 0; c < cn; ++c) acc[c] = _mm256_fmadd_ps(w, load8(row + 8 * (c0 + c)), acc[c]);
        }
      }
      for (int64_t c = 0; c < cn; ++c) _mm256_storeu_ps(out + g * D + 8 * (c0 + c), _mm256_mul_ps(acc[c], inv));
    }
  }
}
#endif

template <typename T>
static void paged_decode_t(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& pages, const torch::Tensor& lengths, torch::Tensor& out,
                           int64_t page_size, double scale, double softcap, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), S = k_cache.size(1), P = pages.size(1);
  const int64_t G = H / KVH, STRIDE = D + RowOf<T>::EXTRA;
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
#if defined(__AVX512F__)
  // The vectorised path: no soft-capping (Gemma 2 takes the portable loop below).
  const ItemFn<T> fast = fcap > 0.f ? nullptr : pick_item<T>(G, D);
  if (fast != nullptr) {
    parallel_items(B, KVH, len, window, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / KVH, kh = item % KVH;
        const int64_t L = len[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t n = L - first;
        scores.resize(G * n);
        if (item + 1 < end) prefetch_item(kp, vp, pg, len, item + 1, KVH, S, STRIDE, P, page_size, window);
        fast(qp + (b * H + kh * G) * D, kp + kh * S * STRIDE, vp + kh * S * STRIDE, pg + b * P, page_size, first, n, fscale,
             scores.data(), op + (b * H + kh * G) * D);
      }
    });
    return;
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (fcap <= 0.f && D % 8 == 0) {
    parallel_items(B, KVH, len, window, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, kf;
      std::vector<int64_t> slots;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / KVH, kh = item % KVH;
        const int64_t L = len[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        decode_item_avx2(qp + (b * H + kh * G) * D, kp + kh * S * STRIDE, vp + kh * S * STRIDE, pg + b * P, page_size,
                         first, L - first, G, D, STRIDE, fscale, scores, slots, kf, op + (b * H + kh * G) * D);
      }
    });
    return;
  }
#endif

  parallel_items(B, KVH, len, window, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = len[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first;
      scores.assign(G * n, 0.f);
      const float* qrow = qp + (b * H + kh * G) * D;
      const T* kbase = kp + kh * S * STRIDE;
      const T* vbase = vp + kh * S * STRIDE;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first + i;
        const int64_t slot = pg[b * P + pos / page_size] * page_size + pos % page_size;
        const T* k = kbase + slot * STRIDE;
        const float ks = row_scale(k, D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qrow + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * static_cast<float>(k[d]);
          float s = dot * ks * fscale;
          if (fcap > 0.f) s = tanhf(s / fcap) * fcap;
          scores[g * n + i] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::vector<float> denom(G, 0.f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        float mx = -INFINITY;
        for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = expf(sg[i] - mx);
          sum += sg[i];
        }
        denom[g] = sum;
      }
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first + i;
        const int64_t slot = pg[b * P + pos / page_size] * page_size + pos % page_size;
        const T* v = vbase + slot * STRIDE;
        const float vs = row_scale(v, D);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + i] * vs;
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (b * H + kh * G + g) * D;
        const float inv = 1.f / denom[g];
        for (int64_t d = 0; d < D; ++d) o[d] = acc[g * D + d] * inv;
      }
    }
  });
}


void paged_decode(const torch::Tensor& q,        // [B, H, D] float32, contiguous
                  const torch::Tensor& k_cache,  // [KVH, S, D] float32, bfloat16, float16; int8: [KVH, S, D + 4]
                  const torch::Tensor& v_cache,  // [KVH, S, D] as k_cache
                  const torch::Tensor& pages,    // [B, P] int64
                  const torch::Tensor& lengths,  // [B] int64: context length, query at length - 1
                  torch::Tensor& out,            // [B, H, D] float32
                  int64_t page_size, double scale, double softcap, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32 && q.is_contiguous() &&
                  out.is_contiguous(), "paged_decode: q and out must be contiguous float32 [B, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: k_cache and v_cache must be contiguous and of one dtype");
  TORCH_CHECK(pages.scalar_type() == torch::kInt64 && lengths.scalar_type() == torch::kInt64 && pages.is_contiguous(),
              "paged_decode: pages and lengths must be int64");
  const int64_t extra = k_cache.scalar_type() == torch::kInt8 ? RowOf<int8_t>::EXTRA : 0;
  TORCH_CHECK(k_cache.size(2) == q.size(2) + extra && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: cache rows of ", k_cache.size(2), " elements for a head dim of ", q.size(2));
  switch (k_cache.scalar_type()) {
    case torch::kInt8: return paged_decode_t<int8_t>(q, k_cache, v_cache, pages, lengths, out, page_size, scale,
                                                     softcap, window);
    case torch::kFloat32: return paged_decode_t<float>(q, k_cache, v_cache, pages, lengths, out, page_size, scale,
                                                       softcap, window);
    case torch::kBFloat16: return paged_decode_t<at::BFloat16>(q, k_cache, v_cache, pages, lengths, out, page_size,
                                                               scale, softcap, window);
    case torch::kHalf: return paged_decode_t<at::Half>(q, k_cache, v_cache, pages, lengths, out, page_size, scale,
                                                       softcap, window);
    default: TORCH_CHECK(false, "paged_decode: pages must be float32, bfloat16, float16 or int8, not ",
                         k_cache.scalar_type());
  }
}


// A decode-only step's whole attention call in one pass (the fused forward's, per layer): each row's
// new key and value written into its page slot, then its attention, queries read where the
// projection left them and the output written where the next GEMM reads it, in the model's dtype
// (float32 or bfloat16: widened as read, rounded once as written, as PyTorch's conversions around
// paged_decode did; the same float32 arithmetic in between, so the same bits; bf16 on a CPU with
// avx512_bf16 takes ahead_item below: its sums run in another order). The separate copies
// (two index_copy_, the queries' transpose and widening, the output's rounding) were ~100-250 us a
// layer of a ~800 us call at SmolLM2's 57-row decode steps. Returns false, having done nothing,
// where it does not apply (soft-capping, a head layout without a vectorised item, mixed dtypes, no
// AVX-512 or AVX2): the caller then takes the separate path.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ACB_DECODE_INTO 1
#endif

#if defined(ACB_DECODE_INTO)
// A paged_decode_into call's tensors as pointers, sizes and strides (the drivers below)
template <typename T>
struct IntoCall {
  using Page = T;  // the pages' element type
  using Query = T;  // the model's dtype: queries, new rows, output
  using ItemQuery = T;  // the queries as the AVX-512 float item reads them (q_for)
  int64_t B, H, D, KVH, S, P, G, qs, ks, vs, os;
  const T *qp, *knp, *vnp;
  T *kp, *vp, *op;
  const int64_t *sl, *pg, *len;
  int64_t page_size, window;
  IntoCall(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new, torch::Tensor& k_cache,
           torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& pages,
           const torch::Tensor& lengths, torch::Tensor& out, int64_t page_size_, int64_t window_)
      : B(q.size(0)), H(q.size(1)), D(q.size(2)), KVH(k_cache.size(0)), S(k_cache.size(1)), P(pages.size(1)),
        G(H / KVH), qs(q.stride(0)), ks(k_new.stride(0)), vs(v_new.stride(0)), os(out.stride(0)),
        qp(q.data_ptr<T>()), knp(k_new.data_ptr<T>()), vnp(v_new.data_ptr<T>()), kp(k_cache.data_ptr<T>()),
        vp(v_cache.data_ptr<T>()), op(out.data_ptr<T>()), sl(slots.data_ptr<int64_t>()),
        pg(pages.data_ptr<int64_t>()), len(lengths.data_ptr<int64_t>()), page_size(page_size_), window(window_) {}
  // only item (b, kh) reads row b's keys and values of head kh: it writes them first
  void write(int64_t b, int64_t kh) const {
    std::memcpy(kp + (kh * S + sl[b]) * D, knp + b * ks + kh * D, D * sizeof(T));
    std::memcpy(vp + (kh * S + sl[b]) * D, vnp + b * vs + kh * D, D * sizeof(T));
  }
  int64_t first(int64_t b) const { return window > 0 ? std::max<int64_t>(0, len[b] - window) : 0; }
  int64_t row() const { return D; }  // elements per cached row
  const T* q_of(int64_t b, int64_t kh) const { return qp + b * qs + kh * G * D; }
  const T* q_for(int64_t b, int64_t kh, T*) const { return q_of(b, kh); }  // the queries as the item reads them
  const T* k_of(int64_t kh) const { return kp + kh * S * D; }  // head kh's cached keys
  const T* v_of(int64_t kh) const { return vp + kh * S * D; }
  T* out_of(int64_t b, int64_t kh) const { return op + b * os + kh * G * D; }
};


// paged_decode_into over int8 pages (kv_cache_dtype="int8"): the queries, new rows and output in
// the model's dtype Q, the cache rows D int8 values and their float32 scale (W = D + 4 bytes). A
// row's new key and value are quantized as write_kv_int8 quantizes them (quantize_kv_row) into
// its slot, then its attention runs over the int8 rows. rotate: keys are stored rotated (the new
// key rotated before it is rounded) and the queries rotated alike (over the Hadamard block) into
// the item's own buffer before it reads the pages (acb/kv_quant.py).
template <typename Q>
struct Into8Call {
  using Page = int8_t;
  using Query = Q;  // the model's dtype: queries, new rows, output
  // The queries as the AVX-512 float item reads them (q_for): the model's dtype, except a bf16
  // model's on a CPU without avx512_bf16. There the separate path widens a bf16 step's rows before
  // it rotates them (acb/attention.py), so here too they are widened and rotated in float32 (and
  // the item writes bf16): otherwise the rotated queries were rounded to bf16 on one path only.
#if defined(__AVX512BF16__)
  using ItemQuery = Q;
#else
  using ItemQuery = float;
#endif
  int64_t B, H, D, W, KVH, S, P, G, qs, ks, vs, os;
  const Q *qp, *knp, *vnp;
  int8_t *kp, *vp;
  Q* op;
  const int64_t *sl, *pg, *len;
  int64_t page_size, window;
  bool rotate;
  Into8Call(const torch::Tensor& q, const torch::Tensor& k_new, const torch::Tensor& v_new, torch::Tensor& k_cache,
            torch::Tensor& v_cache, const torch::Tensor& slots, const torch::Tensor& pages,
            const torch::Tensor& lengths, torch::Tensor& out, int64_t page_size_, int64_t window_, bool rotate_)
      : B(q.size(0)), H(q.size(1)), D(q.size(2)), W(k_cache.size(2)), KVH(k_cache.size(0)), S(k_cache.size(1)),
        P(pages.size(1)), G(H / KVH), qs(q.stride(0)), ks(k_new.stride(0)), vs(v_new.stride(0)), os(out.stride(0)),
        qp(q.data_ptr<Q>()), knp(k_new.data_ptr<Q>()), vnp(v_new.data_ptr<Q>()), kp(k_cache.data_ptr<int8_t>()),
        vp(v_cache.data_ptr<int8_t>()), op(out.data_ptr<Q>()), sl(slots.data_ptr<int64_t>()),
        pg(pages.data_ptr<int64_t>()), len(lengths.data_ptr<int64_t>()), page_size(page_size_), window(window_),
        rotate(rotate_) {}
  void write(int64_t b, int64_t kh) const {  // only item (b, kh) reads these rows: it writes them first
    quantize_kv_row(knp + b * ks + kh * D, D, kp + (kh * S + sl[b]) * W, rotate);
    quantize_kv_row(vnp + b * vs + kh * D, D, vp + (kh * S + sl[b]) * W);
  }
  int64_t first(int64_t b) const { return window > 0 ? std::max<int64_t>(0, len[b] - window) : 0; }
  int64_t row() const { return W; }  // bytes per cached row: D values and the scale
  const Q* q_of(int64_t b, int64_t kh) const { return qp + b * qs + kh * G * D; }
  const ItemQuery* q_for(int64_t b, int64_t kh, ItemQuery* buf) const {  // buf: G * D values
    if constexpr (std::is_same_v<ItemQuery, Q>) {
      if (!rotate) return q_of(b, kh);
    } else if (!rotate) {  // widened only
      for (int64_t i = 0; i < G * D; ++i) buf[i] = static_cast<float>(q_of(b, kh)[i]);
      return buf;
    }
    const float over_block = 1.f / static_cast<float>(D & -D);
    for (int64_t g = 0; g < G; ++g) rotate_row(q_of(b, kh) + g * D, buf + g * D, D, over_block);
    return buf;
  }
  const int8_t* k_of(int64_t kh) const { return kp + kh * S * W; }
  const int8_t* v_of(int64_t kh) const { return vp + kh * S * W; }
  Q* out_of(int64_t b, int64_t kh) const { return op + b * os + kh * G * D; }
};

#endif

#if defined(__AVX512F__)
// The portable vectorised driver (IntoCall or Into8Call): the float kernel's items as paged_decode runs
// them (int8 pages: each key widened into float32 as read, its scale applied to its scores, each
// value's to its weight), so a float32 model gets the same bits as the separate writes and paged_decode.
template <typename Call, typename Fn>
static void decode_into_t(const Call& c, float scale, Fn fast) {
  parallel_items(c.B, c.KVH, c.len, c.window, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<typename Call::ItemQuery> qbuf(c.G * c.D);  // rotated queries (int8 pages)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / c.KVH, kh = item % c.KVH;
      c.write(b, kh);
      const int64_t first = c.first(b), n = c.len[b] - first;
      scores.resize(c.G * n);
      if (item + 1 < end)
        prefetch_item(c.kp, c.vp, c.pg, c.len, item + 1, c.KVH, c.S, c.row(), c.P, c.page_size, c.window);
      fast(c.q_for(b, kh, qbuf.data()), c.k_of(kh), c.v_of(kh), c.pg + b * c.P, c.page_size, first, n, scale,
           scores.data(), c.out_of(b, kh));
    }
  });
}
#endif

#if defined(__AVX512BF16__)
// A bf16 decode-only step (paged_decode_into, bf16 model, bf16 pages) on avx512_bf16. The float
// kernel above widens every key into a float32 buffer and runs out of instructions before memory
// (57 rows x 200 keys, 9 heads over 3: ~415 us a layer in cache for float32 and bf16 pages alike).
// Here the scores are VDPBF16PS over the rows as stored (query and keys are bf16: every product is
// exact, the sums float32), the softmax and the value sums are float32 as before (each value row
// widened by halves: its even dims and its odd dims, put back in order once at the end), a row's
// slot is computed once per item, and the next item's keys and values are fetched into L2 while
// this item runs (its first rows otherwise start cold: each item is only a few microseconds).
// The same values and the same float32 softmax as the float kernel; only the order of the sums
// differs (a last-bit difference in ~0.01 % of outputs).
static inline __m512 dotbf(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
// The next item's rows, fetched into L2 a few at a time while this item computes (keys, then values;
// over the item's key blocks and then its value rows)
template <typename T>
struct AheadOf {
  const T* k = nullptr;
  const T* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0, done = 0, row_bytes = 0;
  inline void step(int64_t rows) {
    for (const int64_t end = std::min(done + rows, 2 * n); done < end; ++done)
      prefetch_lines<_MM_HINT_T1>(done < n ? k + slots[done] : v + slots[done - n], row_bytes);
  }
};
// slots[i]: where the row of position first + i starts (elements from the head's base)
static void fill_slots(const int64_t* pages, int64_t page_size, int64_t first, int64_t n, int64_t stride, int64_t* slots) {
  for (int64_t i = 0; i < n; ++i) slots[i] = slot_of(pages, page_size, first + i) * stride;
}
// The scores of G bf16 query heads (q: W 32-dim words each) against one block of 16 keys:
// word(j, w) is key j's w-th word as bf16, s16 each key's factor; the first keys (keep) stored at
// scores + g * n + i0.
template <int G, int W, typename Word>
static inline void block_scores(const __m512i* q, Word word, __m512 s16, __mmask16 keep, float* scores, int64_t n,
                                int64_t i0) {
  for (int g = 0; g < G; ++g) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = dotbf(_mm512_setzero_ps(), q[g * W], word(j, 0));
      for (int w = 1; w < W; ++w) acc[j] = dotbf(acc[j], q[g * W + w], word(j, w));
    }
    _mm512_mask_storeu_ps(scores + g * n + i0, keep, _mm512_mul_ps(reduce16(acc), s16));
  }
}
template <int G, int W>  // W: 32-dim words per row (D = 32 W)
static void ahead_item(const at::BFloat16* qrow, const at::BFloat16* kbase, const at::BFloat16* vbase, int64_t n,
                       float scale, float* scores, const int64_t* slots, at::BFloat16* out,
                       AheadOf<at::BFloat16>& ahead) {
  constexpr int D = 32 * W;
  // rows ahead into L1. The item's rows were sent towards L2 while the item before it ran, but from
  // memory they are not all there in time: with 30 layers' pages read in turn (what an engine step
  // does; benchmarks/decode_attention.py, 48 rows x 435 keys) 8 rows ahead took ~810 us a call,
  // 32 ~705, 64 ~695 (one layer's pages, which stay in L3: ~310 us at any distance).
  constexpr int64_t AHEAD = 32;
  alignas(64) static const at::BFloat16 zero_row[D] = {};
  __m512i q[G * W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) q[g * W + w] = _mm512_loadu_si512(qrow + g * D + w * 32);
  const at::BFloat16* rows[16];
  const int64_t blocks = std::max<int64_t>(1, (n + 15) / 16);
  // the next item's rows spread over this item's key blocks and then its value rows (a block's worth
  // every 16): fetched during the key blocks alone, the memory sat idle while the values were summed
  // (45 rows x 380 keys over ascending pages: 434-446 -> 392-401 us a call, alternated)
  const int64_t per_block = (ahead.n + blocks - 1) / blocks;
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    ahead.step(per_block);
    const int nk = static_cast<int>(std::min<int64_t>(16, n - i0));
    for (int j = 0; j < 16; ++j) {
      const int64_t i = i0 + j;
      rows[j] = j < nk ? kbase + slots[i] : zero_row;
      if (i + AHEAD < n) prefetch_lines(kbase + slots[i + AHEAD], D * 2);
    }
    const __mmask16 keep = nk == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nk) - 1);
    block_scores<G, W>(q, [&](int j, int w) { return _mm512_loadu_si512(rows[j] + w * 32); }, _mm512_set1_ps(scale),
                       keep, scores, n, i0);
  }
  float denom[G];
  exp_rows<G>(scores, n, denom);
  // values: acc[g][2w] holds dims 32w + 2m (lane m), acc[g][2w + 1] dims 32w + 2m + 1
  __m512 acc[G * 2 * W];
  for (int j = 0; j < G * 2 * W; ++j) acc[j] = _mm512_setzero_ps();
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t i = 0; i < n; ++i) {
    const at::BFloat16* vp = vbase + slots[i];
    if (i + AHEAD < n) prefetch_lines(vbase + slots[i + AHEAD], D * 2);
    if ((i & 15) == 0) ahead.step(i + 16 >= n ? 2 * ahead.n : per_block);  // the rest at the last block
    __m512 v[2 * W];
    for (int w = 0; w < W; ++w) {
      const __m512i x = _mm512_loadu_si512(vp + w * 32);
      v[2 * w] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
      v[2 * w + 1] = _mm512_castsi512_ps(_mm512_and_si512(x, hi));
    }
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + i]);
      for (int c = 0; c < 2 * W; ++c) acc[g * 2 * W + c] = _mm512_fmadd_ps(p, v[c], acc[g * 2 * W + c]);
    }
  }
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[g]);
    for (int w = 0; w < W; ++w) {
      const __m512 ev = acc[g * 2 * W + 2 * w], od = acc[g * 2 * W + 2 * w + 1];
      store16(out + g * D + w * 32, _mm512_mul_ps(_mm512_permutex2var_ps(ev, lo_idx, od), inv));
      store16(out + g * D + w * 32 + 16, _mm512_mul_ps(_mm512_permutex2var_ps(ev, hi_idx, od), inv));
    }
  }
}

// decode_into_t for bf16 on avx512_bf16 (bf16 pages, IntoCall, or int8 pages, Into8Call): the same
// writes and items, each item's slots computed before it runs (its successor's while it runs, for
// the prefetch)
template <typename Call, typename Fn>
static void decode_into_ahead(const Call& c, float scale, Fn fast) {
  using Page = typename Call::Page;
  parallel_items(c.B, c.KVH, c.len, c.window, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<typename Call::ItemQuery> qbuf(c.G * c.D);  // rotated queries (int8 pages)
    std::vector<int64_t> cur, nxt;
    auto prepare = [&](int64_t item, std::vector<int64_t>& item_slots, AheadOf<Page>& ahead) {
      const int64_t b = item / c.KVH, kh = item % c.KVH, first = c.first(b), n = c.len[b] - first;
      item_slots.resize(n);
      fill_slots(c.pg + b * c.P, c.page_size, first, n, c.row(), item_slots.data());
      ahead = AheadOf<Page>{c.k_of(kh), c.v_of(kh), item_slots.data(), n, 0,
                            c.row() * static_cast<int64_t>(sizeof(Page))};
    };
    AheadOf<Page> first_item;
    prepare(begin, cur, first_item);
    first_item.step(32);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / c.KVH, kh = item % c.KVH;
      c.write(b, kh);
      const int64_t n = c.len[b] - c.first(b);
      scores.resize(c.G * n);
      AheadOf<Page> ahead;
      if (item + 1 < end) prepare(item + 1, nxt, ahead);
      fast(c.q_for(b, kh, qbuf.data()), c.k_of(kh), c.v_of(kh), n, scale, scores.data(), cur.data(), c.out_of(b, kh),
           ahead);
      std::swap(cur, nxt);
    }
  });
}

// A bf16 model's decode-only step over int8 pages on avx512_bf16. The float kernel widens each
// int8 key into a float32 buffer and each value row as it goes: at SmolLM2's 45 rows x ~370 keys it
// took ~960 us a layer against ~530 for bf16 pages, so int8 pages were slower than the bf16 ones
// they halve. Here each key row's int8 values become bf16 (exactly: an integer of magnitude <= 127
// has 7 significant bits) and the scores are VDPBF16PS against the bf16 query as the bf16 kernel
// computes them (every product exact, float32 sums), times the row's scale and the softmax scale;
// the softmax is float32; each value row is widened from int8 to float32 and its weight is the
// softmax weight times the row's scale. The slots and the prefetch of the next item are the bf16
// kernel's, over rows of D + 4 bytes.
static inline __m512i int8x32_to_bf16(const int8_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo));  // lo: the first 16 dims
}
template <int G, int W>  // W: 32-dim words per row (D = 32 W)
static void ahead_item(const at::BFloat16* qrow, const int8_t* kbase, const int8_t* vbase, int64_t n, float scale,
                       float* scores, const int64_t* slots, at::BFloat16* out, AheadOf<int8_t>& ahead) {
  constexpr int D = 32 * W, ROW = D + 4;
  constexpr int64_t AHEAD = 8;  // rows ahead into L1 (16-48 measured no different over int8 pages read from memory)
  __m512i q[G * W];
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) q[g * W + w] = _mm512_loadu_si512(qrow + g * D + w * 32);
  __m512i kb[16 * W];  // a block's 16 keys as bf16
  alignas(64) float kscale[16];
  const int64_t blocks = std::max<int64_t>(1, (n + 15) / 16);
  const int64_t per_block = (ahead.n + blocks - 1) / blocks;  // spread as in the bf16 kernel above
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    ahead.step(per_block);
    const int nk = static_cast<int>(std::min<int64_t>(16, n - i0));
    for (int j = 0; j < nk; ++j) {
      const int64_t i = i0 + j;
      const int8_t* kp = kbase + slots[i];
      if (i + AHEAD < n) prefetch_lines(kbase + slots[i + AHEAD], ROW);
      for (int w = 0; w < W; ++w) kb[j * W + w] = int8x32_to_bf16(kp + w * 32);
      kscale[j] = row_scale(kp, D) * scale;
    }
    for (int j = nk; j < 16; ++j) {
      for (int w = 0; w < W; ++w) kb[j * W + w] = _mm512_setzero_si512();
      kscale[j] = 0.f;
    }
    const __mmask16 keep = nk == 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nk) - 1);
    block_scores<G, W>(q, [&](int j, int w) { return kb[j * W + w]; }, _mm512_load_ps(kscale), keep, scores, n, i0);
  }
  float denom[G];
  exp_rows<G>(scores, n, denom);
  constexpr int DC = D / 16;
  __m512 acc[G * DC];
  for (int j = 0; j < G * DC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const int8_t* vp = vbase + slots[i];
    if (i + AHEAD < n) prefetch_lines(vbase + slots[i + AHEAD], ROW);
    if ((i & 15) == 0) ahead.step(i + 16 >= n ? 2 * ahead.n : per_block);  // the rest at the last block
    const float vs = row_scale(vp, D);
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = load16(vp + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * n + i] * vs);
      for (int c = 0; c < DC; ++c) acc[g * DC + c] = _mm512_fmadd_ps(p, v[c], acc[g * DC + c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[g]);
    for (int c = 0; c < DC; ++c) store16(out + g * D + c * 16, _mm512_mul_ps(acc[g * DC + c], inv));
  }
}

// ahead_item for a bf16 model over pages of Page (bf16 or int8), by query heads per kv head and head dim
template <typename Page>
using AheadItemFn = void (*)(const at::BFloat16*, const Page*, const Page*, int64_t, float, float*, const int64_t*,
                             at::BFloat16*, AheadOf<Page>&);

template <typename Page, int G>
static AheadItemFn<Page> pick_ahead_w(int64_t D) {
  switch (D) {
    case 32: return ahead_item<G, 1>;
    case 64: return ahead_item<G, 2>;
    case 128: return ahead_item<G, 4>;
    case 256: return ahead_item<G, 8>;
    default: return nullptr;
  }
}
template <typename Page>
static AheadItemFn<Page> pick_ahead(int64_t G, int64_t D) {
  switch (G) {
    case 1: return pick_ahead_w<Page, 1>(D);
    case 2: return pick_ahead_w<Page, 2>(D);
    case 3: return pick_ahead_w<Page, 3>(D);
    case 4: return pick_ahead_w<Page, 4>(D);
    case 5: return pick_ahead_w<Page, 5>(D);
    case 6: return pick_ahead_w<Page, 6>(D);
    case 7: return pick_ahead_w<Page, 7>(D);
    case 8: return pick_ahead_w<Page, 8>(D);
    default: return nullptr;
  }
}

#endif

#if defined(__AVX512F__)
// One decode-only call's items for a model dtype Q over pages of Page: acb's avx512_bf16 item where
// there is one (a bf16 model over bf16 or int8 pages), the float item otherwise; false where neither
// takes this head layout.
template <typename Q, typename Page, typename Call>
static bool run_into(const Call& c, int64_t G, int64_t D, float scale) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<Q, at::BFloat16>) {  // over bf16 or int8 pages
    if (const AheadItemFn<Page> fast = pick_ahead<Page>(G, D)) return decode_into_ahead(c, scale, fast), true;
  }
#endif
  const ItemFn<Page, typename Call::ItemQuery, Q> fast = pick_item<Page, typename Call::ItemQuery, Q>(G, D);
  if (fast == nullptr) return false;
  decode_into_t(c, scale, fast);
  return true;
}
#endif

#if !defined(__AVX512F__) && defined(ACB_DECODE_INTO)
// paged_decode_into on AVX2: per item (row, kv head), the new rows written (or quantized) into their
// slots, the G queries widened to float32 (and rotated, in float32, on int8 pages), paged_decode's AVX2
// item (decode_item_avx2), and the output rounded once to the model's dtype: the separate path's writes,
// conversions and arithmetic on this CPU, so its bits, without its copies and dispatches.
template <typename Call>
static void decode_into_avx2(const Call& c, float scale) {
  using Q = typename Call::Query;
  bool rotate = false;  // int8 pages holding rotated keys
  if constexpr (std::is_same_v<typename Call::Page, int8_t>) rotate = c.rotate;
  const float over_block = 1.f / static_cast<float>(c.D & -c.D);
  parallel_items(c.B, c.KVH, c.len, c.window, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, kf, qf(c.G * c.D), of(std::is_same_v<Q, float> ? 0 : c.G * c.D);
    std::vector<int64_t> slots;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / c.KVH, kh = item % c.KVH;
      c.write(b, kh);
      // the queries in float32: a bf16 step's widened, then rotated in float32 where they read int8 pages
      // (the separate path on this CPU widens a bf16 step's rows before it rotates them)
      const Q* q = c.q_of(b, kh);
      const float* qr;
      float* out;  // the item's float32 output: the call's own for a float32 model, else `of`
      if constexpr (std::is_same_v<Q, float>) {
        qr = q;
        out = c.out_of(b, kh);
      } else {
        for (int64_t i = 0; i < c.G * c.D; i += 8) _mm256_storeu_ps(qf.data() + i, load8(q + i));
        qr = qf.data();
        out = of.data();
      }
      if (rotate) {  // in place where qr is qf (rotate_row widens its row before writing)
        for (int64_t g = 0; g < c.G; ++g) rotate_row(qr + g * c.D, qf.data() + g * c.D, c.D, over_block);
        qr = qf.data();
      }
      const int64_t first = c.first(b), n = c.len[b] - first;
      decode_item_avx2(qr, c.k_of(kh), c.v_of(kh), c.pg + b * c.P, c.page_size, first, n, c.G, c.D, c.row(), scale,
                       scores, slots, kf, out);
      if constexpr (!std::is_same_v<Q, float>) {  // rounded to nearest even as it is written
        uint16_t* o = reinterpret_cast<uint16_t*>(c.out_of(b, kh));
        for (int64_t i = 0; i < c.G * c.D; i += 8) acb_vec::store8(o + i, _mm256_loadu_ps(of.data() + i));
      }
    }
  });
}

template <typename Q, typename Page, typename Call>
static bool run_into(const Call& c, int64_t, int64_t D, float scale) {
  if (D % 8 != 0) return false;  // decode_item_avx2's 8-lane rows
  decode_into_avx2(c, scale);
  return true;
}
#endif

bool paged_decode_into(const torch::Tensor& q,      // [B, H, D]: heads contiguous within a row, any row stride
                       const torch::Tensor& k_new,  // [B, KVH, D] the rows' new keys, laid out as q
                       const torch::Tensor& v_new,  // [B, KVH, D] their values
                       torch::Tensor& k_cache, torch::Tensor& v_cache,  // [KVH, S, D] (int8: [KVH, S, D + 4])
                       const torch::Tensor& slots,    // [B] int64: each row's new slot
                       const torch::Tensor& pages,    // [B, P] int64
                       const torch::Tensor& lengths,  // [B] int64: context length, the new token's included
                       torch::Tensor& out,            // [B, H, D], laid out as q
                       int64_t page_size, double scale, double softcap, int64_t window,
                       bool rotate) {  // int8 pages holding rotated keys (acb/kv_quant.py)
#if defined(ACB_DECODE_INTO)
  const auto dt = q.scalar_type();
  if (softcap > 0.0 || (dt != torch::kFloat32 && dt != torch::kBFloat16)) return false;
  // the pages: the model's dtype, or int8 rows of D values and their scale (kv_cache_dtype="int8")
  const bool int8_pages = k_cache.scalar_type() == torch::kInt8;
  const auto page_dt = int8_pages ? torch::kInt8 : dt;
  for (const torch::Tensor* t : {&k_new, &v_new, static_cast<const torch::Tensor*>(&out)})
    if (t->scalar_type() != dt) return false;
  if (k_cache.scalar_type() != page_dt || v_cache.scalar_type() != page_dt) return false;
  for (const torch::Tensor* t : {&q, &k_new, &v_new, static_cast<const torch::Tensor*>(&out)})
    if (t->dim() != 3 || t->stride(2) != 1 || t->stride(1) != t->size(2)) return false;
  const int64_t row = q.size(2) + (int8_pages ? RowOf<int8_t>::EXTRA : 0);
  if (!k_cache.is_contiguous() || !v_cache.is_contiguous() || k_cache.size(2) != row ||
      v_cache.sizes() != k_cache.sizes() || q.size(1) % k_cache.size(0) != 0 || k_new.size(1) != k_cache.size(0) ||
      slots.scalar_type() != torch::kInt64 || pages.scalar_type() != torch::kInt64 ||
      lengths.scalar_type() != torch::kInt64 || !pages.is_contiguous() || !slots.is_contiguous() ||
      slots.size(0) != q.size(0) || k_new.size(0) != q.size(0) || out.size(0) != q.size(0))
    return false;
  const int64_t G = q.size(1) / k_cache.size(0), D = q.size(2);
  const float fscale = static_cast<float>(scale);
  using BF = at::BFloat16;
  if (int8_pages)
    return dt == torch::kFloat32
               ? run_into<float, int8_t>(
                     Into8Call<float>{q, k_new, v_new, k_cache, v_cache, slots, pages, lengths, out, page_size, window,
                                      rotate},
                     G, D, fscale)
               : run_into<BF, int8_t>(
                     Into8Call<BF>{q, k_new, v_new, k_cache, v_cache, slots, pages, lengths, out, page_size, window,
                                   rotate},
                     G, D, fscale);
  return dt == torch::kFloat32
             ? run_into<float, float>(
                   IntoCall<float>{q, k_new, v_new, k_cache, v_cache, slots, pages, lengths, out, page_size, window},
                   G, D, fscale)
             : run_into<BF, BF>(
                   IntoCall<BF>{q, k_new, v_new, k_cache, v_cache, slots, pages, lengths, out, page_size, window},
                   G, D, fscale);
#else
  return false;
#endif
}


// ---------------------------------------------------------------------------------
// Prefill attention: every prompt chunk of the packed step attends causally to its keys
// (a fresh prompt's own new k/v, read straight from the step's tensors; a continued
// chunk's gathered context). PyTorch's CPU flash kernel computes whole key blocks (the causal half
// included) and, on this project's 2-core machine, made 25-60 GFLOP/s on prompts of
// 64-512 tokens; this one packs each (span, kv head)'s keys transposed once, then
// runs 8 query rows x 32 keys register tiles (all query heads of a kv head share the
// packed keys), an online softmax, and only the key blocks each row can see.
// The float32 prompt kernel runs with AVX-512 (16-lane tiles) or AVX2 + FMA (8-lane tiles, below);
// both share the work items, the rows' bookkeeping and the driver (prefill_attention).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define ACB_PREFILL_F32 1
#endif

#if defined(ACB_PREFILL_F32)
namespace prefill {

constexpr int KB = 32;  // keys per block
constexpr int RB = 8;   // query rows per register tile
constexpr int BQ = 16;  // query positions per work item

struct Args {
  const float* q; int64_t q_tok, q_head;    // q[t, h, :] = q + t * q_tok + h * q_head
  const float* k; int64_t k_tok, k_head;
  const float* v; int64_t v_tok, v_head;
  float* out; int64_t o_tok, o_head;
  int64_t D, G;
  float scale, cap;
  int64_t window;
};

// Up to RB query rows of one work item (positions [i0, i1) of a span, the G heads of kv head kh,
// rows r0..): their queries, positions and windows, and their online-softmax state. Row r0 + r is
// position i0 + (r0 + r) / G, head kh * G + (r0 + r) % G: counted on from r0's, not divided per row
// (two 64-bit divisions a row, here and in store(), took ~10 % of the bf16 kernel's time).
template <typename Q>
struct Rows {
  int R;
  const Q* qr[RB];
  int64_t pos[RB], lo[RB], tok[RB], head[RB];
  float m[RB], l[RB], corr[RB];
  int64_t hi_max = 0, lo_min = INT64_MAX;

  Rows(const Q* q, int64_t q_tok, int64_t q_head, int64_t G, int64_t window, int64_t t0, int64_t past, int64_t kh,
       int64_t i0, int64_t r0, int64_t nrows, float* acc, int64_t D)
      : R(static_cast<int>(std::min<int64_t>(RB, nrows - r0))) {
    int64_t i = i0 + r0 / G, g = r0 % G;
    for (int r = 0; r < R; ++r) {
      tok[r] = i;
      head[r] = kh * G + g;
      qr[r] = q + (t0 + i) * q_tok + head[r] * q_head;
      pos[r] = past + i;
      lo[r] = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
      hi_max = std::max(hi_max, pos[r]);
      lo_min = std::min(lo_min, lo[r]);
      m[r] = 0.f;
      l[r] = 0.f;
      std::fill(acc + r * D, acc + (r + 1) * D, 0.f);
      if (++g == G) {
        g = 0;
        ++i;
      }
    }
  }
};
}  // namespace prefill
#endif

#if defined(__AVX512F__)
namespace prefill {

// One row's online-softmax step over a block of KB scores s (keys kb..kb+31): scaled, soft-capped
// when cap > 0, masked to the keys lo..pos the row sees. p0/p1: the block's weights (0 where
// masked), relative to the row's running max m; corr: the factor for its accumulators; m, l: its
// running max and sum, updated. False (corr = 1, nothing updated) where the row sees no key here.
// Which of a block's KB keys (kb..kb+31) a row at position pos sees (lo..pos): v0 the first 16, v1 the rest
static inline void block_keys(int64_t kb, int64_t pos, int64_t lo, __mmask16& v0, __mmask16& v1) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i key0 = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(kb)));
  const __m512i key1 = _mm512_add_epi32(key0, _mm512_set1_epi32(16));
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(pos)), low = _mm512_set1_epi32(static_cast<int>(lo));
  v0 = _mm512_cmple_epi32_mask(key0, hi) & _mm512_cmpge_epi32_mask(key0, low);
  v1 = _mm512_cmple_epi32_mask(key1, hi) & _mm512_cmpge_epi32_mask(key1, low);
}

// A row's KB scores s times scale, soft-capped when cap > 0: x0 the first 16, x1 the rest
static inline void scaled_scores(const float* s, float scale, float cap, __m512& x0, __m512& x1) {
  const __m512 vscale = _mm512_set1_ps(scale);
  x0 = _mm512_mul_ps(_mm512_loadu_ps(s), vscale);
  x1 = _mm512_mul_ps(_mm512_loadu_ps(s + 16), vscale);
  if (cap > 0.f) {
    alignas(64) float t[KB];
    _mm512_store_ps(t, x0);
    _mm512_store_ps(t + 16, x1);
    for (int j = 0; j < KB; ++j) t[j] = tanhf(t[j] / cap) * cap;
    x0 = _mm512_load_ps(t);
    x1 = _mm512_load_ps(t + 16);
  }
}

// The largest of a row's scores x0, x1 over the keys it sees (v0, v1; at least one)
static inline float seen_max(__mmask16 v0, __mmask16 v1, __m512 x0, __m512 x1) {
  const __m512 lowest = _mm512_set1_ps(-3.0e38f);  // masked lanes (no infinities: -ffast-math)
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_mask_mov_ps(lowest, v0, x0), _mm512_mask_mov_ps(lowest, v1, x1)));
}

static inline bool softmax_block(const float* s, int64_t kb, int64_t pos, int64_t lo, float scale, float cap,
                                 float& m, float& l, float& corr, __m512& p0, __m512& p1) {
  __mmask16 v0, v1;
  block_keys(kb, pos, lo, v0, v1);
  if ((v0 | v1) == 0) {
    corr = 1.f;
    return false;
  }
  __m512 x0, x1;
  scaled_scores(s, scale, cap, x0, x1);
  const float bm = seen_max(v0, v1, x0, x1);
  const bool first = l == 0.f;
  const float m_new = first ? bm : std::max(m, bm);
  corr = first ? 0.f : expf(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  p0 = _mm512_maskz_mov_ps(v0, exp16(_mm512_sub_ps(x0, mv)));
  p1 = _mm512_maskz_mov_ps(v1, exp16(_mm512_sub_ps(x1, mv)));
  l = l * corr + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
  m = m_new;
  return true;
}

// softmax_block for the R rows of a tile at once (the bf16 kernel's): each row's block max first,
// then every row's new running max and its accumulators' factor in one vector exp (where
// softmax_block took a scalar expf per row, a chain of reductions and a call one row after
// another), then each row's weights into ex[r * KB ...] (zeros where it sees no key of the block:
// its max, sum and factor 1 left as they were).
static inline void softmax_rows(float* s, int64_t kb, int R, const int64_t* pos, const int64_t* lo, float scale,
                                float cap, float* m, float* l, float* corr, float* ex) {
  __mmask16 v0[RB], v1[RB];
  alignas(64) float bm[16] = {};
  __mmask16 seen = 0;  // the rows that see a key of this block
  for (int r = 0; r < R; ++r) {
    block_keys(kb, pos[r], lo[r], v0[r], v1[r]);
    if ((v0[r] | v1[r]) == 0) continue;
    seen |= static_cast<__mmask16>(1u << r);
    float* sr = s + r * KB;
    __m512 x0, x1;
    scaled_scores(sr, scale, cap, x0, x1);
    _mm512_storeu_ps(sr, x0);  // scaled (and capped) in place, for the weights below
    _mm512_storeu_ps(sr + 16, x1);
    bm[r] = seen_max(v0[r], v1[r], x0, x1);
  }
  const __mmask16 rows = static_cast<__mmask16>((1u << R) - 1);
  const __m512 mo = _mm512_maskz_loadu_ps(rows, m), lo_ = _mm512_maskz_loadu_ps(rows, l);
  const __m512 bmv = _mm512_load_ps(bm);
  const __mmask16 first = _mm512_cmp_ps_mask(lo_, _mm512_setzero_ps(), _CMP_EQ_OQ);
  const __m512 m_new = _mm512_mask_mov_ps(_mm512_max_ps(mo, bmv), first, bmv);
  // not first: exp(m - m_new); first: 0; a row that sees nothing here: 1, its max unchanged
  __m512 c = _mm512_maskz_mov_ps(static_cast<__mmask16>(~first), exp16(_mm512_sub_ps(mo, m_new)));
  c = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), seen, c);
  _mm512_mask_storeu_ps(corr, rows, c);
  _mm512_mask_storeu_ps(m, static_cast<__mmask16>(rows & seen), m_new);
  alignas(64) float mn[16];
  _mm512_store_ps(mn, m_new);
  for (int r = 0; r < R; ++r) {
    float* e = ex + r * KB;
    if (!(seen >> r & 1)) {
      _mm512_store_ps(e, _mm512_setzero_ps());
      _mm512_store_ps(e + 16, _mm512_setzero_ps());
      continue;
    }
    const __m512 mv = _mm512_set1_ps(mn[r]);
    const __m512 p0 = _mm512_maskz_mov_ps(v0[r], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * KB), mv)));
    const __m512 p1 = _mm512_maskz_mov_ps(v1[r], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + r * KB + 16), mv)));
    l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(_mm512_add_ps(p0, p1));
    _mm512_store_ps(e, p0);
    _mm512_store_ps(e + 16, p1);
  }
}

// out rows = acc / l, DC * 16 dims each: float32, or rounded to bfloat16 (to nearest even, as PyTorch's
// conversion of the float32 rows would round them)
template <int DC, typename Q, typename O>
static inline void store(const Rows<Q>& t, O* out, int64_t o_tok, int64_t o_head, int64_t t0, const float* acc) {
  constexpr int D = DC * 16;
  for (int r = 0; r < t.R; ++r) {
    O* o = out + (t0 + t.tok[r]) * o_tok + t.head[r] * o_head;
    const __m512 inv = _mm512_set1_ps(1.f / t.l[r]);
    for (int c = 0; c < DC; ++c) store16(o + c * 16, _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c * 16), inv));
  }
}

// s[r][0:32] = q_r . KT[:, 0:32] for R rows
template <int R>
static inline void qk(const float* const* qr, const float* kt, int64_t ldk, int64_t D, float* s) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m512 b0 = _mm512_loadu_ps(kt + d * ldk), b1 = _mm512_loadu_ps(kt + d * ldk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(qr[r][d]);
      c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * KB, c0[r]);
    _mm512_storeu_ps(s + r * KB + 16, c1[r]);
  }
}

// acc[r] = acc[r] * corr[r] + sum_j p[r][j] * v_j, for R rows of DC*16 dims
template <int DC, int R>
static inline void pv(float* acc, const float* corr, const float* p, const float* const* vr, int nk) {
  constexpr int D = DC * 16;
  __m512 a[R * DC];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < DC; ++c) a[r * DC + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c * 16), cr);
  }
  for (int j = 0; j < nk; ++j) {
    __m512 v[DC];
    for (int c = 0; c < DC; ++c) v[c] = _mm512_loadu_ps(vr[j] + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(p[r * KB + j]);
      for (int c = 0; c < DC; ++c) a[r * DC + c] = _mm512_fmadd_ps(w, v[c], a[r * DC + c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + r * D + c * 16, a[r * DC + c]);
}

template <int DC>
static void pv_rows(float* acc, const float* corr, const float* p, const float* const* vr, int nk, int rows) {
  constexpr int RP = DC >= 16 ? 1 : (16 / DC > RB ? RB : 16 / DC);  // accumulators fit the registers
  constexpr int D = DC * 16;
  int r = 0;
  for (; r + RP <= rows; r += RP) pv<DC, RP>(acc + r * D, corr + r, p + r * KB, vr, nk);
  for (; r < rows; ++r) pv<DC, 1>(acc + r * D, corr + r, p + r * KB, vr, nk);
}

static void qk_rows(const float* const* qr, const float* kt, int64_t ldk, int64_t D, float* s, int rows) {
  switch (rows) {
    case 1: qk<1>(qr, kt, ldk, D, s); break;
    case 2: qk<2>(qr, kt, ldk, D, s); break;
    case 3: qk<3>(qr, kt, ldk, D, s); break;
    case 4: qk<4>(qr, kt, ldk, D, s); break;
    case 5: qk<5>(qr, kt, ldk, D, s); break;
    case 6: qk<6>(qr, kt, ldk, D, s); break;
    case 7: qk<7>(qr, kt, ldk, D, s); break;
    default: qk<8>(qr, kt, ldk, D, s); break;
  }
}

// Query positions [i0, i1) of one span (first packed token `t0`), kv head kh: its G
// heads' rows, RB at a time, against the span's packed keys kt (blocks of [D][KB]).
template <int D>
static void run_item(const Args& a, int64_t t0, int64_t k0, int64_t past, int64_t kh, int64_t i0, int64_t i1,
                     const float* kt, int64_t ldk, float* s, float* p, float* acc) {
  constexpr int DC = D / 16;
  const int64_t G = a.G;
  const int64_t nrows = (i1 - i0) * G;
  for (int64_t r0 = 0; r0 < nrows; r0 += RB) {
    Rows<float> t(a.q, a.q_tok, a.q_head, G, a.window, t0, past, kh, i0, r0, nrows, acc, D);
    const int R = t.R;
    const float* const* qr = t.qr;
    const int64_t *pos = t.pos, *lo = t.lo;
    float *m = t.m, *l = t.l, *corr = t.corr;
    const int64_t hi_max = t.hi_max, lo_min = t.lo_min;
    const float* vr[KB];
    for (int64_t kb = lo_min / KB * KB; kb <= hi_max; kb += KB) {
      qk_rows(qr, kt + kb * D, KB, D, s, R);
      const int nk = static_cast<int>(std::min<int64_t>(KB, hi_max + 1 - kb));
      for (int r = 0; r < R; ++r) {
        float* pr = p + r * KB;
        __m512 p0, p1;
        if (!softmax_block(s + r * KB, kb, pos[r], lo[r], a.scale, a.cap, m[r], l[r], corr[r], p0, p1)) {
          std::fill(pr, pr + KB, 0.f);
          continue;
        }
        _mm512_storeu_ps(pr, p0);
        _mm512_storeu_ps(pr + 16, p1);
      }
      for (int j = 0; j < nk; ++j) vr[j] = a.v + (k0 + kb + j) * a.v_tok + kh * a.v_head;
      pv_rows<DC>(acc, corr, p, vr, nk, R);
    }
    store<DC>(t, a.out, a.o_tok, a.o_head, t0, acc);
  }
}



#if defined(__AVX512BF16__)
// bfloat16 prompts (a bf16 model): the same tiles and online softmax, with the two products
// on avx512_bf16 dot products (VDPBF16PS: two bf16 pairs a lane into a float32 sum), half the
// instructions of the float32 kernel's FMAs. Keys are packed per (span, kv head) as
// [D/2][ldk] pairs (k[d], k[d+1]) of one key, values as [ldk/2][D] pairs (v_j[d], v_j+1[d]) of
// two keys; queries are read in place as pairs. Scores, the softmax, its sums and the
// accumulators are float32; the softmax weights go into the second product as two bf16 parts
// (p = hi + lo, two VDPBF16PS: ~16 bits of each weight, where flash attention on GPUs rounds p to
// bf16's 8), their sum is taken before rounding. With bf16_weights (acb's int8 forward) p is hi
// alone: one VDPBF16PS.
static inline __m512 dot(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}
static inline uint32_t pair_at(const at::BFloat16* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// s[r][0:32] = q_r . K[0:32] for R rows; kt: [D/2][ldk] uint32 pairs
template <int R>
static inline void qk16(const at::BFloat16* const* qr, const uint32_t* kt, int64_t ldk, int64_t D, float* s) {
  __m512 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm512_setzero_ps();
  for (int64_t dp = 0; dp < D / 2; ++dp) {
    const __m512i b0 = _mm512_loadu_si512(kt + dp * ldk), b1 = _mm512_loadu_si512(kt + dp * ldk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(pair_at(qr[r] + 2 * dp)));
      c0[r] = dot(c0[r], b0, a);
      c1[r] = dot(c1[r], b1, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * KB, c0[r]);
    _mm512_storeu_ps(s + r * KB + 16, c1[r]);
  }
}

// acc[r] = acc[r] * corr[r] + sum_j p[r][j] v_j; p16: per row KB/2 uint32 pairs of the bf16
// weights' high parts, then (LO) KB/2 pairs of their low parts (p = hi + lo, each bf16: ~16 bits of
// p; without LO p is its high part alone, rounded to bf16's 8 bits: one product, not two),
// vt: [pairs][D] uint32 value pairs starting at this block
template <int DC, int R, bool LO>
static inline void pv16(float* acc, const float* corr, const uint32_t* p16, const uint32_t* vt, int np) {
  constexpr int D = DC * 16;
  __m512 a[R * DC];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < DC; ++c) a[r * DC + c] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * D + c * 16), cr);
  }
  for (int j = 0; j < np; ++j) {
    __m512i v[DC];
    for (int c = 0; c < DC; ++c) v[c] = _mm512_loadu_si512(vt + j * D + c * 16);
    for (int r = 0; r < R; ++r) {
      const __m512i w = _mm512_set1_epi32(static_cast<int>(p16[r * KB + j]));
      if constexpr (LO) {
        const __m512i w_lo = _mm512_set1_epi32(static_cast<int>(p16[r * KB + KB / 2 + j]));
        for (int c = 0; c < DC; ++c) a[r * DC + c] = dot(dot(a[r * DC + c], v[c], w), v[c], w_lo);
      } else {
        for (int c = 0; c < DC; ++c) a[r * DC + c] = dot(a[r * DC + c], v[c], w);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + r * D + c * 16, a[r * DC + c]);
}

// Not inlined into run_item16: inlined, GCC's code for the one-product (LO false) kernel ran ~4 % slower
// than the two-product one, out of line ~13 % faster (benchmarks/prefill_attention.py --bf16-weights; the
// two-product kernel the same or faster)
template <int DC, bool LO>
__attribute__((noinline)) static void pv16_rows(float* acc, const float* corr, const uint32_t* p16, const uint32_t* vt,
                                                int np, int rows) {
  constexpr int RP = DC >= 16 ? 1 : (16 / DC > RB ? RB : 16 / DC);
  constexpr int D = DC * 16;
  int r = 0;
  for (; r + RP <= rows; r += RP) pv16<DC, RP, LO>(acc + r * D, corr + r, p16 + r * KB, vt, np);
  for (; r < rows; ++r) pv16<DC, 1, LO>(acc + r * D, corr + r, p16 + r * KB, vt, np);
}

static void qk16_rows(const at::BFloat16* const* qr, const uint32_t* kt, int64_t ldk, int64_t D, float* s, int rows) {
  switch (rows) {
    case 1: qk16<1>(qr, kt, ldk, D, s); break;
    case 2: qk16<2>(qr, kt, ldk, D, s); break;
    case 3: qk16<3>(qr, kt, ldk, D, s); break;
    case 4: qk16<4>(qr, kt, ldk, D, s); break;
    case 5: qk16<5>(qr, kt, ldk, D, s); break;
    case 6: qk16<6>(qr, kt, ldk, D, s); break;
    case 7: qk16<7>(qr, kt, ldk, D, s); break;
    default: qk16<8>(qr, kt, ldk, D, s); break;
  }
}

struct Args16 {
  const at::BFloat16* q; int64_t q_tok, q_head;
  float* out; at::BFloat16* out16; int64_t o_tok, o_head;  // the output: float32 (out) or bf16 (out16)
  int64_t D, G;
  float scale, cap;
  int64_t window;
};

// As run_item, over packed bf16 keys kt ([D/2][ldk] pairs) and values vt ([ldk/2][D] pairs); LO:
// the value product takes the softmax weights as hi + lo (else rounded to bf16, as on GPUs).
template <int DC, bool LO>
static void run_item16(const Args16& a, int64_t t0, int64_t past, int64_t kh, int64_t i0, int64_t i1,
                       const uint32_t* kt, const uint32_t* vt, int64_t ldk, float* s, uint32_t* p16, float* acc) {
  constexpr int D = DC * 16;
  const int64_t G = a.G;
  const int64_t nrows = (i1 - i0) * G;
  for (int64_t r0 = 0; r0 < nrows; r0 += RB) {
    Rows<at::BFloat16> t(a.q, a.q_tok, a.q_head, G, a.window, t0, past, kh, i0, r0, nrows, acc, D);
    const int R = t.R;
    const at::BFloat16* const* qr = t.qr;
    const int64_t *pos = t.pos, *lo = t.lo;
    float *m = t.m, *l = t.l, *corr = t.corr;
    const int64_t hi_max = t.hi_max, lo_min = t.lo_min;
    for (int64_t kb = lo_min / KB * KB; kb <= hi_max; kb += KB) {
      qk16_rows(qr, kt + kb, ldk, D, s, R);
      const int nk = static_cast<int>(std::min<int64_t>(KB, hi_max + 1 - kb));
      alignas(64) float ex[RB * KB];  // the rows' weights, relative to their new running max
      softmax_rows(s, kb, R, pos, lo, a.scale, a.cap, m, l, corr, ex);
      for (int r = 0; r < R; ++r) {
        uint32_t* pr = p16 + r * KB;
        const __m512 p0 = _mm512_load_ps(ex + r * KB), p1 = _mm512_load_ps(ex + r * KB + 16);
        // 32 bf16 weights in key order: pair j = (p[2j], p[2j+1]); then what rounding them left out,
        // also bf16 (rounding p to bf16 alone cost SmolLM2 ~0.1 point of top-1 agreement with float32)
        const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));
        _mm512_storeu_si512(pr, hi);
        if constexpr (!LO) continue;
        // hi's low 256 bits are p0's 16 weights rounded, its high 256 bits p1's: widened back
        const __m512 h0 = acb_vec::widen16(_mm512_castsi512_si256(hi));
        const __m512 h1 = acb_vec::widen16(_mm512_extracti64x4_epi64(hi, 1));
        _mm512_storeu_si512(pr + KB / 2, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
            _mm512_sub_ps(p1, h1), _mm512_sub_ps(p0, h0))));
      }
      pv16_rows<DC, LO>(acc, corr, p16, vt + (kb / 2) * D, (nk + 1) / 2, R);
    }
    if (a.out16 != nullptr) store<DC>(t, a.out16, a.o_tok, a.o_head, t0, acc);
    else store<DC>(t, a.out, a.o_tok, a.o_head, t0, acc);
  }
}

using RunFn16 = void (*)(const Args16&, int64_t, int64_t, int64_t, int64_t, int64_t, const uint32_t*, const uint32_t*,
                         int64_t, float*, uint32_t*, float*);

template <bool LO>
static RunFn16 pick16(int64_t D) {
  switch (D) {
    case 16: return run_item16<1, LO>;
    case 32: return run_item16<2, LO>;
    case 64: return run_item16<4, LO>;
    case 128: return run_item16<8, LO>;
    case 256: return run_item16<16, LO>;
    default: return nullptr;
  }
}
#endif
}  // namespace prefill
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The float32 prompt kernel on AVX2 (no AVX-512: Zen 2/3, Haswell to Alder Lake): the AVX-512 kernel's
// blocks of 32 keys, rows, online softmax and work items, on 8-lane tiles sized to 16 ymm registers:
// the scores 4 rows x 16 keys at a time, the weighted values 8 / CW rows x CW * 8 dims. A bf16 or
// fp16 step's rows reach it widened to float32 (attention.py). PyTorch's flash kernel, which it
// replaces here, computes whole key blocks, the causal half included.
namespace prefill {

static inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}
static inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// softmax_block (above, AVX-512) on 8 lanes: the block's KB weights written to p (0 where masked)
static inline bool softmax_block8(const float* s, int64_t kb, int64_t pos, int64_t lo, float scale, float cap,
                                  float& m, float& l, float& corr, float* p) {
  const int64_t first = std::max(lo, kb), last = std::min(pos, kb + KB - 1);
  if (first > last) {
    corr = 1.f;
    return false;
  }
  // lane j of vector c is key kb + 8c + j, seen where first <= key <= last
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i below = _mm256_set1_epi32(static_cast<int>(first - kb - 1));
  const __m256i above = _mm256_set1_epi32(static_cast<int>(last - kb + 1));
  const __m256 vscale = _mm256_set1_ps(scale), lowest = _mm256_set1_ps(-3.0e38f);  // no infinities: -ffast-math
  __m256 x[KB / 8], keep[KB / 8];
  for (int c = 0; c < KB / 8; ++c) {
    const __m256i key = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * c));
    keep[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(key, below), _mm256_cmpgt_epi32(above, key)));
    x[c] = _mm256_mul_ps(_mm256_loadu_ps(s + 8 * c), vscale);
  }
  if (cap > 0.f) {
    alignas(32) float t[KB];
    for (int c = 0; c < KB / 8; ++c) _mm256_store_ps(t + 8 * c, x[c]);
    for (int j = 0; j < KB; ++j) t[j] = tanhf(t[j] / cap) * cap;
    for (int c = 0; c < KB / 8; ++c) x[c] = _mm256_load_ps(t + 8 * c);
  }
  __m256 mx = lowest;
  for (int c = 0; c < KB / 8; ++c) mx = _mm256_max_ps(mx, _mm256_blendv_ps(lowest, x[c], keep[c]));
  const float bm = hmax8(mx);
  const bool first_block = l == 0.f;
  const float m_new = first_block ? bm : std::max(m, bm);
  corr = first_block ? 0.f : expf(m - m_new);
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 sum = _mm256_setzero_ps();
  for (int c = 0; c < KB / 8; ++c) {
    const __m256 e = _mm256_and_ps(keep[c], acb_vec::exp256(_mm256_sub_ps(x[c], mv)));
    _mm256_storeu_ps(p + 8 * c, e);
    sum = _mm256_add_ps(sum, e);
  }
  l = l * corr + hsum8(sum);
  m = m_new;
  return true;
}

// s[r][0:16] = q_r . KT[:, 0:16] for R <= 4 rows (8 accumulators, 2 key vectors, 1 broadcast)
template <int R>
static inline void qk8(const float* const* qr, const float* kt, int64_t ldk, int64_t D, float* s) {
  __m256 c0[R], c1[R];
  for (int r = 0; r < R; ++r) c0[r] = c1[r] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 b0 = _mm256_loadu_ps(kt + d * ldk), b1 = _mm256_loadu_ps(kt + d * ldk + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(qr[r] + d);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(s + r * KB, c0[r]);
    _mm256_storeu_ps(s + r * KB + 8, c1[r]);
  }
}

// s[r][0:32] for `rows` rows: 4 rows x 16 keys at a time
static void qk8_rows(const float* const* qr, const float* kt, int64_t ldk, int64_t D, float* s, int rows) {
  for (int r0 = 0; r0 < rows; r0 += 4)
    for (int h = 0; h < KB; h += 16) {
      const float* k = kt + h;
      float* out = s + r0 * KB + h;
      switch (std::min(4, rows - r0)) {
        case 1: qk8<1>(qr + r0, k, ldk, D, out); break;
        case 2: qk8<2>(qr + r0, k, ldk, D, out); break;
        case 3: qk8<3>(qr + r0, k, ldk, D, out); break;
        default: qk8<4>(qr + r0, k, ldk, D, out); break;
      }
    }
}

// acc[r][c0 : c0 + 8 CW] = acc * corr[r] + sum_j p[r][j] * v_j, for R rows (R * CW <= 8 accumulators)
template <int CW, int R>
static inline void pv8(float* acc, int64_t D, int64_t c0, const float* corr, const float* p, const float* const* vr,
                       int nk) {
  __m256 a[R * CW];
  for (int r = 0; r < R; ++r) {
    const __m256 cr = _mm256_set1_ps(corr[r]);
    for (int c = 0; c < CW; ++c) a[r * CW + c] = _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c0 + 8 * c), cr);
  }
  for (int j = 0; j < nk; ++j) {
    __m256 v[CW];
    for (int c = 0; c < CW; ++c) v[c] = _mm256_loadu_ps(vr[j] + c0 + 8 * c);
    for (int r = 0; r < R; ++r) {
      const __m256 w = _mm256_broadcast_ss(p + r * KB + j);
      for (int c = 0; c < CW; ++c) a[r * CW + c] = _mm256_fmadd_ps(w, v[c], a[r * CW + c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + r * D + c0 + 8 * c, a[r * CW + c]);
}

template <int D>
static void pv8_rows(float* acc, const float* corr, const float* p, const float* const* vr, int nk, int rows) {
  constexpr int CW = D >= 32 ? 4 : D / 8, RP = 8 / CW;
  int r = 0;
  for (; r + RP <= rows; r += RP)
    for (int64_t c0 = 0; c0 < D; c0 += 8 * CW) pv8<CW, RP>(acc + r * D, D, c0, corr + r, p + r * KB, vr, nk);
  for (; r < rows; ++r)
    for (int64_t c0 = 0; c0 < D; c0 += 8 * CW) pv8<CW, 1>(acc + r * D, D, c0, corr + r, p + r * KB, vr, nk);
}

// out rows = acc / l
template <int D>
static inline void store8(const Rows<float>& t, float* out, int64_t o_tok, int64_t o_head, int64_t t0,
                          const float* acc) {
  for (int r = 0; r < t.R; ++r) {
    float* o = out + (t0 + t.tok[r]) * o_tok + t.head[r] * o_head;
    const __m256 inv = _mm256_set1_ps(1.f / t.l[r]);
    for (int c = 0; c < D; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(acc + r * D + c), inv));
  }
}

// run_item (AVX-512, above) on these tiles
template <int D>
static void run_item(const Args& a, int64_t t0, int64_t k0, int64_t past, int64_t kh, int64_t i0, int64_t i1,
                      const float* kt, int64_t ldk, float* s, float* p, float* acc) {
  const int64_t G = a.G;
  const int64_t nrows = (i1 - i0) * G;
  for (int64_t r0 = 0; r0 < nrows; r0 += RB) {
    Rows<float> t(a.q, a.q_tok, a.q_head, G, a.window, t0, past, kh, i0, r0, nrows, acc, D);
    const int R = t.R;
    const float* vr[KB];
    for (int64_t kb = t.lo_min / KB * KB; kb <= t.hi_max; kb += KB) {
      qk8_rows(t.qr, kt + kb * D, KB, D, s, R);
      const int nk = static_cast<int>(std::min<int64_t>(KB, t.hi_max + 1 - kb));
      for (int r = 0; r < R; ++r)
        if (!softmax_block8(s + r * KB, kb, t.pos[r], t.lo[r], a.scale, a.cap, t.m[r], t.l[r], t.corr[r], p + r * KB))
          std::fill(p + r * KB, p + (r + 1) * KB, 0.f);
      for (int j = 0; j < nk; ++j) vr[j] = a.v + (k0 + kb + j) * a.v_tok + kh * a.v_head;
      pv8_rows<D>(acc, t.corr, p, vr, nk, R);
    }
    store8<D>(t, a.out, a.o_tok, a.o_head, t0, acc);
  }
}

}  // namespace prefill
#endif

#if defined(ACB_PREFILL_F32)
namespace prefill {
// the float32 kernel for head dim D (this build's run_item, AVX-512 or AVX2), or null
using RunFn = void (*)(const Args&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                      float*, float*);

static RunFn pick(int64_t D) {
  switch (D) {
    case 16: return run_item<16>;
    case 32: return run_item<32>;
    case 64: return run_item<64>;
    case 128: return run_item<128>;
    case 256: return run_item<256>;
    default: return nullptr;
  }
}
}  // namespace prefill

// Work items (span, kv head, block of BQ query positions), spread over the threads by their
// cost (causal: a block's keys grow with its position), largest first: one list per thread.
struct Item { int64_t s, kh, i0, i1; double cost; };
static std::vector<std::vector<Item>> spread_items(const int64_t* sp, int64_t N, int64_t KVH, int64_t window) {
  std::vector<Item> items;
  for (int64_t s = 0; s < N; ++s) {
    const int64_t n = sp[4 * s + 1] - sp[4 * s], past = sp[4 * s + 3];
    for (int64_t i0 = 0; i0 < n; i0 += prefill::BQ) {
      const int64_t i1 = std::min(n, i0 + prefill::BQ);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, past + i0 - window + 1) : 0;
      for (int64_t kh = 0; kh < KVH; ++kh)
        items.push_back({s, kh, i0, i1, double(i1 - i0) * double(past + i1 - lo + prefill::KB)});
    }
  }
  std::sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size())));
  std::vector<std::vector<Item>> buckets(nt);
  std::vector<double> load(nt, 0.0);
  for (const Item& it : items) {
    const int64_t b = std::min_element(load.begin(), load.end()) - load.begin();
    buckets[b].push_back(it);
    load[b] += it.cost;
  }
  return buckets;
}
#endif

#if defined(__AVX512BF16__)
// The bf16 prefill (q, k, v all bfloat16; out float32 or bfloat16): keys and values packed as pairs.
static bool prefill_attention_bf16(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& spans, torch::Tensor& out, double scale, double softcap,
                                   int64_t window, bool bf16_weights) {
  using prefill::KB;
  const int64_t H = q.size(0), D = q.size(2), KVH = k.size(0);
  const prefill::RunFn16 run = bf16_weights ? prefill::pick16<false>(D) : prefill::pick16<true>(D);
  if (run == nullptr) return false;
  const bool out16 = out.scalar_type() == torch::kBFloat16;
  prefill::Args16 a{q.data_ptr<at::BFloat16>(), q.stride(1), q.stride(0), out16 ? nullptr : out.data_ptr<float>(),
                    out16 ? out.data_ptr<at::BFloat16>() : nullptr, out.stride(0), out.stride(1), D, H / KVH,
                    static_cast<float>(scale), static_cast<float>(softcap), window};
  const at::BFloat16 *kp = k.data_ptr<at::BFloat16>(), *vp = v.data_ptr<at::BFloat16>();
  const int64_t k_tok = k.stride(1), k_head = k.stride(0), v_tok = v.stride(1), v_head = v.stride(0);
  const int64_t N = spans.size(0);
  const int64_t* sp = spans.data_ptr<int64_t>();
  auto keys = [&](int64_t s) { return sp[4 * s + 3] + sp[4 * s + 1] - sp[4 * s]; };  // past + n
  // per span and kv head: keys [D/2][ldk] pairs, values [ldk/2][D] pairs (ldk: keys rounded up to KB)
  std::vector<int64_t> off(N + 1, 0);
  for (int64_t s = 0; s < N; ++s) off[s + 1] = off[s] + KVH * (D / 2) * ((keys(s) + KB - 1) / KB * KB);
  std::vector<uint32_t> kt(off[N]), vt(off[N]);
  at::parallel_for(0, N * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, kh = item % KVH, k0 = sp[4 * s + 2], n = keys(s);
      const int64_t ldk = (n + KB - 1) / KB * KB;
      uint32_t* kd = kt.data() + off[s] + kh * (D / 2) * ldk;
      uint32_t* vd = vt.data() + off[s] + kh * (D / 2) * ldk;
      std::fill(kd, kd + (D / 2) * ldk, 0u);
      std::fill(vd, vd + (D / 2) * ldk, 0u);
      const uint16_t* kb16 = reinterpret_cast<const uint16_t*>(kp);
      const uint16_t* vb16 = reinterpret_cast<const uint16_t*>(vp);
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* kr = kb16 + (k0 + j) * k_tok + kh * k_head;
        for (int64_t dp = 0; dp < D / 2; ++dp) kd[dp * ldk + j] = uint32_t(kr[2 * dp]) | (uint32_t(kr[2 * dp + 1]) << 16);
        const uint16_t* vr = vb16 + (k0 + j) * v_tok + kh * v_head;
        uint16_t* vrow = reinterpret_cast<uint16_t*>(vd + (j / 2) * D) + (j % 2);
        for (int64_t d = 0; d < D; ++d) vrow[2 * d] = vr[d];
      }
    }
  });
  const auto buckets = spread_items(sp, N, KVH, window);
  at::parallel_for(0, static_cast<int64_t>(buckets.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(prefill::RB * KB), acc(prefill::RB * D);
    std::vector<uint32_t> p16(prefill::RB * KB);  // per row: KB/2 pairs of high parts, KB/2 of low
    for (int64_t b = begin; b < end; ++b)
      for (const Item& it : buckets[b]) {
        const int64_t* row = sp + 4 * it.s;
        const int64_t ldk = (keys(it.s) + KB - 1) / KB * KB;
        const int64_t base = off[it.s] + it.kh * (D / 2) * ldk;
        run(a, row[0], row[3], it.kh, it.i0, it.i1, kt.data() + base, vt.data() + base, ldk, s.data(), p16.data(),
            acc.data());
      }
  });
  return true;
}
#endif

// q [H, T, D], k/v [KVH, L, D] (any strides, the last dim contiguous), out [T, H, D] float32, or
// bfloat16 with bf16 q, k and v (last dim contiguous), spans [N, 4] int64, one row per prompt chunk:
// (first, end) its query rows in q/out, `key_first` where its keys start in k/v and `past` the position
// of its first query: queries i in [0, end - first) sit at position past + i and see
// keys j <= past + i (and > past + i - window), key j at k/v row key_first + j. A fresh
// prompt is (first, end, first, 0). Returns false, touching nothing, where this build or shape has no fast
// path (the caller then uses PyTorch's attention). q, k and v are all float32 (built with AVX-512
// or AVX2 + FMA: ``prefill_f32()``), or all bfloat16 where the build has avx512_bf16 (``prefill_bf16()``).
// bf16_weights (bf16 inputs): the value product takes the softmax weights rounded to bf16, one VDPBF16PS
// (as flash attention on GPUs), where it otherwise takes them as hi + lo (~16 bits; two): ~13 % less time
// (12 x 330-token prompts). SmolLM2's top-1 agreement with float32: int8 97.64 -> 97.63 % (acb's int8
// forward asks for it), bf16 ~0.1 point lower (its forward, at its 99 % line, does not).
bool prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& spans, torch::Tensor& out, double scale, double softcap,
                       int64_t window, bool bf16_weights) {
#if defined(ACB_PREFILL_F32)
  const int64_t H = q.size(0), D = q.size(2), KVH = k.size(0);
  const bool shapes_ok = q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1 &&
                         H % KVH == 0 && spans.scalar_type() == torch::kInt64 && spans.is_contiguous() &&
                         spans.dim() == 2 && spans.size(1) == 4;
  if (!shapes_ok) return false;
  // out: float32, or bfloat16 where q, k and v are (rounded once as it is written)
  if (out.scalar_type() != torch::kFloat32 &&
      !(out.scalar_type() == torch::kBFloat16 && q.scalar_type() == torch::kBFloat16))
    return false;
  if (q.scalar_type() == torch::kBFloat16) {
#if defined(__AVX512BF16__)
    if (k.scalar_type() == torch::kBFloat16 && v.scalar_type() == torch::kBFloat16)
      return prefill_attention_bf16(q, k, v, spans, out, scale, softcap, window, bf16_weights);
#endif
    return false;
  }
  const prefill::RunFn run = prefill::pick(D);
  if (run == nullptr || q.scalar_type() != torch::kFloat32 || k.scalar_type() != torch::kFloat32 ||
      v.scalar_type() != torch::kFloat32)
    return false;
  using prefill::KB;
  prefill::Args a{q.data_ptr<float>(), q.stride(1), q.stride(0), k.data_ptr<float>(), k.stride(1), k.stride(0),
                  v.data_ptr<float>(), v.stride(1), v.stride(0), out.data_ptr<float>(), out.stride(0), out.stride(1),
                  D, H / KVH, static_cast<float>(scale), static_cast<float>(softcap), window};
  const int64_t N = spans.size(0);
  const int64_t* sp = spans.data_ptr<int64_t>();
  // packed, transposed keys: per span, per kv head, ldk / KB blocks of [D][KB] (ldk = n rounded up to
  // KB), each block's 32 keys contiguous: as [D][ldk] the tiles' loads strode ldk floats, 4 KB apart at
  // 1,024 keys, which the L1 cache's sets could not hold (AVX2, 4 x 1,024 tokens: 78 ms a call, 60 blocked)
  std::vector<int64_t> kt_off(N + 1, 0);
  auto keys = [&](int64_t s) { return sp[4 * s + 3] + sp[4 * s + 1] - sp[4 * s]; };  // past + n
  for (int64_t s = 0; s < N; ++s) kt_off[s + 1] = kt_off[s] + KVH * D * ((keys(s) + KB - 1) / KB * KB);
  std::vector<float> kt(kt_off[N]);
  at::parallel_for(0, N * KVH, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / KVH, kh = item % KVH, k0 = sp[4 * s + 2], n = keys(s);
      const int64_t ldk = (n + KB - 1) / KB * KB;
      float* dst = kt.data() + kt_off[s] + kh * D * ldk;
      for (int64_t j = 0; j < n; ++j) {
        const float* src = a.k + (k0 + j) * a.k_tok + kh * a.k_head;
        float* col = dst + (j / KB) * KB * D + j % KB;
        for (int64_t d = 0; d < D; ++d) col[d * KB] = src[d];
      }
      if (n % KB) {  // the last block's keys past n: zeros
        float* last = dst + (n / KB) * KB * D;
        for (int64_t d = 0; d < D; ++d) std::fill(last + d * KB + n % KB, last + (d + 1) * KB, 0.f);
      }
    }
  });
  const auto buckets = spread_items(sp, N, KVH, window);
  at::parallel_for(0, static_cast<int64_t>(buckets.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(prefill::RB * KB), p(prefill::RB * KB), acc(prefill::RB * D);
    for (int64_t b = begin; b < end; ++b)
      for (const Item& it : buckets[b]) {
        const int64_t* row = sp + 4 * it.s;
        const int64_t ldk = (keys(it.s) + KB - 1) / KB * KB;
        run(a, row[0], row[2], row[3], it.kh, it.i0, it.i1, kt.data() + kt_off[it.s] + it.kh * D * ldk, ldk,
            s.data(), p.data(), acc.data());
      }
  });
  return true;
#else
  return false;
#endif
}

// Writes the step's new keys (or values) into int8 pages: src [KVH, T, D] float32 (any
// strides, the last dim contiguous), cache [KVH, S, D + 4] int8, slots [T] int64. Each
// (kv head, token) row gets scale = max|x| * (1/127) and q = round(x * 127 / max|x|) (ties to
// even; an all-zero row: scale 0, q 0), the scale stored as the row's last 4 bytes.
// src: float32 or bfloat16 (a bf16 model's new rows, quantized from their bf16 values)
// readback (optional, [KVH, T, D] float32 or bfloat16, contiguous): each row as stored, read back
// (q * scale in float32, rounded once to readback's dtype): what a later chunk reads from the
// pages, the bits of kv_quant.dequantize over the written slots (then .to(bfloat16)), without
// gathering them back out of the cache.
template <typename R>
static inline void read_back_row(const int8_t* row, int64_t D, R* dst) {
  float scale;
  std::memcpy(&scale, row + D, sizeof scale);
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    const __m512 s = _mm512_set1_ps(scale);
    for (int64_t c = 0; c < D; c += 16) store16(dst + c, _mm512_mul_ps(load16(row + c), s));
    return;
  }
#endif
  for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<R>(static_cast<float>(row[d]) * scale);
}

// A prompt step's new keys (or values) into their pages: src [KVH, T, D] (any row strides, a
// contiguous last dim) -> cache [KVH, S, D] of the same dtype at slots [T], row by row: what
// cache.index_copy_(1, slots, src) writes, without its per-element indexing (2,048 rows x 3 heads
// of SmolLM2's bf16 keys: ~127 us there, two per layer of a prompt step).
void write_kv(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1, "write_kv: src must be [KVH, T, D] with a contiguous last dim");
  TORCH_CHECK(cache.scalar_type() == src.scalar_type() && cache.is_contiguous() && cache.dim() == 3 &&
                  cache.size(0) == src.size(0) && cache.size(2) == src.size(2),
              "write_kv: cache must be a contiguous [KVH, S, D] of src's dtype");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.dim() == 1 &&
                  slots.numel() == src.size(1),
              "write_kv: slots must be int64 [T]");
  const int64_t KVH = src.size(0), T = src.size(1), D = src.size(2), S = cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "write_kv: slot ", sl[t], " out of range");
  const int64_t es = src.element_size(), bytes = D * es, sh = src.stride(0) * es, st = src.stride(1) * es;
  const char* x = static_cast<const char*>(src.data_ptr());
  char* c = static_cast<char*>(cache.data_ptr());
  at::parallel_for(0, KVH * T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / T, t = item % T;
      std::memcpy(c + (h * S + sl[t]) * bytes, x + h * sh + t * st, bytes);
    }
  });
}

void write_kv_int8(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots, bool rotate,
                   const c10::optional<torch::Tensor>& readback) {
  TORCH_CHECK((src.scalar_type() == torch::kFloat32 || src.scalar_type() == torch::kBFloat16) && src.dim() == 3 &&
                  src.stride(2) == 1,
              "write_kv_int8: src must be float32 or bfloat16 [KVH, T, D] with a contiguous last dim");
  TORCH_CHECK(cache.scalar_type() == torch::kInt8 && cache.is_contiguous() && cache.size(0) == src.size(0) &&
                  cache.size(2) == src.size(2) + RowOf<int8_t>::EXTRA,
              "write_kv_int8: cache must be contiguous int8 [KVH, S, D + 4]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == src.size(1),
              "write_kv_int8: slots must be int64 [T]");
  const int64_t KVH = src.size(0), T = src.size(1), D = src.size(2), S = cache.size(1), W = cache.size(2);
  int8_t* c = cache.data_ptr<int8_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t sh = src.stride(0), st = src.stride(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "write_kv_int8: slot ", sl[t], " out of range");
  if (readback)
    TORCH_CHECK((readback->scalar_type() == torch::kFloat32 || readback->scalar_type() == torch::kBFloat16) &&
                    readback->is_contiguous() && readback->dim() == 3 && readback->size(0) == KVH &&
                    readback->size(1) == T && readback->size(2) == D,
                "write_kv_int8: readback must be a contiguous float32 or bfloat16 [KVH, T, D]");
  auto run = [&](const auto* x, auto* back) {
    at::parallel_for(0, KVH * T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t item = begin; item < end; ++item) {
        const int64_t h = item / T, t = item % T;
        int8_t* row = c + (h * S + sl[t]) * W;
        quantize_kv_row(x + h * sh + t * st, D, row, rotate);
        if constexpr (!std::is_same_v<std::remove_pointer_t<decltype(back)>, void>)
          read_back_row(row, D, back + item * D);
      }
    });
  };
  auto with = [&](const auto* x) {
    if (!readback)
      run(x, static_cast<void*>(nullptr));
    else if (readback->scalar_type() == torch::kFloat32)
      run(x, readback->data_ptr<float>());
    else
      run(x, readback->data_ptr<at::BFloat16>());
  };
  if (src.scalar_type() == torch::kFloat32)
    with(src.data_ptr<float>());
  else
    with(src.data_ptr<at::BFloat16>());
}

// Rows x [N, D] (float32 or bfloat16, contiguous) -> out (the same) = x H * scale: rotate_row, as
// the kernels above rotate keys and queries for int8 pages, for every other path that reads them.
void hadamard(const torch::Tensor& x, torch::Tensor& out, double scale) {
  TORCH_CHECK((x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) && x.dim() == 2 &&
                  x.is_contiguous(),
              "hadamard: x must be a contiguous float32 or bfloat16 [N, D]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes() && out.is_contiguous(),
              "hadamard: out must be laid out as x");
  const int64_t N = x.size(0), D = x.size(1);
  const float s = static_cast<float>(scale);
  auto run = [&](const auto* src, auto* dst) {
    at::parallel_for(0, N, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) rotate_row(src + i * D, dst + i * D, D, s);
    });
  };
  if (x.scalar_type() == torch::kFloat32)
    run(x.data_ptr<float>(), out.data_ptr<float>());
  else
    run(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
}

// What this build runs (torch_bindings.cpp exports these for Python)
bool has_avx512() {  // the one-call decode's AVX-512 items (AVX2 with head dims a multiple of 8: decode_into())
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool decode_into() {  // paged_decode_into runs (AVX-512, or AVX2 + FMA; elsewhere it returns false, doing nothing)
#if defined(ACB_DECODE_INTO)
  return true;
#else
  return false;
#endif
}

bool prefill_f32() {  // prefill_attention takes float32 q/k/v (AVX-512 or AVX2 + FMA; elsewhere it returns false)
#if defined(ACB_PREFILL_F32)
  return true;
#else
  return false;
#endif
}

bool prefill_bf16() {  // prefill_attention takes bfloat16 q/k/v (avx512_bf16)
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace acb::attention
