// What acb's native kernels use of PyTorch's C++ API: ATen's tensor, parallel_for and a CPU at::empty.
// <torch/extension.h> brings all of the C++ frontend besides (modules, optimisers, autograd, every
// operator's declaration): compiling that header alone took 31.7 s on this project's 2-core machine
// (torch 2.13, -O3), these with pybind11 9-10 s. Of what is left, pybind11 and torch's tensor casters
// are needed by torch_bindings.cpp alone (it includes them itself), and ATen/ops/empty.h brings
// ATen/Context.h and the dispatcher's headers: without both, a source file's headers compile in under
// half the time (4.9 against 10.6 CPU-seconds, measured side by side on a busy 2-core host).
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>

// The torch:: names the kernels are written with (torch/types.h's, which are ATen's)
namespace torch {
using at::ScalarType;
using at::Tensor;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kBFloat16 = at::kBFloat16;
constexpr auto kHalf = at::kHalf;
constexpr auto kInt8 = at::kChar;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kLong = at::kLong;

// at::empty for the kernels' CPU outputs: the allocation at::empty's dispatcher reaches on the CPU
// (at::detail::empty_cpu), called directly. What the dispatcher adds is the NaN fill of
// torch.use_deterministic_algorithms(True) with fill_uninitialized_memory, for memory the kernels
// write before anyone reads it.
inline at::Tensor empty(at::IntArrayRef size, const at::TensorOptions& options) {
  TORCH_CHECK(options.device().is_cpu(), "acb's CPU kernels take CPU tensors, not ", options.device());
  return at::Tensor(at::detail::empty_cpu(size, options));
}
}  // namespace torch
