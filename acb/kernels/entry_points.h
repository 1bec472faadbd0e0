// The kernels one module calls in another, by address: the int8 module's decode loop
// (int8_cpu.cpp's DecodeLoop) runs a whole decode-only step's layers in C++ and calls RoPE
// (fused_cpu.cpp) and the one-call decode attention (paged_decode_cpu.cpp) through these
// pointers. Each module hands out its function's address as an int (`_address`), and checks
// here, at compile time, that its function has exactly this type; all three are built against
// the same PyTorch in the same process, so their torch::Tensor is one type.
#pragma once
#include "torch_min.h"

namespace acb_entry {
using RopeFn = void (*)(torch::Tensor, const torch::Tensor&, const torch::Tensor&, int64_t);
using DecodeIntoFn = bool (*)(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, torch::Tensor&,
                              torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                              torch::Tensor&, int64_t, double, double, int64_t, bool);
}  // namespace acb_entry
