// acb's vector types and helpers, one header per ISA (as vLLM's csrc/cpu/cpu_types_x86.hpp and
// llama.cpp's ggml-cpu/simd-mappings.h): what every CPU has (vec_scalar.h: bf16 by bits, the scalar
// Walsh-Hadamard transform), AVX2 + FMA's (vec_avx2.h: 8 float32 lanes) and AVX-512's (vec_avx512.h:
// 16 lanes), each where this build's -march (or avx512_emulated.h) has the ISA. The kernels include
// this header, not the ISA's.
#pragma once
#include "vec_scalar.h"
#if defined(__AVX2__) && defined(__FMA__)
#include "vec_avx2.h"
#endif
#if defined(__AVX512F__)
#include "vec_avx512.h"
#endif
