// checkpoint.hpp (sft_qwen3 example): the training state of a
// Sharded<Qwen3Model, Strategy> as a slime train_state checkpoint
// (slime/io/train_state.hpp), and the Hugging Face export of its weights.
//
// What a checkpoint holds, per parameter P (HF name), as this rank's flat
// element range [begin, end) of the full tensor:
//   P               the fp32 master value
//   P/exp_avg       AdamW's first moment
//   P/exp_avg_sq    AdamW's second moment
// and, in metadata.json, the caller's JSON (step, data position, ...) and
// AdamW's step count. Pieces are ranges of the full tensors, so a checkpoint
// loads into any number of ranks and any strategy (each rank reads only its
// own range). Replicated tensors (NoShard) are saved by rank 0 only.
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

namespace sft {

namespace detail {

// f(name, master, exp_avg, exp_avg_sq, shape, begin, end) for every parameter
// piece this rank holds: views into the master shard and the AdamW moments.
template <class ShardedModel, class F>
void for_each_state_piece(ShardedModel& sh, F&& f) {
  const std::vector<std::pair<std::string, slime::Tensor>> moments = sh.optimizer().state_tensors();
  SLIME_CHECK(moments.size() == 2 * sh.num_units(), "checkpoint: the optimizer holds ", moments.size(),
              " moment tensors for ", sh.num_units(), " sharding units");
  std::vector<slime::Tensor> masters;  // unit order, as the loop below
  sh.for_each_local_shard([&](const slime::parallel::LocalShard& s) { masters.push_back(s.master); });
  const int r = sh.shard_rank();
  std::size_t i = 0;
  for (std::size_t u = 0; u < sh.num_units(); ++u)
    for (const slime::parallel::FlatShardEntry& e : sh.unit_layout(u).entries()) {
      const int64_t begin = e.begin(r), end = e.end(r);
      const slime::Shape piece{end - begin};
      // The moments are laid out as the master shard: [shard_numel] per unit.
      f(e.name, masters[i++], moments[2 * u].second.view(e.shard_offset, piece),
        moments[2 * u + 1].second.view(e.shard_offset, piece), e.shape, begin, end);
    }
}

}  // namespace detail

// Saves the state as step `step` of `dir` (collective over `comm`, the
// communicator the model is sharded over). `metadata` (a JSON object) is
// stored as given, plus "adamw_steps".
template <class ShardedModel>
void save_checkpoint(ShardedModel& sh, slime::comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                     nlohmann::json metadata, int keep_last) {
  std::vector<slime::io::TensorPiece> pieces;
  // Replicated parameters (a shard group of one rank) tile from rank 0 alone.
  const bool saves = sh.shard_world() > 1 || comm.rank() == 0;
  if (saves)
    detail::for_each_state_piece(
        sh, [&](const std::string& name, const slime::Tensor& master, const slime::Tensor& exp_avg,
                const slime::Tensor& exp_avg_sq, const slime::Shape& shape, int64_t begin, int64_t end) {
          pieces.push_back({name, shape, begin, end, master});
          pieces.push_back({name + "/exp_avg", shape, begin, end, exp_avg});
          pieces.push_back({name + "/exp_avg_sq", shape, begin, end, exp_avg_sq});
        });
  metadata["adamw_steps"] = sh.optimizer().step_count();
  slime::io::TrainStateSaveOptions options;
  options.keep_last = keep_last;
  slime::io::save_train_state(comm, dir, step, pieces, metadata, options);
}

// Loads the newest checkpoint of `dir` into `sh` (every rank reads its own
// ranges) and returns its metadata. Throws when there is none.
template <class ShardedModel>
nlohmann::json load_checkpoint(ShardedModel& sh, const std::filesystem::path& dir) {
  const slime::io::TrainStateReader reader = slime::io::TrainStateReader::open_latest(dir);
  const slime::Device device = sh.device();
  // Parameters through load_parameter (one full tensor at a time): it also
  // refreshes the compute-dtype copy (bf16 on GPUs) of the master.
  for (const std::string& name : sh.parameter_names()) {
    const slime::Shape shape = reader.shape(name);
    const slime::Tensor full = reader.read_range(name, 0, shape.numel(), device);
    sh.load_parameter(name, full.reshape(shape));
  }
  detail::for_each_state_piece(
      sh, [&](const std::string& name, const slime::Tensor&, const slime::Tensor& exp_avg,
              const slime::Tensor& exp_avg_sq, const slime::Shape&, int64_t begin, int64_t end) {
        slime::Tensor m = exp_avg, v = exp_avg_sq;  // views: reading into them fills the optimizer's state
        reader.read_range(name + "/exp_avg", begin, end, m);
        reader.read_range(name + "/exp_avg_sq", begin, end, v);
      });
  const nlohmann::json& meta = reader.metadata();
  SLIME_CHECK(meta.contains("adamw_steps"), "checkpoint '", reader.path().string(), "' has no \"adamw_steps\"");
  sh.optimizer().set_step_count(meta.at("adamw_steps").get<int64_t>());
  nlohmann::json out = meta;
  out["step"] = reader.step();
  return out;
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
