// slime/ops/batch_invariant.hpp: the batch-invariant numerics mode (issue 20:
// true on-policy on CUDA).
//
// In this mode every op that the rollout engine and the trainer share
// computes each output row with a reduction order that depends on that row's
// inputs only, never on how many rows the call has or where the row sits in
// the batch. A decode step (a handful of rows), a prefill and the trainer's
// packed micro-batch then give the same bits for the same token, so the
// engine's logprob of a sampled token equals the trainer's recompute.
//
// What the mode changes (CUDA only; the CPU reference is batch-invariant by
// construction, and the mode changes nothing there):
//   - ops::cuda::gemm of the forward form C = alpha · A · Bᵀ (Linear's
//     forward, the LM head's logits chunks) runs slime's own tiled GEMM
//     (ops::cuda::grouped_gemm with one group) instead of cuBLAS, whose
//     kernel choice depends on M. Each output element is summed over K in
//     one fixed order whatever M is (64-wide k-steps in turn into one fp32
//     accumulator); on Hopper a call of few rows (a decode step) takes a
//     narrower or lower tile (n128, n64, or 64 rows by 64, 32 or 16) so that
//     its weight rows spread over the SMs, which moves the sums between CTAs
//     without changing them. (Opt-in, SLIME_GEMM_K_CHUNKS=1: K summed in
//     chunks of 256, each in a fresh accumulator and added in order; a
//     64-row tile runs its chunks side by side on four warpgroups, and more
//     rows on few n64 tiles split K over CTAs; same rule, other bits.) The backward GEMMs stay on cuBLAS (they feed no
//     logprob).
//   - the grouped GEMM of the MoE experts never takes the cuBLAS backend
//     (its host offsets are ignored): the kernels' tiles depend on the
//     feature sizes only, not on the group sizes.
//   - the attention backward sums dq over key blocks in a fixed order
//     (AttentionOptions::deterministic), so that a training step is also
//     bitwise run to run (issue 20's determinism run).
// Attention, RMSNorm, RoPE, SwiGLU, the router and the MoE combine are
// batch-invariant as they are: one reduction per row in a fixed order, no
// split over keys, kernels chosen without looking at the batch. (A decode
// call's attention packs a kv group's query heads into one tile,
// AttentionOptions::pack_gqa: each row's sum is the training forward's, bit
// for bit; test_attention_gpu checks it.)
//
// Process-wide, like a cuBLAS math mode. The environment variable
// SLIME_BATCH_INVARIANT=1 turns it on at start-up (0, empty or unset: off);
// set_batch_invariant changes it (from any thread; calls already queued on a
// stream keep the mode they were issued under). The cost is measured by
// bench_fsdp's and the rollout benchmark's batch-invariant rows.
#pragma once

#include <atomic>
#include <cstdlib>
#include <string_view>

#include "slime/core/error.hpp"

namespace slime::ops {

namespace detail {
inline bool batch_invariant_from_env() {
  const char* v = std::getenv("SLIME_BATCH_INVARIANT");
  if (v == nullptr) return false;
  const std::string_view s(v);
  if (s.empty() || s == "0") return false;
  SLIME_CHECK(s == "1", "SLIME_BATCH_INVARIANT must be 0 or 1, got '", s, "'");
  return true;
}
inline std::atomic<bool>& batch_invariant_flag() {
  static std::atomic<bool> flag{batch_invariant_from_env()};
  return flag;
}
}  // namespace detail

// Whether the batch-invariant mode is on.
inline bool batch_invariant() { return detail::batch_invariant_flag().load(std::memory_order_relaxed); }

// Turns the mode on or off; returns the previous setting.
inline bool set_batch_invariant(bool on) {
  return detail::batch_invariant_flag().exchange(on, std::memory_order_relaxed);
}

// Sets the mode for a scope and restores the previous setting on exit.
class BatchInvariantScope {
 public:
  explicit BatchInvariantScope(bool on = true) : previous_(set_batch_invariant(on)) {}
  ~BatchInvariantScope() { set_batch_invariant(previous_); }
  BatchInvariantScope(const BatchInvariantScope&) = delete;
  BatchInvariantScope& operator=(const BatchInvariantScope&) = delete;

 private:
  bool previous_;
};

}  // namespace slime::ops
