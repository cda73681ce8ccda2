// parallel::Frozen<Module, Strategy> (Sharded with optim::NoOptimizer) on
// LocalComm: 1 to 4 ranks with FullShard, ShardGradOp and NoShard score a
// tiny Qwen3 (dense and MoE, tied and untied) like the unwrapped model
// (bitwise at degree 1, <= 1e-6 otherwise); a rank holds only its master
// shard, which is the compute shard in the module's dtype (f32 and bf16),
// bytes from the allocator statistics against the bound of FlatShardLayout;
// no gradient is ever allocated; backward, zero_grad, optimizer_step,
// grad_norm and gather_gradient throw "frozen"; gather_parameter /
// load_parameter copy a trained policy's weights in; runtime offload moves
// the shards (a frozen model copies them to the host once).
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/optimizer.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::Frozen;
using parallel::FullShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::error_of;
using slime_test::fsdp::make_model;
using slime_test::fsdp::micro_batch;
using slime_test::fsdp::MicroBatch;
using slime_test::fsdp::thread_checks;
using slime_test::fsdp::tiny_config;

static_assert(!Frozen<nn::Qwen3Model>::trains);
static_assert(Sharded<nn::Qwen3Model, FullShard>::trains);
static_assert(std::is_same_v<Frozen<nn::Qwen3Model>, Sharded<nn::Qwen3Model, FullShard, optim::NoOptimizer>>);

namespace {

std::vector<float> logprobs_of(nn::Qwen3Model& m, const MicroBatch& mb) {
  nn::Qwen3Model::Context ctx;
  const Tensor h = m.forward(mb.batch, ctx);
  return m.token_logprobs(h, mb.targets).logprobs.to_vector<float>();
}

template <class F>
std::vector<float> logprobs_of(F& frozen, const MicroBatch& mb) {
  nn::Qwen3Model::Context ctx;
  const Tensor h = frozen.forward(mb.batch, ctx);
  const Tensor lp = frozen.token_logprobs(h, mb.targets).logprobs;
  return lp.to_vector<float>();
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 1e30;
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double(a[i]) - double(b[i])));
  return m;
}

bool bitwise(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// The elements of a rank's shards under FlatShardLayout over `world` ranks,
// bounded per parameter p of rows r_p, row size e_p and numel n_p: the piece
// has rows_per_rank = ceil(r_p / world) rounded up to a multiple of
// s_p = 16 / gcd(16, e_p) rows, so
//   piece_p <= (ceil(r_p / world) + s_p - 1) e_p < n_p / world + s_p e_p,
// where s_p e_p = lcm(16, e_p) (kFlatShardAlign = 16).
int64_t shard_bound(nn::Qwen3Model& m, int world) {
  int64_t bound = 0;
  m.for_each_parameter([&](nn::Parameter& p) {
    const Shape& s = p.value.shape();
    const int64_t rows = s.rank() == 0 ? 1 : s[0], numel = s.numel();
    const int64_t e = rows > 0 ? numel / rows : 0;
    const int64_t step = e > 0 ? parallel::kFlatShardAlign / std::gcd(parallel::kFlatShardAlign, e) : 1;
    bound += ((rows + world - 1) / world + step - 1) * e;
  });
  return bound;
}

int64_t padding_bound(nn::Qwen3Model& m) {
  int64_t pad = 0;
  m.for_each_parameter([&](nn::Parameter& p) {
    const Shape& s = p.value.shape();
    const int64_t rows = s.rank() == 0 ? 1 : s[0];
    const int64_t e = rows > 0 ? s.numel() / rows : 0;
    pad += e > 0 ? std::lcm(parallel::kFlatShardAlign, e) : 0;
  });
  return pad;
}

}  // namespace

TEMPLATE_TEST_CASE("Frozen on 1-4 LocalComm ranks scores like the unwrapped model", "[fsdp][frozen]", FullShard,
                   ShardGradOp, NoShard) {
  for (const bool moe : {false, true}) {
    for (const bool tied : {false, true}) {
      for (int ranks = 1; ranks <= 4; ++ranks) {
        INFO("ranks " << ranks << (tied ? ", tied" : "") << (moe ? ", MoE" : ""));
        nn::Qwen3Model plain = make_model(tiny_config(tied, moe));
        std::vector<std::vector<float>> want;
        for (int r = 0; r < ranks; ++r)
          for (int step = 0; step < 2; ++step) want.push_back(logprobs_of(plain, micro_batch(step, r, 0, 37)));
        std::vector<double> diff(std::size_t(ranks), 0);
        std::vector<int> same(std::size_t(ranks), 1);
        comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
          Frozen<nn::Qwen3Model, TestType> ref(make_model(tiny_config(tied, moe)), comm);
          const std::size_t r = std::size_t(comm.rank());
          for (int step = 0; step < 2; ++step) {
            const std::vector<float> got = logprobs_of(ref, micro_batch(step, comm.rank(), 0, 37));
            const std::vector<float>& w = want[r * 2 + std::size_t(step)];
            diff[r] = std::max(diff[r], max_abs_diff(got, w));
            same[r] = same[r] && bitwise(got, w);
          }
          // No gradient anywhere; FullShard keeps nothing gathered after the head.
          ref.module().for_each_parameter([&](nn::Parameter& p) { TCHECK(!p.grad.defined()); });
          if (TestType::reshard_after_forward && comm.size() > 1)
            for (std::size_t u = 0; u < ref.num_units(); ++u) TCHECK(!ref.is_gathered(u));
        });
        thread_checks().require_none();
        for (int r = 0; r < ranks; ++r) {
          INFO("rank " << r << ": max |difference| " << diff[std::size_t(r)]);
          if (ranks == 1) CHECK(same[std::size_t(r)] == 1);
          CHECK(diff[std::size_t(r)] <= 1e-6);
        }
      }
    }
  }
}

TEST_CASE("Frozen: a rank holds its master shard only, in the module's dtype (1/N of the model)", "[fsdp][frozen]") {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    nn::Qwen3Model model(tiny_config(false, true), {Device::cpu(), dtype});
    model.init_random(11, 0.2f);
    const int64_t numel = nn::num_parameters(model);
    const int64_t pad = padding_bound(model);
    const std::size_t es = dtype_size(dtype);
    std::vector<int64_t> bounds(5);
    for (int w = 1; w <= 4; ++w) bounds[std::size_t(w)] = shard_bound(model, w);
    for (int ranks = 1; ranks <= 4; ++ranks) {
      INFO(dtype_name(dtype) << ", " << ranks << " ranks, " << numel << " parameters");
      std::vector<int64_t> freed(static_cast<std::size_t>(ranks)), shard(static_cast<std::size_t>(ranks));
      std::vector<std::vector<uint8_t>> gathered(static_cast<std::size_t>(ranks));
      comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
        nn::Qwen3Model m(tiny_config(false, true), {Device::cpu(), dtype});
        m.init_random(11, 0.2f);
        std::optional<Frozen<nn::Qwen3Model>> ref;
        ref.emplace(std::move(m), comm);
        TCHECK(ref->compute_dtype() == dtype);
        int64_t s = 0;
        for (std::size_t u = 0; u < ref->num_units(); ++u) s += ref->unit_layout(u).shard_numel();
        const std::size_t r = std::size_t(comm.rank());
        shard[r] = s;
        // The master is the compute shard: gather_parameter returns the module's dtype.
        const Tensor w = ref->gather_parameter("model.embed_tokens.weight");
        TCHECK(w.dtype() == dtype);
        const auto* b = static_cast<const uint8_t*>(w.data_ptr());
        gathered[r].assign(b, b + w.nbytes());
        for (int q = 0; q < comm.size(); ++q) {
          comm.barrier();
          if (q == comm.rank()) {
            const int64_t before = memory_stats(Device::cpu()).current_bytes;
            ref.reset();
            freed[r] = before - memory_stats(Device::cpu()).current_bytes;
          }
          comm.barrier();
        }
      });
      thread_checks().require_none();
      std::vector<uint8_t> want;
      model.for_each_parameter([&](nn::Parameter& p) {
        if (p.name != "model.embed_tokens.weight") return;
        const auto* b = static_cast<const uint8_t*>(p.value.data_ptr());
        want.assign(b, b + p.value.nbytes());
      });
      for (int r = 0; r < ranks; ++r) {
        const int64_t s = shard[std::size_t(r)];
        INFO("rank " << r << ": S = " << s << " elements, " << freed[std::size_t(r)] << " bytes; unsharded "
                     << numel * int64_t(es) << " bytes / " << ranks << " = " << numel * int64_t(es) / ranks
                     << ", padding bound " << pad << " elements");
        // Exactly the master shard: no grad shard, no optimizer state, no f32 copy.
        CHECK(freed[std::size_t(r)] == s * int64_t(es));
        CHECK(s <= bounds[std::size_t(ranks)]);
        CHECK(double(s) < double(numel) / ranks + double(pad));
        CHECK(gathered[std::size_t(r)] == want);
      }
    }
  }
}

TEST_CASE("Frozen: training calls throw 'frozen', cpu_offload is refused, NoOptimizer takes no step",
          "[fsdp][frozen]") {
  auto group = comm::LocalComm::create_group(1);
  comm::Comm& comm = *group[0];
  Frozen<nn::Qwen3Model> ref(make_model(tiny_config(false)), comm);
  const MicroBatch mb = micro_batch(0, 0, 0, 37);
  nn::Qwen3Model::Context ctx;
  const Tensor hidden = ref.forward(mb.batch, ctx);
  const ops::TokenLogprobs lp = ref.token_logprobs(hidden, mb.targets);
  const Tensor g = Tensor::zeros({mb.batch.num_tokens()}, DType::f32);
  CHECK_THROWS_WITH(ref.backward(ctx, hidden), ContainsSubstring("Sharded::backward: the model is frozen"));
  CHECK_THROWS_WITH(ref.token_logprobs_backward(hidden, mb.targets, 1.f, lp, g, Tensor{}), ContainsSubstring("frozen"));
  CHECK_THROWS_WITH(ref.loss_and_backward(mb.batch, mb.targets), ContainsSubstring("frozen"));
  CHECK_THROWS_WITH(ref.zero_grad(), ContainsSubstring("Sharded::zero_grad: the model is frozen"));
  CHECK_THROWS_WITH(ref.optimizer_step(1e-2), ContainsSubstring("Sharded::optimizer_step: the model is frozen"));
  CHECK_THROWS_WITH(ref.grad_norm(), ContainsSubstring("frozen"));
  CHECK_THROWS_WITH(ref.gather_gradient("model.norm.weight"), ContainsSubstring("frozen"));
  CHECK(ref.logits(hidden).size(1) == 37);
  CHECK(ref.optimizer().state_tensors().empty());
  CHECK(ref.optimizer().step_count() == 0);
  ref.module().for_each_parameter([](nn::Parameter& p) { CHECK_FALSE(p.grad.defined()); });

  parallel::ShardedOptions off;
  off.cpu_offload = true;
  CHECK_THROWS_WITH((Frozen<nn::Qwen3Model>(make_model(tiny_config(false)), comm, off)),
                    ContainsSubstring("the model is frozen"));
  optim::NoOptimizer none;
  const std::vector<Tensor> t = {Tensor::zeros({4}, DType::f32)};
  CHECK_THROWS_WITH(none.step(t, t, 1e-2), ContainsSubstring("takes no optimizer step"));
  CHECK_THROWS_WITH(none.set_step_count(3), ContainsSubstring("frozen"));
  none.set_step_count(0);
}

TEST_CASE("Frozen: load_parameter copies a trained policy in, offload / onload move the shards once",
          "[fsdp][frozen]") {
  for (int ranks : {1, 3}) {
    INFO(ranks << " ranks");
    struct Result {
      int same_before = 0, same_after_update = 0, same_after_cycles = 0, differs = 0;
      int64_t shard = 0, freed = 0, first_transfer = 0, later_transfer = -1, reload_transfer = 0;
      int64_t pinned = 0, restored = 0;
    };
    std::vector<Result> res(static_cast<std::size_t>(ranks));
    comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
      Result& x = res[std::size_t(comm.rank())];
      const MicroBatch mb = micro_batch(0, comm.rank(), 0, 37);
      Sharded<nn::Qwen3Model, FullShard> policy(make_model(tiny_config(true)), comm);
      Frozen<nn::Qwen3Model> ref(make_model(tiny_config(true)), comm);
      for (std::size_t u = 0; u < ref.num_units(); ++u) x.shard += ref.unit_layout(u).shard_numel();
      x.same_before = bitwise(logprobs_of(ref, mb), logprobs_of(policy, mb));
      // The policy trains a step: the reference stays, then takes its weights.
      policy.zero_grad();
      policy.loss_and_backward(mb.batch, mb.targets);
      policy.optimizer_step(5e-2);
      const std::vector<float> trained = logprobs_of(policy, mb);
      x.differs = max_abs_diff(logprobs_of(ref, mb), trained) > 1e-4;
      for (const std::string& name : policy.parameter_names())
        ref.load_parameter(name, policy.gather_parameter(name));  // collective gather, local load
      x.same_after_update = bitwise(logprobs_of(ref, mb), trained);
      // Offload: the master shards go to pinned memory (the only state).
      auto in_turn = [&](auto&& f) {
        for (int q = 0; q < comm.size(); ++q) {
          comm.barrier();
          if (q == comm.rank()) f();
          comm.barrier();
        }
      };
      in_turn([&] {
        const int64_t h0 = memory_stats(Device::cpu()).current_bytes, p0 = pinned_memory_stats().current_bytes;
        const int64_t cached = ref.cached_buffer_bytes();  // the reused gather buffers, freed too
        ref.offload();
        x.freed = h0 - memory_stats(Device::cpu()).current_bytes - cached;
        x.pinned = pinned_memory_stats().current_bytes - p0;
        x.first_transfer = int64_t(ref.offload_transfer_bytes());
        const int64_t h1 = memory_stats(Device::cpu()).current_bytes;
        ref.onload();
        x.restored = memory_stats(Device::cpu()).current_bytes - h1;
        for (int c = 0; c < 3; ++c) {
          ref.offload();  // unchanged masters: nothing to copy
          x.later_transfer = std::max(x.later_transfer, int64_t(ref.offload_transfer_bytes()));
          ref.onload();
        }
      });
      x.same_after_cycles = bitwise(logprobs_of(ref, mb), trained);
      // A load after onload marks the host copies stale: the next offload copies.
      ref.load_parameter("model.norm.weight", policy.gather_parameter("model.norm.weight"));
      ref.offload();
      x.reload_transfer = int64_t(ref.offload_transfer_bytes());
      // Reads while offloaded: the host masters.
      TCHECK(ref.gather_parameter("model.norm.weight").to_vector<float>() ==
             policy.gather_parameter("model.norm.weight").to_vector<float>());
      ref.onload();
      x.same_after_cycles = x.same_after_cycles && bitwise(logprobs_of(ref, mb), trained);
    });
    thread_checks().require_none();
    for (int r = 0; r < ranks; ++r) {
      const Result& x = res[std::size_t(r)];
      INFO("rank " << r << ": S = " << x.shard);
      CHECK(x.same_before == 1);
      CHECK(x.differs == 1);
      CHECK(x.same_after_update == 1);
      CHECK(x.same_after_cycles == 1);
      CHECK(x.freed == 4 * x.shard);
      CHECK(x.pinned == 4 * x.shard);
      CHECK(x.first_transfer == 4 * x.shard);
      CHECK(x.restored == 4 * x.shard);
      CHECK(x.later_transfer == 0);
      CHECK(x.reload_transfer == 4 * x.shard);
    }
  }
}
