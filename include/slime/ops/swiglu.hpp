// slime/ops/swiglu.hpp: the SwiGLU gate of the Qwen3 MLP, h = silu(gate) * up,
// forward and backward, on the CPU or the GPU.
//
// Accumulation contract: parameter gradients accumulate (+=) into fp32
// tensors (SwiGLU has none); activation gradients are written (=).
//
// Two layouts:
//   separate  gate and up are two tensors of one shape [..., F] (e.g. two
//             projections, or the two halves of a [2, tokens, F] buffer);
//   fused     gate_up [tokens, 2F] as one projection with the weights
//             [W_gate; W_up] writes it: row t holds gate[t, :] then up[t, :].
//             (Those halves are not contiguous tensors, so the fused calls
//             take the one tensor and read it with a row stride.)
// f32 or bf16, one dtype; fp32 math (silu(g) = g / (1 + exp(-g)) with an
// accurate exp), one rounding per output. HF rounds silu(gate) to bf16 before
// the product; slime does not (about one bf16 ulp of difference).
// Outputs may be the same tensor as an input (in place), never a partial
// overlap.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <utility>

#include "slime/core/tensor.hpp"
#include "slime/ops/cpu/swiglu.hpp"
#include "slime/ops/cuda/swiglu.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::ops {

namespace detail::memops {

// rows x cols of a [..., cols] tensor; cols of a 0-d tensor is 1.
inline int64_t last_extent(const Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }

inline void check_no_partial_overlap(std::initializer_list<const Tensor*> outputs,
                                     std::initializer_list<const Tensor*> inputs, std::string_view op) {
  for (const Tensor* o : outputs)
    for (const Tensor* i : inputs)
      SLIME_CHECK(!partially_overlap(*o, *i), op,
                  ": an output partially overlaps an input (in place is allowed only as the same tensor)");
  for (auto a = outputs.begin(); a != outputs.end(); ++a)
    for (auto b = a + 1; b != outputs.end(); ++b) SLIME_CHECK(!overlap(**a, **b), op, ": two outputs overlap");
}

}  // namespace detail::memops

// h = silu(gate) * up; gate, up, h of one shape and dtype.
inline void swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h,
                           [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(gate, "swiglu_forward: gate");
  for (auto [t, name] : {std::pair{&up, "swiglu_forward: up"}, std::pair{&h, "swiglu_forward: h"}}) {
    check_dtype(*t, gate.dtype(), name);
    check_shape(*t, gate.shape(), name);
    check_same_device(gate, *t, "swiglu_forward: gate", name);
  }
  m::check_no_partial_overlap({&h}, {&gate, &up}, "swiglu_forward");
  if (gate.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const int64_t cols = m::last_extent(gate), rows = cols == 0 ? 0 : gate.numel() / cols;
    const Stream s = m::stream_for(gate.device(), stream, "swiglu_forward");
    DeviceGuard guard(gate.device());
    cuda::swiglu_forward({gate.data_ptr(), cols, up.data_ptr(), cols, h.data_ptr(), cols, rows, cols, gate.dtype()},
                         s.handle());
    return;
#else
    m::fail_no_cuda("swiglu_forward");
#endif
  }
  m::visit_f32_bf16(gate.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::swiglu_forward(static_cast<const T*>(gate.data_ptr()), static_cast<const T*>(up.data_ptr()), gate.numel(),
                        static_cast<T*>(h.data_ptr()));
  });
}

// dgate = dh * up * silu'(gate), dup = dh * silu(gate) (written); all five of
// one shape and dtype.
inline void swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh, const Tensor& dgate,
                            const Tensor& dup, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(gate, "swiglu_backward: gate");
  for (auto [t, name] : {std::pair{&up, "swiglu_backward: up"}, std::pair{&dh, "swiglu_backward: dh"},
                         std::pair{&dgate, "swiglu_backward: dgate"}, std::pair{&dup, "swiglu_backward: dup"}}) {
    check_dtype(*t, gate.dtype(), name);
    check_shape(*t, gate.shape(), name);
    check_same_device(gate, *t, "swiglu_backward: gate", name);
  }
  m::check_no_partial_overlap({&dgate, &dup}, {&gate, &up, &dh}, "swiglu_backward");
  if (gate.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const int64_t cols = m::last_extent(gate), rows = cols == 0 ? 0 : gate.numel() / cols;
    const Stream s = m::stream_for(gate.device(), stream, "swiglu_backward");
    DeviceGuard guard(gate.device());
    cuda::swiglu_backward({gate.data_ptr(), cols, up.data_ptr(), cols, dh.data_ptr(), cols, dgate.data_ptr(), cols,
                           dup.data_ptr(), cols, rows, cols, gate.dtype()},
                          s.handle());
    return;
#else
    m::fail_no_cuda("swiglu_backward");
#endif
  }
  m::visit_f32_bf16(gate.dtype(), [&](auto tag) {
    using T = decltype(tag);
    cpu::swiglu_backward(static_cast<const T*>(gate.data_ptr()), static_cast<const T*>(up.data_ptr()),
                         static_cast<const T*>(dh.data_ptr()), gate.numel(), static_cast<T*>(dgate.data_ptr()),
                         static_cast<T*>(dup.data_ptr()));
  });
}

// h [tokens, F] = silu(gate_up[:, :F]) * gate_up[:, F:], gate_up [tokens, 2F].
inline void swiglu_forward_fused(const Tensor& gate_up, const Tensor& h, [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(gate_up, "swiglu_forward_fused: gate_up");
  SLIME_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "swiglu_forward_fused: gate_up must be 2-d [tokens, 2F], got ", gate_up.str());
  const int64_t rows = gate_up.size(0), cols = gate_up.size(1) / 2;
  check_dtype(h, gate_up.dtype(), "swiglu_forward_fused: h");
  check_shape(h, Shape{rows, cols}, "swiglu_forward_fused: h");
  check_same_device(gate_up, h, "swiglu_forward_fused: gate_up", "h");
  SLIME_CHECK(!m::overlap(h, gate_up), "swiglu_forward_fused: h overlaps gate_up");
  if (gate_up.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(gate_up.device(), stream, "swiglu_forward_fused");
    DeviceGuard guard(gate_up.device());
    const char* base = static_cast<const char*>(gate_up.data_ptr());
    cuda::swiglu_forward({base, 2 * cols, base + cols * int64_t(dtype_size(gate_up.dtype())), 2 * cols, h.data_ptr(),
                          cols, rows, cols, gate_up.dtype()},
                         s.handle());
    return;
#else
    m::fail_no_cuda("swiglu_forward_fused");
#endif
  }
  m::visit_f32_bf16(gate_up.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(gate_up.data_ptr());
    T* out = static_cast<T*>(h.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      cpu::swiglu_forward(in + r * 2 * cols, in + r * 2 * cols + cols, cols, out + r * cols);
  });
}

// dgate_up [tokens, 2F] (dgate then dup per row, written) from gate_up
// [tokens, 2F] and dh [tokens, F]. dgate_up may be gate_up (in place).
inline void swiglu_backward_fused(const Tensor& gate_up, const Tensor& dh, const Tensor& dgate_up,
                                  [[maybe_unused]] const Stream& stream = {}) {
  namespace m = detail::memops;
  m::check_f32_or_bf16(gate_up, "swiglu_backward_fused: gate_up");
  SLIME_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "swiglu_backward_fused: gate_up must be 2-d [tokens, 2F], got ", gate_up.str());
  const int64_t rows = gate_up.size(0), cols = gate_up.size(1) / 2;
  check_dtype(dh, gate_up.dtype(), "swiglu_backward_fused: dh");
  check_shape(dh, Shape{rows, cols}, "swiglu_backward_fused: dh");
  check_dtype(dgate_up, gate_up.dtype(), "swiglu_backward_fused: dgate_up");
  check_shape(dgate_up, gate_up.shape(), "swiglu_backward_fused: dgate_up");
  check_same_device(gate_up, dh, "swiglu_backward_fused: gate_up", "dh");
  check_same_device(gate_up, dgate_up, "swiglu_backward_fused: gate_up", "dgate_up");
  m::check_no_partial_overlap({&dgate_up}, {&gate_up, &dh}, "swiglu_backward_fused");
  SLIME_CHECK(!m::overlap(dgate_up, dh), "swiglu_backward_fused: dgate_up overlaps dh");
  if (gate_up.device().is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = m::stream_for(gate_up.device(), stream, "swiglu_backward_fused");
    DeviceGuard guard(gate_up.device());
    const std::size_t half = std::size_t(cols) * dtype_size(gate_up.dtype());
    const char* in = static_cast<const char*>(gate_up.data_ptr());
    char* out = static_cast<char*>(dgate_up.data_ptr());
    cuda::swiglu_backward({in, 2 * cols, in + half, 2 * cols, dh.data_ptr(), cols, out, 2 * cols, out + half, 2 * cols,
                           rows, cols, gate_up.dtype()},
                          s.handle());
    return;
#else
    m::fail_no_cuda("swiglu_backward_fused");
#endif
  }
  m::visit_f32_bf16(gate_up.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const T* in = static_cast<const T*>(gate_up.data_ptr());
    const T* d = static_cast<const T*>(dh.data_ptr());
    T* out = static_cast<T*>(dgate_up.data_ptr());
    for (int64_t r = 0; r < rows; ++r)
      cpu::swiglu_backward(in + r * 2 * cols, in + r * 2 * cols + cols, d + r * cols, cols, out + r * 2 * cols,
                           out + r * 2 * cols + cols);
  });
}

}  // namespace slime::ops
