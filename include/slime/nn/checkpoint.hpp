// slime/nn/checkpoint.hpp: Hugging Face checkpoint directories <-> Qwen3Model:
// load_hf reads config.json and the safetensors (single file or sharded) into
// a model on any device and dtype; save_hf writes a directory that
// transformers' Qwen3ForCausalLM.from_pretrained loads.
#pragma once

#include <filesystem>
#include <map>
#include <set>
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

inline std::string dims_str(const std::vector<int64_t>& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + (dims.size() == 1 ? ",)" : ")");
}

}  // namespace detail

// Loads the Hugging Face checkpoint in `dir` (config.json plus
// model.safetensors or a sharded index) as a dense Qwen3 model on `device`,
// converting every tensor to `dtype` (round to nearest even). Throws
// slime::Error naming the directory, file and tensor for: a missing or
// unreadable config, a MoE config, missing parameters, unexpected tensors
// (other than rotary_emb.inv_freq buffers, and lm_head.weight of a tied
// model, which transformers ignores too), and shape mismatches.
inline Qwen3Model load_hf(const std::filesystem::path& dir, Device device = Device::cpu(), DType dtype = DType::f32) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf: checkpoint directory '", dir.string(), "' does not exist");
  const Qwen3Config config = Qwen3Config::from_file(dir / "config.json");
  Qwen3Model model(config, {device, dtype});
  const io::SafetensorsDir files(dir);

  std::set<std::string> expected;
  std::vector<std::string> missing;
  std::vector<std::string> bad_shape;
  model.for_each_parameter([&](Parameter& p) {
    expected.insert(p.name);
    if (!files.contains(p.name)) {
      missing.push_back(p.name);
      return;
    }
    const io::SafetensorsTensorInfo& info = files.info(p.name);
    const std::vector<int64_t> want(p.value.shape().begin(), p.value.shape().end());
    if (info.dims != want)
      bad_shape.push_back(p.name + " (file '" + files.file_of(p.name).path().string() + "' has " +
                          detail::dims_str(info.dims) + ", the config implies " + p.value.shape().str() + ")");
  });
  std::vector<std::string> unexpected;
  for (const std::string& name : files.names()) {
    if (expected.count(name) || detail::is_ignored_checkpoint_tensor(name)) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    unexpected.push_back(name);
  }
  const std::string where = "load_hf('" + dir.string() + "')";
  SLIME_CHECK(missing.empty(), where, ": ", missing.size(),
              " parameter(s) missing from the checkpoint: ", detail::join_names(missing));
  SLIME_CHECK(unexpected.empty(), where, ": ", unexpected.size(),
              " unexpected tensor(s) in the checkpoint (not parameters of a dense Qwen3 model with this config): ",
              detail::join_names(unexpected));
  SLIME_CHECK(bad_shape.empty(), where, ": ", bad_shape.size(),
              " tensor(s) with the wrong shape: ", detail::join_names(bad_shape));
  model.for_each_parameter([&](Parameter& p) { files.read_into(p.name, p.value); });
  return model;
}

// Writes `model` as a Hugging Face checkpoint into `dir` (created if needed):
// model.safetensors (or shards above max_shard_bytes) in the model's dtype,
// then config.json (torch_dtype set to the model's dtype), each written
// atomically (temporary file, fsync, rename).
inline void save_hf(Qwen3Model& model, const std::filesystem::path& dir,
                    uint64_t max_shard_bytes = io::kDefaultMaxShardBytes) {
  std::vector<std::pair<std::string, Tensor>> tensors;
  model.for_each_parameter([&](Parameter& p) { tensors.emplace_back(p.name, p.value); });
  io::write_safetensors_dir(dir, tensors, max_shard_bytes);
  Qwen3Config config = model.config();
  config.torch_dtype = model.dtype();
  io::detail::write_file_atomically(dir / "config.json", config.to_json().dump(2) + "\n");
}

}  // namespace slime::nn
