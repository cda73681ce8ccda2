// Sharded::offload / onload on one GPU (a 1-rank NcclComm made on the main
// thread, so the Catch2 checks run there), bf16 Qwen3 (fsdp_gpu_test_util's
// config), FullShard, fp32 master weights.
//
// Expected device bytes (memory_stats(cuda:0).current_bytes, exact; S = shard
// elements over all units; one rank: every unit's gathered buffer is its
// compute shard and the gradients accumulate straight into the grad shard):
//   offload frees exactly 18 S + W: master 4 S + compute (bf16) 2 S + grad
//   4 S + AdamW moments 8 S, at a step boundary and between micro-batches
//   alike (no unreduced gradient buffers on one rank), plus W, the modules'
//   op workspaces (attention, RMSNorm and embedding backward scratch, sized by
//   a micro-batch's tokens: nn::workspace_bytes before the offload), which are
//   released, not copied; onload allocates exactly 18 S again (the next
//   backward makes the workspaces). What stays above the bytes held before
//   the model was built: under 8 MiB (printed).
//   The first offload allocates exactly 18 S pinned bytes; later cycles
//   allocate no pinned memory; 100 cycles leave device, pinned and the
//   pool's reserved bytes where the first left them.
// Bitwise: every offload / onload returns the master weights and the AdamW
// moments bit for bit (checked at every cycle); the run with cycles (between
// steps and between the 2 micro-batches of each step) ends with the same
// master weights as the run without. Sequences are at most 128 tokens so that
// the attention backward's dq (fp32 atomics across key blocks of 128) has one
// block: the runs are deterministic; should two plain runs still differ, the
// test says so and compares within 1e-3 instead.
// Colocated: a rollout::Engine on the same GPU and 100 cycles of train step,
// sync_colocated of the gathered weights (into the offloaded engine's pinned
// weights), policy offload, engine onload, generate, engine offload, policy
// onload: device and pinned bytes after every cycle equal the first cycle's.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp_gpu_test_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/rollout/weight_sync.hpp"

namespace {

using namespace slime;
using slime_test::fsdp::config;
using slime_test::fsdp::rel;
using Policy = parallel::Sharded<nn::Qwen3Model, parallel::FullShard>;

constexpr int kSteps = 3, kMicroBatches = 2;
constexpr double kLr = 1e-3;

struct Batch {
  nn::PackedBatch batch;
  Tensor targets;
};

// Micro-batch m of step `step`: 3 sequences of 17 .. 101 tokens.
Batch make_batch(int step, int m, Device dev) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < 3; ++s) {
    std::vector<int32_t> seq;
    for (int i = 0; i < 17 + 40 * s + step + m; ++i)
      seq.push_back(int32_t((step * 131 + m * 71 + s * 13 + i * 37) % 1001));
    for (int32_t t : seq) targets.push_back(int32_t((t * 7 + 3) % 1001));
    seqs.push_back(seq);
  }
  return {nn::make_packed_batch(seqs, dev), Tensor::from_vector(targets, {int64_t(targets.size())}, dev)};
}

std::unique_ptr<comm::NcclComm> one_rank_comm() {
  return comm::NcclComm::init_rank(comm::NcclComm::unique_id(), 0, 1, Device::cuda(0));
}

Policy make_policy(comm::Comm& comm, uint64_t seed = 5) {
  nn::Qwen3Model model(config(), {comm.device(), DType::bf16});
  model.init_random(seed, 0.02f);
  return Policy(std::move(model), comm);
}

int64_t shard_elems(Policy& sh) {
  int64_t n = 0;
  for (std::size_t u = 0; u < sh.num_units(); ++u) n += sh.unit_layout(u).shard_numel();
  return n;
}

// Master weights (gathered, f32) and AdamW moments, as bytes.
std::vector<std::vector<float>> snapshot(Policy& sh) {
  std::vector<std::vector<float>> out;
  for (const std::string& name : sh.parameter_names()) out.push_back(sh.gather_parameter(name).to_vector<float>());
  for (const auto& [name, t] : sh.optimizer().state_tensors()) out.push_back(t.to_vector<float>());
  return out;
}

bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0)
      return false;
  return true;
}

// What the cycles of one run observed (checked on the caller's side).
struct CycleLog {
  int cycles = 0, restored_bitwise = 0;
  std::vector<int64_t> freed, reallocated, transfer;  // per cycle
  int64_t pinned_first = 0, pinned_allocs_later = 0, residual = 0;
  std::vector<int64_t> workspaces;  // per cycle: the op workspaces offload released
  int64_t workspaces_left = 0;      // workspace bytes still held after offloads (expected 0)
};

// K steps of 2 micro-batches; with `log`, an offload / onload cycle after
// every backward and after every optimizer_step. The final master weights.
std::vector<std::vector<float>> train(comm::Comm& comm, CycleLog* log) {
  const Device dev = comm.device();
  std::vector<Batch> batches;
  for (int step = 0; step < kSteps; ++step)
    for (int m = 0; m < kMicroBatches; ++m) batches.push_back(make_batch(step, m, dev));
  Stream::default_for(dev).synchronize();
  const int64_t base = memory_stats(dev).current_bytes;
  Policy sh = make_policy(comm);
  int64_t pinned_allocs = 0;
  auto cycle = [&] {
    if (!log) return;
    const auto before = snapshot(sh);
    const int64_t d0 = memory_stats(dev).current_bytes, p0 = pinned_memory_stats().current_bytes;
    // released, not copied: the op workspaces and the reused step buffers
    // (Sharded::cached_buffer_bytes; none on one rank, which neither gathers nor reduces)
    const int64_t ws = int64_t(nn::workspace_bytes(sh.module())) + sh.cached_buffer_bytes();
    sh.offload();
    const int64_t d1 = memory_stats(dev).current_bytes;
    log->workspaces.push_back(ws);
    log->workspaces_left += int64_t(nn::workspace_bytes(sh.module()));
    if (log->cycles == 0) {
      log->pinned_first = pinned_memory_stats().current_bytes - p0;
      pinned_allocs = pinned_memory_stats().allocations;
    }
    log->residual = std::max(log->residual, d1 - base);
    sh.onload();
    const int64_t d2 = memory_stats(dev).current_bytes;
    log->freed.push_back(d0 - d1 - ws);
    log->reallocated.push_back(d2 - d1);
    log->transfer.push_back(int64_t(sh.offload_transfer_bytes()));
    log->restored_bitwise += same_bits(snapshot(sh), before);
    ++log->cycles;
  };
  for (int step = 0; step < kSteps; ++step) {
    int64_t tokens = 0;
    for (int m = 0; m < kMicroBatches; ++m) tokens += batches[std::size_t(step * kMicroBatches + m)].batch.num_tokens();
    sh.zero_grad();
    sh.set_micro_batches(kMicroBatches);
    for (int m = 0; m < kMicroBatches; ++m) {
      const Batch& b = batches[std::size_t(step * kMicroBatches + m)];
      sh.loss_and_backward(b.batch, b.targets, 1.f, double(tokens));
      cycle();
    }
    sh.optimizer_step(kLr);
    cycle();
  }
  if (log) log->pinned_allocs_later = pinned_memory_stats().allocations - pinned_allocs;
  std::vector<std::vector<float>> out;
  for (const std::string& name : sh.parameter_names()) out.push_back(sh.gather_parameter(name).to_vector<float>());
  return out;
}

std::vector<rollout::Request> requests(int n, int64_t max_new) {
  std::vector<rollout::Request> rs;
  for (int i = 0; i < n; ++i) {
    rollout::Request r;
    for (int j = 0; j < 1 + (i * 37) % 61; ++j) r.prompt.push_back(int32_t((i * 131 + j * 17) % 1001));
    r.sample_id = uint64_t(i);
    r.sampling.max_new_tokens = max_new + i % 5;
    rs.push_back(r);
  }
  return rs;
}

}  // namespace

TEST_CASE("Sharded runtime offload on a GPU frees 18 S device bytes and restores them bit for bit", "[fsdp][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const auto comm = one_rank_comm();
  const auto plain = train(*comm, nullptr);
  const auto plain_again = train(*comm, nullptr);
  CycleLog log;
  const auto cycled = train(*comm, &log);
  int64_t S = 0;
  {
    Policy sh = make_policy(*comm);
    S = shard_elems(sh);
  }
  INFO("S = " << S << " shard elements");
  std::printf(
      "sharded runtime offload (bf16, 1 GPU): S = %lld, 18 S = %lld bytes moved per offload; left on the device "
      "while offloaded: %lld bytes\n",
      (long long)S, (long long)(18 * S), (long long)log.residual);
  REQUIRE(log.cycles == kSteps * (kMicroBatches + 1));
  CHECK(log.restored_bitwise == log.cycles);
  for (int c = 0; c < log.cycles; ++c) {
    INFO("cycle " << c);
    CHECK(log.freed[std::size_t(c)] == 18 * S);
    CHECK(log.reallocated[std::size_t(c)] == 18 * S);
    CHECK(log.transfer[std::size_t(c)] == 18 * S);
  }
  CHECK(log.pinned_first == 18 * S);
  CHECK(log.pinned_allocs_later == 0);
  CHECK(log.workspaces_left == 0);  // every offload released the op workspaces
  CHECK(*std::max_element(log.workspaces.begin(), log.workspaces.end()) > 0);  // and there were some
  CHECK(log.residual >= 0);
  CHECK(log.residual < (int64_t(8) << 20));
  REQUIRE(cycled.size() == plain.size());
  if (same_bits(plain_again, plain)) {
    CHECK(same_bits(cycled, plain));
  } else {
    WARN("two runs without cycles differ (non-deterministic kernels): comparing within 1e-3");
    for (std::size_t i = 0; i < plain.size(); ++i) CHECK(rel(cycled[i], plain[i]) <= 1e-3);
  }
}

TEST_CASE("Sharded runtime offload: 100 cycles grow neither device nor pinned memory", "[fsdp][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const auto comm = one_rank_comm();
  const Device dev = comm->device();
  Policy sh = make_policy(*comm);
  const Batch b = make_batch(0, 0, dev);
  sh.zero_grad();
  sh.loss_and_backward(b.batch, b.targets);
  sh.optimizer_step(kLr);
  Stream::default_for(dev).synchronize();
  const int64_t d0 = memory_stats(dev).current_bytes;
  // The op workspaces of the step: freed by the first offload, and not made
  // again (no backward inside the cycles).
  const int64_t ws = int64_t(nn::workspace_bytes(sh.module()));
  CHECK(ws > 0);
  int64_t offloaded_bytes = -1, pinned_after_first = -1, allocs_after_first = -1, reserved_after_first = -1;
  int64_t worst_device = 0, worst_offloaded = 0, worst_pinned = 0;
  for (int c = 0; c < 100; ++c) {
    sh.offload();
    const int64_t off = memory_stats(dev).current_bytes;
    sh.onload();
    Stream::default_for(dev).synchronize();
    if (c == 0) {
      offloaded_bytes = off;
      pinned_after_first = pinned_memory_stats().current_bytes;
      allocs_after_first = pinned_memory_stats().allocations;
      reserved_after_first = memory_stats(dev).reserved_bytes;
    }
    worst_device = std::max(worst_device, std::abs(memory_stats(dev).current_bytes - (d0 - ws)));
    worst_offloaded = std::max(worst_offloaded, std::abs(off - offloaded_bytes));
    worst_pinned = std::max(worst_pinned, std::abs(pinned_memory_stats().current_bytes - pinned_after_first));
  }
  CHECK(worst_device == 0);
  CHECK(worst_offloaded == 0);
  CHECK(d0 - offloaded_bytes == 18 * shard_elems(sh) + ws);
  CHECK(nn::workspace_bytes(sh.module()) == 0);
  CHECK(worst_pinned == 0);
  CHECK(pinned_memory_stats().allocations == allocs_after_first);
  CHECK(memory_stats(dev).reserved_bytes <= reserved_after_first);
  // Training goes on after the cycles.
  sh.zero_grad();
  CHECK(std::isfinite(sh.loss_and_backward(b.batch, b.targets).loss));
  sh.optimizer_step(kLr);
}

TEST_CASE("Sharded and a rollout engine take turns on one GPU for 100 cycles without growth", "[fsdp][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const auto comm = one_rank_comm();
  const Device dev = comm->device();
  Policy sh = make_policy(*comm);
  const int64_t S = shard_elems(sh);
  nn::Qwen3Model engine_model(config(), {dev, DType::bf16});
  engine_model.init_random(9, 0.02f);
  rollout::Engine engine(engine_model, {.max_batch = 8, .max_context = 128, .kv_capacity = 0, .seed = 5});
  engine.offload();
  const Batch b = make_batch(0, 0, dev);
  int64_t first_current = -1, first_pinned = -1, first_reserved = -1;
  int64_t worst_current = 0, worst_pinned = 0, train_peak = 0, rollout_peak = 0, cycle_peak = 0;
  int bad_drops = 0, bad_versions = 0, errors = 0;
  for (int cycle = 0; cycle < 100; ++cycle) {
    Stream::default_for(dev).synchronize();
    reset_peak_memory_stats(dev);
    const int64_t start = memory_stats(dev).current_bytes;
    // Training turn (the engine offloaded).
    sh.zero_grad();
    sh.loss_and_backward(b.batch, b.targets);
    sh.optimizer_step(kLr);
    train_peak = std::max(train_peak, memory_stats(dev).peak_bytes - start);
    rollout::sync_colocated(rollout::ShardedWeights<Policy>{&sh}, engine, cycle + 1, {.verify = cycle % 25 == 0});
    const int64_t d0 = memory_stats(dev).current_bytes;
    // made again by this cycle's backward; the reused step buffers (none on one rank)
    const int64_t ws = int64_t(nn::workspace_bytes(sh.module())) + sh.cached_buffer_bytes();
    sh.offload();
    bad_drops += d0 - memory_stats(dev).current_bytes != 18 * S + ws;
    // Rollout turn (the policy offloaded).
    engine.onload();
    const int64_t r0 = memory_stats(dev).current_bytes;
    reset_peak_memory_stats(dev);
    const auto out = engine.generate(requests(8, 8));
    rollout_peak = std::max(rollout_peak, memory_stats(dev).peak_bytes - r0);
    for (const auto& c : out) {
      bad_versions += c.weight_version != cycle + 1;
      errors += c.finish == rollout::FinishReason::error;
    }
    engine.offload();
    sh.onload();
    Stream::default_for(dev).synchronize();
    cycle_peak = std::max(cycle_peak, memory_stats(dev).peak_bytes);
    const int64_t current = memory_stats(dev).current_bytes, pinned = pinned_memory_stats().current_bytes;
    if (cycle == 0) {
      first_current = current;
      first_pinned = pinned;
      first_reserved = memory_stats(dev).reserved_bytes;
    }
    worst_current = std::max(worst_current, std::abs(current - first_current));
    worst_pinned = std::max(worst_pinned, std::abs(pinned - first_pinned));
  }
  std::printf(
      "colocated cycles (bf16, 1 GPU): device bytes between cycles %lld, pinned %lld; training turn peak %lld, "
      "rollout turn peak %lld (above their bases), whole cycle peak %lld; reserved after cycle 1 %lld, after 100 "
      "%lld\n",
      (long long)first_current, (long long)first_pinned, (long long)train_peak, (long long)rollout_peak,
      (long long)cycle_peak, (long long)first_reserved, (long long)memory_stats(dev).reserved_bytes);
  CHECK(bad_drops == 0);
  CHECK(bad_versions == 0);
  CHECK(errors == 0);
  CHECK(worst_current == 0);
  CHECK(worst_pinned == 0);
  CHECK(memory_stats(dev).reserved_bytes <= first_reserved);
  CHECK(train_peak > 0);
  CHECK(rollout_peak > 0);
  // The engine serves the policy's weights: its bf16 parameters equal the
  // policy's gathered masters rounded to bf16.
  engine.onload();
  std::vector<std::string> mismatched;
  engine_model.for_each_parameter([&](nn::Parameter& p) {
    const Tensor want = sh.gather_parameter(p.name);
    Tensor cast = Tensor::empty(want.shape(), DType::bf16, dev);
    ops::cast(want, cast);
    if (rollout::tensor_hash(cast) != rollout::tensor_hash(p.value)) mismatched.push_back(p.name);
  });
  CHECK(mismatched.empty());
}
