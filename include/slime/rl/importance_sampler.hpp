// slime/rl/importance_sampler.hpp: importance weights for the mismatch between
// the engine that sampled (rollout logprobs) and the trainer (its old
// logprobs): TIS and MIS, as policy types of ImportanceSampler<Policy>,
// configured at run time by value. CPU reference on raw pointers (float or
// double) and f32 CPU Tensors; the weights are constants for the loss (no
// gradient flows through them).
//
//   ImportanceSampler<Tis> tis({.low = 0, .high = 2});
//   ImportanceSampler<Mis<Geometric, Mask>> mis({.low = 0.5, .high = 2, .veto = 1e-4});
//
// Per response token (loss_mask = 1), d_t = old_t − rollout_t:
//   Tis: w = clamp(exp(d_t), low, high)
//   Mis<Level, Mode>: ρ = exp(clamp(ℓ, −20, 20)) with the pooled log-ratio
//     ℓ = d_t (Token), Σ_s d (Sequence) or mean_s d (Geometric) (the ±20
//     bound is slime's SAFETY_BOUND against overflow), then Truncate:
//     w = min(ρ, high); Clip: w = clamp(ρ, low, high); Mask: w = ρ inside
//     [low, high], else the token is rejected. Veto (> 0): a sequence with any
//     exp(d_t) < veto is rejected whole.
//   Mis::renormalize, w ← w / mean over the call (call it on the whole step
//     batch, before micro-batching, for split invariance):
//     batch: THUDM/slime's --tis-batch-normalize (mis.py): the mean of the
//       bounded weights before rejection over every loss token (Token), or
//       the mean over every sequence of the call, empty ones included, of
//       its mean weight (Sequence; Geometric likewise, where slime raises);
//       no division when the mean is ≤ 1e-8;
//     kept (ours): the mean over the kept tokens, so the weights that enter
//       the loss average exactly 1 (rejected weights, which can be far
//       outside the bounds under Mask, do not move the scale).
//     slime applies it per micro-batch; ours applies to whatever the call
//     covers.
// Rejected tokens get w = 0 and keep = 0: they leave the loss's numerator only
// (policy_loss keeps the original mask count in the denominator).
// Outputs [tokens] are written (=); outside the mask w = 0, keep = 0.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "slime/rl/kl.hpp"
#include "slime/rl/metrics.hpp"

namespace slime::rl {

// MIS levels: how the log-ratio is pooled before exponentiation.
struct Token {};
struct Sequence {};
struct Geometric {};
// MIS modes: what happens outside [low, high].
struct Truncate {};
struct Clip {};
struct Mask {};

// slime's SAFETY_BOUND: |pooled log-ratio| before exp.
inline constexpr double mis_log_ratio_bound = 20.0;
// Mis::renormalize (see the top of the file).
enum class MisRenormalize { off, batch, kept };

struct Tis {
  double low = 0;
  double high = 2;
};

template <class Level, class Mode>
struct Mis {
  static_assert(std::is_same_v<Level, Token> || std::is_same_v<Level, Sequence> || std::is_same_v<Level, Geometric>,
                "Mis<Level, Mode>: Level must be Token, Sequence or Geometric");
  static_assert(std::is_same_v<Mode, Truncate> || std::is_same_v<Mode, Clip> || std::is_same_v<Mode, Mask>,
                "Mis<Level, Mode>: Mode must be Truncate, Clip or Mask");
  using level = Level;
  using mode = Mode;
  double low = 0.5;
  double high = 2;
  double veto = 0;  // reject a sequence with a token ratio below it; 0: off
  MisRenormalize renormalize = MisRenormalize::off;
};

// Additive sums (combine micro-batches with +=); the accessors give the means.
struct ImportanceMetrics {
  double tokens = 0;          // loss-mask tokens
  double kept = 0;            // not rejected
  double rejected = 0;        // by the mask mode or the veto
  double clipped = 0;         // weight changed or rejected by the bounds
  double weight_sum = 0;      // over kept tokens
  double abs_dev_sum = 0;     // Σ |w − 1| over kept tokens
  double trainer_lp_sum = 0;  // Σ old
  double rollout_lp_sum = 0;  // Σ rollout
  double k3_sum = 0;          // Σ k3(trainer vs rollout), samples from the rollout

  double mean_weight() const { return kept > 0 ? weight_sum / kept : 0; }
  double clip_fraction() const { return tokens > 0 ? clipped / tokens : 0; }
  double rejected_fraction() const { return tokens > 0 ? rejected / tokens : 0; }
  double mean_abs_deviation() const { return kept > 0 ? abs_dev_sum / kept : 0; }
  double trainer_perplexity() const { return std::exp(tokens > 0 ? -trainer_lp_sum / tokens : 0); }
  double rollout_perplexity() const { return std::exp(tokens > 0 ? -rollout_lp_sum / tokens : 0); }
  double kl_k3() const { return tokens > 0 ? k3_sum / tokens : 0; }

  ImportanceMetrics& operator+=(const ImportanceMetrics& o) {
    tokens += o.tokens;
    kept += o.kept;
    rejected += o.rejected;
    clipped += o.clipped;
    weight_sum += o.weight_sum;
    abs_dev_sum += o.abs_dev_sum;
    trainer_lp_sum += o.trainer_lp_sum;
    rollout_lp_sum += o.rollout_lp_sum;
    k3_sum += o.k3_sum;
    return *this;
  }
};

struct ImportanceResult {
  Tensor weights;    // f32 [T]
  Tensor keep_mask;  // u8 [T]
  ImportanceMetrics metrics;
};

template <class Policy>
class ImportanceSampler {
 public:
  explicit ImportanceSampler(Policy policy = {}) : policy_(policy) {
    SLIME_CHECK(policy_.low >= 0, "ImportanceSampler: low must be >= 0, got ", policy_.low);
    SLIME_CHECK(policy_.low <= policy_.high, "ImportanceSampler: bounds low > high: [", policy_.low, ", ", policy_.high,
                "]");
    if constexpr (!std::is_same_v<Policy, Tis>) {
      SLIME_CHECK(policy_.veto >= 0, "ImportanceSampler: veto must be >= 0 (0: off), got ", policy_.veto);
    }
  }

  const Policy& policy() const { return policy_; }

  template <class T>
  ImportanceMetrics compute(const T* old_lp, const T* rollout_lp, const uint8_t* loss_mask, const int32_t* cu_seqlens,
                            int64_t num_seqs, int64_t tokens, T* weights, uint8_t* keep) const {
    detail::check_cu_seqlens("rl::ImportanceSampler", cu_seqlens, num_seqs, tokens);
    ImportanceMetrics m;
    // MisRenormalize::batch: Σ bounded weights (before rejection) over the loss
    // tokens, and Σ over sequences of each one's mean weight.
    double batch_token_sum = 0, batch_seq_mean_sum = 0;
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t begin = cu_seqlens[s], end = cu_seqlens[s + 1];
      double sum = 0;
      int64_t n = 0;
      bool vetoed = false;
      for (int64_t t = begin; t < end; ++t) {
        if (!loss_mask[t]) continue;
        const double d = double(old_lp[t]) - double(rollout_lp[t]);
        sum += d;
        ++n;
        if constexpr (!std::is_same_v<Policy, Tis>) {
          if (policy_.veto > 0 && std::exp(d) < policy_.veto) vetoed = true;
        }
      }
      double seq_weight_sum = 0;
      for (int64_t t = begin; t < end; ++t) {
        weights[t] = T(0);
        keep[t] = 0;
        if (!loss_mask[t]) continue;
        const double d = double(old_lp[t]) - double(rollout_lp[t]);
        m.tokens += 1;
        m.trainer_lp_sum += double(old_lp[t]);
        m.rollout_lp_sum += double(rollout_lp[t]);
        m.k3_sum += kl_term<double>(KlEstimator::k3, double(rollout_lp[t]), double(old_lp[t])).value;
        double w = 0;
        bool clipped = false, rejected = vetoed;
        if constexpr (std::is_same_v<Policy, Tis>) {
          const double rho = std::exp(d);
          w = std::clamp(rho, policy_.low, policy_.high);
          clipped = w != rho;
        } else {
          using L = typename Policy::level;
          using M = typename Policy::mode;
          double log_rho = d;
          if constexpr (std::is_same_v<L, Sequence>) log_rho = sum;
          if constexpr (std::is_same_v<L, Geometric>) log_rho = sum / double(n);
          const double rho = std::exp(std::clamp(log_rho, -mis_log_ratio_bound, mis_log_ratio_bound));
          if constexpr (std::is_same_v<M, Truncate>) {
            w = std::min(rho, policy_.high);
            clipped = rho > policy_.high;
          } else if constexpr (std::is_same_v<M, Clip>) {
            w = std::clamp(rho, policy_.low, policy_.high);
            clipped = w != rho;
          } else {
            w = rho;
            clipped = rho < policy_.low || rho > policy_.high;
            rejected = rejected || clipped;
          }
        }
        m.clipped += clipped ? 1 : 0;
        seq_weight_sum += w;
        if (rejected) {
          m.rejected += 1;
          continue;
        }
        weights[t] = T(w);
        keep[t] = 1;
        m.kept += 1;
      }
      batch_token_sum += seq_weight_sum;
      batch_seq_mean_sum += n > 0 ? seq_weight_sum / double(n) : 0.0;
    }
    double scale = 1;
    if constexpr (!std::is_same_v<Policy, Tis>) {
      if (policy_.renormalize == MisRenormalize::kept) {
        double sum_w = 0;
        for (int64_t t = 0; t < tokens; ++t) sum_w += keep[t] ? double(weights[t]) : 0.0;
        if (m.kept > 0 && sum_w > 0) scale = m.kept / sum_w;
      } else if (policy_.renormalize == MisRenormalize::batch) {
        const double mean = std::is_same_v<typename Policy::level, Token>
                                ? batch_token_sum / std::max(m.tokens, 1.0)
                                : (num_seqs > 0 ? batch_seq_mean_sum / double(num_seqs) : 0.0);
        if (mean > 1e-8) scale = 1 / mean;
      }
    }
    if (scale != 1) {
      for (int64_t t = 0; t < tokens; ++t) {
        if (keep[t]) weights[t] = T(double(weights[t]) * scale);
      }
    }
    for (int64_t t = 0; t < tokens; ++t) {
      if (!keep[t]) continue;
      m.weight_sum += double(weights[t]);
      m.abs_dev_sum += std::abs(double(weights[t]) - 1);
    }
    return m;
  }

  // f32 CPU tensors [T]; loss_mask u8 [T]; cu_seqlens i32 [S + 1].
  ImportanceResult operator()(const Tensor& old_lp, const Tensor& rollout_lp, const Tensor& loss_mask,
                              const Tensor& cu_seqlens) const {
    constexpr std::string_view fn = "rl::ImportanceSampler";
    detail::require_cpu(fn, old_lp);
    SLIME_CHECK(old_lp.dim() == 1, fn, ": old_lp must be 1-d [tokens], got ", old_lp.str());
    const int64_t n = old_lp.size(0);
    detail::check_token_tensor(fn, old_lp, DType::f32, n, "old_lp");
    detail::check_token_tensor(fn, rollout_lp, DType::f32, n, "rollout_lp");
    detail::check_token_tensor(fn, loss_mask, DType::u8, n, "loss_mask");
    const int64_t s = detail::check_cu_seqlens_tensor(fn, cu_seqlens, n);
    ImportanceResult r;
    r.weights = Tensor::empty(Shape{n}, DType::f32);
    r.keep_mask = Tensor::empty(Shape{n}, DType::u8);
    r.metrics = compute<float>(old_lp.data<float>(), rollout_lp.data<float>(), loss_mask.data<uint8_t>(),
                               cu_seqlens.data<int32_t>(), s, n, r.weights.data<float>(), r.keep_mask.data<uint8_t>());
    return r;
  }

 private:
  Policy policy_;
};

}  // namespace slime::rl
