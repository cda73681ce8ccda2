// rl/logprob_mismatch.hpp: how far the trainer's logprobs of the sampled
// tokens are from the rollout engine's (the on-policy gap). Zero everywhere
// means the engine and the trainer computed the same bits: true on-policy.
//
//   LogprobMismatch m = rl::logprob_mismatch(trainer_lp, rollout_lp, loss_mask);
//   m.max_abs_diff(), m.mean_abs_diff(), m.mismatch_fraction()
//
// Counted over the loss tokens (loss_mask != 0) only: elsewhere the rollout
// logprob is not defined (prompt tokens). Additive over micro-batches and
// ranks (+=; the max combines by max), so a step's value is exact whatever
// the micro-batching.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "slime/core/tensor.hpp"
#include "slime/rl/metrics.hpp"

namespace slime::rl {

struct LogprobMismatch {
  double tokens = 0;        // loss tokens compared
  double mismatched = 0;    // of them, where the two logprobs differ in any bit
  double abs_diff_sum = 0;  // Σ |trainer − rollout|
  double abs_diff_max = 0;  // max |trainer − rollout| (a NaN on either side: +inf)

  double mean_abs_diff() const { return tokens > 0 ? abs_diff_sum / tokens : 0; }
  double max_abs_diff() const { return abs_diff_max; }
  double mismatch_fraction() const { return tokens > 0 ? mismatched / tokens : 0; }

  LogprobMismatch& operator+=(const LogprobMismatch& o) {
    tokens += o.tokens;
    mismatched += o.mismatched;
    abs_diff_sum += o.abs_diff_sum;
    abs_diff_max = std::max(abs_diff_max, o.abs_diff_max);
    return *this;
  }
};

// Raw form: n tokens of each (T is float or double).
template <class T>
LogprobMismatch logprob_mismatch(const T* trainer_lp, const T* rollout_lp, const uint8_t* loss_mask, int64_t n) {
  LogprobMismatch m;
  for (int64_t t = 0; t < n; ++t) {
    if (!loss_mask[t]) continue;
    const T a = trainer_lp[t], b = rollout_lp[t];
    m.tokens += 1;
    // Bits, not values: -0 and +0 differ in bits and a NaN never equals itself.
    if (std::memcmp(&a, &b, sizeof(T)) != 0) m.mismatched += 1;
    const double d = std::abs(double(a) - double(b));
    const double diff = std::isnan(d) ? INFINITY : d;
    m.abs_diff_sum += diff;
    m.abs_diff_max = std::max(m.abs_diff_max, diff);
  }
  return m;
}

// Tensor form: f32 CPU tensors [T]; loss_mask u8 [T].
inline LogprobMismatch logprob_mismatch(const Tensor& trainer_lp, const Tensor& rollout_lp, const Tensor& loss_mask) {
  constexpr std::string_view fn = "rl::logprob_mismatch";
  detail::require_cpu(fn, trainer_lp);
  SLIME_CHECK(trainer_lp.dim() == 1, fn, ": trainer_lp must be 1-d [tokens], got ", trainer_lp.str());
  const int64_t n = trainer_lp.size(0);
  detail::check_token_tensor(fn, trainer_lp, DType::f32, n, "trainer_lp");
  detail::check_token_tensor(fn, rollout_lp, DType::f32, n, "rollout_lp");
  detail::check_token_tensor(fn, loss_mask, DType::u8, n, "loss_mask");
  return logprob_mismatch(trainer_lp.data<float>(), rollout_lp.data<float>(), loss_mask.data<uint8_t>(), n);
}

}  // namespace slime::rl
