// tests/fsdp/sharded_test_util.hpp: what the CPU FSDP tests share
// (test_sharded.cpp, test_sharded_ep.cpp, tests/cp/test_sharded_cp.cpp): the
// per-rank micro-batches, the parameters by name (gathered from a Sharded
// model too) and their relative difference, an error's message, and an
// expert-parallel model's values copied from the whole model.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "slime/comm/mesh.hpp"
#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/optim/grad_clip.hpp"
#include "thread_checks.hpp"

namespace slime_test::fsdp {

// The micro-batch (step, rank, mb): a few sequences of varying length and
// their next-token targets.
struct MicroBatch {
  slime::nn::PackedBatch batch;
  slime::Tensor targets;
};
inline MicroBatch micro_batch(int step, int rank, int mb, int64_t vocab) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  const int nseq = 1 + (rank + mb) % 3;
  for (int s = 0; s < nseq; ++s) {
    const int len = 2 + (step * 5 + rank * 3 + mb * 7 + s * 11) % 6;
    std::vector<int32_t> seq;
    for (int i = 0; i < len; ++i) seq.push_back(int32_t((step * 13 + rank * 17 + mb * 5 + s * 3 + i * 7) % vocab));
    for (int i = 0; i < len; ++i) targets.push_back(int32_t((seq[std::size_t(i)] * 3 + 1) % vocab));
    seqs.push_back(seq);
  }
  MicroBatch m;
  m.batch = slime::nn::make_packed_batch(seqs);
  m.targets = slime::Tensor::from_vector(targets, {int64_t(targets.size())});
  return m;
}

using Params = std::map<std::string, std::vector<float>>;

// The largest relative 2-norm difference ||a - b|| / ||b|| over the
// parameters (which must have the same names and sizes).
inline double max_rel_diff(const Params& a, const Params& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (const auto& [name, va] : a) {
    INFO(name);
    REQUIRE(b.count(name) == 1);
    const auto& vb = b.at(name);
    REQUIRE(va.size() == vb.size());
    double num = 0, den = 0;
    for (std::size_t i = 0; i < va.size(); ++i) {
      num += double(va[i] - vb[i]) * double(va[i] - vb[i]);
      den += double(vb[i]) * double(vb[i]);
    }
    worst = std::max(worst, std::sqrt(num / std::max(den, 1e-30)));
  }
  return worst;
}

// The message of what f throws, or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// The tiny Qwen3 the CPU FSDP tests train (vocab 37, hidden 16, 2 layers);
// moe: Qwen3-MoE with layer 0 dense, layer 1 sparse (4 experts, top-2).
inline slime::nn::Qwen3Config tiny_config(bool tied, bool moe = false) {
  slime::nn::Qwen3Config c;
  if (moe) {  // Qwen3-MoE: layer 0 dense, layer 1 sparse (4 experts, top-2)
    c.model_type = "qwen3_moe";
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.moe_intermediate_size = 12;
    c.mlp_only_layers = {0};
  }
  c.vocab_size = 37;  // prime: the embedding rows never divide the ranks
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  c.tie_word_embeddings = tied;
  return c;
}

inline slime::nn::Qwen3Model make_model(const slime::nn::Qwen3Config& c, uint64_t seed = 7) {
  slime::nn::Qwen3Model m(c, {});
  m.init_random(seed, 0.2f);
  return m;
}

// The unwrapped reference's optimizer step: AdamW over every parameter of
// `model` with its accumulated gradients, clipped to max_grad_norm when > 0
// (the global norm, as Sharded::optimizer_step does).
inline void reference_step(slime::nn::Qwen3Model& model, slime::optim::AdamW& opt, double lr, double max_grad_norm) {
  std::vector<slime::Tensor> params, grads;
  model.for_each_parameter([&](slime::nn::Parameter& p) {
    params.push_back(p.value);
    grads.push_back(p.grad);
  });
  float scale = 1.f;
  if (max_grad_norm > 0) scale = slime::optim::clip_coefficient(slime::optim::global_grad_norm(grads), max_grad_norm);
  opt.step(params, grads, lr, scale);
}

// Every value of `full` into `m`, the same model built with an
// ExpertParallel: an expert stack gets its slice of the experts. Called in
// rank threads: library checks (exceptions), not Catch2 assertions.
template <class Model>
void copy_expert_slices(Model& full, Model& m) {
  std::vector<slime::nn::Parameter*> src, dst;
  full.for_each_parameter([&](slime::nn::Parameter& p) { src.push_back(&p); });
  m.for_each_parameter([&](slime::nn::Parameter& p) { dst.push_back(&p); });
  SLIME_CHECK(src.size() == dst.size(), "copy_expert_slices: parameter counts differ");
  for (std::size_t i = 0; i < src.size(); ++i) {
    SLIME_CHECK(src[i]->name == dst[i]->name, "copy_expert_slices: parameter ", i, " is ", src[i]->name, " vs ",
                dst[i]->name);
    if (dst[i]->is_expert_stack()) {
      const int64_t per = dst[i]->value.numel() / dst[i]->value.size(0);
      dst[i]->value.copy_from(src[i]->value.view(dst[i]->first_expert * per, dst[i]->value.shape()));
    } else {
      dst[i]->value.copy_from(src[i]->value);
    }
  }
}

// Every parameter's values by name.
inline Params parameters_of(slime::nn::Qwen3Model& model) {
  Params out;
  model.for_each_parameter([&](slime::nn::Parameter& p) { out[p.name] = p.value.to_vector<float>(); });
  return out;
}

// What gather_full reads of a Sharded model.
enum class Gathered { values, gradients };

// Every parameter's value (or reduced gradient) of a Sharded model on `mesh`
// gathered into `out` (under `mutex`), each expert stack of `experts`
// experts reassembled from the ep ranks' slices. Collective: every rank calls
// it; world rank 0 writes the dense parameters and the first rank of each ep
// slice's group its slice.
template <class ShardedModel>
void gather_full(ShardedModel& sh, const slime::comm::Mesh& mesh, int64_t experts, Params& out, std::mutex& mutex,
                 Gathered what = Gathered::values) {
  using slime::comm::Axis;
  const bool first_of_slice =
      mesh.coord(Axis::dp_replicate) == 0 && mesh.coord(Axis::dp_shard) == 0 && mesh.coord(Axis::cp) == 0;
  const int64_t ep = mesh.size(Axis::ep);
  for (const std::string& name : sh.parameter_names()) {
    // Collective: every rank.
    const slime::Tensor t = what == Gathered::values ? sh.gather_parameter(name) : sh.gather_gradient(name);
    const std::vector<float> v = t.template to_vector<float>();
    if (sh.is_expert_parameter(name)) {
      const int64_t local = experts / ep, per = t.numel() / local;
      TCHECK(t.size(0) == local);
      TCHECK(sh.parameter_first_expert(name) == mesh.coord(Axis::ep) * local);
      if (!first_of_slice) continue;
      std::lock_guard lock(mutex);
      std::vector<float>& full = out[name];
      full.resize(std::size_t(experts * per));
      std::memcpy(full.data() + sh.parameter_first_expert(name) * per, v.data(), v.size() * sizeof(float));
    } else if (mesh.world().rank() == 0) {
      std::lock_guard lock(mutex);
      out[name] = v;
    }
  }
}

}  // namespace slime_test::fsdp
