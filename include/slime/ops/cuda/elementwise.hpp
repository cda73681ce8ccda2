// slime/ops/cuda/elementwise.hpp: host-callable launchers of the CUDA
// residual add, scale and dtype cast kernels (src/ops/elementwise.cu).
// Pointers are device pointers of n elements of the named dtype (f32, bf16 or
// f16); any alignment works (16-byte vectors where all pointers allow them).
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// y = a + b, all of `dtype`; y may alias a or b.
void add(const void* a, const void* b, void* y, DType dtype, int64_t n, StreamHandle stream);

// y = a * s, both of `dtype`; y may alias a.
void scale(const void* a, float s, void* y, DType dtype, int64_t n, StreamHandle stream);

// y = y_dtype(x): exact widening to fp32, one round-to-nearest-even narrowing.
void cast(const void* x, DType x_dtype, void* y, DType y_dtype, int64_t n, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
