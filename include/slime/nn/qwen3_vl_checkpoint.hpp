// slime/nn/qwen3_vl_checkpoint.hpp: Hugging Face Qwen3-VL / Qwen3-VL-MoE
// checkpoint directories <-> Qwen3VLModel: load_hf_vl reads config.json and
// the safetensors (single file or sharded index) into a model on any device
// and dtype; save_hf_vl writes a directory that transformers'
// Qwen3VLForConditionalGeneration / Qwen3VLMoeForConditionalGeneration
// .from_pretrained loads. The tower's tensors are "model.visual.*", the
// language model's "model.language_model.*" and "lm_head.weight"; the MoE
// experts are stored fused (nn::ExpertLayout::fused), as the hub's
// Qwen3-VL-MoE checkpoints and transformers store them.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3_vl.hpp"

namespace slime::nn {

// Loads every parameter of `model` from the checkpoint directory `dir`
// (config.json is not read). Throws naming the directory and tensor for a
// missing parameter, an unexpected tensor or a wrong shape.
inline void load_hf_vl_weights(Qwen3VLModel& model, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf_vl: checkpoint directory '", dir.string(), "' does not exist");
  model.visual().load_hf_weights(dir);
  load_hf_weights(model.language(), io::SafetensorsDir(dir), "load_hf_vl('" + dir.string() + "')", ExpertLayout::fused,
                  {model.visual().prefix() + "."});
}

// Loads the Qwen3-VL checkpoint in `dir` on `device` in `dtype`;
// `dispatcher` as for Qwen3Model (this rank's experts are what it loads).
inline Qwen3VLModel load_hf_vl(const std::filesystem::path& dir, Device device = Device::cpu(),
                               DType dtype = DType::f32, DispatcherRef dispatcher = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf_vl: checkpoint directory '", dir.string(), "' does not exist");
  Qwen3VLModel model(Qwen3VLConfig::from_file(dir / "config.json"), {device, dtype}, dispatcher);
  load_hf_vl_weights(model, dir);
  return model;
}

// Writes `model` (every expert held) as a Hugging Face directory: the
// safetensors (shards above max_shard_bytes) in the model's dtype, then
// config.json, each atomically.
inline void save_hf_vl(Qwen3VLModel& model, const std::filesystem::path& dir,
                       uint64_t max_shard_bytes = io::kDefaultMaxShardBytes) {
  const int64_t experts = model.language_config().num_experts;
  std::vector<std::pair<std::string, Tensor>> tensors;
  model.visual().for_each_parameter([&](Parameter& p) {
    if (&p == &model.visual().patch_embed().weight) {
      const Qwen3VLVisionConfig& v = model.config().vision;
      tensors.emplace_back(p.name, p.value.reshape({v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size,
                                                    v.patch_size}));  // the Conv3d's shape
    } else {
      tensors.emplace_back(p.name, p.value);
    }
  });
  std::vector<Parameter*> stack;  // one layer's gate, up, down
  model.language().for_each_parameter([&](Parameter& p) {
    if (!p.is_expert_stack()) {
      tensors.emplace_back(p.name, p.value);
      return;
    }
    SLIME_CHECK(p.first_expert == 0 && p.value.size(0) == experts, "save_hf_vl('", dir.string(), "'): parameter '",
                p.name, "' holds experts [", p.first_expert, ", ", p.first_expert + p.value.size(0), ") of ", experts,
                "; save_hf_vl writes whole checkpoints (gather the experts of an expert-parallel model first)");
    stack.push_back(&p);
    if (stack.size() < 3) return;
    for (auto& t : detail::fuse_experts(*stack[0], *stack[1], *stack[2])) tensors.push_back(std::move(t));
    stack.clear();
  });
  SLIME_CHECK(stack.empty(), "save_hf_vl: an expert layer without gate, up and down stacks");
  io::write_safetensors_dir(dir, tensors, max_shard_bytes);
  Qwen3VLConfig config = model.config();
  config.text.torch_dtype = model.dtype();
  io::detail::write_file_atomically(dir / "config.json", config.to_json().dump(2) + "\n");
}

}  // namespace slime::nn
