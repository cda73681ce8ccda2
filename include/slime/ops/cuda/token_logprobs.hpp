// slime/ops/cuda/token_logprobs.hpp: host-callable CUDA launchers of the fused
// lm-head + log-softmax + entropy op (defined in src/ops/token_logprobs.cu).
// Callers normally use slime/ops/token_logprobs.hpp, which validates and
// dispatches; these functions trust their Params.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// Pointers are device pointers on the current device. `dtype` (bf16 or f32)
// is the type of hidden, weight and grad_hidden; `target_dtype` i32 or i64.
// The workspace is 16-byte aligned and holds at least
// token_logprobs_workspace_bytes(...) bytes for the same sizes and chunks.
struct TokenLogprobsForwardParams {
  const void* hidden;   // [tokens, dim]
  const void* weight;   // [vocab, dim]
  const void* targets;  // [tokens]
  DType dtype;
  DType target_dtype;
  int64_t tokens, dim, vocab;
  float temperature;
  int64_t token_chunk, vocab_chunk;
  void* workspace;
  std::size_t workspace_bytes;
  float* logprobs;  // [tokens]
  float* entropy;   // [tokens]
  float* lse;       // [tokens]
};

struct TokenLogprobsBackwardParams {
  const void* hidden;   // [tokens, dim]
  const void* weight;   // [vocab, dim]
  const void* targets;  // [tokens]
  DType dtype;
  DType target_dtype;
  int64_t tokens, dim, vocab;
  float temperature;
  int64_t token_chunk, vocab_chunk;
  void* workspace;
  std::size_t workspace_bytes;
  const float* lse;                  // [tokens], from the forward
  const float* entropy;              // [tokens], from the forward
  const float* maybe_grad_logprobs;  // [tokens] or nullptr (zero)
  const float* maybe_grad_entropy;   // [tokens] or nullptr (zero)
  void* maybe_grad_hidden;           // [tokens, dim] of `dtype`, written; or nullptr
  float* maybe_grad_weight;          // [vocab, dim] fp32, accumulated; or nullptr
};

void token_logprobs_forward(const TokenLogprobsForwardParams& params, StreamHandle stream);
void token_logprobs_backward(const TokenLogprobsBackwardParams& params, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
