// Fused elementwise kernels for acb's CPU forward of Llama-family decoders
// (acb/model/fused.py): one pass over memory instead of PyTorch's chain of small ops.
//
// Built without -ffast-math and with -ffp-contract=off (acb/kernels/cpu.py's SOURCES): each value is computed by
// the same float operations, in the same order, as transformers' modules (RoPE is
// bit-identical; RMSNorm differs from PyTorch's only in the order its sum of
// squares is accumulated).
//
// bfloat16 tensors are computed in float32 and rounded to bfloat16 (round to nearest
// even, as PyTorch rounds) at exactly the points where transformers' modules round
// when the model is bf16: RMSNorm rounds the normalised row, then the product with its
// weight; RoPE rounds each of its two products and their sum.
#include "ops.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#include "vec.h"

namespace acb::fused {
namespace {

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, name,
              " must be float32 or bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be a 2-D tensor with contiguous rows");
}

// bfloat16 <-> float32 by bits (vec_scalar.h; vectorises under omp simd, unlike
// c10::BFloat16's class); widen(float) is the identity, so one template reads either dtype
inline float widen(float v) { return v; }
using acb_bf16::to_bf16;
using acb_bf16::widen;
// the value as the tensor's dtype holds it: identity for float32, rounded for bfloat16
template <typename T> inline float held(float f);
template <> inline float held<float>(float f) { return f; }
template <> inline float held<uint16_t>(float f) { return widen(to_bf16(f)); }
inline void store(float* p, float v) { *p = v; }
inline void store(uint16_t* p, float v) { *p = to_bf16(v); }

template <typename T>
T* ptr(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

}  // namespace

// RMSNorm over rows. x: [T, D] (rows may be strided), float32 or bfloat16.
// GEMMA = false, transformers' LlamaRMSNorm: out[t] = w * held(x[t] * rsqrt(mean(x[t]^2) + eps)),
//   the normalised row rounded to x's dtype before the product; w: [D] of x's dtype.
// GEMMA = true, transformers' Gemma2/3RMSNorm: out[t] = (x[t] * rsqrt(...)) * w, all in float32,
//   rounded once; w: [D] float32 (the module's 1 + weight).
template <typename T, bool GEMMA>
static void rms_norm_t(const torch::Tensor& x, const torch::Tensor& w, double eps, torch::Tensor& out) {
  using W = std::conditional_t<GEMMA, float, T>;
  const int64_t T_ = x.size(0), D = x.size(1), xs = x.stride(0);
  const T* xp = ptr<T>(x);
  const W* wp = ptr<W>(w);
  T* op = ptr<T>(out);
  const float feps = static_cast<float>(eps);
  const float fd = static_cast<float>(D);
  at::parallel_for(0, T_, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* xr = xp + t * xs;
      T* orow = op + t * D;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < D; ++i) ss += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.f / std::sqrt(ss / fd + feps);
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) {
        if constexpr (GEMMA)
          store(orow + i, (widen(xr[i]) * inv) * wp[i]);
        else
          store(orow + i, widen(wp[i]) * held<T>(widen(xr[i]) * inv));
      }
    }
  });
}

template <bool GEMMA>
static torch::Tensor rms_norm_any(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "x");
  const auto wtype = GEMMA ? torch::kFloat32 : x.scalar_type();
  TORCH_CHECK(w.is_contiguous() && w.numel() == x.size(1) && w.scalar_type() == wtype,
              GEMMA ? "w must be a contiguous float32 [D]" : "w must be a contiguous [D] of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    rms_norm_t<float, GEMMA>(x, w, eps, out);
  else
    rms_norm_t<uint16_t, GEMMA>(x, w, eps, out);
  return out;
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return rms_norm_any<false>(x, w, eps);
}

torch::Tensor rms_norm_f32w(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return rms_norm_any<true>(x, w, eps);
}

// Rotary embedding in place, transformers' rotate_half convention:
// x1' = x1*cos1 - x2*sin1, x2' = x2*cos2 + x1*sin2 over the two halves of each head.
// x: [T, heads * d] (rows may be strided, e.g. a column slice of a fused projection);
// cos, sin: [T, d] contiguous.
template <typename T>
static void rope_t(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t d) {
  const int64_t T_ = x.size(0), heads = x.size(1) / d, xs = x.stride(0), h2 = d / 2;
  T* xp = ptr<T>(x);
  const T* cp = ptr<T>(cos);
  const T* sp = ptr<T>(sin);
  at::parallel_for(0, T_ * heads, std::max<int64_t>(1, 16384 / d), [&](int64_t b, int64_t e) {
    for (int64_t item = b; item < e; ++item) {
      const int64_t t = item / heads, h = item % heads;
      T* v = xp + t * xs + h * d;
      const T* c = cp + t * d;
      const T* s = sp + t * d;
#pragma omp simd
      for (int64_t i = 0; i < h2; ++i) {
        const float a = widen(v[i]), bb = widen(v[i + h2]);
        store(v + i, held<T>(a * widen(c[i])) - held<T>(bb * widen(s[i])));
        store(v + i + h2, held<T>(bb * widen(c[i + h2])) + held<T>(a * widen(s[i + h2])));
      }
    }
  });
}

void rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t d) {
  check_rows(x, "x");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == d &&
                  cos.size(0) == x.size(0) && sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "cos/sin must be contiguous [T, d] of x's dtype");
  TORCH_CHECK(d % 2 == 0 && x.size(1) % d == 0, "row width must be a multiple of an even head dim");
  if (x.scalar_type() == torch::kFloat32)
    rope_t<float>(x, cos, sin, d);
  else
    rope_t<uint16_t>(x, cos, sin, d);
}


// The MLP's gated activation over one GEMM's output: gu [T, 2N] holds the gate projection's
// N columns, then the up projection's (rows may be strided); out[t] = act(g[t]) * u[t],
// computed in float32 from the values as gu's dtype holds them and rounded once to it
// (float32 or bfloat16). act 0: SiLU, g / (1 + exp(-g)); 1: GELU-tanh. The exp is a
// degree-6 polynomial (relative error ~2e-7, vec_avx512.h), as oneDNN's fused
// epilogue approximates it: not bit-identical to PyTorch's, well inside float32's noise.
template <typename T>
static void glu_t(const torch::Tensor& gu, int64_t act, torch::Tensor& out) {
  const int64_t T_ = gu.size(0), N = gu.size(1) / 2, gs = gu.stride(0);
  const T* src = ptr<T>(gu);
  T* dst = ptr<T>(out);
  // ~32k values a chunk: a decode step's few rows stay on one thread (waking the pool costs more)
  at::parallel_for(0, T_, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, N)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const T* g = src + t * gs;
      const T* u = g + N;
      T* m = dst + t * N;
      int64_t n = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
      for (; n < N; n += 16) {
        const __mmask16 k = N - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (N - n)) - 1);
        const __m512 gv = acb_vec::load16(g + n, k), uv = acb_vec::load16(u + n, k);  // bf16: widened
        const __m512 mv = _mm512_mul_ps(acb_vec::act512(gv, act), uv);
        if constexpr (std::is_same_v<T, float>)
          acb_vec::store16(m + n, k, mv);
        else  // to_bf16 on 16 lanes: round to nearest even, NaN stays NaN
          _mm256_mask_storeu_epi16(m + n, k, acb_vec::round16_nan(mv));
      }
#endif
      for (; n < N; ++n) {
        const float gf = widen(g[n]), uf = widen(u[n]);
        const float a = act == 0 ? gf / (1.f + std::exp(-gf))
                                 : 0.5f * gf * (1.f + std::tanh(0.7978845608028654f * (gf + 0.044715f * gf * gf * gf)));
        store(m + n, a * uf);
      }
    }
  });
}

torch::Tensor glu(const torch::Tensor& gu, int64_t act) {
  check_rows(gu, "gu");
  TORCH_CHECK(gu.size(1) % 2 == 0, "gu must hold the gate's and the up projection's columns (an even width)");
  TORCH_CHECK(act == 0 || act == 1, "act must be 0 (SiLU) or 1 (GELU-tanh)");
  auto out = torch::empty({gu.size(0), gu.size(1) / 2}, gu.options());
  if (gu.scalar_type() == torch::kFloat32)
    glu_t<float>(gu, act, out);
  else
    glu_t<uint16_t>(gu, act, out);
  return out;
}

// torch.argmax(x, dim=-1) of float32 rows x [B, V] (rows may be strided), as int64 [B]: the
// first index of each row's maximum, or of its first NaN (PyTorch takes NaN as the largest).
// Two passes a row: its maximum (8 lanes, NaNs flagged apart: max_ps drops them), then the
// first index holding it. PyTorch's reduction ran ~8x slower over 48 rows of a 49,152-token vocabulary.
static int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0;
  float m = -INFINITY;
  bool nan = false;
#ifdef __AVX2__
  __m256 vm = _mm256_set1_ps(-INFINITY), vn = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vn = _mm256_or_ps(vn, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    vm = _mm256_max_ps(vm, v);
  }
  nan = _mm256_movemask_ps(vn) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vm);
  for (float l : lanes) m = l > m ? l : m;
#endif
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    m = x[i] > m ? x[i] : m;
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  }
  i = 0;
#ifdef __AVX2__
  const __m256 vmax = _mm256_set1_ps(m);
  for (; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), vmax, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // (n == 0: PyTorch refuses an empty row before it gets here)
}

torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "x must be a 2-D tensor with contiguous, non-empty rows");
  const int64_t B = x.size(0), V = x.size(1), xs = x.stride(0);
  auto out = torch::empty({B}, x.options().dtype(torch::kInt64));
  const float* src = ptr<float>(x);
  int64_t* dst = ptr<int64_t>(out);
  at::parallel_for(0, B, std::max<int64_t>(1, 32768 / V), [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) dst[r] = argmax_row(src + r * xs, V);
  });
  return out;
}

}  // namespace acb::fused
