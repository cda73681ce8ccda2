// slime/ops/cuda/gelu.hpp: host-callable launchers of the CUDA GELU kernels
// (src/ops/gelu.cu). Pointers are device pointers of n contiguous elements of
// f32 or bf16 (one dtype); any alignment works (16-byte vectors where all
// pointers allow them).
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"
#include "slime/ops/cpu/gelu.hpp"  // GeluApproximation

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct GeluForwardArgs {
  const void* x;
  void* y;  // may be x
  int64_t n;
  GeluApproximation approx;
  DType dtype;
};

struct GeluBackwardArgs {
  const void* x;
  const void* dy;
  void* dx;  // written; may be x or dy
  int64_t n;
  GeluApproximation approx;
  DType dtype;
};

// y = gelu(x).
void gelu_forward(const GeluForwardArgs& args, StreamHandle stream);

// dx = dy * gelu'(x).
void gelu_backward(const GeluBackwardArgs& args, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
