// slime/parallel/export_hf.hpp: save_hf, the Hugging Face export of a sharded
// (and expert-parallel) Qwen3 / Qwen3-MoE model: config.json and the weights
// under HF's names, one tensor per expert, written atomically (a temporary
// directory renamed into place, io::export_hf_directory).
//
//   parallel::save_hf(policy, comm, policy.module().config(), "out/hf",
//                     {.dtype = DType::bf16, .ep = &ep});
//
// Collective over `comm` (the world the model is sharded over): every rank
// gathers each parameter in turn (Sharded::gather_parameter, one full tensor
// at a time), expert stacks also over the ep group
// (ExpertParallel::gather_expert_stack); rank 0 writes. At most one gathered
// parameter is alive at a time, so the export never holds the whole model.
// Works while the model is offloaded (gather_parameter reads the host masters).
//
// A Qwen3-VL(-MoE) model (nn::Qwen3VLModel, its tower frozen or not):
// gather_vl_model gathers it the same way into one unsharded model on rank 0
// (CPU, every expert), and save_hf_vl writes that with nn::save_hf_vl (the
// tower's Conv3d shape and the fused experts of transformers' layout). Rank 0
// then holds the whole model once, in the export dtype.
//
//   parallel::save_hf_vl(policy, comm, "out/hf", {.dtype = DType::bf16, .ep = &ep});
#pragma once

#include <optional>
#include <unordered_map>

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/safetensors_writer.hpp"
#include "slime/nn/config.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"

namespace slime::parallel {

struct SaveHfOptions {
  // The stored dtype of every tensor (and config.json's torch_dtype); the
  // fp32 master values are cast to it.
  DType dtype = DType::f32;
  // The ExpertParallel the model's experts are split by (its stacks are
  // gathered over its group); null when the model has none.
  const ExpertParallel<>* ep = nullptr;
  // Shard size, extra files, safetensors metadata.
  io::HfExportOptions files = {};
};

namespace detail {

// HF name of entry `expert` of a stacked expert weight ("...experts.{}.up_proj.weight").
inline std::string expert_entry_name(std::string_view stack_name, int64_t expert) {
  const std::size_t at = stack_name.find("{}");
  return std::string(stack_name.substr(0, at)) + std::to_string(expert) + std::string(stack_name.substr(at + 2));
}

}  // namespace detail

// Writes `model` as the Hugging Face directory `dir` (see the top of the
// file). `config` is the model's architecture (the module's config();
// torch_dtype is set to options.dtype). Collective over `comm`.
template <class Module, ShardingStrategy Strategy>
void save_hf(Sharded<Module, Strategy>& model, comm::Comm& comm, nn::Qwen3Config config,
             const std::filesystem::path& dir, const SaveHfOptions& options = {}) {
  // The whole value of parameter `name` (every expert of a stack).
  auto whole = [&](const std::string& name) {
    Tensor t = model.gather_parameter(name);
    if (options.ep != nullptr && model.is_expert_parameter(name)) t = options.ep->gather_expert_stack(t);
    return t;
  };
  const std::vector<std::string> names = model.parameter_names();
  if (comm.rank() != 0) {
    for (const std::string& name : names) (void)whole(name);  // the gathers are collective
    return;
  }
  struct Item {
    std::size_t param;    // index into names
    int64_t expert = -1;  // entry of a stacked expert weight, or -1
  };
  std::vector<io::SafetensorsEntry> entries;
  std::vector<Item> items;
  for (std::size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const Shape& shape = model.parameter_shape(name);
    if (name.find("{}") == std::string::npos) {
      entries.push_back({name, options.dtype, shape});
      items.push_back({i});
      continue;
    }
    // A stack [E_local, ...] on this rank; the export holds all E experts.
    const int64_t experts =
        options.ep != nullptr && model.is_expert_parameter(name) ? options.ep->num_experts() : shape[0];
    const std::vector<int64_t> dims(shape.begin() + 1, shape.end());
    for (int64_t e = 0; e < experts; ++e) {
      entries.push_back({detail::expert_entry_name(name, e), options.dtype, Shape(std::span<const int64_t>(dims))});
      items.push_back({i, e});
    }
  }
  // Each parameter is gathered once (the entries of one stack share it).
  std::size_t held = names.size(), next = 0;
  Tensor full;
  auto produce = [&](const io::SafetensorsEntry& entry) -> Tensor {
    const Item& item = items[next++];
    if (item.param != held) {
      full = Tensor{};
      full = whole(names[item.param]);
      held = item.param;
    }
    const Tensor t = item.expert < 0 ? full : full.slice_rows(item.expert, 1).reshape(entry.shape);
    if (t.dtype() == options.dtype) return t;
    Tensor out = Tensor::empty(t.shape(), options.dtype, t.device());
    ops::cast(t, out);
    return out;
  };
  config.torch_dtype = options.dtype;
  io::export_hf_directory(dir, config.to_json(), entries, produce, options.files);
}

// The whole of a sharded Qwen3-VL model as an unsharded nn::Qwen3VLModel on
// rank 0 of `comm` (on the CPU, in options.dtype, every expert: no
// dispatcher), std::nullopt on the other ranks (options.files is not used).
// Collective over `comm`, as save_hf.
template <ShardingStrategy Strategy, optim::ShardOptimizer Optimizer>
std::optional<nn::Qwen3VLModel> gather_vl_model(Sharded<nn::Qwen3VLModel, Strategy, Optimizer>& model, comm::Comm& comm,
                                                const SaveHfOptions& options = {}) {
  std::optional<nn::Qwen3VLModel> full;
  std::unordered_map<std::string, nn::Parameter*> by_name;
  if (comm.rank() == 0) {
    full.emplace(model.module().config(), nn::ModuleOptions{Device::cpu(), options.dtype});
    full->for_each_parameter([&](nn::Parameter& p) { by_name.emplace(p.name, &p); });
  }
  for (const std::string& name : model.parameter_names()) {
    Tensor t = model.gather_parameter(name);  // collective: every rank, every name
    if (options.ep != nullptr && model.is_expert_parameter(name)) t = options.ep->gather_expert_stack(t);
    if (comm.rank() != 0) continue;
    const auto it = by_name.find(name);
    SLIME_CHECK(it != by_name.end(), "gather_vl_model: the sharded model's parameter '", name,
                "' is not a parameter of its config's Qwen3VLModel");
    nn::Parameter& p = *it->second;
    SLIME_CHECK(t.shape() == p.value.shape(), "gather_vl_model: parameter '", name, "' gathers to shape ", t.shape(),
                " but the whole model's is ", p.value.shape(),
                p.is_expert_stack() ? " (an expert stack under expert parallelism: pass options.ep)" : "");
    const Tensor host = t.to(Device::cpu());
    if (host.dtype() == p.value.dtype()) {
      p.value.copy_from(host);
    } else {
      ops::cast(host, p.value);
    }
    by_name.erase(it);
  }
  if (comm.rank() == 0)
    SLIME_CHECK(by_name.empty(), "gather_vl_model: ", by_name.size(), " parameter(s) of the whole model, e.g. '",
                by_name.empty() ? std::string() : by_name.begin()->first, "', are not in the sharded model");
  return full;
}

// Writes a sharded Qwen3-VL model as the Hugging Face directory `dir`
// (gather_vl_model, then nn::save_hf_vl on rank 0, its shards above
// options.files.max_shard_bytes; its metadata and copy_files are not
// written). Collective over `comm`.
template <ShardingStrategy Strategy, optim::ShardOptimizer Optimizer>
void save_hf_vl(Sharded<nn::Qwen3VLModel, Strategy, Optimizer>& model, comm::Comm& comm,
                const std::filesystem::path& dir, const SaveHfOptions& options = {}) {
  std::optional<nn::Qwen3VLModel> full = gather_vl_model(model, comm, options);
  if (full) nn::save_hf_vl(*full, dir, options.files.max_shard_bytes);
}

}  // namespace slime::parallel
