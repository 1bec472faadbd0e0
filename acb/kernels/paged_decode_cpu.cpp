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
