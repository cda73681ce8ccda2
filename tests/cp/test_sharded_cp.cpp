// Sharded<Qwen3Model, Strategy> composed with ContextParallel on LocalComm
// (f32, CPU): a tiny Qwen3 (dense, and MoE with ExpertParallel) on meshes
// dp_shard x cp = 1 x 2 (ring, Ulysses), 2 x 2, 1 x 4 (Ulysses x ring) and
// 1 x 2 x ep 2, and HybridShard dp_replicate 2 x cp 2, trains 2 AdamW steps:
// every data-parallel rank has a batch of its own, each cp rank its plan's
// rows of it (loss weight 0 on padding and on each sequence's first token),
// the normaliser is the weight sum of all data-parallel ranks' batches. The
// parameters and step losses must equal those of the unwrapped, unsharded
// model trained on the concatenated batch. Also: avg reduction (cp does not
// count among the data-parallel ranks), the MoE aux loss over cp ranks, the
// groups, and clear errors for what does not compose.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../fsdp/sharded_test_util.hpp"
#include "../fsdp/thread_checks.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/packed_batch.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/parallel/context_parallel.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;
using namespace slime::parallel;   // Sharded, its strategies, ContextParallel
using namespace slime_test::fsdp;  // the FSDP tests' tiny Qwen3, parameter maps and thread checks
using Catch::Matchers::ContainsSubstring;
using comm::Axis;

constexpr int64_t kVocab = 37;   // tiny_config's
constexpr int64_t kExperts = 4;  // tiny_config(moe)'s
constexpr uint64_t kSeed = 11;
constexpr double kLr = 1e-2;
constexpr int kSteps = 2;

// One data-parallel rank's batch: sequences, next-token targets and loss
// weights (0 on the first token of each sequence longer than one, as a
// prompt mask would be).
struct Batch {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  std::vector<float> weights;

  double weight_sum() const {
    double s = 0;
    for (float w : weights) s += double(w);
    return s;
  }
  void append(const Batch& b) {
    seqs.insert(seqs.end(), b.seqs.begin(), b.seqs.end());
    targets.insert(targets.end(), b.targets.begin(), b.targets.end());
    weights.insert(weights.end(), b.weights.begin(), b.weights.end());
  }
};

// Data rank `rank`'s batch at `step`: 2 or 3 sequences of 1 to 7 tokens (one-
// token samples and samples shorter than cp included), or with `multiple` > 1
// of lengths multiple and 2 x multiple (no cp padding).
Batch batch_of(int step, int rank, int multiple) {
  Batch b;
  const int nseq = 2 + (step + rank) % 2;
  for (int s = 0; s < nseq; ++s) {
    const int len = multiple > 1 ? multiple * (1 + (step + rank + s) % 2) : 1 + (step * 5 + rank * 3 + s * 11) % 7;
    std::vector<int32_t> seq;
    for (int i = 0; i < len; ++i) {
      seq.push_back(int32_t((step * 13 + rank * 17 + s * 3 + i * 7) % kVocab));
      b.targets.push_back(int32_t((seq.back() * 3 + 1) % kVocab));
      b.weights.push_back(i == 0 && len > 1 ? 0.f : 1.f);
    }
    b.seqs.push_back(seq);
  }
  return b;
}

nn::Qwen3Config dense_config() { return tiny_config(/*tied=*/false); }
nn::Qwen3Config moe_config() { return tiny_config(/*tied=*/false, /*moe=*/true); }

struct Case {
  comm::MeshShape mesh;
  nn::Qwen3Config config;
  int ulysses = 1;
  int multiple = 1;  // batch_of's
  int64_t min_chunk = ContextParallelOptions{}.min_chunk_tokens;
  bool via_module = false;  // set the sequence attention through Sharded::module()
  // avg: each rank normalises by its data rank's batch (the mean of the
  // data ranks' mean losses) or by the global weight sum / data ranks (the
  // same step as sum with the global normaliser).
  bool per_rank_normaliser = false;
  parallel::ShardedOptions options;

  explicit Case(const comm::MeshShape& m, nn::Qwen3Config c = dense_config()) : mesh(m), config(std::move(c)) {}
  Case& with_ulysses(int u) {
    ulysses = u;
    return *this;
  }
  // Lengths multiples of m, every sequence split (zigzag): no cp padding.
  Case& with_multiple(int m) {
    multiple = m;
    min_chunk = 0;
    return *this;
  }
  // Sequences whose zigzag chunks would be shorter than m tokens stay whole.
  Case& with_min_chunk(int64_t m) {
    min_chunk = m;
    return *this;
  }
  Case& through_module() {
    via_module = true;
    return *this;
  }
  Case& with_avg(bool per_rank = true) {
    options.gradient_reduce = comm::ReduceOp::avg;
    per_rank_normaliser = per_rank;
    return *this;
  }

  int world() const { return mesh.dp_replicate * mesh.dp_shard * mesh.cp * mesh.ep; }
  int data_ranks() const { return mesh.dp_replicate * mesh.dp_shard * mesh.ep; }
  bool avg() const { return options.gradient_reduce == comm::ReduceOp::avg; }
  bool per_rank() const { return avg() && per_rank_normaliser; }
};

comm::MeshShape mesh_of(int dp_shard, int cp, int ep = 1, int dp_replicate = 1) {
  return comm::MeshShape{.dp_replicate = dp_replicate, .dp_shard = dp_shard, .cp = cp, .ep = ep};
}

struct Result {
  Params params;               // after kSteps
  Params grads;                // the first step's reduced gradients (of the same parameters)
  std::vector<double> losses;  // per step: the loss summed over ranks (the aux term once)
};

Tensor host(const std::vector<int32_t>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }
Tensor host(const std::vector<float>& v) { return Tensor::from_vector(v, {int64_t(v.size())}); }

// The unwrapped model without expert or context parallelism: sum, one
// backward over every data rank's batch concatenated, normalised by their
// weight sum; avg, one backward per data rank's batch, normalised by its
// weight sum times the data ranks.
Result reference_run(const Case& c) {
  nn::Qwen3Model model(c.config, {});
  model.init_random(kSeed, 0.2f);
  optim::AdamW opt;
  Result out;
  for (int step = 0; step < kSteps; ++step) {
    nn::zero_grad(model);
    std::vector<Batch> batches;
    Batch all;
    for (int r = 0; r < c.data_ranks(); ++r) {
      batches.push_back(batch_of(step, r, c.multiple));
      all.append(batches.back());
    }
    if (!c.per_rank()) batches = {all};
    double loss = 0;
    for (const Batch& b : batches) {
      const double norm = c.per_rank() ? b.weight_sum() * c.data_ranks() : all.weight_sum();
      loss += model.loss_and_backward(nn::make_packed_batch(b.seqs), host(b.targets), host(b.weights), 1.f, norm).loss;
    }
    out.losses.push_back(c.per_rank() ? loss * c.data_ranks() : loss);
    if (step == 0) model.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = p.grad.to_vector<float>(); });
    reference_step(model, opt, kLr, 0);
  }
  out.params = parameters_of(model);
  return out;
}

// Every rank: the model (its ep slice of the experts), its ContextParallel
// over the mesh's cp axis, its data rank's batch and its plan's rows of it.
template <class S>
Result sharded_run(const Case& c) {
  Result out;
  out.losses.assign(kSteps, 0.0);
  std::mutex mutex;
  comm::run_local_ranks(
      c.world(),
      [&](comm::Comm& world) {
        const comm::Mesh mesh(world, c.mesh);
        const int dp_r = mesh.size(Axis::dp_replicate), dp_s = mesh.size(Axis::dp_shard), cp = mesh.size(Axis::cp),
                  ep = mesh.size(Axis::ep);
        std::optional<parallel::ExpertParallel<>> expert;
        if (ep > 1) expert.emplace(mesh, kExperts);
        parallel::ContextParallel cpar(mesh.comm(Axis::cp), {.ulysses = c.ulysses, .min_chunk_tokens = c.min_chunk});
        // The same values as the reference's (init_random draws expert
        // slices at their global offsets).
        nn::Qwen3Model model(c.config, {}, expert ? &*expert : nullptr);
        model.init_random(kSeed, 0.2f);
        if (!c.via_module) model.set_sequence_attention(&cpar);
        Sharded<nn::Qwen3Model, S> sh(std::move(model), mesh, c.options);
        if (c.via_module) sh.module().set_sequence_attention(&cpar);
        TCHECK(sh.cp_world() == cp);
        if constexpr (S::shards) {
          TCHECK(sh.shard_world() == dp_s * cp * ep);
          TCHECK(sh.replicate_world() == (S::replicates ? dp_r : 1));
          if (ep > 1) TCHECK(sh.expert_shard_world() == dp_s * cp);
        } else {
          TCHECK(sh.replicate_world() == dp_r * dp_s * cp * ep);
          if (ep > 1) TCHECK(sh.expert_replicate_world() == dp_r * dp_s * cp);
        }
        const int data_rank =
            (mesh.coord(Axis::dp_replicate) * dp_s + mesh.coord(Axis::dp_shard)) * ep + mesh.coord(Axis::ep);
        const double coef = c.config.router_aux_loss_coef;
        for (int step = 0; step < kSteps; ++step) {
          sh.zero_grad();
          double global = 0;
          for (int r = 0; r < c.data_ranks(); ++r) global += batch_of(step, r, c.multiple).weight_sum();
          const Batch mine = batch_of(step, data_rank, c.multiple);
          std::vector<int32_t> cu{0}, tokens;
          for (const auto& s : mine.seqs) {
            cu.push_back(cu.back() + int32_t(s.size()));
            tokens.insert(tokens.end(), s.begin(), s.end());
          }
          const parallel::CpPlan& plan = cpar.plan(cu);
          const nn::PackedBatch local = cpar.local_batch(tokens);
          const nn::LossResult r =
              sh.loss_and_backward(local, host(plan.take(mine.targets, 0)), host(plan.take(mine.weights, 0.f)), 1.f,
                                   c.per_rank() ? mine.weight_sum()
                                   : c.avg()    ? global / c.data_ranks()
                                                : global);
          {
            // Each rank's loss holds its rows' share and the whole aux term.
            std::lock_guard lock(mutex);
            // (avg with the global normaliser / data ranks: the shares are data-ranks times larger).
            const double share = r.loss - coef * r.aux_loss;
            out.losses[std::size_t(step)] += (c.avg() && !c.per_rank() ? share / c.data_ranks() : share) +
                                             (world.rank() == 0 ? coef * r.aux_loss : 0);
          }
          if (step == 0) gather_full(sh, mesh, kExperts, out.grads, mutex, Gathered::gradients);
          sh.optimizer_step(kLr);
        }
        gather_full(sh, mesh, kExperts, out.params, mutex);
      },
      comm::kLocalCommTimeout);
  thread_checks().require_none();
  return out;
}

// The largest normwise relative difference of the gradients over the
// attention weights and over the rest. The ring's blockwise softmax rounds
// otherwise than one softmax, and the q / k norms (head_dim elements, each a
// sum over every token and head with much cancellation) amplify it: up to
// 1.2e-6 on q_proj and 1.1e-6 on q_norm (measured, ring 2 and Ulysses 2 x
// ring 2, dp 1); every other weight stays below 8e-7.
struct GradDiff {
  double attention = 0, rest = 0;
};
GradDiff grad_diff(const Params& got, const Params& want) {
  Params got_attn, want_attn, got_rest, want_rest;
  for (const auto& [name, g] : got) {
    const bool attn = name.find("self_attn") != std::string::npos;
    (attn ? got_attn : got_rest)[name] = g;
    (attn ? want_attn : want_rest)[name] = want.count(name) ? want.at(name) : std::vector<float>{};
  }
  return {max_rel_diff(got_attn, want_attn), max_rel_diff(got_rest, want_rest)};
}

// The first step's gradients (of the same parameters) within grad_diff's
// bounds (2e-6 for attention, 1e-6), the parameters after kSteps within
// 1e-6 (largest normwise relative difference) and the losses within 1e-6
// relative.
template <class S>
void check_equal(const Case& c) {
  const Result want = reference_run(c), got = sharded_run<S>(c);
  REQUIRE(got.grads.size() == want.grads.size());
  const GradDiff g = grad_diff(got.grads, want.grads);
  const double d = max_rel_diff(got.params, want.params);
  INFO("max relative gradient difference " << g.rest << " (attention " << g.attention << "), parameters " << d);
  CHECK(g.attention <= 2e-6);
  CHECK(g.rest <= 1e-6);
  CHECK(d <= 1e-6);
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < want.losses.size(); ++s) {
    INFO("step " << s << ": loss " << got.losses[s] << " vs " << want.losses[s]);
    CHECK(std::abs(got.losses[s] - want.losses[s]) <= 1e-6 * std::abs(want.losses[s]));
  }
}

}  // namespace

TEST_CASE("Sharded<FullShard> with ContextParallel equals the unsharded model (f32, CPU)", "[cp][fsdp]") {
  struct Named {
    const char* name;
    Case c;
  };
  const std::vector<Named> cases = {
      {"dp_shard 1 x cp 2 (ring)", Case(mesh_of(1, 2))},
      {"dp_shard 2 x cp 2 (ring)", Case(mesh_of(2, 2))},
      {"dp_shard 1 x cp 2 (Ulysses), set through module()", Case(mesh_of(1, 2)).with_ulysses(2).through_module()},
      {"dp_shard 1 x cp 4 (Ulysses 2 x ring 2)", Case(mesh_of(1, 4)).with_ulysses(2)},
      {"MoE dp_shard 2 x cp 2, no expert parallelism", Case(mesh_of(2, 2), moe_config())},
      {"MoE dp_shard 1 x cp 2 x ep 2", Case(mesh_of(1, 2, 2), moe_config())},
      {"dp_shard 2 x cp 2, short sequences whole", Case(mesh_of(2, 2)).with_min_chunk(1)},
      {"dp_shard 1 x cp 4 (Ulysses 2 x ring 2), short sequences whole",
       Case(mesh_of(1, 4)).with_ulysses(2).with_min_chunk(1)},
  };
  for (const Named& n : cases) {
    INFO(n.name);
    check_equal<FullShard>(n.c);
  }
}

TEST_CASE("Sharded with ContextParallel: ShardGradOp, NoShard and HybridShard equal the unsharded model",
          "[cp][fsdp]") {
  {
    INFO("ShardGradOp dp_shard 2 x cp 2");
    check_equal<ShardGradOp>(Case(mesh_of(2, 2)));
  }
  {
    INFO("NoShard dp_shard 2 x cp 2");
    check_equal<NoShard>(Case(mesh_of(2, 2)));
  }
  {
    INFO("NoShard MoE dp_shard 1 x cp 2 x ep 2");
    check_equal<NoShard>(Case(mesh_of(1, 2, 2), moe_config()));
  }
  {
    INFO("HybridShard dp_replicate 2 x dp_shard 1 x cp 2");
    check_equal<HybridShard>(Case(mesh_of(1, 2, 1, 2)));
  }
}

TEST_CASE("Sharded with ContextParallel: avg divides by the data-parallel ranks, cp not counted", "[cp][fsdp]") {
  // Each rank normalises by its data rank's batch alone; the step is the
  // mean over data ranks of their batches' mean losses.
  {
    INFO("FullShard dp_shard 2 x cp 2");
    check_equal<FullShard>(Case(mesh_of(2, 2)).with_avg());
  }
  {
    INFO("NoShard dp_shard 2 x cp 2");
    check_equal<NoShard>(Case(mesh_of(2, 2)).with_avg());
  }
  {
    INFO("FullShard MoE dp_shard 1 x cp 2 x ep 2 (expert units: cp / ep)");
    check_equal<FullShard>(Case(mesh_of(1, 2, 2), moe_config()).with_avg());
  }
}

TEST_CASE("Sharded with ContextParallel: the MoE aux loss covers every cp rank's rows", "[cp][fsdp][moe]") {
  // Batches without cp padding (lengths multiples of 2 x ring = 4, every
  // sequence zigzag: no padding entries either): the statistics of every
  // rank's rows are then exactly the batch's tokens.
  nn::Qwen3Config c = moe_config();
  c.output_router_logits = true;
  c.router_aux_loss_coef = 0.1;  // large enough to move the parameters
  {
    INFO("dp_shard 2 x cp 2");
    check_equal<FullShard>(Case(mesh_of(2, 2), c).with_multiple(4));
  }
  {
    INFO("dp_shard 1 x cp 2 x ep 2");
    check_equal<FullShard>(Case(mesh_of(1, 2, 2), c).with_multiple(4));
  }
  {
    // The aux scale undoes the division by the 2 data-parallel ranks, not by
    // the 4 ranks; the CE normaliser is the global one / 2: the sum's step.
    INFO("avg, dp_shard 1 x cp 2 x ep 2");
    check_equal<FullShard>(Case(mesh_of(1, 2, 2), c).with_multiple(4).with_avg(/*per_rank=*/false));
  }
}

TEST_CASE("Sharded with ContextParallel: clear errors for what does not compose", "[cp][fsdp]") {
  std::vector<std::string> full_replicated(4), no_attention(4);
  comm::run_local_ranks(4, [&](comm::Comm& world) {
    const std::size_t r = std::size_t(world.rank());
    const comm::Mesh replicated(world, mesh_of(1, 2, 1, 2));
    full_replicated[r] = error_of([&] { Sharded<nn::Qwen3Model, FullShard>(make_model(dense_config()), replicated); });
    // cp > 1 without the model's sequence attention: each rank would attend
    // over its rows alone.
    const comm::Mesh mesh(world, mesh_of(2, 2));
    Sharded<nn::Qwen3Model, FullShard> sh(make_model(dense_config()), mesh);
    no_attention[r] = error_of([&] {
      nn::Qwen3Model::Context ctx;
      sh.forward(nn::make_packed_batch({{1, 2, 3}}), ctx);
    });
  });
  std::vector<std::string> noshard_2d(8);
  comm::run_local_ranks(8, [&](comm::Comm& world) {
    const comm::Mesh mesh(world, mesh_of(2, 2, 1, 2));
    noshard_2d[std::size_t(world.rank())] =
        error_of([&] { Sharded<nn::Qwen3Model, NoShard>(make_model(dense_config()), mesh); });
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK_THAT(full_replicated[std::size_t(r)],
               ContainsSubstring("shards over dp_shard x cp only") && ContainsSubstring("use HybridShard"));
    CHECK_THAT(no_attention[std::size_t(r)], ContainsSubstring("cp = 2 but the module has no sequence attention"));
  }
  for (const std::string& e : noshard_2d) CHECK_THAT(e, ContainsSubstring("replicates over one axis"));
}
