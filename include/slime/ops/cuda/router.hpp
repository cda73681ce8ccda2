// slime/ops/cuda/router.hpp: host-callable launchers of the CUDA router and
// auxiliary-loss kernels (src/ops/router.cu). Callers normally use
// slime/ops/router.hpp, which validates and dispatches; these functions trust
// their arguments (device pointers on the current device, sizes checked).
//
// One warp per row of [rows, E] with E <= kRouterMaxExperts: a lane holds
// experts lane, lane + 32, ... in registers. Top-k is k rounds of a warp
// argmax (largest probability, ties to the lower id), so k <= 8 costs a few
// shuffles and larger k (up to E) is slower but exact. Expert ids outside
// [0, E) in indices are skipped by the backward and the auxiliary loss (the
// CPU path rejects them). Deterministic run to run: no float atomics; the
// auxiliary loss sums per-expert column sums in fixed row chunks, then the
// chunks in order (two stages); counts use integer atomics (exact).
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

namespace slime::ops::cuda {
inline constexpr int64_t kRouterMaxExperts = 256;
}  // namespace slime::ops::cuda

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct RouterForwardParams {
  const void* logits;  // [tokens, experts] of logits_dtype (f32 or bf16)
  DType logits_dtype;
  int64_t tokens, experts, k;
  bool norm_topk_prob;
  float* probs;      // [tokens, experts]
  int32_t* indices;  // [tokens, k]
  void* weights;     // [tokens, k] of weights_dtype (f32 or bf16)
  DType weights_dtype;
};

struct RouterBackwardParams {
  const float* probs;      // [tokens, experts]
  const int32_t* indices;  // [tokens, k]
  const void* dweights;    // [tokens, k] of dweights_dtype
  DType dweights_dtype;
  int64_t tokens, experts, k;
  bool norm_topk_prob;
  void* dlogits;  // [tokens, experts] of dlogits_dtype; = or += with accumulate
  DType dlogits_dtype;
  bool accumulate;
};

struct RouterAuxParams {
  const float* probs;      // [rows, experts]
  const int32_t* indices;  // [rows, k]
  int64_t rows, experts, k;
  void* workspace;  // router_aux_loss_workspace_bytes(rows, experts) bytes, 16-byte aligned
  std::size_t workspace_bytes;
};

// Bytes of workspace the auxiliary-loss forward and backward need.
std::size_t router_aux_loss_workspace_bytes(int64_t rows, int64_t experts);

void router_forward(const RouterForwardParams& p, StreamHandle stream);
void router_backward(const RouterBackwardParams& p, StreamHandle stream);

// *loss (device f32) = E · Σ_e (count_e / rows) · (Σ_t probs[t, e] / rows); 0 for 0 rows.
void router_aux_loss_forward(const RouterAuxParams& p, float* loss, StreamHandle stream);

// dlogits [rows, experts] (dlogits_dtype; = or += with accumulate) of dloss · loss.
void router_aux_loss_backward(const RouterAuxParams& p, float dloss, void* dlogits, DType dlogits_dtype,
                              bool accumulate, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
