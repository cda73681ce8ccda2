// slime/data/prompt_dataset.hpp: prompt datasets for RL: prompt tokens plus
// the label and metadata a reward function needs, read from JSONL and walked
// in a deterministic, resumable shuffled order.
//
// One JSON object per line (blank lines skipped, unknown fields ignored):
//   prompt_tokens  [int]    required, non-empty, each in [0, vocab_size)
//   label          any      optional: the reference answer, test cases, ...
//   metadata       any      optional
//   images         [string] optional image paths
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/data/sample.hpp"
#include "slime/data/shuffle.hpp"

namespace slime::data {

struct Prompt {
  std::vector<int32_t> tokens;
  nlohmann::json label;     // null when absent
  nlohmann::json metadata;  // null when absent
  std::vector<std::string> images;
  int64_t line = 0;  // where it came from (1-based line in the file)
};

inline Prompt prompt_from_json(const nlohmann::json& j, const JsonlOptions& options, const detail::JsonlWhere& at) {
  Prompt p;
  p.tokens = detail::read_tokens(detail::require_field(j, "prompt_tokens", at), "prompt_tokens", options, at);
  if (const nlohmann::json* l = detail::find_field(j, "label")) p.label = *l;
  if (const nlohmann::json* m = detail::find_field(j, "metadata")) p.metadata = *m;
  if (const nlohmann::json* im = detail::find_field(j, "images")) p.images = detail::read_strings(*im, "images", at);
  p.line = at.line;
  return p;
}

// Prompts held in memory, handed out in batches in the order of an
// EpochSampler: deterministic by (seed, epoch), resumable from a DataPosition.
class PromptDataset {
 public:
  PromptDataset(std::vector<Prompt> prompts, uint64_t seed, bool shuffle = true)
      : prompts_(std::move(prompts)), sampler_(check_size(prompts_.size()), seed, shuffle) {}

  // Reads every prompt of a JSONL file; errors name the file and line.
  static PromptDataset from_jsonl(const std::filesystem::path& path, uint64_t seed, JsonlOptions options = {},
                                  bool shuffle = true) {
    JsonlReader reader(path);
    std::vector<Prompt> prompts;
    nlohmann::json j;
    while (reader.next(j)) prompts.push_back(prompt_from_json(j, options, reader.where()));
    SLIME_CHECK(!prompts.empty(), "prompt file '", path.string(), "' holds no prompts");
    return PromptDataset(std::move(prompts), seed, shuffle);
  }

  int64_t size() const { return int64_t(prompts_.size()); }
  const Prompt& operator[](int64_t i) const {
    SLIME_CHECK(i >= 0 && i < size(), "PromptDataset: index ", i, " out of range for ", size(), " prompts");
    return prompts_[std::size_t(i)];
  }

  // The next `count` prompts (as indices into the dataset), crossing into the
  // next epoch when this one ends.
  std::vector<int64_t> next_batch(int64_t count) { return sampler_.next_batch(count); }

  DataPosition position() const { return sampler_.position(); }
  void seek(DataPosition p) { sampler_.seek(p); }

 private:
  static int64_t check_size(std::size_t n) {
    SLIME_CHECK(n > 0, "PromptDataset: no prompts");
    return int64_t(n);
  }

  std::vector<Prompt> prompts_;
  EpochSampler sampler_;
};

}  // namespace slime::data
