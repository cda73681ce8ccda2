// checkpoint.hpp (sft_qwen3 example): the training state of a
// Sharded<Qwen3Model, Strategy> as a slime train_state checkpoint. (The
// Hugging Face export is the library's parallel::save_hf.)
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

#include <nlohmann/json.hpp>

#include "slime/comm/comm.hpp"
#include "slime/io/train_state.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"

namespace sft {

// Saves the state as step `step` of `dir` (collective over `comm`, the
// world the model is sharded over), keeping the keep_last newest checkpoints
// (0: all). `metadata` (a JSON object) is stored as given, plus "adamw_steps".
// `run_id`: the run id of the checkpoint this run resumed from (empty: this
// process's), so that a run keeps one id across resumes.
template <class ShardedModel>
void save_checkpoint(ShardedModel& sh, slime::comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                     nlohmann::json metadata, int keep_last, const std::string& run_id) {
  slime::io::TrainStateSaveOptions options;
  options.keep_last = keep_last;
  options.run_id = run_id;
  slime::parallel::save_sharded_state(sh, comm, dir, step, std::move(metadata), options);
}

// Loads the newest checkpoint of `dir` into `sh` (every rank reads its own
// ranges) and returns its metadata, with "step" and "run_id". Throws when there is none.
template <class ShardedModel>
nlohmann::json load_checkpoint(ShardedModel& sh, const std::filesystem::path& dir) {
  return slime::parallel::load_sharded_state(sh, dir);
}

}  // namespace sft
