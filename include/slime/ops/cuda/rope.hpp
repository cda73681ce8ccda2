// slime/ops/cuda/rope.hpp: host-callable launchers of the CUDA rotary
// position embedding kernels (src/ops/rope.cu). q, k and the outputs are f32
// or bf16 (one dtype), [tokens, heads, head_dim] contiguous.
#pragma once

#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"
#include "slime/ops/cpu/rope.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// The largest head_dim the kernels take (inv_freq travels in the launch
// parameters).
inline constexpr int64_t kRopeMaxHeadDim = 512;

struct RopeArgs {
  const void* q;  // [tokens, q_heads, head_dim]
  void* q_out;    // same shape; may be q
  int64_t q_heads;
  const void* k;  // [tokens, k_heads, head_dim], or null with k_heads = 0
  void* k_out;    // same shape; may be k
  int64_t k_heads;
  const int32_t* positions;  // [tokens, spec.axes()]
  int64_t tokens, head_dim;  // head_dim even, <= kRopeMaxHeadDim
  RopeSpec spec;             // checked against head_dim by the caller
  int sign;  // +1: rotate by +angle (forward), -1: by -angle (backward)
  DType dtype;
};

// Rotates q and k in one launch; angles as in slime/ops/cpu/rope.hpp (the
// host computes each pair's inv_freq in fp32 exactly as the CPU reference
// does, and its axis).
void rope(const RopeArgs& args, StreamHandle stream);

// positions[t] = t - cu_seqlens[s] where s is the last sequence with
// cu_seqlens[s] <= t. cu_seqlens is not validated on the device.
void positions_from_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t tokens, int32_t* positions,
                               StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
