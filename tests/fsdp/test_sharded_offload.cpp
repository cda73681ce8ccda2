// Sharded::offload / onload on LocalComm (CPU): the training state goes to
// pinned host memory and back between steps and between the micro-batches of
// an accumulated step (offload after a backward, onload before the next
// micro-batch or optimizer_step). 1, 2 and 3 ranks with FullShard,
// ShardGradOp and NoShard, HybridShard on 2x1 and 1x2 meshes, both gradient
// sync modes, tied embeddings, clipping and ShardedOptions::cpu_offload: the
// parameters after K steps equal (bitwise) the run without cycles. Bytes from
// the allocator statistics (on the CPU the "device" is pageable host memory,
// f32 model: master = compute shard), S = a rank's shard elements:
//   offload at a step boundary frees 16 S host bytes (master 4, grad 4,
//   AdamW moments 8) and the first one allocates 16 S pinned; later cycles
//   allocate no pinned memory; onload brings the 16 S back. Mid-accumulation
//   on 3 ranks the unreduced full gradients (4 bytes per gathered element)
//   move too. With cpu_offload only the grad and compute shards move (8 S),
//   into the existing staging shards (no new pinned memory).
// Errors while offloaded, offload twice / onload when not offloaded (no-ops),
// checkpoint reads while offloaded.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::FullShard;
using parallel::HybridShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::error_of;
using slime_test::fsdp::micro_batch;
using slime_test::fsdp::MicroBatch;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;

namespace {

constexpr double kLr = 1e-2;
constexpr const char* kOffloaded = "Sharded is offloaded: call onload() first";

nn::Qwen3Model make_model(bool tied) { return slime_test::fsdp::make_model(slime_test::fsdp::tiny_config(tied)); }

struct RunConfig {
  int ranks = 1;
  int micro_batches = 1;
  int steps = 3;
  bool tied = false;
  bool cycles = false;  // offload / onload between steps and micro-batches
  double max_grad_norm = 0;
  comm::MeshShape mesh;  // HybridShard only
  parallel::ShardedOptions options;
};

int64_t global_tokens(const RunConfig& rc, int step) {
  int64_t n = 0;
  for (int r = 0; r < rc.ranks; ++r)
    for (int m = 0; m < rc.micro_batches; ++m) n += micro_batch(step, r, m, 37).batch.num_tokens();
  return n;
}

// What every call but the cycle's own must say while offloaded (checked once
// per run, in the first cycle; the calls throw before touching any state).
template <class S>
void check_offloaded_errors(Sharded<nn::Qwen3Model, S>& sh, const MicroBatch& mb) {
  TCHECK(sh.offloaded());
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = Tensor::zeros({mb.batch.num_tokens(), 16}, DType::f32);
  const Tensor g = Tensor::zeros({mb.batch.num_tokens()}, DType::f32);
  ops::TokenLogprobs lp;
  for (const std::string& e : {
           error_of([&] { sh.forward(mb.batch, ctx); }),
           error_of([&] { sh.backward(ctx, hidden); }),
           error_of([&] { sh.loss_and_backward(mb.batch, mb.targets); }),
           error_of([&] { sh.logits(hidden); }),
           error_of([&] { sh.token_logprobs(hidden, mb.targets); }),
           error_of([&] { sh.token_logprobs_backward(hidden, mb.targets, 1.f, lp, g, Tensor{}); }),
           error_of([&] { sh.zero_grad(); }),
           error_of([&] { sh.grad_norm(); }),
           error_of([&] { sh.optimizer_step(kLr); }),
           error_of([&] { sh.load_parameter("model.norm.weight", Tensor::zeros({16}, DType::f32)); }),
       })
    TCHECK(e.find(kOffloaded) != std::string::npos);
}

// One rank's training loop; rank 0 (`out` set) keeps the gathered parameters.
template <class S>
void train(Sharded<nn::Qwen3Model, S>& sh, const RunConfig& rc, int rank, Params* out) {
  bool first_cycle = true;
  auto cycle = [&](const MicroBatch& mb) {
    if (!rc.cycles) return;
    sh.offload();
    if (first_cycle) check_offloaded_errors(sh, mb);
    first_cycle = false;
    sh.onload();
    TCHECK(!sh.offloaded());
  };
  for (int step = 0; step < rc.steps; ++step) {
    sh.zero_grad();
    sh.set_micro_batches(rc.micro_batches);
    const double norm = double(global_tokens(rc, step));
    MicroBatch mb;
    for (int m = 0; m < rc.micro_batches; ++m) {
      mb = micro_batch(step, rank, m, 37);
      sh.loss_and_backward(mb.batch, mb.targets, 1.f, norm);
      cycle(mb);  // after the backward; onload before the next micro-batch or optimizer_step
    }
    sh.optimizer_step(kLr, rc.max_grad_norm);
    cycle(mb);
  }
  for (const std::string& name : sh.parameter_names()) {
    const Tensor full = sh.gather_parameter(name);  // collective: every rank
    if (out) (*out)[name] = full.to_vector<float>();
  }
}

template <class S>
Params sharded_run(const RunConfig& rc) {
  Params out;
  comm::run_local_ranks(rc.ranks, [&](comm::Comm& comm) {
    Params* mine = comm.rank() == 0 ? &out : nullptr;
    if constexpr (std::is_same_v<S, HybridShard>) {
      const comm::Mesh mesh(comm, rc.mesh);
      Sharded<nn::Qwen3Model, S> sh(make_model(rc.tied), mesh, rc.options);
      train(sh, rc, comm.rank(), mine);
    } else {
      Sharded<nn::Qwen3Model, S> sh(make_model(rc.tied), comm, rc.options);
      train(sh, rc, comm.rank(), mine);
    }
  });
  return out;
}

bool bitwise_equal(const Params& a, const Params& b) {
  if (a.empty() || a.size() != b.size()) return false;
  for (const auto& [name, va] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != va.size() ||
        std::memcmp(va.data(), it->second.data(), va.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

// The run with offload / onload cycles against the same run without.
template <class S>
void check_cycles_bitwise(RunConfig rc) {
  rc.cycles = false;
  const Params plain = sharded_run<S>(rc);
  rc.cycles = true;
  const Params cycled = sharded_run<S>(rc);
  thread_checks().require_none();
  CHECK(bitwise_equal(cycled, plain));
}

}  // namespace

TEMPLATE_TEST_CASE("Sharded offload and onload between steps and micro-batches change no bit", "[fsdp]", FullShard,
                   ShardGradOp, NoShard) {
  for (int ranks = 1; ranks <= 3; ++ranks) {
    for (int micro_batches : {1, 2}) {
      for (const auto sync : {parallel::GradientSync::at_end, parallel::GradientSync::every_micro_batch}) {
        if (micro_batches == 1 && sync == parallel::GradientSync::every_micro_batch) continue;  // the same run
        INFO("ranks " << ranks << ", micro-batches " << micro_batches << ", sync " << int(sync));
        RunConfig rc;
        rc.ranks = ranks;
        rc.micro_batches = micro_batches;
        rc.tied = ranks == 2;
        rc.options.gradient_sync = sync;
        check_cycles_bitwise<TestType>(rc);
      }
    }
  }
}

TEST_CASE("Sharded<HybridShard> offload cycles on 2x1 and 1x2 meshes change no bit", "[fsdp]") {
  for (const comm::MeshShape shape :
       {comm::MeshShape{.dp_replicate = 2, .dp_shard = 1}, comm::MeshShape{.dp_replicate = 1, .dp_shard = 2}}) {
    INFO("dp_replicate " << shape.dp_replicate << ", dp_shard " << shape.dp_shard);
    RunConfig rc;
    rc.ranks = 2;
    rc.micro_batches = 2;
    rc.mesh = shape;
    check_cycles_bitwise<HybridShard>(rc);
  }
}

TEMPLATE_TEST_CASE("Sharded offload cycles with cpu_offload and clipping change no bit", "[fsdp]", FullShard, NoShard) {
  for (int ranks : {1, 3}) {
    INFO("ranks " << ranks);
    RunConfig rc;
    rc.ranks = ranks;
    rc.micro_batches = 2;
    rc.max_grad_norm = 0.05;  // well below the gradient norm: every step clips
    const Params plain = sharded_run<TestType>(rc);
    rc.options.cpu_offload = true;
    rc.cycles = true;
    const Params cycled = sharded_run<TestType>(rc);
    thread_checks().require_none();
    CHECK(bitwise_equal(cycled, plain));
  }
}

TEST_CASE("Sharded offload frees the state's bytes, reuses its pinned buffers, onload restores them", "[fsdp]") {
  // One rank at a time (the others wait in barriers, allocating nothing)
  // measures its offload and onload: offload and onload communicate nothing.
  struct Bytes {
    int64_t shard = 0, gathered = 0;          // S, and the gathered elements of the units holding full grads
    int64_t freed = 0, pinned_first = 0;      // first offload at a step boundary
    int64_t pinned_allocs_later = -1;         // pinned allocations of cycles 2 .. 5
    int64_t restored = 0, refreed = 0;        // onload's host bytes back; the last offload's drop
    int64_t transfer = 0, host_pinned = 0;    // offload_transfer_bytes, offload_host_bytes
    int64_t mid_transfer = 0, mid_freed = 0;  // offload between two micro-batches (at_end)
    int64_t cpu_freed = 0, cpu_pinned = -1, cpu_transfer = 0, cpu_host_pinned = -1;  // with cpu_offload
    // Sharded::cached_buffer_bytes before each measured offload (the reused
    // step buffers, which offload frees too; none after a cycle).
    int64_t cached = -1, refreed_cached = -1, mid_cached = -1, cpu_cached = -1;
  };
  for (int ranks : {1, 3}) {
    INFO(ranks << " ranks");
    std::vector<Bytes> bytes(static_cast<std::size_t>(ranks));
    comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
      Bytes& b = bytes[std::size_t(comm.rank())];
      auto in_turn = [&](const std::function<void()>& f) {
        for (int q = 0; q < comm.size(); ++q) {
          comm.barrier();
          if (q == comm.rank()) f();
          comm.barrier();
        }
      };
      Sharded<nn::Qwen3Model, FullShard> sh(make_model(false), comm);
      for (std::size_t u = 0; u < sh.num_units(); ++u) b.shard += sh.unit_layout(u).shard_numel();
      const MicroBatch mb = micro_batch(0, comm.rank(), 0, 37);
      sh.zero_grad();
      sh.loss_and_backward(mb.batch, mb.targets);
      sh.optimizer_step(kLr);
      in_turn([&] {
        const int64_t h0 = memory_stats(Device::cpu()).current_bytes, p0 = pinned_memory_stats().current_bytes;
        b.cached = sh.cached_buffer_bytes();
        sh.offload();
        b.freed = h0 - memory_stats(Device::cpu()).current_bytes;
        b.pinned_first = pinned_memory_stats().current_bytes - p0;
        b.transfer = int64_t(sh.offload_transfer_bytes());
        b.host_pinned = int64_t(sh.offload_host_bytes());
        const int64_t h1 = memory_stats(Device::cpu()).current_bytes;
        sh.onload();
        b.restored = memory_stats(Device::cpu()).current_bytes - h1;
        const int64_t allocs = pinned_memory_stats().allocations;
        for (int c = 0; c < 4; ++c) {
          const int64_t h = memory_stats(Device::cpu()).current_bytes;
          b.refreed_cached = sh.cached_buffer_bytes();
          sh.offload();
          b.refreed = h - memory_stats(Device::cpu()).current_bytes;
          sh.onload();
        }
        b.pinned_allocs_later = pinned_memory_stats().allocations - allocs;
      });
      // Between two micro-batches of an at_end step: the unreduced gradients too.
      sh.zero_grad();
      sh.set_micro_batches(2);
      sh.loss_and_backward(mb.batch, mb.targets);
      for (std::size_t u = 0; u < sh.num_units(); ++u)
        if (comm.size() > 1) b.gathered += sh.unit_layout(u).gathered_numel();
      in_turn([&] {
        const int64_t h0 = memory_stats(Device::cpu()).current_bytes;
        b.mid_cached = sh.cached_buffer_bytes();
        sh.offload();
        b.mid_freed = h0 - memory_stats(Device::cpu()).current_bytes;
        b.mid_transfer = int64_t(sh.offload_transfer_bytes());
        sh.onload();
      });
      sh.loss_and_backward(mb.batch, mb.targets);
      sh.optimizer_step(kLr);

      // cpu_offload: only the compute and grad shards were on the "device".
      parallel::ShardedOptions opt;
      opt.cpu_offload = true;
      Sharded<nn::Qwen3Model, FullShard> off(make_model(false), comm, opt);
      off.zero_grad();
      off.loss_and_backward(mb.batch, mb.targets);
      off.optimizer_step(kLr);
      in_turn([&] {
        const int64_t h0 = memory_stats(Device::cpu()).current_bytes, p0 = pinned_memory_stats().allocations;
        b.cpu_cached = off.cached_buffer_bytes();
        off.offload();
        b.cpu_freed = h0 - memory_stats(Device::cpu()).current_bytes;
        b.cpu_pinned = pinned_memory_stats().allocations - p0;
        b.cpu_transfer = int64_t(off.offload_transfer_bytes());
        b.cpu_host_pinned = int64_t(off.offload_host_bytes());
        off.onload();
      });
    });
    for (int r = 0; r < ranks; ++r) {
      const Bytes& b = bytes[std::size_t(r)];
      const int64_t S = b.shard;
      INFO("rank " << r << ": S = " << S << ", gathered " << b.gathered);
      // One rank: no gather and no reduce, so nothing to cache.
      CHECK((ranks == 1 ? b.cached == 0 : b.cached > 0));
      CHECK(b.refreed_cached == 0);
      CHECK(b.freed == 16 * S + b.cached);
      CHECK(b.pinned_first == 16 * S);
      CHECK(b.transfer == 16 * S);
      CHECK(b.host_pinned == 16 * S);
      CHECK(b.restored == 16 * S);
      CHECK(b.refreed == 16 * S);
      CHECK(b.pinned_allocs_later == 0);
      // FullShard after a backward: nothing gathered; with 3 ranks every unit
      // holds its f32 full gradient (4 bytes per gathered element).
      CHECK(b.mid_transfer == 16 * S + 4 * b.gathered);
      CHECK(b.mid_freed == 16 * S + 4 * b.gathered + b.mid_cached);
      CHECK(b.cpu_freed == 8 * S + b.cpu_cached);
      CHECK(b.cpu_transfer == 8 * S);
      CHECK(b.cpu_pinned == 0);
      CHECK(b.cpu_host_pinned == 0);
    }
  }
}

TEST_CASE("Sharded while offloaded: clear errors, no-op repeats, checkpoint reads from the host", "[fsdp]") {
  auto group = comm::LocalComm::create_group(1);
  comm::Comm& comm = *group[0];
  Sharded<nn::Qwen3Model, FullShard> sh(make_model(true), comm);
  const MicroBatch mb = micro_batch(0, 0, 0, 37);
  sh.zero_grad();
  sh.loss_and_backward(mb.batch, mb.targets);
  sh.optimizer_step(kLr);
  Params before;
  for (const std::string& name : sh.parameter_names()) before[name] = sh.gather_parameter(name).to_vector<float>();
  const auto moments_before = sh.optimizer().state_tensors();
  std::vector<std::vector<float>> moment_values;
  for (const auto& [name, t] : moments_before) moment_values.push_back(t.to_vector<float>());

  CHECK_FALSE(sh.offloaded());
  sh.onload();  // not offloaded: a no-op
  CHECK_FALSE(sh.offloaded());
  CHECK(sh.offload_host_bytes() == 0);

  sh.offload();
  CHECK(sh.offloaded());
  const std::size_t transfer = sh.offload_transfer_bytes();
  const int64_t allocs = pinned_memory_stats().allocations;
  sh.offload();  // already offloaded: a no-op
  CHECK(sh.offloaded());
  CHECK(sh.offload_transfer_bytes() == transfer);
  CHECK(pinned_memory_stats().allocations == allocs);

  nn::Qwen3Model::Context ctx;
  CHECK_THROWS_WITH(sh.forward(mb.batch, ctx), ContainsSubstring("Sharded::forward: Sharded is offloaded"));
  CHECK_THROWS_WITH(sh.loss_and_backward(mb.batch, mb.targets), ContainsSubstring(kOffloaded));
  CHECK_THROWS_WITH(sh.zero_grad(), ContainsSubstring(kOffloaded));
  CHECK_THROWS_WITH(sh.optimizer_step(kLr), ContainsSubstring("Sharded::optimizer_step: Sharded is offloaded"));
  // The module's parameters have no values (their memory went to the host)
  // and the optimizer holds no moments; the step count stays.
  sh.module().for_each_parameter([](nn::Parameter& p) {
    CHECK_FALSE(p.value.defined());
    CHECK_FALSE(p.grad.defined());
  });
  CHECK(sh.optimizer().state_tensors().empty());
  CHECK(sh.optimizer().step_count() == 1);
  // Checkpoint reads: the host masters.
  for (const std::string& name : sh.parameter_names()) {
    INFO(name);
    CHECK(sh.gather_parameter(name).to_vector<float>() == before.at(name));
  }
  int64_t elements = 0;
  sh.for_each_local_shard([&](const parallel::LocalShard& s) {
    CHECK(s.master.is_pinned());
    elements += s.end - s.begin;
  });
  CHECK(elements == nn::num_parameters(*std::make_unique<nn::Qwen3Model>(make_model(true))));

  sh.onload();
  CHECK_FALSE(sh.offloaded());
  CHECK(sh.optimizer().step_count() == 1);
  const auto moments_after = sh.optimizer().state_tensors();
  REQUIRE(moments_after.size() == moment_values.size());
  for (std::size_t i = 0; i < moments_after.size(); ++i) {
    INFO(moments_after[i].first);
    CHECK(moments_after[i].first == moments_before[i].first);
    CHECK(moments_after[i].second.to_vector<float>() == moment_values[i]);
  }
  sh.module().for_each_parameter([](nn::Parameter& p) { CHECK(p.value.defined()); });
  // Training goes on.
  sh.zero_grad();
  CHECK(std::isfinite(sh.loss_and_backward(mb.batch, mb.targets).loss));
  sh.optimizer_step(kLr);
  CHECK(sh.optimizer().step_count() == 2);
}
