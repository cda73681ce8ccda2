// slime/ops/cpu/token_logprobs.hpp: CPU reference (the specification) of the
// fused lm-head + log-softmax + entropy op of slime/ops/token_logprobs.hpp.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32 (or
// double) buffers; activation gradients are written (`=`).
//
// Per token t, with logits z = (h[t] . W^T) / temperature over the vocabulary:
//   lse[t]      = log sum_v exp(z_v)
//   logprob[t]  = z_target - lse[t]
//   entropy[t]  = lse[t] - sum_v p_v z_v            (p = softmax(z))
// Backward, with mu = sum_v p_v z_v = lse - entropy:
//   d logprob / d z_v = [v = target] - p_v
//   d entropy / d z_v = p_v (mu - z_v)
//   dz_v = g_lp (1[v = target] - p_v) + g_ent p_v (mu - z_v)
//   dh[t] = sum_v dz_v W[v] / temperature,  dW[v] += sum_t dz_v h[t] / temperature
//
// The forward walks the vocabulary in chunks of `vocab_chunk` with an online
// log-sum-exp, exactly as the GPU does, so no [tokens, vocab] buffer exists;
// the chunk size changes results only by rounding. Accumulation is in float
// for float/bf16 inputs and in double for double (finite-difference tests).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/half.hpp"

namespace slime::ops::cpu {

// The accumulation (and output) type of the reference for element type T.
template <class T>
using token_logprobs_acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

inline constexpr int64_t kTokenLogprobsCpuVocabChunk = 4096;

namespace token_logprobs_detail {

template <class Acc, class T>
Acc to_acc(T x) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    return Acc(float(x));
  } else {
    return Acc(x);
  }
}

template <class T, class Acc>
T from_acc(Acc x) {
  if constexpr (std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>) {
    return T(float(x));
  } else {
    return T(x);
  }
}

template <class Acc, class T>
Acc dot(const T* a, const T* b, int64_t n) {
  Acc s = 0;
  for (int64_t i = 0; i < n; ++i) s += to_acc<Acc>(a[i]) * to_acc<Acc>(b[i]);
  return s;
}

// Online log-sum-exp with the entropy term, relative to the running max m:
//   s = sum exp(z - m),  a = sum exp(z - m) (z - m)
// so that lse = m + log s and entropy = log s - a / s, with no cancellation
// between two large numbers when the logits are large.
template <class Acc>
struct LseState {
  Acc m = -std::numeric_limits<Acc>::infinity();
  Acc s = 0;
  Acc a = 0;
};

// Merges a chunk's state (already relative to its own max) into `x`.
template <class Acc>
void merge(LseState<Acc>& x, const LseState<Acc>& c) {
  if (x.s == 0) {
    x = c;
    return;
  }
  const Acc m = std::max(x.m, c.m);
  const Acc ex = std::exp(x.m - m), ec = std::exp(c.m - m);
  x.a = ex * (x.a + x.s * (x.m - m)) + ec * (c.a + c.s * (c.m - m));
  x.s = ex * x.s + ec * c.s;
  x.m = m;
}

template <class Idx>
void check_target(Idx target, int64_t token, int64_t vocab) {
  SLIME_CHECK(int64_t(target) >= 0 && int64_t(target) < vocab, "token_logprobs: targets[", token,
              "] = ", int64_t(target), " is outside the vocabulary [0, ", vocab, ")");
}

}  // namespace token_logprobs_detail

// hidden [tokens, dim], weight [vocab, dim], targets [tokens] in [0, vocab)
// -> logprobs, entropy, lse [tokens]. Throws for a target out of range.
template <class T, class Idx>
void token_logprobs_forward(const T* hidden, const T* weight, const Idx* targets, int64_t tokens, int64_t dim,
                            int64_t vocab, token_logprobs_acc_t<T> temperature, token_logprobs_acc_t<T>* logprobs,
                            token_logprobs_acc_t<T>* entropy, token_logprobs_acc_t<T>* lse,
                            int64_t vocab_chunk = kTokenLogprobsCpuVocabChunk) {
  using Acc = token_logprobs_acc_t<T>;
  namespace d = token_logprobs_detail;
  SLIME_CHECK(vocab > 0 && dim > 0 && vocab_chunk > 0, "token_logprobs_forward: vocab ", vocab, ", dim ", dim,
              ", vocab_chunk ", vocab_chunk, " must be positive");
  const Acc inv_temperature = Acc(1) / temperature;
  const int64_t chunk = std::min(vocab_chunk, vocab);
  std::vector<Acc> z(static_cast<std::size_t>(chunk));  // one chunk of one token's logits
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t target = int64_t(targets[t]);
    d::check_target(targets[t], t, vocab);
    const T* h = hidden + t * dim;
    d::LseState<Acc> state;
    Acc z_target = 0;
    for (int64_t v0 = 0; v0 < vocab; v0 += chunk) {
      const int64_t n = std::min(chunk, vocab - v0);
      Acc m = -std::numeric_limits<Acc>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        z[j] = d::dot<Acc>(h, weight + (v0 + j) * dim, dim) * inv_temperature;
        m = std::max(m, z[j]);
      }
      d::LseState<Acc> c{m, 0, 0};
      for (int64_t j = 0; j < n; ++j) {
        const Acc e = std::exp(z[j] - m);
        c.s += e;
        c.a += e * (z[j] - m);
      }
      d::merge(state, c);
      if (target >= v0 && target < v0 + n) z_target = z[target - v0];
    }
    const Acc log_s = std::log(state.s);
    lse[t] = state.m + log_s;
    entropy[t] = log_s - state.a / state.s;
    logprobs[t] = z_target - lse[t];
  }
}

// Backward of token_logprobs_forward from its saved lse and entropy [tokens].
// maybe_grad_logprobs / maybe_grad_entropy [tokens]: nullptr means zero.
// maybe_grad_hidden [tokens, dim] is written; maybe_grad_weight [vocab, dim]
// is accumulated (+=); either may be nullptr (not wanted).
template <class T, class Idx>
void token_logprobs_backward(const T* hidden, const T* weight, const Idx* targets, int64_t tokens, int64_t dim,
                             int64_t vocab, token_logprobs_acc_t<T> temperature, const token_logprobs_acc_t<T>* lse,
                             const token_logprobs_acc_t<T>* entropy, const token_logprobs_acc_t<T>* maybe_grad_logprobs,
                             const token_logprobs_acc_t<T>* maybe_grad_entropy, T* maybe_grad_hidden,
                             token_logprobs_acc_t<T>* maybe_grad_weight) {
  using Acc = token_logprobs_acc_t<T>;
  namespace d = token_logprobs_detail;
  SLIME_CHECK(vocab > 0 && dim > 0, "token_logprobs_backward: vocab ", vocab, " and dim ", dim, " must be positive");
  const Acc inv_temperature = Acc(1) / temperature;
  std::vector<Acc> dh(static_cast<std::size_t>(dim));
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t target = int64_t(targets[t]);
    d::check_target(targets[t], t, vocab);
    const T* h = hidden + t * dim;
    const Acc g_lp = maybe_grad_logprobs ? maybe_grad_logprobs[t] : Acc(0);
    const Acc g_ent = maybe_grad_entropy ? maybe_grad_entropy[t] : Acc(0);
    const Acc mu = lse[t] - entropy[t];  // sum_v p_v z_v
    std::fill(dh.begin(), dh.end(), Acc(0));
    for (int64_t v = 0; v < vocab; ++v) {
      const T* w = weight + v * dim;
      const Acc z = d::dot<Acc>(h, w, dim) * inv_temperature;
      const Acc p = std::exp(z - lse[t]);
      const Acc dz = g_lp * ((v == target ? Acc(1) : Acc(0)) - p) + g_ent * p * (mu - z);
      const Acc c = dz * inv_temperature;  // d loss / d (h . w_v)
      if (maybe_grad_hidden)
        for (int64_t i = 0; i < dim; ++i) dh[i] += c * d::to_acc<Acc>(w[i]);
      if (maybe_grad_weight) {
        Acc* gw = maybe_grad_weight + v * dim;
        for (int64_t i = 0; i < dim; ++i) gw[i] += c * d::to_acc<Acc>(h[i]);
      }
    }
    if (maybe_grad_hidden)
      for (int64_t i = 0; i < dim; ++i) maybe_grad_hidden[t * dim + i] = d::from_acc<T>(dh[i]);
  }
}

}  // namespace slime::ops::cpu
