// Sharded<Qwen3Model> over NCCL, one process per GPU, started by
//   torchrun --no-python --nproc-per-node 2 test_fsdp_nccl
// (ctest runs it through tools/run-under-torchrun.sh, which skips with fewer
// than 2 GPUs). A bf16 Qwen3 trains 3 AdamW steps on 2 ranks (each rank its
// own micro-batch) with FullShard, ShardGradOp and NoShard; a 1-rank run in
// the same process (a communicator of one, both micro-batches accumulated)
// is the reference. Step-0 losses are equal (same forward); later losses and
// the fp32 master parameters agree within bf16 tolerance (1e-2 relative:
// activations are bf16, so the two runs' gradients differ by rounding).
//
// Every rank runs the same collectives in the same order whatever it finds:
// CHECK, never REQUIRE.
#include <catch2/catch_test_macros.hpp>

#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "fsdp_gpu_test_util.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"

namespace {

using namespace slime;
using slime_test::fsdp::config;
using slime_test::fsdp::moe_config;
using slime_test::fsdp::rel;

struct MicroBatch {
  nn::PackedBatch batch;
  Tensor targets;
};
MicroBatch micro_batch(int step, int rank, Device dev) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int s = 0; s < 3; ++s) {
    const int len = 17 + 31 * s + 5 * rank + step;
    std::vector<int32_t> seq;
    for (int i = 0; i < len; ++i) seq.push_back(int32_t((step * 131 + rank * 71 + s * 13 + i * 37) % 1001));
    for (int i = 0; i < len; ++i) targets.push_back(int32_t((seq[std::size_t(i)] * 7 + 3) % 1001));
    seqs.push_back(seq);
  }
  MicroBatch m;
  m.batch = nn::make_packed_batch(seqs, dev);
  m.targets = Tensor::from_vector(targets, {int64_t(targets.size())}, dev);
  return m;
}

constexpr int kSteps = 3;
constexpr double kLr = 1e-4;

struct Result {
  std::vector<double> losses;      // per step, summed over the micro-batches of all ranks
  std::vector<std::string> names;  // sh.parameter_names(): the order depends on the units
  std::vector<std::vector<float>> params;
};

// `data_ranks` micro-batches per step in all; this process feeds those of
// `first_rank` .. first_rank + per_process - 1.
// The training loop shared by the dense and the expert-parallel runs.
template <class ShardedModel>
Result train_loop(ShardedModel& sh, comm::Comm& comm, int first_rank, int per_process, int data_ranks) {
  const Device dev = comm.device();
  Result out;
  for (int step = 0; step < kSteps; ++step) {
    int64_t tokens = 0;
    for (int r = 0; r < data_ranks; ++r) tokens += micro_batch(step, r, dev).batch.num_tokens();
    sh.zero_grad();
    sh.set_micro_batches(per_process);
    double loss = 0;
    for (int m = 0; m < per_process; ++m) {
      MicroBatch mb = micro_batch(step, first_rank + m, dev);
      loss += sh.loss_and_backward(mb.batch, mb.targets, 1.f, double(tokens)).loss;
    }
    Tensor l = Tensor::from_vector(std::vector<float>{float(loss)}, {1}, dev);
    comm.all_reduce(l);
    out.losses.push_back(double(l.to_vector<float>()[0]));
    sh.optimizer_step(kLr, 1.0);
  }
  for (const std::string& name : sh.parameter_names()) {
    const Tensor full = sh.gather_parameter(name);  // f32 master values
    out.names.push_back(name);
    out.params.push_back(full.to_vector<float>());
  }
  return out;
}

template <class S>
Result train(comm::Comm& comm, int first_rank, int per_process, int data_ranks) {
  nn::Qwen3Model model(config(), {comm.device(), DType::bf16});
  model.init_random(5, 0.02f);
  parallel::Sharded<nn::Qwen3Model, S> sh(std::move(model), comm);
  return train_loop(sh, comm, first_rank, per_process, data_ranks);
}

// The MoE model on `comm` over `mesh` (expert parallel along its ep axis when
// ep > 1: this rank's slice of every expert stack, the values those of the
// full model initialised with the same seed).
template <class S>
Result train_moe(comm::Comm& comm, const comm::MeshShape& shape, int first_rank, int per_process, int data_ranks) {
  const Device dev = comm.device();
  nn::Qwen3Model full(moe_config(), {dev, DType::bf16});
  full.init_random(9, 0.02f);
  const comm::Mesh mesh(comm, shape);
  if (shape.ep == 1) {
    parallel::Sharded<nn::Qwen3Model, S> sh(std::move(full), mesh);
    return train_loop(sh, comm, first_rank, per_process, data_ranks);
  }
  parallel::ExpertParallel<> ep(mesh, moe_config().num_experts);
  nn::Qwen3Model model(moe_config(), {dev, DType::bf16}, &ep);
  std::vector<nn::Parameter*> src, dst;
  full.for_each_parameter([&](nn::Parameter& p) { src.push_back(&p); });
  model.for_each_parameter([&](nn::Parameter& p) { dst.push_back(&p); });
  SLIME_CHECK(src.size() == dst.size(), "train_moe: parameter counts differ");
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (dst[i]->is_expert_stack()) {
      const int64_t per = dst[i]->value.numel() / dst[i]->value.size(0);
      dst[i]->value.copy_from(src[i]->value.view(dst[i]->first_expert * per, dst[i]->value.shape()));
    } else {
      dst[i]->value.copy_from(src[i]->value);
    }
  }
  parallel::Sharded<nn::Qwen3Model, S> sh(std::move(model), mesh);
  Result r = train_loop(sh, comm, first_rank, per_process, data_ranks);
  // Expert stacks came back as this rank's slice: all-gather them over the ep
  // ranks into the full stacks (f32, in ep-rank order = expert order).
  const std::vector<std::string> names = sh.parameter_names();
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (!sh.is_expert_parameter(names[i])) continue;
    const std::vector<float>& mine = r.params[i];
    Tensor local = Tensor::from_vector(mine, {int64_t(mine.size())}, dev);
    Tensor all = Tensor::empty({int64_t(mine.size()) * shape.ep}, DType::f32, dev);
    mesh.comm(comm::Axis::ep).all_gather(local, all);
    r.params[i] = all.to_vector<float>();
  }
  return r;
}

template <class S>
void compare(comm::Comm& world, comm::Comm& alone, const char* what) {
  INFO(what << " on rank " << world.rank());
  const Result two = train<S>(world, world.rank(), 1, world.size());
  const Result one = train<S>(alone, 0, world.size(), world.size());
  CHECK(two.losses.size() == std::size_t(kSteps));
  CHECK(std::abs(two.losses[0] - one.losses[0]) <= 1e-6 * std::abs(one.losses[0]));
  for (int s = 1; s < kSteps; ++s)
    CHECK(std::abs(two.losses[std::size_t(s)] - one.losses[std::size_t(s)]) <=
          1e-2 * std::abs(one.losses[std::size_t(s)]));
  CHECK(two.params.size() == one.params.size());
  for (std::size_t i = 0; i < two.params.size() && i < one.params.size(); ++i) {
    INFO("parameter " << i);
    CHECK(rel(two.params[i], one.params[i]) <= 1e-2);
  }
}

}  // namespace

TEST_CASE("Sharded over NCCL on 2 GPUs matches a 1-rank run in bf16", "[fsdp][multi_gpu]") {
  if (std::getenv("WORLD_SIZE") == nullptr)
    SKIP("WORLD_SIZE is unset: run under torchrun --no-python --nproc-per-node 2 test_fsdp_nccl");
  if (cuda_device_count() < 1) SKIP("no CUDA device");

  std::unique_ptr<comm::NcclComm> world = comm::NcclComm::from_env();
  std::unique_ptr<comm::Comm> alone = world->split(world->rank(), 0);  // a communicator of one
  CHECK(alone->size() == 1);
  compare<parallel::FullShard>(*world, *alone, "FullShard");
  compare<parallel::ShardGradOp>(*world, *alone, "ShardGradOp");
  compare<parallel::NoShard>(*world, *alone, "NoShard");
  world->barrier();
}

TEST_CASE("Sharded Qwen3-MoE over NCCL on 2 GPUs, data and expert parallel, matches a 1-rank run in bf16",
          "[fsdp][moe][multi_gpu]") {
  if (std::getenv("WORLD_SIZE") == nullptr)
    SKIP("WORLD_SIZE is unset: run under torchrun --no-python --nproc-per-node 2 test_fsdp_nccl");
  if (cuda_device_count() < 1) SKIP("no CUDA device");

  std::unique_ptr<comm::NcclComm> world = comm::NcclComm::from_env();
  std::unique_ptr<comm::Comm> alone = world->split(world->rank(), 0);
  const int n = world->size();
  const Result one = train_moe<parallel::FullShard>(*alone, comm::MeshShape{}, 0, n, n);
  struct Case {
    const char* what;
    comm::MeshShape shape;
    bool no_shard;
  };
  const Case cases[] = {
      {"FullShard dp 2", comm::MeshShape{.dp_replicate = 1, .dp_shard = n, .cp = 1, .ep = 1}, false},
      {"FullShard dp 1 x ep 2", comm::MeshShape{.dp_replicate = 1, .dp_shard = 1, .cp = 1, .ep = n}, false},
      {"NoShard dp 1 x ep 2", comm::MeshShape{.dp_replicate = 1, .dp_shard = 1, .cp = 1, .ep = n}, true},
  };
  for (const Case& c : cases) {
    INFO(c.what << " on rank " << world->rank());
    const Result two = c.no_shard ? train_moe<parallel::NoShard>(*world, c.shape, world->rank(), 1, n)
                                  : train_moe<parallel::FullShard>(*world, c.shape, world->rank(), 1, n);
    CHECK(two.losses.size() == std::size_t(kSteps));
    // Step 0 is the same forward up to the order of bf16 GEMM rows per expert.
    for (int s = 0; s < kSteps && s < int(two.losses.size()); ++s) {
      INFO("step " << s << ": " << two.losses[std::size_t(s)] << " vs " << one.losses[std::size_t(s)]);
      CHECK(std::abs(two.losses[std::size_t(s)] - one.losses[std::size_t(s)]) <=
            (s == 0 ? 1e-3 : 1e-2) * std::abs(one.losses[std::size_t(s)]));
    }
    // By name: expert parallelism splits a sparse layer into a dense and an
    // expert unit, which changes the order of parameter_names().
    CHECK(two.names.size() == one.names.size());
    for (std::size_t i = 0; i < two.names.size(); ++i) {
      INFO("parameter " << two.names[i]);
      std::size_t j = 0;
      while (j < one.names.size() && one.names[j] != two.names[i]) ++j;
      CHECK(j < one.names.size());
      if (j < one.names.size()) CHECK(rel(two.params[i], one.params[j]) <= 1e-2);
    }
  }
  world->barrier();
}
