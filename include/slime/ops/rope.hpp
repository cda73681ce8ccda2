// slime/ops/rope.hpp: rotary position embedding (rotate-half convention of
// Hugging Face Llama/Qwen3; also Qwen3-VL's interleaved MRoPE and 2-D vision
// rotary, see RopeSpec) on q and k, forward and backward, and the
// per-sequence positions of packed sequences, on the CPU or the GPU.
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (RoPE has none); activation gradients are written (=).
//
// For head_dim d and i < d/2 the pair (x[i], x[i + d/2]) of every head of
// token t turns by angle = positions[t] * inv_freq[i],
// inv_freq[i] = 1 / theta^(2i / d), all in fp32 as HF computes it (see
// slime/ops/cpu/rope.hpp; the GPU takes the host's fp32 inv_freq, so both
// backends use the same angles). HF then rounds cos/sin and each product to
// bf16 for a bf16 model; slime keeps fp32 until the single rounding of the
// output, which is more accurate and differs from HF by about one bf16 ulp.
//
// Positions are explicit (i32 [tokens]), so packed sequences restart at 0:
// positions_from_cu_seqlens() computes them, once per micro-batch, for every
// layer to share.
//
// Shapes: q [tokens, q_heads, head_dim], k [tokens, k_heads, head_dim] (k may
// be undefined: then k_out must be too), f32 or bf16, one dtype; head_dim even
// (GPU: <= 512). Out of place, or in place by passing q_out = q, k_out = k.
// The backward is the rotation by -angle (dq from dq_out); it needs no saved
// activations.
#pragma once

#include <cstdint>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/rope.hpp"
#include "slime/ops/cuda/rope.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

// positions [tokens] i32 from cu_seqlens [num_seqs + 1] i32 (same device):
// positions[t] = t - cu_seqlens[s] for the sequence s holding t. The CPU
// validates cu_seqlens (starts at 0, never decreases, ends at tokens); the GPU
// checks only shapes and dtypes, and leaves positions unspecified (but in
// bounds) for malformed cu_seqlens.
inline void positions_from_cu_seqlens(const Tensor& cu_seqlens, const Tensor& positions,
                                      [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  check_dtype(cu_seqlens, DType::i32, "positions_from_cu_seqlens: cu_seqlens");
  SLIME_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.numel() >= 1,
              "positions_from_cu_seqlens: cu_seqlens must be 1-d [num_seqs + 1], got ", cu_seqlens.str());
  check_dtype(positions, DType::i32, "positions_from_cu_seqlens: positions");
  SLIME_CHECK(positions.dim() == 1, "positions_from_cu_seqlens: positions must be 1-d [tokens], got ", positions.str());
  check_same_device(cu_seqlens, positions, "positions_from_cu_seqlens: cu_seqlens", "positions");
  SLIME_CHECK(!m::overlap(cu_seqlens, positions), "positions_from_cu_seqlens: positions overlaps cu_seqlens");
  const int64_t num_seqs = cu_seqlens.numel() - 1, tokens = positions.numel();
  if (positions.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(positions.device(), stream, "positions_from_cu_seqlens");
    DeviceGuard guard(positions.device());
    cuda::positions_from_cu_seqlens(static_cast<const int32_t*>(cu_seqlens.data_ptr()), num_seqs, tokens,
                                    static_cast<int32_t*>(positions.data_ptr()), s.handle());
    return;
#else
    m::fail_no_cuda("positions_from_cu_seqlens");
#endif
  }
  cpu::positions_from_cu_seqlens(static_cast<const int32_t*>(cu_seqlens.data_ptr()), num_seqs, tokens,
                                 static_cast<int32_t*>(positions.data_ptr()));
}

namespace detail::memops {

inline void rope_impl(const Tensor& q, const Tensor& k, const Tensor& positions, const RopeSpec& spec, const Tensor& q_out,
                      const Tensor& k_out, int sign, [[maybe_unused]] const Stream& stream, std::string_view op,
                      std::string_view qn, std::string_view kn, std::string_view qon, std::string_view kon) {
  using ::slime::detail::concat;
  check_f32_or_bf16(q, concat(op, ": ", qn));
  SLIME_CHECK(q.dim() == 3, op, ": ", qn, " must be 3-d [tokens, heads, head_dim], got ", q.str());
  const int64_t tokens = q.size(0), head_dim = q.size(2);
  SLIME_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be even and positive, got ", q.str());
  spec.check(head_dim, op);
  check_dtype(q_out, q.dtype(), concat(op, ": ", qon));
  check_shape(q_out, q.shape(), concat(op, ": ", qon));
  check_dtype(positions, DType::i32, concat(op, ": positions"));
  if (spec.axes() == 1) {
    check_shape(positions, Shape{tokens}, concat(op, ": positions"));
  } else {
    SLIME_CHECK(positions.dim() == 2 && positions.size(0) == tokens && positions.size(1) == spec.axes(), op,
                ": positions must be [", tokens, ", ", spec.axes(), "] for the ", spec.name(), " rotary, got ",
                positions.str());
  }
  check_same_device(q, q_out, concat(op, ": ", qn), qon);
  check_same_device(q, positions, concat(op, ": ", qn), "positions");
  SLIME_CHECK(k.defined() == k_out.defined(), op, ": ", kn, " and ", kon, " must both be given or both be undefined");
  SLIME_CHECK(!partially_overlap(q_out, q) && !overlap(q_out, positions), op, ": ", qon,
              " overlaps another tensor of the call (in place is allowed only as the same tensor)");
  if (k.defined()) {
    check_dtype(k, q.dtype(), concat(op, ": ", kn));
    SLIME_CHECK(k.dim() == 3 && k.size(0) == tokens && k.size(2) == head_dim, op, ": ", kn, " must be [", tokens,
                ", heads, ", head_dim, "] like ", qn, ", got ", k.str());
    check_dtype(k_out, k.dtype(), concat(op, ": ", kon));
    check_shape(k_out, k.shape(), concat(op, ": ", kon));
    check_same_device(q, k, concat(op, ": ", qn), kn);
    check_same_device(q, k_out, concat(op, ": ", qn), kon);
    SLIME_CHECK(!partially_overlap(k_out, k) && !overlap(k_out, positions) && !overlap(k_out, q) &&
                    !overlap(k_out, q_out) && !overlap(q_out, k),
                op, ": ", kon, " or ", qon, " overlaps another tensor of the call");
  }
  if (q.device().is_cuda()) {
#if SLIME_HAS_CUDA
    SLIME_CHECK(head_dim <= cuda::kRopeMaxHeadDim, op, ": head_dim ", head_dim, " exceeds the GPU limit ",
                cuda::kRopeMaxHeadDim);
    const Stream s = stream_for(q.device(), stream, op);
    DeviceGuard guard(q.device());
    cuda::RopeArgs args{};
    args.q = q.data_ptr();
    args.q_out = q_out.data_ptr();
    args.q_heads = q.size(1);
    args.k = k.defined() ? k.data_ptr() : nullptr;
    args.k_out = k.defined() ? k_out.data_ptr() : nullptr;
    args.k_heads = k.defined() ? k.size(1) : 0;
    args.positions = static_cast<const int32_t*>(positions.data_ptr());
    args.tokens = tokens;
    args.head_dim = head_dim;
    args.spec = spec;
    args.sign = sign;
    args.dtype = q.dtype();
    cuda::rope(args, s.handle());
    return;
#else
    fail_no_cuda(op);
#endif
  }
  visit_f32_bf16(q.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const auto* pos = static_cast<const int32_t*>(positions.data_ptr());
    cpu::rope_rotate(static_cast<const T*>(q.data_ptr()), pos, tokens, q.size(1), head_dim, spec, sign,
                     static_cast<T*>(q_out.data_ptr()));
    if (k.defined())
      cpu::rope_rotate(static_cast<const T*>(k.data_ptr()), pos, tokens, k.size(1), head_dim, spec, sign,
                       static_cast<T*>(k_out.data_ptr()));
  });
}

}  // namespace detail::memops

// q_out = rope(q), k_out = rope(k) at `positions` (i32 [tokens, spec.axes()];
// [tokens] for the text kind) as `spec` says (slime/ops/cpu/rope.hpp: text,
// Qwen3-VL's interleaved MRoPE, its vision tower's 2-D rotary). q_out may be q
// and k_out may be k.
inline void rope_forward(const Tensor& q, const Tensor& k, const Tensor& positions, const RopeSpec& spec,
                         const Tensor& q_out, const Tensor& k_out, const Stream& stream = {}) {
  detail::memops::rope_impl(q, k, positions, spec, q_out, k_out, +1, stream, "rope_forward", "q", "k", "q_out",
                            "k_out");
}

// The text rotary at `positions` (i32 [tokens]) with base `theta` (Qwen3:
// config.rope_theta).
inline void rope_forward(const Tensor& q, const Tensor& k, const Tensor& positions, double theta, const Tensor& q_out,
                         const Tensor& k_out, const Stream& stream = {}) {
  rope_forward(q, k, positions, RopeSpec::text(theta), q_out, k_out, stream);
}

// dq = rope^T(dq_out), dk = rope^T(dk_out): the rotation by -angle (written).
// dq may be dq_out and dk may be dk_out.
inline void rope_backward(const Tensor& dq_out, const Tensor& dk_out, const Tensor& positions, const RopeSpec& spec,
                          const Tensor& dq, const Tensor& dk, const Stream& stream = {}) {
  detail::memops::rope_impl(dq_out, dk_out, positions, spec, dq, dk, -1, stream, "rope_backward", "dq_out", "dk_out",
                            "dq", "dk");
}

inline void rope_backward(const Tensor& dq_out, const Tensor& dk_out, const Tensor& positions, double theta,
                          const Tensor& dq, const Tensor& dk, const Stream& stream = {}) {
  rope_backward(dq_out, dk_out, positions, RopeSpec::text(theta), dq, dk, stream);
}

}  // namespace slime::ops
