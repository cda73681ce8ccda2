// The README's "The pieces, composed" block, compiled as written: CMake copies
// the block into readme_snippet.inc (tests/docs/CMakeLists.txt) and this file
// gives it the names it takes from its surroundings. Built, not run (it needs
// a checkpoint); a change of the API that the README does not follow breaks
// the build.
#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/data/packer.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/lr_schedule.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/rl/advantages.hpp"
#include "slime/rl/importance_sampler.hpp"
#include "slime/rl/policy_loss.hpp"
#include "slime/rl/reference_model.hpp"
#include "slime/rollout/engine.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace readme {

using namespace slime;

// The example's pack phase (examples/qwen3_moe_rl/trainer.hpp), as the
// snippet names it: prompt + response samples, and one micro-batch's inputs.
std::vector<data::Sample> to_samples(const std::vector<rollout::Request>& requests,
                                     const std::vector<rollout::Completion>& done, const Tensor& advantages);
struct LossInputs {
  nn::PackedBatch batch;
  Tensor targets, advantages, loss_mask, rollout_lp, cu_seqlens;  // [T] each; cu_seqlens on the host
};
LossInputs loss_inputs(const data::MicroBatch& mb, std::span<const data::Sample> samples, Device device);
std::vector<float> reward_fn(const std::vector<rollout::Completion>& done);

void grpo_step(const std::filesystem::path& dir, Device device, comm::Comm& comm,
               const std::vector<rollout::Request>& requests, int64_t group_size, const rl::LossNormalizer& global_norm,
               int64_t step) {
#include "readme_snippet.inc"
}

}  // namespace readme
