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
#pragma once

#include <cstddef>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"

namespace slime::nn {

class ParameterOffload {
 public:
  // with_grads: gradients travel too (a trainer between micro-batches);
  // without, an offloaded module has no gradients (they are dropped).
  explicit ParameterOffload(bool with_grads = false) : with_grads_(with_grads) {}

  bool offloaded() const { return offloaded_; }
  // Pinned bytes held (values, plus grads when with_grads).
  std::size_t host_bytes() const {
    std::size_t n = 0;
    for (const auto& t : values_) n += t.nbytes();
    for (const auto& t : grads_) n += t.nbytes();
    return n;
  }

  template <class M>
  void offload(M& module, const Stream& stream = {}) {
    if (offloaded_) return;
    std::size_t i = 0;
    module.for_each_parameter([&](Parameter& p) {
      SLIME_CHECK(p.value.defined(), "ParameterOffload::offload: parameter '", p.name, "' has no value");
      if (values_.size() <= i) {
        values_.emplace_back();
        grads_.emplace_back();
      }
      stash(values_[i], p.value, stream);
      if (with_grads_ && p.grad.defined()) stash(grads_[i], p.grad, stream);
      ++i;
    });
    stream.synchronize();
    i = 0;
    module.for_each_parameter([&](Parameter& p) {
      p.value = values_[i];
      p.grad = (with_grads_ && p.grad.defined()) ? grads_[i] : Tensor{};
      ++i;
    });
    offloaded_ = true;
  }

  template <class M>
  void onload(M& module, Device device, const Stream& stream = {}) {
    if (!offloaded_) return;
    module.for_each_parameter([&](Parameter& p) {
      p.value = p.value.to(device, stream);
      if (p.grad.defined()) p.grad = p.grad.to(device, stream);
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

  bool with_grads_ = false;
  bool offloaded_ = false;
  std::vector<Tensor> values_, grads_;
};

}  // namespace slime::nn
