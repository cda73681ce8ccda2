// slime/rl/policy_loss.hpp: the per-token RL objective (PPO-clip with dual
// clip, GSPO, CISPO) plus entropy bonus and KL to a reference, aggregated
// with global normalisers, with its gradient with respect to the policy's
// log-probabilities (lp) and entropies. CPU reference on raw pointers (float
// or double) and f32 CPU Tensors; the fused CUDA kernel comes later.
//
// Accumulation contract: grad_lp and grad_entropy are activation gradients,
// written (=) for every token (0 outside the loss).
//
// Per token t of sequence s, with ratio r = exp(lp − old) (GSPO: the sequence
// ratio exp(Σ_{u∈s} m_u (lp_u − old_u) / n_s), gradient through the mean):
//   ppo/gspo: pg = max(−A·r, −A·clip(r, 1 − eps_clip, 1 + eps_clip_high)),
//             and for A < 0 with eps_clip_c > 1: pg = min(pg, −A·eps_clip_c)
//   cispo:    pg = −sg(clip(r, 1 − eps_clip, 1 + eps_clip_high))·A·lp
//   pg ← w·pg with importance weights w (no gradient through w)
//   ℓ = pg − entropy_coef·H + kl_coef·KL(lp, ref)
// Loss = Σ_t c_t·k_t·ℓ_t with k_t = loss_mask·keep (rejected tokens leave the
// numerator) and c_t from the aggregation, whose denominators use loss_mask
// (the original mask count) and the GLOBAL counts of LossNormalizer:
//   token_mean:           c_t = 1 / N_tokens
//   seq_mean_token_mean:  c_t = 1 / (n_s · N_seqs)
//   seq_mean_token_sum:   c_t = 1 / N_seqs
// So the loss and gradient of a batch are the sums over its micro-batches
// (and ranks), whatever the split, as long as sequences are not cut.
// Metrics are aggregated with the same weights, so they add up likewise.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "slime/rl/kl.hpp"
#include "slime/rl/metrics.hpp"

namespace slime::rl {

enum class PolicyLossKind { ppo, gspo, cispo };
enum class Aggregation { token_mean, seq_mean_token_mean, seq_mean_token_sum };

struct PolicyLossConfig {
  PolicyLossKind kind = PolicyLossKind::ppo;
  double eps_clip = 0.2;       // lower bound 1 − eps_clip
  double eps_clip_high = 0.2;  // upper bound 1 + eps_clip_high
  double eps_clip_c = 0;       // dual clip (> 1) for negative advantages; 0: off
  double entropy_coef = 0;
  double kl_coef = 0;
  KlEstimator kl_estimator = KlEstimator::k3;
  bool unbiased_kl = false;  // KL · exp(lp − old)
  Aggregation aggregation = Aggregation::token_mean;
};

// Global counts over the whole step batch (all micro-batches, all ranks).
struct LossNormalizer {
  int64_t tokens = 0;     // Σ loss_mask
  int64_t sequences = 0;  // sequences with at least one loss token
};

// Additive: the metrics of a batch are the sums over its micro-batches.
// Each is aggregated with the loss's weights c_t·k_t.
struct PolicyLossMetrics {
  double loss = 0;
  double pg_loss = 0;
  double entropy = 0;
  double kl = 0;
  double ppo_kl = 0;         // old − lp (GSPO: the sequence mean)
  double clip_fraction = 0;  // ratio outside [1 − eps_clip, 1 + eps_clip_high] where it changes pg
  double dual_clip_fraction = 0;

  PolicyLossMetrics& operator+=(const PolicyLossMetrics& o) {
    loss += o.loss;
    pg_loss += o.pg_loss;
    entropy += o.entropy;
    kl += o.kl;
    ppo_kl += o.ppo_kl;
    clip_fraction += o.clip_fraction;
    dual_clip_fraction += o.dual_clip_fraction;
    return *this;
  }
};

namespace detail {

inline void check_loss_config(std::string_view fn, const PolicyLossConfig& c) {
  SLIME_CHECK(c.eps_clip >= 0 && c.eps_clip_high >= 0, fn, ": eps_clip and eps_clip_high must be >= 0, got ",
              c.eps_clip, " and ", c.eps_clip_high);
  SLIME_CHECK(c.eps_clip <= 1, fn, ": eps_clip must be <= 1 (lower bound 1 − eps_clip >= 0), got ", c.eps_clip);
  SLIME_CHECK(c.eps_clip_c == 0 || c.eps_clip_c > 1, fn, ": eps_clip_c must be 0 (off) or > 1, got ", c.eps_clip_c);
}

}  // namespace detail

namespace cpu {

// Per-token inputs [tokens] of one micro-batch; maybe_ pointers may be null.
template <class T>
struct PolicyLossArgs {
  const T* lp = nullptr;
  const T* old_lp = nullptr;
  const T* advantages = nullptr;
  const uint8_t* loss_mask = nullptr;
  const int32_t* cu_seqlens = nullptr;  // [num_seqs + 1]
  int64_t num_seqs = 0;
  int64_t tokens = 0;
  const T* maybe_ref_lp = nullptr;      // needed when kl_coef != 0
  const T* maybe_entropy = nullptr;     // needed when entropy_coef != 0
  const T* maybe_is_weights = nullptr;  // importance weights (treated as constants)
  const uint8_t* maybe_keep = nullptr;  // 0: rejected token (numerator only)
};

// Global counts of one micro-batch; sum them over the batch for LossNormalizer.
inline LossNormalizer count_normalizer(const uint8_t* loss_mask, const int32_t* cu_seqlens, int64_t num_seqs,
                                       int64_t tokens) {
  detail::check_cu_seqlens("rl::count_normalizer", cu_seqlens, num_seqs, tokens);
  LossNormalizer n;
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t c = 0;
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) c += loss_mask[t] ? 1 : 0;
    n.tokens += c;
    n.sequences += c > 0 ? 1 : 0;
  }
  return n;
}

// The micro-batch's share of the loss and metrics; grad_lp [tokens] and
// maybe_grad_entropy [tokens] are written (=).
template <class T>
PolicyLossMetrics policy_loss(const PolicyLossConfig& config, const LossNormalizer& norm, const PolicyLossArgs<T>& a,
                              std::type_identity_t<T>* grad_lp, std::type_identity_t<T>* maybe_grad_entropy) {
  constexpr std::string_view fn = "rl::policy_loss";
  detail::check_loss_config(fn, config);
  detail::check_cu_seqlens(fn, a.cu_seqlens, a.num_seqs, a.tokens);
  SLIME_CHECK(a.lp && a.old_lp && a.advantages && a.loss_mask && grad_lp, fn,
              ": lp, old_lp, advantages, loss_mask and grad_lp are required");
  SLIME_CHECK(config.kl_coef == 0 || a.maybe_ref_lp, fn, ": kl_coef = ", config.kl_coef, " needs ref_lp");
  SLIME_CHECK(config.entropy_coef == 0 || a.maybe_entropy, fn, ": entropy_coef = ", config.entropy_coef,
              " needs entropy");
  const bool by_tokens = config.aggregation == Aggregation::token_mean;
  SLIME_CHECK(by_tokens ? norm.tokens >= 0 : norm.sequences >= 0, fn, ": negative normaliser");

  const double lo = 1 - config.eps_clip, hi = 1 + config.eps_clip_high;
  PolicyLossMetrics m;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t begin = a.cu_seqlens[s], end = a.cu_seqlens[s + 1];
    int64_t n_s = 0;
    double seq_log_ratio = 0;
    for (int64_t t = begin; t < end; ++t) {
      if (!a.loss_mask[t]) continue;
      ++n_s;
      seq_log_ratio += double(a.lp[t]) - double(a.old_lp[t]);
    }
    for (int64_t t = begin; t < end; ++t) {
      grad_lp[t] = T(0);
      if (maybe_grad_entropy) maybe_grad_entropy[t] = T(0);
    }
    if (n_s == 0) continue;
    seq_log_ratio /= double(n_s);
    double c = 0;
    switch (config.aggregation) {
      case Aggregation::token_mean:
        c = 1.0 / double(norm.tokens);
        break;
      case Aggregation::seq_mean_token_mean:
        c = 1.0 / (double(n_s) * double(norm.sequences));
        break;
      case Aggregation::seq_mean_token_sum:
        c = 1.0 / double(norm.sequences);
        break;
    }
    SLIME_CHECK(std::isfinite(c), fn, ": the global normaliser is 0 but micro-batch has loss tokens");
    // GSPO: Σ_t c·k_t·w_t·(dpg_t/dr)·r, spread over the sequence's tokens as d r / d lp_u = r·m_u / n_s.
    double gspo_grad = 0;
    for (int64_t t = begin; t < end; ++t) {
      if (!a.loss_mask[t]) continue;
      const bool keep = !a.maybe_keep || a.maybe_keep[t];
      const double lp = double(a.lp[t]), adv = double(a.advantages[t]);
      const double log_ratio = config.kind == PolicyLossKind::gspo ? seq_log_ratio : lp - double(a.old_lp[t]);
      const double ratio = std::exp(log_ratio);
      const double w = a.maybe_is_weights ? double(a.maybe_is_weights[t]) : 1.0;
      double pg = 0, dpg_dlp = 0, dpg_dratio = 0;
      bool clipped = false, dual = false;
      const double cr = std::clamp(ratio, lo, hi);
      if (config.kind == PolicyLossKind::cispo) {
        pg = -cr * adv * lp;
        dpg_dlp = -cr * adv;
        clipped = cr != ratio;
      } else {
        const double pg1 = -adv * ratio, pg2 = -adv * cr;
        clipped = pg2 > pg1;
        if (clipped) {
          pg = pg2;
        } else {
          pg = pg1;
          dpg_dratio = -adv;
        }
        if (config.eps_clip_c > 0 && adv < 0) {
          const double pg3 = -adv * config.eps_clip_c;
          if (pg3 < pg) {
            pg = pg3;
            dpg_dratio = 0;
            dual = true;
          }
        }
      }
      pg *= w;
      dpg_dlp *= w;
      dpg_dratio *= w;
      double kl = 0, dkl = 0;
      if (a.maybe_ref_lp) {
        const KlTerm<double> k = config.unbiased_kl ? kl_term_unbiased(config.kl_estimator, lp,
                                                                       double(a.maybe_ref_lp[t]), double(a.old_lp[t]))
                                                    : kl_term(config.kl_estimator, lp, double(a.maybe_ref_lp[t]));
        kl = k.value;
        dkl = k.grad;
      }
      const double h = a.maybe_entropy ? double(a.maybe_entropy[t]) : 0.0;
      if (!keep) continue;
      m.pg_loss += c * pg;
      m.entropy += c * h;
      m.kl += c * kl;
      m.ppo_kl += c * -log_ratio;
      m.clip_fraction += clipped ? c : 0.0;
      m.dual_clip_fraction += dual ? c : 0.0;
      m.loss += c * (pg - config.entropy_coef * h + config.kl_coef * kl);
      double g = c * (dpg_dlp + config.kl_coef * dkl);
      if (config.kind == PolicyLossKind::gspo) {
        gspo_grad += c * dpg_dratio * ratio;
      } else {
        g += c * dpg_dratio * ratio;
      }
      grad_lp[t] = T(g);
      if (maybe_grad_entropy) maybe_grad_entropy[t] = T(-config.entropy_coef * c);
    }
    if (config.kind == PolicyLossKind::gspo && gspo_grad != 0) {
      for (int64_t t = begin; t < end; ++t) {
        if (a.loss_mask[t]) grad_lp[t] = T(double(grad_lp[t]) + gspo_grad / double(n_s));
      }
    }
  }
  return m;
}

}  // namespace cpu

// ---- Tensor API: f32 CPU tensors [tokens]; CUDA tensors throw (not implemented yet).

struct PolicyLossTensors {
  Tensor lp, old_lp, advantages;       // f32 [T]
  Tensor loss_mask;                    // u8 [T]
  Tensor cu_seqlens;                   // i32 [S + 1]
  Tensor ref_lp, entropy, is_weights;  // optional f32 [T]
  Tensor keep_mask;                    // optional u8 [T]
};

struct PolicyLossResult {
  PolicyLossMetrics metrics;
  Tensor grad_lp;       // f32 [T]
  Tensor grad_entropy;  // f32 [T], defined when entropy is given
};

inline LossNormalizer count_normalizer(const Tensor& loss_mask, const Tensor& cu_seqlens) {
  constexpr std::string_view fn = "rl::count_normalizer";
  detail::require_cpu(fn, loss_mask);
  SLIME_CHECK(loss_mask.dim() == 1, fn, ": loss_mask must be 1-d, got ", loss_mask.str());
  detail::check_token_tensor(fn, loss_mask, DType::u8, loss_mask.size(0), "loss_mask");
  const int64_t s = detail::check_cu_seqlens_tensor(fn, cu_seqlens, loss_mask.size(0));
  return cpu::count_normalizer(loss_mask.data<uint8_t>(), cu_seqlens.data<int32_t>(), s, loss_mask.size(0));
}

inline PolicyLossResult policy_loss(const PolicyLossConfig& config, const LossNormalizer& norm,
                                    const PolicyLossTensors& in) {
  constexpr std::string_view fn = "rl::policy_loss";
  detail::require_cpu(fn, in.lp);
  SLIME_CHECK(in.lp.dim() == 1, fn, ": lp must be 1-d [tokens], got ", in.lp.str());
  const int64_t n = in.lp.size(0);
  detail::check_token_tensor(fn, in.lp, DType::f32, n, "lp");
  detail::check_token_tensor(fn, in.old_lp, DType::f32, n, "old_lp");
  detail::check_token_tensor(fn, in.advantages, DType::f32, n, "advantages");
  detail::check_token_tensor(fn, in.loss_mask, DType::u8, n, "loss_mask");
  if (in.ref_lp.defined()) detail::check_token_tensor(fn, in.ref_lp, DType::f32, n, "ref_lp");
  if (in.entropy.defined()) detail::check_token_tensor(fn, in.entropy, DType::f32, n, "entropy");
  if (in.is_weights.defined()) detail::check_token_tensor(fn, in.is_weights, DType::f32, n, "is_weights");
  if (in.keep_mask.defined()) detail::check_token_tensor(fn, in.keep_mask, DType::u8, n, "keep_mask");
  const int64_t s = detail::check_cu_seqlens_tensor(fn, in.cu_seqlens, n);
  cpu::PolicyLossArgs<float> a;
  a.lp = in.lp.data<float>();
  a.old_lp = in.old_lp.data<float>();
  a.advantages = in.advantages.data<float>();
  a.loss_mask = in.loss_mask.data<uint8_t>();
  a.cu_seqlens = in.cu_seqlens.data<int32_t>();
  a.num_seqs = s;
  a.tokens = n;
  a.maybe_ref_lp = detail::maybe_data<float>(in.ref_lp);
  a.maybe_entropy = detail::maybe_data<float>(in.entropy);
  a.maybe_is_weights = detail::maybe_data<float>(in.is_weights);
  a.maybe_keep = detail::maybe_data<uint8_t>(in.keep_mask);
  PolicyLossResult r;
  r.grad_lp = Tensor::empty(Shape{n}, DType::f32);
  if (in.entropy.defined()) r.grad_entropy = Tensor::empty(Shape{n}, DType::f32);
  r.metrics = cpu::policy_loss<float>(config, norm, a, r.grad_lp.data<float>(),
                                      in.entropy.defined() ? r.grad_entropy.data<float>() : nullptr);
  return r;
}

}  // namespace slime::rl
