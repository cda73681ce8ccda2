// slime/optim/grad_clip.hpp: global gradient-norm clipping over sharded
// gradients: global_grad_norm (the L2 norm of every gradient element of every
// rank, one all_reduce) and clip_coefficient (torch.nn.utils.clip_grad_norm_'s
// factor), which the caller passes to adamw_step as grad_scale, so clipping
// costs no pass over the gradients.
//
//   const double norm = optim::global_grad_norm(grad_shards, &comm, stream);
//   if (!std::isfinite(norm)) { /* skip the step, lower the lr, ... */ }
//   opt.step(params, grad_shards, schedule.lr(opt.step_count() + 1),
//            optim::clip_coefficient(norm, 1.0), copies, stream);
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/optim/cuda/adamw.hpp"

namespace slime::optim {

namespace cpu {

// Sum of x[i]^2 over n elements, accumulated in double.
template <class T>
double sum_of_squares(const T* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return s;
}

}  // namespace cpu

// The L2 norm of all elements of `grads` (f32, one device) together with the
// gradients of the other ranks of `comm`: each rank holds disjoint shards (as
// FSDP's reduce-scattered gradients), sums their squares locally, and one
// all_reduce (sum) adds the ranks' sums (as one f32 value on comm->device(),
// so the sharded norm equals the unsharded one to f32 rounding, ~1e-7
// relative). Without comm, the norm of the local gradients.
//
// Local sums: fp64 on the CPU; on the GPU fp32 partial sums per chunk of 64Ki
// elements added in fp64 in a fixed order (deterministic run to run; ~1e-7
// relative). Collective when comm is given. Reads the result back to the host
// (synchronises `stream`); on the GPU it allocates a small workspace (4 bytes
// per 64Ki elements) from the stream-ordered pool.
//
// A NaN or infinite gradient gives a NaN or infinite norm, returned as is:
// check std::isfinite before using it (clip_coefficient refuses it).
//
// `buffers` (optional, kept by the caller across steps, e.g. Sharded): the
// GPU workspace and the value all-reduced over comm, so that a steady-state
// call allocates nothing.
struct GradNormBuffers {
  Tensor workspace;  // GPU: the partial sums
  Tensor sum;        // the local sum of squares, all-reduced (on comm's device)
  Tensor host_sum;   // its host staging when comm's device is a GPU
};

inline double global_grad_norm(std::span<const Tensor> grads, comm::Comm* comm = nullptr,
                               [[maybe_unused]] const Stream& stream = {}, GradNormBuffers* buffers = nullptr) {
  GradNormBuffers scratch;
  GradNormBuffers& b = buffers ? *buffers : scratch;
  double local = 0;
  if (!grads.empty()) {
    SLIME_CHECK(grads[0].defined(), "global_grad_norm: grads[0] is undefined");
    const Device device = grads[0].device();
    for (std::size_t i = 0; i < grads.size(); ++i) {
      check_dtype(grads[i], DType::f32, "global_grad_norm: grads[" + std::to_string(i) + "]");
      SLIME_CHECK(grads[i].device() == device, "global_grad_norm: grads[", i, "] is ", grads[i].str(),
                  " but grads[0] is on ", device);
    }
    if (device.is_cuda()) {
#if SLIME_HAS_CUDA
      const Stream s = ops::detail::memops::stream_for(device, stream, "global_grad_norm");
      DeviceGuard guard(device);
      std::vector<const float*> data;
      std::vector<int64_t> numels;
      data.reserve(grads.size());
      numels.reserve(grads.size());
      for (const Tensor& g : grads) {
        data.push_back(g.data<float>());
        numels.push_back(g.numel());
      }
      const std::size_t bytes = cuda::sum_of_squares_workspace_bytes(numels);
      const Tensor ws = reuse_buffer(b.workspace, {int64_t((bytes + 7) / 8)}, DType::i64, device, s);
      cuda::sum_of_squares_multi_tensor(data, numels, ws.data_ptr(), s.handle());
      double result = 0;
      SLIME_CUDA_CHECK(cudaMemcpyAsync(&result, ws.data_ptr(), sizeof(double), cudaMemcpyDeviceToHost, s.handle()));
      s.synchronize();
      local = result;
#else
      ops::detail::memops::fail_no_cuda("global_grad_norm");
#endif
    } else {
      for (const Tensor& g : grads) local += cpu::sum_of_squares(g.data<float>(), g.numel());
    }
  }
  if (comm == nullptr) return std::sqrt(local);
  const Device on = comm->device();
  const Stream cs = on.is_cuda() && stream.device() != on ? Stream::default_for(on) : stream;
  Tensor t = reuse_buffer(b.sum, {1}, DType::f32, on, cs);
  if (on.is_cpu()) {
    t.data<float>()[0] = float(local);
  } else {
    const Tensor h = reuse_buffer(b.host_sum, {1}, DType::f32, Device::cpu(), Stream{});
    h.data<float>()[0] = float(local);
    t.copy_from(h, cs);
  }
  comm->all_reduce(t, comm::ReduceOp::sum, cs);
  return std::sqrt(double(t.to_vector<float>(cs)[0]));
}

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), capped
// at 1, to pass as grad_scale. Throws for a non-finite norm (the step would
// turn every parameter into NaN) and for max_norm not finite and > 0.
inline float clip_coefficient(double norm, double max_norm) {
  SLIME_CHECK(std::isfinite(max_norm) && max_norm > 0, "clip_coefficient: max_norm must be finite and > 0, got ",
              max_norm);
  SLIME_CHECK(std::isfinite(norm), "clip_coefficient: the gradient norm is ", norm,
              " (a NaN or inf gradient): skip this step instead of clipping");
  SLIME_CHECK(norm >= 0, "clip_coefficient: negative norm ", norm);
  const double c = max_norm / (norm + 1e-6);
  return c < 1 ? float(c) : 1.f;
}

}  // namespace slime::optim
