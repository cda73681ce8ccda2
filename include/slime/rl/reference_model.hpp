// slime/rl/reference_model.hpp: the frozen copy of the policy that the KL
// term of the loss is measured against, in two forms: ReferenceModel (a whole,
// unsharded copy on one device) and ShardedReferenceModel (a
// parallel::Frozen model sharded like the policy). Both have the same config
// and weights as the policy at construction (and after update_from), keep
// their parameters in pinned host memory between uses (offload / onload), and
// score the same packed micro-batches as the policy.
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
// NOTE (FSDP): ReferenceModel holds a whole copy of the model on one device
// (under expert parallelism: the policy's slice of the experts), so a
// reference of a policy too large for one device does not fit it. Use
// ShardedReferenceModel<Model, Strategy> then: a parallel::Frozen<Model,
// Strategy> (Sharded with optim::NoOptimizer) over the policy's communicator
// or mesh, holding 1/N of the parameters per rank under FullShard (the flat
// layout's padding aside: parallel/flat_shard.hpp), in the module's dtype, no
// gradients, no optimizer state; each unit is gathered as the forward reaches
// it and released after it. It is a second class template, not ReferenceModel
// at degree 1: the unsharded form needs no communicator, keeps its exact
// per-parameter pinned copies (no padding) and copies from an unwrapped
// policy, which the existing callers rely on.
//
//   rl::ShardedReferenceModel<> ref(Model(config, options, dispatcher), mesh, {.offload = true});
//   ref.update_from(policy);                             // policy: a parallel::Sharded; collective
//   std::vector<Tensor> lp = ref.logprobs(batches, targets, 1.f, stream);  // onload, score, offload
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/offload.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharding_strategy.hpp"

namespace slime::rl {

struct ReferenceModelConfig {
  // Copy the policy into the reference after every update_every-th optimizer
  // step (maybe_update); 0: never (the reference stays the initial policy).
  int64_t update_every = 0;
  // Keep the parameters in pinned host memory between uses (offload at
  // construction); false: they stay on the policy's device.
  bool offload = true;
};

namespace detail {

// Every micro-batch of a step (both reference forms): onloads if needed,
// scores each batch, and offloads again if it was offloaded.
template <class Ref>
std::vector<Tensor> score_all(Ref& ref, const char* where, std::span<const nn::PackedBatch> batches,
                              std::span<const Tensor> targets, float temperature, const Stream& stream) {
  SLIME_CHECK(batches.size() == targets.size(), where, ": ", batches.size(), " micro-batches but ", targets.size(),
              " target tensors");
  const bool was_offloaded = ref.is_offloaded();
  ref.onload(stream);
  std::vector<Tensor> out;
  out.reserve(batches.size());
  for (std::size_t i = 0; i < batches.size(); ++i)
    out.push_back(ref.logprobs(batches[i], targets[i], temperature, stream));
  if (was_offloaded) ref.offload(stream);
  return out;
}

}  // namespace detail

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
    return detail::score_all(*this, "ReferenceModel::logprobs", batches, targets, temperature, stream);
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

// The reference as a frozen Sharded model (see the NOTE above): sharded over
// the policy's communicator or mesh with any strategy (FullShard by default),
// scored by the frozen model's forward and token_logprobs, offloaded with
// Sharded's runtime offload (only the master shards move; a frozen model
// copies them to the host once, and again only after update_from). Under
// expert parallelism (a mesh with ep > 1, the model built with the policy's
// ExpertParallel) it holds the policy's expert slice; its forward exchanges
// tokens over the ep group like the policy's, so every rank must score the
// same number of micro-batches. Every call that gathers (logprobs,
// update_from) is collective over the reference's (and for update_from the
// policy's) groups: every rank calls it in the same order.
template <class Model = nn::Qwen3Model, parallel::ShardingStrategy Strategy = parallel::FullShard>
class ShardedReferenceModel {
 public:
  using Frozen = parallel::Frozen<Model, Strategy>;

  // `model`: an unwrapped model holding the reference's weights (built like
  // the policy's module, e.g. loaded from the same checkpoint or copied
  // before the policy was wrapped; under expert parallelism this rank's
  // slice, built with the policy's ExpertParallel). `comm` / `mesh`: the
  // policy's. Offloaded at construction when config.offload.
  ShardedReferenceModel(Model model, comm::Comm& comm, ReferenceModelConfig config = {},
                        parallel::ShardedOptions options = {},
                        const Stream& stream = {}) requires(!(Strategy::shards && Strategy::replicates))
      : config_(checked(config)), frozen_(std::move(model), comm, options) {
    if (config_.offload) offload(stream);
  }
  ShardedReferenceModel(Model model, const comm::Mesh& mesh, ReferenceModelConfig config = {},
                        parallel::ShardedOptions options = {}, const Stream& stream = {})
      : config_(checked(config)), frozen_(std::move(model), mesh, options) {
    if (config_.offload) offload(stream);
  }

  const ReferenceModelConfig& config() const { return config_; }
  bool is_offloaded() const { return frozen_.offloaded(); }
  // The frozen Sharded model, and the module it wraps (its parameter values
  // are views of gathered units, undefined outside a forward).
  Frozen& sharded() { return frozen_; }
  Model& model() { return frozen_.module(); }

  // Bytes of this rank's parameter shards (the whole of its state: no
  // gradients, no optimizer state): the elements of its flat shards
  // (FlatShardLayout::shard_numel, padding included) in the module's dtype.
  std::size_t parameter_bytes() const {
    std::size_t n = 0;
    for (std::size_t u = 0; u < frozen_.num_units(); ++u) n += std::size_t(frozen_.unit_layout(u).shard_numel());
    return n * dtype_size(frozen_.compute_dtype());
  }

  // The shards to pinned host memory and back (Sharded::offload / onload).
  void offload(const Stream& stream = {}) { frozen_.offload(stream); }
  void onload(const Stream& stream = {}) { frozen_.onload(stream); }

  // Copies the policy's weights in (bitwise; cast to the module's dtype when
  // the policy's masters are f32 and the reference runs in bf16, as the
  // policy's own compute copy is). `policy`: a parallel::Sharded of the same
  // model (any strategy and optimizer; collective over its groups: every rank
  // calls it), or an unwrapped model holding every parameter (the same
  // values on every rank; local). When offloaded, the reference is onloaded
  // for the copy and offloaded again.
  template <class Policy>
  void update_from(Policy& policy, const Stream& stream = {}) {
    const bool offloaded = is_offloaded();
    if (offloaded) onload(stream);
    const std::vector<std::string> names = frozen_.parameter_names();
    if constexpr (requires(std::string_view n) { policy.gather_parameter(n, stream); }) {
      const std::vector<std::string> theirs = policy.parameter_names();
      SLIME_CHECK(theirs.size() == names.size(), "ShardedReferenceModel::update_from: the policy has ", theirs.size(),
                  " parameters, the reference ", names.size(), " (a different config?)");
      for (std::size_t i = 0; i < names.size(); ++i) {
        SLIME_CHECK(theirs[i] == names[i], "ShardedReferenceModel::update_from: parameter ", i, " is '", theirs[i],
                    "' in the policy, '", names[i], "' in the reference");
        check_same(names[i], policy.parameter_shape(names[i]));
        frozen_.load_parameter(names[i], policy.gather_parameter(names[i], stream), stream);
      }
    } else {
      std::vector<nn::Parameter*> src;
      policy.for_each_parameter([&](nn::Parameter& p) { src.push_back(&p); });
      SLIME_CHECK(src.size() == names.size(), "ShardedReferenceModel::update_from: the policy has ", src.size(),
                  " parameters, the reference ", names.size(), " (a different config?)");
      for (const nn::Parameter* p : src) {
        SLIME_CHECK(p->value.defined(), "ShardedReferenceModel::update_from: the policy's '", p->name,
                    "' has no value");
        check_same(p->name, p->value.shape());
        frozen_.load_parameter(p->name, p->value, stream);
      }
    }
    if (offloaded) offload(stream);
  }

  bool should_update(int64_t step) const {
    return config_.update_every > 0 && step > 0 && step % config_.update_every == 0;
  }
  template <class Policy>
  bool maybe_update(int64_t step, Policy& policy, const Stream& stream = {}) {
    if (!should_update(step)) return false;
    update_from(policy, stream);
    return true;
  }

  // log p_ref(targets[t] | batch tokens ..t), f32 [T] on the model's device
  // (the frozen forward, then token_logprobs). Onloaded first (onload).
  Tensor logprobs(const nn::PackedBatch& batch, const Tensor& targets, float temperature = 1.f,
                  const Stream& stream = {}) {
    SLIME_CHECK(!is_offloaded(),
                "ShardedReferenceModel::logprobs: the parameters are offloaded to pinned host memory; call "
                "onload() before scoring (and offload() after)");
    typename Model::Context ctx;
    const Tensor hidden = frozen_.forward(batch, ctx, stream);
    return frozen_.token_logprobs(hidden, targets, temperature, stream).logprobs;
  }

  // Every micro-batch of a step: onloads if needed, scores each batch, and
  // offloads again if it was offloaded.
  std::vector<Tensor> logprobs(std::span<const nn::PackedBatch> batches, std::span<const Tensor> targets,
                               float temperature = 1.f, const Stream& stream = {}) {
    return detail::score_all(*this, "ShardedReferenceModel::logprobs", batches, targets, temperature, stream);
  }

 private:
  static ReferenceModelConfig checked(ReferenceModelConfig c) {
    SLIME_CHECK(c.update_every >= 0, "ShardedReferenceModel: update_every must be >= 0 (0: never), got ",
                c.update_every);
    return c;
  }

  void check_same(const std::string& name, const Shape& shape) const {
    const Shape& mine = frozen_.parameter_shape(name);
    SLIME_CHECK(mine == shape, "ShardedReferenceModel::update_from: '", name, "' has shape ", shape, " in the policy, ",
                mine, " in the reference");
  }

  ReferenceModelConfig config_;
  Frozen frozen_;
};

}  // namespace slime::rl
