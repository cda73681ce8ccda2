// slime/nn/vision_config.hpp: Qwen3VLVisionConfig, the architecture of the
// Qwen3-VL vision tower, read from the "vision_config" object of a Hugging
// Face Qwen3-VL config.json (transformers' Qwen3VLVisionConfig).
//
// Absent or null fields take transformers' defaults:
//   depth 27, hidden_size 1152, intermediate_size 4304, num_heads 16,
//   in_channels 3, patch_size 16, temporal_patch_size 2, spatial_merge_size 2,
//   out_hidden_size 3584, num_position_embeddings 2304,
//   deepstack_visual_indexes [8, 16, 24], hidden_act "gelu_pytorch_tanh",
//   rope_parameters {"rope_type": "axial", "rope_theta": 10000}.
// What slime does not implement is an error naming the field: hidden_act
// other than "gelu_pytorch_tanh", a rope_type other than "axial". Invalid
// values too: a head_dim (hidden_size / num_heads) not divisible by 4 (the
// 2-D rotary), a num_position_embeddings that is not a square (the learned
// grid is side x side), deepstack indexes outside [0, depth) or repeated.
// Keys not interpreted here (initializer_range, model_type, ...) are ignored.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/nn/config.hpp"

namespace slime::nn {

struct Qwen3VLVisionConfig {
  int depth = 27;
  int64_t hidden_size = 1152;
  int64_t intermediate_size = 4304;
  int num_heads = 16;
  int64_t in_channels = 3;
  int64_t patch_size = 16;
  int64_t temporal_patch_size = 2;
  int64_t spatial_merge_size = 2;
  int64_t out_hidden_size = 3584;
  int64_t num_position_embeddings = 2304;
  std::vector<int> deepstack_visual_indexes = {8, 16, 24};
  double rope_theta = 10000.0;
  double layer_norm_eps = 1e-6;  // fixed in transformers (nn.LayerNorm(eps=1e-6))
  std::string source;            // where it came from, named in errors

  int64_t head_dim() const { return hidden_size / num_heads; }
  // C·T·p·p: the width of a row of pixel_values.
  int64_t patch_dim() const { return in_channels * temporal_patch_size * patch_size * patch_size; }
  // Side of the learned square position grid.
  int64_t grid_side() const { return int64_t(std::llround(std::sqrt(double(num_position_embeddings)))); }
  int64_t merge_unit() const { return spatial_merge_size * spatial_merge_size; }

  void validate() const {
    positive("depth", depth);
    positive("hidden_size", hidden_size);
    positive("intermediate_size", intermediate_size);
    positive("num_heads", num_heads);
    positive("in_channels", in_channels);
    positive("patch_size", patch_size);
    positive("temporal_patch_size", temporal_patch_size);
    positive("spatial_merge_size", spatial_merge_size);
    positive("out_hidden_size", out_hidden_size);
    positive("num_position_embeddings", num_position_embeddings);
    // Upper bounds far above any released tower, so that an absurd size is an error naming its
    // field here rather than a failed allocation later.
    at_most("depth", depth, 4096);
    at_most("hidden_size", hidden_size, int64_t(1) << 20);
    at_most("intermediate_size", intermediate_size, int64_t(1) << 20);
    at_most("num_heads", num_heads, 4096);
    at_most("in_channels", in_channels, 64);
    at_most("patch_size", patch_size, 1024);
    at_most("temporal_patch_size", temporal_patch_size, 1024);
    at_most("spatial_merge_size", spatial_merge_size, 64);
    at_most("out_hidden_size", out_hidden_size, int64_t(1) << 20);
    at_most("num_position_embeddings", num_position_embeddings, int64_t(1) << 24);
    if (hidden_size % num_heads != 0)
      fail("hidden_size = ", hidden_size, " is not a multiple of num_heads = ", num_heads);
    if (head_dim() % 4 != 0)
      fail("head_dim = hidden_size / num_heads = ", head_dim(), " must be divisible by 4 (the 2-D vision rotary)");
    if (grid_side() * grid_side() != num_position_embeddings)
      fail("num_position_embeddings = ", num_position_embeddings, " is not a square (the learned grid is side x side)");
    std::vector<int> seen;
    for (int i : deepstack_visual_indexes) {
      if (i < 0 || i >= depth) fail("deepstack_visual_indexes holds ", i, ", outside [0, depth = ", depth, ")");
      if (std::find(seen.begin(), seen.end(), i) != seen.end()) fail("deepstack_visual_indexes repeats ", i);
      seen.push_back(i);
    }
    if (!(std::isfinite(rope_theta) && rope_theta > 0))
      fail("rope_parameters.rope_theta = ", rope_theta, " must be > 0");
  }

  // Parses `j`: the vision_config object, or a whole Qwen3-VL config.json
  // (then its "vision_config"). Validates.
  static Qwen3VLVisionConfig from_json(const nlohmann::json& j, std::string source = {}) {
    Qwen3VLVisionConfig c;
    c.source = std::move(source);
    if (!j.is_object()) c.fail("config is not a JSON object (it is a JSON ", j.type_name(), ")");
    const nlohmann::json* v = &j;
    if (auto it = j.find("vision_config"); it != j.end()) {
      if (!it->is_object()) c.fail("vision_config is not an object: ", json_excerpt(*it));
      v = &*it;
    } else if (j.contains("text_config")) {
      c.fail("a Qwen3-VL config without a vision_config object");
    }
    const auto integer = [&](const char* key, auto& out) {
      auto it = v->find(key);
      if (it == v->end() || it->is_null()) return;
      if (!it->is_number_integer()) c.fail("vision_config.", key, " = ", json_excerpt(*it), " is not an integer");
      const int64_t x = it->get<int64_t>();
      if (x < INT32_MIN || x > INT32_MAX) c.fail("vision_config.", key, " = ", x, " is out of range");
      out = static_cast<std::remove_reference_t<decltype(out)>>(x);
    };
    integer("depth", c.depth);
    integer("hidden_size", c.hidden_size);
    integer("intermediate_size", c.intermediate_size);
    integer("num_heads", c.num_heads);
    integer("in_channels", c.in_channels);
    integer("patch_size", c.patch_size);
    integer("temporal_patch_size", c.temporal_patch_size);
    integer("spatial_merge_size", c.spatial_merge_size);
    integer("out_hidden_size", c.out_hidden_size);
    integer("num_position_embeddings", c.num_position_embeddings);
    if (auto it = v->find("deepstack_visual_indexes"); it != v->end() && !it->is_null()) {
      if (!it->is_array()) c.fail("vision_config.deepstack_visual_indexes is not an array: ", json_excerpt(*it));
      c.deepstack_visual_indexes.clear();
      for (const auto& e : *it) {
        if (!e.is_number_integer() || e.get<int64_t>() < INT32_MIN || e.get<int64_t>() > INT32_MAX)
          c.fail("vision_config.deepstack_visual_indexes = ", json_excerpt(*it), " holds ", json_excerpt(e),
                 ", which is not a block index");
        c.deepstack_visual_indexes.push_back(e.get<int>());
      }
    }
    if (auto it = v->find("hidden_act"); it != v->end() && !it->is_null()) {
      if (!it->is_string() || it->get<std::string>() != "gelu_pytorch_tanh")
        c.fail("vision_config.hidden_act = ", json_excerpt(*it),
               " is not supported (the Qwen3-VL vision MLP is \"gelu_pytorch_tanh\")");
    }
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      auto it = v->find(key);
      if (it == v->end() || it->is_null()) continue;
      if (!it->is_object()) c.fail("vision_config.", key, " is not an object: ", json_excerpt(*it));
      if (auto t = it->find("rope_type"); t != it->end() && !(t->is_string() && t->get<std::string>() == "axial"))
        c.fail("vision_config.", key, ".rope_type = ", json_excerpt(*t),
               " is not supported (the vision rotary is \"axial\")");
      if (auto t = it->find("rope_theta"); t != it->end()) {
        if (!t->is_number()) c.fail("vision_config.", key, ".rope_theta = ", json_excerpt(*t), " is not a number");
        c.rope_theta = t->get<double>();
      }
    }
    c.validate();
    return c;
  }

  // Reads a config.json (the Qwen3-VL one, or a bare vision config); errors name the file.
  static Qwen3VLVisionConfig from_file(const std::filesystem::path& path) {
    return from_json(detail::read_json_file(path), path.string());
  }

  // The vision_config object as transformers writes it; `model_type` is the
  // whole model's ("qwen3_vl" or "qwen3_vl_moe").
  nlohmann::json to_json(const std::string& model_type = "qwen3_vl") const {
    validate();
    return {{"model_type", model_type + "_vision"},
            {"depth", depth},
            {"hidden_size", hidden_size},
            {"intermediate_size", intermediate_size},
            {"num_heads", num_heads},
            {"in_channels", in_channels},
            {"patch_size", patch_size},
            {"temporal_patch_size", temporal_patch_size},
            {"spatial_merge_size", spatial_merge_size},
            {"out_hidden_size", out_hidden_size},
            {"num_position_embeddings", num_position_embeddings},
            {"deepstack_visual_indexes", deepstack_visual_indexes},
            {"hidden_act", "gelu_pytorch_tanh"},
            {"rope_parameters", {{"rope_type", "axial"}, {"rope_theta", rope_theta}}}};
  }

 private:
  std::string where() const {
    return source.empty() ? std::string("Qwen3VLVisionConfig") : "config '" + source + "' (vision_config)";
  }

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
};

}  // namespace slime::nn
