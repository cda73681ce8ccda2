// slime/rl/advantages.hpp: advantage estimators of RL post-training (GRPO,
// REINFORCE++, REINFORCE++ with a group baseline), their broadcast to
// response tokens, and the on-policy distillation penalty, on raw pointers
// (float or double) and CPU Tensors.
//
// Layouts: per-sample rewards [N], grouped by prompt as consecutive runs of
// `group_sizes` (sum = N); per-token values [T] of packed sequences given by
// cu_seqlens [S + 1]; loss_mask [T] (u8, 1 on response tokens). Outputs are
// written (=); tokens outside the mask get 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "slime/rl/metrics.hpp"

namespace slime::rl {

// Added to the unbiased group std before dividing (as in GRPO).
inline constexpr double grpo_std_eps = 1e-6;
// Added to the batch variance inside the square root when whitening.
inline constexpr double whiten_eps = 1e-8;

namespace detail {

inline void check_groups(std::string_view fn, const int64_t* group_sizes, int64_t num_groups, int64_t num_samples) {
  SLIME_CHECK(num_groups >= 0, fn, ": num_groups must be >= 0, got ", num_groups);
  int64_t total = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    SLIME_CHECK(group_sizes[g] >= 0, fn, ": group ", g, " has negative size ", group_sizes[g]);
    total += group_sizes[g];
  }
  SLIME_CHECK(total == num_samples, fn, ": group sizes sum to ", total, " but there are ", num_samples, " rewards");
}

}  // namespace detail

namespace cpu {

// GRPO: A_i = r_i − mean_g(r), divided by (std_g(r) + 1e-6) when normalize_std
// and the group has more than one sample (std unbiased, n − 1).
template <class T>
void grpo_advantages(const T* rewards, int64_t num_samples, const int64_t* group_sizes, int64_t num_groups,
                     bool normalize_std, T* advantages) {
  detail::check_groups("rl::grpo_advantages", group_sizes, num_groups, num_samples);
  int64_t begin = 0;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t n = group_sizes[g];
    if (n == 0) continue;
    double mean = 0;
    for (int64_t i = 0; i < n; ++i) mean += double(rewards[begin + i]);
    mean /= double(n);
    double scale = 1;
    if (normalize_std && n > 1) {
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += (double(rewards[begin + i]) - mean) * (double(rewards[begin + i]) - mean);
      scale = 1 / (std::sqrt(ss / double(n - 1)) + grpo_std_eps);
    }
    for (int64_t i = 0; i < n; ++i) advantages[begin + i] = T((double(rewards[begin + i]) - mean) * scale);
    begin += n;
  }
}

// out[t] = sample_values[sample_index[s]] for every token t of sequence s with
// loss_mask[t] = 1, else 0. A null sample_index means sequence s holds sample s;
// sample_index -1 marks a padding sequence.
template <class T>
void broadcast_to_tokens(const T* sample_values, int64_t num_samples, const int32_t* maybe_sample_index,
                         const int32_t* cu_seqlens, int64_t num_seqs, const uint8_t* loss_mask, int64_t tokens,
                         T* out) {
  detail::check_cu_seqlens("rl::broadcast_to_tokens", cu_seqlens, num_seqs, tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t i = maybe_sample_index ? maybe_sample_index[s] : s;
    SLIME_CHECK(i >= -1 && i < num_samples, "rl::broadcast_to_tokens: sequence ", s, " holds sample ", i,
                ", out of range for ", num_samples, " samples");
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
      out[t] = (i >= 0 && loss_mask[t]) ? sample_values[i] : T(0);
    }
  }
}

// In place: x ← (x − mean) / sqrt(var + 1e-8) over the masked tokens (mean and
// population variance over the mask); unmasked tokens are set to 0.
template <class T>
void whiten(T* values, const uint8_t* loss_mask, int64_t tokens) {
  double n = 0, sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (loss_mask[t]) {
      n += 1;
      sum += double(values[t]);
    }
  }
  if (n == 0) {
    for (int64_t t = 0; t < tokens; ++t) values[t] = T(0);
    return;
  }
  const double mean = sum / n;
  double ss = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (loss_mask[t]) ss += (double(values[t]) - mean) * (double(values[t]) - mean);
  }
  const double inv = 1 / std::sqrt(ss / n + whiten_eps);
  for (int64_t t = 0; t < tokens; ++t) values[t] = loss_mask[t] ? T((double(values[t]) - mean) * inv) : T(0);
}

// REINFORCE++: token rewards −kl_coef·kl[t] on the response tokens plus the
// sequence's reward on its last response token; discounted returns
// G_t = Σ_{u ≥ t} γ^{(u − t)} r_u over the response tokens of the sequence;
// then whitened over every response token of the batch (when `whiten_batch`).
// rewards are per sequence [S]; kl per token [T] (may be null: no KL shaping).
template <class T>
void reinforce_pp_advantages(const T* rewards, const T* maybe_kl, const uint8_t* loss_mask, const int32_t* cu_seqlens,
                             int64_t num_seqs, int64_t tokens, double kl_coef, double gamma, bool whiten_batch,
                             T* out) {
  detail::check_cu_seqlens("rl::reinforce_pp_advantages", cu_seqlens, num_seqs, tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    int64_t last = -1;
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
      if (loss_mask[t]) last = t;
    }
    double ret = 0;
    for (int64_t t = cu_seqlens[s + 1] - 1; t >= cu_seqlens[s]; --t) {
      if (!loss_mask[t]) {
        out[t] = T(0);
        continue;
      }
      double r = maybe_kl ? -kl_coef * double(maybe_kl[t]) : 0.0;
      if (t == last) r += double(rewards[s]);
      ret = r + gamma * ret;
      out[t] = T(ret);
    }
  }
  if (whiten_batch) whiten(out, loss_mask, tokens);
}

// REINFORCE++ with a group baseline: r'_i = r_i − mean_g(r) per sample, then
// A_t = r'_s − kl_coef·kl[t] on the response tokens of sequence s, whitened over
// the batch (when `whiten_batch`). Sequence s holds sample s (rewards [N = S]).
template <class T>
void reinforce_pp_baseline_advantages(const T* rewards, const int64_t* group_sizes, int64_t num_groups,
                                      const T* maybe_kl, const uint8_t* loss_mask, const int32_t* cu_seqlens,
                                      int64_t num_seqs, int64_t tokens, double kl_coef, bool whiten_batch, T* out) {
  std::vector<T> centred(static_cast<std::size_t>(num_seqs));
  grpo_advantages(rewards, num_seqs, group_sizes, num_groups, false, centred.data());
  broadcast_to_tokens(centred.data(), num_seqs, nullptr, cu_seqlens, num_seqs, loss_mask, tokens, out);
  if (maybe_kl) {
    for (int64_t t = 0; t < tokens; ++t) {
      if (loss_mask[t]) out[t] = T(double(out[t]) - kl_coef * double(maybe_kl[t]));
    }
  }
  if (whiten_batch) whiten(out, loss_mask, tokens);
}

// On-policy distillation (THUDM/slime's --opd-kl-coef, loss.py's
// apply_opd_kl_to_advantages): a frozen teacher scores the student's sampled
// tokens and, on every loss token,
//   reverse_kl_t = student_lp_t − teacher_lp_t     (k1 of KL(student ‖ teacher))
//   A_t ← A_t − opd_kl_coef · reverse_kl_t
// after the advantage estimator and before any whitening of the advantages.
// It enters the advantage, not the loss: the policy-gradient term carries it
// (clipped and importance-weighted like the reward), with no gradient through
// reverse_kl itself. student_lp are the logprobs the advantages are computed
// with (slime's old / rollout logprobs, detached). advantages are updated in
// place; maybe_reverse_kl [T] is written (=), 0 outside the mask. Returns
// Σ reverse_kl over the loss tokens.
template <class T>
double apply_opd(const T* student_lp, const T* teacher_lp, const uint8_t* loss_mask, int64_t tokens, double opd_kl_coef,
                 T* advantages, std::type_identity_t<T>* maybe_reverse_kl) {
  SLIME_CHECK(tokens >= 0, "rl::apply_opd: tokens must be >= 0, got ", tokens);
  double sum = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    const double rkl = loss_mask[t] ? double(student_lp[t]) - double(teacher_lp[t]) : 0.0;
    if (loss_mask[t]) advantages[t] = T(double(advantages[t]) - opd_kl_coef * rkl);
    if (maybe_reverse_kl) maybe_reverse_kl[t] = T(rkl);
    sum += rkl;
  }
  return sum;
}

}  // namespace cpu

// ---- Tensor API: f32 CPU tensors (CUDA tensors throw: only policy_loss has a kernel).

// rewards f32 [N] → advantages f32 [N].
inline Tensor grpo_advantages(const Tensor& rewards, std::span<const int64_t> group_sizes, bool normalize_std) {
  constexpr std::string_view fn = "rl::grpo_advantages";
  detail::require_cpu(fn, rewards);
  SLIME_CHECK(rewards.dim() == 1, fn, ": rewards must be 1-d [samples], got ", rewards.str());
  detail::check_token_tensor(fn, rewards, DType::f32, rewards.size(0), "rewards");
  Tensor out = Tensor::empty(rewards.shape(), DType::f32);
  cpu::grpo_advantages<float>(rewards.data<float>(), rewards.size(0), group_sizes.data(), int64_t(group_sizes.size()),
                              normalize_std, out.data<float>());
  return out;
}

// sample_values f32 [N], cu_seqlens i32 [S + 1], loss_mask u8 [T], sample_index
// i32 [S] (undefined: sequence s holds sample s) → f32 [T].
inline Tensor broadcast_to_tokens(const Tensor& sample_values, const Tensor& cu_seqlens, const Tensor& loss_mask,
                                  const Tensor& sample_index = {}) {
  constexpr std::string_view fn = "rl::broadcast_to_tokens";
  detail::require_cpu(fn, sample_values);
  detail::require_cpu(fn, loss_mask);
  SLIME_CHECK(sample_values.dim() == 1 && loss_mask.dim() == 1, fn, ": sample_values and loss_mask must be 1-d, got ",
              sample_values.str(), " and ", loss_mask.str());
  const int64_t tokens = loss_mask.size(0);
  detail::check_token_tensor(fn, sample_values, DType::f32, sample_values.size(0), "sample_values");
  detail::check_token_tensor(fn, loss_mask, DType::u8, tokens, "loss_mask");
  const int64_t s = detail::check_cu_seqlens_tensor(fn, cu_seqlens, tokens);
  if (sample_index.defined()) detail::check_token_tensor(fn, sample_index, DType::i32, s, "sample_index");
  Tensor out = Tensor::empty(Shape{tokens}, DType::f32);
  cpu::broadcast_to_tokens<float>(sample_values.data<float>(), sample_values.size(0),
                                  detail::maybe_data<int32_t>(sample_index), cu_seqlens.data<int32_t>(), s,
                                  loss_mask.data<uint8_t>(), tokens, out.data<float>());
  return out;
}

// f32 CPU tensors [T]: advantages updated in place (see cpu::apply_opd);
// returns the per-token reverse KL (0 outside the mask).
inline Tensor apply_opd(Tensor& advantages, const Tensor& student_lp, const Tensor& teacher_lp, const Tensor& loss_mask,
                        double opd_kl_coef) {
  constexpr std::string_view fn = "rl::apply_opd";
  detail::require_cpu(fn, advantages);
  SLIME_CHECK(advantages.dim() == 1, fn, ": advantages must be 1-d [tokens], got ", advantages.str());
  const int64_t n = advantages.size(0);
  detail::check_token_tensor(fn, advantages, DType::f32, n, "advantages");
  detail::check_token_tensor(fn, student_lp, DType::f32, n, "student_lp");
  detail::check_token_tensor(fn, teacher_lp, DType::f32, n, "teacher_lp");
  detail::check_token_tensor(fn, loss_mask, DType::u8, n, "loss_mask");
  Tensor reverse_kl = Tensor::empty(Shape{n}, DType::f32);
  (void)cpu::apply_opd<float>(student_lp.data<float>(), teacher_lp.data<float>(), loss_mask.data<uint8_t>(), n,
                              opd_kl_coef, advantages.data<float>(), reverse_kl.data<float>());
  return reverse_kl;
}

}  // namespace slime::rl
