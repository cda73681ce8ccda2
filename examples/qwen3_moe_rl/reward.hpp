// The reward of a response to a prompt from a JSONL dataset (--prompts): the
// function users of the example write. This one gives partial credit for
// matching the reference answer token by token: the dataset's "label" is a
// list of token ids, and the reward is the fraction of its positions the
// response reproduces (1.0 for an exact match; tokens after the label's length
// are ignored). Replace it with your verifier: a math checker, unit tests run
// on generated code, a reward model, ... It runs on the rank that sampled the
// response, once per sample, on the host; check_label runs once per prompt when
// the dataset is loaded.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"

namespace rl_example {

// Checks the dataset's labels before training, so that a bad one is an error naming
// "<file>:<line>" rather than a reward computed from a truncated value: each must be a non-empty
// list of integer token ids (a float such as 3.7 is refused, not read as 3).
inline void check_label(const nlohmann::json& label, const std::string& file, int64_t line) {
  const std::string at = slime::detail::concat(file, ":", line);
  SLIME_CHECK(label.is_array() && !label.empty(), at, ": \"label\" must be a non-empty list of token ids, got ",
              slime::json_excerpt(label));
  for (std::size_t i = 0; i < label.size(); ++i)
    (void)slime::json_integer<int32_t>(label[i], slime::detail::concat("\"label\"[", i, "]"), at);
}

inline double user_reward(std::span<const int32_t> prompt, std::span<const int32_t> response,
                          const nlohmann::json& label) {
  (void)prompt;
  SLIME_CHECK(label.is_array() && !label.empty(),
              "user_reward: the dataset's \"label\" must be a non-empty list of token ids, got ",
              slime::json_excerpt(label));
  int64_t hits = 0;
  for (std::size_t i = 0; i < label.size(); ++i)
    hits += i < response.size() && slime::json_integer<int32_t>(label[i], "label", "user_reward") == response[i];
  return double(hits) / double(label.size());
}

}  // namespace rl_example
