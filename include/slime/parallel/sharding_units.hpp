// slime/parallel/sharding_units.hpp: ShardingUnits<Module>, the trait that
// tells Sharded how a module splits into FSDP units (the parameters gathered
// and reduced together) and runs its forward and backward unit by unit, so
// Sharded can gather, prefetch, release and reduce around each unit.
//
// A specialisation provides:
//   using Context = ...;                                  // the module's forward context
//   static std::vector<ShardingUnit> units(Module&);      // in forward order; every parameter exactly once
//   static std::size_t lm_head_unit(Module&);             // unit holding the LM head (language models)
//   template <class Hooks> static Tensor forward(Module&, <inputs>, Context&, const Stream&, Hooks&);
//   template <class Hooks> static void backward(Module&, const Context&, const Tensor& dy, const Stream&, Hooks&);
// forward calls hooks.forward_begin(u) / forward_end(u) around unit u's
// computation, for u = 0, 1, ... in order; backward calls backward_begin(u) /
// backward_end(u) in reverse order. Parameters must be used only between a
// begin and its end (their values and gradients are views that exist only
// then).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"

namespace slime::parallel {

// Which data-parallel group a unit shards over.
//   dense:  every data-parallel rank (the shard group Sharded was built with).
//   expert: extension point for ExpertParallel: expert weights shard over the
//           data-parallel ranks inside their expert group (the mesh's dp_shard
//           axis when ep takes the experts). Sharded rejects models with
//           ExpertParallel of degree > 1 until it is composed; the
//           flat-shard machinery is the same with another Comm.
enum class ShardGroup : uint8_t { dense, expert };

struct ShardingUnit {
  std::string name;
  std::vector<nn::Parameter*> params;
  ShardGroup group = ShardGroup::dense;
};

template <class Module>
struct ShardingUnits;  // specialise for each module Sharded can wrap

// Qwen3Model: unit 0 the embedding (with the LM head when tied), units
// 1..L the decoder layers, unit L + 1 the final norm with the LM head.
template <>
struct ShardingUnits<nn::Qwen3Model> {
  using Context = nn::Qwen3Model::Context;

  static std::vector<ShardingUnit> units(nn::Qwen3Model& m) {
    // Qwen3-MoE without expert parallelism: the experts are ordinary
    // parameters of their layer's unit. With ExpertParallel the ranks hold
    // different experts, which must shard over the data-parallel ranks
    // inside their expert group (ShardGroup::expert): not composed yet.
    for (auto& layer : m.layers())
      SLIME_CHECK(!layer.is_sparse() || layer.moe->expert_parallel() == nullptr ||
                      layer.moe->expert_parallel()->size() == 1,
                  "Sharded<Qwen3Model>: a model with ExpertParallel of degree ",
                  layer.moe->expert_parallel()->size(),
                  " needs the expert shard group (ShardGroup::expert), which is not composed yet; ",
                  "wrap a Qwen3-MoE model without expert parallelism (EP = 1)");
    std::vector<ShardingUnit> u;
    u.push_back({"model.embed_tokens", {}, ShardGroup::dense});
    m.embed_tokens().for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
    for (std::size_t i = 0; i < m.layers().size(); ++i) {
      u.push_back({"model.layers." + std::to_string(i), {}, ShardGroup::dense});
      m.layers()[i].for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
    }
    u.push_back({"model.norm", {}, ShardGroup::dense});
    m.norm().for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
    if (!m.config().tie_word_embeddings) {
      u.back().name = "model.norm+lm_head";
      u.back().params.push_back(&m.lm_head());
    }
    return u;
  }

  static std::size_t lm_head_unit(nn::Qwen3Model& m) {
    return m.config().tie_word_embeddings ? 0 : m.layers().size() + 1;
  }

  template <class Hooks>
  static Tensor forward(nn::Qwen3Model& m, const nn::PackedBatch& batch, Context& ctx, const Stream& stream,
                        Hooks& hooks) {
    SLIME_CHECK(batch.tokens.defined() && batch.cu_seqlens.defined() && batch.positions.defined(),
                "Sharded<Qwen3Model>::forward: the batch is incomplete (use make_packed_batch)");
    SLIME_CHECK(batch.tokens.device() == m.device(), "Sharded<Qwen3Model>::forward: the batch must be on ", m.device(),
                " (the model's device), got tokens ", batch.tokens.str());
    ctx.batch = batch;
    ctx.layers.resize(m.layers().size());
    hooks.forward_begin(0);
    Tensor h = m.embed_tokens().forward(batch.tokens, ctx.embed_tokens, stream);
    hooks.forward_end(0);
    for (std::size_t i = 0; i < m.layers().size(); ++i) {
      hooks.forward_begin(i + 1);
      h = m.layers()[i].forward(h, batch, ctx.layers[i], stream);
      hooks.forward_end(i + 1);
    }
    const std::size_t last = m.layers().size() + 1;
    hooks.forward_begin(last);
    h = m.norm().forward(h, ctx.norm, stream);
    hooks.forward_end(last);
    return h;
  }

  template <class Hooks>
  static void backward(nn::Qwen3Model& m, const Context& ctx, const Tensor& d_hidden, const Stream& stream,
                       Hooks& hooks) {
    SLIME_CHECK(ctx.layers.size() == m.layers().size(), "Sharded<Qwen3Model>::backward: the context holds ",
                ctx.layers.size(), " layers, the model ", m.layers().size(), " (was forward called with it?)");
    const std::size_t last = m.layers().size() + 1;
    hooks.backward_begin(last);
    Tensor d = m.norm().backward(ctx.norm, d_hidden, stream);
    hooks.backward_end(last);
    for (std::size_t i = m.layers().size(); i-- > 0;) {
      hooks.backward_begin(i + 1);
      d = m.layers()[i].backward(ctx.layers[i], d, stream);
      hooks.backward_end(i + 1);
    }
    hooks.backward_begin(0);
    m.embed_tokens().backward(ctx.embed_tokens, d, stream);
    hooks.backward_end(0);
  }
};

}  // namespace slime::parallel
