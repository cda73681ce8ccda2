// token_data.hpp (sft_qwen3 example): the SFT data. uint32 token files
// (slime/data/token_file.hpp) are split into documents at an EOS id, each
// document is cut into training sequences that fit the packing budget, and a
// step draws sequences until it holds the global token budget.
//
// A document d_0 .. d_{n-1} followed by EOS trains next-token prediction on
// every position: inputs d_0 .. d_{n-1}, targets d_1 .. d_{n-1}, EOS. A
// document longer than the budget is cut into windows of at most
// max_tokens_per_rank inputs, each a sequence of its own (positions restart at
// 0). Text after the last EOS of a file is a document without EOS (its last
// token has no target).
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/data/shuffle.hpp"
#include "slime/data/token_file.hpp"

namespace sft {

namespace fs = std::filesystem;
namespace data = slime::data;

// The example's errors about its input (options, data, checkpoints): one
// line that says what is wrong, without a source location. main() prints
// them and exits with 1.
template <class... Args>
void require(bool ok, const Args&... message) {
  if (!ok) throw slime::Error(slime::detail::concat(message...));
}

// One training sequence: inputs tokens [begin, begin + length) of file
// `file`, targets the tokens one further, [begin + 1, begin + length + 1).
struct Sequence {
  uint32_t file = 0;
  uint64_t begin = 0;
  int32_t length = 0;
};

class TokenDataset {
 public:
  // `path`: a token file, or a directory whose *.u32 files are read in name
  // order. Throws naming the path when there is nothing to train on.
  TokenDataset(const fs::path& path, uint32_t eos_id, int64_t max_sequence_tokens) : eos_id_(eos_id) {
    require(max_sequence_tokens >= 1, "max sequence tokens must be >= 1, got ", max_sequence_tokens);
    std::error_code ec;
    std::vector<fs::path> paths;
    if (fs::is_directory(path, ec)) {
      for (const auto& e : fs::directory_iterator(path, ec))
        if (e.is_regular_file() && e.path().extension() == ".u32") paths.push_back(e.path());
      std::sort(paths.begin(), paths.end());
      require(!paths.empty(), "--data: directory '", path.string(), "' holds no .u32 token files");
    } else {
      require(fs::exists(path, ec), "--data: '", path.string(), "' does not exist");
      paths.push_back(path);
    }
    for (const fs::path& p : paths) {
      files_.emplace_back(p);
      split(uint32_t(files_.size() - 1), max_sequence_tokens);
    }
    require(!sequences_.empty(), "--data: '", path.string(), "' holds no document with two or more tokens (EOS id ",
            eos_id, ")");
  }

  int64_t size() const { return int64_t(sequences_.size()); }
  const Sequence& sequence(int64_t i) const { return sequences_[std::size_t(i)]; }
  uint32_t eos_id() const { return eos_id_; }
  int64_t total_tokens() const {
    int64_t n = 0;
    for (const data::TokenFile& f : files_) n += int64_t(f.size());
    return n;
  }

  // The largest token id + 1 over all files (the vocabulary a built-in model needs).
  int64_t vocab_needed() const {
    uint32_t top = eos_id_;
    for (const data::TokenFile& f : files_)
      for (uint32_t t : f.tokens()) top = std::max(top, t);
    return int64_t(top) + 1;
  }
  // Throws naming the file and position of the first id >= vocab_size.
  void check_vocab(int64_t vocab_size) const {
    require(eos_id_ < uint64_t(vocab_size), "--eos-id ", eos_id_, " is outside the model's vocabulary [0, ", vocab_size,
            ")");
    for (const data::TokenFile& f : files_) f.check_vocab(uint64_t(vocab_size));
  }

  // A sequence's inputs and targets as int32 ids (the model's token dtype).
  void inputs_and_targets(const Sequence& s, std::vector<int32_t>& inputs, std::vector<int32_t>& targets) const {
    const std::span<const uint32_t> t = files_[s.file].slice(s.begin, uint64_t(s.length) + 1);
    inputs.assign(t.begin(), t.end() - 1);
    targets.assign(t.begin() + 1, t.end());
  }

 private:
  void split(uint32_t file, int64_t window) {
    const std::span<const uint32_t> t = files_[file].tokens();
    uint64_t start = 0;
    while (start < t.size()) {
      uint64_t end = start;  // the document's EOS, or the end of the file
      while (end < t.size() && t[end] != eos_id_) ++end;
      const uint64_t span = std::min<uint64_t>(end + 1, t.size()) - start;  // document + its EOS
      // span - 1 predictions, in windows of at most `window`.
      for (uint64_t off = 0; off + 1 < span; off += uint64_t(window))
        sequences_.push_back({file, start + off, int32_t(std::min<uint64_t>(uint64_t(window), span - 1 - off))});
      start = end + 1;
    }
  }

  uint32_t eos_id_;
  std::vector<data::TokenFile> files_;
  std::vector<Sequence> sequences_;
};

// The sequences of one optimizer step: drawn in the sampler's order (shuffled
// per epoch, resumable from a DataPosition) until they hold at least
// `global_tokens` input tokens and at least `min_sequences` sequences (one
// per rank).
inline std::vector<Sequence> next_global_batch(data::EpochSampler& sampler, const TokenDataset& data,
                                               int64_t global_tokens, int min_sequences) {
  std::vector<Sequence> batch;
  int64_t tokens = 0;
  while (tokens < global_tokens || int64_t(batch.size()) < min_sequences) {
    batch.push_back(data.sequence(sampler.next()));
    tokens += batch.back().length;
  }
  return batch;
}

// Writes a synthetic token file that a tiny model learns within a few
// steps: `documents` counting runs x, x + 1, x + 2, ... (mod the symbol
// range [1, vocab)), each of 8 to 40 tokens from a random start, each
// followed by EOS = 0. Every token but a document's first is determined by
// the one before it, so the loss falls from ln(vocab) towards the
// entropy of the starts and lengths. Deterministic in `seed`.
inline void write_synthetic_token_file(const fs::path& path, int64_t vocab, int64_t documents, uint64_t seed) {
  require(vocab >= 3, "synthetic data needs a vocabulary of at least 3 ids, got ", vocab);
  std::mt19937_64 rng(seed);  // raw 64-bit words: the same sequence on every platform
  const uint64_t symbols = uint64_t(vocab - 1);
  std::vector<uint32_t> tokens;
  for (int64_t d = 0; d < documents; ++d) {
    const uint64_t start = rng() % symbols, length = 8 + rng() % 33;
    for (uint64_t i = 0; i < length; ++i) tokens.push_back(uint32_t(1 + (start + i) % symbols));
    tokens.push_back(0);  // EOS
  }
  data::write_token_file(path, tokens);
}

}  // namespace sft
