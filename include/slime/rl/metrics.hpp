// slime/rl/metrics.hpp: shared pieces of the RL objectives: input validation
// for packed sequences (cu_seqlens, masks), the device guards of the Tensor
// API (policy_loss runs on CPU and CUDA tensors; advantages, importance
// weights and kl_per_token on CPU tensors only), and the additive metric sums
// that combine across micro-batches and ranks by plain addition.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

#include "slime/core/tensor.hpp"

namespace slime::rl {

namespace detail {

// Validates packed-sequence offsets: cu_seqlens[0] = 0, non-decreasing, last = tokens.
inline void check_cu_seqlens(std::string_view fn, const int32_t* cu_seqlens, int64_t num_seqs, int64_t num_tokens) {
  SLIME_CHECK(num_seqs >= 0, fn, ": num_seqs must be >= 0, got ", num_seqs);
  SLIME_CHECK(num_tokens >= 0, fn, ": num_tokens must be >= 0, got ", num_tokens);
  SLIME_CHECK(cu_seqlens != nullptr, fn, ": cu_seqlens is null");
  SLIME_CHECK(cu_seqlens[0] == 0, fn, ": cu_seqlens[0] must be 0, got ", cu_seqlens[0]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    SLIME_CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], fn, ": cu_seqlens must be non-decreasing, cu_seqlens[", s + 1,
                "] = ", cu_seqlens[s + 1], " < cu_seqlens[", s, "] = ", cu_seqlens[s]);
  }
  SLIME_CHECK(cu_seqlens[num_seqs] == num_tokens, fn, ": cu_seqlens[", num_seqs, "] = ", cu_seqlens[num_seqs],
              " must equal the number of tokens ", num_tokens);
}

// The guard of the CPU-only Tensor APIs (CUDA kernels exist for policy_loss only).
inline void require_cpu(std::string_view fn, const Tensor& t) {
  SLIME_CHECK(t.defined(), fn, ": an input tensor is undefined");
  if (t.device().is_cuda())
    SLIME_FAIL(fn, ": CPU tensors only (the fused CUDA kernel is rl::policy_loss), got ", t.str());
}

// Checks a per-token tensor: defined, on `device`, `dtype`, shape [tokens].
inline void check_token_tensor_on(std::string_view fn, const Tensor& t, DType dtype, int64_t tokens,
                                  std::string_view name, Device device) {
  SLIME_CHECK(t.defined(), fn, ": ", name, " is undefined");
  SLIME_CHECK(t.device() == device, fn, ": ", name, " must be on ", device, " (lp's device), got ", t.str());
  SLIME_CHECK(t.dtype() == dtype, fn, ": ", name, " must be ", dtype_name(dtype), ", got ", t.str());
  SLIME_CHECK(t.dim() == 1 && t.size(0) == tokens, fn, ": ", name, " must have shape (", tokens, "), got ", t.str());
}

// Checks a per-token tensor: defined, CPU, `dtype`, shape [tokens].
inline void check_token_tensor(std::string_view fn, const Tensor& t, DType dtype, int64_t tokens,
                               std::string_view name) {
  require_cpu(fn, t);
  check_token_tensor_on(fn, t, dtype, tokens, name, Device::cpu());
}

// cu_seqlens as an i32 tensor [S + 1] on `device`; returns S. Its values are
// validated on the CPU only (a CUDA kernel checks them on the device).
inline int64_t check_cu_seqlens_tensor_on(std::string_view fn, const Tensor& cu_seqlens, int64_t tokens,
                                          Device device) {
  SLIME_CHECK(cu_seqlens.defined(), fn, ": cu_seqlens is undefined");
  SLIME_CHECK(cu_seqlens.device() == device, fn, ": cu_seqlens must be on ", device, ", got ", cu_seqlens.str());
  SLIME_CHECK(cu_seqlens.dtype() == DType::i32 && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, fn,
              ": cu_seqlens must be i32 of shape (num_seqs + 1), got ", cu_seqlens.str());
  const int64_t s = cu_seqlens.size(0) - 1;
  if (device.is_cpu()) check_cu_seqlens(fn, cu_seqlens.data<int32_t>(), s, tokens);
  return s;
}

// cu_seqlens as an i32 CPU tensor [S + 1]; returns S.
inline int64_t check_cu_seqlens_tensor(std::string_view fn, const Tensor& cu_seqlens, int64_t tokens) {
  require_cpu(fn, cu_seqlens);
  return check_cu_seqlens_tensor_on(fn, cu_seqlens, tokens, Device::cpu());
}

template <class T>
inline const T* maybe_data(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

// Float accumulation for float inputs, double for double.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

}  // namespace detail

}  // namespace slime::rl
