// What acb's native kernels use of PyTorch's C++ API: ATen's tensor, at::empty and parallel_for,
// and pybind11 with torch's tensor casters. <torch/extension.h> brings all of the C++ frontend
// besides (modules, optimisers, autograd, every operator's declaration): compiling that header
// alone took 31.7 s on this project's 2-core machine (torch 2.13, -O3) and these 9-10 s, so a
// kernel's first build (once per machine) is 11-18 s shorter each: the fused kernels 36 -> 14 s,
// int8 32 -> 16 s, decode attention 60 -> ~45 s.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

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
