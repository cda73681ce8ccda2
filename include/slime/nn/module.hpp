// slime/nn/module.hpp: what every slime::nn module shares: Parameter (a value
// with its Hugging Face name and an fp32 gradient), the forward/backward
// contract, and small helpers for allocation and argument checks.
//
// Contract of every module (no autograd engine, llm.c style):
//   - A module is a plain struct of Parameters and sub-modules, and exposes
//     `template <class F> void for_each_parameter(F&& f)` calling f(Parameter&)
//     for every parameter it owns, in a fixed order, with HF names.
//   - `forward(x, ctx, stream)` returns a new output tensor and saves what the
//     backward needs in `ctx` (a plain struct of tensors, one per call: keep
//     one context per micro-batch in flight).
//   - `backward(ctx, dy, stream)` reads the context and returns the gradient of
//     the input (activation gradients are WRITTEN, `=`, into new tensors), and
//     ACCUMULATES (`+=`) the parameter gradients into `Parameter::grad`, fp32,
//     allocated and zeroed on first use. Call zero_grad() before the first
//     micro-batch of a step; several backwards in a row sum their gradients.
//   - Weights and activations share the module's dtype: f32 (CPU reference) or
//     bf16 (GPU); RMSNorm statistics, softmax, logits and gradients are fp32.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "slime/core/dtype.hpp"
#include "slime/core/error.hpp"
#include "slime/core/random.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

namespace slime::nn {

// How init_random fills a parameter: N(0, std) for projections and
// embeddings, ones for norm weights (as transformers initialises them).
enum class ParamInit : uint8_t { normal, ones };

// One trainable tensor: `value` in the module's dtype, `grad` fp32 of the same
// shape on the same device (undefined until ensure_grad / zero_grad).
//
// Stacked expert weights: a Parameter whose name contains "{}" (e.g.
// "model.layers.0.mlp.experts.{}.up_proj.weight", value [E_local, out, in])
// stacks along dim 0 the HF tensors named with "{}" replaced by
// first_expert + i, i in [0, E_local) (expert parallelism holds a slice).
struct Parameter {
  std::string name;  // Hugging Face name, e.g. "model.layers.0.mlp.up_proj.weight"
  Tensor value;
  Tensor grad;
  ParamInit init = ParamInit::normal;
  int64_t first_expert = 0;   // stacked expert weights only (see above)
  int64_t stack_experts = 0;  // stacked expert weights: E of the whole stack (0: the value's dim 0)

  bool is_expert_stack() const { return name.find("{}") != std::string::npos; }
  // The HF name of stack entry i (requires is_expert_stack()).
  std::string expert_name(int64_t i) const {
    const auto at = name.find("{}");
    SLIME_CHECK(at != std::string::npos, "parameter '", name, "' is not a stacked expert weight");
    return name.substr(0, at) + std::to_string(first_expert + i) + name.substr(at + 2);
  }

  // Allocates a zero gradient when there is none; returns it.
  Tensor& ensure_grad(const Stream& stream = {}) {
    SLIME_CHECK(value.defined(), "parameter '", name, "' has no value");
    if (!grad.defined()) grad = Tensor::zeros(value.shape(), DType::f32, value.device(), stream);
    return grad;
  }
  // Sets the gradient to zero (allocating it when needed).
  void zero_grad(const Stream& stream = {}) {
    if (grad.defined()) {
      grad.zero_(stream);
    } else {
      ensure_grad(stream);
    }
  }
};

// Where a module lives and in which dtype its weights and activations are.
struct ModuleOptions {
  Device device = Device::cpu();
  DType dtype = DType::f32;
};

namespace detail {

inline void check_module_options(const ModuleOptions& o, std::string_view what) {
  SLIME_CHECK(o.dtype == DType::f32 || o.dtype == DType::bf16, what, ": dtype must be f32 or bf16, got ",
              dtype_name(o.dtype));
  check_device_exists(o.device);
}

// An activation argument: defined, the module's dtype and device, last extent
// `features` (when >= 0).
inline void check_activation(const Tensor& t, const ModuleOptions& o, int64_t features, std::string_view what) {
  SLIME_CHECK(t.defined(), what, " is undefined");
  SLIME_CHECK(t.dtype() == o.dtype, what, " must be ", dtype_name(o.dtype), " (the module's dtype), got ", t.str());
  SLIME_CHECK(t.device() == o.device, what, " must be on ", o.device, " (the module's device), got ", t.str());
  SLIME_CHECK(t.dim() >= 1, what, " must have at least 1 dim, got ", t.str());
  if (features >= 0) SLIME_CHECK(t.size(-1) == features, what, " must have last extent ", features, ", got ", t.str());
}

// A byte buffer that grows on demand and is reused across calls (workspaces
// of the GPU backward ops). Empty when `bytes` is 0.
inline const Tensor& scratch_bytes(Tensor& cache, std::size_t bytes, Device device, const Stream& stream) {
  if (bytes == 0) return cache;
  if (!cache.defined() || cache.nbytes() < bytes || cache.device() != device)
    cache = Tensor::empty({int64_t((bytes + 255) / 256 * 256)}, DType::u8, device, stream);
  return cache;
}

// A [rows, cols] view of `cache`, which is reallocated only when too small
// (then to max(need, 1.5 x its size)) or of another dtype or device: buffers
// that keep their capacity across steps, so a steady-state call allocates
// nothing.
inline Tensor rows_view(Tensor& cache, int64_t rows, int64_t cols, DType dtype, Device device, const Stream& stream) {
  return reuse_buffer(cache, Shape{rows, cols}, dtype, device, stream);
}

// A 1-D view of n elements of `cache` (as rows_view).
inline Tensor vec_view(Tensor& cache, int64_t n, DType dtype, Device device, const Stream& stream) {
  return rows_view(cache, n, 1, dtype, device, stream).reshape(Shape{n});
}

// A tensor of `shape` over `cache` (grown as rows_view grows it). The modules
// write their outputs and saved values into buffers of their Context this
// way, so that a Context reused for the next step (or micro-batch) allocates
// nothing once its buffers are large enough, and a fresh Context behaves as
// before. What a forward or backward returns stays valid until the next call
// with the same Context writes the same buffer.
inline Tensor context_buffer(Tensor& cache, const Shape& shape, DType dtype, Device device, const Stream& stream) {
  return vec_view(cache, shape.numel(), dtype, device, stream).reshape(shape);
}

}  // namespace detail

// Zeroes (allocating when needed) every parameter gradient of `module`.
template <class M>
void zero_grad(M& module, const Stream& stream = {}) {
  module.for_each_parameter([&](Parameter& p) { p.zero_grad(stream); });
}

// Number of parameter elements of `module`.
template <class M>
int64_t num_parameters(M& module) {
  int64_t n = 0;
  module.for_each_parameter([&](Parameter& p) { n += p.value.numel(); });
  return n;
}

// Fills every parameter of `module` in visiting order: ParamInit::normal with
// N(0, std) drawn from the counter-based stream `seed` at consecutive offsets
// (so the values do not depend on the device), ParamInit::ones with 1. A
// slice of an expert stack (expert parallelism: experts [first_expert,
// + dim 0) of stack_experts) takes the offsets its experts have in the whole
// stack, so every ep rank holds the values of the unsplit model's slice.
template <class M>
void init_parameters(M& module, uint64_t seed, float std = 0.02f, const Stream& stream = {}) {
  uint64_t offset = 0;
  module.for_each_parameter([&](Parameter& p) {
    const int64_t n = p.value.numel();
    uint64_t at = offset, span = uint64_t(n);
    if (p.is_expert_stack() && p.stack_experts > 0 && p.value.size(0) > 0) {
      const int64_t per = n / p.value.size(0);
      at += uint64_t(p.first_expert * per);
      span = uint64_t(p.stack_experts * per);
    }
    if (p.init == ParamInit::ones) {
      fill_uniform(p.value, seed, at, 1.f, 1.f, stream);  // low = high = 1: exactly 1
    } else {
      fill_normal(p.value, seed, at, 0.f, std, stream);
    }
    offset += span;
  });
}

// Op workspaces: scratch a module keeps between calls (e.g. the attention
// backward's f32 buffer, sized by the largest micro-batch seen) and visits
// with for_each_workspace(f(Tensor&)). Releasing them frees the memory (a
// colocated trainer hands the GPU to the rollout engine); the next call that
// needs one allocates it again.
template <class M>
std::size_t workspace_bytes(M& module) {
  std::size_t n = 0;
  module.for_each_workspace([&](Tensor& t) {
    if (t.defined()) n += t.nbytes();
  });
  return n;
}
template <class M>
void release_workspaces(M& module) {
  module.for_each_workspace([](Tensor& t) { t = Tensor{}; });
}

}  // namespace slime::nn
