// slime/rl/cuda/policy_loss.hpp: host-callable CUDA launcher of the fused
// policy loss (defined in src/rl/policy_loss.cu). Callers normally use
// slime/rl/policy_loss.hpp, which validates and dispatches; this trusts its
// Params.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"

namespace slime::rl {
// Defined in slime/rl/policy_loss.hpp and slime/rl/kl.hpp.
enum class PolicyLossKind;
enum class Aggregation;
enum class KlEstimator;
}  // namespace slime::rl

#if SLIME_HAS_CUDA
namespace slime::rl::cuda {

// Number of metrics the kernel reduces, in PolicyLossMetrics' member order
// (loss, pg_loss, entropy, kl, ppo_kl, clip_fraction, dual_clip_fraction).
inline constexpr int kPolicyLossMetrics = 7;

// Device pointers on the current device; maybe_ pointers may be null.
// cu_seqlens is trusted on the host: the kernel traps when cu_seqlens[0] != 0,
// a sequence ends before it starts, or the last offset is not `tokens`.
struct PolicyLossParams {
  PolicyLossKind kind;
  Aggregation aggregation;
  KlEstimator kl_estimator;
  bool unbiased_kl;
  float eps_clip, eps_clip_high, eps_clip_c, entropy_coef, kl_coef;
  int64_t norm_tokens, norm_sequences;  // loss_denominators(): N_tokens, N_seqs (> 0 where divided by)
  const float* lp;                      // [tokens]
  const float* old_lp;                  // [tokens]
  const float* advantages;              // [tokens]
  const uint8_t* loss_mask;             // [tokens]
  const int32_t* cu_seqlens;            // [num_seqs + 1]
  int64_t num_seqs, tokens;
  const float* maybe_ref_lp;      // [tokens], needed when kl_coef != 0
  const float* maybe_entropy;     // [tokens], needed when entropy_coef != 0
  const float* maybe_is_weights;  // [tokens]
  const uint8_t* maybe_keep;      // [tokens]
  float* grad_lp;                 // [tokens], written
  float* maybe_grad_entropy;      // [tokens], written
  double* metrics;                // [kPolicyLossMetrics], written
  void* workspace;                // 16-byte aligned, >= policy_loss_workspace_bytes(num_seqs)
  std::size_t workspace_bytes;
};

// Per-sequence metric partials, reduced in a fixed order by a second kernel.
std::size_t policy_loss_workspace_bytes(int64_t num_seqs);

void policy_loss(const PolicyLossParams& params, StreamHandle stream);

}  // namespace slime::rl::cuda
#endif
