// slime/nn/checkpoint.hpp: Hugging Face checkpoint directories <-> Qwen3Model
// (dense and MoE): load_hf reads config.json and the safetensors (single file
// or sharded) into a model on any device and dtype; save_hf writes a
// directory that transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM
// .from_pretrained loads.
//
// Experts: a stacked expert Parameter (name with "{}", value [E_local, ...],
// see module.hpp) maps to one HF tensor per expert, named as the hub's
// Qwen3-MoE checkpoints name them ("model.layers.L.mlp.experts.e.up_proj.weight",
// [out, in]): stack entry i is expert first_expert + i. Loading reads only the
// experts the model holds (a rank of an expert-parallel model its slice), but
// checks that the checkpoint has every expert of the config, so that every
// rank accepts or rejects the same directory.
#pragma once

#include <filesystem>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/nn/config.hpp"
#include "slime/nn/qwen3.hpp"

namespace slime::nn {

namespace detail {

// Non-persistent buffers some exporters still write (older transformers saved
// the RoPE inverse frequencies): not parameters, skipped on load.
inline bool is_ignored_checkpoint_tensor(std::string_view name) { return name.ends_with("rotary_emb.inv_freq"); }

inline std::string join_names(const std::vector<std::string>& names, std::size_t most = 20) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", ... (" + std::to_string(names.size() - most) + " more)";
  return out;
}

// Shape of one entry of a stacked expert parameter (the value without dim 0).
inline std::vector<int64_t> expert_dims(const Tensor& stack) {
  return std::vector<int64_t>(stack.shape().begin() + 1, stack.shape().end());
}

// Entry i of a stacked expert parameter, as a view of shape expert_dims.
inline Tensor expert_entry(const Tensor& stack, int64_t i) {
  const std::vector<int64_t> dims = expert_dims(stack);
  return stack.slice_rows(i, 1).reshape(Shape(std::span<const int64_t>(dims)));
}

inline std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

}  // namespace detail

// Loads the tensors of the Hugging Face checkpoint in `dir` into `model`'s
// parameters (converting to the model's dtype, round to nearest even); the
// directory's config.json is not read (load_hf reads it). Stacked expert parameters read only their experts
// [first_expert, first_expert + E_local). Throws slime::Error naming the directory, file and tensor for: missing
// parameters (any expert of the config included), unexpected tensors (other than rotary_emb.inv_freq buffers, and
// lm_head.weight of a tied model, which transformers ignores too), and shape
// mismatches.
inline void load_hf_weights(Qwen3Model& model, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf: checkpoint directory '", dir.string(), "' does not exist");
  const std::string where = "load_hf('" + dir.string() + "')";
  const Qwen3Config& config = model.config();
  const io::SafetensorsDir files(dir);

  std::set<std::string> expected;
  std::vector<std::string> missing;
  std::vector<std::string> bad_shape;
  const auto check = [&](const std::string& name, const std::vector<int64_t>& want) {
    expected.insert(name);
    if (!files.contains(name)) {
      missing.push_back(name);
      return;
    }
    const io::SafetensorsTensorInfo& info = files.info(name);
    if (info.dims != want)
      bad_shape.push_back(name + " (file '" + files.file_of(name).path().string() + "' has " +
                          detail::dims_str(info.dims) + ", the config implies " + detail::dims_str(want) + ")");
  };
  model.for_each_parameter([&](Parameter& p) {
    if (!p.is_expert_stack()) {
      check(p.name, std::vector<int64_t>(p.value.shape().begin(), p.value.shape().end()));
      return;
    }
    SLIME_CHECK(p.value.dim() >= 2 && p.first_expert >= 0 && p.first_expert + p.value.size(0) <= config.num_experts,
                where, ": stacked expert parameter '", p.name, "' ", p.value.str(), " with first_expert ",
                p.first_expert, " does not fit num_experts = ", config.num_experts);
    for (int64_t e = 0; e < config.num_experts; ++e)
      check(p.expert_name(e - p.first_expert), detail::expert_dims(p.value));  // expert e, held or not
  });
  std::vector<std::string> unexpected;
  for (const std::string& name : files.names()) {
    if (expected.count(name) || detail::is_ignored_checkpoint_tensor(name)) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    unexpected.push_back(name);
  }
  SLIME_CHECK(missing.empty(), where, ": ", missing.size(),
              " parameter(s) missing from the checkpoint: ", detail::join_names(missing));
  SLIME_CHECK(unexpected.empty(), where, ": ", unexpected.size(), " unexpected tensor(s) in the checkpoint (not ",
              "parameters of a ", config.is_moe() ? "Qwen3-MoE" : "dense Qwen3",
              " model with this config): ", detail::join_names(unexpected));
  SLIME_CHECK(bad_shape.empty(), where, ": ", bad_shape.size(),
              " tensor(s) with the wrong shape: ", detail::join_names(bad_shape));
  model.for_each_parameter([&](Parameter& p) {
    if (!p.is_expert_stack()) {
      files.read_into(p.name, p.value);
      return;
    }
    for (int64_t i = 0; i < p.value.size(0); ++i) {
      Tensor entry = detail::expert_entry(p.value, i);
      files.read_into(p.expert_name(i), entry);
    }
  });
}

// Loads the Hugging Face checkpoint in `dir` (config.json plus
// model.safetensors or a sharded index) as a Qwen3 or Qwen3-MoE model on
// `device`, converting every tensor to `dtype`. `dispatcher` (optional, e.g.
// a parallel::ExpertParallel) is passed to the model (its experts' slice is
// what this rank loads). Throws
// slime::Error for a missing or unreadable config, and as load_hf_weights.
inline Qwen3Model load_hf(const std::filesystem::path& dir, Device device = Device::cpu(), DType dtype = DType::f32,
                          DispatcherRef dispatcher = {}) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf: checkpoint directory '", dir.string(), "' does not exist");
  Qwen3Model model(Qwen3Config::from_file(dir / "config.json"), {device, dtype}, dispatcher);
  load_hf_weights(model, dir);
  return model;
}

// Writes `model` as a Hugging Face checkpoint into `dir` (created if needed):
// model.safetensors (or shards above max_shard_bytes) in the model's dtype,
// one tensor per expert for stacked expert parameters, then config.json
// (torch_dtype set to the model's dtype), each written atomically (temporary
// file, fsync, rename). The model must hold every expert: an
// expert-parallel rank holds a slice, and writing it alone would give a
// checkpoint that is missing the others (gather them first).
inline void save_hf(Qwen3Model& model, const std::filesystem::path& dir,
                    uint64_t max_shard_bytes = io::kDefaultMaxShardBytes) {
  const int64_t experts = model.config().num_experts;
  std::vector<std::pair<std::string, Tensor>> tensors;
  model.for_each_parameter([&](Parameter& p) {
    if (!p.is_expert_stack()) {
      tensors.emplace_back(p.name, p.value);
      return;
    }
    SLIME_CHECK(p.first_expert == 0 && p.value.size(0) == experts, "save_hf('", dir.string(), "'): parameter '", p.name,
                "' holds experts [", p.first_expert, ", ", p.first_expert + p.value.size(0), ") of ", experts,
                "; save_hf writes whole checkpoints (gather the experts of an expert-parallel model first)");
    for (int64_t i = 0; i < p.value.size(0); ++i)
      tensors.emplace_back(p.expert_name(i), detail::expert_entry(p.value, i));
  });
  io::write_safetensors_dir(dir, tensors, max_shard_bytes);
  Qwen3Config config = model.config();
  config.torch_dtype = model.dtype();
  io::detail::write_file_atomically(dir / "config.json", config.to_json().dump(2) + "\n");
}

}  // namespace slime::nn
