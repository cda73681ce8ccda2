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
// chunks in order (two stages); counts use integer atomics (exact). The
// loss and its backward read the statistics through one code path whether
// they come from the workspace (router_aux_loss_forward / _backward) or from
// router_aux_stats's flat f32 vector (the _from_stats calls), so both give
// the same bits for the same rows.
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
  bool replay = false;  // indices are read (routing replay), not written
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

// The backward of the auxiliary loss from statistics (router_aux_stats's
// [2E + 1] layout, see slime/ops/router.hpp) of a set of rows that includes
// these `rows`.
struct RouterAuxFromStatsParams {
  const float* probs;  // [rows, experts]
  int64_t rows, experts;
  const float* stats;  // [2 experts + 1]: counts, prob sums, N
  float dloss;
  void* dlogits;  // [rows, experts] of dlogits_dtype; = or += with accumulate
  DType dlogits_dtype;
  bool accumulate;
};

// Bytes of workspace the auxiliary-loss forward and backward (and router_aux_stats) need.
std::size_t router_aux_loss_workspace_bytes(int64_t rows, int64_t experts);

void router_forward(const RouterForwardParams& p, StreamHandle stream);
void router_backward(const RouterBackwardParams& p, StreamHandle stream);

// *loss (device f32) = E · Σ_e (count_e / rows) · (Σ_t probs[t, e] / rows); 0 for 0 rows.
void router_aux_loss_forward(const RouterAuxParams& p, float* loss, StreamHandle stream);

// dlogits [rows, experts] (dlogits_dtype; = or += with accumulate) of dloss · loss.
void router_aux_loss_backward(const RouterAuxParams& p, float dloss, void* dlogits, DType dlogits_dtype,
                              bool accumulate, StreamHandle stream);

// stats [2E + 1] (device f32; = or += with accumulate) = the counts, prob
// sums and row count of p's rows; the prob sums are the forward's (same
// chunks, same order).
void router_aux_stats(const RouterAuxParams& p, float* stats, bool accumulate, StreamHandle stream);

// *loss (device f32) = the loss of the rows stats [2E + 1] describes; 0 for N = 0.
void router_aux_loss_from_stats(const float* stats, int64_t experts, float* loss, StreamHandle stream);

void router_aux_loss_backward_from_stats(const RouterAuxFromStatsParams& p, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
