// slime/ops/cuda/moe_permute.hpp: host-callable launchers of the CUDA MoE
// layout, permute and unpermute kernels (src/ops/moe_permute.cu). Callers
// normally use slime/ops/moe_permute.hpp, which validates and dispatches;
// these functions trust their arguments (device pointers on the current
// device, sizes checked, N = tokens · k rows).
//
// Layout: keys (the expert id, E for an id outside [0, E)) and copy indices
// go through a stable CUB radix sort, so each expert's rows are in copy order
// (the CPU's layout, bit for bit); counts come from integer atomics (exact),
// offsets from a scan. An id outside [0, E) is not counted: its copy goes to
// the tail rows [offsets[E], N) in copy order, so offsets[E] < N flags it.
//
// Permute / unpermute: one block per token, threads over 16-byte vectors of
// the hidden dimension (one element where hidden or a pointer does not allow
// them). Each kernel reads the rows of token t's k copies through
// copy_to_row (a gather for the sums: no atomics, deterministic; slot order
// j = 0..k-1 in fp32 with IEEE adds and multiplies, so the results equal the
// CPU reference bit for bit except the dweights dot products). A copy whose
// row is not in [0, min(offsets[E], N)) is dropped: it adds nothing to dx and
// y, gets dweight 0, and its grouped row (when in [0, N)) is written with
// zeros by the permute and by the unpermute's backward.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

namespace slime::ops::cuda {
// The GPU layout histogram keeps E + 1 counters in shared memory.
inline constexpr int64_t kMoeLayoutMaxExperts = 8192;
}  // namespace slime::ops::cuda

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// Bytes of device workspace moe_build_layout needs for N = tokens · k copies
// and E experts (CUB's temporary storage for the current device included).
std::size_t moe_layout_workspace_bytes(int64_t tokens, int64_t k, int64_t experts);

struct MoeLayoutParams {
  const int32_t* indices;  // [tokens, k]
  int64_t tokens, k, experts;
  int32_t* counts;       // [experts]
  int32_t* offsets;      // [experts + 1]
  int32_t* row_to_copy;  // [N]
  int32_t* copy_to_row;  // [N]
  void* workspace;       // moe_layout_workspace_bytes(...) bytes, 256-byte aligned
  std::size_t workspace_bytes;
};

void moe_build_layout(const MoeLayoutParams& p, StreamHandle stream);

// The layout as the kernels read it.
struct MoeLayoutView {
  const int32_t* offsets;      // [experts + 1]; offsets[experts] bounds the valid rows
  const int32_t* copy_to_row;  // [N]
  int64_t tokens, k, experts;
};

// x_grouped[copy_to_row[t·k + j]] = x[t] (dtype f32 or bf16).
void moe_permute_forward(const MoeLayoutView& l, const void* x, DType dtype, int64_t hidden, void* x_grouped,
                         StreamHandle stream);

// dx[t] (out_dtype: dtype or f32) = Σ_j dx_grouped[copy_to_row[t·k + j]] (+ dx with accumulate).
void moe_permute_backward(const MoeLayoutView& l, const void* dx_grouped, DType dtype, int64_t hidden, void* dx,
                          DType out_dtype, bool accumulate, StreamHandle stream);

// y[t] (out_dtype: dtype or f32) = Σ_j weights[t, j] · y_grouped[copy_to_row[t·k + j]].
void moe_unpermute_forward(const MoeLayoutView& l, const void* y_grouped, DType dtype, const void* weights,
                           DType weights_dtype, int64_t hidden, void* y, DType out_dtype, StreamHandle stream);

// dy_grouped[row of (t, j)] = weights[t, j] · dy[t] (dtype); dweights[t, j]
// (weights_dtype) = ⟨dy[t], y_grouped[row of (t, j)]⟩.
void moe_unpermute_backward(const MoeLayoutView& l, const void* dy, const void* y_grouped, DType dtype,
                            const void* weights, DType weights_dtype, int64_t hidden, void* dy_grouped, void* dweights,
                            StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
