// slime/parallel/sharding_strategy.hpp: the FSDP strategies as tag types
// (FullShard, ShardGradOp, NoShard, HybridShard), the mixed-precision policy
// and the options of Sharded<Module, Strategy>.
#pragma once

#include <cstdint>
#include <optional>
#include <type_traits>

#include "slime/comm/comm.hpp"
#include "slime/core/dtype.hpp"

namespace slime::parallel {

// Every strategy says whether parameters are sharded over the shard group,
// whether gradients are also all-reduced over a replica group, and when a
// unit's gathered parameters are released.
//   shards:                 parameters, gradients and optimizer states are
//                           split over the shard group (else replicated).
//   replicates:             a replica group exists: gradients are all-reduced
//                           over it after the reduce-scatter.
//   reshard_after_forward:  a unit's gathered parameters are released after
//                           its forward (gathered again for its backward).
//   reshard_after_backward: released after its backward.

// ZeRO-3: reshard after forward, gather again in backward (least memory).
struct FullShard {
  static constexpr bool shards = true, replicates = false;
  static constexpr bool reshard_after_forward = true, reshard_after_backward = true;
};
// ZeRO-2: keep the gathered parameters from forward until the unit's
// backward (one all-gather per unit and step instead of two).
struct ShardGradOp {
  static constexpr bool shards = true, replicates = false;
  static constexpr bool reshard_after_forward = false, reshard_after_backward = true;
};
// DDP: every rank holds every parameter; gradients are all-reduced.
struct NoShard {
  static constexpr bool shards = false, replicates = true;
  static constexpr bool reshard_after_forward = false, reshard_after_backward = false;
};
// HSDP: FullShard inside a shard group (the mesh's dp_shard axis), replicated
// across groups (dp_replicate): reduce-scatter inside, all-reduce across.
struct HybridShard {
  static constexpr bool shards = true, replicates = true;
  static constexpr bool reshard_after_forward = true, reshard_after_backward = true;
};

// Any tag type with these four traits is a strategy (a user-defined one
// works without editing the library); Sharded reads nothing else:
//   shards && replicates:   shard over the mesh's dp_shard, replicate over
//                           dp_replicate (needs a Mesh), as HybridShard;
//   shards only:            shard over the group (FullShard, ShardGradOp);
//   replicates only:        replicate over it (NoShard).
template <class S>
concept ShardingStrategy = requires {
  { S::shards } -> std::convertible_to<bool>;
  { S::replicates } -> std::convertible_to<bool>;
  { S::reshard_after_forward } -> std::convertible_to<bool>;
  { S::reshard_after_backward } -> std::convertible_to<bool>;
}
&&(S::shards || S::replicates);

// Dtypes of the three copies of a parameter. `compute`: the gathered
// parameters the modules run with (unset: the module's dtype, bf16 for a GPU
// model, f32 on the CPU); `master`: the sharded copy the optimizer updates;
// `reduce`: the dtype gradients are reduced in (f32 or bf16). The master must
// be f32 for now (optim::AdamW keeps fp32 masters and moments). Gradients always accumulate
// in fp32 (nn::Parameter::grad) and the sharded gradient is fp32.
struct MixedPrecisionPolicy {
  std::optional<DType> compute;
  DType master = DType::f32;
  DType reduce = DType::f32;
};

// When gradients are reduced over micro-batches (see Sharded::set_micro_batches).
enum class GradientSync : uint8_t {
  at_end,            // full fp32 gradients accumulate locally; one reduction after the last micro-batch
  every_micro_batch  // reduce-scatter after every micro-batch (full gradients never outlive one backward)
};

struct ShardedOptions {
  MixedPrecisionPolicy precision;
  GradientSync gradient_sync = GradientSync::at_end;
  // How gradients combine over the data-parallel ranks. sum: each rank's loss
  // is already normalised by the global token count (the split-invariant
  // aggregation of slime::rl), so the unsharded gradient is the sum; avg:
  // divide by the number of data-parallel ranks (PyTorch FSDP/DDP's default).
  comm::ReduceOp gradient_reduce = comm::ReduceOp::sum;
  // Gather the next unit while the current one computes.
  bool prefetch = true;
  // CPU offload (ZeRO-Offload): the fp32 master shards in pinned host memory,
  // the AdamW moments in host memory and the optimizer step on the CPU
  // (optim::cpu::adamw_update, the reference); see sharded.hpp.
  bool cpu_offload = false;
};

}  // namespace slime::parallel
