// slime/nn/attention.hpp: Qwen3 self-attention over packed sequences:
// q/k/v projections, per-head RMSNorm of q and k over head_dim (before RoPE,
// as HF Qwen3Attention), RoPE at per-sequence positions (config.rope: the
// text rotary, positions [T]; or Qwen3-VL's interleaved MRoPE, positions
// [T, 3] = (t, h, w) per token), causal varlen
// attention with GQA (scale 1/sqrt(head_dim)), output projection.
//
// The keys and values the queries attend over come from a K/V source
// (nn/kv_source.hpp), a policy argument of forward: SelfKv (the default) is
// the batch's own, CachedKv a KV cache the new keys and values are written
// into (decode). Shapes: x [T, hidden] -> [T, hidden]; inside, q [T, Hq, d],
// k and v [T, Hkv, d], o [T, Hq, d], lse f32 [T, Hq]. backward needs a
// context from a differentiable source (SelfKv).
//
// Sequence parallelism: with `sequence_attention` set (nn/sequence_attention.hpp,
// e.g. parallel::ContextParallel; Qwen3Model::set_sequence_attention sets it on
// every layer), a SelfKv forward hands q, k, v to it instead of the local
// kernel: this rank's tokens attend over every rank's tokens of their
// sequence, and backward asks it for dq, dk, dv. A K/V cache (CachedKv) does
// not combine with it (an error).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "slime/nn/kv_source.hpp"
#include "slime/nn/linear.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/nn/sequence_attention.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/rope.hpp"

namespace slime::nn {

struct AttentionConfig {
  int64_t hidden_size = 0;
  int num_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  ops::RopeSpec rope = ops::RopeSpec::text(10000.0);  // text: positions [T]; mrope: [T, 3]
  double rms_norm_eps = 1e-6;
};

struct Attention {
  struct Context {
    Linear::Context q_proj, k_proj, v_proj, o_proj;
    RMSNorm::Context q_norm, k_norm;
    Tensor q, k, v;     // after norm and RoPE: [T, Hq, d], [T, Hkv, d], [T, Hkv, d]
    Tensor o, lse;      // attention output [T, Hq, d] and f32 lse [T, Hq]
    Tensor cu_seqlens;  // [B + 1] i32
    Tensor positions;   // [T] i32
    int max_seqlen = 0;
    SequenceAttention::Saved sequence_saved;  // what sequence_attention keeps for its backward
    // Capacity reused by the next call with this Context (detail::context_buffer).
    Tensor o_buffer, lse_buffer;
    mutable Tensor dq_buffer, dk_buffer, dv_buffer, dx_buffer;
  };

  AttentionConfig config;
  ModuleOptions options;
  Linear q_proj, k_proj, v_proj, o_proj;
  RMSNorm q_norm, k_norm;
  SequenceAttention* sequence_attention = nullptr;  // sequence parallelism (not owned); null: local

  Attention() = default;
  // `prefix` is the HF module path, e.g. "model.layers.0.self_attn".
  Attention(const std::string& prefix, const AttentionConfig& c, ModuleOptions opt) : config(c), options(opt) {
    SLIME_CHECK(c.hidden_size > 0 && c.num_heads > 0 && c.num_kv_heads > 0 && c.head_dim > 0, prefix,
                ": hidden_size, num_heads, num_kv_heads and head_dim must be positive, got ", c.hidden_size, ", ",
                c.num_heads, ", ", c.num_kv_heads, ", ", c.head_dim);
    SLIME_CHECK(c.num_heads % c.num_kv_heads == 0, prefix, ": num_kv_heads = ", c.num_kv_heads,
                " must divide num_heads = ", c.num_heads);
    SLIME_CHECK(c.head_dim % 2 == 0, prefix, ": head_dim = ", c.head_dim, " must be even (RoPE rotates pairs)");
    const int64_t q_out = int64_t(c.num_heads) * c.head_dim, kv_out = int64_t(c.num_kv_heads) * c.head_dim;
    q_proj = Linear(prefix + ".q_proj", c.hidden_size, q_out, opt);
    k_proj = Linear(prefix + ".k_proj", c.hidden_size, kv_out, opt);
    v_proj = Linear(prefix + ".v_proj", c.hidden_size, kv_out, opt);
    o_proj = Linear(prefix + ".o_proj", q_out, c.hidden_size, opt);
    q_norm = RMSNorm(prefix + ".q_norm", c.head_dim, c.rms_norm_eps, opt);
    k_norm = RMSNorm(prefix + ".k_norm", c.head_dim, c.rms_norm_eps, opt);
  }

  // HF order (Qwen3Attention's submodules).
  template <class F>
  void for_each_parameter(F&& f) {
    q_proj.for_each_parameter(f);
    k_proj.for_each_parameter(f);
    v_proj.for_each_parameter(f);
    o_proj.for_each_parameter(f);
    q_norm.for_each_parameter(f);
    k_norm.for_each_parameter(f);
  }

  // x [T, hidden] -> [T, hidden]: the batch's tokens at batch.positions
  // attend over the keys and values `kv` gives (SelfKv: each sequence of
  // `batch` causally to itself only). ctx keeps what backward needs when the
  // source is differentiable (else only the sub-modules' inputs).
  template <LayerKvSource Kv = SelfKv>
  Tensor forward(const Tensor& x, const PackedBatch& batch, Context& ctx, const Stream& stream = {},
                 const Kv& kv = {}) {
    detail::check_activation(x, options, config.hidden_size, q_proj.weight.name + ": x");
    const int64_t T = x.size(0);
    SLIME_CHECK(x.dim() == 2 && T == batch.num_tokens(), q_proj.weight.name, ": x must be [", batch.num_tokens(), ", ",
                config.hidden_size, "] (the batch's tokens), got ", x.str());
    const int64_t hq = config.num_heads, hkv = config.num_kv_heads, d = config.head_dim;
    Tensor q = q_proj.forward(x, ctx.q_proj, stream).reshape({T, hq, d});
    Tensor k = k_proj.forward(x, ctx.k_proj, stream).reshape({T, hkv, d});
    Tensor v = v_proj.forward(x, ctx.v_proj, stream).reshape({T, hkv, d});
    // The norms save their inputs; RoPE writes new tensors so they stay intact.
    Tensor qn = q_norm.forward(q, ctx.q_norm, stream);
    Tensor kn = k_norm.forward(k, ctx.k_norm, stream);
    ops::rope_forward(qn, kn, batch.positions, config.rope, qn, kn, stream);  // in place
    Tensor o = detail::context_buffer(ctx.o_buffer, {T, hq, d}, options.dtype, options.device, stream);
    if (sequence_attention != nullptr) {
      SLIME_CHECK(Kv::differentiable, q_proj.weight.name,
                  ": sequence-parallel attention runs over the batch's own keys (SelfKv), not a K/V cache");
      ctx.q = ctx.k = ctx.v = ctx.lse = Tensor{};
      ctx.o = o;  // marks the context differentiable (backward checks it)
      ctx.positions = batch.positions;
      ctx.sequence_saved.clear();
      sequence_attention->forward(qn, kn, v, batch, o, ctx.sequence_saved, stream);
      return o_proj.forward(o.reshape({T, hq * d}), ctx.o_proj, stream);
    }
    ctx.sequence_saved.clear();
    Tensor lse = detail::context_buffer(ctx.lse_buffer, {T, hq}, DType::f32, options.device, stream);
    kv.attend(qn, kn, v, batch, o, lse, stream);
    if constexpr (Kv::differentiable) {
      ctx.q = qn;
      ctx.k = kn;
      ctx.v = v;
      ctx.o = o;
      ctx.lse = lse;
      ctx.cu_seqlens = batch.cu_seqlens;
      ctx.positions = batch.positions;
      ctx.max_seqlen = batch.max_seqlen;
    } else {
      ctx.q = ctx.k = ctx.v = ctx.o = ctx.lse = Tensor{};  // no backward from this context
    }
    return o_proj.forward(o.reshape({T, hq * d}), ctx.o_proj, stream);
  }

  // dx [T, hidden] (written); the six weights' gradients accumulate. ctx is
  // a differentiable source's (SelfKv).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    SLIME_CHECK(ctx.o.defined(), o_proj.weight.name,
                ": backward needs the context of a forward with a differentiable K/V source (SelfKv)");
    const int64_t T = ctx.o.size(0), hq = config.num_heads, hkv = config.num_kv_heads, d = config.head_dim;
    Tensor d_o = o_proj.backward(ctx.o_proj, dy, stream).reshape({T, hq, d});
    Tensor dq = detail::context_buffer(ctx.dq_buffer, {T, hq, d}, options.dtype, options.device, stream);
    Tensor dk = detail::context_buffer(ctx.dk_buffer, {T, hkv, d}, options.dtype, options.device, stream);
    Tensor dv = detail::context_buffer(ctx.dv_buffer, {T, hkv, d}, options.dtype, options.device, stream);
    if (!ctx.sequence_saved.empty()) {
      SLIME_CHECK(sequence_attention != nullptr, o_proj.weight.name,
                  ": the context is from a sequence-parallel forward, but the layer has no sequence_attention now");
      sequence_attention->backward(ctx.sequence_saved, d_o, dq, dk, dv, stream);
    } else {
      if (const int64_t n = ops::attention_backward_workspace_elems(ctx.q); n > 0) {
        if (!attention_ws_.defined() || attention_ws_.numel() < n)
          attention_ws_ = Tensor::empty({n}, DType::f32, options.device, stream);
      }
      ops::attention_backward(ctx.q, ctx.k, ctx.v, ctx.o, ctx.lse, d_o, ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen,
                              ctx.max_seqlen, dq, dk, dv, {}, attention_ws_, stream);
    }
    ops::rope_backward(dq, dk, ctx.positions, config.rope, dq, dk, stream);  // in place
    dq = q_norm.backward(ctx.q_norm, dq, stream, /*dy_is_scratch=*/true);
    dk = k_norm.backward(ctx.k_norm, dk, stream, /*dy_is_scratch=*/true);
    Tensor dx = detail::context_buffer(ctx.dx_buffer, {T, config.hidden_size}, options.dtype, options.device, stream);
    q_proj.backward_into(ctx.q_proj, dq.reshape({T, hq * d}), dx, false, stream);
    k_proj.backward_into(ctx.k_proj, dk.reshape({T, hkv * d}), dx, true, stream);
    v_proj.backward_into(ctx.v_proj, dv.reshape({T, hkv * d}), dx, true, stream);
    return dx;
  }

  // The op workspaces this module keeps between calls (nn::release_workspaces).
  template <class F>
  void for_each_workspace(F&& f) {
    f(attention_ws_);
    q_norm.for_each_workspace(f);
    k_norm.for_each_workspace(f);
  }

 private:
  Tensor attention_ws_;  // f32 workspace of the GPU attention backward
};

}  // namespace slime::nn
