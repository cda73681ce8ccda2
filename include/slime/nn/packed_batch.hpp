// slime/nn/packed_batch.hpp: PackedBatch, several token sequences packed into
// one [tokens] row with cu_seqlens (no padding), as the model consumes them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "slime/core/tensor.hpp"

namespace slime::nn {

// Sequence b holds tokens [cu_seqlens_host[b], cu_seqlens_host[b + 1]).
struct PackedBatch {
  Tensor tokens;                         // [T] i32, on the model's device
  Tensor cu_seqlens;                     // [B + 1] i32, on the model's device
  std::vector<int32_t> cu_seqlens_host;  // the same values on the host
  int max_seqlen = 0;                    // longest sequence
  Tensor positions;                      // [T] i32: position within its sequence (restarts at 0)

  int64_t num_tokens() const { return cu_seqlens_host.empty() ? 0 : cu_seqlens_host.back(); }
  int64_t num_sequences() const { return int64_t(cu_seqlens_host.size()) - 1; }
  Device device() const { return tokens.device(); }
};

// Packs `sequences` in order onto `device`. At least one token in all; empty
// sequences are allowed (they own no tokens). Token ids are not checked here
// (the model's embedding checks them against its vocabulary).
inline PackedBatch make_packed_batch(const std::vector<std::vector<int32_t>>& sequences, Device device = Device::cpu(),
                                     const Stream& stream = {}) {
  SLIME_CHECK(!sequences.empty(), "make_packed_batch: no sequences");
  PackedBatch b;
  b.cu_seqlens_host.reserve(sequences.size() + 1);
  b.cu_seqlens_host.push_back(0);
  int64_t total = 0;
  for (const auto& s : sequences) {
    total += int64_t(s.size());
    SLIME_CHECK(total <= std::numeric_limits<int32_t>::max(), "make_packed_batch: more than 2^31 - 1 tokens");
    b.cu_seqlens_host.push_back(int32_t(total));
    b.max_seqlen = std::max(b.max_seqlen, int(s.size()));
  }
  SLIME_CHECK(total > 0, "make_packed_batch: the ", sequences.size(), " sequences hold no tokens");
  std::vector<int32_t> tokens, positions;
  tokens.reserve(std::size_t(total));
  positions.reserve(std::size_t(total));
  for (const auto& s : sequences) {
    tokens.insert(tokens.end(), s.begin(), s.end());
    for (std::size_t i = 0; i < s.size(); ++i) positions.push_back(int32_t(i));
  }
  b.tokens = Tensor::from_vector(tokens, {total}, device, stream);
  b.positions = Tensor::from_vector(positions, {total}, device, stream);
  b.cu_seqlens = Tensor::from_vector(b.cu_seqlens_host, {int64_t(b.cu_seqlens_host.size())}, device, stream);
  return b;
}

}  // namespace slime::nn
