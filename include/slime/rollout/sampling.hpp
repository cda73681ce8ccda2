// slime/rollout/sampling.hpp: next-token sampling (temperature, top-k, top-p)
// from one row of logits, with a random stream keyed by (seed, sample id,
// step), so a sample's tokens never depend on what else is in the batch.
//
// Given logits z [V] (fp32):
//   temperature == 0: greedy, argmax z (ties: the lowest token id);
//   otherwise keep the top_k most probable tokens (top_k = 0: all), then the
//   smallest prefix of them, in order of decreasing probability (ties: lower
//   id first), whose mass under softmax(z / temperature) reaches top_p
//   (top_p = 1: all), and return the argmax over the kept tokens of
//   z_v / temperature + g_v, g_v Gumbel noise from Philox word
//   step * vocab + v of the stream keyed by (seed, sample id) (the Gumbel-max
//   trick: exactly a draw from the kept tokens' renormalised softmax). The
//   CUDA sampler (plain temperature and greedy) computes the same argmax.
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

// True when top-k or top-p removes tokens (the device sampler handles only
// plain temperature sampling and greedy decoding).
inline bool has_filter(const SamplingParams& p, int64_t vocab) {
  return (p.top_k > 0 && p.top_k < vocab) || p.top_p < 1.f;
}

// The Philox key of a sample's stream: (seed, sample id) mixed by splitmix64
// so neighbouring ids get unrelated streams.
inline uint64_t sample_stream_key(uint64_t seed, uint64_t sample_id) {
  uint64_t z = seed ^ (sample_id + 0x9e3779b97f4a7c15ull + (seed << 6) + (seed >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// The Gumbel noise of token v at a sample's step: -log(-log(u)), u in (0, 1)
// from Philox word step * vocab + v of the sample's stream. Host and device
// compute it alike (double logs; the two libms may differ in the last bit).
SLIME_HOST_DEVICE float gumbel_noise(uint64_t key, int64_t step, int64_t vocab, int64_t v) {
  const uint32_t w = philox_word(key, uint64_t(step) * uint64_t(vocab) + uint64_t(v));
  const double u = (double(w >> 8) + 0.5) * (1.0 / 16777216.0);  // (0, 1), never 0 or 1
  return float(-log(-log(u)));
}

// Samples a token id from logits [vocab] (Gumbel-max: the argmax over the kept
// tokens of z / temperature + Gumbel noise is distributed as their softmax).
// `scratch` is reused between calls.
inline int32_t sample_token(const float* logits, int64_t vocab, const SamplingParams& p, uint64_t seed,
                            uint64_t sample_id, int64_t step, std::vector<int32_t>& scratch) {
  SLIME_CHECK(vocab >= 1, "sample_token: empty vocabulary");
  if (p.temperature == 0.f) {
    int64_t best = 0;
    for (int64_t v = 1; v < vocab; ++v)
      if (logits[v] > logits[best]) best = v;
    return int32_t(best);
  }
  const float inv_t = 1.f / p.temperature;
  const uint64_t key = sample_stream_key(seed, sample_id);
  auto score = [&](int64_t v) { return logits[v] * inv_t + gumbel_noise(key, step, vocab, v); };
  auto argmax_over = [&](auto&& ids, int64_t n) {
    int64_t best = ids(0);
    float best_score = score(best);
    for (int64_t i = 1; i < n; ++i) {
      const int64_t v = ids(i);
      const float s = score(v);
      if (s > best_score || (s == best_score && v < best)) {
        best = v;
        best_score = s;
      }
    }
    return int32_t(best);
  };
  if (!has_filter(p, vocab)) return argmax_over([](int64_t i) { return i; }, vocab);
  // The kept set: the top_k most probable tokens, then the smallest prefix of
  // them (by decreasing probability, ties by id) whose mass reaches top_p.
  scratch.resize(std::size_t(vocab));
  std::iota(scratch.begin(), scratch.end(), 0);
  const auto by_prob = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  const int64_t k = (p.top_k > 0 && p.top_k < vocab) ? p.top_k : vocab;
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), by_prob);
  int64_t keep = k;
  if (p.top_p < 1.f) {
    const double zmax = double(logits[scratch[0]]) * inv_t;
    double total = 0;
    for (int64_t v = 0; v < vocab; ++v) total += std::exp(double(logits[v]) * inv_t - zmax);
    double mass = 0;
    for (int64_t i = 0; i < k; ++i) {
      mass += std::exp(double(logits[scratch[std::size_t(i)]]) * inv_t - zmax) / total;
      if (mass >= double(p.top_p)) {
        keep = i + 1;
        break;
      }
    }
  }
  return argmax_over([&](int64_t i) { return int64_t(scratch[std::size_t(i)]); }, keep);
}

}  // namespace slime::rollout
