// slime/rl/reference_model.hpp: ReferenceModel, the frozen copy of the policy
// that the KL term of the loss is measured against: same config and weights
// as the policy at construction (and after update_from), parameters kept in
// pinned host memory between uses (offload / onload), and reference logprobs
// on the same packed micro-batches as the policy's.
//
//   rl::ReferenceModel<> ref(policy, {.update_every = 0, .offload = true});
//   ref.onload(stream);                                  // before the step's scoring
//   for (mb : micro_batches) ref_lp[mb] = ref.logprobs(mb.batch, mb.targets, 1.f, stream);
//   ref.offload(stream);                                 // the GPU is the policy's again
//   ... optimizer step s ...
//   ref.maybe_update(s, policy, stream);                 // every update_every steps
//
// Frozen: no gradients are ever allocated; no backward. Copies are bitwise.
//
// NOTE (FSDP): this holds a whole, unsharded copy of the model on one device
// (under expert parallelism: the policy's slice of the experts). Sharding it
// like the policy (Sharded<Model, Strategy> over the same mesh, gathering
// each layer's parameters from the pinned shards as the forward reaches it)
// is not done yet: a reference model of a policy too large for one device
// does not fit.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/offload.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"

namespace slime::rl {

struct ReferenceModelConfig {
  // Copy the policy into the reference after every update_every-th optimizer
  // step (maybe_update); 0: never (the reference stays the initial policy).
  int64_t update_every = 0;
  // Keep the parameters in pinned host memory between uses (offload at
  // construction); false: they stay on the policy's device.
  bool offload = true;
};

// Model: nn::Qwen3Model or any model with the same interface (a constructor
// from (config(), options()), for_each_parameter, forward, token_logprobs).
template <class Model = nn::Qwen3Model>
class ReferenceModel {
 public:
  // A copy of `policy` (same config, device and dtype; weights copied), then
  // offloaded when config.offload.
  explicit ReferenceModel(Model& policy, ReferenceModelConfig config = {}, const Stream& stream = {})
      : ReferenceModel(Model(policy.config(), policy.options()), policy, config, stream) {}

  // A policy built with a token dispatcher (expert parallelism: `dispatcher`
  // is its parallel::ExpertParallel, which must outlive this): the reference
  // holds the same experts' slice, and its forward exchanges tokens over the
  // ep group like the policy's, so every ep rank must score the same number
  // of micro-batches. Model must be constructible from (config(), options(),
  // dispatcher).
  ReferenceModel(Model& policy, nn::DispatcherRef dispatcher, ReferenceModelConfig config = {},
                 const Stream& stream = {})
      : ReferenceModel(Model(policy.config(), policy.options(), dispatcher), policy, config, stream) {}

 private:
  ReferenceModel(Model&& fresh, Model& policy, ReferenceModelConfig config, const Stream& stream)
      : config_(config), model_(std::move(fresh)) {
    SLIME_CHECK(config_.update_every >= 0, "ReferenceModel: update_every must be >= 0 (0: never), got ",
                config_.update_every);
    model_.for_each_parameter([&](nn::Parameter& p) { names_.push_back(p.name); });
    update_from(policy, stream);
    if (config_.offload) offload(stream);
  }

 public:
  const ReferenceModelConfig& config() const { return config_; }
  bool is_offloaded() const { return offload_.offloaded(); }
  // The wrapped model (its parameters are undefined while offloaded).
  Model& model() { return model_; }

  // Parameters to pinned host memory (allocated on the first offload, then
  // reused); the device copies are freed. Waits for the copies. No-op when
  // already offloaded. On a CPU model "pinned" is page-locked host memory
  // when a GPU exists, plain host memory otherwise: a copy either way.
  // (nn::ParameterOffload, frozen: only weights changed by update_from since
  // the last offload are copied.)
  void offload(const Stream& stream = {}) { offload_.offload(model_, stream); }

  // Parameters back to the model's device (fresh allocations, ordered on
  // `stream`). The pinned copies stay, so the next offload copies nothing
  // unless update_from changed the weights. No-op when on the device.
  void onload(const Stream& stream = {}) { offload_.onload(model_, model_.device(), stream); }

  // Copies the policy's weights into the reference (bitwise), where they live
  // now: on the device, or into the pinned copies when offloaded. The policy
  // must have the same parameters (names, shapes, dtypes).
  void update_from(Model& policy, const Stream& stream = {}) {
    std::vector<nn::Parameter*> src;
    policy.for_each_parameter([&](nn::Parameter& p) { src.push_back(&p); });
    SLIME_CHECK(src.size() == names_.size(), "ReferenceModel::update_from: the policy has ", src.size(),
                " parameters, the reference ", names_.size(), " (a different config?)");
    const bool offloaded = offload_.offloaded();
    if (!offloaded) offload_.mark_stale();  // the device weights change: the pinned copies are old
    std::size_t i = 0;
    model_.for_each_parameter([&](nn::Parameter& p) {
      const nn::Parameter& s = *src[i];
      SLIME_CHECK(s.name == names_[i], "ReferenceModel::update_from: parameter ", i, " is '", s.name,
                  "' in the policy, '", names_[i], "' in the reference");
      SLIME_CHECK(s.value.defined(), "ReferenceModel::update_from: the policy's '", s.name, "' has no value");
      Tensor& dst = offloaded ? offload_.host_value(i) : p.value;
      SLIME_CHECK(dst.dtype() == s.value.dtype() && dst.shape() == s.value.shape(), "ReferenceModel::update_from: '",
                  s.name, "' is ", s.value.str(), " in the policy, ", dst.str(), " in the reference");
      dst.copy_from(s.value, stream);
      ++i;
    });
    if (offloaded) synchronize(stream);  // pinned destinations: readable on return
  }

  // True when optimizer step `step` (1-based) is one after which the policy
  // is copied in: every update_every steps.
  bool should_update(int64_t step) const {
    return config_.update_every > 0 && step > 0 && step % config_.update_every == 0;
  }
  // update_from(policy) when should_update(step); returns whether it copied.
  bool maybe_update(int64_t step, Model& policy, const Stream& stream = {}) {
    if (!should_update(step)) return false;
    update_from(policy, stream);
    return true;
  }

  // log p_ref(targets[t] | batch tokens ..t), f32 [T] on the model's device,
  // for one packed micro-batch (the policy's own batch and targets). The
  // parameters must be on the device (onload first).
  Tensor logprobs(const nn::PackedBatch& batch, const Tensor& targets, float temperature = 1.f,
                  const Stream& stream = {}) {
    SLIME_CHECK(!offload_.offloaded(),
                "ReferenceModel::logprobs: the parameters are offloaded to pinned host memory; call "
                "onload() before scoring (and offload() after)");
    typename Model::Context ctx;
    const Tensor hidden = model_.forward(batch, ctx, stream);
    return model_.token_logprobs(hidden, targets, temperature, stream).logprobs;
  }

  // Every micro-batch of a step: onloads if needed, scores each batch, and
  // offloads again if it was offloaded.
  std::vector<Tensor> logprobs(std::span<const nn::PackedBatch> batches, std::span<const Tensor> targets,
                               float temperature = 1.f, const Stream& stream = {}) {
    SLIME_CHECK(batches.size() == targets.size(), "ReferenceModel::logprobs: ", batches.size(), " micro-batches but ",
                targets.size(), " target tensors");
    const bool was_offloaded = offload_.offloaded();
    onload(stream);
    std::vector<Tensor> out;
    out.reserve(batches.size());
    for (std::size_t i = 0; i < batches.size(); ++i)
      out.push_back(logprobs(batches[i], targets[i], temperature, stream));
    if (was_offloaded) offload(stream);
    return out;
  }

 private:
  void synchronize(const Stream& stream) const {
    const Device d = model_.device();
    if (d.is_cuda()) (stream.device() == d ? stream : Stream::default_for(d)).synchronize();
  }

  ReferenceModelConfig config_;
  Model model_;
  std::vector<std::string> names_;
  // Pinned copies, one per parameter (in visiting order); the values are
  // released while offloaded.
  nn::ParameterOffload offload_{nn::ParameterOffload::Options{.release_values = true, .frozen = true}};
};

}  // namespace slime::rl
