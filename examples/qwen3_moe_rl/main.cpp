// qwen3_moe_rl: a Qwen3-MoE GRPO/GSPO trainer assembled from slime's
// templates (see trainer.hpp for the step). With no arguments it trains the
// built-in tiny Qwen3-MoE on the built-in "successor" task with 2 ranks: on
// the CPU (threads, LocalComm) where there is no GPU, on CUDA (one GPU per
// rank, NCCL) where there is. Under torchrun / mpirun / srun
// each process is one rank on its GPU.
//
// At the end rank 0 prints whether it learned: the mean reward of the last 10
// steps against the first 10 (criterion: up by at least 0.1).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <numeric>
#include <vector>

#include "engine_server.hpp"
#include "options.hpp"
#include "slime/comm/bootstrap.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "trainer.hpp"

namespace {

using namespace slime;
using rl_example::Options;
using rl_example::StepReport;

template <class Strategy>
std::vector<StepReport> train_rank(const Options& o, comm::Comm& comm, Device device,
                                   const rl_example::RemoteRollout* remote) {
  rl_example::Trainer<Strategy> trainer(o, comm, device, remote);
  return trainer.run();
}

std::vector<StepReport> train_rank(const Options& o, comm::Comm& comm, Device device,
                                   const rl_example::RemoteRollout* remote) {
  if (o.fsdp == "full") return train_rank<parallel::FullShard>(o, comm, device, remote);
  if (o.fsdp == "grad_op") return train_rank<parallel::ShardGradOp>(o, comm, device, remote);
  SLIME_CHECK(o.fsdp == "no_shard", "--fsdp '", o.fsdp, "': expected full, grad_op or no_shard");
  return train_rank<parallel::NoShard>(o, comm, device, remote);
}

// One rank of the world: a trainer with a colocated engine, or under
// --rollout disaggregated a trainer (the first ranks) or an engine (the last
// --engine-ranks ranks). Engine ranks return no reports.
std::vector<StepReport> run_rank(const Options& o, comm::Comm& world, Device device) {
  if (o.rollout_mode == "colocated") return train_rank(o, world, device, nullptr);
  SLIME_CHECK(o.rollout_mode == "disaggregated", "--rollout '", o.rollout_mode,
              "': expected colocated or disaggregated");
  const int W = world.size(), G = o.engine_ranks, T = W - G;
  SLIME_CHECK(G >= 1 && T >= 1, "--rollout disaggregated: --engine-ranks ", G, " must leave at least one of the ", W,
              " ranks to train (and be >= 1)");
  const bool engine = world.rank() >= T;
  std::unique_ptr<comm::Comm> role = world.split(engine ? 1 : 0, world.rank());
  std::unique_ptr<comm::Comm> sync = world.split(world.rank() == 0 || engine ? 0 : -1, world.rank());
  const rl_example::RemoteRollout remote{&world, sync.get(), T, G};
  if (engine) {
    rl_example::serve_rollouts(o, remote, device);
    return {};
  }
  return train_rank(o, *role, device, &remote);
}

// Mean reward over steps [first, last).
double mean_reward(const std::vector<StepReport>& r, std::size_t first, std::size_t last) {
  double s = 0;
  for (std::size_t i = first; i < last; ++i) s += r[i].reward;
  return last > first ? s / double(last - first) : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "qwen3_moe_rl: GRPO/GSPO on a Qwen3-MoE model with slime (FSDP, expert parallel, colocated or disaggregated "
      "rollout engines, TIS)"};
  Options o;
  o.add_to(app);
  CLI11_PARSE(app, argc, argv);
  if (o.advantage == "gspo") {  // GSPO's sequence ratios need much tighter clips
    if (app.count("--eps-clip") == 0) o.eps_clip = 3e-4;
    if (app.count("--eps-clip-high") == 0) o.eps_clip_high = 4e-4;
  }
  if (o.short_run) {
    o.steps = std::min(o.steps, 6);
    o.prompts_per_rollout = 4;
    o.samples_per_prompt = 4;
  }
  try {
    // One process per rank under torchrun, mpirun (OpenMPI) or srun (Slurm).
    const comm::ProcessInfo proc = comm::process_info_from_env();
    const bool launched = proc.launcher != "single";
    bool cuda = o.device == "cuda" || (o.device == "auto" && cuda_device_count() > 0);
    SLIME_CHECK(o.device == "auto" || o.device == "cpu" || o.device == "cuda", "--device '", o.device,
                "': expected auto, cpu or cuda");
    std::vector<StepReport> reports;
    if (launched) {
      SLIME_CHECK(cuda, "one process per rank (started by ", proc.launcher,
                  ") needs CUDA and NCCL; on the CPU run one process with --ranks");
#if SLIME_HAS_CUDA
      auto comm = comm::NcclComm::from_env();
      reports = run_rank(o, *comm, comm->device());
#endif
    } else if (cuda) {
#if SLIME_HAS_CUDA
      const int n = std::min(o.ranks, cuda_device_count());
      if (n < o.ranks) fmt::print("only {} GPUs: running {} ranks\n", n, n);
      std::vector<std::vector<StepReport>> per_rank(static_cast<std::size_t>(n));
      comm::run_nccl_ranks(n, [&](comm::Comm& comm) {
        per_rank[std::size_t(comm.rank())] = run_rank(o, comm, Device::cuda(comm.rank()));
      });
      reports = per_rank[0];
#else
      SLIME_FAIL("--device cuda: this build has no CUDA");
#endif
    } else {
      std::vector<std::vector<StepReport>> per_rank(static_cast<std::size_t>(o.ranks));
      comm::run_local_ranks(
          o.ranks, [&](comm::Comm& comm) { per_rank[std::size_t(comm.rank())] = run_rank(o, comm, Device::cpu()); });
      reports = per_rank[0];
    }
    if (!reports.empty() && proc.rank == 0) {
      const std::size_t k = std::min<std::size_t>(10, reports.size() / 2);
      const double first = mean_reward(reports, 0, k), last = mean_reward(reports, reports.size() - k, reports.size());
      fmt::print("mean reward: first {} steps {:.3f}, last {} steps {:.3f} ({:+.3f}); learned (>= +0.1): {}\n", k,
                 first, k, last, last - first, last - first >= 0.1 ? "yes" : "no");
      fmt::print("metrics: {}/metrics.jsonl (plot: python3 tools/plot_metrics.py {}/metrics.jsonl)\n", o.out_dir,
                 o.out_dir);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "qwen3_moe_rl: {}\n", e.what());
    return 1;
  }
  return 0;
}
