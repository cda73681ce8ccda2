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
//   dense:  every rank holding the same copy of the parameters: with expert
//           parallelism (a Mesh with ep > 1) the flattened dp_shard x ep
//           group, since every ep rank holds the same dense parameters.
//   expert: expert weights held by an ExpertParallel of degree ep_degree > 1:
//           the ep ranks hold different slices, so the unit shards over the
//           data-parallel ranks holding the same slice (the mesh's dp_shard
//           axis) and its gradients reduce over those only (under EP the
//           expert's gradient on its ep rank already covers the tokens every
//           ep rank routed to it, through the block's all_to_all).
enum class ShardGroup : uint8_t { dense, expert };

struct ShardingUnit {
  std::string name;
  std::vector<nn::Parameter*> params;
  ShardGroup group = ShardGroup::dense;
  int ep_degree = 1;  // expert units: the degree of the ExpertParallel holding the slices
};

template <class Module>
struct ShardingUnits;  // specialise for each module Sharded can wrap

// Qwen3Model: unit 0 the embedding (with the LM head when tied), then per
// decoder layer its unit "model.layers.<i>" and, for a sparse layer whose
// block has an ExpertParallel of degree > 1, a second unit
// "model.layers.<i>.mlp.experts" (ShardGroup::expert) right after it with
// the stacked expert weights (gate_proj, up_proj, down_proj: this ep rank's
// slice); the layer's other parameters, the router gate included, stay in its
// dense unit. Last the final norm with the LM head. Without expert
// parallelism (or degree 1) the experts are ordinary parameters of their
// layer's unit.
template <>
struct ShardingUnits<nn::Qwen3Model> {
  using Context = nn::Qwen3Model::Context;

  // Whether decoder layer `l` has an expert unit.
  static bool has_expert_unit(const nn::DecoderLayer& l) {
    return l.is_sparse() && l.moe->expert_parallel() != nullptr && l.moe->expert_parallel()->size() > 1;
  }

  static std::vector<ShardingUnit> units(nn::Qwen3Model& m) {
    std::vector<ShardingUnit> u;
    u.push_back({"model.embed_tokens", {}, ShardGroup::dense});
    m.embed_tokens().for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
    for (std::size_t i = 0; i < m.layers().size(); ++i) {
      nn::DecoderLayer& layer = m.layers()[i];
      const std::string name = "model.layers." + std::to_string(i);
      u.push_back({name, {}, ShardGroup::dense});
      if (has_expert_unit(layer)) {
        ShardingUnit experts{name + ".mlp.experts", {}, ShardGroup::expert, layer.moe->expert_parallel()->size()};
        layer.for_each_parameter(
            [&](nn::Parameter& p) { (p.is_expert_stack() ? experts : u.back()).params.push_back(&p); });
        u.push_back(std::move(experts));
      } else {
        layer.for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
      }
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
    if (m.config().tie_word_embeddings) return 0;
    std::size_t n = 1;
    for (const nn::DecoderLayer& l : m.layers()) n += has_expert_unit(l) ? 2 : 1;
    return n;
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
    std::size_t u = 1;  // the layer's (first) unit
    for (std::size_t i = 0; i < m.layers().size(); ++i) {
      const bool experts = has_expert_unit(m.layers()[i]);
      hooks.forward_begin(u);
      if (experts) hooks.forward_begin(u + 1);
      h = m.layers()[i].forward(h, batch, ctx.layers[i], stream);
      if (experts) hooks.forward_end(u + 1);
      hooks.forward_end(u);
      u += experts ? 2 : 1;
    }
    const std::size_t last = u;
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
    std::size_t u = 1;
    for (const nn::DecoderLayer& l : m.layers()) u += has_expert_unit(l) ? 2 : 1;
    hooks.backward_begin(u);
    Tensor d = m.norm().backward(ctx.norm, d_hidden, stream);
    hooks.backward_end(u);
    for (std::size_t i = m.layers().size(); i-- > 0;) {
      const bool experts = has_expert_unit(m.layers()[i]);
      u -= experts ? 2 : 1;
      if (experts) hooks.backward_begin(u + 1);
      hooks.backward_begin(u);
      d = m.layers()[i].backward(ctx.layers[i], d, stream);
      if (experts) hooks.backward_end(u + 1);
      hooks.backward_end(u);
    }
    hooks.backward_begin(0);
    m.embed_tokens().backward(ctx.embed_tokens, d, stream);
    hooks.backward_end(0);
  }
};

}  // namespace slime::parallel
