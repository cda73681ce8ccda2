// remote_rollout.hpp (qwen3_moe_rl example): disaggregated rollout, where the
// last --engine-ranks ranks of the world run rollout engines on their own
// devices and the others train.
//
//   world        all ranks: trainer ranks [0, T), engine ranks [T, W)
//   trainer comm the T trainer ranks (FSDP, expert parallelism)
//   sync comm    trainer rank 0 and the engine ranks: commands and weights
//
// Trainer rank 0 drives the engines with commands broadcast on the sync comm
// (two i64: what, value):
//   hello   value = the engines' max context (once, before anything else)
//   weights value = the weight version; rollout::send_weights follows
//   rollout every trainer rank t sends its requests to engine rank
//           T + t % G (rollout/remote.hpp) and receives its completions
//   stop    the engines return
// The engine's sampler keys every sample by (seed, sample_id), so with the
// same seed and weights the completions equal a colocated engine's.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"

namespace rl_example {

enum class EngineCommand : int64_t { stop = 0, hello = 1, weights = 2, rollout = 3 };

struct RemoteRollout {
  slime::comm::Comm* world = nullptr;
  slime::comm::Comm* sync = nullptr;  // trainer rank 0 and the engines (null on the other trainer ranks)
  int trainer_ranks = 0;
  int engine_ranks = 0;
  // The world rank of the engine serving trainer rank t.
  int engine_of(int t) const { return trainer_ranks + t % engine_ranks; }
};

// Broadcast on the sync comm from its rank 0 (trainer rank 0); returns what
// rank 0 sent.
inline std::pair<EngineCommand, int64_t> broadcast_command(slime::comm::Comm& sync, EngineCommand what, int64_t value,
                                                           slime::Device device) {
  slime::Tensor t = slime::Tensor::from_vector(std::vector<int64_t>{int64_t(what), value}, {2}, device);
  sync.broadcast(t, 0);
  const std::vector<int64_t> v = t.to_vector<int64_t>();
  return {EngineCommand(v[0]), v[1]};
}

}  // namespace rl_example
