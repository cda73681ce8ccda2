// Sharded CPU offload on one GPU (a 1-rank NcclComm): a bf16 Qwen3 trains 3
// AdamW steps with and without ShardedOptions::cpu_offload. The offloaded run
// exercises the CUDA paths the CPU test cannot: masters cast on the device
// and downloaded to pinned memory, gradients downloaded and compute values
// uploaded around the CPU AdamW, masters gathered through the device.
// Expected: the first loss equal (same weights, same forward); after 3 steps
// the fp32 masters within 1e-3 relative (the CPU AdamW equals the CUDA kernel
// bit for bit, so the runs differ only if the backward kernels are not
// deterministic, and then by rounding amplified by Adam's normalisation);
// memory from the allocator statistics, exactly (S = shard elements):
//   device: compute shard bf16 2 S + grad shard f32 4 S = 6 S (18 S without offload)
//   pinned: master 4 S + staging grad 4 S + staging compute (bf16) 2 S = 10 S
//   host:   AdamW moments 8 S
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_gpu_test_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;
using slime_test::fsdp::config;
using slime_test::fsdp::rel;

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<float>> params;
  int64_t shard_elems = 0, device_bytes = 0, pinned_bytes = 0, host_bytes = 0;
};

Run train(comm::Comm& comm, bool offload) {
  const Device dev = comm.device();
  nn::Qwen3Model model(config(), {dev, DType::bf16});
  model.init_random(5, 0.02f);
  parallel::ShardedOptions opt;
  opt.cpu_offload = offload;
  std::optional<parallel::Sharded<nn::Qwen3Model, parallel::FullShard>> sh;
  sh.emplace(std::move(model), comm, opt);
  Run out;
  for (int step = 0; step < 3; ++step) {
    std::vector<std::vector<int32_t>> seqs;
    std::vector<int32_t> targets;
    for (int s = 0; s < 3; ++s) {
      std::vector<int32_t> seq;
      for (int i = 0; i < 17 + 40 * s + step; ++i) seq.push_back(int32_t((step * 131 + s * 13 + i * 37) % 1001));
      for (int32_t t : seq) targets.push_back(int32_t((t * 7 + 3) % 1001));
      seqs.push_back(seq);
    }
    const nn::PackedBatch b = nn::make_packed_batch(seqs, dev);
    const Tensor t = Tensor::from_vector(targets, {int64_t(targets.size())}, dev);
    sh->zero_grad();
    out.losses.push_back(sh->loss_and_backward(b, t).loss);
    sh->optimizer_step(1e-3);
  }
  for (const std::string& name : sh->parameter_names())
    out.params.push_back(sh->gather_parameter(name).to_vector<float>());
  for (std::size_t u = 0; u < sh->num_units(); ++u) out.shard_elems += sh->unit_layout(u).shard_numel();
  Stream::default_for(dev).synchronize();
  const int64_t d0 = memory_stats(dev).current_bytes, p0 = pinned_memory_stats().current_bytes,
                h0 = memory_stats(Device::cpu()).current_bytes;
  sh.reset();
  Stream::default_for(dev).synchronize();
  out.device_bytes = d0 - memory_stats(dev).current_bytes;
  out.pinned_bytes = p0 - pinned_memory_stats().current_bytes;
  out.host_bytes = h0 - memory_stats(Device::cpu()).current_bytes;
  return out;
}

}  // namespace

TEST_CASE("Sharded CPU offload on a GPU matches the run without it", "[fsdp][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  Run plain, off;
  comm::run_nccl_ranks(1, [&](comm::NcclComm& comm) {
    plain = train(comm, false);
    off = train(comm, true);
  });
  REQUIRE(plain.losses.size() == 3);
  REQUIRE(off.losses.size() == 3);
  CHECK(off.losses[0] == plain.losses[0]);
  for (int s = 1; s < 3; ++s) CHECK(std::abs(off.losses[std::size_t(s)] - plain.losses[std::size_t(s)]) <= 1e-3);
  REQUIRE(off.params.size() == plain.params.size());
  for (std::size_t i = 0; i < off.params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(rel(off.params[i], plain.params[i]) <= 1e-3);
  }
  const int64_t S = plain.shard_elems;
  CHECK(off.shard_elems == S);
  // Device: master 4 + compute 2 + grad 4 + moments 8 bytes per shard element,
  // plus the same op workspaces in both runs (attention, logprobs: a fixed
  // amount); offload moves the master and the moments (12 S) off the device.
  CHECK(plain.device_bytes >= 18 * S);
  CHECK(plain.device_bytes - off.device_bytes == 12 * S);
  CHECK(plain.pinned_bytes == 0);
  CHECK(off.pinned_bytes == 10 * S);
  CHECK(off.host_bytes == 8 * S);
}
