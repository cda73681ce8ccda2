// slime/ops/cuda/swiglu.hpp: host-callable launchers of the CUDA SwiGLU
// kernels (src/ops/swiglu.cu). Every operand is a [rows, cols] matrix of f32
// or bf16 (one dtype) with its own leading dimension (elements between rows),
// so the gate and up halves of a fused [rows, 2 * cols] projection output can
// be read in place.
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct SwigluForwardArgs {
  const void* gate;
  int64_t ld_gate;
  const void* up;
  int64_t ld_up;
  void* h;  // may be gate or up (same elements)
  int64_t ld_h;
  int64_t rows, cols;
  DType dtype;
};

struct SwigluBackwardArgs {
  const void* gate;
  int64_t ld_gate;
  const void* up;
  int64_t ld_up;
  const void* dh;
  int64_t ld_dh;
  void* dgate;  // may be gate (same elements)
  int64_t ld_dgate;
  void* dup;  // may be up (same elements)
  int64_t ld_dup;
  int64_t rows, cols;
  DType dtype;
};

// h = silu(gate) * up.
void swiglu_forward(const SwigluForwardArgs& args, StreamHandle stream);

// dgate = dh * up * silu'(gate), dup = dh * silu(gate).
void swiglu_backward(const SwigluBackwardArgs& args, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
