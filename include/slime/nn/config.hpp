// slime/nn/config.hpp: Qwen3Config, the architecture of a Qwen3 dense or
// Qwen3-MoE decoder, read from and written to Hugging Face config.json.
//
// Reading follows transformers (Qwen3Config / Qwen3MoeConfig) so that a
// checkpoint means the same model here as there:
// - model_type "qwen3" or "qwen3_moe"; when absent it is taken from
//   "architectures", else from whether num_experts is present and positive.
//   Qwen3-VL's language models ("text_config" of a Qwen3-VL config.json,
//   model_type "qwen3_vl_text" dense or "qwen3_vl_moe_text" MoE) read the
//   same fields with the dense / MoE defaults, plus interleaved MRoPE:
//   rope_parameters.mrope_section (pairs per t, h, w axis, summing to
//   head_dim / 2; mrope_section) with mrope_interleaved true (Qwen3-VL's
//   layout; the non-interleaved Qwen2-VL layout is an error).
// - vocab_size, hidden_size, intermediate_size, num_hidden_layers and
//   num_attention_heads are required (no real checkpoint omits them; a
//   missing one means the wrong file). Other fields, when absent or null,
//   take transformers' defaults for the model type:
//     field                    qwen3                     qwen3_moe
//     num_key_value_heads      32 (null: attention heads) 4
//     head_dim                 128                       hidden_size / num_attention_heads
//     max_position_embeddings  32768                     32768
//     rms_norm_eps             1e-6                      1e-6
//     rope_theta               10000                     10000
//     tie_word_embeddings      false                     false
//     attention_bias           false                     false
//     torch_dtype              float32                   float32
//     num_experts              0 (dense)                 128
//     num_experts_per_tok      0                         8
//     moe_intermediate_size    0                         768
//     norm_topk_prob           false                     false
//     decoder_sparse_step      1                         1
//     mlp_only_layers          []                        []
//     router_aux_loss_coef     0.001                     0.001
//     output_router_logits     false                     false
//   (Qwen3Config's head_dim default is 128, not hidden/heads; Qwen3MoeConfig
//   has no head_dim field and its attention falls back to hidden/heads.)
//   qwen3_vl_text takes qwen3's defaults, qwen3_vl_moe_text qwen3_moe's,
//   except: max_position_embeddings 128000 (both), and for
//   qwen3_vl_moe_text num_key_value_heads 16, num_experts 60,
//   num_experts_per_tok 4, moe_intermediate_size 1408, and norm_topk_prob
//   true (its router always renormalises; false is an error).
//   The MoE fields are read only for qwen3_moe; a dense config with
//   num_experts > 0 is an error. output_router_logits decides, as in
//   Qwen3MoeForCausalLM, whether the training loss includes
//   router_aux_loss_coef times the load-balancing loss (Qwen3Model::
//   loss_and_backward follows it).
// - Spellings in the wild: num_experts / num_local_experts, top-level
//   rope_theta / rope_parameters.rope_theta (transformers 5), torch_dtype /
//   dtype. When both spellings are present they must agree.
// - What slime does not implement is an error rather than a silent change of
//   the model: rope scaling other than "default" (YaRN, linear, ...),
//   use_sliding_window = true, hidden_act other than "silu".
// - Keys not interpreted here (bos/eos_token_id, initializer_range, use_cache,
//   ...) are kept in `extra` and written back by to_json().
//
// Writing (to_json) emits both spellings where transformers 4 and 5 differ,
// so that either version, and tools that read config.json directly, load it:
// top-level "rope_theta" and "rope_parameters": {"rope_theta", "rope_type":
// "default"}; "torch_dtype" and "dtype". MoE configs write "num_experts".
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "slime/core/dtype.hpp"
#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"
#include "slime/ops/cpu/rope.hpp"

namespace slime::nn {

namespace detail {

// Parses the JSON file `path`; errors name it.
// Refuses a FIFO or device, NUL bytes and nesting past kJsonMaxDepth.
inline nlohmann::json read_json_file(const std::filesystem::path& path) {
  return parse_json(read_regular_file(path, "config"), "config '" + path.string() + "'");
}

}  // namespace detail

struct Qwen3Config {
  // "qwen3" (dense), "qwen3_moe", or a Qwen3-VL language model:
  // "qwen3_vl_text" (dense), "qwen3_vl_moe_text" (MoE)
  std::string model_type = "qwen3";

  int64_t vocab_size = 151936;
  int64_t hidden_size = 4096;
  int64_t intermediate_size = 22016;  // dense MLP (and the MLP of mlp_only_layers)
  int num_hidden_layers = 32;
  int num_attention_heads = 32;
  int num_key_value_heads = 32;
  int head_dim = 128;
  int64_t max_position_embeddings = 32768;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  // Interleaved MRoPE (Qwen3-VL): rotation pairs per (t, h, w) axis; all 0
  // for the text rotary. Positions are then [tokens, 3].
  std::array<int64_t, 3> mrope_section{};
  bool tie_word_embeddings = false;
  DType torch_dtype = DType::f32;
  bool attention_bias = false;

  // Mixture of experts (qwen3_moe); num_experts == 0 for dense models.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  bool norm_topk_prob = false;
  int decoder_sparse_step = 1;
  std::vector<int> mlp_only_layers;  // layers with a dense MLP instead of experts
  double router_aux_loss_coef = 0.001;
  // HF: return the router logits and add router_aux_loss_coef * aux loss to
  // the loss (Qwen3MoeForCausalLM.forward).
  bool output_router_logits = false;

  // config.json keys this struct does not interpret, written back by to_json.
  nlohmann::json extra = nlohmann::json::object();
  // Where the config came from (a file path); named in errors. Empty when
  // built in code.
  std::string source;

  bool is_moe() const { return num_experts > 0; }
  // Whether model_type names a MoE model (qwen3_moe, qwen3_vl_moe_text).
  bool is_moe_type() const { return model_type == "qwen3_moe" || model_type == "qwen3_vl_moe_text"; }
  bool is_vl_text() const { return model_type == "qwen3_vl_text" || model_type == "qwen3_vl_moe_text"; }
  bool uses_mrope() const { return mrope_section[0] + mrope_section[1] + mrope_section[2] > 0; }
  // The rotary the attention applies (positions [tokens, rope().axes()]).
  ops::RopeSpec rope() const {
    return uses_mrope() ? ops::RopeSpec::mrope(rope_theta, mrope_section) : ops::RopeSpec::text(rope_theta);
  }

  // Qwen3-MoE's rule (Qwen3MoeDecoderLayer): layer i holds experts iff
  // i is not in mlp_only_layers, num_experts > 0 and (i + 1) %
  // decoder_sparse_step == 0; other layers hold the dense MLP
  // (intermediate_size).
  bool is_sparse_layer(int layer) const {
    SLIME_CHECK(layer >= 0 && layer < num_hidden_layers, where(), ": layer ", layer, " out of range [0, ",
                num_hidden_layers, ")");
    if (num_experts <= 0) return false;
    SLIME_CHECK(decoder_sparse_step > 0, where(), ": decoder_sparse_step = ", decoder_sparse_step, " must be positive");
    if (std::find(mlp_only_layers.begin(), mlp_only_layers.end(), layer) != mlp_only_layers.end()) return false;
    return (layer + 1) % decoder_sparse_step == 0;
  }
  bool is_moe_layer(int layer) const { return is_sparse_layer(layer); }  // the same rule, older name

  // Number of layers with experts.
  int num_sparse_layers() const {
    int n = 0;
    for (int i = 0; i < num_hidden_layers; ++i) n += is_sparse_layer(i) ? 1 : 0;
    return n;
  }

  // Throws slime::Error naming the field, its value and the source.
  void validate() const {
    if (!known_model_type(model_type))
      fail("model_type = '", model_type, "' is not a Qwen3 model type (expected ", kModelTypes, ")");
    positive("vocab_size", vocab_size);
    positive("hidden_size", hidden_size);
    positive("intermediate_size", intermediate_size);
    positive("num_hidden_layers", num_hidden_layers);
    positive("num_attention_heads", num_attention_heads);
    positive("num_key_value_heads", num_key_value_heads);
    positive("head_dim", head_dim);
    positive("max_position_embeddings", max_position_embeddings);
    // Upper bounds far above any released model, so that an absurd size is an error naming its
    // field here rather than a failed allocation later.
    at_most("vocab_size", vocab_size, kMaxVocabSize);
    at_most("hidden_size", hidden_size, kMaxWidth);
    at_most("intermediate_size", intermediate_size, kMaxWidth);
    at_most("num_hidden_layers", num_hidden_layers, kMaxLayers);
    at_most("num_attention_heads", num_attention_heads, kMaxHeads);
    at_most("num_key_value_heads", num_key_value_heads, kMaxHeads);
    at_most("head_dim", head_dim, kMaxHeadDim);
    at_most("max_position_embeddings", max_position_embeddings, kMaxPositions);
    if (num_attention_heads % num_key_value_heads != 0)
      fail("num_attention_heads = ", num_attention_heads,
           " is not a multiple of num_key_value_heads = ", num_key_value_heads);
    if (head_dim % 2 != 0) fail("head_dim = ", head_dim, " must be even (RoPE rotates pairs)");
    if (!(std::isfinite(rms_norm_eps) && rms_norm_eps > 0)) fail("rms_norm_eps = ", rms_norm_eps, " must be > 0");
    if (!(std::isfinite(rope_theta) && rope_theta > 0)) fail("rope_theta = ", rope_theta, " must be > 0");
    if (!is_floating(torch_dtype)) fail("torch_dtype = ", dtype_name(torch_dtype), " is not a floating-point dtype");
    if (!is_moe_type() && num_experts != 0)
      fail("num_experts = ", num_experts, " but model_type '", model_type, "' is dense");
    if (uses_mrope()) {
      const auto& m = mrope_section;
      if (m[0] < 0 || m[1] < 0 || m[2] < 0 || m[0] + m[1] + m[2] != head_dim / 2)
        fail("mrope_section [", m[0], ", ", m[1], ", ", m[2],
             "] must be >= 0 and sum to head_dim / 2 = ", head_dim / 2);
    }
    if (is_vl_text() && !uses_mrope()) fail("model_type '", model_type, "' needs rope_parameters.mrope_section");
    if (is_moe_type()) {
      positive("num_experts", num_experts);
      positive("num_experts_per_tok", num_experts_per_tok);
      if (num_experts_per_tok > num_experts)
        fail("num_experts_per_tok = ", num_experts_per_tok, " exceeds num_experts = ", num_experts);
      positive("moe_intermediate_size", moe_intermediate_size);
      at_most("num_experts", num_experts, kMaxExperts);
      at_most("moe_intermediate_size", moe_intermediate_size, kMaxWidth);
      positive("decoder_sparse_step", decoder_sparse_step);
      if (!(std::isfinite(router_aux_loss_coef) && router_aux_loss_coef >= 0))
        fail("router_aux_loss_coef = ", router_aux_loss_coef, " must be >= 0");
    }
    for (int layer : mlp_only_layers)
      if (layer < 0 || layer >= num_hidden_layers)
        fail("mlp_only_layers contains ", layer, ", outside [0, num_hidden_layers = ", num_hidden_layers, ")");
  }

  // Parses a config.json object (see the header comment) and validates it.
  // `source` names the origin in errors.
  static Qwen3Config from_json(const nlohmann::json& j, std::string source = {}) {
    Qwen3Config c;
    c.source = std::move(source);
    if (!j.is_object()) c.fail("config is not a JSON object (it is a JSON ", j.type_name(), ")");
    Reader r{c, j, {}};

    // Model type first: it picks the defaults.
    if (const auto* mt = r.find("model_type")) {
      if (!mt->is_string()) c.fail("model_type is not a string: ", json_excerpt(*mt));
      c.model_type = mt->get<std::string>();
    } else if (const auto* arch = r.find("architectures");
               arch != nullptr && arch->is_array() && !arch->empty() && (*arch)[0] == "Qwen3MoeForCausalLM") {
      c.model_type = "qwen3_moe";
    } else {
      const auto* e = r.find("num_experts");
      if (e == nullptr) e = r.find("num_local_experts");
      c.model_type = e != nullptr && e->is_number() && e->get<double>() > 0 ? "qwen3_moe" : "qwen3";
    }
    if (!known_model_type(c.model_type))
      c.fail("model_type = '", c.model_type, "' is not a Qwen3 model type (expected ", kModelTypes, ")");
    const bool moe = c.is_moe_type();
    r.take("model_type");
    r.take("architectures");

    c.vocab_size = r.required_int("vocab_size");
    c.hidden_size = r.required_int("hidden_size");
    c.intermediate_size = r.required_int("intermediate_size");
    c.num_hidden_layers = r.required_int32("num_hidden_layers");
    c.num_attention_heads = r.required_int32("num_attention_heads");

    if (r.present("num_key_value_heads")) {
      c.num_key_value_heads = r.int32("num_key_value_heads");
    } else {
      // null means "same as attention heads" (Qwen3Config); absent takes the class default.
      const bool explicit_null = j.contains("num_key_value_heads");
      const int fallback = c.model_type == "qwen3_moe" ? 4 : c.model_type == "qwen3_vl_moe_text" ? 16 : 32;
      c.num_key_value_heads = explicit_null ? c.num_attention_heads : fallback;
      r.take("num_key_value_heads");
    }
    if (r.present("head_dim")) {
      c.head_dim = r.int32("head_dim");
    } else {
      r.take("head_dim");
      if (moe) {
        if (c.num_attention_heads <= 0 || c.hidden_size % c.num_attention_heads != 0)
          c.fail("head_dim is absent and hidden_size = ", c.hidden_size,
                 " is not a multiple of num_attention_heads = ", c.num_attention_heads);
        c.head_dim = int(c.hidden_size / c.num_attention_heads);
      } else {
        c.head_dim = 128;
      }
    }
    c.max_position_embeddings = r.int_or("max_position_embeddings", c.is_vl_text() ? 128000 : 32768);
    c.rms_norm_eps = r.number_or("rms_norm_eps", 1e-6);
    c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false);
    c.attention_bias = r.bool_or("attention_bias", false);

    // dtype: "torch_dtype" (transformers 4) or "dtype" (transformers 5).
    {
      std::optional<DType> a = r.dtype_field("torch_dtype"), b = r.dtype_field("dtype");
      if (a && b && *a != *b) c.fail("torch_dtype = ", dtype_name(*a), " and dtype = ", dtype_name(*b), " disagree");
      c.torch_dtype = a ? *a : b ? *b : DType::f32;
    }

    // RoPE: top-level rope_theta and/or rope_parameters (transformers 5);
    // rope_scaling (transformers 4) must be null or the default type.
    {
      std::optional<double> top;
      if (r.present("rope_theta")) top = r.number("rope_theta");
      r.take("rope_theta");
      std::optional<double> nested;
      for (const char* key : {"rope_parameters", "rope_scaling"}) {
        const nlohmann::json* p = r.find(key);
        r.take(key);
        if (p == nullptr || p->is_null()) continue;
        if (!p->is_object()) c.fail(key, " is not an object: ", json_excerpt(*p));
        std::string type = "default";
        for (const char* type_key : {"rope_type", "type"})
          if (auto it = p->find(type_key); it != p->end()) {
            if (!it->is_string()) c.fail(key, ".", type_key, " is not a string: ", json_excerpt(*it));
            type = it->get<std::string>();
          }
        if (type != "default")
          c.fail(key, " has rope_type '", type, "'; slime implements only the default RoPE (no scaling)");
        if (auto it = p->find("mrope_section"); it != p->end() && !it->is_null()) {
          if (!it->is_array() || it->size() != 3)
            c.fail(key, ".mrope_section is not an array of 3 integers: ", json_excerpt(*it));
          for (std::size_t a = 0; a < 3; ++a) {
            const nlohmann::json& e = (*it)[a];
            if (!e.is_number_integer() || e.get<int64_t>() < 0 || e.get<int64_t>() > INT32_MAX)
              c.fail(key, ".mrope_section = ", json_excerpt(*it), " holds ", json_excerpt(e),
                     ", which is not a count of rotation pairs");
            c.mrope_section[a] = e.get<int64_t>();
          }
          const auto il = p->find("mrope_interleaved");
          if (il == p->end() || !il->is_boolean() || !il->get<bool>())
            c.fail(key, " has an mrope_section but mrope_interleaved is not true; slime implements Qwen3-VL's ",
                   "interleaved MRoPE only");
        }
        if (auto it = p->find("rope_theta"); it != p->end()) {
          if (!it->is_number()) c.fail(key, ".rope_theta is not a number: ", json_excerpt(*it));
          const double v = it->get<double>();
          if (nested && *nested != v)
            c.fail("rope_parameters.rope_theta and rope_scaling.rope_theta disagree: ", *nested, " vs ", v);
          nested = v;
        }
      }
      if (top && nested && *top != *nested)
        c.fail("rope_theta = ", *top, " and rope_parameters.rope_theta = ", *nested, " disagree");
      c.rope_theta = top ? *top : nested ? *nested : 10000.0;
    }

    // What changes the model but is not implemented.
    if (r.present("hidden_act")) {
      const nlohmann::json& act = *r.find("hidden_act");
      if (!act.is_string() || act.get<std::string>() != "silu")
        c.fail("hidden_act = ", json_excerpt(act), " is not supported (Qwen3 uses \"silu\")");
    }
    r.take("hidden_act");
    if (r.bool_or("use_sliding_window", false))
      c.fail("use_sliding_window = true is not supported (slime's Qwen3 attention is full causal)");

    if (moe) {
      std::optional<int> a, b;
      if (r.present("num_experts")) a = r.int32("num_experts");
      if (r.present("num_local_experts")) b = r.int32("num_local_experts");
      r.take("num_experts");
      r.take("num_local_experts");
      if (a && b && *a != *b) c.fail("num_experts = ", *a, " and num_local_experts = ", *b, " disagree");
      const bool vl = c.is_vl_text();  // Qwen3VLMoeTextConfig's defaults differ from Qwen3MoeConfig's
      c.num_experts = a ? *a : b ? *b : (vl ? 60 : 128);
      c.num_experts_per_tok = r.int32_or("num_experts_per_tok", vl ? 4 : 8);
      c.moe_intermediate_size = r.int_or("moe_intermediate_size", vl ? 1408 : 768);
      // Qwen3-VL-MoE's router always renormalises its top-k probabilities
      // (Qwen3VLMoeTextTopKRouter; its config has no such field).
      c.norm_topk_prob = r.bool_or("norm_topk_prob", vl);
      if (vl && !c.norm_topk_prob)
        c.fail("norm_topk_prob = false, but Qwen3-VL-MoE always renormalises the top-k routing weights");
      c.decoder_sparse_step = r.int32_or("decoder_sparse_step", 1);
      c.router_aux_loss_coef = r.number_or("router_aux_loss_coef", 0.001);
      c.output_router_logits = r.bool_or("output_router_logits", false);
      if (r.present("mlp_only_layers")) {
        const nlohmann::json& l = *r.find("mlp_only_layers");
        if (!l.is_array()) c.fail("mlp_only_layers is not an array: ", json_excerpt(l));
        for (const auto& e : l) {
          if (!e.is_number_integer() || e.get<int64_t>() < INT32_MIN || e.get<int64_t>() > INT32_MAX)
            c.fail("mlp_only_layers = ", json_excerpt(l), " holds ", json_excerpt(e), ", which is not a layer index");
          c.mlp_only_layers.push_back(e.get<int>());
        }
      }
      r.take("mlp_only_layers");
    } else {
      // A dense model_type with experts is a contradiction, not a dense model.
      for (const char* key : {"num_experts", "num_local_experts"})
        if (const auto* e = r.find(key); e != nullptr && e->is_number() && e->get<double>() > 0)
          c.fail(key, " = ", json_excerpt(*e), " but model_type '", c.model_type, "' is dense (expected a MoE type)");
      c.num_experts = 0;
      c.num_experts_per_tok = 0;
      c.moe_intermediate_size = 0;
    }

    for (auto& [key, value] : j.items())
      if (!r.used.count(key)) c.extra[key] = value;
    c.validate();
    return c;
  }

  // Reads and validates a config.json file; errors name the file.
  static Qwen3Config from_file(const std::filesystem::path& path) {
    return from_json(detail::read_json_file(path), path.string());
  }

  // config.json as transformers' Qwen3Config / Qwen3MoeConfig expect it.
  nlohmann::json to_json() const {
    validate();
    nlohmann::json j = extra;
    const bool moe = is_moe_type();
    if (!is_vl_text()) j["architectures"] = {moe ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"};
    j["model_type"] = model_type;
    j["vocab_size"] = vocab_size;
    j["hidden_size"] = hidden_size;
    j["intermediate_size"] = intermediate_size;
    j["num_hidden_layers"] = num_hidden_layers;
    j["num_attention_heads"] = num_attention_heads;
    j["num_key_value_heads"] = num_key_value_heads;
    j["head_dim"] = head_dim;
    j["max_position_embeddings"] = max_position_embeddings;
    j["rms_norm_eps"] = rms_norm_eps;
    j["rope_theta"] = rope_theta;
    j["rope_parameters"] = {{"rope_theta", rope_theta}, {"rope_type", "default"}};
    if (uses_mrope()) {
      j["rope_parameters"]["mrope_section"] = mrope_section;
      j["rope_parameters"]["mrope_interleaved"] = true;
    }
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["torch_dtype"] = hf_dtype_name(torch_dtype);
    j["dtype"] = hf_dtype_name(torch_dtype);
    j["attention_bias"] = attention_bias;
    j["hidden_act"] = "silu";
    j["use_sliding_window"] = false;
    if (moe) {
      j["num_experts"] = num_experts;
      j["num_experts_per_tok"] = num_experts_per_tok;
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["norm_topk_prob"] = norm_topk_prob;
      j["decoder_sparse_step"] = decoder_sparse_step;
      j["mlp_only_layers"] = mlp_only_layers;
      j["router_aux_loss_coef"] = router_aux_loss_coef;
      j["output_router_logits"] = output_router_logits;
    }
    return j;
  }

 private:
  // Size limits of validate(): powers of two well above the largest released models (vocabularies
  // of about 2^18, widths of 2^15 to 2^16, under 2^8 layers, 2^9 experts).
  static constexpr int64_t kMaxVocabSize = int64_t(1) << 24;
  static constexpr int64_t kMaxWidth = int64_t(1) << 20;  // hidden and intermediate sizes
  static constexpr int64_t kMaxLayers = 4096;
  static constexpr int64_t kMaxHeads = 4096;
  static constexpr int64_t kMaxHeadDim = 4096;
  static constexpr int64_t kMaxPositions = int64_t(1) << 26;
  static constexpr int64_t kMaxExperts = 1 << 16;

  static constexpr const char* kModelTypes = "'qwen3', 'qwen3_moe', 'qwen3_vl_text' or 'qwen3_vl_moe_text'";
  static bool known_model_type(const std::string& t) {
    return t == "qwen3" || t == "qwen3_moe" || t == "qwen3_vl_text" || t == "qwen3_vl_moe_text";
  }

  static std::string_view hf_dtype_name(DType t) {
    switch (t) {
      case DType::f32:
        return "float32";
      case DType::bf16:
        return "bfloat16";
      case DType::f16:
        return "float16";
      case DType::i32:
        return "int32";
      case DType::i64:
        return "int64";
      case DType::u8:
        return "uint8";
    }
    return "?";
  }

  std::string where() const { return source.empty() ? std::string("Qwen3Config") : "config '" + source + "'"; }

  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    SLIME_FAIL(where(), ": ", args...);
  }

  template <class T>
  void positive(const char* field, T value) const {
    if (value <= 0) fail(field, " = ", value, " must be positive");
  }
  template <class T>
  void at_most(const char* field, T value, int64_t limit) const {
    if (int64_t(value) > limit) fail(field, " = ", value, " exceeds slime's limit of ", limit);
  }

  // Typed access to config.json fields that records which keys were used.
  struct Reader {
    const Qwen3Config& c;
    const nlohmann::json& j;
    std::set<std::string> used;

    const nlohmann::json* find(const char* key) const {
      auto it = j.find(key);
      return it == j.end() ? nullptr : &*it;
    }
    void take(const char* key) { used.insert(key); }
    // Present and not null.
    bool present(const char* key) const {
      const auto* v = find(key);
      return v != nullptr && !v->is_null();
    }
    int64_t integer(const char* key) {
      take(key);
      const nlohmann::json& v = *find(key);
      if (!v.is_number_integer()) c.fail(key, " = ", json_excerpt(v), " is not an integer");
      if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))
        c.fail(key, " = ", json_excerpt(v), " is too large");
      return v.get<int64_t>();
    }
    int int32(const char* key) {
      const int64_t v = integer(key);
      if (v < INT32_MIN || v > INT32_MAX) c.fail(key, " = ", v, " does not fit in a 32-bit int");
      return int(v);
    }
    int64_t required_int(const char* key) {
      if (!present(key)) c.fail("required field '", key, "' is missing");
      return integer(key);
    }
    int required_int32(const char* key) {
      if (!present(key)) c.fail("required field '", key, "' is missing");
      return int32(key);
    }
    int64_t int_or(const char* key, int64_t fallback) {
      take(key);
      return present(key) ? integer(key) : fallback;
    }
    int int32_or(const char* key, int fallback) {
      take(key);
      return present(key) ? int32(key) : fallback;
    }
    double number(const char* key) {
      take(key);
      const nlohmann::json& v = *find(key);
      if (!v.is_number()) c.fail(key, " = ", json_excerpt(v), " is not a number");
      return v.get<double>();
    }
    double number_or(const char* key, double fallback) {
      take(key);
      return present(key) ? number(key) : fallback;
    }
    bool bool_or(const char* key, bool fallback) {
      take(key);
      if (!present(key)) return fallback;
      const nlohmann::json& v = *find(key);
      if (!v.is_boolean()) c.fail(key, " = ", json_excerpt(v), " is not a boolean");
      return v.get<bool>();
    }
    std::optional<DType> dtype_field(const char* key) {
      take(key);
      if (!present(key)) return std::nullopt;
      const nlohmann::json& v = *find(key);
      if (!v.is_string()) c.fail(key, " = ", json_excerpt(v), " is not a string");
      std::string s = v.get<std::string>();
      if (s.starts_with("torch.")) s = s.substr(6);
      if (s != "float32" && s != "bfloat16" && s != "float16")
        c.fail(key, " = \"", v.get<std::string>(), "\" is not one of float32, bfloat16, float16");
      return parse_dtype(s);
    }
  };
};

}  // namespace slime::nn
