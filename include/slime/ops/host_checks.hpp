// slime/ops/host_checks.hpp: O(batch) checks of host-side batch data before a
// launch: cu_seqlens and token targets.
//
// The CUDA kernels trap on a broken cu_seqlens or an out-of-range target
// (checking on the device would need a host sync), and a trap kills the CUDA
// context, so the process dies with the batch. Where the data is already on
// the host (the packer's cu_seqlens, the targets a trainer builds before
// uploading them), these checks turn a bad batch into a slime::Error naming
// `where`, the index and the value, and the process lives. The CPU reference
// ops check the same conditions themselves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"

namespace slime::ops {

// cu_seqlens of a packed batch: num_sequences + 1 entries (num_sequences -1:
// any count), cu[0] = 0, non-decreasing, cu.back() =
// total_tokens. `name` names the array in the message ("cu_seqlens",
// "cu_seqlens_q"). Returns the longest sequence (a lower bound for
// max_seqlen).
inline int64_t check_cu_seqlens(std::span<const int32_t> cu, int64_t total_tokens, std::string_view where,
                                int64_t num_sequences = -1, std::string_view name = "cu_seqlens") {
  SLIME_CHECK(!cu.empty(), where, ": ", name, " is empty (it holds one entry more than there are sequences)");
  if (num_sequences >= 0)
    SLIME_CHECK(int64_t(cu.size()) == num_sequences + 1, where, ": ", name, " must hold ", num_sequences + 1,
                " entries (", num_sequences, " sequences), got ", cu.size());
  SLIME_CHECK(cu[0] == 0, where, ": ", name, "[0] must be 0, got ", cu[0]);
  int64_t longest = 0;
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    SLIME_CHECK(cu[b + 1] >= cu[b], where, ": ", name, " must be non-decreasing: ", name, "[", b + 1, "] = ", cu[b + 1],
                " < ", name, "[", b, "] = ", cu[b]);
    longest = std::max<int64_t>(longest, int64_t(cu[b + 1]) - cu[b]);
  }
  SLIME_CHECK(cu.back() == total_tokens, where, ": ", name, " must end at the token count ", total_tokens, ", got ",
              cu.back());
  return longest;
}

// Token targets (of token_logprobs, a loss): every entry in [0, vocab).
template <class T>
requires(std::is_same_v<T, int32_t> ||
         std::is_same_v<T, int64_t>) inline void check_token_targets(std::span<const T> targets, int64_t vocab,
                                                                     std::string_view where) {
  SLIME_CHECK(vocab > 0, where, ": the vocabulary size must be positive, got ", vocab);
  for (std::size_t t = 0; t < targets.size(); ++t)
    SLIME_CHECK(int64_t(targets[t]) >= 0 && int64_t(targets[t]) < vocab, where, ": targets[", t,
                "] = ", int64_t(targets[t]), " is outside the vocabulary [0, ", vocab, ")");
}

// The same for a CPU tensor of i32 or i64 targets.
inline void check_token_targets(const Tensor& targets, int64_t vocab, std::string_view where) {
  SLIME_CHECK(targets.defined() && targets.device().is_cpu() && targets.dim() == 1 &&
                  (targets.dtype() == DType::i32 || targets.dtype() == DType::i64),
              where, ": targets must be i32 or i64 [tokens] on the CPU to be checked on the host, got ",
              targets.defined() ? targets.str() : std::string("undefined"));
  const std::size_t n = std::size_t(targets.numel());
  if (targets.dtype() == DType::i32)
    check_token_targets(std::span<const int32_t>(targets.data<int32_t>(), n), vocab, where);
  else
    check_token_targets(std::span<const int64_t>(targets.data<int64_t>(), n), vocab, where);
}

}  // namespace slime::ops
