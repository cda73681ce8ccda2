// Helpers of the rollout tests: bitwise comparison of completions.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <cstdint>
#include <cstring>
#include <vector>

#include "slime/rollout/engine.hpp"

namespace rollout_test {

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// The same tokens, finish reasons and logprob bits, request by request.
inline void require_same(const std::vector<slime::rollout::Completion>& a,
                         const std::vector<slime::rollout::Completion>& b) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("request " << i);
    CHECK(a[i].finish == b[i].finish);
    REQUIRE(a[i].tokens == b[i].tokens);
    for (std::size_t j = 0; j < a[i].logprobs.size(); ++j) CHECK(same_bits(a[i].logprobs[j], b[i].logprobs[j]));
  }
}

// The trainer's targets for the packed prompt + completion of every request:
// each sequence's tokens shifted by one (the last token is never an input).
inline std::vector<int32_t> next_token_targets(const std::vector<slime::rollout::Request>& requests,
                                               const std::vector<slime::rollout::Completion>& out) {
  std::vector<int32_t> targets;
  for (std::size_t i = 0; i < requests.size(); ++i) {
    std::vector<int32_t> full = requests[i].prompt;
    full.insert(full.end(), out[i].tokens.begin(), out[i].tokens.end());
    targets.insert(targets.end(), full.begin() + 1, full.end());
  }
  return targets;
}

}  // namespace rollout_test
