// What acb's native kernels use of PyTorch's C++ API: ATen's tensor, at::empty and parallel_for.
// <torch/extension.h> brings all of the C++ frontend besides (modules, optimisers, autograd, every
// operator's declaration): compiling that header alone took 31.7 s on this project's 2-core machine
// (torch 2.13, -O3), these with pybind11 9-10 s. pybind11 and torch's tensor casters are more than
// half of that (8.6 of 19.9 CPU-seconds without them, measured on a busy 2-core host), and only
// torch_bindings.cpp needs them: it includes <torch/csrc/utils/pybind.h> itself.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

// The torch:: names the kernels are written with (torch/types.h's, which are ATen's)
namespace torch {
using at::empty;
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
}  // namespace torch
