// slime/data/distributed.hpp: agree_micro_batch_count, the one collective of
// the per-rank packing path (each rank packs only its own samples).
//
//   int local = local_micro_batch_count(config, my_lengths);
//   int count = agree_micro_batch_count(dp_comm, local);  // max over ranks
//   auto mbs  = split_micro_batches(config, my_lengths, count);
//
// Ranks that plan() the global batch need none of this: plan() is
// deterministic, so they agree without communicating (slime/data/packer.hpp).
#pragma once

#include <cstdint>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/data/packer.hpp"

namespace slime::data {

// The largest local_count over the ranks of `comm` (an all_reduce max on one
// i32 on the communicator's device). Collective: every rank calls it.
inline int agree_micro_batch_count(comm::Comm& comm, int local_count, const Stream& stream = {}) {
  SLIME_CHECK(local_count >= 0, "agree_micro_batch_count: negative local count ", local_count);
  Tensor t = Tensor::from_vector(std::vector<int32_t>{local_count}, Shape{1}, comm.device(), stream);
  comm.all_reduce(t, comm::ReduceOp::max, stream);
  return t.to_vector<int32_t>(stream)[0];
}

}  // namespace slime::data
