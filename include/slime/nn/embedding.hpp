// slime/nn/embedding.hpp: Embedding, the token embedding table as a module
// (forward: y = table[ids]; backward: table.grad += scattered dy).
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "slime/nn/module.hpp"
#include "slime/ops/embedding.hpp"

namespace slime::nn {

struct Embedding {
  // What the backward reads.
  struct Context {
    Tensor ids;       // [tokens] i32 or i64
    Tensor y_buffer;  // capacity reused by the next forward with this Context (detail::context_buffer)
  };

  ModuleOptions options;
  Parameter weight;  // [vocab, dim]

  Embedding() = default;
  // `prefix` is the HF module path, e.g. "model.embed_tokens".
  Embedding(const std::string& prefix, int64_t num_embeddings, int64_t dim, ModuleOptions opt) : options(opt) {
    detail::check_module_options(opt, prefix);
    SLIME_CHECK(num_embeddings > 0 && dim > 0, prefix, ": num_embeddings and dim must be positive, got ",
                num_embeddings, " and ", dim);
    weight.name = prefix + ".weight";
    weight.value = Tensor::empty({num_embeddings, dim}, opt.dtype, opt.device);
  }

  int64_t num_embeddings() const { return weight.value.size(0); }
  int64_t dim() const { return weight.value.size(1); }

  template <class F>
  void for_each_parameter(F&& f) {
    f(weight);
  }

  // y [tokens, dim] = weight[ids]. Ids out of range throw on the CPU; on the
  // GPU their rows come out NaN (see ops/embedding.hpp).
  Tensor forward(const Tensor& ids, Context& ctx, const Stream& stream = {}) {
    SLIME_CHECK(ids.defined() && ids.dim() == 1, weight.name, ": ids must be 1-d [tokens], got ", ids.str());
    SLIME_CHECK(ids.device() == options.device, weight.name, ": ids must be on ", options.device, ", got ", ids.str());
    Tensor y = detail::context_buffer(ctx.y_buffer, {ids.numel(), dim()}, options.dtype, options.device, stream);
    ops::embedding_forward(ids, weight.value, y, stream);
    ctx.ids = ids;
    return y;
  }

  // weight.grad += dy scattered by id (the ids have no gradient).
  void backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    detail::check_activation(dy, options, dim(), weight.name + ": dy");
    const Tensor& ws = detail::scratch_bytes(
        workspace_, options.device.is_cuda() ? ops::embedding_backward_workspace_bytes(ctx.ids.numel()) : 0,
        options.device, stream);
    ops::embedding_backward(ctx.ids, dy, weight.ensure_grad(stream), ws, stream);
  }

  // The op workspaces this module keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    f(workspace_);
  }

 private:
  Tensor workspace_;
};

}  // namespace slime::nn
