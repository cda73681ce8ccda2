// slime/ops/cpu/router.hpp: CPU reference of the Qwen3-MoE router (softmax
// over experts, top-k, optional renormalisation) and of the load-balancing
// auxiliary loss, forward and backward, on raw pointers; the loss is written
// as statistics (router_aux_stats) and the loss and gradient from them, which
// also serve rows sharded over data-parallel ranks (see ops/router.hpp).
//
// Accumulation contract: parameter gradients accumulate (`+=`) in fp32 (the
// router has none here; the gate weight's gradient is a Linear's); activation
// gradients are written (`=`), or added (`+=`) where a function takes
// `accumulate` and it is true.
//
// Follows transformers' modeling_qwen3_moe.py (commit 00d4b3d2142c, the file
// generated from modular_qwen3_moe.py):
//   Qwen3MoeSparseMoeBlock.forward:
//     router_logits   = self.gate(hidden_states)             (hidden dtype)
//     routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
//     routing_weights, selected_experts = torch.topk(routing_weights, top_k)
//     if norm_topk_prob: routing_weights /= routing_weights.sum(-1, keepdim)
//     routing_weights = routing_weights.to(hidden_states.dtype)
//   load_balancing_loss_func (attention_mask = None):
//     p = softmax(gate_logits); selected = topk(p, top_k)
//     tokens_per_expert [k, E] = mean over rows of one_hot(selected)
//     router_prob_per_expert [E] = mean over rows of p
//     loss = num_experts * Σ tokens_per_expert · router_prob_per_expert
//          = E · Σ_e (count_e / N) · (Σ_t p[t, e] / N)
//   where count_e = how many of the N·k (row, slot) choices picked e (so a
//   perfectly balanced router gives loss = k, not 1).
// Probabilities are kept in P (float, or double for the finite-difference
// tests). Top-k ties go to the lower expert index (torch.topk leaves the
// order of ties unspecified).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// The probability / accumulator type for logits of type T.
template <class T>
using router_acc_t = memops::acc_t<T>;

// For each of `tokens` rows of logits [tokens, experts]:
//   probs[t, :]    = softmax(logits[t, :])                      (in P)
//   indices[t, j]  = the expert with the j-th largest probability
//   weights[t, j]  = probs[t, indices[t, j]], divided by Σ_j of those when
//                    norm_topk_prob; rounded once into TW.
// Requires 1 <= k <= experts.
// Routing replay (`replay`): indices are read instead of written, the experts
// a rollout engine chose; weights[t, j] = probs[t, indices[t, j]] (divided by
// the sum of those when norm_topk_prob; a row whose sum is 0, e.g. with no
// valid id, gets weights 0), with an id outside [0, experts) weighted 0 and
// left out of the sum. Replaying the top-k gives the same weights bit for bit.
template <class T, class P, class TW>
void router_forward(const T* logits, int64_t tokens, int64_t experts, int64_t k, bool norm_topk_prob, P* probs,
                    int32_t* indices, TW* weights, bool replay = false) {
  std::vector<char> taken(static_cast<std::size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const T* l = logits + t * experts;
    P* p = probs + t * experts;
    P mx = memops::to_acc<P>(l[0]);
    for (int64_t e = 1; e < experts; ++e) mx = std::fmax(mx, memops::to_acc<P>(l[e]));
    P sum = 0;
    for (int64_t e = 0; e < experts; ++e) {
      p[e] = std::exp(memops::to_acc<P>(l[e]) - mx);
      sum += p[e];
    }
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    if (replay) {
      const int32_t* idx = indices + t * k;
      auto chosen = [&](int64_t j) { return idx[j] >= 0 && idx[j] < experts ? p[idx[j]] : P(0); };
      P sel_sum = 0;
      for (int64_t j = 0; j < k; ++j) sel_sum += chosen(j);
      for (int64_t j = 0; j < k; ++j)
        weights[t * k + j] =
            memops::from_acc<TW>(norm_topk_prob ? (sel_sum > P(0) ? chosen(j) / sel_sum : P(0)) : chosen(j));
      continue;
    }
    std::fill(taken.begin(), taken.end(), char(0));
    P sel_sum = 0;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[std::size_t(e)] && (best < 0 || p[e] > p[best])) best = e;
      taken[std::size_t(best)] = 1;
      indices[t * k + j] = int32_t(best);
      sel_sum += p[best];
    }
    for (int64_t j = 0; j < k; ++j) {
      const P w = p[indices[t * k + j]];
      weights[t * k + j] = memops::from_acc<TW>(norm_topk_prob ? w / sel_sum : w);
    }
  }
}

// Gradient of router_forward's weights with respect to the logits, the top-k
// selection held constant (it is not differentiable):
//   dp[e]  = Σ_j [indices[t, j] = e] · g_j, with g_j = dweights[t, j], or with
//            renormalisation (w_j = p_j / S, S = Σ_i p_i) g_j = (dw_j − Σ_i dw_i w_i) / S
//   dlogits[t, e] = p[e] · (dp[e] − Σ_f p[f] dp[f])   (= or += with accumulate)
template <class P, class TW, class TG>
void router_backward(const P* probs, const int32_t* indices, const TW* dweights, int64_t tokens, int64_t experts,
                     int64_t k, bool norm_topk_prob, TG* dlogits, bool accumulate = false) {
  std::vector<P> dp(static_cast<std::size_t>(experts));
  for (int64_t t = 0; t < tokens; ++t) {
    const P* p = probs + t * experts;
    const int32_t* idx = indices + t * k;
    const TW* dw = dweights + t * k;
    std::fill(dp.begin(), dp.end(), P(0));
    if (norm_topk_prob) {
      P s = 0, c = 0;
      for (int64_t j = 0; j < k; ++j) s += p[idx[j]];
      for (int64_t j = 0; j < k; ++j) c += memops::to_acc<P>(dw[j]) * (p[idx[j]] / s);
      for (int64_t j = 0; j < k; ++j) dp[std::size_t(idx[j])] += (memops::to_acc<P>(dw[j]) - c) / s;
    } else {
      for (int64_t j = 0; j < k; ++j) dp[std::size_t(idx[j])] += memops::to_acc<P>(dw[j]);
    }
    P dot = 0;
    for (int64_t e = 0; e < experts; ++e) dot += p[e] * dp[std::size_t(e)];
    TG* out = dlogits + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      const P g = p[e] * (dp[std::size_t(e)] - dot);
      out[e] = memops::from_acc<TG>(accumulate ? memops::to_acc<P>(out[e]) + g : g);
    }
  }
}

// The auxiliary loss's statistics over `rows` rows, in one flat [2E + 1]
// vector so that a sum over shards of the rows (one all_reduce) makes them
// those of all the rows (E = experts):
//   stats[e]      = count_e, how many of the rows' (row, slot) choices picked e
//   stats[E + e]  = Σ_t probs[t, e], summed over the rows in order
//   stats[2E]     = rows
// Counts are counted in int64 and rounded once into P.
template <class P>
void router_aux_stats(const P* probs, const int32_t* indices, int64_t rows, int64_t experts, int64_t k, P* stats) {
  std::vector<int64_t> counts(static_cast<std::size_t>(experts), 0);
  P* prob_sum = stats + experts;
  std::fill(prob_sum, prob_sum + experts, P(0));
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t j = 0; j < k; ++j) ++counts[std::size_t(indices[t * k + j])];
    for (int64_t e = 0; e < experts; ++e) prob_sum[e] += probs[t * experts + e];
  }
  for (int64_t e = 0; e < experts; ++e) stats[e] = P(counts[std::size_t(e)]);
  stats[2 * experts] = P(rows);
}

// loss = E · Σ_e (count_e / N) · (prob_sum_e / N) from stats [2E + 1]
// (router_aux_stats's layout), N = stats[2E]; 0 when N = 0 (transformers
// would give NaN, a mean over nothing).
template <class P>
P router_aux_loss_from_stats(const P* stats, int64_t experts) {
  const P n = stats[2 * experts];
  if (n == P(0)) return P(0);
  P loss = 0;
  for (int64_t e = 0; e < experts; ++e) loss += (stats[e] / n) * (stats[experts + e] / n);
  return P(experts) * loss;
}

// dlogits [rows, E] of dloss · loss for `rows` rows of probs, the loss being
// that of the (possibly larger) set of N rows that stats [2E + 1] describes
// (N = stats[2E]; these rows among them). Through the mean probabilities only
// (the counts come from top-k and are constant): with g_e = dloss · E ·
// count_e / N², dlogits[t, e] = p[t, e] · (g_e − Σ_f p[t, f] g_f) (= or +=
// with accumulate); g = 0 when N = 0.
template <class P, class TG>
void router_aux_loss_backward_from_stats(const P* probs, int64_t rows, int64_t experts, const P* stats, P dloss,
                                         TG* dlogits, bool accumulate = false) {
  const P n = stats[2 * experts];
  std::vector<P> g(static_cast<std::size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) g[std::size_t(e)] = n == P(0) ? P(0) : dloss * P(experts) * stats[e] / (n * n);
  for (int64_t t = 0; t < rows; ++t) {
    const P* p = probs + t * experts;
    P dot = 0;
    for (int64_t e = 0; e < experts; ++e) dot += p[e] * g[std::size_t(e)];
    TG* out = dlogits + t * experts;
    for (int64_t e = 0; e < experts; ++e) {
      const P d = p[e] * (g[std::size_t(e)] - dot);
      out[e] = memops::from_acc<TG>(accumulate ? memops::to_acc<P>(out[e]) + d : d);
    }
  }
}

// The auxiliary loss over `rows` rows: router_aux_loss_from_stats of their
// router_aux_stats.
template <class P>
P router_aux_loss_forward(const P* probs, const int32_t* indices, int64_t rows, int64_t experts, int64_t k) {
  std::vector<P> stats(static_cast<std::size_t>(2 * experts + 1));
  router_aux_stats(probs, indices, rows, experts, k, stats.data());
  return router_aux_loss_from_stats(stats.data(), experts);
}

// dlogits [rows, E] of dloss · router_aux_loss_forward over the same rows (=
// or += with accumulate).
template <class P, class TG>
void router_aux_loss_backward(const P* probs, const int32_t* indices, int64_t rows, int64_t experts, int64_t k, P dloss,
                              TG* dlogits, bool accumulate = false) {
  if (rows == 0) return;
  std::vector<P> stats(static_cast<std::size_t>(2 * experts + 1));
  router_aux_stats(probs, indices, rows, experts, k, stats.data());
  router_aux_loss_backward_from_stats(probs, rows, experts, stats.data(), dloss, dlogits, accumulate);
}

}  // namespace slime::ops::cpu
