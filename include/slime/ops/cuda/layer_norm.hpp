// slime/ops/cuda/layer_norm.hpp: host-callable launchers of the CUDA
// LayerNorm kernels (src/ops/layer_norm.cu). x, y, dy, dx are f32 or bf16
// (one dtype); w and b are f32 or bf16 (one dtype); mean, rstd, dw and db are
// f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct LayerNormForwardArgs {
  const void* x;  // [rows, dim]
  const void* w;  // [dim]
  const void* b;  // [dim]
  void* y;        // [rows, dim], may be x
  float* mean;    // [rows]
  float* rstd;    // [rows]
  int64_t rows, dim;
  float eps;
  DType x_dtype, w_dtype;  // w_dtype is b's too
};

struct LayerNormBackwardArgs {
  const void* x;      // [rows, dim]
  const void* w;      // [dim]
  const float* mean;  // [rows]
  const float* rstd;  // [rows]
  const void* dy;     // [rows, dim]
  void* dx;           // [rows, dim], written; may be x or dy
  float* dw;          // [dim], accumulated
  float* db;          // [dim], accumulated
  void* workspace;    // layer_norm_backward_workspace_bytes(rows, dim) bytes
  std::size_t workspace_bytes;
  int64_t rows, dim;
  DType x_dtype, w_dtype;
};

// Throws for a dim the kernels do not support (see src/ops/layer_norm.cu).
void layer_norm_forward(const LayerNormForwardArgs& args, StreamHandle stream);

// Bytes of workspace: the per-block dw and db partial sums, at most
// 2 x min(rows, 8 x SMs of the current device) x dim fp32.
std::size_t layer_norm_backward_workspace_bytes(int64_t rows, int64_t dim);

// Deterministic run to run: each block sums dy * n and dy over a fixed set of
// rows in a fixed order into its own partial rows of the workspace; a second
// kernel adds the partials in a fixed order into dw and db. Throws if the
// workspace is too small.
void layer_norm_backward(const LayerNormBackwardArgs& args, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
