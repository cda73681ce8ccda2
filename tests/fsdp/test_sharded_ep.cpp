// Sharded<Qwen3Model, Strategy> composed with ExpertParallel on LocalComm: a
// tiny Qwen3-MoE (8 experts, top-2, layer 0 dense, layers 1 and 2 sparse) on
// meshes dp x ep = 1 x 2, 2 x 2 and 1 x 4 (and HybridShard 2 x 1 x 2) trains
// 3 AdamW steps on per-rank data and must end with the parameters of the
// unwrapped, unsharded model without expert parallelism trained on every
// rank's micro-batch with the same global normaliser (<= 1e-6 relative; the
// expert stacks reassembled from the ep ranks' slices). Also: avg reduction,
// grad-norm clipping, the units and groups, checkpoint access of expert
// stacks (this ep rank's slice) and bad input.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::ExpertParallel;
using parallel::FullShard;
using parallel::HybridShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::error_of;
using slime_test::fsdp::max_rel_diff;
using slime_test::fsdp::micro_batch;
using slime_test::fsdp::MicroBatch;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;

namespace {

constexpr int64_t kExperts = 8;
constexpr int64_t kVocab = 37;
constexpr double kLr = 1e-2;
constexpr int kSteps = 3;

nn::Qwen3Config moe_config() {
  nn::Qwen3Config c;
  c.model_type = "qwen3_moe";
  c.num_experts = kExperts;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 12;
  c.mlp_only_layers = {0};
  c.vocab_size = kVocab;  // prime: the embedding rows never divide the ranks
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.rope_theta = 100.0;
  return c;
}

nn::Qwen3Model full_model() {
  nn::Qwen3Model m(moe_config(), {});
  m.init_random(7, 0.2f);
  return m;
}

// The model with `ep`'s slice of the experts, its values those of full_model().
nn::Qwen3Model ep_model(ExpertParallel<>& ep) {
  nn::Qwen3Model full = full_model();
  nn::Qwen3Model m(moe_config(), {}, &ep);
  slime_test::fsdp::copy_expert_slices(full, m);
  return m;
}

struct RunConfig {
  comm::MeshShape mesh;
  int world = 2;
  double max_grad_norm = 0;
  parallel::ShardedOptions options;
};

int64_t global_tokens(int world, int step) {
  int64_t n = 0;
  for (int r = 0; r < world; ++r) n += micro_batch(step, r, 0, kVocab).batch.num_tokens();
  return n;
}

// The micro-batches of `step` of ranks [first, first + count), concatenated
// in rank order (one packed batch).
MicroBatch concatenated(int first, int count, int step) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int r = first; r < first + count; ++r) {
    const MicroBatch mb = micro_batch(step, r, 0, kVocab);
    const std::vector<int32_t> tokens = mb.batch.tokens.to_vector<int32_t>();
    const std::vector<int32_t> cu = mb.batch.cu_seqlens.to_vector<int32_t>();
    for (std::size_t i = 0; i + 1 < cu.size(); ++i)
      seqs.emplace_back(tokens.begin() + cu[i], tokens.begin() + cu[i + 1]);
    for (int32_t t : mb.targets.to_vector<int32_t>()) targets.push_back(t);
  }
  MicroBatch m;
  m.batch = nn::make_packed_batch(seqs);
  m.targets = Tensor::from_vector(targets, {int64_t(targets.size())});
  return m;
}

// The unwrapped model without expert parallelism trained on every rank's
// micro-batch with the global normaliser: the ranks' data concatenated, one
// backward per data-parallel group (its ep ranks' batches in rank order,
// which is the order in which expert parallelism hands the experts their
// rows), the groups' gradients summed, as the reductions do. The numbers are
// the unsplit batch's up to f32 rounding; the grouping keeps the sums in the
// sharded run's order, since AdamW's first steps (about lr * sign(g))
// magnify the rounding of near-zero gradients past 1e-6.
Params reference_run(const RunConfig& rc) {
  nn::Qwen3Model model = full_model();
  optim::AdamW opt;
  const int ep = rc.mesh.ep;
  for (int step = 0; step < kSteps; ++step) {
    nn::zero_grad(model);
    const double norm = double(global_tokens(rc.world, step));
    for (int first = 0; first < rc.world; first += ep) {
      const MicroBatch mb = concatenated(first, ep, step);
      model.loss_and_backward(mb.batch, mb.targets, 1.f, norm);
    }
    slime_test::fsdp::reference_step(model, opt, kLr, rc.max_grad_norm);
  }
  return slime_test::fsdp::parameters_of(model);
}

// Every rank trains on its own micro-batches (data rank = world rank); the
// gathered parameters, expert stacks reassembled from the ep slices.
template <class S>
Params sharded_run(const RunConfig& rc, std::vector<double>* norms = nullptr) {
  Params out;
  std::mutex mutex;
  comm::run_local_ranks(rc.world, [&](comm::Comm& world) {
    const comm::Mesh mesh(world, rc.mesh);
    ExpertParallel<> ep(mesh, kExperts);
    Sharded<nn::Qwen3Model, S> sh(ep_model(ep), mesh, rc.options);
    const int dp = mesh.size(comm::Axis::dp_replicate) * mesh.size(comm::Axis::dp_shard);
    const int nep = mesh.size(comm::Axis::ep);
    if constexpr (S::shards) {
      TCHECK(sh.shard_world() == mesh.size(comm::Axis::dp_shard) * nep);
      TCHECK(sh.expert_shard_world() == mesh.size(comm::Axis::dp_shard));
    } else {
      TCHECK(sh.replicate_world() == dp * nep);
      TCHECK(sh.expert_replicate_world() == dp);
    }
    // embed, layer 0, layer 1 + experts, layer 2 + experts, norm + lm_head
    TCHECK(sh.num_units() == (nep > 1 ? 7u : 5u));
    if (nep > 1) {
      TCHECK(sh.unit_name(3) == "model.layers.1.mlp.experts");
      TCHECK(sh.is_expert_unit(3));
      TCHECK(sh.is_expert_unit(5));
      TCHECK(!(sh.is_expert_unit(4)));
    }
    for (int step = 0; step < kSteps; ++step) {
      sh.zero_grad();
      double norm = double(global_tokens(world.size(), step));
      if (rc.options.gradient_reduce == comm::ReduceOp::avg) norm /= world.size();
      MicroBatch mb = micro_batch(step, world.rank(), 0, kVocab);
      sh.loss_and_backward(mb.batch, mb.targets, 1.f, norm);
      const std::optional<double> n = sh.optimizer_step(kLr, rc.max_grad_norm);
      if (n && norms && world.rank() == 0) norms->push_back(*n);
    }
    slime_test::fsdp::gather_full(sh, mesh, kExperts, out, mutex);
  });
  thread_checks().require_none();
  return out;
}

}  // namespace

TEST_CASE("Sharded<FullShard> with ExpertParallel equals the unsharded model", "[fsdp][moe][ep]") {
  struct Case {
    int dp, ep;
  };
  for (const Case c : {Case{1, 2}, Case{2, 2}, Case{1, 4}}) {
    INFO("dp " << c.dp << " x ep " << c.ep);
    RunConfig rc;
    rc.mesh = comm::MeshShape{.dp_replicate = 1, .dp_shard = c.dp, .cp = 1, .ep = c.ep};
    rc.world = c.dp * c.ep;
    const Params want = reference_run(rc);
    const Params got = sharded_run<FullShard>(rc);
    const double d = max_rel_diff(got, want);
    INFO("max relative difference " << d);
    CHECK(d <= 1e-6);
  }
}

TEST_CASE("Sharded with ExpertParallel: ShardGradOp, NoShard and HybridShard equal the unsharded model",
          "[fsdp][moe][ep]") {
  RunConfig rc;
  rc.world = 4;
  rc.mesh = comm::MeshShape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2};
  const Params want = reference_run(rc);
  {
    INFO("ShardGradOp dp 2 x ep 2");
    CHECK(max_rel_diff(sharded_run<ShardGradOp>(rc), want) <= 1e-6);
  }
  {
    INFO("NoShard dp 2 x ep 2");
    CHECK(max_rel_diff(sharded_run<NoShard>(rc), want) <= 1e-6);
  }
  {
    INFO("HybridShard dp_replicate 2 x dp_shard 1 x ep 2");
    RunConfig h = rc;
    h.mesh = comm::MeshShape{.dp_replicate = 2, .dp_shard = 1, .cp = 1, .ep = 2};
    CHECK(max_rel_diff(sharded_run<HybridShard>(h), want) <= 1e-6);
  }
}

TEST_CASE("Sharded with ExpertParallel: avg reduction and grad-norm clipping", "[fsdp][moe][ep]") {
  RunConfig rc;
  rc.world = 4;
  rc.mesh = comm::MeshShape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2};
  for (const int dp : {1, 2}) {
    // dp 1: the expert units have groups of one rank, and still their 1 / ep.
    INFO("avg: every gradient divided by the " << 2 * dp << " data-parallel ranks (dp " << dp << " x ep 2)");
    RunConfig a = rc;
    a.world = 2 * dp;
    a.mesh.dp_shard = dp;
    a.options.gradient_reduce = comm::ReduceOp::avg;
    CHECK(max_rel_diff(sharded_run<FullShard>(a), reference_run(a)) <= 1e-6);
  }
  RunConfig clip = rc;
  clip.max_grad_norm = 0.05;  // below the gradient norm: clipping scales every step
  const Params want = reference_run(clip);
  std::vector<double> full_norms, noshard_norms;
  CHECK(max_rel_diff(sharded_run<FullShard>(clip, &full_norms), want) <= 1e-6);
  CHECK(max_rel_diff(sharded_run<NoShard>(clip, &noshard_norms), want) <= 1e-6);
  REQUIRE(full_norms.size() == std::size_t(kSteps));
  REQUIRE(noshard_norms.size() == std::size_t(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    CHECK(full_norms[std::size_t(s)] > clip.max_grad_norm);
    CHECK(std::abs(full_norms[std::size_t(s)] - noshard_norms[std::size_t(s)]) <= 1e-6 * full_norms[std::size_t(s)]);
  }
}

TEST_CASE("Sharded with ExpertParallel: checkpoint access of expert stacks is this ep rank's slice",
          "[fsdp][moe][ep]") {
  comm::run_local_ranks(4, [&](comm::Comm& world) {
    const comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2});
    ExpertParallel<> ep(mesh, kExperts);
    Sharded<nn::Qwen3Model, FullShard> sh(ep_model(ep), mesh);
    const int64_t local = kExperts / 2, first = mesh.coord(comm::Axis::ep) * local;
    const int dp_rank = mesh.coord(comm::Axis::dp_shard);
    int experts = 0;
    sh.for_each_local_shard([&](const parallel::LocalShard& s) {
      const bool stack = s.name.find("{}") != std::string::npos;
      TCHECK(s.expert == stack);
      if (!stack) return;
      ++experts;
      TCHECK(s.first_expert == first);
      TCHECK(s.shape[0] == local);
      // Sharded over the 2 dp ranks only: rank 0 holds the first half of the slice.
      TCHECK(s.begin == (dp_rank == 0 ? 0 : s.shape.numel() / 2));
      TCHECK(s.end == (dp_rank == 0 ? s.shape.numel() / 2 : s.shape.numel()));
    });
    TCHECK(experts == 6);  // 3 stacks x 2 sparse layers
    // The module's initial values, gathered back, then loaded and gathered again.
    const std::string name = "model.layers.2.mlp.experts.{}.down_proj.weight";
    nn::Qwen3Model full = full_model();
    std::vector<float> want;
    full.for_each_parameter([&](nn::Parameter& p) {
      if (p.name == name) {
        const std::vector<float> all = p.value.to_vector<float>();
        const std::size_t per = all.size() / std::size_t(kExperts);
        want.assign(all.begin() + std::ptrdiff_t(std::size_t(first) * per),
                    all.begin() + std::ptrdiff_t(std::size_t(first + local) * per));
      }
    });
    const Tensor slice = sh.gather_parameter(name);
    TCHECK(slice.shape() == sh.parameter_shape(name));
    TCHECK(slice.to_vector<float>() == want);
    Tensor doubled = Tensor::empty(slice.shape(), DType::f32);
    ops::scale(slice, 2.f, doubled);
    sh.load_parameter(name, doubled);
    TCHECK(sh.gather_parameter(name).to_vector<float>() == doubled.to_vector<float>());
    TCHECK(!(sh.is_expert_parameter("model.layers.1.mlp.gate.weight")));
    TCHECK(sh.parameter_first_expert("model.layers.1.mlp.gate.weight") == 0);
  });
  thread_checks().require_none();
}

TEST_CASE("Sharded with ExpertParallel: bad input gives clear errors", "[fsdp][moe][ep]") {
  std::vector<std::string> plain_comm(2), wrong_degree(4);
  comm::run_local_ranks(2, [&](comm::Comm& world) {
    ExpertParallel<> ep(world, kExperts);
    plain_comm[std::size_t(world.rank())] = error_of([&] { Sharded<nn::Qwen3Model, FullShard>(ep_model(ep), world); });
  });
  comm::run_local_ranks(4, [&](comm::Comm& world) {
    const comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2});
    ExpertParallel<> ep(world, kExperts);  // over all 4 ranks, not the mesh's ep axis
    wrong_degree[std::size_t(world.rank())] = error_of([&] { Sharded<nn::Qwen3Model, FullShard>(ep_model(ep), mesh); });
  });
  for (const std::string& e : plain_comm) CHECK_THAT(e, ContainsSubstring("build Sharded from a comm::Mesh"));
  for (const std::string& e : wrong_degree) CHECK_THAT(e, ContainsSubstring("degree 4 but the mesh has ep = 2"));
}

// ---- the MoE load-balancing loss under Sharded -----------------------------
//
// With output_router_logits the loss includes router_aux_loss_coef · aux over
// the router outputs of the whole data-parallel batch (Sharded all-reduces
// the per-expert statistics), so the loss and every reduced gradient equal
// the unsharded model's on the ranks' batches concatenated (one backward).

namespace {

constexpr double kAuxCoef = 0.5;  // large, so the aux gradient is a visible part of the router's

nn::Qwen3Config aux_config() {
  nn::Qwen3Config c = moe_config();
  c.output_router_logits = true;
  c.router_aux_loss_coef = kAuxCoef;
  return c;
}

// The model with `ep`'s slice of the experts (every expert without one),
// values those of full_model() (the same seed and draw for each config).
nn::Qwen3Model aux_model(ExpertParallel<>* ep) {
  nn::Qwen3Model m(aux_config(), {}, ep);
  nn::init_parameters(m, 7, 0.2f);
  return m;
}

struct AuxResult {
  double loss = 0, aux = 0;  // the step's loss (CE summed over ranks + coef · aux) and aux
  Params grads;              // every gradient by name (expert stacks whole)
};

AuxResult aux_reference(int world) {
  nn::Qwen3Model model = aux_model(nullptr);
  nn::zero_grad(model);
  const MicroBatch mb = concatenated(0, world, 0);
  const nn::LossResult r = model.loss_and_backward(mb.batch, mb.targets, 1.f, double(global_tokens(world, 0)));
  AuxResult out{r.loss, r.aux_loss, {}};
  model.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = p.grad.to_vector<float>(); });
  return out;
}

template <class S>
AuxResult aux_sharded(const comm::MeshShape& shape, int world, comm::ReduceOp reduce = comm::ReduceOp::sum) {
  AuxResult out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    const comm::Mesh mesh(w, shape);
    ExpertParallel<> ep(mesh, kExperts);
    parallel::ShardedOptions opt;
    opt.gradient_reduce = reduce;
    Sharded<nn::Qwen3Model, S> sh(aux_model(&ep), mesh, opt);
    sh.zero_grad();
    double norm = double(global_tokens(world, 0));
    if (reduce == comm::ReduceOp::avg) norm /= world;
    const MicroBatch mb = micro_batch(0, w.rank(), 0, kVocab);
    const nn::LossResult r = sh.loss_and_backward(mb.batch, mb.targets, 1.f, norm);
    {
      std::lock_guard lock(mutex);
      // Each rank's loss is its CE share + coef · (the same global aux).
      const double ce =
          reduce == comm::ReduceOp::avg ? (r.loss - kAuxCoef * r.aux_loss) / world : r.loss - kAuxCoef * r.aux_loss;
      out.loss += ce;
      if (w.rank() == 0) {
        out.aux = r.aux_loss;
        out.loss += kAuxCoef * r.aux_loss;
      }
    }
    slime_test::fsdp::gather_full(sh, mesh, kExperts, out.grads, mutex, slime_test::fsdp::Gathered::gradients);
  });
  thread_checks().require_none();
  return out;
}

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

}  // namespace

TEST_CASE("Sharded: the MoE aux loss and its gradients equal the unsharded model's, 1-4 ranks, with and without EP",
          "[fsdp][moe][ep][aux]") {
  struct Case {
    int dp, ep;
  };
  for (const Case c : {Case{1, 1}, Case{2, 1}, Case{3, 1}, Case{4, 1}, Case{1, 2}, Case{2, 2}, Case{1, 4}}) {
    INFO("dp " << c.dp << " x ep " << c.ep);
    const int world = c.dp * c.ep;
    const comm::MeshShape shape{.dp_replicate = 1, .dp_shard = c.dp, .cp = 1, .ep = c.ep};
    const AuxResult want = aux_reference(world);
    CHECK(want.aux > 0);
    for (int strategy = 0; strategy < 2; ++strategy) {
      INFO((strategy == 0 ? "FullShard" : "NoShard"));
      if (strategy == 1 && c.dp > 1 && c.ep > 1) continue;  // NoShard replicates over one axis
      const AuxResult got = strategy == 0 ? aux_sharded<FullShard>(shape, world) : aux_sharded<NoShard>(shape, world);
      INFO("aux " << got.aux << " vs " << want.aux << ", loss " << got.loss << " vs " << want.loss);
      CHECK(rel(got.aux, want.aux) <= 1e-6);
      CHECK(rel(got.loss, want.loss) <= 1e-6);
      const double d = max_rel_diff(got.grads, want.grads);
      INFO("max relative gradient difference " << d);
      CHECK(d <= 1e-6);
    }
  }
  SECTION("avg reduction: the aux scale undoes the division by the ranks") {
    const comm::MeshShape shape{.dp_replicate = 1, .dp_shard = 2, .cp = 1, .ep = 2};
    const AuxResult want = aux_reference(4);
    const AuxResult got = aux_sharded<FullShard>(shape, 4, comm::ReduceOp::avg);
    CHECK(rel(got.aux, want.aux) <= 1e-6);
    // avg divides every gradient by the 4 ranks: the CE normaliser was divided
    // by 4 too and the aux scale multiplied by 4, so the result is the sum's.
    CHECK(max_rel_diff(got.grads, want.grads) <= 1e-6);
  }
}

TEST_CASE("Sharded at degree 1 is the identity, aux loss included (bitwise)", "[fsdp][moe][aux]") {
  nn::Qwen3Model plain = aux_model(nullptr);
  const MicroBatch mb = micro_batch(0, 0, 0, kVocab);
  nn::zero_grad(plain);
  const nn::LossResult want = plain.loss_and_backward(mb.batch, mb.targets);
  Params want_grads;
  plain.for_each_parameter([&](nn::Parameter& p) { want_grads[p.name] = p.grad.to_vector<float>(); });
  REQUIRE(want.aux_loss > 0);
  for (int strategy = 0; strategy < 2; ++strategy) {
    INFO((strategy == 0 ? "FullShard" : "NoShard"));
    nn::LossResult got;
    Params got_grads;
    comm::run_local_ranks(1, [&](comm::Comm& w) {
      auto run = [&](auto& sh) {
        sh.zero_grad();
        got = sh.loss_and_backward(mb.batch, mb.targets);
        for (const std::string& name : sh.parameter_names())
          got_grads[name] = sh.gather_gradient(name).template to_vector<float>();
      };
      if (strategy == 0) {
        Sharded<nn::Qwen3Model, FullShard> sh(aux_model(nullptr), w);
        run(sh);
      } else {
        Sharded<nn::Qwen3Model, NoShard> sh(aux_model(nullptr), w);
        run(sh);
      }
    });
    CHECK(got.loss == want.loss);
    CHECK(got.aux_loss == want.aux_loss);
    CHECK(got.logprobs.to_vector<float>() == want.logprobs.to_vector<float>());
    REQUIRE(got_grads.size() == want_grads.size());
    for (const auto& [name, g] : want_grads) {
      INFO(name);
      CHECK(got_grads.at(name) == g);
    }
  }
}
