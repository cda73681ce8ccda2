// slime/rollout/sampling.hpp: next-token sampling (temperature, top-k, top-p)
// from one row of logits, with a random stream keyed by (seed, sample id,
// step), so a sample's tokens never depend on what else is in the batch.
//
// Given logits z [V] (fp32):
//   temperature == 0: greedy, argmax z (ties: the lowest token id);
//   otherwise p = softmax(z / temperature) in double; keep the top_k most
//   probable tokens (top_k = 0: all), then the smallest prefix of them, in
//   order of decreasing probability (ties: lower id first), whose mass reaches
//   top_p (top_p = 1: all); renormalise and draw by inverse CDF over that
//   order with u = uniform01(philox_word(key(seed, sample id), step)).
// The logprob a trainer sees is not computed here: the engine reports
// log softmax(z / temperature)[token] over the full vocabulary (the quantity
// the trainer recomputes), via the same fused op the trainer uses.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/random.hpp"

namespace slime::rollout {

struct SamplingParams {
  float temperature = 1.f;           // 0: greedy
  float top_p = 1.f;                 // (0, 1]
  int64_t top_k = 0;                 // 0: no top-k filter
  int64_t max_new_tokens = 64;       // >= 1
  std::vector<int32_t> stop_tokens;  // generation ends after emitting one of these (it is kept)

  void validate(const std::string& where) const {
    SLIME_CHECK(std::isfinite(temperature) && temperature >= 0.f, where, ": temperature must be >= 0, got ",
                temperature);
    SLIME_CHECK(top_p > 0.f && top_p <= 1.f, where, ": top_p must be in (0, 1], got ", top_p);
    SLIME_CHECK(top_k >= 0, where, ": top_k must be >= 0 (0 disables it), got ", top_k);
    SLIME_CHECK(max_new_tokens >= 1, where, ": max_new_tokens must be >= 1, got ", max_new_tokens);
  }
};

// The Philox key of a sample's stream: (seed, sample id) mixed by splitmix64
// so neighbouring ids get unrelated streams.
inline uint64_t sample_stream_key(uint64_t seed, uint64_t sample_id) {
  uint64_t z = seed ^ (sample_id + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Samples a token id from logits [vocab] as described above. `scratch` is
// reused between calls (no allocation in steady state once it is large enough).
inline int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t seed,
                            uint64_t sample_id, int64_t step, std::vector<int32_t>& scratch) {
  SLIME_CHECK(vocab >= 1, "sample_token: empty vocabulary");
  if (p.temperature == 0.f) {
    int64_t best = 0;
    for (int64_t v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    return int32_t(best);
  }
  const double inv_t = 1.0 / double(p.temperature);
  double zmax = -INFINITY;
  for (int64_t v = 0; v < vocab; ++v) zmax = std::max(zmax, double(logits[v]) * inv_t);
  SLIME_CHECK(std::isfinite(zmax), "sample_token: the logits hold no finite value (max ", zmax, ")");
  // Candidates in order of decreasing logit (= probability), ties by id.
  scratch.resize(std::size_t(vocab));
  std::iota(scratch.begin(), scratch.end(), 0);
  const auto by_prob = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  if (k < vocab) {
    std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), by_prob);
  } else if (p.top_p < 1.f) {
    std::sort(scratch.begin(), scratch.end(), by_prob);
  }
  // Unnormalised probabilities exp(z/T - max) of the kept candidates.
  double total = 0;
  for (int64_t v = 0; v < vocab; ++v) total += std::exp(double(logits[v]) * inv_t - zmax);
  int64_t keep = k;
  if (p.top_p < 1.f) {
    double mass = 0;
    for (int64_t i = 0; i < k; ++i) {
      mass += std::exp(double(logits[scratch[std::size_t(i)]]) * inv_t - zmax) / total;
      if (mass >= double(p.top_p)) {
        keep = i + 1;
        break;
      }
    }
  }
  double kept = 0;
  for (int64_t i = 0; i < keep; ++i) kept += std::exp(double(logits[scratch[std::size_t(i)]]) * inv_t - zmax);
  const double u = double(uniform01(philox_word(sample_stream_key(seed, sample_id), uint64_t(step)))) * kept;
  double acc = 0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += std::exp(double(logits[scratch[std::size_t(i)]]) * inv_t - zmax);
    if (u < acc) return scratch[std::size_t(i)];
  }
  return scratch[std::size_t(keep - 1)];  // u rounded up to the total
}

}  // namespace slime::rollout
