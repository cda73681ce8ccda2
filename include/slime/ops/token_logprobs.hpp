// slime/ops/token_logprobs.hpp: fused lm-head + log-softmax + entropy for RL
// training: per-token log-probabilities of the targets and the entropy of the
// policy, with their backward, never materialising the [tokens, vocab] logits.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (grad_weight); activation gradients are written (`=`, grad_hidden).
//
//   hidden  [tokens, dim]   bf16 or f32 (the final norm's output)
//   weight  [vocab, dim]    same dtype (Hugging Face lm_head layout)
//   targets [tokens]        i32 or i64, each in [0, vocab); there is no
//                           "ignore" value: mask with the upstream gradient
//                           (grad = 0) instead. Out of range is an error: a
//                           slime::Error on the CPU, a device trap on the GPU
//                           (checking there would need a host sync).
//   z = hidden . weight^T / temperature   (fp32, temperature > 0)
//   lse[t]      = logsumexp_v z[t, v]                         fp32 [tokens]
//   logprobs[t] = z[t, targets[t]] - lse[t]                   fp32 [tokens]
//   entropy[t]  = lse[t] - sum_v softmax(z[t])_v z[t, v]      fp32 [tokens]
// The backward takes lse and entropy from the forward and recomputes the
// logits chunk by chunk (see ops/cpu/token_logprobs.hpp for the derivatives).
//
// GPU algorithm: for each chunk of tokens, for each chunk of the vocabulary,
// one cuBLAS GEMM (bf16 or f32 in, fp32 accumulate) writes the fp32 logits of
// the chunk into the workspace, then one kernel folds the chunk into a running
// (max, sum exp, sum exp * z) per token (online log-sum-exp) and picks the
// target logit; the last vocabulary chunk writes the outputs. The backward
// turns each recomputed logits chunk into dz in place (bf16 for bf16 inputs)
// and runs two GEMMs: dh (+= over vocabulary chunks, in an fp32 accumulator
// for bf16) and dW (+=, beta = 1). The workspace is the only large buffer:
// query its size with token_logprobs_workspace_bytes() and pass it in, and a
// call allocates nothing (without one the call allocates it itself).
//
// Determinism: run to run deterministic on the same GPU, library versions and
// chunks (fixed-order reductions, no atomics); results depend on the chunk
// sizes through rounding only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "slime/core/device.hpp"
#include "slime/core/dtype.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/token_logprobs.hpp"
#include "slime/ops/cuda/token_logprobs.hpp"

namespace slime::ops {

// Chunk sizes: 0 picks the default. Vocabulary chunks are at most
// kTokenLogprobsMaxVocabChunk (the GPU kernels hold one row of a chunk in
// registers).
struct TokenLogprobsChunks {
  int64_t tokens = 0;
  int64_t vocab = 0;
};

inline constexpr int64_t kTokenLogprobsMaxVocabChunk = 16384;
inline constexpr int64_t kTokenLogprobsVocabChunk = 8192;
// The default token chunk keeps the workspace at or under this many bytes.
inline constexpr std::size_t kTokenLogprobsWorkspaceBudget = std::size_t(256) << 20;

// Where things live in the GPU workspace:
//   [0, logits_bytes)               logits chunk, fp32 [token_chunk, logits_ld];
//                                   the backward overwrites it with dz (f32 in
//                                   place, or bf16 rows of pitch 2 * logits_ld)
//   [scratch_offset, total_bytes)   forward: running state, float4 [token_chunk];
//                                   backward with bf16 grad_hidden: the fp32 dh
//                                   accumulator [token_chunk, dim]
struct TokenLogprobsWorkspaceLayout {
  int64_t token_chunk = 1;
  int64_t vocab_chunk = 1;
  int64_t logits_ld = 8;  // fp32 elements per logits row: vocab_chunk rounded up to 8
  std::size_t logits_bytes = 0;
  std::size_t scratch_offset = 0;
  std::size_t total_bytes = 0;
};

inline TokenLogprobsWorkspaceLayout token_logprobs_workspace_layout(int64_t tokens, int64_t dim, int64_t vocab,
                                                                    DType dtype, TokenLogprobsChunks chunks = {}) {
  SLIME_CHECK(tokens >= 0 && dim > 0 && vocab > 0,
              "token_logprobs: sizes must be tokens >= 0, dim > 0, vocab > 0; got ", tokens, ", ", dim, ", ", vocab);
  SLIME_CHECK(chunks.tokens >= 0 && chunks.vocab >= 0 && chunks.vocab <= kTokenLogprobsMaxVocabChunk,
              "token_logprobs: chunks must be tokens >= 0 (0 = default) and vocab in [0, ", kTokenLogprobsMaxVocabChunk,
              "] (0 = default); got tokens ", chunks.tokens, ", vocab ", chunks.vocab);
  auto round_up = [](int64_t x, int64_t m) { return (x + m - 1) / m * m; };
  auto align = [](std::size_t x) { return (x + 255) / 256 * 256; };
  TokenLogprobsWorkspaceLayout l;
  if (chunks.vocab > 0) {
    l.vocab_chunk = std::min(chunks.vocab, vocab);
  } else {
    // Balanced chunks of at most kTokenLogprobsVocabChunk, rounded to GEMM tiles.
    const int64_t n = (vocab + kTokenLogprobsVocabChunk - 1) / kTokenLogprobsVocabChunk;
    l.vocab_chunk = std::min(vocab, round_up((vocab + n - 1) / n, 128));
  }
  l.logits_ld = round_up(l.vocab_chunk, 8);
  const int64_t scratch_row = std::max<int64_t>(16, dtype == DType::bf16 ? dim * 4 : 0);
  const int64_t row_bytes = l.logits_ld * 4 + scratch_row;
  if (chunks.tokens > 0) {
    l.token_chunk = std::max<int64_t>(1, std::min(chunks.tokens, tokens));
  } else {
    int64_t most = std::max<int64_t>(1, int64_t(kTokenLogprobsWorkspaceBudget) / row_bytes);
    if (most >= 128) most = most / 128 * 128;
    const int64_t n = std::max<int64_t>(1, (tokens + most - 1) / most);
    l.token_chunk = std::max<int64_t>(1, std::min({most, tokens, round_up((tokens + n - 1) / n, 128)}));
  }
  l.logits_bytes = align(std::size_t(l.token_chunk) * std::size_t(l.logits_ld) * 4);
  l.scratch_offset = l.logits_bytes;
  l.total_bytes = l.scratch_offset + align(std::size_t(l.token_chunk) * std::size_t(scratch_row));
  return l;
}

// Bytes of GPU workspace for a forward or backward with these sizes, dtype
// (of hidden) and chunks (0 = default; the default keeps it at or under
// kTokenLogprobsWorkspaceBudget, about 192 MiB at dim 4096, vocab 151936).
inline std::size_t token_logprobs_workspace_bytes(int64_t tokens, int64_t dim, int64_t vocab, DType dtype,
                                                  TokenLogprobsChunks chunks = {}) {
  return token_logprobs_workspace_layout(tokens, dim, vocab, dtype, chunks).total_bytes;
}

namespace token_logprobs_detail {

inline void check_inputs(const char* op, const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                         float temperature) {
  SLIME_CHECK(hidden.defined(), op, ": hidden is undefined");
  SLIME_CHECK(hidden.dtype() == DType::bf16 || hidden.dtype() == DType::f32, op, ": hidden must be bf16 or f32, got ",
              hidden.str());
  SLIME_CHECK(hidden.dim() == 2, op, ": hidden must be [tokens, dim], got ", hidden.str());
  SLIME_CHECK(hidden.size(1) > 0, op, ": hidden must have dim > 0, got ", hidden.str());
  check_dtype(weight, hidden.dtype(), std::string(op) + ": weight (the dtype of hidden)");
  SLIME_CHECK(weight.dim() == 2 && weight.size(1) == hidden.size(1) && weight.size(0) > 0, op,
              ": weight must be [vocab > 0, ", hidden.size(1), "] (Hugging Face lm_head layout), got ", weight.str());
  SLIME_CHECK(targets.defined(), op, ": targets is undefined");
  SLIME_CHECK(targets.dtype() == DType::i32 || targets.dtype() == DType::i64, op, ": targets must be i32 or i64, got ",
              targets.str());
  check_shape(targets, Shape{hidden.size(0)}, std::string(op) + ": targets");
  check_same_device(hidden, weight, "hidden", "weight");
  check_same_device(hidden, targets, "hidden", "targets");
  SLIME_CHECK(std::isfinite(temperature) && temperature > 0.f, op, ": temperature must be finite and > 0, got ",
              temperature);
}

inline void check_f32_vector(const char* op, const Tensor& t, const Tensor& hidden, const char* name) {
  check_dtype(t, DType::f32, std::string(op) + ": " + name);
  check_shape(t, Shape{hidden.size(0)}, std::string(op) + ": " + name);
  check_same_device(hidden, t, "hidden", name);
}

inline const void* workspace_ptr(const char* op, const Tensor& workspace, const Tensor& hidden, std::size_t needed) {
  check_same_device(hidden, workspace, "hidden", "workspace");
  SLIME_CHECK(workspace.nbytes() >= needed, op, ": workspace has ", workspace.nbytes(), " bytes, needs ", needed,
              " (token_logprobs_workspace_bytes)");
  SLIME_CHECK(reinterpret_cast<std::uintptr_t>(workspace.data_ptr()) % 16 == 0, op,
              ": workspace must be 16-byte aligned");
  return workspace.data_ptr();
}

// Calls f(T{}, Idx{}) for the element type of hidden and the index type of targets.
template <class F>
void visit_types(const Tensor& hidden, const Tensor& targets, F&& f) {
  auto with_index = [&](auto value) {
    if (targets.dtype() == DType::i32) {
      f(value, int32_t{});
    } else {
      f(value, int64_t{});
    }
  };
  if (hidden.dtype() == DType::f32) {
    with_index(float{});
  } else {
    with_index(BFloat16{});
  }
}

}  // namespace token_logprobs_detail

// Forward: writes logprobs, entropy and lse (each f32 [tokens], on the device
// of hidden). `workspace` (GPU only, any dtype, >= token_logprobs_workspace_bytes
// for the same chunks) may be undefined: the call then allocates one.
inline void token_logprobs_forward(const Tensor& hidden, const Tensor& weight, const Tensor& targets, float temperature,
                                   const Tensor& logprobs, const Tensor& entropy, const Tensor& lse,
                                   const Tensor& workspace = {}, TokenLogprobsChunks chunks = {},
                                   const Stream& stream = {}) {
  namespace d = token_logprobs_detail;
  constexpr const char* op = "token_logprobs_forward";
  d::check_inputs(op, hidden, weight, targets, temperature);
  d::check_f32_vector(op, logprobs, hidden, "logprobs");
  d::check_f32_vector(op, entropy, hidden, "entropy");
  d::check_f32_vector(op, lse, hidden, "lse");
  const int64_t tokens = hidden.size(0), dim = hidden.size(1), vocab = weight.size(0);
  const TokenLogprobsWorkspaceLayout layout =
      token_logprobs_workspace_layout(tokens, dim, vocab, hidden.dtype(), chunks);
  if (tokens == 0) return;
  if (hidden.device().is_cpu()) {
    d::visit_types(hidden, targets, [&](auto value, auto index) {
      using T = decltype(value);
      using Idx = decltype(index);
      cpu::token_logprobs_forward<T, Idx>(hidden.data<T>(), weight.data<T>(), targets.data<Idx>(), tokens, dim, vocab,
                                          temperature, logprobs.data<float>(), entropy.data<float>(), lse.data<float>(),
                                          layout.vocab_chunk);
    });
    return;
  }
#if SLIME_HAS_CUDA
  const Device dev = hidden.device();
  const Stream s = stream.device() == dev ? stream : Stream::default_for(dev);
  DeviceGuard guard(dev);
  Tensor ws = workspace.defined() ? workspace : Tensor::empty({int64_t(layout.total_bytes)}, DType::u8, dev, s);
  cuda::TokenLogprobsForwardParams p{};
  p.hidden = hidden.data_ptr();
  p.weight = weight.data_ptr();
  p.targets = targets.data_ptr();
  p.dtype = hidden.dtype();
  p.target_dtype = targets.dtype();
  p.tokens = tokens;
  p.dim = dim;
  p.vocab = vocab;
  p.temperature = temperature;
  p.token_chunk = layout.token_chunk;
  p.vocab_chunk = layout.vocab_chunk;
  p.workspace = const_cast<void*>(d::workspace_ptr(op, ws, hidden, layout.total_bytes));
  p.workspace_bytes = ws.nbytes();
  p.logprobs = logprobs.data<float>();
  p.entropy = entropy.data<float>();
  p.lse = lse.data<float>();
  cuda::token_logprobs_forward(p, s.handle());
#else
  (void)workspace;
  (void)stream;
  SLIME_FAIL(op, ": ", hidden.device(), " needs the CUDA backend");
#endif
}

// Backward from the forward's lse and entropy. grad_logprobs / grad_entropy
// (f32 [tokens]) may be undefined (zero). grad_hidden [tokens, dim] (dtype of
// hidden) is written; grad_weight [vocab, dim] f32 is accumulated (+=); either
// may be undefined (not computed). Workspace as for the forward.
inline void token_logprobs_backward(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                    float temperature, const Tensor& lse, const Tensor& entropy,
                                    const Tensor& grad_logprobs, const Tensor& grad_entropy, const Tensor& grad_hidden,
                                    const Tensor& grad_weight, const Tensor& workspace = {},
                                    TokenLogprobsChunks chunks = {}, const Stream& stream = {}) {
  namespace d = token_logprobs_detail;
  constexpr const char* op = "token_logprobs_backward";
  d::check_inputs(op, hidden, weight, targets, temperature);
  d::check_f32_vector(op, lse, hidden, "lse");
  d::check_f32_vector(op, entropy, hidden, "entropy");
  if (grad_logprobs.defined()) d::check_f32_vector(op, grad_logprobs, hidden, "grad_logprobs");
  if (grad_entropy.defined()) d::check_f32_vector(op, grad_entropy, hidden, "grad_entropy");
  if (grad_hidden.defined()) {
    check_dtype(grad_hidden, hidden.dtype(), std::string(op) + ": grad_hidden (the dtype of hidden)");
    check_shape(grad_hidden, hidden.shape(), std::string(op) + ": grad_hidden");
    check_same_device(hidden, grad_hidden, "hidden", "grad_hidden");
  }
  if (grad_weight.defined()) {
    check_dtype(grad_weight, DType::f32, std::string(op) + ": grad_weight (fp32 accumulator)");
    check_shape(grad_weight, weight.shape(), std::string(op) + ": grad_weight");
    check_same_device(hidden, grad_weight, "hidden", "grad_weight");
  }
  const int64_t tokens = hidden.size(0), dim = hidden.size(1), vocab = weight.size(0);
  [[maybe_unused]] const TokenLogprobsWorkspaceLayout layout =
      token_logprobs_workspace_layout(tokens, dim, vocab, hidden.dtype(), chunks);
  if (tokens == 0 || (!grad_hidden.defined() && !grad_weight.defined())) return;
  const float* g_lp = grad_logprobs.defined() ? grad_logprobs.data<float>() : nullptr;
  const float* g_ent = grad_entropy.defined() ? grad_entropy.data<float>() : nullptr;
  if (hidden.device().is_cpu()) {
    d::visit_types(hidden, targets, [&](auto value, auto index) {
      using T = decltype(value);
      using Idx = decltype(index);
      cpu::token_logprobs_backward<T, Idx>(hidden.data<T>(), weight.data<T>(), targets.data<Idx>(), tokens, dim, vocab,
                                           temperature, lse.data<float>(), entropy.data<float>(), g_lp, g_ent,
                                           grad_hidden.defined() ? grad_hidden.data<T>() : nullptr,
                                           grad_weight.defined() ? grad_weight.data<float>() : nullptr);
    });
    return;
  }
#if SLIME_HAS_CUDA
  const Device dev = hidden.device();
  const Stream s = stream.device() == dev ? stream : Stream::default_for(dev);
  DeviceGuard guard(dev);
  Tensor ws = workspace.defined() ? workspace : Tensor::empty({int64_t(layout.total_bytes)}, DType::u8, dev, s);
  cuda::TokenLogprobsBackwardParams p{};
  p.hidden = hidden.data_ptr();
  p.weight = weight.data_ptr();
  p.targets = targets.data_ptr();
  p.dtype = hidden.dtype();
  p.target_dtype = targets.dtype();
  p.tokens = tokens;
  p.dim = dim;
  p.vocab = vocab;
  p.temperature = temperature;
  p.token_chunk = layout.token_chunk;
  p.vocab_chunk = layout.vocab_chunk;
  p.workspace = const_cast<void*>(d::workspace_ptr(op, ws, hidden, layout.total_bytes));
  p.workspace_bytes = ws.nbytes();
  p.lse = lse.data<float>();
  p.entropy = entropy.data<float>();
  p.maybe_grad_logprobs = g_lp;
  p.maybe_grad_entropy = g_ent;
  p.maybe_grad_hidden = grad_hidden.defined() ? grad_hidden.data_ptr() : nullptr;
  p.maybe_grad_weight = grad_weight.defined() ? grad_weight.data<float>() : nullptr;
  cuda::token_logprobs_backward(p, s.handle());
#else
  (void)workspace;
  (void)stream;
  SLIME_FAIL(op, ": ", hidden.device(), " needs the CUDA backend");
#endif
}

// The forward's outputs, allocated on the device of hidden.
struct TokenLogprobs {
  Tensor logprobs;  // f32 [tokens]
  Tensor entropy;   // f32 [tokens]
  Tensor lse;       // f32 [tokens], for the backward
};

// Buffers a caller keeps across calls (a model's Context does) so that
// token_logprobs and its backward allocate nothing once sized: the outputs,
// the GPU workspace and grad_hidden. What a call returns is a view of them,
// valid until the next call with the same buffers.
struct TokenLogprobsBuffers {
  Tensor logprobs, entropy, lse;
  Tensor workspace;  // GPU only: token_logprobs_workspace_bytes
  Tensor grad_hidden;
};

namespace token_logprobs_detail {
// The workspace view for the GPU (undefined on the CPU, which needs none).
inline Tensor buffer_workspace(TokenLogprobsBuffers& b, const Tensor& hidden, int64_t vocab, const Stream& stream) {
  if (!hidden.device().is_cuda()) return {};
  const std::size_t bytes = token_logprobs_workspace_bytes(hidden.size(0), hidden.size(1), vocab, hidden.dtype());
  return reuse_buffer(b.workspace, Shape{int64_t(bytes)}, DType::u8, hidden.device(), stream);
}
}  // namespace token_logprobs_detail

// token_logprobs_forward with its outputs and workspace in `buffers`.
inline TokenLogprobs token_logprobs(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                    float temperature, TokenLogprobsBuffers& buffers, const Stream& stream = {}) {
  SLIME_CHECK(hidden.defined() && hidden.dim() == 2, "token_logprobs: hidden must be [tokens, dim], got ",
              hidden.str());
  SLIME_CHECK(weight.defined() && weight.dim() == 2, "token_logprobs: weight must be [vocab, dim], got ", weight.str());
  const Device dev = hidden.device();
  const Shape shape{hidden.size(0)};
  TokenLogprobs out{reuse_buffer(buffers.logprobs, shape, DType::f32, dev, stream),
                    reuse_buffer(buffers.entropy, shape, DType::f32, dev, stream),
                    reuse_buffer(buffers.lse, shape, DType::f32, dev, stream)};
  const Tensor ws = token_logprobs_detail::buffer_workspace(buffers, hidden, weight.size(0), stream);
  token_logprobs_forward(hidden, weight, targets, temperature, out.logprobs, out.entropy, out.lse, ws, {}, stream);
  return out;
}

// Convenience forward that allocates its outputs (and, on the GPU, a workspace).
inline TokenLogprobs token_logprobs(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                    float temperature = 1.f, const Stream& stream = {}) {
  TokenLogprobsBuffers fresh;
  return token_logprobs(hidden, weight, targets, temperature, fresh, stream);
}

// grad_hidden (in `buffers`) from the gradients of token_logprobs' outputs;
// grad_weight (optional) accumulates. See token_logprobs_backward above.
inline Tensor token_logprobs_backward(const Tensor& hidden, const Tensor& weight, const Tensor& targets,
                                      float temperature, const TokenLogprobs& fwd, const Tensor& grad_logprobs,
                                      const Tensor& grad_entropy, const Tensor& grad_weight,
                                      TokenLogprobsBuffers& buffers, const Stream& stream = {}) {
  SLIME_CHECK(hidden.defined() && hidden.dim() == 2, "token_logprobs_backward: hidden must be [tokens, dim], got ",
              hidden.str());
  SLIME_CHECK(weight.defined() && weight.dim() == 2, "token_logprobs_backward: weight must be [vocab, dim], got ",
              weight.str());
  const Tensor grad_hidden = reuse_buffer(buffers.grad_hidden, hidden.shape(), hidden.dtype(), hidden.device(), stream);
  const Tensor ws = token_logprobs_detail::buffer_workspace(buffers, hidden, weight.size(0), stream);
  token_logprobs_backward(hidden, weight, targets, temperature, fwd.lse, fwd.entropy, grad_logprobs, grad_entropy,
                          grad_hidden, grad_weight, ws, {}, stream);
  return grad_hidden;
}

}  // namespace slime::ops
