// Sharded<Module, Strategy> around a module that is not Qwen3: a stack of
// Linear + RMSNorm blocks, one unit each, exposing units() and running its
// forward / backward through the hooks (nn/units.hpp). On LocalComm with 1 to
// 4 ranks and every strategy, a user-defined strategy tag included, the
// reduced gradients equal the unwrapped module's on the ranks' inputs
// concatenated (<= 1e-6 relative), and one rank is the identity (bitwise).
#include <catch2/catch_test_macros.hpp>

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/random.hpp"
#include "slime/nn/linear.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/nn/rms_norm.hpp"
#include "slime/nn/units.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using parallel::Sharded;
using slime_test::fsdp::max_rel_diff;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;

namespace {

constexpr int kBlocks = 3;
constexpr int64_t kWidth = 13;  // odd: rows never divide the ranks

// y = norm_i(linear_i(x)) for i = 0 .. kBlocks-1; unit i = block i.
struct Stack {
  struct Context {
    std::vector<nn::Linear::Context> linear;
    std::vector<nn::RMSNorm::Context> norm;
  };
  std::vector<nn::Linear> linear;
  std::vector<nn::RMSNorm> norm;

  Stack() {
    for (int i = 0; i < kBlocks; ++i) {
      const std::string p = "blocks." + std::to_string(i);
      linear.emplace_back(p + ".proj", kWidth, kWidth, nn::ModuleOptions{});
      norm.emplace_back(p + ".norm", kWidth, 1e-6, nn::ModuleOptions{});
    }
    nn::init_parameters(*this, 11, 0.3f);
  }

  template <class F>
  void for_each_parameter(F&& f) {
    for (int i = 0; i < kBlocks; ++i) {
      linear[std::size_t(i)].for_each_parameter(f);
      norm[std::size_t(i)].for_each_parameter(f);
    }
  }

  std::vector<nn::Unit> units() {
    std::vector<nn::Unit> u;
    for (int i = 0; i < kBlocks; ++i) {
      u.push_back({"blocks." + std::to_string(i), {}, nn::UnitKind::dense, 1, false});
      linear[std::size_t(i)].for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
      norm[std::size_t(i)].for_each_parameter([&](nn::Parameter& p) { u.back().params.push_back(&p); });
    }
    return u;
  }

  template <nn::UnitHooks Hooks = nn::NoHooks>
  Tensor forward(const Tensor& x, Context& ctx, const Stream& s, Hooks& hooks) {
    ctx.linear.resize(kBlocks);
    ctx.norm.resize(kBlocks);
    Tensor h = x;
    for (std::size_t i = 0; i < std::size_t(kBlocks); ++i) {
      hooks.forward_begin(i);
      h = norm[i].forward(linear[i].forward(h, ctx.linear[i], s), ctx.norm[i], s);
      hooks.forward_end(i);
    }
    return h;
  }
  template <nn::UnitHooks Hooks = nn::NoHooks>
  void backward(const Context& ctx, const Tensor& dy, const Stream& s, Hooks& hooks) {
    Tensor d = dy;
    for (std::size_t i = std::size_t(kBlocks); i-- > 0;) {
      hooks.backward_begin(i);
      d = linear[i].backward(ctx.linear[i], norm[i].backward(ctx.norm[i], d, s), s);
      hooks.backward_end(i);
    }
  }
};
static_assert(nn::HasUnits<Stack>);

// A strategy the library does not know: shard, keep everything gathered.
struct KeepGathered {
  static constexpr bool shards = true, replicates = false;
  static constexpr bool reshard_after_forward = false, reshard_after_backward = false;
};

// Rank r's rows: 2 + r of them (ranks hold different amounts), and its dy.
Tensor rows_of(int rank, uint64_t seed) {
  Tensor t = Tensor::empty({2 + rank, kWidth}, DType::f32);
  fill_normal(t, seed, uint64_t(rank) * 1000, 0.f, 1.f);
  return t;
}

Tensor concat(int world, uint64_t seed) {
  std::vector<float> all;
  for (int r = 0; r < world; ++r)
    for (float v : rows_of(r, seed).to_vector<float>()) all.push_back(v);
  return Tensor::from_vector(all, {int64_t(all.size()) / kWidth, kWidth});
}

struct Result {
  std::vector<float> y;  // rank 0's output (the reference: rows of rank 0)
  Params grads;
};

Result reference(int world) {
  Stack m;
  nn::zero_grad(m);
  nn::NoHooks none;
  Stack::Context ctx;
  const Tensor y = m.forward(concat(world, 1), ctx, {}, none);
  m.backward(ctx, concat(world, 2), {}, none);
  Result out;
  const std::vector<float> v = y.to_vector<float>();
  out.y.assign(v.begin(), v.begin() + 2 * kWidth);
  m.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = p.grad.to_vector<float>(); });
  return out;
}

template <class S>
Result sharded(int world, const comm::MeshShape* shape = nullptr) {
  Result out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    auto run = [&](auto& sh) {
      TCHECK(sh.num_units() == std::size_t(kBlocks));
      TCHECK(sh.unit_name(1) == "blocks.1");
      sh.zero_grad();
      Stack::Context ctx;
      const Tensor y = sh.forward(rows_of(w.rank(), 1), ctx);
      sh.backward(ctx, rows_of(w.rank(), 2));
      if (w.rank() == 0) out.y = y.to_vector<float>();
      for (const std::string& name : sh.parameter_names()) {
        const std::vector<float> g = sh.gather_gradient(name).template to_vector<float>();
        if (w.rank() == 0) {
          std::lock_guard lock(mutex);
          out.grads[name] = g;
        }
      }
      sh.optimizer_step(1e-2);  // runs on any module's shards
    };
    if (shape) {
      const comm::Mesh mesh(w, *shape);
      Sharded<Stack, S> sh(Stack{}, mesh);
      run(sh);
    } else {
      if constexpr (!(S::shards && S::replicates)) {
        Sharded<Stack, S> sh(Stack{}, w);
        run(sh);
      }
    }
  });
  thread_checks().require_none();
  return out;
}

template <class S>
void check_equals_reference(int world, const comm::MeshShape* shape = nullptr) {
  const Result want = reference(world);
  const Result got = sharded<S>(world, shape);
  const double dy = max_rel_diff(Params{{"y", got.y}}, Params{{"y", want.y}});
  const double dg = max_rel_diff(got.grads, want.grads);
  INFO("output difference " << dy << ", gradient difference " << dg);
  CHECK(dy <= 1e-6);
  CHECK(dg <= 1e-6);
}

}  // namespace

TEST_CASE("Sharded wraps a non-Qwen module with units: every strategy equals the unwrapped module", "[fsdp]") {
  for (int world = 1; world <= 4; ++world) {
    INFO(world << " ranks");
    {
      INFO("FullShard");
      check_equals_reference<parallel::FullShard>(world);
    }
    {
      INFO("ShardGradOp");
      check_equals_reference<parallel::ShardGradOp>(world);
    }
    {
      INFO("NoShard");
      check_equals_reference<parallel::NoShard>(world);
    }
    {
      INFO("a user-defined strategy tag");
      check_equals_reference<KeepGathered>(world);
    }
  }
  {
    INFO("HybridShard dp_replicate 2 x dp_shard 2");
    const comm::MeshShape shape{.dp_replicate = 2, .dp_shard = 2, .cp = 1, .ep = 1};
    check_equals_reference<parallel::HybridShard>(4, &shape);
  }
}

TEST_CASE("Sharded around a non-Qwen module: one rank is the identity, bit for bit", "[fsdp]") {
  const Result want = reference(1);
  const Result got = sharded<parallel::FullShard>(1);
  CHECK(got.y == want.y);
  for (const auto& [name, g] : want.grads) {
    INFO(name);
    CHECK(got.grads.at(name) == g);
  }
}

// The head calls (logits, token logprobs, the causal-LM loss) exist only
// where the module has them.
template <class S>
concept HasLogits = requires(S& sh, const Tensor& t) {
  sh.logits(t);
};
static_assert(!HasLogits<Sharded<Stack, parallel::FullShard>>);
static_assert(HasLogits<Sharded<nn::Qwen3Model, parallel::FullShard>>);
