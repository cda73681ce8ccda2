// slime/nn/moe.hpp: SparseMoeBlock, transformers' Qwen3MoeSparseMoeBlock (a
// top-k softmax router over E SwiGLU experts). Its tokens reach the experts
// through a TokenDispatcher (nn/token_dispatcher.hpp): LocalDispatcher by
// default, or any other model of the concept (parallel::ExpertParallel for
// expert parallelism) given at construction.
//
// Accumulation contract: parameter gradients accumulate (`+=`) into fp32
// tensors (Parameter::grad); activation gradients are written (`=`).
//
// Forward, exactly Qwen3MoeSparseMoeBlock.forward (modeling_qwen3_moe.py):
//   logits  [T, E] = x · gate.weightᵀ, in the module dtype (HF's gate is an
//                    nn.Linear in the model dtype)
//   probs   [T, E] = softmax(logits) in fp32; indices [T, k] = its top-k
//   weights [T, k] = the top-k probabilities, renormalised when
//                    norm_topk_prob, cast to the module dtype
//   (routing replay: Context::replay_indices replaces indices; weights are
//   those experts' probabilities, renormalised the same way)
//   y       [T, H] = Σ_j weights[t, j] · down_e(silu(gate_e(x_t)) ⊙ up_e(x_t)),
//                    e = indices[t, j]
// Rounding differences from HF are the ops' (see ops/moe_permute.hpp and
// ops/swiglu.hpp: one rounding per output instead of one per step). The
// experts run on the grouped layout: rows grouped by expert, grouped GEMMs
// for gate and up, SwiGLU, a grouped GEMM for down: dispatch → experts → combine (locally: layout → permute →
// experts → unpermute). Expert parallelism gives the same numbers (bitwise on the CPU when the
// ranks' tokens, concatenated in ep-rank order, are the unsharded batch).
//
// Parameters (HF names; the experts stacked along dim 0, see nn::Parameter):
//   <prefix>.gate.weight                   [E, H]
//   <prefix>.experts.{}.gate_proj.weight   [E_local, I, H]
//   <prefix>.experts.{}.up_proj.weight     [E_local, I, H]
//   <prefix>.experts.{}.down_proj.weight   [E_local, H, I]
// with E_local = E / ep and first_expert = the ep rank's first expert (E and 0
// without expert parallelism). The router's gate is replicated: under expert
// parallelism each rank's gate gradient covers its own tokens only (reduce it
// over the data-parallel ranks as any replicated parameter).
//
// Group sizes on the host (CUDA only): the grouped GEMMs take the cuBLAS
// backend when they get the group offsets on the host (ops/grouped_gemm.hpp).
// A dispatcher that exchanged counts (expert parallelism of degree > 1)
// already has them (the handle's local_counts()): free. Otherwise, when
// `host_group_sizes` is on (the default) and the device is one where cuBLAS
// is the faster backend (ops::grouped_gemm_wants_host_offsets: not Hopper,
// whose wgmma kernels beat it), forward copies the dispatch's offsets
// [E_local + 1] to the host once and synchronises the stream (after queueing
// the permute, so the GPU stays busy while the host waits); otherwise the
// grouped GEMMs run the device-offset kernels and forward never synchronises. backward reuses forward's host offsets
// (Context). The CPU path is unchanged.
//
// Memory: forward keeps what backward needs in the Context, in buffers that
// keep their capacity when the Context is reused (one Context per micro-batch
// in flight), so a steady-state forward allocates only its output y.
// backward allocates its output dx and its temporaries (from the stream-ordered
// pool on the GPU: L layers share them instead of each holding its own).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "slime/nn/module.hpp"
#include "slime/nn/token_dispatcher.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/grouped_gemm.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/moe_permute.hpp"
#include "slime/ops/router.hpp"
#include "slime/ops/swiglu.hpp"

namespace slime::nn {

struct MoeBlockConfig {
  int64_t hidden_size = 0, moe_intermediate_size = 0, num_experts = 0, num_experts_per_tok = 0;
  bool norm_topk_prob = true;
};

struct SparseMoeBlock {
  struct Context {
    // Routing replay (set by the caller before forward; empty: route by the
    // top-k): i32 [T, k] on the block's device, the experts each token goes
    // to (e.g. those the rollout engine chose). The router's probabilities
    // still come from this forward's logits, and its gradient flows through
    // the replayed experts' weights (ops::router_forward_replay).
    Tensor replay_indices;
    Tensor router_logits;  // [T, E] module dtype, as HF returns them
    Tensor probs;          // [T, E] f32 (for the auxiliary loss)
    Tensor indices;        // [T, k] i32, global expert ids
    Tensor weights;        // [T, k] module dtype
    Tensor x;              // [T, H] the input
    // The local experts' rows (R of them), grouped by local expert.
    Tensor x_rows;                   // [R, H]
    Tensor offsets;                  // i32 [E_local + 1]
    Tensor gate, up, h;              // [R, I]
    Tensor y_rows;                   // [R, H] the experts' outputs
    LocalDispatcher::Handle local;   // the local dispatcher's (no dispatcher given)
    DispatcherRef::Handle dispatch;  // the given dispatcher's
    // Host copy of `offsets` for the grouped GEMMs (CUDA); empty when unknown.
    std::vector<int32_t> host_offsets;
    // Capacity of the tensors above (see detail::rows_view).
    struct Buffers {
      Tensor logits, probs, indices, weights, gate, up, h, y_rows, y;
      Tensor host_offsets;  // pinned [E_local + 1] (CUDA): the copy of `offsets`
    } buffers;
    // The backward's (detail::context_buffer).
    struct BackwardBuffers {
      Tensor dx, dlogits, dlogits_dt, dh, dgate, dx_rows;
    };
    mutable BackwardBuffers backward_buffers;
  };

  ModuleOptions options;
  MoeBlockConfig config;
  Parameter gate;                           // "<prefix>.gate.weight" [E, H]
  Parameter gate_proj, up_proj, down_proj;  // stacked experts, see the top of this file
  // CUDA without the Hopper kernels: copy the group sizes to the host (one
  // stream synchronisation per forward where dispatch has not already) so the
  // grouped GEMMs use cuBLAS; see the top of this file.
  bool host_group_sizes = true;

  SparseMoeBlock() = default;
  // `prefix` is the HF module path, e.g. "model.layers.0.mlp". With a
  // `dispatcher` (which must outlive the block; it may serve every layer)
  // this rank holds experts [first_expert(), + num_local_experts()) of it.
  SparseMoeBlock(const std::string& prefix, const MoeBlockConfig& cfg, ModuleOptions opt, DispatcherRef dispatcher = {})
      : options(opt), config(cfg), dispatcher_(dispatcher), local_(cfg.num_experts, opt.device) {
    detail::check_module_options(opt, prefix);
    SLIME_CHECK(cfg.hidden_size > 0 && cfg.moe_intermediate_size > 0 && cfg.num_experts > 0, prefix,
                ": hidden_size, moe_intermediate_size and num_experts must be positive, got ", cfg.hidden_size, ", ",
                cfg.moe_intermediate_size, ", ", cfg.num_experts);
    SLIME_CHECK(cfg.num_experts_per_tok >= 1 && cfg.num_experts_per_tok <= cfg.num_experts, prefix,
                ": num_experts_per_tok = ", cfg.num_experts_per_tok, " must be in [1, num_experts = ", cfg.num_experts,
                "]");
    int64_t local = cfg.num_experts, first = 0;
    if (dispatcher) {
      SLIME_CHECK(dispatcher.num_experts() == cfg.num_experts, prefix, ": the dispatcher splits ",
                  dispatcher.num_experts(), " experts but the block has num_experts = ", cfg.num_experts);
      SLIME_CHECK(dispatcher.device() == opt.device, prefix, ": the dispatcher works on ", dispatcher.device(),
                  " but the block is on ", opt.device);
      local = dispatcher.num_local_experts();
      first = dispatcher.first_expert();
    }
    const int64_t H = cfg.hidden_size, I = cfg.moe_intermediate_size;
    gate.name = prefix + ".gate.weight";
    gate.value = Tensor::empty({cfg.num_experts, H}, opt.dtype, opt.device);
    auto expert = [&](Parameter& p, const char* name, int64_t out, int64_t in) {
      p.name = prefix + ".experts.{}." + name + ".weight";
      p.value = Tensor::empty({local, out, in}, opt.dtype, opt.device);
      p.first_expert = first;
      p.stack_experts = cfg.num_experts;
    };
    expert(gate_proj, "gate_proj", I, H);
    expert(up_proj, "up_proj", I, H);
    expert(down_proj, "down_proj", H, I);
  }

  int64_t hidden_size() const { return config.hidden_size; }
  int64_t num_local_experts() const { return gate_proj.value.size(0); }
  // The dispatcher given at construction (empty: the local one).
  const DispatcherRef& dispatcher() const { return dispatcher_; }
  // Ranks the experts are split over (1 without a dispatcher that splits them).
  int expert_degree() const { return dispatcher_ ? dispatcher_.size() : 1; }

  template <class F>
  void for_each_parameter(F&& f) {
    f(gate);
    f(gate_proj);
    f(up_proj);
    f(down_proj);
  }

  // x [T, H] -> y [T, H] (a new tensor). Every rank of the ep group must call
  // it, also with T = 0.
  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    using detail::rows_view;
    detail::check_activation(x, options, config.hidden_size, gate.name + ": x");
    SLIME_CHECK(x.dim() == 2, gate.name, ": x must be 2-D [tokens, hidden], got ", x.str());
    const Device dev = options.device;
    const DType dt = options.dtype;
    const int64_t T = x.size(0), H = config.hidden_size, E = config.num_experts, k = config.num_experts_per_tok;
    const int64_t I = config.moe_intermediate_size;
    Context::Buffers& b = ctx.buffers;

    ctx.x = x;
    ctx.router_logits = rows_view(b.logits, T, E, dt, dev, stream);
    ops::linear_forward(x, gate.value, ctx.router_logits, stream);
    ctx.probs = rows_view(b.probs, T, E, DType::f32, dev, stream);
    ctx.weights = rows_view(b.weights, T, k, dt, dev, stream);
    if (ctx.replay_indices.defined()) {
      const Tensor& r = ctx.replay_indices;
      SLIME_CHECK(r.dtype() == DType::i32 && r.shape() == Shape({T, k}) && r.device() == dev, gate.name,
                  ": replay_indices must be i32 [", T, ", ", k, "] (tokens, num_experts_per_tok) on ", dev, ", got ",
                  r.str());
      ctx.indices = r;
      ops::router_forward_replay(ctx.router_logits, config.norm_topk_prob, ctx.indices, ctx.probs, ctx.weights, stream);
    } else {
      ctx.indices = rows_view(b.indices, T, k, DType::i32, dev, stream);
      ops::router_forward(ctx.router_logits, config.norm_topk_prob, ctx.probs, ctx.indices, ctx.weights, stream);
    }

    ctx.host_offsets.clear();
    if (dispatcher_) {
      ctx.x_rows = dispatcher_.dispatch(x, ctx.indices, ctx.dispatch, stream);
      ctx.offsets = dispatcher_.local_offsets(ctx.dispatch);
    } else {
      ctx.x_rows = local_.dispatch(x, ctx.indices, ctx.local, stream);
      ctx.offsets = ctx.local.local_offsets();
    }
    if (dev.is_cuda()) {
      const std::vector<int64_t>& counts = dispatcher_ ? dispatcher_.local_counts(ctx.dispatch) : no_counts_;
      if (!counts.empty()) {
        ctx.host_offsets.assign(counts.size() + 1, 0);
        for (std::size_t i = 0; i < counts.size(); ++i)
          ctx.host_offsets[i + 1] = int32_t(ctx.host_offsets[i] + counts[i]);
      } else if (host_group_sizes && ops::grouped_gemm_wants_host_offsets(dev)) {
        copy_offsets_to_host(ctx, stream);
      }
    }
    const std::span<const int32_t> host = ctx.host_offsets;

    const int64_t R = ctx.x_rows.size(0);
    ctx.gate = rows_view(b.gate, R, I, dt, dev, stream);
    ctx.up = rows_view(b.up, R, I, dt, dev, stream);
    ctx.h = rows_view(b.h, R, I, dt, dev, stream);
    ctx.y_rows = rows_view(b.y_rows, R, H, dt, dev, stream);
    ops::grouped_gemm_forward(ctx.x_rows, gate_proj.value, ctx.offsets, ctx.gate, stream, host);
    ops::grouped_gemm_forward(ctx.x_rows, up_proj.value, ctx.offsets, ctx.up, stream, host);
    ops::swiglu_forward(ctx.gate, ctx.up, ctx.h, stream);
    ops::grouped_gemm_forward(ctx.h, down_proj.value, ctx.offsets, ctx.y_rows, stream, host);

    Tensor y = detail::context_buffer(b.y, {T, H}, dt, dev, stream);
    if (dispatcher_) {
      dispatcher_.combine(ctx.y_rows, ctx.weights, ctx.dispatch, stream, y);
    } else {
      local_.combine(ctx.y_rows, ctx.weights, ctx.local, stream, y);
    }
    return y;
  }

  // dx [T, H] (written, in the Context's buffer); the four weights' gradients accumulate
  // (fp32). aux_dlogits: optional f32 [T, E], the gradient of an auxiliary
  // loss w.r.t. this block's router logits, added to the router's own
  // gradient (in fp32, before the one rounding to the module dtype).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}, const Tensor& aux_dlogits = {}) {
    const std::string what = gate.name + ": backward";
    SLIME_CHECK(ctx.x.defined() && ctx.y_rows.defined(), what, ": the context holds no forward");
    detail::check_activation(dy, options, config.hidden_size, what + ": dy");
    SLIME_CHECK(dy.shape() == ctx.x.shape(), what, ": dy must have the input's shape ", ctx.x.shape(), ", got ",
                dy.str());
    const Device dev = options.device;
    const DType dt = options.dtype;
    const int64_t T = ctx.x.size(0), H = config.hidden_size, E = config.num_experts;
    if (aux_dlogits.defined()) {
      SLIME_CHECK(
          aux_dlogits.dtype() == DType::f32 && aux_dlogits.shape() == Shape({T, E}) && aux_dlogits.device() == dev,
          what, ": aux_dlogits must be f32 [", T, ", ", E, "] on ", dev, ", got ", aux_dlogits.str());
    }

    // Combine's backward: d expert outputs and d router weights.
    const CombineGrads g = dispatcher_ ? dispatcher_.combine_backward(dy, ctx.dispatch, stream)
                                       : local_.combine_backward(dy, ctx.local, stream);
    const Tensor& dweights = g.dweights;

    // The experts.
    const Tensor dx_rows = experts_backward(ctx, g.d_expert_out, stream);
    Context::BackwardBuffers& bb = ctx.backward_buffers;
    Tensor dx = detail::context_buffer(bb.dx, {T, H}, dt, dev, stream);
    if (dispatcher_) {
      dispatcher_.dispatch_backward(dx_rows, ctx.dispatch, stream, dx);
    } else {
      local_.dispatch_backward(dx_rows, ctx.local, stream, dx);
    }

    // The router: dlogits in fp32 (+ the auxiliary loss's), then the gate.
    Tensor dlogits = detail::context_buffer(bb.dlogits, {T, E}, DType::f32, dev, stream);
    ops::router_backward(ctx.probs, ctx.indices, dweights, config.norm_topk_prob, dlogits, /*accumulate=*/false,
                         stream);
    if (aux_dlogits.defined()) ops::add_(dlogits, aux_dlogits, stream);
    Tensor dlogits_dt = dlogits;
    if (dt != DType::f32) {
      dlogits_dt = detail::context_buffer(bb.dlogits_dt, {T, E}, dt, dev, stream);
      ops::cast(dlogits, dlogits_dt, stream);
    }
    ops::linear_backward_input(dlogits_dt, gate.value, dx, /*accumulate=*/true, stream);
    ops::linear_backward_weight(dlogits_dt, ctx.x, gate.ensure_grad(stream), stream);
    return dx;
  }

 private:
  // The stream the ops run on: `stream`, or the device's default one.
  Stream effective_stream(const Stream& stream) const {
    return stream.device() == options.device ? stream : Stream::default_for(options.device);
  }

  // Copies ctx.offsets to the host through a pinned buffer and waits for it
  // (the one stream synchronisation; CUDA).
  void copy_offsets_to_host(Context& ctx, const Stream& stream) {
    Tensor& pinned = ctx.buffers.host_offsets;
    if (!pinned.defined() || pinned.shape() != ctx.offsets.shape())
      pinned = Tensor::empty_pinned(ctx.offsets.shape(), DType::i32);
    const Stream s = effective_stream(stream);
    pinned.copy_from(ctx.offsets, s);
    s.synchronize();
    const int32_t* o = pinned.data<int32_t>();
    ctx.host_offsets.assign(o, o + pinned.numel());
  }

  // d x_rows [R, H] from d y_rows; the expert weights' gradients accumulate.
  Tensor experts_backward(const Context& ctx, const Tensor& dy_rows, const Stream& stream) {
    const Device dev = options.device;
    const DType dt = options.dtype;
    const std::span<const int32_t> host = ctx.host_offsets;
    Context::BackwardBuffers& bb = ctx.backward_buffers;
    Tensor dh = detail::context_buffer(bb.dh, ctx.h.shape(), dt, dev, stream);
    ops::grouped_gemm_backward_input(dy_rows, down_proj.value, ctx.offsets, dh, /*accumulate=*/false, stream, host);
    ops::grouped_gemm_backward_weight(dy_rows, ctx.h, ctx.offsets, down_proj.ensure_grad(stream), stream, host);
    Tensor dgate = detail::context_buffer(bb.dgate, ctx.gate.shape(), dt, dev, stream);
    ops::swiglu_backward(ctx.gate, ctx.up, dh, dgate, dh, stream);  // dup overwrites dh (in place)
    Tensor dx_rows = detail::context_buffer(bb.dx_rows, ctx.x_rows.shape(), dt, dev, stream);
    ops::grouped_gemm_backward_input(dgate, gate_proj.value, ctx.offsets, dx_rows, /*accumulate=*/false, stream, host);
    ops::grouped_gemm_backward_input(dh, up_proj.value, ctx.offsets, dx_rows, /*accumulate=*/true, stream, host);
    ops::grouped_gemm_backward_weight(dgate, ctx.x_rows, ctx.offsets, gate_proj.ensure_grad(stream), stream, host);
    ops::grouped_gemm_backward_weight(dh, ctx.x_rows, ctx.offsets, up_proj.ensure_grad(stream), stream, host);
    return dx_rows;
  }

  DispatcherRef dispatcher_;  // empty: local_
  LocalDispatcher local_;     // all experts on this rank
  static inline const std::vector<int64_t> no_counts_{};
};

}  // namespace slime::nn
