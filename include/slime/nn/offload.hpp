// slime/nn/offload.hpp: moving a module's parameters (and gradients) to
// pinned host memory and back, so that a colocated trainer and rollout engine
// can take turns on one GPU.
//
//   nn::ParameterOffload off;
//   off.offload(model, stream);          // values (and grads) -> pinned host; device memory freed
//   ...                                  // the other side uses the GPU
//   off.onload(model, device, stream);   // back, bit for bit
//
// The pinned buffers are allocated once and reused, so cycles allocate no
// host memory after the first. offload synchronises `stream` (the device
// buffers are freed only after the copies finished); onload is stream-ordered.
// While offloaded, Parameter::value (and grad) are the pinned host tensors:
// reading them works, running the module on the device does not.
//
// Options: release_values leaves Parameter::value undefined while offloaded
// (the pinned copies stay reachable through host_value(i)); frozen says the
// module's values do not change while onloaded (a reference model), so an
// onload / offload cycle copies nothing back: only copies marked stale
// (mark_stale(), after writing the device values) are refreshed.
#pragma once

#include <cstddef>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"

namespace slime::nn {

class ParameterOffload {
 public:
  struct Options {
    // Gradients travel too (a trainer between micro-batches); without, an
    // offloaded module has no gradients (they are dropped).
    bool with_grads = false;
    // Parameter::value is undefined while offloaded (not the pinned tensor).
    bool release_values = false;
    // The values do not change while onloaded: the pinned copies stay current
    // across onload, and offload copies only the ones marked stale.
    bool frozen = false;
  };

  explicit ParameterOffload(bool with_grads = false) : opt_{.with_grads = with_grads} {}
  explicit ParameterOffload(Options options) : opt_(options) {}

  bool offloaded() const { return offloaded_; }
  // Pinned bytes held (values, plus grads when with_grads).
  std::size_t host_bytes() const {
    std::size_t n = 0;
    for (const auto& t : values_) n += t.nbytes();
    for (const auto& t : grads_) n += t.nbytes();
    return n;
  }

  // The pinned copy of the i-th parameter (for_each_parameter order); defined
  // after the first offload. While offloaded it holds the weights: writing
  // into it changes what onload brings back.
  Tensor& host_value(std::size_t i) {
    SLIME_CHECK(i < values_.size(), "ParameterOffload::host_value: parameter ", i, " of ", values_.size(),
                " pinned copies (offload first)");
    return values_[i];
  }

  // The device values changed (frozen mode): the next offload copies them all.
  void mark_stale() { current_.assign(current_.size(), false); }

  template <class M>
  void offload(M& module, const Stream& stream = {}) {
    if (offloaded_) return;
    std::size_t i = 0;
    Device device = Device::cpu();
    module.for_each_parameter([&](Parameter& p) {
      SLIME_CHECK(p.value.defined(), "ParameterOffload::offload: parameter '", p.name, "' has no value");
      if (values_.size() <= i) {
        values_.emplace_back();
        grads_.emplace_back();
        current_.push_back(false);
      }
      if (p.value.device().is_cuda()) device = p.value.device();
      if (!current_[i]) stash(values_[i], p.value, stream);
      current_[i] = true;
      if (opt_.with_grads && p.grad.defined()) stash(grads_[i], p.grad, stream);
      ++i;
    });
    // The copies ran on `stream`, or on the device's default stream when
    // `stream` is the CPU one: wait for them before the device buffers go.
    if (stream.device().is_cuda()) {
      stream.synchronize();
    } else if (device.is_cuda()) {
      Stream::default_for(device).synchronize();
    }
    i = 0;
    module.for_each_parameter([&](Parameter& p) {
      p.value = opt_.release_values ? Tensor{} : values_[i];
      p.grad = (opt_.with_grads && p.grad.defined()) ? grads_[i] : Tensor{};
      ++i;
    });
    offloaded_ = true;
  }

  template <class M>
  void onload(M& module, Device device, const Stream& stream = {}) {
    if (!offloaded_) return;
    std::size_t i = 0;
    module.for_each_parameter([&](Parameter& p) {
      p.value = (opt_.release_values ? values_[i] : p.value).to(device, stream);
      if (p.grad.defined()) p.grad = p.grad.to(device, stream);
      if (!opt_.frozen) current_[i] = false;  // the module may change them
      ++i;
    });
    offloaded_ = false;
  }

 private:
  // host = a pinned copy of `t` (the buffer reused when the shape matches).
  static void stash(Tensor& host, const Tensor& t, const Stream& stream) {
    if (!host.defined() || host.shape() != t.shape() || host.dtype() != t.dtype())
      host = Tensor::empty_pinned(t.shape(), t.dtype());
    if (!host.shares_storage_with(t)) host.copy_from(t, stream);  // a CPU module onloaded "to" the CPU
  }

  Options opt_;
  bool offloaded_ = false;
  std::vector<Tensor> values_, grads_;
  std::vector<bool> current_;  // values_[i] holds the module's current values
};

}  // namespace slime::nn
