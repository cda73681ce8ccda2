// Issue 19 on one GPU: a steady-state Sharded training step (bf16 Qwen3,
// dense and MoE, FullShard; forward, token_logprobs and its backward through
// the reused Context, backward, AdamW without clipping, and with clipping by
// queue_optimizer_step: the clip factor on the device) allocates nothing
// (device, host and pinned allocation counts unchanged over 3 steps after 2
// warm-up steps) and makes the host wait for the GPU nowhere
// (slime::host_sync_count unchanged; a 1-rank NcclComm, whose collectives
// never wait on the host). With 2 LocalComm ranks on the same GPU (gathers
// and reductions through BufferCache) the steps allocate nothing either
// (LocalComm waits on the host by design, so its syncs are not counted).
// The counts are printed (INFO) when a check fails. The device's clip reads
// the same norm as the host's grad_norm, bit for bit.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <vector>

#include "fsdp_gpu_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/host_sync.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;
using Policy = parallel::Sharded<nn::Qwen3Model, parallel::FullShard>;

constexpr int kWarmup = 2, kCounted = 3;

nn::Qwen3Config step_config(bool moe) { return moe ? slime_test::fsdp::moe_config() : slime_test::fsdp::config(); }

// What the counted steps changed.
struct Counts {
  int64_t device_allocs = 0, host_allocs = 0, pinned_allocs = 0, host_syncs = 0;
};

// kWarmup + kCounted steps of `sh` on one micro-batch of 3 sequences (17,
// 57 and 97 tokens) with this rank's tokens; the counters over the last
// kCounted steps (process-wide: with several ranks, theirs too). With
// max_grad_norm > 0 the steps clip (queue_optimizer_step; each step's norm
// left unread).
Counts count_steps(Policy& sh, int rank, comm::Comm& comm, double max_grad_norm = 0) {
  const Device dev = sh.device();
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> seq;
    for (int i = 0; i < 17 + 40 * s; ++i) seq.push_back(int32_t((rank * 97 + s * 13 + i * 37) % 1001));
    for (int32_t t : seq) targets.push_back(int32_t((t * 7 + 3) % 1001));
    seqs.push_back(seq);
  }
  const nn::PackedBatch batch = nn::make_packed_batch(seqs, dev);
  const int64_t T = int64_t(targets.size());
  const Tensor tgt = Tensor::from_vector(targets, {T}, dev);
  const Tensor grad_lp = Tensor::from_vector(std::vector<float>(std::size_t(T), -1.f / float(T)), {T}, dev);
  const Stream s = Stream::create(dev);
  Stream::default_for(dev).synchronize();  // the batch was written on the default stream
  Policy::Context ctx;
  auto step = [&] {
    sh.zero_grad(s);
    const Tensor hidden = sh.forward(batch, ctx, s);
    const ops::TokenLogprobs lp = sh.token_logprobs(ctx, hidden, tgt, 1.f, s);
    sh.backward(ctx, sh.token_logprobs_backward(ctx, hidden, tgt, 1.f, lp, grad_lp, Tensor{}, s), s);
    sh.queue_optimizer_step(1e-3, max_grad_norm, s);
  };
  for (int i = 0; i < kWarmup; ++i) step();
  s.synchronize();
  comm.barrier();
  Counts before{memory_stats(dev).allocations, memory_stats(Device::cpu()).allocations,
                pinned_memory_stats().allocations, host_sync_count()};
  for (int i = 0; i < kCounted; ++i) step();
  Counts after{memory_stats(dev).allocations, memory_stats(Device::cpu()).allocations,
               pinned_memory_stats().allocations, host_sync_count()};
  s.synchronize();
  comm.barrier();
  return {after.device_allocs - before.device_allocs, after.host_allocs - before.host_allocs,
          after.pinned_allocs - before.pinned_allocs, after.host_syncs - before.host_syncs};
}

}  // namespace

TEST_CASE("a Sharded step on one GPU allocates nothing and never waits on the host", "[fsdp][gpu][memory]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    for (const double max_grad_norm : {0.0, 1e-3}) {
      INFO("max_grad_norm " << max_grad_norm);
      const auto comm = comm::NcclComm::init_rank(comm::NcclComm::unique_id(), 0, 1, Device::cuda(0));
      nn::Qwen3Model model(step_config(moe), {comm->device(), DType::bf16});
      model.init_random(5, 0.02f);
      Policy sh(std::move(model), *comm);
      const Counts c = count_steps(sh, 0, *comm, max_grad_norm);
      INFO("over " << kCounted << " steps: " << c.device_allocs << " device, " << c.host_allocs << " host, "
                   << c.pinned_allocs << " pinned allocations, " << c.host_syncs << " host waits");
      CHECK(c.device_allocs == 0);
      CHECK(c.host_allocs == 0);
      CHECK(c.pinned_allocs == 0);
      CHECK(c.host_syncs == 0);
    }
  }
}

TEST_CASE("the clip on the device reads the host's grad_norm bit for bit and skips a NaN step", "[fsdp][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    const auto comm = comm::NcclComm::init_rank(comm::NcclComm::unique_id(), 0, 1, Device::cuda(0));
    nn::Qwen3Model model(step_config(moe), {comm->device(), DType::bf16});
    model.init_random(5, 0.02f);
    Policy sh(std::move(model), *comm);
    const Device dev = sh.device();
    const nn::PackedBatch batch = nn::make_packed_batch({{1, 5, 9, 200, 7}, {3, 4, 900}}, dev);
    const Tensor tgt = Tensor::from_vector(std::vector<int32_t>{5, 9, 200, 7, 1, 4, 900, 3}, {8}, dev);
    Tensor grad_lp = Tensor::from_vector(std::vector<float>(8, -0.125f), {8}, dev);
    const Stream s = Stream::create(dev);
    Stream::default_for(dev).synchronize();
    auto backward = [&] {
      Policy::Context ctx;
      sh.zero_grad(s);
      const Tensor hidden = sh.forward(batch, ctx, s);
      const ops::TokenLogprobs lp = sh.token_logprobs(ctx, hidden, tgt, 1.f, s);
      sh.backward(ctx, sh.token_logprobs_backward(ctx, hidden, tgt, 1.f, lp, grad_lp, Tensor{}, s), s);
    };
    for (int step = 0; step < 2; ++step) {
      backward();
      const double host_norm = sh.grad_norm(s);
      const optim::PendingNorm pending = sh.queue_optimizer_step(1e-3, 1e-3, s);
      REQUIRE(pending.has_value());
      CHECK(pending.get() == host_norm);
      CHECK(host_norm > 0);
    }
    // A NaN gradient: the device skips the update; optimizer_step throws and keeps the step count.
    auto masters = [&] {
      std::vector<std::vector<float>> m;
      sh.for_each_local_shard([&](const parallel::LocalShard& l) { m.push_back(l.master.to_vector<float>(s)); });
      return m;
    };
    std::vector<float> bad(8, -0.125f);
    bad[3] = std::numeric_limits<float>::quiet_NaN();
    grad_lp.copy_from(Tensor::from_vector(bad, {8}), s);
    backward();
    const auto before = masters();
    const int64_t steps = sh.optimizer().step_count();
    REQUIRE_THROWS_WITH(sh.optimizer_step(1e-3, 1.0, s), Catch::Matchers::ContainsSubstring("update was not applied"));
    CHECK(sh.optimizer().step_count() == steps);
    CHECK(masters() == before);
  }
}

TEST_CASE("a Sharded step of 2 LocalComm ranks on one GPU allocates nothing", "[fsdp][gpu][memory]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    std::vector<Counts> counts(2);
    std::mutex mu;
    comm::run_local_ranks(
        2,
        [&](comm::Comm& comm) {
          nn::Qwen3Model model(step_config(moe), {comm.device(), DType::bf16});
          model.init_random(5, 0.02f);
          Policy sh(std::move(model), comm);
          const Counts c = count_steps(sh, comm.rank(), comm);
          std::lock_guard<std::mutex> lock(mu);
          counts[std::size_t(comm.rank())] = c;
        },
        comm::kLocalCommTimeout, Device::cuda(0));
    // The counters are process-wide: each rank's window holds both ranks' steps.
    for (const Counts& c : counts) {
      INFO("over " << kCounted << " steps: " << c.device_allocs << " device, " << c.host_allocs << " host, "
                   << c.pinned_allocs << " pinned allocations");
      CHECK(c.device_allocs == 0);
      CHECK(c.host_allocs == 0);
      CHECK(c.pinned_allocs == 0);
    }
  }
}

// The counter the step test relies on counts (so its zero means something):
// a stream synchronisation, a read-back to the host, a copy into pageable
// host memory and a device synchronisation count one each; work on the CPU
// and a copy into pinned memory none.
TEST_CASE("host_sync_count counts the host's waits for the GPU", "[core][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const Device dev = Device::cuda(0);
  const Stream s = Stream::create(dev);
  const Tensor t = Tensor::zeros({1000}, DType::f32, dev, s);
  const Tensor host = Tensor::empty({1000}, DType::f32), pinned = Tensor::empty_pinned({1000}, DType::f32);
  const auto waits = [](auto&& f) {
    const int64_t before = host_sync_count();
    f();
    return host_sync_count() - before;
  };
  CHECK(waits([&] { s.synchronize(); }) == 1);
  CHECK(waits([&] { (void)t.to_vector<float>(s); }) == 1);
  CHECK(waits([&] { Tensor(host).copy_from(t, s); }) == 1);
  CHECK(waits([&] { synchronize_device(dev); }) == 1);
  CHECK(waits([&] { Tensor(pinned).copy_from(t, s); }) == 0);
  CHECK(waits([&] { (void)host.to_vector<float>(); }) == 0);
  s.synchronize();
}
