// slime/nn/vision.hpp: Qwen3VLVisionModel, the Qwen3-VL vision tower
// (transformers' Qwen3VLVisionModel), with explicit forward and backward.
//
//   pixel_values [P, C·T·p·p] (P = sum over images of t·h·w patches, in the
//   processor's order: per image, per temporal patch, m x m merge blocks
//   row-major, the patches of a block row-major)
//   -> patch_embed: the Conv3d with kernel = stride = (T, p, p) is a Linear
//      with bias over a row (weight [hidden, C, T, p, p] = [hidden, C·T·p·p])
//   -> + the learned pos_embed [side², hidden] bilinearly resampled to each
//      image's h x w grid (align_corners, transformers'
//      get_vision_interpolation_indices_and_weights), repeated over t
//   -> depth x VisionBlock: x += attn(norm1(x)); x += mlp(norm2(x)), where
//      attn is qkv (Linear with bias) -> the 2-D vision rotary at each
//      patch's (row, col) -> full (non-causal) attention within each image
//      frame (cu_seqlens over images x t) -> proj (Linear with bias), and mlp
//      is linear_fc1 -> GELU (tanh) -> linear_fc2, both with bias
//   -> merger: LayerNorm(hidden), view [P/m², m²·hidden], linear_fc1, exact
//      GELU, linear_fc2 -> embeds [P/m², out_hidden]
//   and after block deepstack_visual_indexes[j] the deepstack merger j (the
//   same with the LayerNorm over m²·hidden after the view) -> deepstack[j].
//
// Accumulation contract (nn/module.hpp): parameter gradients accumulate (+=)
// in fp32; activation gradients are written. backward takes the gradients of
// embeds and of each deepstack output (an undefined one counts as zero); the
// pixels get a gradient only on request.
//
// The position-embedding resample's taps are computed on the host per call
// (vision_pos_interpolation: for every patch the 4 table rows and weights of
// the bilinear blend) and applied by ops::pos_embed_interpolate_forward; the
// backward (ops::pos_embed_interpolate_backward) sums each table row's taps
// in a fixed order, on the GPU from a by-row grouping of the taps built on the
// host (ops::pos_embed_row_taps). The context keeps ids and weights [4, P]
// (and on the GPU the grouping): 32 bytes per patch (48 with the grouping).
//
// Devices and dtypes: f32 (the CPU reference) or bf16; CUDA attention needs
// bf16 and a head_dim ops/attention.hpp lists (checked at construction).
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/dtype.hpp"
#include "slime/core/error.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/nn/layer_norm.hpp"
#include "slime/nn/linear_with_bias.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/units.hpp"
#include "slime/nn/vision_config.hpp"
#include "slime/nn/vl_positions.hpp"
#include "slime/ops/attention.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/ops/gelu.hpp"
#include "slime/ops/rope.hpp"
#include "slime/ops/row_ops.hpp"

namespace slime::nn {

// The bilinear taps of every patch into the side x side position table:
// tap k in [0, 4) of patch p reads row ids[k][p] with weight weights[k][p]
// (k = 2a + b for the row tap a and the column tap b).
struct VisionPosInterpolation {
  std::array<std::vector<int32_t>, 4> ids;
  std::array<std::vector<float>, 4> weights;
  int64_t patches() const { return int64_t(ids[0].size()); }
};

// transformers' get_vision_interpolation_indices_and_weights (bilinear,
// align_corners, border padding) in its fp32 arithmetic: for a patch at
// row r of an h-row grid, src = fl(fl(r·(side-1)) / max(h-1, 1)), taps
// floor(src) and floor(src)+1 clamped to [0, side), weights max(0, 1 -
// |src - floor - offset|); the same for the column, and the 2-D taps are the
// products. Patches in the processor's order (see the file comment).
inline VisionPosInterpolation vision_pos_interpolation(std::span<const GridThw> grids, int64_t side,
                                                       int64_t spatial_merge_size) {
  SLIME_CHECK(side > 0, "vision_pos_interpolation: side must be positive, got ", side);
  const int64_t m = spatial_merge_size;
  VisionPosInterpolation out;
  const auto axis = [&](int64_t index, int64_t size, std::array<int32_t, 2>& taps, std::array<float, 2>& w) {
    const float src = float(index) * float(side - 1) / float(std::max<int64_t>(size - 1, 1));
    const float fl = std::floor(src);
    for (int o = 0; o < 2; ++o) {
      taps[o] = int32_t(std::clamp<int64_t>(int64_t(fl) + o, 0, side - 1));
      w[o] = std::max(0.f, 1.f - std::abs(src - fl - float(o)));
    }
  };
  const std::vector<int32_t> rc = vision_patch_positions(grids, m);  // (row, col) per patch; checks the grids
  std::size_t p = 0;
  for (const GridThw& g : grids) {
    const int64_t n = g[0] * g[1] * g[2];
    for (int64_t i = 0; i < n; ++i, ++p) {
      std::array<int32_t, 2> ht{}, wt{};
      std::array<float, 2> hw{}, ww{};
      axis(rc[2 * p], g[1], ht, hw);
      axis(rc[2 * p + 1], g[2], wt, ww);
      for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 2; ++b) {
          out.ids[std::size_t(2 * a + b)].push_back(int32_t(ht[a] * side + wt[b]));
          out.weights[std::size_t(2 * a + b)].push_back(hw[a] * ww[b]);
        }
    }
  }
  return out;
}

// ---- blocks ---------------------------------------------------------------

// What every block of one forward shares: the patches' rotary positions and
// the attention segments (one per image frame).
struct VisionSegments {
  Tensor positions;   // [P, 2] i32 (row, col)
  Tensor cu_seqlens;  // [frames + 1] i32
  int max_seqlen = 0;
};

struct VisionAttention {
  struct Context {
    Tensor x;        // [P, hidden], the input of qkv
    Tensor q, k, v;  // after the rotary: [P, H, d]
    Tensor o, lse;   // [P, H, d], f32 [P, H]
    LinearWithBias::Context proj;
    VisionSegments segments;  // handles: shared with the tower's context
  };

  ModuleOptions options;
  LinearWithBias qkv;   // [3·hidden, hidden]: rows [s·hidden, (s+1)·hidden) are q, k, v (s = 0, 1, 2)
  LinearWithBias proj;  // [hidden, hidden]
  int num_heads = 0;
  double rope_theta = 10000.0;

  VisionAttention() = default;
  VisionAttention(const std::string& prefix, int64_t hidden, int heads, double theta, ModuleOptions opt)
      : options(opt),
        qkv(prefix + ".qkv", hidden, 3 * hidden, opt),
        proj(prefix + ".proj", hidden, hidden, opt),
        num_heads(heads),
        rope_theta(theta) {}

  int64_t hidden() const { return proj.in_features(); }
  int64_t head_dim() const { return hidden() / num_heads; }

  template <class F>
  void for_each_parameter(F&& f) {
    qkv.for_each_parameter(f);
    proj.for_each_parameter(f);
  }

  Tensor forward(const Tensor& x, const VisionSegments& seg, Context& ctx, const Stream& stream = {}) {
    const int64_t P = x.size(0), D = hidden(), H = num_heads, d = head_dim();
    std::array<Tensor, 3> qkv_out;
    for (int s = 0; s < 3; ++s) {
      qkv_out[s] = Tensor::empty({P, H, d}, options.dtype, options.device, stream);
      detail::linear_bias_forward(x, qkv.weight.value.slice_rows(s * D, D), qkv.bias.value.slice_rows(s * D, D),
                                  qkv_out[s].reshape({P, D}), stream);
    }
    const ops::RopeSpec spec = ops::RopeSpec::vision(rope_theta);
    ops::rope_forward(qkv_out[0], qkv_out[1], seg.positions, spec, qkv_out[0], qkv_out[1], stream);  // in place
    Tensor o = Tensor::empty({P, H, d}, options.dtype, options.device, stream);
    Tensor lse = Tensor::empty({P, H}, DType::f32, options.device, stream);
    ops::attention_forward(qkv_out[0], qkv_out[1], qkv_out[2], seg.cu_seqlens, seg.cu_seqlens, seg.max_seqlen,
                           seg.max_seqlen, o, lse, attention_options(), stream);
    ctx.x = x;
    ctx.q = qkv_out[0];
    ctx.k = qkv_out[1];
    ctx.v = qkv_out[2];
    ctx.o = o;
    ctx.lse = lse;
    ctx.segments = seg;
    return proj.forward(o.reshape({P, D}), ctx.proj, stream);
  }

  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    const VisionSegments& seg = ctx.segments;
    const int64_t P = ctx.x.size(0), D = hidden(), H = num_heads, d = head_dim();
    Tensor d_o = proj.backward(ctx.proj, dy, stream).reshape({P, H, d});
    std::array<Tensor, 3> dqkv;
    for (auto& t : dqkv) t = Tensor::empty({P, H, d}, options.dtype, options.device, stream);
    if (const int64_t n = ops::attention_backward_workspace_elems(ctx.q); n > 0) {
      if (!attention_ws_.defined() || attention_ws_.numel() < n)
        attention_ws_ = Tensor::empty({n}, DType::f32, options.device, stream);
    }
    ops::attention_backward(ctx.q, ctx.k, ctx.v, ctx.o, ctx.lse, d_o, seg.cu_seqlens, seg.cu_seqlens, seg.max_seqlen,
                            seg.max_seqlen, dqkv[0], dqkv[1], dqkv[2], attention_options(), attention_ws_, stream);
    ops::rope_backward(dqkv[0], dqkv[1], seg.positions, ops::RopeSpec::vision(rope_theta), dqkv[0], dqkv[1], stream);
    Tensor dx = Tensor::empty({P, D}, options.dtype, options.device, stream);
    Tensor& dw = qkv.weight.ensure_grad(stream);
    Tensor& db = qkv.bias.ensure_grad(stream);
    for (int s = 0; s < 3; ++s)
      detail::linear_bias_backward(dqkv[s].reshape({P, D}), ctx.x, qkv.weight.value.slice_rows(s * D, D), dx,
                                   dw.slice_rows(s * D, D), db.slice_rows(s * D, D), /*accumulate=*/s > 0, bias_ws_,
                                   stream);
    return dx;
  }

  template <class F>
  void for_each_workspace(F&& f) {
    f(attention_ws_);
    f(bias_ws_);
    proj.for_each_workspace(f);
  }

 private:
  static ops::AttentionOptions attention_options() {
    ops::AttentionOptions o;
    o.causal = false;  // every patch of a frame sees every other
    return o;
  }

  Tensor attention_ws_;  // f32 workspace of the GPU attention backward
  Tensor bias_ws_;       // ops::bias_backward's GPU workspace (qkv's bias)
};

// linear_fc1 -> GELU -> linear_fc2, both with bias: the block MLP (tanh GELU)
// and the patch mergers' MLP (exact GELU).
struct VisionMLP {
  struct Context {
    LinearWithBias::Context fc1, fc2;
    Tensor h;  // fc1's output, the GELU input
  };

  LinearWithBias linear_fc1, linear_fc2;
  ops::GeluApproximation approximation = ops::GeluApproximation::tanh;

  VisionMLP() = default;
  VisionMLP(const std::string& prefix, int64_t in, int64_t mid, int64_t out, ops::GeluApproximation approx,
            ModuleOptions opt)
      : linear_fc1(prefix + ".linear_fc1", in, mid, opt),
        linear_fc2(prefix + ".linear_fc2", mid, out, opt),
        approximation(approx) {}

  template <class F>
  void for_each_parameter(F&& f) {
    linear_fc1.for_each_parameter(f);
    linear_fc2.for_each_parameter(f);
  }

  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    Tensor h = linear_fc1.forward(x, ctx.fc1, stream);
    Tensor a = Tensor::empty(h.shape(), h.dtype(), h.device(), stream);
    ops::gelu_forward(h, approximation, a, stream);
    ctx.h = h;
    return linear_fc2.forward(a, ctx.fc2, stream);
  }

  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor da = linear_fc2.backward(ctx.fc2, dy, stream);
    ops::gelu_backward(ctx.h, da, approximation, da, stream);  // in place
    return linear_fc1.backward(ctx.fc1, da, stream);
  }

  template <class F>
  void for_each_workspace(F&& f) {
    linear_fc1.for_each_workspace(f);
    linear_fc2.for_each_workspace(f);
  }
};

struct VisionBlock {
  struct Context {
    LayerNorm::Context norm1, norm2;
    VisionAttention::Context attn;
    VisionMLP::Context mlp;
  };

  LayerNorm norm1, norm2;
  VisionAttention attn;
  VisionMLP mlp;

  VisionBlock() = default;
  // `prefix` e.g. "model.visual.blocks.0".
  VisionBlock(const std::string& prefix, const Qwen3VLVisionConfig& c, ModuleOptions opt)
      : norm1(prefix + ".norm1", c.hidden_size, c.layer_norm_eps, opt),
        norm2(prefix + ".norm2", c.hidden_size, c.layer_norm_eps, opt),
        attn(prefix + ".attn", c.hidden_size, c.num_heads, c.rope_theta, opt),
        mlp(prefix + ".mlp", c.hidden_size, c.intermediate_size, c.hidden_size, ops::GeluApproximation::tanh, opt) {}

  // HF order (Qwen3VLVisionBlock's submodules): norm1, norm2, attn, mlp.
  template <class F>
  void for_each_parameter(F&& f) {
    norm1.for_each_parameter(f);
    norm2.for_each_parameter(f);
    attn.for_each_parameter(f);
    mlp.for_each_parameter(f);
  }

  Tensor forward(const Tensor& x, const VisionSegments& seg, Context& ctx, const Stream& stream = {}) {
    Tensor h = attn.forward(norm1.forward(x, ctx.norm1, stream), seg, ctx.attn, stream);
    ops::add_(h, x, stream);
    Tensor y = mlp.forward(norm2.forward(h, ctx.norm2, stream), ctx.mlp, stream);
    ops::add_(y, h, stream);
    return y;
  }

  // dx (written); every parameter gradient accumulates.
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dh = norm2.backward(ctx.norm2, mlp.backward(ctx.mlp, dy, stream), stream, /*dy_is_scratch=*/true);
    ops::add_(dh, dy, stream);  // the residual
    Tensor dx = norm1.backward(ctx.norm1, attn.backward(ctx.attn, dh, stream), stream, /*dy_is_scratch=*/true);
    ops::add_(dx, dh, stream);
    return dx;
  }

  template <class F>
  void for_each_workspace(F&& f) {
    norm1.for_each_workspace(f);
    norm2.for_each_workspace(f);
    attn.for_each_workspace(f);
    mlp.for_each_workspace(f);
  }
};

// Qwen3VLVisionPatchMerger: [P, hidden] -> [P/m², out_hidden]. The norm runs
// over hidden before the view (the final merger) or over m²·hidden after it
// (use_postshuffle_norm: the deepstack mergers).
struct VisionPatchMerger {
  struct Context {
    LayerNorm::Context norm;
    VisionMLP::Context mlp;
    int64_t patches = 0;
  };

  LayerNorm norm;
  VisionMLP mlp;
  bool postshuffle_norm = false;
  int64_t hidden = 0, merge_unit = 0;

  VisionPatchMerger() = default;
  VisionPatchMerger(const std::string& prefix, const Qwen3VLVisionConfig& c, bool use_postshuffle_norm,
                    ModuleOptions opt)
      : norm(prefix + ".norm", use_postshuffle_norm ? c.hidden_size * c.merge_unit() : c.hidden_size, c.layer_norm_eps,
             opt),
        mlp(prefix, c.hidden_size * c.merge_unit(), c.hidden_size * c.merge_unit(), c.out_hidden_size,
            ops::GeluApproximation::none, opt),
        postshuffle_norm(use_postshuffle_norm),
        hidden(c.hidden_size),
        merge_unit(c.merge_unit()) {}

  // HF order: norm, linear_fc1, linear_fc2.
  template <class F>
  void for_each_parameter(F&& f) {
    norm.for_each_parameter(f);
    mlp.for_each_parameter(f);
  }

  Tensor forward(const Tensor& x, Context& ctx, const Stream& stream = {}) {
    const int64_t P = x.size(0), N = P / merge_unit;
    ctx.patches = P;
    const Tensor merged = x.reshape({N, merge_unit * hidden});
    Tensor xn = postshuffle_norm ? norm.forward(merged, ctx.norm, stream)
                                 : norm.forward(x, ctx.norm, stream).reshape({N, merge_unit * hidden});
    return mlp.forward(xn, ctx.mlp, stream);
  }

  // dx [P, hidden] (written).
  Tensor backward(const Context& ctx, const Tensor& dy, const Stream& stream = {}) {
    Tensor dxn = mlp.backward(ctx.mlp, dy, stream);
    if (postshuffle_norm) return norm.backward(ctx.norm, dxn, stream, true).reshape({ctx.patches, hidden});
    return norm.backward(ctx.norm, dxn.reshape({ctx.patches, hidden}), stream, true);
  }

  template <class F>
  void for_each_workspace(F&& f) {
    norm.for_each_workspace(f);
    mlp.for_each_workspace(f);
  }
};

// ---- the tower ------------------------------------------------------------

struct VisionOutput {
  Tensor embeds;                  // [P/m², out_hidden]
  std::vector<Tensor> deepstack;  // one [P/m², out_hidden] per deepstack_visual_indexes entry
};

// The taps of one forward's position-embedding resample, on the model's
// device: what ops::pos_embed_interpolate_{forward,backward} read.
struct VisionPosTaps {
  Tensor ids;                   // [4, P] i32: table rows
  Tensor weights;               // [4, P] f32
  ops::PosEmbedRowTaps by_row;  // the taps grouped by table row (GPU only; empty on the CPU)
};

class Qwen3VLVisionModel {
 public:
  struct Context {
    VisionSegments segments;
    LinearWithBias::Context patch_embed;
    VisionPosTaps pos_taps;  // the position-embedding resample's taps
    std::vector<VisionBlock::Context> blocks;
    std::vector<VisionPatchMerger::Context> deepstack;
    VisionPatchMerger::Context merger;
  };

  Qwen3VLVisionModel() = default;

  // Parameters on opt.device in opt.dtype, uninitialised (init_random or
  // load_hf_weights). `prefix` is the tower's HF module path.
  Qwen3VLVisionModel(const Qwen3VLVisionConfig& config, ModuleOptions opt, std::string prefix = "model.visual")
      : config_(config), options_(opt), prefix_(std::move(prefix)) {
    config_.validate();
    const std::string where = "Qwen3VLVisionModel" + (config.source.empty() ? "" : "('" + config.source + "')");
    detail::check_module_options(opt, where);
    if (opt.device.is_cuda()) {
      SLIME_CHECK(opt.dtype == DType::bf16, where, ": a tower on ", opt.device,
                  " must be bf16 (the CUDA attention kernels are bf16 only), got ", dtype_name(opt.dtype));
      try {
        ops::check_attention_head_dim(opt.device, config_.head_dim());
      } catch (const Error& e) {
        SLIME_FAIL(where, ": ", e.message());
      }
    }
    patch_embed_ = LinearWithBias(prefix_ + ".patch_embed.proj", config_.patch_dim(), config_.hidden_size, opt);
    pos_embed_.name = prefix_ + ".pos_embed.weight";
    pos_embed_.value = Tensor::empty({config_.num_position_embeddings, config_.hidden_size}, opt.dtype, opt.device);
    for (int i = 0; i < config_.depth; ++i)
      blocks_.emplace_back(prefix_ + ".blocks." + std::to_string(i), config_, opt);
    merger_ = VisionPatchMerger(prefix_ + ".merger", config_, false, opt);
    for (std::size_t j = 0; j < config_.deepstack_visual_indexes.size(); ++j)
      deepstack_.emplace_back(prefix_ + ".deepstack_merger_list." + std::to_string(j), config_, true, opt);
  }

  const Qwen3VLVisionConfig& config() const { return config_; }
  const ModuleOptions& options() const { return options_; }
  const std::string& prefix() const { return prefix_; }
  LinearWithBias& patch_embed() { return patch_embed_; }
  Parameter& pos_embed() { return pos_embed_; }
  std::vector<VisionBlock>& blocks() { return blocks_; }
  VisionPatchMerger& merger() { return merger_; }
  std::vector<VisionPatchMerger>& deepstack_mergers() { return deepstack_; }

  // Every parameter once, HF names, in the order of HF's state_dict.
  template <class F>
  void for_each_parameter(F&& f) {
    patch_embed_.for_each_parameter(f);
    f(pos_embed_);
    for (auto& b : blocks_) b.for_each_parameter(f);
    merger_.for_each_parameter(f);
    for (auto& d : deepstack_) d.for_each_parameter(f);
  }

  template <class F>
  void for_each_workspace(F&& f) {
    patch_embed_.for_each_workspace(f);
    for (auto& b : blocks_) b.for_each_workspace(f);
    merger_.for_each_workspace(f);
    for (auto& d : deepstack_) d.for_each_workspace(f);
  }

  void init_random(uint64_t seed, float std = 0.02f, const Stream& stream = {}) {
    init_parameters(*this, seed, std, stream);
  }

  // The units (nn/units.hpp), in forward order: "<prefix>.patch_embed" (with
  // pos_embed), "<prefix>.blocks.<i>" (with the deepstack merger that reads
  // block i's output, when there is one: it runs right after the block), and
  // "<prefix>.merger".
  std::vector<Unit> units() {
    std::vector<Unit> u;
    u.push_back(Unit{prefix_ + ".patch_embed", {}, UnitKind::dense, 1, false});
    patch_embed_.for_each_parameter([&](Parameter& p) { u.back().params.push_back(&p); });
    u.back().params.push_back(&pos_embed_);
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      u.push_back(Unit{prefix_ + ".blocks." + std::to_string(i), {}, UnitKind::dense, 1, false});
      blocks_[i].for_each_parameter([&](Parameter& p) { u.back().params.push_back(&p); });
      if (const int j = deepstack_of(int(i)); j >= 0)
        deepstack_[std::size_t(j)].for_each_parameter([&](Parameter& p) { u.back().params.push_back(&p); });
    }
    u.push_back(Unit{prefix_ + ".merger", {}, UnitKind::dense, 1, false});
    merger_.for_each_parameter([&](Parameter& p) { u.back().params.push_back(&p); });
    return u;
  }

  // The tower on pixel_values [P, C·T·p·p] of the images `grids` (image_grid_thw,
  // in patches before merging; P = sum of t·h·w). Throws for a pixel_values
  // width other than C·T·p·p, a grid side not divisible by the merge size,
  // or P != sum t·h·w. `hooks` are called around every unit (see units()).
  template <UnitHooks Hooks = NoHooks>
  VisionOutput forward(const Tensor& pixel_values, std::span<const GridThw> grids, Context& ctx, const Stream& stream,
                       Hooks& hooks) {
    check_inputs(pixel_values, grids);
    make_segments(grids, ctx.segments, stream);
    ctx.pos_taps = pos_taps(grids, stream);
    ctx.blocks.resize(blocks_.size());
    ctx.deepstack.resize(deepstack_.size());
    VisionOutput out;
    out.deepstack.resize(deepstack_.size());

    std::size_t u = 0;
    hooks.forward_begin(u);
    Tensor h = patch_embed_.forward(pixel_values, ctx.patch_embed, stream);  // [P, D]
    ops::pos_embed_interpolate_forward(pos_embed_.value, ctx.pos_taps.ids, ctx.pos_taps.weights, h,
                                       /*accumulate=*/true, stream);
    hooks.forward_end(u++);
    for (std::size_t i = 0; i < blocks_.size(); ++i) {
      hooks.forward_begin(u);
      h = blocks_[i].forward(h, ctx.segments, ctx.blocks[i], stream);
      if (const int j = deepstack_of(int(i)); j >= 0)
        out.deepstack[std::size_t(j)] = deepstack_[std::size_t(j)].forward(h, ctx.deepstack[std::size_t(j)], stream);
      hooks.forward_end(u++);
    }
    hooks.forward_begin(u);
    out.embeds = merger_.forward(h, ctx.merger, stream);
    hooks.forward_end(u);
    return out;
  }
  VisionOutput forward(const Tensor& pixel_values, std::span<const GridThw> grids, Context& ctx,
                       const Stream& stream = {}) {
    NoHooks none;
    return forward(pixel_values, grids, ctx, stream, none);
  }

  // Accumulates every parameter's gradient from d_embeds [P/m², out_hidden]
  // and d_deepstack (one per deepstack index, or empty; an undefined entry
  // is zero). Hooks in reverse unit order.
  // Returns the gradient of pixel_values when `pixel_grad` (finite-difference
  // checks; training needs none), else an undefined tensor.
  template <UnitHooks Hooks>
  Tensor backward(const Context& ctx, const Tensor& d_embeds, const std::vector<Tensor>& d_deepstack,
                  const Stream& stream, Hooks& hooks, bool pixel_grad = false) {
    SLIME_CHECK(ctx.blocks.size() == blocks_.size() && ctx.pos_taps.ids.defined(), prefix_,
                ": backward needs the context of a forward of this tower");
    SLIME_CHECK(d_deepstack.empty() || d_deepstack.size() == deepstack_.size(), prefix_, ": backward got ",
                d_deepstack.size(), " deepstack gradients, expected none or ", deepstack_.size(),
                " (one per deepstack_visual_indexes entry)");
    const int64_t N = ctx.merger.patches / config_.merge_unit();
    const auto check_grad = [&](const Tensor& t, const std::string& what) {
      detail::check_activation(t, options_, config_.out_hidden_size, prefix_ + ": " + what);
      SLIME_CHECK(t.dim() == 2 && t.size(0) == N, prefix_, ": ", what, " must be [", N, ", ", config_.out_hidden_size,
                  "] (the merged tokens), got ", t.str());
    };
    check_grad(d_embeds, "d_embeds");
    for (std::size_t j = 0; j < d_deepstack.size(); ++j)
      if (d_deepstack[j].defined()) check_grad(d_deepstack[j], "d_deepstack[" + std::to_string(j) + "]");

    std::size_t u = blocks_.size() + 1;
    hooks.backward_begin(u);
    Tensor d = merger_.backward(ctx.merger, d_embeds, stream);
    hooks.backward_end(u);
    for (std::size_t i = blocks_.size(); i-- > 0;) {
      --u;
      hooks.backward_begin(u);
      if (const int j = deepstack_of(int(i)); j >= 0 && !d_deepstack.empty() && d_deepstack[std::size_t(j)].defined())
        ops::add_(
            d, deepstack_[std::size_t(j)].backward(ctx.deepstack[std::size_t(j)], d_deepstack[std::size_t(j)], stream),
            stream);
      d = blocks_[i].backward(ctx.blocks[i], d, stream);
      hooks.backward_end(u);
    }
    hooks.backward_begin(0);
    ops::pos_embed_interpolate_backward(d, ctx.pos_taps.ids, ctx.pos_taps.weights, ctx.pos_taps.by_row,
                                        pos_embed_.ensure_grad(stream), stream);
    Tensor d_pixels;
    if (pixel_grad) d_pixels = Tensor::empty(ctx.patch_embed.x.shape(), options_.dtype, options_.device, stream);
    patch_embed_.backward_into(ctx.patch_embed, d, d_pixels, false, stream);
    hooks.backward_end(0);
    return d_pixels;
  }
  Tensor backward(const Context& ctx, const Tensor& d_embeds, const std::vector<Tensor>& d_deepstack = {},
                  const Stream& stream = {}, bool pixel_grad = false) {
    NoHooks none;
    return backward(ctx, d_embeds, d_deepstack, stream, none, pixel_grad);
  }

  // Loads the tower's tensors (names under prefix()) from the HF checkpoint
  // directory `dir` (model.safetensors or a sharded index), converting to the
  // model's dtype; the Conv3d weight [hidden, C, T, p, p] fills the patch
  // embedding's [hidden, C·T·p·p]. Tensors outside the prefix (the language
  // model) are not read. Throws naming the directory and tensor for a missing
  // tower parameter, an unexpected tensor under the prefix, or a wrong shape.
  void load_hf_weights(const std::filesystem::path& dir) {
    const std::string where = prefix_ + ": load_hf_weights('" + dir.string() + "')";
    std::error_code ec;
    SLIME_CHECK(std::filesystem::is_directory(dir, ec), where, ": the checkpoint directory does not exist");
    const io::SafetensorsDir files(dir);
    std::set<std::string> expected;
    std::vector<std::string> missing, bad_shape;
    for_each_parameter([&](Parameter& p) {
      expected.insert(p.name);
      if (!files.contains(p.name)) {
        missing.push_back(p.name);
        return;
      }
      const Shape want = file_shape(p);
      if (!(files.info(p.name).shape() == want))
        bad_shape.push_back(p.name + " (the file has " + files.info(p.name).shape().str() + ", the config implies " +
                            want.str() + ")");
    });
    std::vector<std::string> unexpected;
    for (const std::string& name : files.names())
      if (name.starts_with(prefix_ + ".") && !expected.count(name)) unexpected.push_back(name);
    const auto join = [](const std::vector<std::string>& v) {
      std::string s;
      for (std::size_t i = 0; i < v.size() && i < 20; ++i) s += (i ? ", " : "") + v[i];
      if (v.size() > 20) s += ", ... (" + std::to_string(v.size() - 20) + " more)";
      return s;
    };
    SLIME_CHECK(missing.empty(), where, ": ", missing.size(), " tower parameter(s) missing: ", join(missing));
    SLIME_CHECK(unexpected.empty(), where, ": ", unexpected.size(),
                " unexpected tensor(s) under the tower's prefix: ", join(unexpected));
    SLIME_CHECK(bad_shape.empty(), where, ": ", bad_shape.size(), " tensor(s) with the wrong shape: ", join(bad_shape));
    for_each_parameter([&](Parameter& p) {
      Tensor dst = p.value.reshape(file_shape(p));
      files.read_into(p.name, dst);
    });
  }

  // The index j of the deepstack merger that reads block i's output, or -1.
  int deepstack_of(int block) const {
    const auto& idx = config_.deepstack_visual_indexes;
    const auto it = std::find(idx.begin(), idx.end(), block);
    return it == idx.end() ? -1 : int(it - idx.begin());
  }

 private:
  // A parameter's shape in the HF checkpoint (the patch embedding is a Conv3d).
  Shape file_shape(const Parameter& p) const {
    if (&p == &patch_embed_.weight)
      return Shape{config_.hidden_size, config_.in_channels, config_.temporal_patch_size, config_.patch_size,
                   config_.patch_size};
    return p.value.shape();
  }

  void check_inputs(const Tensor& pixel_values, std::span<const GridThw> grids) const {
    const std::string what = prefix_ + ": pixel_values";
    detail::check_activation(pixel_values, options_, -1, what);
    SLIME_CHECK(pixel_values.dim() == 2 && pixel_values.size(1) == config_.patch_dim(), what,
                " must be [patches, in_channels·temporal_patch_size·patch_size² = ", config_.in_channels, "·",
                config_.temporal_patch_size, "·", config_.patch_size, "² = ", config_.patch_dim(), "], got ",
                pixel_values.str());
    SLIME_CHECK(!grids.empty(), prefix_, ": no images (image_grid_thw is empty)");
    int64_t total = 0;
    for (std::size_t i = 0; i < grids.size(); ++i) {
      try {
        detail::check_grid(grids[i], config_.spatial_merge_size, i);
      } catch (const Error& e) {
        SLIME_FAIL(prefix_, ": image_grid_thw: ", e.message());
      }
      total += grids[i][0] * grids[i][1] * grids[i][2];
    }
    SLIME_CHECK(pixel_values.size(0) == total, what, " has ", pixel_values.size(0),
                " rows, but image_grid_thw implies sum t·h·w = ", total, " patches over ", grids.size(), " image(s)");
  }

  void make_segments(std::span<const GridThw> grids, VisionSegments& seg, const Stream& stream) const {
    std::vector<int32_t> cu{0};
    int max_len = 0;
    for (const GridThw& g : grids)
      for (int64_t f = 0; f < g[0]; ++f) {
        cu.push_back(int32_t(cu.back() + g[1] * g[2]));
        max_len = std::max(max_len, int(g[1] * g[2]));
      }
    const std::vector<int32_t> pos = vision_patch_positions(grids, config_.spatial_merge_size);
    seg.positions = Tensor::from_vector(pos, {int64_t(pos.size() / 2), 2}, options_.device, stream);
    seg.cu_seqlens = Tensor::from_vector(cu, {int64_t(cu.size())}, options_.device, stream);
    seg.max_seqlen = max_len;
  }

  // vision_pos_interpolation's taps as tensors on the model's device; the
  // by-row grouping (which also validates the ids) for the GPU backward.
  VisionPosTaps pos_taps(std::span<const GridThw> grids, const Stream& stream) const {
    const VisionPosInterpolation t = vision_pos_interpolation(grids, config_.grid_side(), config_.spatial_merge_size);
    const int64_t P = t.patches();
    std::vector<int32_t> ids;
    std::vector<float> weights;
    ids.reserve(std::size_t(4 * P));
    weights.reserve(std::size_t(4 * P));
    for (std::size_t k = 0; k < 4; ++k) {
      ids.insert(ids.end(), t.ids[k].begin(), t.ids[k].end());
      weights.insert(weights.end(), t.weights[k].begin(), t.weights[k].end());
    }
    VisionPosTaps out;
    const Tensor host_ids = Tensor::from_vector(ids, {4, P});
    out.ids = options_.device.is_cpu() ? host_ids : host_ids.to(options_.device, stream);
    out.weights = Tensor::from_vector(weights, {4, P}, options_.device, stream);
    if (options_.device.is_cuda())
      out.by_row = ops::pos_embed_row_taps(host_ids, config_.num_position_embeddings, options_.device, stream);
    return out;
  }

  Qwen3VLVisionConfig config_;
  ModuleOptions options_;
  std::string prefix_;
  LinearWithBias patch_embed_;
  Parameter pos_embed_;  // [num_position_embeddings, hidden]
  std::vector<VisionBlock> blocks_;
  VisionPatchMerger merger_;
  std::vector<VisionPatchMerger> deepstack_;
};

// Reads `dir`/config.json's vision_config and the tower's weights.
inline Qwen3VLVisionModel load_hf_vision(const std::filesystem::path& dir, Device device = Device::cpu(),
                                         DType dtype = DType::f32) {
  Qwen3VLVisionModel model(Qwen3VLVisionConfig::from_file(dir / "config.json"), {device, dtype});
  model.load_hf_weights(dir);
  return model;
}

}  // namespace slime::nn
