// slime/nn/qwen3_vl.hpp: Qwen3VLModel, Qwen3-VL and Qwen3-VL-MoE
// (transformers' Qwen3VLForConditionalGeneration /
// Qwen3VLMoeForConditionalGeneration): the vision tower (nn/vision.hpp,
// "model.visual") and the language model (nn::Qwen3Model with MRoPE,
// "model.language_model", LM head "lm_head.weight") run as one model with
// one unit list, so parallel::Sharded and the trainers drive it as they
// drive Qwen3Model.
//
// A batch (VLBatch, make_vl_batch) is packed token sequences whose images'
// placeholders are already expanded (data/qwen_vl_image.hpp), the images'
// pixel rows in the order their placeholders appear, and the MRoPE
// positions [T, 3] of transformers' get_rope_index (nn/vl_positions.hpp).
// forward: tower on the pixel rows -> merged embeddings [N, D] and
// deepstack features; the language model with those scattered into the N
// image-pad rows (nn::VisualEmbeds) -> final-normed hidden [T, D]. backward:
// language model (its VisualGrads), then the tower, unless the tower is
// frozen (set_vision_trainable(false): no tower backward, so its parameters
// get no gradient).
//
// Units: the tower's (patch_embed, blocks, merger; not trainable when the
// tower is frozen) first, then the language
// model's; a batch without images runs no tower, but its units' hooks are
// still called in order, so a wrapper sees every unit every step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/causal_lm.hpp"
#include "slime/nn/config.hpp"
#include "slime/nn/kv_source.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/units.hpp"
#include "slime/nn/vision.hpp"
#include "slime/nn/vision_config.hpp"
#include "slime/nn/vl_positions.hpp"
#include "slime/ops/elementwise.hpp"

namespace slime::nn {

// A Qwen3-VL config.json: the language model's text_config (a Qwen3Config of
// model_type qwen3_vl_text or qwen3_vl_moe_text), the tower's vision_config
// and the special token ids. transformers' defaults (Qwen3VLConfig) apply to
// absent ids. tie_word_embeddings may be given at the top level, in
// text_config, or both (then they must agree).
struct Qwen3VLConfig {
  std::string model_type = "qwen3_vl";  // or "qwen3_vl_moe"
  Qwen3Config text;
  Qwen3VLVisionConfig vision;
  int32_t image_token_id = 151655;
  int32_t video_token_id = 151656;
  int32_t vision_start_token_id = 151652;
  int32_t vision_end_token_id = 151653;
  nlohmann::json extra = nlohmann::json::object();  // top-level keys not interpreted, written back
  std::string source;

  bool is_moe() const { return text.is_moe(); }

  void validate() const {
    const std::string w = source.empty() ? std::string("Qwen3VLConfig") : "config '" + source + "'";
    SLIME_CHECK(model_type == "qwen3_vl" || model_type == "qwen3_vl_moe", w, ": model_type = '", model_type,
                "' is not a Qwen3-VL model type (expected 'qwen3_vl' or 'qwen3_vl_moe')");
    SLIME_CHECK(text.model_type == (model_type == "qwen3_vl" ? "qwen3_vl_text" : "qwen3_vl_moe_text"), w,
                ": text_config.model_type = '", text.model_type, "' does not belong to model_type '", model_type, "'");
    text.validate();
    vision.validate();
    SLIME_CHECK(
        vision.out_hidden_size == text.hidden_size, w, ": vision_config.out_hidden_size = ", vision.out_hidden_size,
        " must equal text_config.hidden_size = ", text.hidden_size, " (the merged patches replace token embeddings)");
    SLIME_CHECK(vision.deepstack_visual_indexes.size() <= std::size_t(text.num_hidden_layers), w, ": ",
                vision.deepstack_visual_indexes.size(), " deepstack indexes but only ", text.num_hidden_layers,
                " decoder layers to add them to");
    for (const auto& [name, id] : {std::pair{"image_token_id", image_token_id},
                                   {"video_token_id", video_token_id},
                                   {"vision_start_token_id", vision_start_token_id},
                                   {"vision_end_token_id", vision_end_token_id}})
      SLIME_CHECK(id >= 0 && id < text.vocab_size, w, ": ", name, " = ", id, " is outside the vocabulary [0, ",
                  text.vocab_size, ")");
  }

  static Qwen3VLConfig from_json(const nlohmann::json& j, std::string source = {}) {
    Qwen3VLConfig c;
    c.source = std::move(source);
    const std::string w = c.source.empty() ? std::string("Qwen3VLConfig") : "config '" + c.source + "'";
    SLIME_CHECK(j.is_object(), w, ": config is not a JSON object");
    if (auto it = j.find("model_type"); it != j.end()) {
      SLIME_CHECK(it->is_string(), w, ": model_type is not a string");
      c.model_type = it->get<std::string>();
    }
    SLIME_CHECK(c.model_type == "qwen3_vl" || c.model_type == "qwen3_vl_moe", w, ": model_type = '", c.model_type,
                "' is not a Qwen3-VL model type (expected 'qwen3_vl' or 'qwen3_vl_moe')");
    const auto tc = j.find("text_config");
    SLIME_CHECK(tc != j.end() && tc->is_object(), w, ": a Qwen3-VL config needs a text_config object");
    nlohmann::json text = *tc;
    if (!text.contains("model_type")) text["model_type"] = c.model_type + "_text";
    std::optional<bool> tie_top, tie_text;
    if (auto it = j.find("tie_word_embeddings"); it != j.end() && !it->is_null()) {
      SLIME_CHECK(it->is_boolean(), w, ": tie_word_embeddings is not a boolean");
      tie_top = it->get<bool>();
    }
    if (auto it = text.find("tie_word_embeddings"); it != text.end() && !it->is_null()) {
      SLIME_CHECK(it->is_boolean(), w, ": text_config.tie_word_embeddings is not a boolean");
      tie_text = it->get<bool>();
    }
    SLIME_CHECK(!(tie_top && tie_text && *tie_top != *tie_text), w, ": tie_word_embeddings = ", *tie_top,
                " and text_config.tie_word_embeddings = ", *tie_text, " disagree");
    if (tie_top) text["tie_word_embeddings"] = *tie_top;
    c.text = Qwen3Config::from_json(text, c.source.empty() ? std::string() : c.source + " (text_config)");
    c.vision = Qwen3VLVisionConfig::from_json(j, c.source);
    const auto id = [&](const char* key, int32_t& out) {
      auto it = j.find(key);
      if (it == j.end() || it->is_null()) return;
      SLIME_CHECK(it->is_number_integer() && it->get<int64_t>() >= 0 && it->get<int64_t>() <= INT32_MAX, w, ": ", key,
                  " is not a token id");
      out = int32_t(it->get<int64_t>());
    };
    id("image_token_id", c.image_token_id);
    id("video_token_id", c.video_token_id);
    id("vision_start_token_id", c.vision_start_token_id);
    id("vision_end_token_id", c.vision_end_token_id);
    for (auto& [key, value] : j.items())
      if (key != "model_type" && key != "architectures" && key != "text_config" && key != "vision_config" &&
          key != "tie_word_embeddings" && !key.ends_with("token_id") && key != "dtype" && key != "torch_dtype")
        c.extra[key] = value;
    c.validate();
    return c;
  }

  static Qwen3VLConfig from_file(const std::filesystem::path& path) {
    return from_json(detail::read_json_file(path), path.string());
  }

  // config.json as transformers' Qwen3VLConfig / Qwen3VLMoeConfig read it.
  nlohmann::json to_json() const {
    validate();
    nlohmann::json j = extra;
    const bool moe = model_type == "qwen3_vl_moe";
    j["architectures"] = {moe ? "Qwen3VLMoeForConditionalGeneration" : "Qwen3VLForConditionalGeneration"};
    j["model_type"] = model_type;
    j["text_config"] = text.to_json();
    j["vision_config"] = vision.to_json(moe ? "qwen3_vl_moe" : "qwen3_vl");
    j["image_token_id"] = image_token_id;
    j["video_token_id"] = video_token_id;
    j["vision_start_token_id"] = vision_start_token_id;
    j["vision_end_token_id"] = vision_end_token_id;
    j["tie_word_embeddings"] = text.tie_word_embeddings;
    j["dtype"] = j["text_config"]["dtype"];
    return j;
  }
};

// What Qwen3VLModel::forward takes (make_vl_batch builds it).
struct VLBatch {
  PackedBatch text;                    // tokens, cu_seqlens; positions [T, 3] (MRoPE)
  Tensor pixel_values;                 // [P, patch_dim] in the model's dtype; undefined without images
  std::vector<GridThw> grids;          // per image, in the order of its placeholder run in `text`
  Tensor image_rows;                   // i32 [N]: the rows of the image-pad tokens, increasing

  int64_t num_tokens() const { return text.num_tokens(); }
  bool has_images() const { return !grids.empty(); }
};

// One sequence of a VL batch: its tokens (placeholders expanded: each image
// is a run of image_token_id of its merged patch count) and its images'
// grids and pixel rows ([sum t·h·w, patch_dim] f32 on the host, in order).
// prompt_length: tokens from there on are a completion, text whatever their
// id (a sampled image_token_id is no placeholder); -1: all prompt.
struct VLSequence {
  std::vector<int32_t> tokens;
  std::vector<GridThw> grids;
  Tensor pixel_values;  // undefined when grids is empty
  int64_t prompt_length = -1;
};

// Packs `sequences` for a model of `config` on `device` in `dtype`: MRoPE
// positions per sequence (nn::mrope_positions), the image rows, and the
// pixel rows of every image cast to dtype. Throws for placeholder runs that
// do not match the grids, pixel rows that do not match the grids, and a
// batch with no tokens.
inline VLBatch make_vl_batch(std::span<const VLSequence> sequences, const Qwen3VLConfig& config, Device device,
                             DType dtype, const Stream& stream = {}) {
  SLIME_CHECK(!sequences.empty(), "make_vl_batch: no sequences");
  std::vector<std::vector<int32_t>> tokens;
  tokens.reserve(sequences.size());
  for (const VLSequence& s : sequences) tokens.push_back(s.tokens);
  VLBatch b;
  b.text = make_packed_batch(tokens, device, stream);
  const int64_t patch_dim = config.vision.patch_dim();
  std::vector<int32_t> positions, rows;
  positions.reserve(std::size_t(b.text.num_tokens()) * 3);
  int64_t offset = 0, patches = 0;
  for (std::size_t i = 0; i < sequences.size(); ++i) {
    const VLSequence& s = sequences[i];
    const std::size_t text_from = s.prompt_length < 0 ? s.tokens.size() : std::size_t(s.prompt_length);
    MropePositions p;
    try {
      p = mrope_positions(s.tokens, s.grids, config.image_token_id, config.vision.spatial_merge_size, text_from);
    } catch (const Error& e) {
      SLIME_FAIL("make_vl_batch: sequence ", i, ": ", e.message());
    }
    positions.insert(positions.end(), p.positions.begin(), p.positions.end());
    for (std::size_t t = 0; t < s.tokens.size() && t < text_from; ++t)
      if (s.tokens[t] == config.image_token_id) rows.push_back(int32_t(offset + int64_t(t)));
    int64_t want = 0;
    for (const GridThw& g : s.grids) want += g[0] * g[1] * g[2];
    if (s.grids.empty()) {
      SLIME_CHECK(!s.pixel_values.defined() || s.pixel_values.numel() == 0, "make_vl_batch: sequence ", i,
                  " has pixel rows but no images");
    } else {
      SLIME_CHECK(s.pixel_values.defined() && s.pixel_values.dtype() == DType::f32 &&
                      s.pixel_values.device().is_cpu() && (s.pixel_values.shape() == Shape{want, patch_dim}),
                  "make_vl_batch: sequence ", i, ": pixel_values must be f32 [", want, ", ", patch_dim,
                  "] on the CPU (sum t·h·w of its ", s.grids.size(), " image(s), in_channels·temporal·patch²), got ",
                  s.pixel_values.defined() ? s.pixel_values.str() : std::string("none"));
    }
    b.grids.insert(b.grids.end(), s.grids.begin(), s.grids.end());
    patches += want;
    offset += int64_t(s.tokens.size());
  }
  b.text.positions = Tensor::from_vector(positions, {b.text.num_tokens(), 3}, device, stream);
  if (!b.grids.empty()) {
    Tensor pixels = Tensor::empty({patches, patch_dim}, DType::f32);
    int64_t at = 0;
    for (const VLSequence& s : sequences) {
      if (s.grids.empty()) continue;
      pixels.slice_rows(at, s.pixel_values.size(0)).copy_from(s.pixel_values);
      at += s.pixel_values.size(0);
    }
    if (dtype != DType::f32) {
      Tensor cast = Tensor::empty({patches, patch_dim}, dtype);
      ops::cast(pixels, cast);
      pixels = cast;
    }
    b.pixel_values = device.is_cpu() ? pixels : pixels.to(device, stream);
    b.image_rows = Tensor::from_vector(rows, {int64_t(rows.size())}, device, stream);
  }
  return b;
}

class Qwen3VLModel {
 public:
  struct Context {
    Qwen3VLVisionModel::Context visual;
    Qwen3Model::Context language;
    bool images = false;  // the forward ran the tower
  };

  Qwen3VLModel() = default;

  // Parameters on opt.device in opt.dtype, uninitialised (init_random or
  // load_hf_vl). `dispatcher`: the language model's MoE token dispatcher
  // (e.g. parallel::ExpertParallel), as for Qwen3Model.
  Qwen3VLModel(const Qwen3VLConfig& config, ModuleOptions opt, DispatcherRef dispatcher = {})
      : config_(config),
        options_(opt),
        visual_((config.validate(), config.vision), opt, "model.visual"),
        language_(config.text, opt, dispatcher, "model.language_model") {}

  const Qwen3VLConfig& config() const { return config_; }
  const Qwen3Config& language_config() const { return config_.text; }
  const ModuleOptions& options() const { return options_; }
  Device device() const { return options_.device; }
  DType dtype() const { return options_.dtype; }
  Qwen3VLVisionModel& visual() { return visual_; }
  Qwen3Model& language() { return language_; }

  // Whether backward runs the tower (default true). Frozen: the tower's
  // parameters get no gradient and its units are not trainable
  // (nn::Unit::trainable); parallel::Sharded keeps no gradients or optimizer
  // state for them and its optimizer leaves them as they are. Set it before
  // wrapping: a wrapper reads units() once.
  void set_vision_trainable(bool trainable) { vision_trainable_ = trainable; }
  bool vision_trainable() const { return vision_trainable_; }

  // Every parameter once, HF names, in the order of HF's state_dict (tower,
  // language model, LM head).
  template <class F>
  void for_each_parameter(F&& f) {
    visual_.for_each_parameter(f);
    language_.for_each_parameter(f);
  }
  template <class F>
  void for_each_workspace(F&& f) {
    visual_.for_each_workspace(f);
    language_.for_each_workspace(f);
  }

  void init_random(uint64_t seed, float std = 0.02f, const Stream& stream = {}) {
    init_parameters(*this, seed, std, stream);
  }

  std::size_t num_vision_units() const { return std::size_t(config_.vision.depth) + 2; }

  // The tower's units, then the language model's (see the file comment).
  std::vector<Unit> units() {
    std::vector<Unit> u = visual_.units();
    for (Unit& v : u) v.trainable = vision_trainable_;
    for (Unit& l : language_.units()) u.push_back(std::move(l));
    return u;
  }

  // Final-normed hidden [T, D]. kv: the language model's K/V source.
  template <UnitHooks Hooks = NoHooks, KvSource Kv = SelfKv>
  Tensor forward(const VLBatch& batch, Context& ctx, const Stream& stream, Hooks& hooks, const Kv& kv = {}) {
    const std::size_t nv = num_vision_units();
    VisualEmbeds visual;
    ctx.images = batch.has_images();
    if (ctx.images) {
      SLIME_CHECK(batch.image_rows.defined() && batch.pixel_values.defined(),
                  "Qwen3VLModel::forward: the batch has images but no image_rows or pixel_values (use make_vl_batch)");
      OffsetHooks<Hooks> vh{hooks, 0};
      VisionOutput out = visual_.forward(batch.pixel_values, batch.grids, ctx.visual, stream, vh);
      SLIME_CHECK(out.embeds.size(0) == batch.image_rows.numel(), "Qwen3VLModel::forward: the images give ",
                  out.embeds.size(0), " merged patches, the batch has ", batch.image_rows.numel(),
                  " image-pad tokens (placeholders not expanded to the merged patch count?)");
      visual = VisualEmbeds{batch.image_rows, out.embeds, std::move(out.deepstack)};
    } else {
      for (std::size_t u = 0; u < nv; ++u) {
        hooks.forward_begin(u);
        hooks.forward_end(u);
      }
    }
    OffsetHooks<Hooks> lh{hooks, nv};
    return language_.forward(batch.text, ctx.language, stream, lh, kv, visual);
  }
  Tensor forward(const VLBatch& batch, Context& ctx, const Stream& stream = {}) {
    NoHooks none;
    return forward(batch, ctx, stream, none);
  }

  // Accumulates every trainable parameter's gradient (LM head excepted, as
  // Qwen3Model::backward) from d_hidden [T, D] and the aux-loss gradients.
  template <UnitHooks Hooks>
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream, Hooks& hooks,
                const AuxLoss& aux = {}) {
    const std::size_t nv = num_vision_units();
    const bool tower = ctx.images && vision_trainable_;
    VisualGrads grads;
    OffsetHooks<Hooks> lh{hooks, nv};
    language_.backward(ctx.language, d_hidden, stream, lh, aux, tower ? &grads : nullptr);
    if (tower) {
      OffsetHooks<Hooks> vh{hooks, 0};
      visual_.backward(ctx.visual, grads.embeds, grads.deepstack, stream, vh);
    } else {
      for (std::size_t u = nv; u-- > 0;) {
        hooks.backward_begin(u);
        hooks.backward_end(u);
      }
    }
  }
  void backward(const Context& ctx, const Tensor& d_hidden, const Stream& stream = {}, const AuxLoss& aux = {}) {
    NoHooks none;
    backward(ctx, d_hidden, stream, none, aux);
  }

  // The language model's calls (see Qwen3Model).
  void set_sequence_attention(SequenceAttention* sa) { language_.set_sequence_attention(sa); }
  SequenceAttention* sequence_attention() const { return language_.sequence_attention(); }
  std::vector<int> sparse_layers() const { return language_.sparse_layers(); }
  std::vector<Tensor> router_logits(const Context& ctx) const { return language_.router_logits(ctx.language); }
  AuxLoss aux_loss_and_grad(const Context& ctx, std::optional<double> scale = std::nullopt, const Stream& stream = {},
                            const AuxStatsReduce& reduce = {}) const {
    return language_.aux_loss_and_grad(ctx.language, scale, stream, reduce);
  }
  Tensor logits(const Tensor& hidden, const Stream& stream = {}) { return language_.logits(hidden, stream); }
  ops::TokenLogprobs token_logprobs(const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) {
    return language_.token_logprobs(hidden, targets, temperature, stream);
  }
  Tensor token_logprobs_backward(const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) {
    return language_.token_logprobs_backward(hidden, targets, temperature, fwd, grad_logprobs, grad_entropy, stream);
  }
  // With the buffers of ctx (Qwen3Model::token_logprobs(ctx, ...)).
  ops::TokenLogprobs token_logprobs(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature = 1.f,
                                    const Stream& stream = {}) {
    return language_.token_logprobs(ctx.language, hidden, targets, temperature, stream);
  }
  Tensor token_logprobs_backward(Context& ctx, const Tensor& hidden, const Tensor& targets, float temperature,
                                 const ops::TokenLogprobs& fwd, const Tensor& grad_logprobs, const Tensor& grad_entropy,
                                 const Stream& stream = {}) {
    return language_.token_logprobs_backward(ctx.language, hidden, targets, temperature, fwd, grad_logprobs,
                                             grad_entropy, stream);
  }

  // As Qwen3Model::loss_and_backward, over a VL batch.
  LossResult loss_and_backward(const VLBatch& batch, const Tensor& targets, const Tensor& loss_weights = {},
                               float temperature = 1.f, std::optional<double> normalizer = std::nullopt,
                               const Stream& stream = {}, std::optional<bool> with_aux_loss = std::nullopt) {
    return causal_lm_loss_and_backward(*this, batch, targets, loss_weights, temperature, normalizer, stream,
                                       with_aux_loss.value_or(config_.text.output_router_logits));
  }

 private:
  Qwen3VLConfig config_;
  ModuleOptions options_;
  Qwen3VLVisionModel visual_;
  Qwen3Model language_;
  bool vision_trainable_ = true;
};

}  // namespace slime::nn
