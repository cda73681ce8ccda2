// Sharded<Qwen3Model, Strategy> on LocalComm: 1 to 4 ranks with every
// strategy train a tiny random Qwen3 (f32, odd vocabulary so rows do not
// divide) for K AdamW steps and must end with the parameters of the unwrapped
// model trained on the same micro-batches (<= 1e-6 relative; bitwise at
// degree 1); gradient accumulation in both sync modes, avg reduction, tied
// embeddings, HybridShard on a 2x2 mesh, grad-norm clipping; per-rank
// parameter + gradient + optimizer bytes from the allocator statistics;
// the flat-shard layout; checkpoint access; CPU offload (bitwise equal to
// the run without it, pinned vs host bytes); bad input.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/parallel/sharded.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::FullShard;
using parallel::HybridShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::error_of;
using slime_test::fsdp::make_model;
using slime_test::fsdp::max_rel_diff;
using slime_test::fsdp::micro_batch;
using slime_test::fsdp::MicroBatch;
using slime_test::fsdp::Params;
using slime_test::fsdp::tiny_config;

namespace {

struct RunConfig {
  int ranks = 1;
  int micro_batches = 1;
  int steps = 3;
  bool tied = false;
  bool moe = false;
  double max_grad_norm = 0;
  parallel::ShardedOptions options;
};

constexpr double kLr = 1e-2;

int64_t global_tokens(const RunConfig& rc, int step) {
  int64_t n = 0;
  for (int r = 0; r < rc.ranks; ++r)
    for (int m = 0; m < rc.micro_batches; ++m) n += micro_batch(step, r, m, 37).batch.num_tokens();
  return n;
}

// The unwrapped model trained on every rank's micro-batches in turn.
Params reference_run(const RunConfig& rc, std::vector<double>* losses = nullptr) {
  nn::Qwen3Model model = make_model(tiny_config(rc.tied, rc.moe));
  optim::AdamW opt;
  for (int step = 0; step < rc.steps; ++step) {
    nn::zero_grad(model);
    const double norm = double(global_tokens(rc, step));
    double loss = 0;
    for (int r = 0; r < rc.ranks; ++r)
      for (int m = 0; m < rc.micro_batches; ++m) {
        MicroBatch mb = micro_batch(step, r, m, 37);
        loss += model.loss_and_backward(mb.batch, mb.targets, 1.f, norm).loss;
      }
    if (losses) losses->push_back(loss);
    slime_test::fsdp::reference_step(model, opt, kLr, rc.max_grad_norm);
  }
  return slime_test::fsdp::parameters_of(model);
}

// One rank's training loop on a wrapped model; rank 0 returns the gathered
// parameters.
template <class S>
void train(Sharded<nn::Qwen3Model, S>& sh, const RunConfig& rc, int data_rank, int data_ranks, Params* out,
           std::vector<double>* losses) {
  for (int step = 0; step < rc.steps; ++step) {
    sh.zero_grad();
    sh.set_micro_batches(rc.micro_batches);
    double norm = double(global_tokens(rc, step));
    if (rc.options.gradient_reduce == comm::ReduceOp::avg) norm /= data_ranks;
    double loss = 0;
    for (int m = 0; m < rc.micro_batches; ++m) {
      MicroBatch mb = micro_batch(step, data_rank, m, 37);
      loss += sh.loss_and_backward(mb.batch, mb.targets, 1.f, norm).loss;
    }
    if (losses) losses->push_back(loss);
    sh.optimizer_step(kLr, rc.max_grad_norm);
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
    Sharded<nn::Qwen3Model, S> sh(make_model(tiny_config(rc.tied, rc.moe)), comm, rc.options);
    train(sh, rc, comm.rank(), comm.size(), comm.rank() == 0 ? &out : nullptr, nullptr);
  });
  return out;
}

bool bitwise_equal(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, va] : a) {
    const auto it = b.find(name);
    if (it == b.end() || it->second.size() != va.size() ||
        std::memcmp(va.data(), it->second.data(), va.size() * sizeof(float)) != 0)
      return false;
  }
  return true;
}

}  // namespace

TEST_CASE("FlatShardLayout pads dim 0, aligns pieces and round-trips rank-major buffers", "[fsdp]") {
  const std::vector<std::pair<std::string, Shape>> shapes = {
      {"a", Shape{37, 16}}, {"b", Shape{16}}, {"c", Shape{3, 7}}, {"d", Shape{}}, {"e", Shape{0, 4}}, {"f", Shape{5}}};
  for (int world = 1; world <= 4; ++world) {
    INFO("world " << world);
    const parallel::FlatShardLayout layout(shapes, world);
    int64_t offset = 0;
    for (const auto& e : layout.entries()) {
      INFO(e.name);
      CHECK(e.shard_offset == offset);
      CHECK(e.piece % parallel::kFlatShardAlign == 0);
      CHECK(e.rows_per_rank * world >= e.rows);
      // The ranks' ranges tile [0, numel).
      int64_t covered = 0;
      for (int r = 0; r < world; ++r) {
        CHECK(e.begin(r) == covered);
        covered = e.end(r);
      }
      CHECK(covered == e.numel);
      offset += e.piece;
    }
    CHECK(layout.shard_numel() == offset);
    // Each rank's shard from the parameters, gathered rank-major, unpacked:
    // every parameter is contiguous at its gathered offset.
    std::vector<std::vector<float>> values;
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      std::vector<float> v(std::size_t(shapes[i].second.numel()));
      for (std::size_t j = 0; j < v.size(); ++j) v[j] = float(100 * i + j + 1);
      values.push_back(v);
    }
    Tensor rank_major = Tensor::zeros({layout.gathered_numel()}, DType::f32);
    float* rm = rank_major.data<float>();
    for (int r = 0; r < world; ++r)
      for (std::size_t i = 0; i < shapes.size(); ++i) {
        const auto& e = layout.entries()[i];
        for (int64_t j = e.begin(r); j < e.end(r); ++j)
          rm[r * layout.shard_numel() + e.shard_offset + (j - e.begin(r))] = values[i][std::size_t(j)];
      }
    Tensor gathered = Tensor::empty({layout.gathered_numel()}, DType::f32);
    gathered.fill_bytes_(0xff);
    parallel::unpack_rank_major(rank_major, gathered, layout);
    for (std::size_t i = 0; i < shapes.size(); ++i) {
      const Tensor v = gathered.view(layout.gathered_offset(i), shapes[i].second);
      CHECK(v.to_vector<float>() == values[i]);
      CHECK(layout.gathered_offset(i) % parallel::kFlatShardAlign == 0);
    }
    Tensor back = Tensor::empty({layout.gathered_numel()}, DType::f32);
    back.fill_bytes_(0xff);
    parallel::pack_rank_major(gathered, back, layout);
    CHECK(back.to_vector<float>() == rank_major.to_vector<float>());
  }
}

TEMPLATE_TEST_CASE("Sharded on 1-4 LocalComm ranks equals the unwrapped model after K AdamW steps", "[fsdp]", FullShard,
                   ShardGradOp, NoShard) {
  for (const bool tied : {false, true}) {
    for (int ranks = 1; ranks <= 4; ++ranks) {
      INFO("ranks " << ranks << (tied ? ", tied embeddings" : ""));
      RunConfig rc;
      rc.ranks = ranks;
      rc.tied = tied;
      const Params want = reference_run(rc);
      const Params got = sharded_run<TestType>(rc);
      if (ranks == 1) {
        CHECK(bitwise_equal(got, want));  // degree 1 is the identity
      } else {
        CHECK(max_rel_diff(got, want) <= 1e-6);
      }
    }
  }
}

TEMPLATE_TEST_CASE("Sharded wraps Qwen3-MoE (no expert parallelism) like a dense model", "[fsdp][moe]", FullShard,
                   ShardGradOp, NoShard) {
  for (int ranks = 1; ranks <= 3; ++ranks) {
    INFO("ranks " << ranks);
    RunConfig rc;
    rc.ranks = ranks;
    rc.moe = true;
    rc.micro_batches = 2;
    const Params want = reference_run(rc);
    REQUIRE(want.count("model.layers.1.mlp.experts.{}.up_proj.weight") == 1);
    const Params got = sharded_run<TestType>(rc);
    if (ranks == 1) {
      CHECK(bitwise_equal(got, want));
    } else {
      CHECK(max_rel_diff(got, want) <= 1e-6);
    }
  }
}

TEMPLATE_TEST_CASE("Sharded gradient accumulation: reduce at the end or every micro-batch", "[fsdp]", FullShard,
                   ShardGradOp, NoShard) {
  for (const auto sync : {parallel::GradientSync::at_end, parallel::GradientSync::every_micro_batch}) {
    for (int ranks : {1, 3}) {
      INFO("ranks " << ranks << ", sync " << int(sync));
      RunConfig rc;
      rc.ranks = ranks;
      rc.micro_batches = 3;
      rc.options.gradient_sync = sync;
      CHECK(max_rel_diff(sharded_run<TestType>(rc), reference_run(rc)) <= 1e-6);
    }
  }
}

TEST_CASE("Sharded: avg reduction, grad-norm clipping, bf16 gradient reduction", "[fsdp]") {
  RunConfig rc;
  rc.ranks = 2;
  rc.options.gradient_reduce = comm::ReduceOp::avg;  // each rank normalises by global tokens / 2
  CHECK(max_rel_diff(sharded_run<FullShard>(rc), reference_run(rc)) <= 1e-6);

  RunConfig clip;
  clip.ranks = 3;
  clip.max_grad_norm = 0.05;  // well below the gradient norm: every step clips
  CHECK(max_rel_diff(sharded_run<FullShard>(clip), reference_run(clip)) <= 1e-6);

  // bf16 reduction rounds each rank's gradient: close, not equal.
  RunConfig bf;
  bf.ranks = 2;
  bf.steps = 1;
  bf.options.precision.reduce = DType::bf16;
  const double err = max_rel_diff(sharded_run<FullShard>(bf), reference_run(bf));
  CHECK(err <= 1e-2);
}

TEST_CASE("Sharded<HybridShard> on a 2x2 mesh equals the unwrapped model", "[fsdp]") {
  for (const bool tied : {false, true}) {
    INFO((tied ? "tied" : "untied"));
    RunConfig rc;
    rc.ranks = 4;
    rc.tied = tied;
    rc.micro_batches = 2;
    Params got;
    std::mutex mu;
    std::vector<int> shard_worlds(4), replicate_worlds(4);
    comm::run_local_ranks(4, [&](comm::Comm& world) {
      comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 2, .dp_shard = 2});
      Sharded<nn::Qwen3Model, HybridShard> sh(make_model(tiny_config(tied)), mesh, rc.options);
      shard_worlds[std::size_t(world.rank())] = sh.shard_world();
      replicate_worlds[std::size_t(world.rank())] = sh.replicate_world();
      Params mine;
      train(sh, rc, world.rank(), world.size(), &mine, nullptr);
      std::lock_guard lock(mu);
      if (world.rank() == 3) got = mine;  // the last replica's view of the model
    });
    CHECK(shard_worlds == std::vector<int>{2, 2, 2, 2});
    CHECK(replicate_worlds == std::vector<int>{2, 2, 2, 2});
    CHECK(max_rel_diff(got, reference_run(rc)) <= 1e-6);
  }
}

TEST_CASE("Sharded: FullShard releases gathered units after forward, ShardGradOp keeps them", "[fsdp]") {
  // Checked on the main thread from what each rank recorded (Catch2
  // assertions are not thread-safe).
  std::vector<std::vector<int>> full_after_fwd(2), keep_after_fwd(2), keep_after_bwd(2);
  std::vector<std::string> second_name(2);
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    const std::size_t r = std::size_t(comm.rank());
    MicroBatch mb = micro_batch(0, comm.rank(), 0, 37);
    Sharded<nn::Qwen3Model, FullShard> full(make_model(tiny_config(false)), comm);
    nn::Qwen3Model::Context ctx;
    full.forward(mb.batch, ctx);
    second_name[r] = full.unit_name(1);
    for (std::size_t u = 0; u < full.num_units(); ++u) full_after_fwd[r].push_back(full.is_gathered(u));

    Sharded<nn::Qwen3Model, ShardGradOp> keep(make_model(tiny_config(false)), comm);
    Tensor hidden = keep.forward(mb.batch, ctx);
    for (std::size_t u = 0; u < keep.num_units(); ++u) keep_after_fwd[r].push_back(keep.is_gathered(u));
    auto lp = keep.token_logprobs(hidden, mb.targets);
    Tensor g =
        Tensor::from_vector(std::vector<float>(std::size_t(mb.batch.num_tokens()), 1.f), {mb.batch.num_tokens()});
    keep.backward(ctx, keep.token_logprobs_backward(hidden, mb.targets, 1.f, lp, g, Tensor{}));
    for (std::size_t u = 0; u < keep.num_units(); ++u) keep_after_bwd[r].push_back(keep.is_gathered(u));
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(second_name[std::size_t(r)] == "model.layers.0");
    // The last unit (norm + lm_head) stays gathered for the head and backward.
    CHECK(full_after_fwd[std::size_t(r)] == std::vector<int>{0, 0, 0, 1});
    CHECK(keep_after_fwd[std::size_t(r)] == std::vector<int>{1, 1, 1, 1});
    CHECK(keep_after_bwd[std::size_t(r)] == std::vector<int>{0, 0, 0, 0});
  }
}

TEST_CASE("Sharded: per-rank parameter + gradient + optimizer bytes fall as 1/N", "[fsdp]") {
  nn::Qwen3Config c;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.tie_word_embeddings = false;
  const MicroBatch mb = micro_batch(0, 0, 0, 37);

  // Unwrapped: parameters + gradients + AdamW states, from the allocator.
  int64_t unsharded = 0;
  {
    const int64_t before = memory_stats(Device::cpu()).current_bytes;
    nn::Qwen3Model model = make_model(c);
    optim::AdamW opt;
    nn::zero_grad(model);
    model.loss_and_backward(mb.batch, mb.targets);
    std::vector<Tensor> params, grads;
    model.for_each_parameter([&](nn::Parameter& p) {
      params.push_back(p.value);
      grads.push_back(p.grad);
    });
    opt.step(params, grads, kLr);
    params.clear();
    grads.clear();
    unsharded = memory_stats(Device::cpu()).current_bytes - before;
  }
  const int64_t expected = nn::num_parameters(*std::make_unique<nn::Qwen3Model>(make_model(c))) * 16;
  INFO("unsharded bytes " << unsharded << " (4 + 4 + 8 bytes per parameter: " << expected << ")");
  CHECK(unsharded >= expected);
  CHECK(unsharded <= expected * 21 / 20);

  for (int ranks : {2, 3, 4}) {
    std::vector<int64_t> freed(std::size_t(ranks), 0);
    comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
      std::optional<Sharded<nn::Qwen3Model, FullShard>> sh;
      sh.emplace(make_model(c), comm);
      sh->zero_grad();
      sh->loss_and_backward(mb.batch, mb.targets);
      sh->optimizer_step(kLr);
      // One rank at a time (the others wait in barriers, allocating nothing)
      // destroys its wrapper: the drop is what it held.
      for (int r = 0; r < comm.size(); ++r) {
        comm.barrier();
        if (r == comm.rank()) {
          sh->release_buffers();  // what a step reuses (at most what it had alive at once) is not state
          const int64_t before = memory_stats(Device::cpu()).current_bytes;
          sh.reset();
          freed[std::size_t(r)] = before - memory_stats(Device::cpu()).current_bytes;
        }
        comm.barrier();
      }
    });
    for (int r = 0; r < ranks; ++r) {
      const double ratio = double(freed[std::size_t(r)]) / double(unsharded);
      INFO(ranks << " ranks, rank " << r << ": " << freed[std::size_t(r)] << " bytes, " << ratio << " of unsharded");
      CHECK(ratio <= 1.0 / ranks * 1.05);
      CHECK(ratio >= 1.0 / ranks * 0.9);
    }
  }
}

TEMPLATE_TEST_CASE("Sharded CPU offload equals the run without it bit for bit", "[fsdp]", FullShard, ShardGradOp,
                   NoShard) {
  // On the CPU both runs keep everything in host memory: this checks the
  // offload code path (separate master and compute shards, staging copies of
  // the gradients and the new compute values, the CPU update, masters read
  // through gather_parameter), which must not change a bit.
  for (const bool tied : {false, true}) {
    for (int ranks : {1, 3}) {
      INFO("ranks " << ranks << (tied ? ", tied embeddings" : ""));
      RunConfig rc;
      rc.ranks = ranks;
      rc.tied = tied;
      rc.micro_batches = 2;
      rc.max_grad_norm = ranks == 3 ? 0.05 : 0;  // clipping too
      const Params plain = sharded_run<TestType>(rc);
      rc.options.cpu_offload = true;
      const Params offloaded = sharded_run<TestType>(rc);
      CHECK(bitwise_equal(offloaded, plain));
      CHECK(max_rel_diff(offloaded, reference_run(rc)) <= 1e-6);
    }
  }
}

TEST_CASE("Sharded CPU offload: masters and staging shards pinned, load_parameter and local shards work", "[fsdp]") {
  // Bytes a rank's wrapper holds after a step, from the allocator statistics
  // (freed when it is destroyed, one rank at a time). S = the rank's shard
  // elements over all units. f32 model on the CPU:
  //   without offload: host 16 S (master = compute 4, grad 4, moments 8), pinned 0
  //   with offload:    host 16 S (compute 4, grad 4, moments 8), pinned 12 S
  //                    (master 4, staging grad 4, staging compute 4)
  // (On a GPU with a bf16 model the device then holds 6 S instead of 18 S.)
  for (const bool offload : {false, true}) {
    for (int ranks : {1, 3}) {
      INFO((offload ? "offload, " : "no offload, ") << ranks << " ranks");
      const std::size_t n_ranks = static_cast<std::size_t>(ranks);
      std::vector<int64_t> host(n_ranks), pinned(n_ranks), elems(n_ranks);
      std::vector<int> flags(n_ranks, -1);
      comm::run_local_ranks(ranks, [&](comm::Comm& comm) {
        parallel::ShardedOptions opt;
        opt.cpu_offload = offload;
        std::optional<Sharded<nn::Qwen3Model, FullShard>> sh;
        sh.emplace(make_model(tiny_config(false)), comm, opt);
        const MicroBatch mb = micro_batch(0, comm.rank(), 0, 37);
        sh->zero_grad();
        sh->loss_and_backward(mb.batch, mb.targets);
        sh->optimizer_step(kLr);
        int64_t n = 0;
        for (std::size_t u = 0; u < sh->num_units(); ++u) n += sh->unit_layout(u).shard_numel();
        const std::size_t r = std::size_t(comm.rank());
        elems[r] = n;
        flags[r] = sh->cpu_offload() ? 1 : 0;
        for (int q = 0; q < comm.size(); ++q) {
          comm.barrier();
          if (q == comm.rank()) {
            sh->release_buffers();  // the reused step buffers (Sharded::cached_buffer_bytes) are not state
            const int64_t h0 = memory_stats(Device::cpu()).current_bytes;
            const int64_t p0 = pinned_memory_stats().current_bytes;
            sh.reset();
            host[r] = h0 - memory_stats(Device::cpu()).current_bytes;
            pinned[r] = p0 - pinned_memory_stats().current_bytes;
          }
          comm.barrier();
        }
      });
      for (int r = 0; r < ranks; ++r) {
        INFO("rank " << r << ": S = " << elems[std::size_t(r)]);
        CHECK(flags[std::size_t(r)] == (offload ? 1 : 0));
        CHECK(host[std::size_t(r)] == 16 * elems[std::size_t(r)]);
        CHECK(pinned[std::size_t(r)] == (offload ? 12 : 0) * elems[std::size_t(r)]);
      }
    }
  }

  // Checkpoint access with offloaded masters: load the trained values into a
  // fresh offloaded 2-rank wrapper; the local shards (host masters) tile the
  // parameters and gather back equal.
  RunConfig rc;
  rc.steps = 2;
  const Params want = reference_run(rc);
  Params reloaded;
  std::map<std::string, int64_t> covered;
  std::mutex mu;
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    parallel::ShardedOptions opt;
    opt.cpu_offload = true;
    Sharded<nn::Qwen3Model, FullShard> sh(make_model(tiny_config(false), 99), comm, opt);
    for (const auto& [name, v] : want) {
      const Tensor full = sh.gather_parameter(name);
      sh.load_parameter(name, Tensor::from_vector(v, full.shape()));
    }
    Params mine;
    for (const auto& name : sh.parameter_names()) mine[name] = sh.gather_parameter(name).to_vector<float>();
    std::lock_guard lock(mu);
    sh.for_each_local_shard([&](const parallel::LocalShard& s) {
      const auto piece = s.master.to_vector<float>();
      const auto& full = want.at(s.name);
      bool same = int64_t(piece.size()) == s.end - s.begin;
      for (std::size_t i = 0; same && i < piece.size(); ++i) same = piece[i] == full[std::size_t(s.begin) + i];
      covered[s.name] += same ? s.end - s.begin : -1000000;
    });
    if (comm.rank() == 1) reloaded = mine;
  });
  CHECK(bitwise_equal(reloaded, want));
  for (const auto& [name, v] : want) {
    INFO(name);
    CHECK(covered[name] == int64_t(v.size()));
  }
}

TEST_CASE("Sharded checkpoint access: local shards tile each parameter, load_parameter reshards", "[fsdp]") {
  RunConfig rc;
  rc.ranks = 3;
  rc.steps = 2;
  const Params want = reference_run(rc);
  std::mutex mu;
  std::map<std::string, std::vector<float>> assembled;
  std::map<std::string, int64_t> covered;
  comm::run_local_ranks(3, [&](comm::Comm& comm) {
    Sharded<nn::Qwen3Model, FullShard> sh(make_model(tiny_config(false)), comm);
    train(sh, rc, comm.rank(), comm.size(), nullptr, nullptr);
    std::lock_guard lock(mu);
    sh.for_each_local_shard([&](const parallel::LocalShard& s) {
      auto& v = assembled[s.name];
      v.resize(std::size_t(s.shape.numel()));
      const auto piece = s.master.to_vector<float>();
      if (int64_t(piece.size()) != s.end - s.begin) covered[s.name] = -1000000;  // checked below
      std::copy(piece.begin(), piece.end(), v.begin() + s.begin);
      covered[s.name] += s.end - s.begin;
    });
  });
  for (const auto& [name, v] : want) {
    INFO(name);
    CHECK(covered[name] == int64_t(v.size()));
  }
  CHECK(max_rel_diff(assembled, want) <= 1e-6);

  // Load the trained values into 2 ranks of a fresh model: gathered back equal.
  Params reloaded;
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    Sharded<nn::Qwen3Model, FullShard> sh(make_model(tiny_config(false), 99), comm);
    for (const auto& [name, v] : want) {
      const Tensor full = sh.gather_parameter(name);
      sh.load_parameter(name, Tensor::from_vector(v, full.shape()));
    }
    Params mine;
    for (const auto& name : sh.parameter_names()) mine[name] = sh.gather_parameter(name).to_vector<float>();
    std::lock_guard lock(mu);
    if (comm.rank() == 1) reloaded = mine;
  });
  CHECK(bitwise_equal(reloaded, want));
}

TEST_CASE("Sharded: bad input gives clear errors", "[fsdp]") {
  auto group = comm::LocalComm::create_group(1);
  comm::Comm& comm = *group[0];
  parallel::ShardedOptions bf16;
  bf16.precision.compute = DType::bf16;
  CHECK_THROWS_WITH((Sharded<nn::Qwen3Model, FullShard>(make_model(tiny_config(false)), comm, bf16)),
                    ContainsSubstring("differs from the module's dtype"));
  parallel::ShardedOptions f16;
  f16.precision.master = DType::f16;
  CHECK_THROWS_WITH((Sharded<nn::Qwen3Model, FullShard>(make_model(tiny_config(false)), comm, f16)),
                    ContainsSubstring("master dtype f16 is not supported"));
  parallel::ShardedOptions i32;
  i32.precision.reduce = DType::i32;
  CHECK_THROWS_WITH((Sharded<nn::Qwen3Model, FullShard>(make_model(tiny_config(false)), comm, i32)),
                    ContainsSubstring("reduce dtype"));

  Sharded<nn::Qwen3Model, FullShard> sh(make_model(tiny_config(false)), comm);
  // A module without parameter values (e.g. one whose tensors were moved out).
  nn::Qwen3Model empty = make_model(tiny_config(false));
  empty.for_each_parameter([](nn::Parameter& p) { p.value = Tensor{}; });
  CHECK_THROWS_WITH((Sharded<nn::Qwen3Model, FullShard>(std::move(empty), comm)), ContainsSubstring("without a value"));
  CHECK_THROWS_WITH(sh.set_micro_batches(0), ContainsSubstring("n must be >= 1"));
  sh.set_micro_batches(2);
  MicroBatch mb = micro_batch(0, 0, 0, 37);
  sh.loss_and_backward(mb.batch, mb.targets);
  CHECK_THROWS_WITH(sh.optimizer_step(kLr), ContainsSubstring("after 1 of 2 micro-batches"));
  CHECK_THROWS_WITH(sh.set_micro_batches(1), ContainsSubstring("after 1 of 2"));
  CHECK_THROWS_WITH(sh.gather_parameter("model.nope.weight"), ContainsSubstring("no parameter named"));
  CHECK_THROWS_WITH(sh.load_parameter("model.norm.weight", Tensor::zeros({3}, DType::f32)),
                    ContainsSubstring("must have shape"));

  std::vector<std::string> hybrid_needed(4), noshard_2d(4), with_cp(4);
  comm::run_local_ranks(4, [&](comm::Comm& world) {
    const std::size_t r = std::size_t(world.rank());
    comm::Mesh mesh(world, comm::MeshShape{.dp_replicate = 2, .dp_shard = 2});
    hybrid_needed[r] = error_of([&] { Sharded<nn::Qwen3Model, FullShard>(make_model(tiny_config(false)), mesh); });
    noshard_2d[r] = error_of([&] { Sharded<nn::Qwen3Model, NoShard>(make_model(tiny_config(false)), mesh); });
    // cp composes (tests/cp/test_sharded_cp.cpp), but not without the model's sequence attention.
    comm::Mesh cp(world, comm::MeshShape{.dp_shard = 2, .cp = 2});
    Sharded<nn::Qwen3Model, HybridShard> on_cp(make_model(tiny_config(false)), cp);
    with_cp[r] = error_of([&] {
      nn::Qwen3Model::Context ctx;
      on_cp.forward(micro_batch(0, 0, 0, 37).batch, ctx);
    });
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK_THAT(hybrid_needed[std::size_t(r)], ContainsSubstring("use HybridShard"));
    CHECK_THAT(noshard_2d[std::size_t(r)], ContainsSubstring("replicates over one axis"));
    CHECK_THAT(with_cp[std::size_t(r)], ContainsSubstring("cp = 2 but the module has no sequence attention"));
  }
}

// The CPU allocations of f() on every rank together (allocation counts are
// per process): the ranks meet before and after it.
template <class F>
int64_t allocations_of(comm::Comm& comm, F&& f) {
  comm.barrier();
  const int64_t before = memory_stats(Device::cpu()).allocations;
  comm.barrier();
  f();
  comm.barrier();
  const int64_t after = memory_stats(Device::cpu()).allocations;
  comm.barrier();
  return after - before;
}

// Every parameter of `sh` gathered (collective); into `out` on rank 0.
template <class S>
void gather_into(Sharded<nn::Qwen3Model, S>& sh, comm::Comm& comm, Params& out) {
  for (const std::string& name : sh.parameter_names()) {
    const Tensor full = sh.gather_parameter(name);
    if (comm.rank() == 0) out[name] = full.to_vector<float>();
  }
}

// Issue 19: the gathered parameters, full gradients and staging of the
// collectives (BufferCache), the LM head's outputs and workspace
// (token_logprobs with the Context) and the grad-norm scratch are reused, so
// once the first step sized them a step allocates nothing; and the results
// equal a run through the allocating calls with a fresh Context per
// micro-batch, bit for bit.
TEMPLATE_TEST_CASE("Sharded: a steady-state training step allocates nothing", "[fsdp][memory]", FullShard, ShardGradOp,
                   NoShard) {
  using Model = Sharded<nn::Qwen3Model, TestType>;
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    constexpr int kRanks = 2, kSteps = 4, kMicroBatches = 2;
    // reused: one Context and the buffered calls; allocations of each step
    // (both ranks together: the counters are per process).
    auto run = [&](bool reused, std::vector<int64_t>* allocations) {
      Params out;
      comm::run_local_ranks(kRanks, [&](comm::Comm& comm) {
        Model sh(make_model(tiny_config(false, moe)), comm);
        typename Model::Context kept;
        std::vector<MicroBatch> mbs;  // two sizes, the same every step; built before the counting
        std::vector<Tensor> grad_lps;
        for (int m = 0; m < kMicroBatches; ++m) {
          mbs.push_back(micro_batch(0, comm.rank(), m, 37));
          const int64_t T = mbs.back().batch.num_tokens();
          grad_lps.push_back(Tensor::from_vector(std::vector<float>(std::size_t(T), -0.01f), {T}));
        }
        for (int step = 0; step < kSteps; ++step) {
          const int64_t n = allocations_of(comm, [&] {
            sh.zero_grad();
            sh.set_micro_batches(kMicroBatches);
            for (int m = 0; m < kMicroBatches; ++m) {
              const MicroBatch& mb = mbs[std::size_t(m)];
              const Tensor& grad_lp = grad_lps[std::size_t(m)];
              typename Model::Context fresh;
              typename Model::Context& ctx = reused ? kept : fresh;
              const Tensor hidden = sh.forward(mb.batch, ctx);
              if (reused) {
                const ops::TokenLogprobs lp = sh.token_logprobs(ctx, hidden, mb.targets);
                sh.backward(ctx, sh.token_logprobs_backward(ctx, hidden, mb.targets, 1.f, lp, grad_lp, Tensor{}));
              } else {
                const ops::TokenLogprobs lp = sh.token_logprobs(hidden, mb.targets);
                sh.backward(ctx, sh.token_logprobs_backward(hidden, mb.targets, 1.f, lp, grad_lp, Tensor{}));
              }
            }
            sh.optimizer_step(kLr, 1.0);  // clipped: the grad norm's all-reduce runs too
          });
          if (allocations && comm.rank() == 0) allocations->push_back(n);
        }
        gather_into(sh, comm, out);
      });
      return out;
    };
    std::vector<int64_t> allocations;
    const Params got = run(true, &allocations);
    REQUIRE(allocations.size() == std::size_t(kSteps));
    CHECK(allocations[0] > 0);  // the first step sizes the buffers (the count sees allocations)
    for (int step = 1; step < kSteps; ++step) {
      INFO("step " << step);
      CHECK(allocations[std::size_t(step)] == 0);
    }
    CHECK(bitwise_equal(got, run(false, nullptr)));
  }
}

// loss_and_backward with a kept Context: the same parameters bit for bit as
// with a fresh Context per micro-batch, and the activations and LM head
// outputs are not allocated again (what a step still allocates: the
// gradient of the logprobs, uploaded per micro-batch).
TEST_CASE("Sharded::loss_and_backward with a kept Context equals a fresh one and reuses its buffers",
          "[fsdp][memory]") {
  constexpr int kRanks = 2, kSteps = 3, kMicroBatches = 2;
  // Catch2's assertions are not thread-safe: the ranks record, the test checks.
  std::atomic<int> non_finite{0};
  auto run = [&](bool kept, std::vector<int64_t>* allocations) {
    Params out;
    comm::run_local_ranks(kRanks, [&](comm::Comm& comm) {
      Sharded<nn::Qwen3Model, FullShard> sh(make_model(tiny_config(false, true)), comm);
      Sharded<nn::Qwen3Model, FullShard>::Context ctx;
      std::vector<MicroBatch> mbs;
      for (int m = 0; m < kMicroBatches; ++m) mbs.push_back(micro_batch(0, comm.rank(), m, 37));
      for (int step = 0; step < kSteps; ++step) {
        const int64_t n = allocations_of(comm, [&] {
          sh.zero_grad();
          sh.set_micro_batches(kMicroBatches);
          for (const MicroBatch& mb : mbs) {
            const nn::LossResult r =
                kept ? sh.loss_and_backward(ctx, mb.batch, mb.targets) : sh.loss_and_backward(mb.batch, mb.targets);
            if (!std::isfinite(r.loss)) ++non_finite;
          }
          sh.optimizer_step(kLr);
        });
        if (allocations && comm.rank() == 0) allocations->push_back(n);
      }
      gather_into(sh, comm, out);
    });
    return out;
  };
  std::vector<int64_t> fresh_allocs, kept_allocs;
  const Params fresh = run(false, &fresh_allocs);
  CHECK(bitwise_equal(run(true, &kept_allocs), fresh));
  CHECK(non_finite == 0);
  INFO("allocations per step: fresh " << fresh_allocs.back() << ", kept " << kept_allocs.back());
  // Per micro-batch and rank: the gradient of the logprobs (from_vector).
  CHECK(kept_allocs.back() == kRanks * kMicroBatches);
  CHECK(fresh_allocs.back() > 10 * kept_allocs.back());
}

TEST_CASE("Sharded::queue_optimizer_step clips as optimizer_step does, and a NaN norm skips the update", "[fsdp]") {
  // What each rank saw (Catch2's assertions are not thread-safe: checked after the ranks).
  struct Seen {
    std::vector<double> sync_norms, queued_norms;
    bool same_masters = false, no_norm_unclipped = false, nan_throws = false, nan_masters_kept = false;
    bool queued_nan = false, queued_masters_kept = false, bad_max_throws = false;
    int64_t host_steps = 0, queued_steps = 0;
  };
  for (const bool moe : {false, true}) {
    INFO((moe ? "Qwen3-MoE" : "dense Qwen3"));
    std::vector<Seen> seen(2);
    comm::run_local_ranks(2, [&](comm::Comm& comm) {
      Seen& me = seen[std::size_t(comm.rank())];
      Sharded<nn::Qwen3Model, FullShard> host(make_model(tiny_config(false, moe)), comm);
      Sharded<nn::Qwen3Model, FullShard> queued(make_model(tiny_config(false, moe)), comm);
      auto masters = [](auto& sh) {
        std::vector<std::vector<float>> m;
        sh.for_each_local_shard([&](const parallel::LocalShard& l) { m.push_back(l.master.to_vector<float>()); });
        return m;
      };
      auto backward = [&](auto& sh, int step, bool nan) {
        sh.zero_grad();
        MicroBatch mb = micro_batch(step, comm.rank(), 0, 37);
        const int64_t T = mb.batch.num_tokens();
        std::vector<float> w(std::size_t(T), 1.f);
        if (nan) w[std::size_t(T / 2)] = std::numeric_limits<float>::quiet_NaN();
        sh.loss_and_backward(mb.batch, mb.targets, Tensor::from_vector(w, {T}), 1.f, double(T));
      };
      for (int step = 0; step < 3; ++step) {
        backward(host, step, false);
        backward(queued, step, false);
        me.sync_norms.push_back(*host.optimizer_step(kLr, 0.05));  // every step clips
        const optim::PendingNorm pending = queued.queue_optimizer_step(kLr, 0.05);
        me.queued_norms.push_back(pending.has_value() ? pending.get() : -1.0);
      }
      me.same_masters = masters(host) == masters(queued);
      me.no_norm_unclipped = !queued.queue_optimizer_step(kLr).has_value() && !host.optimizer_step(kLr).has_value();

      backward(host, 3, true);
      backward(queued, 3, true);
      const auto before = masters(host);
      try {
        host.optimizer_step(kLr, 1.0);
      } catch (const Error& e) {
        me.nan_throws = std::string(e.what()).find("update was not applied") != std::string::npos;
      }
      me.host_steps = host.optimizer().step_count();
      me.nan_masters_kept = masters(host) == before;
      const optim::PendingNorm pending = queued.queue_optimizer_step(kLr, 1.0);
      me.queued_nan = std::isnan(pending.get());
      me.queued_steps = queued.optimizer().step_count();
      me.queued_masters_kept = masters(queued) == before;
      try {
        queued.queue_optimizer_step(kLr, -1.0);
      } catch (const Error& e) {
        me.bad_max_throws = std::string(e.what()).find("max_grad_norm must be 0") != std::string::npos;
      }
    });
    for (const Seen& me : seen) {
      REQUIRE(me.sync_norms.size() == 3);
      CHECK(me.queued_norms == me.sync_norms);
      CHECK(me.same_masters);
      CHECK(me.no_norm_unclipped);  // no clipping, no norm
      CHECK(me.nan_throws);
      CHECK(me.host_steps == 4);
      CHECK(me.nan_masters_kept);
      CHECK(me.queued_nan);
      CHECK(me.queued_steps == 5);  // a skipped step counts
      CHECK(me.queued_masters_kept);
      CHECK(me.bad_max_throws);
    }
  }
}
