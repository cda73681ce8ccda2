// step_metrics.hpp (qwen3_moe_rl example): what a step measures, as one
// struct. Counts are int64 and sums double, reduced across ranks exactly as
// they are: one all_gather of the fields' 64-bit words, then every rank
// combines them in rank order (the same bits on every rank, token counts
// exact far beyond float's 2^24). rank 0 logs the result under the names of
// metrics.jsonl (tools/plot_metrics.py groups them by name).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/metrics_log.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/logprob_mismatch.hpp"
#include "slime/rl/policy_loss.hpp"

namespace rl_example {

enum class Reduce { sum, max };

// `values` (int64 or double words) reduced over the ranks of `comm`, each
// value by its op: one all_gather, then rank order (deterministic).
template <class Visit>
void reduce_over_ranks(slime::comm::Comm& comm, Visit&& visit) {
  std::vector<int64_t> words;
  visit([&](auto& v, Reduce) { words.push_back(std::bit_cast<int64_t>(v)); });
  const int64_t n = int64_t(words.size()), W = comm.size();
  const slime::Tensor mine = slime::Tensor::from_vector(words, {n}, comm.device());
  slime::Tensor all = slime::Tensor::empty({W * n}, slime::DType::i64, comm.device());
  comm.all_gather(mine, all);
  const std::vector<int64_t> g = all.to_vector<int64_t>();
  std::size_t i = 0;
  visit([&](auto& v, Reduce op) {
    using T = std::remove_reference_t<decltype(v)>;
    T acc = std::bit_cast<T>(g[i]);
    for (int64_t r = 1; r < W; ++r) {
      const T x = std::bit_cast<T>(g[std::size_t(r * n) + i]);
      acc = op == Reduce::max ? std::max(acc, x) : acc + x;
    }
    v = acc;
    ++i;
  });
}

// Sums of doubles over the ranks (e.g. the moments of a global whitening).
inline void sum_over_ranks(slime::comm::Comm& comm, std::span<double> values) {
  reduce_over_ranks(comm, [&](auto&& f) {
    for (double& v : values) f(v, Reduce::sum);
  });
}

struct StepMetrics {
  // Reduced over the ranks (see for_each_reduced).
  int64_t samples = 0;                      // responses
  int64_t tokens = 0;                       // tokens trained on (prompt + response)
  int64_t response_tokens = 0;              // of them, response tokens (the loss's)
  double reward = 0;                        // sum over the responses
  slime::rl::PolicyLossMetrics loss;        // additive (global normalisers)
  slime::rl::ImportanceMetrics importance;  // additive
  slime::rl::LogprobMismatch on_policy;     // trainer vs engine logprobs of the sampled tokens
  int64_t routing_rows = 0;                 // --routing measure: (token, sparse layer) pairs compared
  int64_t routing_agreed = 0;               // of them, those where the trainer's router chose the engine's experts
  double opd_reverse_kl = 0;                // --teacher: Σ (student lp - teacher lp) over the response tokens
  int64_t peak_memory_bytes = 0;            // the step's device high-water mark, max over ranks
  // This rank's (rank 0 logs its own).
  double lr = 0;
  double grad_norm = 0;
  double rollout_seconds = 0, train_seconds = 0, sync_seconds = 0, step_seconds = 0;

  template <class F>
  void for_each_reduced(F&& f) {
    f(samples, Reduce::sum);
    f(tokens, Reduce::sum);
    f(response_tokens, Reduce::sum);
    f(reward, Reduce::sum);
    f(loss.loss, Reduce::sum);
    f(loss.pg_loss, Reduce::sum);
    f(loss.entropy, Reduce::sum);
    f(loss.kl, Reduce::sum);
    f(loss.ppo_kl, Reduce::sum);
    f(loss.clip_fraction, Reduce::sum);
    f(loss.dual_clip_fraction, Reduce::sum);
    f(importance.tokens, Reduce::sum);
    f(importance.kept, Reduce::sum);
    f(importance.rejected, Reduce::sum);
    f(importance.clipped, Reduce::sum);
    f(importance.weight_sum, Reduce::sum);
    f(importance.abs_dev_sum, Reduce::sum);
    f(importance.trainer_lp_sum, Reduce::sum);
    f(importance.rollout_lp_sum, Reduce::sum);
    f(importance.k3_sum, Reduce::sum);
    f(on_policy.tokens, Reduce::sum);
    f(on_policy.mismatched, Reduce::sum);
    f(on_policy.abs_diff_sum, Reduce::sum);
    f(on_policy.abs_diff_max, Reduce::max);
    f(routing_rows, Reduce::sum);
    f(routing_agreed, Reduce::sum);
    f(opd_reverse_kl, Reduce::sum);
    f(peak_memory_bytes, Reduce::max);
  }

  // The sums of every rank (collective over `comm`).
  void reduce(slime::comm::Comm& comm) {
    reduce_over_ranks(comm, [&](auto&& f) { for_each_reduced(f); });
  }

  // What metrics.jsonl holds for the step (names kept stable: the plots and
  // the CI checks read them).
  slime::io::Scalars scalars() const {
    const double n = double(std::max<int64_t>(samples, 1));
    const slime::rl::ImportanceMetrics& im = importance;
    slime::io::Scalars out{{"reward", reward / n},
                           {"loss", loss.loss},
                           {"pg_loss", loss.pg_loss},
                           {"kl", loss.kl},
                           {"entropy", loss.entropy},
                           {"clip_fraction", loss.clip_fraction},
                           {"importance_weight_mean", im.kept > 0 ? im.weight_sum / im.kept : 1.0},
                           {"importance_clip_fraction", im.tokens > 0 ? im.clipped / im.tokens : 0.0},
                           {"kl_rollout_k3", im.tokens > 0 ? im.k3_sum / im.tokens : 0.0},
                           // the engine/trainer logprob gap over the response tokens (all 0: true on-policy)
                           {"logprob_diff_max", on_policy.max_abs_diff()},
                           {"logprob_diff_mean", on_policy.mean_abs_diff()},
                           {"logprob_mismatch_fraction", on_policy.mismatch_fraction()},
                           // --teacher: the mean reverse KL (k1) to the teacher per response token (0 without)
                           {"opd_reverse_kl", response_tokens > 0 ? opd_reverse_kl / double(response_tokens) : 0.0},
                           {"tokens", double(tokens)},
                           {"response_length", double(response_tokens) / n},
                           {"lr", lr},
                           {"grad_norm", grad_norm},
                           // rank 0's wall time of the step's phases
                           {"rollout_seconds", rollout_seconds},
                           {"train_seconds", train_seconds},
                           {"sync_seconds", sync_seconds},
                           {"peak_memory_bytes", double(peak_memory_bytes)},
                           {"step_seconds", step_seconds},
                           {"tokens_per_s", double(tokens) / std::max(step_seconds, 1e-9)}};
    // --routing measure: the fraction of (token, sparse layer) pairs whose
    // experts the trainer's router chose as the engine did (1: on-policy routing)
    if (routing_rows > 0) out.emplace_back("routing_agreement", double(routing_agreed) / double(routing_rows));
    return out;
  }
};

}  // namespace rl_example
