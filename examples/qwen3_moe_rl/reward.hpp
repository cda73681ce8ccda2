// The reward of a response to a prompt from a JSONL dataset (--prompts): the
// function users of the example write. This one gives partial credit for
// matching the reference answer token by token: the dataset's "label" is a
// list of token ids, and the reward is the fraction of its positions the
// response reproduces (1.0 for an exact match; tokens after the label's length
// are ignored). Replace it with your verifier: a math checker, unit tests run
// on generated code, a reward model, ... It runs on the rank that sampled the
// response, once per sample, on the host.
#pragma once

#include <cstdint>
#include <span>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"

namespace rl_example {

inline double user_reward(std::span<const int32_t> prompt, std::span<const int32_t> response,
                          const nlohmann::json& label) {
  (void)prompt;
  SLIME_CHECK(label.is_array() && !label.empty(),
              "user_reward: the dataset's \"label\" must be a non-empty list of token ids, got ", label.dump());
  int64_t hits = 0;
  for (std::size_t i = 0; i < label.size(); ++i) hits += i < response.size() && label[i].get<int64_t>() == response[i];
  return double(hits) / double(label.size());
}

}  // namespace rl_example
