// Fused elementwise kernels for acb's CPU forward of Llama-family decoders
// (acb/fused.py): one pass over memory instead of PyTorch's chain of small ops.
//
// Built without -ffast-math and with -ffp-contract=off: each value is computed by
// the same float operations, in the same order, as transformers' modules (RoPE is
// bit-identical; RMSNorm differs from PyTorch's only in the order its sum of
// squares is accumulated).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, name, " must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be a 2-D tensor with contiguous rows");
}

}  // namespace

// out[t] = w * (x[t] * rsqrt(mean(x[t]^2) + eps)), row by row (transformers' LlamaRMSNorm
// for float32). x: [T, D] (rows may be strided), w: [D].
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == torch::kFloat32,
              "w must be a contiguous float32 [D]");
  const int64_t T = x.size(0), D = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  const float fd = static_cast<float>(D);
  at::parallel_for(0, T, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* xr = xp + t * xs;
      float* orow = op + t * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / fd + feps);
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) orow[i] = wp[i] * (xr[i] * inv);
    }
  });
  return out;
}

// Rotary embedding in place, transformers' rotate_half convention:
// x1' = x1*cos1 - x2*sin1, x2' = x2*cos2 + x1*sin2 over the two halves of each head.
// x: [T, heads * d] (rows may be strided, e.g. a column slice of a fused projection);
// cos, sin: [T, d] contiguous.
void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t d) {
  check_rows(x, "x");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d &&
                  cos.size(0) == x.size(0) && sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32,
              "cos/sin must be contiguous float32 [T, d]");
  TORCH_CHECK(d % 2 == 0 && x.size(1) % d == 0, "row width must be a multiple of an even head dim");
  const int64_t T = x.size(0), heads = x.size(1) / d, xs = x.stride(0), h2 = d / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  at::parallel_for(0, T * heads, std::max<int64_t>(1, 16384 / d), [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / heads, h = item % heads;
      float* v = xp + t * xs + h * d;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
#pragma omp simd
      for (int64_t i = 0; i < h2; ++i) {
        const float a = v[i], bb = v[i + h2];
        v[i] = a * c[i] - bb * s[i];
        v[i + h2] = bb * c[i + h2] + a * s[i + h2];
      }
    }
  });
}

// The GIL is released while a kernel runs: the event loop's thread keeps serving.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over rows (float32)", py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, "rotary embedding in place (float32)", py::call_guard<py::gil_scoped_release>());
}
