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

#include <algorithm>
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
#include "slime/ops/elementwise.hpp"

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

// How a checkpoint stores a MoE layer's experts.
//   per_expert: one tensor per expert and projection (Qwen3-MoE on the hub):
//     <layer>.mlp.experts.<e>.{gate,up,down}_proj.weight  [out, in]
//   fused: two stacks per layer (Qwen3-VL-MoE), in either of two layouts:
//     transformers 5 (what it writes, and what save_hf_vl writes):
//       <layer>.mlp.experts.gate_up_proj  [E, 2·I, hidden]  (gate = rows [0, I), up = rows [I, 2I))
//       <layer>.mlp.experts.down_proj     [E, hidden, I]
//     the hub's released checkpoints: the transposes of dims 1 and 2.
//   A file whose shape is transformers 5's is read as that, any other shape
//   that is its transpose as the hub's (transformers' own rule, so a square
//   stack means the same in both).
enum class ExpertLayout : uint8_t { per_expert, fused };

namespace detail {

// Where a stacked expert parameter lives in a fused checkpoint: the fused
// tensor's name, and which half of gate_up_proj (0 gate, 1 up; -1 down_proj).
struct FusedExpertSlot {
  std::string name;
  int half = -1;
};
inline FusedExpertSlot fused_expert_slot(const Parameter& p) {
  const std::size_t at = p.name.find(".experts.{}.");
  SLIME_CHECK(at != std::string::npos, "fused_expert_slot: '", p.name, "' is not an expert stack");
  const std::string base = p.name.substr(0, at) + ".experts.";
  const std::string proj = p.name.substr(at + std::string(".experts.{}.").size());
  if (proj == "gate_proj.weight") return {base + "gate_up_proj", 0};
  if (proj == "up_proj.weight") return {base + "gate_up_proj", 1};
  SLIME_CHECK(proj == "down_proj.weight", "fused_expert_slot: unknown expert projection '", p.name, "'");
  return {base + "down_proj", -1};
}

// transformers 5's shape of the fused tensor holding stack p ([E_local, out,
// in]) for E experts, and the hub's (its transpose).
inline std::vector<int64_t> fused_expert_dims(const Parameter& p, int64_t experts, bool hub = false) {
  const int64_t out = p.value.size(1) * (fused_expert_slot(p).half >= 0 ? 2 : 1), in = p.value.size(2);
  return hub ? std::vector<int64_t>{experts, in, out} : std::vector<int64_t>{experts, out, in};
}

// Reads stack p's experts [first_expert, first_expert + E_local) from the
// fused tensor `fused` (f32 on the host, either layout) into p.value.
inline void read_fused_experts(const Tensor& fused, Parameter& p, int64_t experts) {
  const FusedExpertSlot slot = fused_expert_slot(p);
  const bool hub = std::vector<int64_t>(fused.shape().begin(), fused.shape().end()) != fused_expert_dims(p, experts);
  const int64_t n = p.value.size(0), out = p.value.size(1), in = p.value.size(2);
  const int64_t rows = fused.size(1), cols = fused.size(2), offset = slot.half > 0 ? out : 0;
  const float* src = fused.data<float>();
  std::vector<float> dst(std::size_t(n * out * in));
  for (int64_t i = 0; i < n; ++i) {
    const float* e = src + (p.first_expert + i) * rows * cols;
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k)
        dst[std::size_t((i * out + o) * in + k)] = hub ? e[k * cols + offset + o] : e[(offset + o) * cols + k];
  }
  Tensor host = Tensor::from_vector(dst, p.value.shape());
  if (p.value.dtype() != DType::f32) {
    Tensor cast = Tensor::empty(p.value.shape(), p.value.dtype());
    ops::cast(host, cast);
    host = cast;
  }
  p.value.copy_from(host);
}

// A layer's fused tensors in transformers 5's layout from its three stacks
// (every expert held): gate_up_proj [E, 2·I, hidden] and down_proj [E,
// hidden, I], in the stacks' dtype, on the host.
inline std::vector<std::pair<std::string, Tensor>> fuse_experts(Parameter& gate, Parameter& up, Parameter& down) {
  const int64_t E = gate.value.size(0), I = gate.value.size(1), H = gate.value.size(2);
  const DType dtype = gate.value.dtype();
  Tensor gate_up = Tensor::empty({E, 2 * I, H}, dtype);
  const Tensor g = gate.value.to(Device::cpu()), u = up.value.to(Device::cpu());
  for (int64_t e = 0; e < E; ++e) {
    gate_up.slice_rows(e, 1).reshape({2 * I, H}).slice_rows(0, I).copy_from(g.slice_rows(e, 1).reshape({I, H}));
    gate_up.slice_rows(e, 1).reshape({2 * I, H}).slice_rows(I, I).copy_from(u.slice_rows(e, 1).reshape({I, H}));
  }
  return {{fused_expert_slot(gate).name, gate_up}, {fused_expert_slot(down).name, down.value.to(Device::cpu())}};
}

}  // namespace detail

// Loads the tensors of the Hugging Face checkpoint in `files` into `model`'s
// parameters (converting to the model's dtype, round to nearest even); no
// config.json is read (load_hf reads it). Stacked expert parameters read only
// their experts [first_expert, first_expert + E_local), in `layout`. Tensors
// whose name starts with one of `foreign_prefixes` belong to another part of
// the checkpoint (a VLM's vision tower) and are skipped. Throws slime::Error
// naming `where`, the file and the tensor for: missing parameters (any
// expert of the config included), unexpected tensors (other than
// rotary_emb.inv_freq buffers, and lm_head.weight of a tied model, which
// transformers ignores too), and shape mismatches.
inline void load_hf_weights(Qwen3Model& model, const io::SafetensorsDir& files, const std::string& where,
                            ExpertLayout layout = ExpertLayout::per_expert,
                            const std::vector<std::string>& foreign_prefixes = {}) {
  const Qwen3Config& config = model.config();
  std::set<std::string> expected;
  std::vector<std::string> missing;
  std::vector<std::string> bad_shape;
  const auto check = [&](const std::string& name, const std::vector<int64_t>& want) {
    if (!expected.insert(name).second) return;  // a fused tensor serves two stacks
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
    SLIME_CHECK(p.value.dim() == 3 && p.first_expert >= 0 && p.first_expert + p.value.size(0) <= config.num_experts,
                where, ": stacked expert parameter '", p.name, "' ", p.value.str(), " with first_expert ",
                p.first_expert, " does not fit num_experts = ", config.num_experts);
    if (layout == ExpertLayout::fused) {
      const std::string name = detail::fused_expert_slot(p).name;
      const std::vector<int64_t> hub = detail::fused_expert_dims(p, config.num_experts, true);
      if (files.contains(name) && files.info(name).dims == hub) {
        expected.insert(name);  // the hub's layout
        return;
      }
      check(name, detail::fused_expert_dims(p, config.num_experts));
      return;
    }
    for (int64_t e = 0; e < config.num_experts; ++e)
      check(p.expert_name(e - p.first_expert), detail::expert_dims(p.value));  // expert e, held or not
  });
  std::vector<std::string> unexpected;
  for (const std::string& name : files.names()) {
    if (expected.count(name) || detail::is_ignored_checkpoint_tensor(name)) continue;
    if (config.tie_word_embeddings && name == "lm_head.weight") continue;
    if (std::any_of(foreign_prefixes.begin(), foreign_prefixes.end(),
                    [&](const std::string& f) { return name.starts_with(f); }))
      continue;
    unexpected.push_back(name);
  }
  SLIME_CHECK(missing.empty(), where, ": ", missing.size(),
              " parameter(s) missing from the checkpoint: ", detail::join_names(missing));
  SLIME_CHECK(unexpected.empty(), where, ": ", unexpected.size(), " unexpected tensor(s) in the checkpoint (not ",
              "parameters of a ", config.is_moe() ? "Qwen3-MoE" : "dense Qwen3",
              " model with this config): ", detail::join_names(unexpected));
  SLIME_CHECK(bad_shape.empty(), where, ": ", bad_shape.size(),
              " tensor(s) with the wrong shape: ", detail::join_names(bad_shape));
  std::string fused_name;  // the fused tensor last read: gate and up come from one gate_up_proj
  Tensor fused;
  model.for_each_parameter([&](Parameter& p) {
    if (!p.is_expert_stack()) {
      files.read_into(p.name, p.value);
      return;
    }
    if (layout == ExpertLayout::fused) {
      const std::string name = detail::fused_expert_slot(p).name;
      if (name != fused_name) {
        fused = files.file_of(name).read(name, DType::f32);
        fused_name = name;
      }
      detail::read_fused_experts(fused, p, config.num_experts);
      return;
    }
    for (int64_t i = 0; i < p.value.size(0); ++i) {
      Tensor entry = detail::expert_entry(p.value, i);
      files.read_into(p.expert_name(i), entry);
    }
  });
}

// The same from the directory `dir` (model.safetensors or a sharded index).
inline void load_hf_weights(Qwen3Model& model, const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  SLIME_CHECK(fs::is_directory(dir, ec), "load_hf: checkpoint directory '", dir.string(), "' does not exist");
  load_hf_weights(model, io::SafetensorsDir(dir), "load_hf('" + dir.string() + "')");
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
