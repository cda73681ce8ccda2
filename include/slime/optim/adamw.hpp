// slime/optim/adamw.hpp: AdamW with decoupled weight decay on fp32 master
// parameters (local FSDP shards or whole tensors), on the CPU or the GPU: the
// multi-tensor update adamw_step, its CPU reference cpu::adamw_update (the
// specification, double-capable), and AdamW, which owns the moments and the
// step counter.
//
// The update of one element, in torch.optim.AdamW's order and rounding
// (_single_tensor_adam with decoupled_weight_decay, as its vectorised CPU
// kernels round: every scalar rounded to the element type once, fma = one
// rounding):
//   g  = grad * grad_scale              (grad_scale: e.g. the clip coefficient)
//   p  = p * (1 - lr * weight_decay)
//   m  = lerp(m, g, w = 1 - beta1)      = fma(w, g - m, m) for |w| < 0.5,
//                                         else fma(w - 1, g - m, g)
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   p  = p + (-lr / (1 - beta1^step)) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)
//   param_copy = p rounded to its dtype (bf16 model weights), when given
// step is 1-based (the first update uses step = 1). The gradient is read, not
// changed.
//
// On the GPU one kernel launch updates up to 64 tensors (a chunk table in the
// kernel arguments, 16-byte vectors; see slime/optim/cuda/adamw.hpp) with the
// same fp32 operations as the CPU reference (the same roundings: the two
// results are equal bit for bit). The update is elementwise, so it is
// deterministic. Steady-state calls allocate
// no device memory.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/half.hpp"
#include "slime/core/tensor.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/optim/cuda/adamw.hpp"
#include "slime/optim/optimizer.hpp"

namespace slime::optim {

struct AdamWConfig {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
};

// One tensor group of an update: param, grad, exp_avg, exp_avg_sq are f32
// with the same number of elements; param_copy (optional: leave it undefined)
// is bf16 or f32 with that many elements, written from the updated param.
struct AdamWTensors {
  Tensor param, grad, exp_avg, exp_avg_sq, param_copy;
};

// Throws unless 0 <= beta1, beta2 < 1, eps >= 0, weight_decay >= 0 and lr >= 0
// (all finite), as torch.optim.AdamW.
inline void check_adamw_config(const AdamWConfig& c) {
  SLIME_CHECK(std::isfinite(c.lr) && c.lr >= 0, "AdamW: lr must be finite and >= 0, got ", c.lr);
  SLIME_CHECK(c.beta1 >= 0 && c.beta1 < 1, "AdamW: beta1 must be in [0, 1), got ", c.beta1);
  SLIME_CHECK(c.beta2 >= 0 && c.beta2 < 1, "AdamW: beta2 must be in [0, 1), got ", c.beta2);
  SLIME_CHECK(std::isfinite(c.eps) && c.eps >= 0, "AdamW: eps must be finite and >= 0, got ", c.eps);
  SLIME_CHECK(std::isfinite(c.weight_decay) && c.weight_decay >= 0, "AdamW: weight_decay must be finite and >= 0, got ",
              c.weight_decay);
}

// The per-step scalars of the update, in double (the CPU reference and the
// kernel round each to their element type once).
struct AdamWCoefficients {
  double decay;        // 1 - lr * weight_decay
  double lerp_weight;  // 1 - beta1
  double beta2, one_minus_beta2;
  double step_size;              // lr / (1 - beta1^step)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^step)
  double eps;
  double grad_scale;
};

// Checks the arguments (config as check_adamw_config, lr finite >= 0, step >=
// 1, grad_scale finite) and computes the step's scalars.
inline AdamWCoefficients adamw_coefficients(const AdamWConfig& cfg, double lr, int64_t step, float grad_scale) {
  check_adamw_config(cfg);
  SLIME_CHECK(std::isfinite(lr) && lr >= 0, "adamw_step: lr must be finite and >= 0, got ", lr);
  SLIME_CHECK(step >= 1, "adamw_step: step is 1-based (bias correction), got ", step);
  SLIME_CHECK(std::isfinite(grad_scale), "adamw_step: grad_scale must be finite, got ", grad_scale,
              " (a non-finite gradient norm? check it before clipping)");
  const double bc1 = 1 - std::pow(cfg.beta1, double(step));
  const double bc2 = 1 - std::pow(cfg.beta2, double(step));
  return {1 - lr * cfg.weight_decay, 1 - cfg.beta1, cfg.beta2, 1 - cfg.beta2, lr / bc1, std::sqrt(bc2), cfg.eps,
          double(grad_scale)};
}

namespace cpu {

// The CPU reference of the update above on n elements. T: float or double
// (param, grad and moments); C: the param_copy element type (float,
// BFloat16, or T); param_copy may be nullptr. Arithmetic in T.
template <class T, class C = T>
void adamw_update(T* param, const T* grad, T* exp_avg, T* exp_avg_sq, C* param_copy, int64_t n,
                  const AdamWCoefficients& k) {
  const T decay = T(k.decay), w = T(k.lerp_weight), beta2 = T(k.beta2), one_minus_beta2 = T(k.one_minus_beta2);
  const T step_size = T(k.step_size), bc2_sqrt = T(k.bias_correction2_sqrt), eps = T(k.eps);
  const T grad_scale = T(k.grad_scale);
  const bool small_weight = std::abs(w) < T(0.5);
  const T w_minus_1 = w - T(1);
  for (int64_t i = 0; i < n; ++i) {
    // One rounding per operation: std::fma where PyTorch's kernels fuse,
    // plain operations elsewhere (GCC contracts a * b + c on its own only
    // where the target has FMA instructions, not on baseline x86-64).
    const T g = grad[i] * grad_scale;
    T p = param[i] * decay;
    T m = exp_avg[i];
    m = small_weight ? std::fma(w, g - m, m) : std::fma(w_minus_1, g - m, g);
    const T v = std::fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
    const T denom = std::sqrt(v) / bc2_sqrt + eps;
    const T num = -step_size * m;
    p = p + num / denom;
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    if (param_copy != nullptr) param_copy[i] = C(p);
  }
}

}  // namespace cpu

namespace detail {

inline void check_adamw_group(const AdamWTensors& t, std::size_t i, Device device) {
  const std::string at = "adamw_step: tensors[" + std::to_string(i) + "].";
  check_dtype(t.param, DType::f32, at + "param");
  const int64_t n = t.param.numel();
  auto check_state = [&](const Tensor& s, const char* name) {
    check_dtype(s, DType::f32, at + name);
    SLIME_CHECK(s.numel() == n, at, name, " must have ", n, " elements (as param ", t.param.str(), "), got ", s.str());
    SLIME_CHECK(s.device() == device, at, name, " must be on ", device, " (as tensors[0].param), got ", s.str());
  };
  SLIME_CHECK(t.param.device() == device, at, "param must be on ", device, " (as tensors[0].param), got ",
              t.param.str());
  check_state(t.grad, "grad");
  check_state(t.exp_avg, "exp_avg");
  check_state(t.exp_avg_sq, "exp_avg_sq");
  const Tensor* all[] = {&t.param, &t.grad, &t.exp_avg, &t.exp_avg_sq, &t.param_copy};
  if (t.param_copy.defined()) {
    SLIME_CHECK(t.param_copy.dtype() == DType::bf16 || t.param_copy.dtype() == DType::f32, at,
                "param_copy must be bf16 or f32, got ", t.param_copy.str());
    SLIME_CHECK(t.param_copy.numel() == n, at, "param_copy must have ", n, " elements (as param ", t.param.str(),
                "), got ", t.param_copy.str());
    SLIME_CHECK(t.param_copy.device() == device, at, "param_copy must be on ", device, ", got ", t.param_copy.str());
  }
  const char* names[] = {"param", "grad", "exp_avg", "exp_avg_sq", "param_copy"};
  for (int a = 0; a < 5; ++a)
    for (int b = a + 1; b < 5; ++b)
      if (all[a]->defined() && all[b]->defined())
        SLIME_CHECK(!ops::detail::memops::overlap(*all[a], *all[b]), at, names[a], " and ", names[b], " overlap");
}

}  // namespace detail

// One AdamW update of every tensor group (see the file comment), with the
// learning rate `lr` (from a schedule; cfg.lr is not used) and the 1-based
// `step`. All tensors on one device; on CUDA the update is ordered on
// `stream` (the device's default stream when `stream` is the CPU stream).
// Groups must not share memory with each other (not checked across groups).
//
// device_grad_scale (optional): an f32 [1] tensor on the parameters' device
// (clip_factor's factor) that multiplies grad_scale where the update runs,
// so a GPU step needs no host wait for it; when its value is not finite the
// update is skipped (every tensor keeps its value).
inline void adamw_step(std::span<const AdamWTensors> tensors, const AdamWConfig& cfg, double lr, int64_t step,
                       float grad_scale = 1.f, [[maybe_unused]] const Stream& stream = {},
                       const Tensor& device_grad_scale = {}) {
  AdamWCoefficients k = adamw_coefficients(cfg, lr, step, grad_scale);
  if (tensors.empty()) return;
  SLIME_CHECK(tensors[0].param.defined(), "adamw_step: tensors[0].param is undefined");
  const Device device = tensors[0].param.device();
  for (std::size_t i = 0; i < tensors.size(); ++i) detail::check_adamw_group(tensors[i], i, device);
  if (device_grad_scale.defined()) {
    check_dtype(device_grad_scale, DType::f32, "adamw_step: device_grad_scale");
    SLIME_CHECK(device_grad_scale.numel() == 1 && device_grad_scale.device() == device,
                "adamw_step: device_grad_scale must be one f32 value on ", device, ", got ", device_grad_scale.str());
    if (device.is_cpu()) {
      const float f = device_grad_scale.data<float>()[0];
      if (!std::isfinite(f)) return;
      k.grad_scale = double(grad_scale * f);
    }
  }
  if (device.is_cuda()) {
#if SLIME_HAS_CUDA
    const Stream s = ops::detail::memops::stream_for(device, stream, "adamw_step");
    DeviceGuard guard(device);
    std::vector<cuda::AdamWTensorArgs> args;
    args.reserve(tensors.size());
    for (const AdamWTensors& t : tensors)
      args.push_back({t.param.data<float>(), t.grad.data<float>(), t.exp_avg.data<float>(), t.exp_avg_sq.data<float>(),
                      t.param_copy.defined() ? t.param_copy.data_ptr() : nullptr,
                      t.param_copy.defined() ? t.param_copy.dtype() : DType::f32, t.param.numel()});
    const cuda::AdamWScalars s32{float(k.decay),
                                 float(k.lerp_weight),
                                 float(k.beta2),
                                 float(k.one_minus_beta2),
                                 float(k.step_size),
                                 float(k.bias_correction2_sqrt),
                                 float(k.eps),
                                 float(k.grad_scale),
                                 device_grad_scale.defined() ? device_grad_scale.data<float>() : nullptr};
    cuda::adamw_multi_tensor(args, s32, s.handle());
    return;
#else
    ops::detail::memops::fail_no_cuda("adamw_step");
#endif
  }
  for (const AdamWTensors& t : tensors) {
    float* p = t.param.data<float>();
    const float* g = t.grad.data<float>();
    float* m = t.exp_avg.data<float>();
    float* v = t.exp_avg_sq.data<float>();
    const int64_t n = t.param.numel();
    if (!t.param_copy.defined()) {
      cpu::adamw_update<float, float>(p, g, m, v, nullptr, n, k);
    } else if (t.param_copy.dtype() == DType::bf16) {
      cpu::adamw_update(p, g, m, v, t.param_copy.data<BFloat16>(), n, k);
    } else {
      cpu::adamw_update(p, g, m, v, t.param_copy.data<float>(), n, k);
    }
  }
}

// AdamW over a fixed list of parameter tensors (e.g. a rank's FSDP shards):
// owns the moments (f32 zeros of each parameter's shape on its device,
// allocated by init_state or the first step) and the step counter. A
// ShardOptimizer (optim/optimizer.hpp): two state tensors per parameter,
// exp_avg and exp_avg_sq; device tensors run the CUDA kernel, host tensors
// the CPU reference (the same roundings: ShardedOptions::cpu_offload).
class AdamW {
 public:
  using Config = AdamWConfig;
  static constexpr bool trains = true;
  static constexpr std::size_t state_per_param = 2;

  explicit AdamW(AdamWConfig cfg = {}) : cfg_(cfg) { check_adamw_config(cfg_); }

  // Allocates zero moments for `params` (f32 tensors) when there are none;
  // with state, checks that `params` matches it. step() calls it; call it
  // directly to restore a checkpoint into state_tensors() before any step.
  void init_state(std::span<const Tensor> params, const Stream& stream = {}) {
    if (exp_avg_.empty() && !params.empty()) {
      for (std::size_t i = 0; i < params.size(); ++i) {
        check_dtype(params[i], DType::f32, "AdamW: params[" + std::to_string(i) + "]");
        exp_avg_.push_back(Tensor::zeros(params[i].shape(), DType::f32, params[i].device(), stream));
        exp_avg_sq_.push_back(Tensor::zeros(params[i].shape(), DType::f32, params[i].device(), stream));
      }
      return;
    }
    SLIME_CHECK(params.size() == exp_avg_.size(), "AdamW: got ", params.size(),
                " params, the optimizer holds state for ", exp_avg_.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      SLIME_CHECK(
          params[i].defined() && params[i].numel() == exp_avg_[i].numel() && params[i].device() == exp_avg_[i].device(),
          "AdamW: params[", i, "] is ", params[i].str(), " but its state is ", exp_avg_[i].str());
  }

  // One update with learning rate `lr`; param_copies is empty or one bf16/f32
  // tensor per param (written from the updated param); device_grad_scale as
  // adamw_step's (a skipped update still counts as a step). The step counter
  // advances only when the update was queued.
  void step(std::span<const Tensor> params, std::span<const Tensor> grads, double lr, float grad_scale = 1.f,
            std::span<const Tensor> param_copies = {}, const Stream& stream = {},
            const Tensor& device_grad_scale = {}) {
    SLIME_CHECK(grads.size() == params.size(), "AdamW::step: ", params.size(), " params but ", grads.size(), " grads");
    SLIME_CHECK(param_copies.empty() || param_copies.size() == params.size(), "AdamW::step: ", params.size(),
                " params but ", param_copies.size(), " param_copies (give none or one per param)");
    init_state(params, stream);
    groups_.resize(params.size());
    for (std::size_t i = 0; i < params.size(); ++i)
      groups_[i] = {params[i], grads[i], exp_avg_[i], exp_avg_sq_[i],
                    param_copies.empty() ? Tensor() : param_copies[i]};
    adamw_step(groups_, cfg_, lr, step_ + 1, grad_scale, stream, device_grad_scale);
    for (AdamWTensors& g : groups_) g = {};  // hold no references between steps
    ++step_;
  }

  // Updates taken so far (the next uses step_count() + 1).
  int64_t step_count() const { return step_; }
  void set_step_count(int64_t steps) {
    SLIME_CHECK(steps >= 0, "AdamW::set_step_count: negative step count ", steps);
    step_ = steps;
  }

  // The moments, named "exp_avg.<i>" and "exp_avg_sq.<i>" (i = parameter
  // index), as handles sharing the optimizer's storage: save them, or copy a
  // checkpoint into them. Empty before init_state / the first step.
  std::vector<std::pair<std::string, Tensor>> state_tensors() {
    std::vector<std::pair<std::string, Tensor>> out;
    out.reserve(2 * exp_avg_.size());
    for (std::size_t i = 0; i < exp_avg_.size(); ++i) {
      out.emplace_back("exp_avg." + std::to_string(i), exp_avg_[i]);
      out.emplace_back("exp_avg_sq." + std::to_string(i), exp_avg_sq_[i]);
    }
    return out;
  }

  // Drops the moments (their memory goes), keeping the config and the step
  // count; the next init_state / step allocates zero moments again.
  void release_state() {
    exp_avg_.clear();
    exp_avg_sq_.clear();
    groups_.clear();
  }

  const AdamWConfig& config() const { return cfg_; }

 private:
  AdamWConfig cfg_;
  int64_t step_ = 0;
  std::vector<Tensor> exp_avg_, exp_avg_sq_;
  std::vector<AdamWTensors> groups_;  // reused across steps
};
static_assert(ShardOptimizer<AdamW>);

}  // namespace slime::optim
