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
//
// Without a host wait (the GPU's step runs ahead of the host): the norm and
// the factor stay on the device, AdamW reads the factor there, and the host
// reads the norm later (PendingNorm), e.g. when it logs the step:
//   optim::ClipBuffers clip;  // kept across steps
//   const Tensor& factor = optim::clip_factor(
//       std::array{optim::NormGroup{grad_shards, &comm}}, 1.0, device, stream, clip);
//   opt.step(params, grad_shards, lr, 1.f, copies, stream, factor);
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
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

// ---- the clip factor on the device -------------------------------------------

// One group of gradients whose norm is taken over `comm` (nullptr: this
// rank's alone): Sharded's sharded gradients over the shard group, or
// NoShard's expert gradients over ep.
struct NormGroup {
  std::span<const Tensor> grads;
  comm::Comm* comm = nullptr;
};

// Kept by the caller across steps (Sharded keeps one), so that a steady-state
// clip_factor allocates nothing: each group's sum, and the results.
struct ClipBuffers {
  std::array<GradNormBuffers, 2> groups;
  Tensor sums;    // GPU: f32 [2], each group's sum of squares, all-reduced
  Tensor norm;    // the global norm, an fp64 in 8 bytes (i64 [1]: Tensor has no f64 dtype)
  Tensor factor;  // f32 [1]: clip_coefficient(norm, max_norm), NaN when the norm is not finite
};

namespace detail {

inline void check_norm_group(const NormGroup& g, Device device, std::size_t index) {
  for (std::size_t i = 0; i < g.grads.size(); ++i) {
    const std::string at = "clip_factor: groups[" + std::to_string(index) + "].grads[" + std::to_string(i) + "]";
    check_dtype(g.grads[i], DType::f32, at);
    SLIME_CHECK(g.grads[i].device() == device, at, " is ", g.grads[i].str(), ", expected on ", device);
  }
  if (device.is_cuda() && g.comm != nullptr)
    SLIME_CHECK(g.comm->device() == device, "clip_factor: groups[", index, "].comm works on ", g.comm->device(),
                ", not on the gradients' device ", device, " (use global_grad_norm and clip_coefficient)");
}

}  // namespace detail

// The global norm of 1 or 2 gradient groups (√(n₀² + n₁²) for two, each nᵢ as
// global_grad_norm gives it, with the same roundings) and
// clip_coefficient(norm, max_norm), left in b.norm / b.factor on `device`
// (the gradients' device). On the GPU every step is queued on `stream` (the
// sums, their all-reduce over each comm on the device, one kernel for the
// factor): no host wait, so the factor can only be used on the device, by
// adamw_step's device_grad_scale. A norm that is not finite gives a NaN
// factor, and adamw_step then skips the update; read b.norm to learn it (a
// PendingNorm). On the CPU the same values, computed at once. Returns
// b.factor. Collective over each group's comm: every rank calls it.
inline const Tensor& clip_factor(std::span<const NormGroup> groups, double max_norm, Device device,
                                 [[maybe_unused]] const Stream& stream, ClipBuffers& b) {
  SLIME_CHECK(groups.size() == 1 || groups.size() == 2, "clip_factor: 1 or 2 gradient groups, got ", groups.size());
  SLIME_CHECK(std::isfinite(max_norm) && max_norm > 0, "clip_factor: max_norm must be finite and > 0, got ", max_norm);
  for (std::size_t i = 0; i < groups.size(); ++i) detail::check_norm_group(groups[i], device, i);
  if (device.is_cpu()) {
    double norm = global_grad_norm(groups[0].grads, groups[0].comm, stream, &b.groups[0]);
    if (groups.size() == 2) {
      const double e = global_grad_norm(groups[1].grads, groups[1].comm, stream, &b.groups[1]);
      norm = std::sqrt(norm * norm + e * e);
    }
    *static_cast<double*>(reuse_buffer(b.norm, {1}, DType::i64, device, stream).data_ptr()) = norm;
    reuse_buffer(b.factor, {1}, DType::f32, device, stream).data<float>()[0] =
        std::isfinite(norm) ? clip_coefficient(norm, max_norm) : std::numeric_limits<float>::quiet_NaN();
    return b.factor;
  }
#if SLIME_HAS_CUDA
  const Stream s = ops::detail::memops::stream_for(device, stream, "clip_factor");
  DeviceGuard guard(device);
  const Tensor norm = reuse_buffer(b.norm, {1}, DType::i64, device, s);
  const Tensor factor = reuse_buffer(b.factor, {1}, DType::f32, device, s);
  const Tensor sums = reuse_buffer(b.sums, {2}, DType::f32, device, s);
  cuda::NormSums on_device;
  on_device.count = int(groups.size());
  for (std::size_t i = 0; i < groups.size(); ++i) {
    Tensor sum = sums.view(int64_t(i), {1});
    std::vector<const float*> data;
    std::vector<int64_t> numels;
    for (const Tensor& t : groups[i].grads) {
      data.push_back(t.data<float>());
      numels.push_back(t.numel());
    }
    const std::size_t bytes = cuda::sum_of_squares_workspace_bytes(numels);
    Tensor ws = reuse_buffer(b.groups[i].workspace, {int64_t((bytes + 7) / 8)}, DType::i64, device, s);
    if (data.empty()) {
      ws.zero_(s);
      sum.zero_(s);
    } else {
      cuda::sum_of_squares_multi_tensor(data, numels, ws.data_ptr(), s.handle(), sum.data<float>());
    }
    if (groups[i].comm != nullptr) {
      groups[i].comm->all_reduce(sum, comm::ReduceOp::sum, s);
      on_device.f32[i] = sum.data<float>();
    } else {
      on_device.f64[i] = static_cast<const double*>(ws.data_ptr());  // global_grad_norm without comm: not rounded
    }
  }
  cuda::clip_factor_on_device(on_device, max_norm, static_cast<double*>(norm.data_ptr()), factor.data<float>(),
                              s.handle());
  return b.factor;
#else
  ops::detail::memops::fail_no_cuda("clip_factor");
#endif
}

// The norm of an optimizer step queued without a host wait (Sharded::
// queue_optimizer_step), read when the caller asks: get() waits for the
// step's norm on the GPU (one host wait, the first time) and returns it. A
// default-constructed one holds no norm (the step did not clip).
class PendingNorm {
 public:
  // A pinned host slot, its copy event and the value once read. Kept by a
  // PendingNormPool and handed to one PendingNorm at a time.
  struct Slot {
    Tensor host;  // the norm's fp64 (i64 [1]), pinned (or CPU)
    Event ready;
    double value = 0;
    bool read = false;
  };

  PendingNorm() = default;
  explicit PendingNorm(std::shared_ptr<Slot> slot) : slot_(std::move(slot)) {}

  bool has_value() const { return slot_ != nullptr; }
  double get() const {
    SLIME_CHECK(slot_ != nullptr, "PendingNorm::get: the step did not clip, so it has no norm (has_value() is false)");
    if (!slot_->read) {
      slot_->ready.synchronize();
      slot_->value = *static_cast<const double*>(slot_->host.data_ptr());
      slot_->read = true;
    }
    return slot_->value;
  }

 private:
  std::shared_ptr<Slot> slot_;
};

// The slots of a caller's PendingNorms: publish(norm, stream) copies the
// device norm into a slot no live PendingNorm holds (a new one only while the
// caller keeps earlier ones unread and alive), so a step allocates nothing
// when each PendingNorm is dropped or read before the next.
class PendingNormPool {
 public:
  PendingNorm publish(const Tensor& norm, const Stream& stream) {
    std::shared_ptr<PendingNorm::Slot> slot;
    for (const auto& s : slots_)
      if (s.use_count() == 1 && s->host.defined() && s->ready.device() == norm.device()) {
        slot = s;
        break;
      }
    if (slot == nullptr) {
      slot = std::make_shared<PendingNorm::Slot>();
      slot->host = norm.device().is_cuda() ? Tensor::empty_pinned({1}, DType::i64) : Tensor::empty({1}, DType::i64);
      slot->ready = Event(norm.device(), false);
      slots_.push_back(slot);
    }
    slot->host.copy_from(norm, stream);
    if (norm.device().is_cuda()) slot->ready.record(stream);
    slot->read = false;
    return PendingNorm(slot);
  }
  void clear() { slots_.clear(); }

 private:
  std::vector<std::shared_ptr<PendingNorm::Slot>> slots_;
};

}  // namespace slime::optim
