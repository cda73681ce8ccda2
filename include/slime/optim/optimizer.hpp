// slime/optim/optimizer.hpp: ShardOptimizer, what a data-parallel wrapper
// (parallel::Sharded) needs from the optimizer of its local shards, and
// NoOptimizer, the optimizer of a frozen model (no state, no step).
//
// An optimizer O works on a fixed list of parameter tensors (a rank's master
// shards, one per sharding unit) and owns their state:
//   O::Config                 what the caller passes to build one (O(Config))
//   O::trains                 whether it updates the parameters: a wrapper
//                             with trains == false keeps no gradients at all
//   O::state_per_param        k: state tensors per parameter tensor
//   init_state(params, s)     allocates the state of `params` (zeros) when it
//                             has none, else checks it matches them
//   step(params, grads, lr, grad_scale, copies, s, device_grad_scale)
//                             one update (ordered on s for device tensors;
//                             host tensors run the CPU reference, which rounds
//                             as the device kernel does); copies: empty or one
//                             tensor per param written from the updated value;
//                             device_grad_scale: undefined, or an f32 [1] on the
//                             params' device multiplying grad_scale there (the
//                             clip factor), whose non-finite value skips the update
//   state_tensors()           k * params.size() (name, tensor) handles sharing
//                             the state's storage, entries [k i, k i + k)
//                             those of params[i], each shaped as params[i];
//                             the name is "<kind>.<i>" (a checkpoint stores
//                             params[i]'s state under its name + "/<kind>").
//                             Empty before init_state and after release_state
//   release_state()           drops the state tensors (their memory goes),
//                             keeping the config and the step count; the next
//                             init_state allocates zeros again (runtime
//                             offload copies the saved state into them)
//   step_count(), set_step_count(n)
//                             updates taken so far (checkpoints)
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

namespace slime::optim {

template <class O>
concept ShardOptimizer = std::constructible_from<O, typename O::Config> &&
    std::default_initializable<typename O::Config> && std::movable<O> &&
    requires(O& o, const O& co, std::span<const Tensor> ts, const Stream& s, double lr, float scale, int64_t n) {
  { O::trains } -> std::convertible_to<bool>;
  { O::state_per_param } -> std::convertible_to<std::size_t>;
  o.init_state(ts, s);
  o.step(ts, ts, lr, scale, ts, s);
  o.step(ts, ts, lr, scale, ts, s, Tensor{});
  { o.state_tensors() } -> std::same_as<std::vector<std::pair<std::string, Tensor>>>;
  o.release_state();
  { co.step_count() } -> std::convertible_to<int64_t>;
  o.set_step_count(n);
};

// The optimizer of a frozen model (a reference or teacher model): it trains
// nothing, holds no state and takes no step; a Sharded with it keeps no
// gradient buffers (see parallel::Frozen).
class NoOptimizer {
 public:
  struct Config {};
  static constexpr bool trains = false;
  static constexpr std::size_t state_per_param = 0;

  NoOptimizer() = default;
  explicit NoOptimizer(Config) {}

  void init_state(std::span<const Tensor>, const Stream& = {}) {}
  void step(std::span<const Tensor>, std::span<const Tensor>, double, float = 1.f, std::span<const Tensor> = {},
            const Stream& = {}, const Tensor& = {}) {
    SLIME_FAIL("NoOptimizer::step: the model is frozen (optim::NoOptimizer): it takes no optimizer step");
  }
  std::vector<std::pair<std::string, Tensor>> state_tensors() { return {}; }
  void release_state() {}
  int64_t step_count() const { return 0; }
  void set_step_count(int64_t steps) {
    SLIME_CHECK(steps == 0, "NoOptimizer::set_step_count: the model is frozen (optim::NoOptimizer) and takes no ",
                "steps, got a step count of ", steps);
  }
  const Config& config() const { return cfg_; }

 private:
  Config cfg_;
};
static_assert(ShardOptimizer<NoOptimizer>);

}  // namespace slime::optim
