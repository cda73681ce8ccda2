// tests/data/rollout_lengths.hpp: synthetic RL rollout batches (sample lengths
// and prompt groups) with the long tail of real rollouts, shared by the packer
// tests and bench/bench_packer.cpp.
//
// Each prompt has `group_size` responses (GRPO-style groups, one prompt length
// per group). Prompt lengths are log-normal (median 300 tokens, sigma 0.7)
// clipped to [16, max_prompt]; response lengths are log-normal (median 1200,
// sigma 1.0) clipped to [1, max_response], so a few percent hit the cap, as
// truncated responses do. Mean sample length is about 2,300 tokens. Drawn from
// slime's Philox normals: the same batch on every machine.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "slime/core/random.hpp"

namespace slime::data::testing {

struct RolloutBatch {
  std::vector<int64_t> lengths;      // prompt + response tokens
  std::vector<int64_t> group_index;  // sample i belongs to prompt i / group_size
};

inline RolloutBatch rollout_lengths(int64_t n, uint64_t seed, int group_size = 8, int64_t max_prompt = 4096,
                                    int64_t max_response = 16384) {
  RolloutBatch b;
  b.lengths.resize(static_cast<std::size_t>(n));
  b.group_index.resize(static_cast<std::size_t>(n));
  int64_t prompt = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t g = i / group_size;
    if (i % group_size == 0) {
      const double z = double(random_normal(seed, uint64_t(2 * g)));
      prompt = std::clamp<int64_t>(int64_t(std::lround(300.0 * std::exp(0.7 * z))), 16, max_prompt);
    }
    const double z = double(random_normal(seed ^ 0x9e3779b97f4a7c15ull, uint64_t(i)));
    const int64_t response = std::clamp<int64_t>(int64_t(std::lround(1200.0 * std::exp(1.0 * z))), 1, max_response);
    b.lengths[std::size_t(i)] = prompt + response;
    b.group_index[std::size_t(i)] = g;
  }
  return b;
}

}  // namespace slime::data::testing
