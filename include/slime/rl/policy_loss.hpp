// slime/rl/policy_loss.hpp: the per-token RL objective (PPO-clip with dual
// clip, GSPO, CISPO) plus entropy bonus and KL to a reference, aggregated
// with global normalisers, with its gradient with respect to the policy's
// log-probabilities (lp) and entropies. CPU reference on raw pointers (float
// or double); the Tensor API dispatches f32 tensors to it or to the fused
// CUDA kernel (src/rl/policy_loss.cu).
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
// Loss = Σ_t k_t·(c_pg·pg_t + c_t·(kl_coef·KL_t − entropy_coef·H_t)) with
// k_t = loss_mask·keep (rejected tokens leave the numerator) and c from the
// aggregation, whose denominators use loss_mask (the original mask count) and
// the GLOBAL counts of LossNormalizer (n_s: sequence s's loss tokens):
//   token_mean:           c_pg = c_t = 1 / N_tokens
//   seq_mean_token_mean:  c_pg = c_t = 1 / (n_s · N_seqs)
//   seq_mean_token_sum:   c_pg = 1 / N_seqs, c_t = 1 / (n_s · N_seqs)
// seq_mean_token_sum (Dr. GRPO) reduces the policy-gradient term only, as
// THUDM/slime's --custom-pg-loss-reducer-function-path does: the KL and
// entropy terms and every metric but pg_loss keep the per-sequence mean.
// Empty sequences (no loss token) follow EmptySequences:
//   count (default, slime's): N_seqs counts every sequence of the step and
//     N_tokens = Σ_s max(n_s, 1) (slime's step_global_batch_size and
//     Megatron's per-token num_tokens), so a fully masked sample dilutes the
//     step like a sample whose loss is 0;
//   skip (ours, an option): N_seqs counts the sequences with n_s > 0 and
//     N_tokens = Σ_s n_s, so the loss scale does not depend on how many
//     samples were masked out (e.g. removed or over-long ones).
// So the loss and gradient of a batch are the sums over its micro-batches
// (and ranks), whatever the split, as long as sequences are not cut.
// Metrics are aggregated with the weights c_t (pg_loss with c_pg), so they
// add up likewise. clip_fraction is the c_t-weighted share of tokens whose
// clipped branch is taken (slime's pg_clipfrac through its sum_of_sample_mean):
// the fraction of loss tokens under token_mean, the mean over sequences of
// each one's fraction otherwise, so it is ≤ 1 under every aggregation (and
// below the plain fraction by the share of empty sequences under count).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/rl/cuda/policy_loss.hpp"
#include "slime/rl/kl.hpp"
#include "slime/rl/metrics.hpp"

namespace slime::rl {

enum class PolicyLossKind { ppo, gspo, cispo };
enum class Aggregation { token_mean, seq_mean_token_mean, seq_mean_token_sum };
// Whether sequences without loss tokens count in the normalisers (see above).
enum class EmptySequences { count, skip };

struct PolicyLossConfig {
  PolicyLossKind kind = PolicyLossKind::ppo;
  double eps_clip = 0.2;       // lower bound 1 − eps_clip
  double eps_clip_high = 0.2;  // upper bound 1 + eps_clip_high
  double eps_clip_c = 0;       // dual clip (> 1) for negative advantages; 0: off
  double entropy_coef = 0;
  double kl_coef = 0;
  KlEstimator kl_estimator = KlEstimator::k1;  // slime's --kl-loss-type default
  bool unbiased_kl = false;                    // KL · exp(lp − old)
  Aggregation aggregation = Aggregation::token_mean;
  EmptySequences empty_sequences = EmptySequences::count;
};

// Global counts over the whole step batch (all micro-batches, all ranks).
struct LossNormalizer {
  int64_t tokens = 0;              // Σ loss_mask
  int64_t sequences = 0;           // every sequence
  int64_t nonempty_sequences = 0;  // sequences with at least one loss token

  LossNormalizer& operator+=(const LossNormalizer& o) {
    tokens += o.tokens;
    sequences += o.sequences;
    nonempty_sequences += o.nonempty_sequences;
    return *this;
  }
};

// The denominators of token_mean (N_tokens) and of the sequence means (N_seqs).
struct LossDenominators {
  int64_t tokens = 0;
  int64_t sequences = 0;
};

inline LossDenominators loss_denominators(EmptySequences empty, const LossNormalizer& n) {
  if (empty == EmptySequences::skip) return {n.tokens, n.nonempty_sequences};
  return {n.tokens + (n.sequences - n.nonempty_sequences), n.sequences};
}

// Additive: the metrics of a batch are the sums over its micro-batches.
// Each is aggregated with the loss's weights c_t·k_t.
struct PolicyLossMetrics {
  double loss = 0;
  double pg_loss = 0;
  double entropy = 0;
  double kl = 0;
  double ppo_kl = 0;         // old − lp (GSPO: the sequence mean)
  double clip_fraction = 0;  // ratio outside [1 − eps_clip, 1 + eps_clip_high] where it changes pg (≤ 1)
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

inline void check_normalizer(std::string_view fn, const LossNormalizer& n) {
  SLIME_CHECK(n.tokens >= 0 && n.nonempty_sequences >= 0 && n.sequences >= n.nonempty_sequences &&
                  n.tokens >= n.nonempty_sequences,
              fn, ": inconsistent LossNormalizer (tokens ", n.tokens, ", sequences ", n.sequences, ", non-empty ",
              n.nonempty_sequences, "); sum count_normalizer over the step batch");
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
    n.sequences += 1;
    n.nonempty_sequences += c > 0 ? 1 : 0;
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
  detail::check_normalizer(fn, norm);
  const LossDenominators den = loss_denominators(config.empty_sequences, norm);

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
    // c: the weight of the KL and entropy terms and of the metrics; c_pg: of the pg term.
    double c = 0, c_pg = 0;
    switch (config.aggregation) {
      case Aggregation::token_mean:
        c = c_pg = 1.0 / double(den.tokens);
        break;
      case Aggregation::seq_mean_token_mean:
        c = c_pg = 1.0 / (double(n_s) * double(den.sequences));
        break;
      case Aggregation::seq_mean_token_sum:
        c = 1.0 / (double(n_s) * double(den.sequences));
        c_pg = 1.0 / double(den.sequences);
        break;
    }
    SLIME_CHECK(std::isfinite(c_pg), fn, ": the global normaliser is 0 but micro-batch has loss tokens");
    // GSPO: Σ_t c_pg·k_t·w_t·(dpg_t/dr)·r, spread over the sequence's tokens as d r / d lp_u = r·m_u / n_s.
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
      m.pg_loss += c_pg * pg;
      m.entropy += c * h;
      m.kl += c * kl;
      m.ppo_kl += c * -log_ratio;
      m.clip_fraction += clipped ? c : 0.0;
      m.dual_clip_fraction += dual ? c : 0.0;
      m.loss += c_pg * pg + c * (config.kl_coef * kl - config.entropy_coef * h);
      double g = c_pg * dpg_dlp + c * config.kl_coef * dkl;
      if (config.kind == PolicyLossKind::gspo) {
        gspo_grad += c_pg * dpg_dratio * ratio;
      } else {
        g += c_pg * dpg_dratio * ratio;
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

// ---- Tensor API: f32 tensors [tokens] on the CPU (the reference above) or on
// one CUDA device (the fused kernel of src/rl/policy_loss.cu: one pass over the
// tokens, GSPO adds a segmented sweep per sequence; deterministic run to run).
// On CUDA the host checks shapes, dtypes and devices; cu_seqlens' values are
// checked on the device (a broken one traps), and the normaliser the
// aggregation divides by must be > 0 (the host cannot see whether the
// micro-batch has loss tokens without a synchronisation).

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

// Outputs of policy_loss_into, allocated by the caller (on lp's device) and
// reused across calls: grad_lp f32 [T]; grad_entropy f32 [T] when entropy is
// given (else undefined); workspace u8 of at least
// policy_loss_workspace_bytes(num_seqs) bytes, whose first
// kPolicyLossMetricBytes hold the metrics as 7 doubles (read_policy_loss_metrics).
struct PolicyLossOutputs {
  Tensor grad_lp;
  Tensor grad_entropy;
  Tensor workspace;
};

inline constexpr std::size_t kPolicyLossMetricCount = 7;
inline constexpr std::size_t kPolicyLossMetricBytes = kPolicyLossMetricCount * sizeof(double);

inline std::size_t policy_loss_workspace_bytes(int64_t num_seqs) {
  // The metrics, then (CUDA) one row of partial sums per sequence, 256-byte aligned.
  return 256 + ((std::size_t(num_seqs > 0 ? num_seqs : 0) * kPolicyLossMetricBytes + 255) / 256) * 256;
}

namespace detail {

inline void metrics_to_array(const PolicyLossMetrics& m, void* out) {
  const double v[kPolicyLossMetricCount] = {m.loss,   m.pg_loss,       m.entropy,           m.kl,
                                            m.ppo_kl, m.clip_fraction, m.dual_clip_fraction};
  std::memcpy(out, v, sizeof(v));
}

inline PolicyLossMetrics metrics_from_array(const double* v) {
  PolicyLossMetrics m;
  m.loss = v[0];
  m.pg_loss = v[1];
  m.entropy = v[2];
  m.kl = v[3];
  m.ppo_kl = v[4];
  m.clip_fraction = v[5];
  m.dual_clip_fraction = v[6];
  return m;
}

// Validates `in` and returns (tokens, num_seqs).
inline std::pair<int64_t, int64_t> check_policy_loss_tensors(std::string_view fn, const PolicyLossTensors& in) {
  SLIME_CHECK(in.lp.defined(), fn, ": lp is undefined");
  SLIME_CHECK(in.lp.dim() == 1, fn, ": lp must be 1-d [tokens], got ", in.lp.str());
  const int64_t n = in.lp.size(0);
  const Device dev = in.lp.device();
  check_token_tensor_on(fn, in.lp, DType::f32, n, "lp", dev);
  check_token_tensor_on(fn, in.old_lp, DType::f32, n, "old_lp", dev);
  check_token_tensor_on(fn, in.advantages, DType::f32, n, "advantages", dev);
  check_token_tensor_on(fn, in.loss_mask, DType::u8, n, "loss_mask", dev);
  if (in.ref_lp.defined()) check_token_tensor_on(fn, in.ref_lp, DType::f32, n, "ref_lp", dev);
  if (in.entropy.defined()) check_token_tensor_on(fn, in.entropy, DType::f32, n, "entropy", dev);
  if (in.is_weights.defined()) check_token_tensor_on(fn, in.is_weights, DType::f32, n, "is_weights", dev);
  if (in.keep_mask.defined()) check_token_tensor_on(fn, in.keep_mask, DType::u8, n, "keep_mask", dev);
  return {n, check_cu_seqlens_tensor_on(fn, in.cu_seqlens, n, dev)};
}

}  // namespace detail

// The global counts of one micro-batch (sum them over micro-batches and ranks,
// e.g. by one all_reduce). A CUDA loss_mask / cu_seqlens is copied to the host
// (a synchronisation: compute the normaliser once per step, before the
// micro-batches).
inline LossNormalizer count_normalizer(const Tensor& loss_mask, const Tensor& cu_seqlens, const Stream& stream = {}) {
  constexpr std::string_view fn = "rl::count_normalizer";
  SLIME_CHECK(loss_mask.defined(), fn, ": loss_mask is undefined");
  SLIME_CHECK(loss_mask.dim() == 1, fn, ": loss_mask must be 1-d, got ", loss_mask.str());
  const Device dev = loss_mask.device();
  detail::check_token_tensor_on(fn, loss_mask, DType::u8, loss_mask.size(0), "loss_mask", dev);
  const int64_t s = detail::check_cu_seqlens_tensor_on(fn, cu_seqlens, loss_mask.size(0), dev);
  if (dev.is_cuda()) {
    const std::vector<uint8_t> mask = loss_mask.to_vector<uint8_t>(stream);
    const std::vector<int32_t> cu = cu_seqlens.to_vector<int32_t>(stream);
    return cpu::count_normalizer(mask.data(), cu.data(), s, loss_mask.size(0));
  }
  return cpu::count_normalizer(loss_mask.data<uint8_t>(), cu_seqlens.data<int32_t>(), s, loss_mask.size(0));
}

// The metrics that policy_loss_into left at the start of `workspace` (waits
// for the stream when the workspace is on a GPU).
inline PolicyLossMetrics read_policy_loss_metrics(const Tensor& workspace, const Stream& stream = {}) {
  SLIME_CHECK(workspace.defined() && workspace.dtype() == DType::u8 && workspace.nbytes() >= kPolicyLossMetricBytes,
              "rl::read_policy_loss_metrics: workspace must be u8 of at least ", kPolicyLossMetricBytes, " bytes, got ",
              workspace.str());
  const Tensor head = workspace.flatten().view(0, Shape{int64_t(kPolicyLossMetricBytes)});
  const std::vector<uint8_t> bytes = head.to_vector<uint8_t>(stream);
  double v[kPolicyLossMetricCount];
  std::memcpy(v, bytes.data(), sizeof(v));
  return detail::metrics_from_array(v);
}

// The loss and its gradients into caller-owned outputs: allocates nothing and,
// on CUDA, does not synchronise (the metrics stay in out.workspace; a trainer
// reads them once per step). Ordered on `stream`.
inline void policy_loss_into(const PolicyLossConfig& config, const LossNormalizer& norm, const PolicyLossTensors& in,
                             PolicyLossOutputs& out, const Stream& stream = {}) {
  constexpr std::string_view fn = "rl::policy_loss";
  detail::check_loss_config(fn, config);
  const auto [n, s] = detail::check_policy_loss_tensors(fn, in);
  const Device dev = in.lp.device();
  SLIME_CHECK(config.kl_coef == 0 || in.ref_lp.defined(), fn, ": kl_coef = ", config.kl_coef, " needs ref_lp");
  SLIME_CHECK(config.entropy_coef == 0 || in.entropy.defined(), fn, ": entropy_coef = ", config.entropy_coef,
              " needs entropy");
  detail::check_token_tensor_on(fn, out.grad_lp, DType::f32, n, "grad_lp", dev);
  if (in.entropy.defined()) detail::check_token_tensor_on(fn, out.grad_entropy, DType::f32, n, "grad_entropy", dev);
  SLIME_CHECK(out.workspace.defined() && out.workspace.device() == dev && out.workspace.dtype() == DType::u8 &&
                  out.workspace.nbytes() >= policy_loss_workspace_bytes(s),
              fn, ": workspace must be u8 on ", dev, " with at least ", policy_loss_workspace_bytes(s),
              " bytes (policy_loss_workspace_bytes(", s, ")), got ", out.workspace.str());
  float* grad_entropy = in.entropy.defined() ? out.grad_entropy.data<float>() : nullptr;
  if (dev.is_cpu()) {
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
    const PolicyLossMetrics m = cpu::policy_loss<float>(config, norm, a, out.grad_lp.data<float>(), grad_entropy);
    detail::metrics_to_array(m, out.workspace.data_ptr());
    return;
  }
#if SLIME_HAS_CUDA
  detail::check_normalizer(fn, norm);
  const LossDenominators den = loss_denominators(config.empty_sequences, norm);
  const bool by_tokens = config.aggregation == Aggregation::token_mean;
  SLIME_CHECK(n == 0 || (by_tokens ? den.tokens > 0 : den.sequences > 0), fn, ": the global normaliser (",
              by_tokens ? "tokens = " : "sequences = ", by_tokens ? den.tokens : den.sequences, ") must be > 0 on ",
              dev, " (sum count_normalizer over the whole step batch)");
  static_assert(kPolicyLossMetricCount == std::size_t(cuda::kPolicyLossMetrics));
  const Stream st = stream.device() == dev ? stream : Stream::default_for(dev);
  DeviceGuard guard(dev);
  cuda::PolicyLossParams p{};
  p.kind = config.kind;
  p.aggregation = config.aggregation;
  p.kl_estimator = config.kl_estimator;
  p.unbiased_kl = config.unbiased_kl;
  p.eps_clip = float(config.eps_clip);
  p.eps_clip_high = float(config.eps_clip_high);
  p.eps_clip_c = float(config.eps_clip_c);
  p.entropy_coef = float(config.entropy_coef);
  p.kl_coef = float(config.kl_coef);
  p.norm_tokens = den.tokens;
  p.norm_sequences = den.sequences;
  p.lp = in.lp.data<float>();
  p.old_lp = in.old_lp.data<float>();
  p.advantages = in.advantages.data<float>();
  p.loss_mask = in.loss_mask.data<uint8_t>();
  p.cu_seqlens = in.cu_seqlens.data<int32_t>();
  p.num_seqs = s;
  p.tokens = n;
  p.maybe_ref_lp = detail::maybe_data<float>(in.ref_lp);
  p.maybe_entropy = detail::maybe_data<float>(in.entropy);
  p.maybe_is_weights = detail::maybe_data<float>(in.is_weights);
  p.maybe_keep = detail::maybe_data<uint8_t>(in.keep_mask);
  p.grad_lp = out.grad_lp.data<float>();
  p.maybe_grad_entropy = grad_entropy;
  char* ws = static_cast<char*>(out.workspace.data_ptr());
  p.metrics = reinterpret_cast<double*>(ws);
  p.workspace = ws + 256;
  p.workspace_bytes = out.workspace.nbytes() - 256;
  SLIME_CHECK(reinterpret_cast<std::uintptr_t>(ws) % 16 == 0, fn, ": workspace must be 16-byte aligned");
  cuda::policy_loss(p, st.handle());
#else
  (void)stream;
  SLIME_FAIL(fn, ": ", dev, " needs the CUDA backend");
#endif
}

// Allocates the outputs, runs policy_loss_into and reads the metrics back (on
// CUDA: a synchronisation of `stream`).
inline PolicyLossResult policy_loss(const PolicyLossConfig& config, const LossNormalizer& norm,
                                    const PolicyLossTensors& in, const Stream& stream = {}) {
  const auto [n, s] = detail::check_policy_loss_tensors("rl::policy_loss", in);
  const Device dev = in.lp.device();
  PolicyLossOutputs out;
  out.grad_lp = Tensor::empty(Shape{n}, DType::f32, dev, stream);
  if (in.entropy.defined()) out.grad_entropy = Tensor::empty(Shape{n}, DType::f32, dev, stream);
  out.workspace = Tensor::empty(Shape{int64_t(policy_loss_workspace_bytes(s))}, DType::u8, dev, stream);
  policy_loss_into(config, norm, in, out, stream);
  PolicyLossResult r;
  r.metrics = read_policy_loss_metrics(out.workspace, stream);
  r.grad_lp = out.grad_lp;
  r.grad_entropy = out.grad_entropy;
  return r;
}

}  // namespace slime::rl
