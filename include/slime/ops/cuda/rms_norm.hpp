// slime/ops/cuda/rms_norm.hpp: host-callable launchers of the CUDA RMSNorm
// kernels (src/ops/rms_norm.cu). x, y, dy, dx are f32 or bf16 (one dtype);
// w is f32 or bf16; rstd and dw are f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct RmsNormForwardArgs {
  const void* x;  // [rows, dim]
  const void* w;  // [dim]
  void* y;        // [rows, dim], may be x
  float* rstd;    // [rows]
  int64_t rows, dim;
  float eps;
  DType x_dtype, w_dtype;
};

struct RmsNormBackwardArgs {
  const void* x;      // [rows, dim]
  const void* w;      // [dim]
  const float* rstd;  // [rows]
  const void* dy;     // [rows, dim]
  void* dx;           // [rows, dim], written; may be x or dy
  float* dw;          // [dim], accumulated
  void* workspace;    // rms_norm_backward_workspace_bytes(rows, dim) bytes
  std::size_t workspace_bytes;
  int64_t rows, dim;
  DType x_dtype, w_dtype;
};

// Throws for a dim the kernels do not support (see src/ops/rms_norm.cu).
void rms_norm_forward(const RmsNormForwardArgs& args, StreamHandle stream);

// Bytes of workspace: the per-block dw partial sums, at most
// min(rows, 8 x SMs of the current device) x dim fp32.
std::size_t rms_norm_backward_workspace_bytes(int64_t rows, int64_t dim);

// Deterministic run to run: each block sums dy * n over a fixed set of rows in
// a fixed order into its own partial row of the workspace; a second kernel
// adds the partials in a fixed order into dw. Throws if the workspace is too
// small.
void rms_norm_backward(const RmsNormBackwardArgs& args, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
