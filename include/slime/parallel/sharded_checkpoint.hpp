// slime/parallel/sharded_checkpoint.hpp: the training state of a
// Sharded<Module, Strategy> (fp32 master parameters, AdamW moments and step
// count) as an io::train_state checkpoint that loads into any number of
// ranks, any strategy and any expert-parallel degree.
//
// What a checkpoint holds, per parameter P (its Hugging Face name; a stacked
// expert weight under its "{}" name), as element ranges of the full tensors:
//   P               the fp32 master value
//   P/<kind>        each of the optimizer's state tensors (its
//                   state_tensors() names "<kind>.<unit>", optim/optimizer.hpp):
//   P/exp_avg       AdamW's first moment
//   P/exp_avg_sq    AdamW's second moment
// and, in metadata.json, the caller's JSON plus "adamw_steps" (the
// optimizer's step count; the key is reserved). A frozen unit of a trained
// model (Sharded::unit_trainable false, e.g. a Qwen3-VL tower after
// set_vision_trainable(false)) has P only: no optimizer state exists for it.
// Its masters are still saved (rather than read back from the HF directory
// the run started from) so that a checkpoint alone restores the model, and a
// load checks them like any other tensor; the cost is 4 bytes per frozen
// parameter once per checkpoint. A model that freezes a unit it trained when
// saving (or the reverse) does not load: its tensors differ. A frozen Sharded (an
// optimizer that does not train) has no training state: it is refused at
// compile time (export its weights with gather_parameter). Expert stacks are saved in whole-stack
// coordinates: the full tensor is [E, ...] with E every expert of the model
// (nn::Parameter::stack_experts), and an ep rank's slice [E_local, ...] is
// the range starting at first_expert * (elements per expert). So the
// checkpoint does not depend on how the state was split.
//
// Write-once rule: every element of every tensor is written by exactly one
// rank. A rank writes its range of a unit's parameters only when it is the
// first of the ranks holding that same range (Sharded::unit_replicate_rank(u)
// == 0): NoShard replicas, HybridShard's dp_replicate groups and the dp
// replicas of an expert slice write once; under expert parallelism each ep
// rank is the only holder (with its replicate rank 0) of its slice, so the ep
// ranks tile every stack. (Not "rank 0 saves replicated tensors": under EP
// with NoShard rank 0 does not hold the other ranks' experts.)
// save_train_state checks the tiling over all ranks and fails on every rank
// otherwise.
//
// Loading reads only this rank's ranges (for an expert slice: its range of
// the whole stack), checks first that the checkpoint holds every parameter of
// the model with matching shapes (and nothing else) and only then changes
// the state, so a load refused for those reasons leaves the model as it was.
//
// Conditions: call both at a step boundary (after optimizer_step, before the
// next micro-batch: gradients are not saved) with the Sharded onloaded
// (runtime offload keeps the moments in private buffers: onload() first; a
// clear error says so). ShardedOptions::cpu_offload works (masters and
// moments on the host). Both synchronise the host with the device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/error.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/module.hpp"
#include "slime/parallel/sharded.hpp"

namespace slime::parallel {

// The tensor names of a parameter's moments in a checkpoint.
inline std::string exp_avg_name(const std::string& parameter) { return parameter + "/exp_avg"; }
inline std::string exp_avg_sq_name(const std::string& parameter) { return parameter + "/exp_avg_sq"; }

// The metadata key of AdamW's step count.
inline constexpr const char* kAdamWStepsKey = "adamw_steps";

namespace detail {

// One parameter's piece on this rank, in checkpoint coordinates.
struct ShardedStatePiece {
  std::string name;
  Shape full_shape;            // the checkpoint's shape (an expert stack: the whole stack)
  int64_t begin = 0, end = 0;  // this rank's range of the flattened full_shape
  int64_t local_begin = 0;     // where it starts in the parameter (an expert slice: in the slice)
  Tensor master;               // [end - begin] view into the rank's master shard
  std::vector<std::pair<std::string, Tensor>> state;  // (checkpoint name, [end - begin] view): the optimizer's
  bool writes = false;                                // this rank writes the range (write-once rule)
};

// E of every expert stack of the module (name -> stack_experts), where the
// module exposes its nn::Parameters.
template <class S>
std::map<std::string, int64_t> expert_stack_sizes(S& sh) {
  std::map<std::string, int64_t> sizes;
  if constexpr (requires { sh.module().for_each_parameter([](nn::Parameter&) {}); }) {
    sh.module().for_each_parameter([&](nn::Parameter& p) {
      if (p.is_expert_stack() && p.stack_experts > 0) sizes[p.name] = p.stack_experts;
    });
  }
  return sizes;
}

// Every parameter piece this rank holds, in unit order.
template <class S>
std::vector<ShardedStatePiece> sharded_state_pieces(S& sh, const char* where) {
  using Optimizer = std::remove_reference_t<decltype(sh.optimizer())>;
  static_assert(Optimizer::trains,
                "sharded checkpoints hold training state; a frozen Sharded has none (export its "
                "weights with gather_parameter)");
  constexpr std::size_t k = Optimizer::state_per_param;
  SLIME_CHECK(!sh.offloaded(), where, ": Sharded is offloaded: call onload() first (the AdamW moments are in ",
              "offload buffers)");
  const std::vector<std::pair<std::string, Tensor>> moments = sh.optimizer().state_tensors();
  std::size_t trainable = 0;
  for (std::size_t u = 0; u < sh.num_units(); ++u) trainable += sh.unit_trainable(u) ? 1 : 0;
  SLIME_CHECK(moments.size() == k * trainable, where, ": the optimizer holds ", moments.size(), " state tensors for ",
              trainable, " trainable sharding units (expected ", k, " per unit)");
  // "<kind>.<unit>" -> "<kind>"
  std::vector<std::string> kinds;
  for (std::size_t j = 0; j < k && j < moments.size(); ++j) {
    const std::string& n = moments[j].first;
    kinds.push_back(n.substr(0, n.rfind('.')));
  }
  const std::map<std::string, int64_t> stacks = expert_stack_sizes(sh);
  std::vector<ShardedStatePiece> pieces;
  sh.for_each_local_shard([&](const LocalShard& s) {
    ShardedStatePiece p;
    p.name = s.name;
    p.full_shape = s.shape;
    p.begin = s.begin;
    p.end = s.end;
    p.local_begin = s.begin;
    p.master = s.master;
    if (s.expert) {
      SLIME_CHECK(s.shape.rank() >= 1 && s.shape[0] > 0, where, ": expert stack '", s.name, "' has shape ", s.shape);
      const auto it = stacks.find(s.name);
      SLIME_CHECK(it != stacks.end(), where, ": expert stack '", s.name,
                  "' does not say how many experts the whole stack has (nn::Parameter::stack_experts)");
      const int64_t experts = it->second, local = s.shape[0];
      SLIME_CHECK(s.first_expert >= 0 && s.first_expert + local <= experts, where, ": expert stack '", s.name,
                  "' holds experts [", s.first_expert, ", ", s.first_expert + local, ") of ", experts);
      const int64_t at = s.first_expert * (s.shape.numel() / local);
      std::vector<int64_t> dims(s.shape.begin(), s.shape.end());
      dims[0] = experts;
      p.full_shape = Shape(std::span<const int64_t>(dims));
      p.begin += at;
      p.end += at;
    }
    pieces.push_back(std::move(p));
  });
  // The same order: unit by unit, entry by entry. The moments are laid out as
  // the master shard ([shard_numel] per unit).
  // A frozen unit (Sharded::unit_trainable) has no state: its pieces are
  // masters only, and the t-th trainable unit's state is entries [k t, k t + k).
  std::size_t i = 0, t = 0;
  for (std::size_t u = 0; u < sh.num_units(); ++u) {
    const bool writes = sh.unit_replicate_rank(u) == 0;
    const bool trains = sh.unit_trainable(u);
    for (const FlatShardEntry& e : sh.unit_layout(u).entries()) {
      SLIME_CHECK(i < pieces.size() && pieces[i].name == e.name, where, ": parameter order mismatch at '", e.name, "'");
      ShardedStatePiece& p = pieces[i++];
      const Shape n{p.end - p.begin};
      if (trains)
        for (std::size_t j = 0; j < k; ++j)
          p.state.emplace_back(p.name + "/" + kinds[j], moments[k * t + j].second.view(e.shard_offset, n));
      p.writes = writes;
    }
    if (trains) ++t;
  }
  SLIME_CHECK(i == pieces.size(), where, ": ", pieces.size(), " local shards but ", i, " layout entries");
  return pieces;
}

}  // namespace detail

// Saves sh's training state as step `step` of the checkpoint directory `dir`
// (io::save_train_state: atomic, `latest` updated, options.keep_last
// pruning). Collective over `world`, the whole world communicator: every rank
// holding part of the state (all of the mesh's ranks) calls it with the same
// dir and step. `metadata` (a JSON object, taken from rank 0) is stored with
// "adamw_steps" added (null: an empty object). Requires sh onloaded; at a step boundary.
template <class S>
void save_sharded_state(S& sh, comm::Comm& world, const std::filesystem::path& dir, int64_t step,
                        nlohmann::json metadata, const io::TrainStateSaveOptions& options = {}) {
  const char* where = "save_sharded_state";
  if (metadata.is_null()) metadata = nlohmann::json::object();
  SLIME_CHECK(metadata.is_object(), where, ": metadata must be a JSON object, got a JSON ", metadata.type_name());
  std::vector<io::TensorPiece> out;
  for (detail::ShardedStatePiece& p : detail::sharded_state_pieces(sh, where)) {
    if (!p.writes) continue;
    out.push_back({p.name, p.full_shape, p.begin, p.end, p.master});
    for (const auto& [name, t] : p.state) out.push_back({name, p.full_shape, p.begin, p.end, t});
  }
  metadata[kAdamWStepsKey] = sh.optimizer().step_count();
  synchronize_device(sh.device());  // the last optimizer step done, on whatever stream it ran
  io::save_train_state(world, dir, step, out, metadata, options);
}

// Loads the newest checkpoint of `dir` (the step `dir/latest` names) into
// sh, whatever the rank count, strategy and expert-parallel degree that saved
// it; returns its metadata (the caller's JSON with "adamw_steps") with "step"
// set to its step and "run_id" to its run id. Local: each rank reads its own ranges (no communication).
// Throws, before changing anything, when there is no checkpoint or it is not
// one of this model (a parameter missing, a shape or dtype that differs, a
// tensor this model does not have). A read that fails after those checks (an
// unreadable or truncated rank file) can leave the state partly loaded: load
// again, or from another checkpoint. Requires sh onloaded.
template <class S>
nlohmann::json load_sharded_state(S& sh, const std::filesystem::path& dir) {
  const std::string where = "load_sharded_state('" + dir.string() + "')";
  const io::TrainStateReader reader = io::TrainStateReader::open_latest(dir);
  const std::string at = where + ", step " + std::to_string(reader.step());
  const std::vector<detail::ShardedStatePiece> pieces = detail::sharded_state_pieces(sh, where.c_str());

  // 1. The checkpoint holds exactly this model's tensors, shapes and dtypes.
  std::set<std::string> expected;
  for (const detail::ShardedStatePiece& p : pieces) {
    std::vector<std::string> names = {p.name};
    for (const auto& st : p.state) names.push_back(st.first);
    for (const std::string& name : names) {
      expected.insert(name);
      SLIME_CHECK(reader.contains(name), at, ": the checkpoint has no tensor '", name, "' (it holds ",
                  reader.names().size(), " tensors: not a checkpoint of this model, or not of a Sharded state)");
      SLIME_CHECK(reader.shape(name) == p.full_shape, at, ": tensor '", name, "' was saved with shape ",
                  reader.shape(name), " but this model's is ", p.full_shape,
                  " (expert stacks: the whole stack; a checkpoint of another model?)");
      SLIME_CHECK(reader.dtype(name) == DType::f32, at, ": tensor '", name, "' was saved as ",
                  dtype_name(reader.dtype(name)), "; the master parameters and moments are f32");
    }
  }
  for (const std::string& name : reader.names())
    SLIME_CHECK(expected.count(name) == 1, at, ": the checkpoint holds tensor '", name,
                "' that this model does not have (a checkpoint of another model?)");
  const nlohmann::json& meta = reader.metadata();
  SLIME_CHECK(meta.is_object() && meta.contains(kAdamWStepsKey) && meta.at(kAdamWStepsKey).is_number_integer(), at,
              ": the metadata has no integer \"", kAdamWStepsKey, "\" (AdamW's step count)");
  const int64_t adamw_steps = meta.at(kAdamWStepsKey).get<int64_t>();
  SLIME_CHECK(adamw_steps >= 0, at, ": negative \"", kAdamWStepsKey, "\" ", adamw_steps);

  // 2. This rank's ranges.
  const Device device = sh.device();
  synchronize_device(device);  // no queued work still reads or writes the moments
  for (const detail::ShardedStatePiece& p : pieces) {
    const int64_t n = p.end - p.begin;
    // The master through load_parameter, which refreshes the compute copy
    // (bf16 on GPUs) as well: a parameter-shaped temporary of which only
    // this rank's range is read and used.
    const Shape& shape = sh.parameter_shape(p.name);
    if (n == 0) continue;  // only padding rows here: nothing to read
    Tensor full = Tensor::empty(shape, DType::f32, device);
    Tensor mine = full.reshape(Shape{shape.numel()}).view(p.local_begin, Shape{n});
    reader.read_range(p.name, p.begin, p.end, mine);
    sh.load_parameter(p.name, full);
    for (const auto& [state_name, view] : p.state) {
      Tensor t = view;  // a view: reading into it fills the optimizer's state
      reader.read_range(state_name, p.begin, p.end, t);
    }
  }
  sh.optimizer().set_step_count(adamw_steps);
  synchronize_device(device);
  nlohmann::json out = meta;
  out["step"] = reader.step();
  // The run id to pass on to the next saves (TrainStateSaveOptions::run_id):
  // one run keeps one id across resumes. Empty for a version 1 checkpoint.
  out["run_id"] = reader.run_id();
  return out;
}

}  // namespace slime::parallel
