// checkpoint.hpp (sft_qwen3 example): the training state of a
// Sharded<Qwen3Model, Strategy> as a slime train_state checkpoint, and the
// Hugging Face export of its weights.
//
// The checkpoint is the library's (slime/parallel/sharded_checkpoint.hpp):
// per parameter P (HF name) the fp32 master P and AdamW's P/exp_avg and
// P/exp_avg_sq as element ranges of the full tensors, each element written by
// exactly one rank (replicas write once), and in metadata.json the caller's
// JSON (step, data position, ...) plus AdamW's step count ("adamw_steps"). A
// checkpoint loads into any number of ranks and any strategy (each rank reads
// only its own ranges).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/comm/comm.hpp"
#include "slime/io/safetensors_writer.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/config.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"

namespace sft {

// Saves the state as step `step` of `dir` (collective over `comm`, the
// world the model is sharded over), keeping the keep_last newest checkpoints
// (0: all). `metadata` (a JSON object) is stored as given, plus "adamw_steps".
template <class ShardedModel>
void save_checkpoint(ShardedModel& sh, slime::comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                     nlohmann::json metadata, int keep_last) {
  slime::io::TrainStateSaveOptions options;
  options.keep_last = keep_last;
  slime::parallel::save_sharded_state(sh, comm, dir, step, std::move(metadata), options);
}

// Loads the newest checkpoint of `dir` into `sh` (every rank reads its own
// ranges) and returns its metadata, with "step". Throws when there is none.
template <class ShardedModel>
nlohmann::json load_checkpoint(ShardedModel& sh, const std::filesystem::path& dir) {
  return slime::parallel::load_sharded_state(sh, dir);
}

// Writes the model as a Hugging Face directory (config.json + safetensors,
// fp32 master weights). Collective: every rank gathers each parameter in turn
// (one full tensor at a time); rank 0 writes. Stacked expert weights (MoE)
// are written as one tensor per expert, as the hub's checkpoints name them.
template <class ShardedModel>
void export_hf(ShardedModel& sh, slime::comm::Comm& comm, const std::filesystem::path& dir,
               slime::nn::Qwen3Config config) {
  struct Item {
    std::string param;    // Sharded's parameter name
    int64_t expert = -1;  // entry of a stacked expert weight, or -1
  };
  std::vector<slime::io::SafetensorsEntry> entries;
  std::vector<Item> items;
  for (std::size_t u = 0; u < sh.num_units(); ++u)
    for (const slime::parallel::FlatShardEntry& e : sh.unit_layout(u).entries()) {
      const std::size_t at = e.name.find("{}");
      if (at == std::string::npos) {
        entries.push_back({e.name, slime::DType::f32, e.shape});
        items.push_back({e.name});
        continue;
      }
      const std::vector<int64_t> dims(e.shape.begin() + 1, e.shape.end());
      for (int64_t i = 0; i < e.shape[0]; ++i) {
        entries.push_back({e.name.substr(0, at) + std::to_string(i) + e.name.substr(at + 2), slime::DType::f32,
                           slime::Shape(std::span<const int64_t>(dims))});
        items.push_back({e.name, i});
      }
    }
  // Gathers each parameter once (expert entries of one stack share it).
  std::string held_name;
  slime::Tensor held;
  std::size_t next = 0;
  auto produce = [&](const slime::io::SafetensorsEntry& entry) -> slime::Tensor {
    const Item& item = items[next++];
    if (item.param != held_name) {
      held = slime::Tensor{};
      held = sh.gather_parameter(item.param);
      held_name = item.param;
    }
    if (item.expert < 0) return held;
    return held.slice_rows(item.expert, 1).reshape(entry.shape);
  };
  if (comm.rank() == 0) {
    config.torch_dtype = slime::DType::f32;
    slime::io::export_hf_directory(dir, config.to_json(), entries, produce);
  } else {
    for (const slime::io::SafetensorsEntry& e : entries) produce(e);
  }
}

}  // namespace sft
