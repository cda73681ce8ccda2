// engine_server.hpp (qwen3_moe_rl example): what an engine rank runs under
// --rollout disaggregated (see remote_rollout.hpp for the protocol): a
// rollout::Engine on its own device whose weights arrive from trainer rank 0
// by rollout::receive_weights after every optimizer step, and which answers
// the requests of its trainer ranks until trainer rank 0 says stop.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "options.hpp"
#include "remote_rollout.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/remote.hpp"
#include "slime/rollout/weight_sync.hpp"
#include "trainer.hpp"

namespace rl_example {

inline void serve_rollouts(const Options& o, const RemoteRollout& remote, slime::Device device) {
  using namespace slime;
  const DType dtype = device.is_cuda() ? DType::bf16 : DType::f32;  // as the trainer's compute dtype
  nn::Qwen3Model model(model_config(o), {device, dtype});           // filled by the first weight sync
  std::unique_ptr<rollout::Engine> engine;
  std::vector<int> trainers;  // the trainer ranks this engine serves
  for (int t = 0; t < remote.trainer_ranks; ++t)
    if (remote.engine_of(t) == remote.world->rank()) trainers.push_back(t);
  for (;;) {
    const auto [what, value] = broadcast_command(*remote.sync, EngineCommand::stop, 0, device);
    if (what == EngineCommand::stop) return;
    if (what == EngineCommand::hello) {
      engine = std::make_unique<rollout::Engine>(model, engine_config(o, value));
      continue;
    }
    SLIME_CHECK(engine != nullptr, "engine rank ", remote.world->rank(), ": command ", int64_t(what), " before hello");
    if (what == EngineCommand::weights) {
      rollout::receive_weights(*remote.sync, 0, *engine);
      SLIME_CHECK(engine->weight_version() == value, "engine rank ", remote.world->rank(), ": received version ",
                  engine->weight_version(), ", announced ", value);
      continue;
    }
    SLIME_CHECK(what == EngineCommand::rollout, "engine rank ", remote.world->rank(), ": unknown command ",
                int64_t(what));
    // Every served trainer's requests in one batch (continuous batching).
    std::vector<rollout::Request> all;
    std::vector<std::size_t> counts;
    for (int t : trainers) {
      std::vector<rollout::Request> mine = rollout::recv_requests(*remote.world, t, device);
      counts.push_back(mine.size());
      for (auto& q : mine) all.push_back(std::move(q));
    }
    std::vector<rollout::Completion> done = engine->generate(all);
    std::size_t at = 0;
    for (std::size_t i = 0; i < trainers.size(); ++i) {
      const std::vector<rollout::Completion> part(done.begin() + std::ptrdiff_t(at),
                                                  done.begin() + std::ptrdiff_t(at + counts[i]));
      rollout::send_completions(*remote.world, trainers[i], part, device);
      at += counts[i];
    }
  }
}

}  // namespace rl_example
