// Decode attention over acb's paged KV cache, on CPU, in one pass per (row, kv head).
//
// Reads each key and value once, straight from its page (no gather copy), and
// serves all query heads of a kv head (GQA) from that single read. Numerically
// it is the same masked softmax as the PyTorch path: scores * scale, optional
// tanh soft-capping, sliding window (key pos > query pos - window), then the
// weighted sum of values.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>


#if defined(__AVX512F__)
#include <immintrin.h>

// exp on 16 lanes: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial
// (relative error ~2e-7, like expf). Inputs here are scores minus their max: <= 0.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Pages are scattered, so hardware prefetch stops at each one: fetch a key's (or value's)
// row a few positions ahead.
template <int D>
static inline void prefetch_row(const float* base, const int64_t* pages, int64_t page_size, int64_t pos) {
  const char* row = reinterpret_cast<const char*>(base + (pages[pos / page_size] * page_size + pos % page_size) * D);
  for (int c = 0; c < D * 4; c += 64) _mm_prefetch(row + c, _MM_HINT_T0);
}

// One (row, kv head): G query heads of DC*16 dims over n keys starting at position
// `first`. Queries and the G x D accumulator live in registers (G, DC compile-time).
template <int G, int DC>
static void decode_item_avx512(const float* qrow, const float* kbase, const float* vbase, const int64_t* pages,
                               int64_t page_size, int64_t first, int64_t n, float scale, float* scores,
                               float* out) {
  constexpr int D = DC * 16;
  __m512 q[G * DC];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < DC; ++c) q[g * DC + c] = _mm512_loadu_ps(qrow + g * D + c * 16);
  constexpr int64_t AHEAD = 8;  // positions to prefetch ahead
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    const float* k = kbase + (pages[pos / page_size] * page_size + pos % page_size) * D;
    if (i + AHEAD < n) prefetch_row<D>(kbase, pages, page_size, pos + AHEAD);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(q[g * DC], _mm512_loadu_ps(k));
      for (int c = 1; c < DC; ++c) acc = _mm512_fmadd_ps(q[g * DC + c], _mm512_loadu_ps(k + c * 16), acc);
      scores[g * n + i] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
  float denom[G];
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
  __m512 acc[G * DC];
  for (int j = 0; j < G * DC; ++j) acc[j] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    const float* v = vbase + (pages[pos / page_size] * page_size + pos % page_size) * D;
    if (i + AHEAD < n) prefetch_row<D>(vbase, pages, page_size, pos + AHEAD);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * n + i]);
      for (int c = 0; c < DC; ++c) acc[g * DC + c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(v + c * 16), acc[g * DC + c]);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / denom[g]);
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(acc[g * DC + c], inv));
  }
}

using ItemFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t, float,
                        float*, float*);

template <int DC>
static ItemFn pick_g(int64_t G) {
  switch (G) {
    case 1: return decode_item_avx512<1, DC>;
    case 2: return decode_item_avx512<2, DC>;
    case 3: return decode_item_avx512<3, DC>;
    case 4: return decode_item_avx512<4, DC>;
    case 5: return decode_item_avx512<5, DC>;
    case 6: return decode_item_avx512<6, DC>;
    case 7: return decode_item_avx512<7, DC>;
    case 8: return decode_item_avx512<8, DC>;
    default: return nullptr;
  }
}

static ItemFn pick_item(int64_t G, int64_t D) {
  switch (D) {
    case 64: return pick_g<4>(G);
    case 128: return pick_g<8>(G);
    case 256: return pick_g<16>(G);
    default: return nullptr;
  }
}
#endif

void paged_decode(const torch::Tensor& q,        // [B, H, D] float32, contiguous
                  const torch::Tensor& k_cache,  // [KVH, S, D] float32
                  const torch::Tensor& v_cache,  // [KVH, S, D] float32
                  const torch::Tensor& pages,    // [B, P] int64
                  const torch::Tensor& lengths,  // [B] int64: context length, query at length - 1
                  torch::Tensor& out,            // [B, H, D] float32
                  int64_t page_size, double scale, double softcap, int64_t window) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(0), S = k_cache.size(1), P = pages.size(1);
  const int64_t G = H / KVH;
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
#if defined(__AVX512F__)
  // The vectorised path: no soft-capping (Gemma 2 takes the portable loop below).
  const ItemFn fast = fcap > 0.f ? nullptr : pick_item(G, D);
  if (fast != nullptr) {
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t b = item / KVH, kh = item % KVH;
        const int64_t L = len[b];
        const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
        const int64_t n = L - first;
        scores.resize(G * n);
        fast(qp + (b * H + kh * G) * D, kp + kh * S * D, vp + kh * S * D, pg + b * P, page_size, first, n, fscale,
             scores.data(), op + (b * H + kh * G) * D);
      }
    });
    return;
  }
#endif

  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / KVH, kh = item % KVH;
      const int64_t L = len[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first;
      scores.assign(G * n, 0.f);
      const float* qrow = qp + (b * H + kh * G) * D;
      const float* kbase = kp + kh * S * D;
      const float* vbase = vp + kh * S * D;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t pos = first + i;
        const int64_t slot = pg[b * P + pos / page_size] * page_size + pos % page_size;
        const float* k = kbase + slot * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qrow + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          float s = dot * fscale;
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
        const float* v = vbase + slot * D;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * n + i];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * v[d];
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_decode", &paged_decode, "paged decode attention (CPU)"); }
