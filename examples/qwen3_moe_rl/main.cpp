// qwen3_moe_rl: a Qwen3-MoE GRPO/GSPO trainer assembled from slime's
// templates (see trainer.hpp for the step). With no arguments it trains the
// built-in tiny Qwen3-MoE on the built-in "successor" task with 2 ranks: on
// the CPU (threads, LocalComm) where there is no GPU, on CUDA (one GPU per
// rank, NCCL) where there is. Under torchrun / mpirun / srun each process is
// one rank on its GPU (slime/comm/launch.hpp starts the ranks).
//
// At the end rank 0 prints whether it learned: the mean reward of the last 10
// steps against the first 10 (criterion: up by at least 0.1).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <exception>
#include <memory>
#include <optional>
#include <vector>

#include "engine_server.hpp"
#include "options.hpp"
#include "slime/comm/launch.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "trainer.hpp"

namespace {

using namespace slime;
using rl_example::Options;
using rl_example::StepReport;

std::vector<StepReport> train_rank(const Options& o, comm::Comm& comm, const rl_example::RemoteRollout* remote) {
  auto run = [&]<class Strategy>(Strategy) { return rl_example::Trainer<Strategy>(o, comm, remote).run(); };
  if (o.fsdp == "full") return run(parallel::FullShard{});
  if (o.fsdp == "grad_op") return run(parallel::ShardGradOp{});
  SLIME_CHECK(o.fsdp == "no_shard", "--fsdp '", o.fsdp, "': expected full, grad_op or no_shard");
  return run(parallel::NoShard{});
}

// One rank of the world: a trainer with a colocated engine, or under
// --rollout disaggregated a trainer (the first ranks) or an engine (the last
// --engine-ranks ranks). Engine ranks return no reports.
std::vector<StepReport> run_rank(const Options& o, comm::Comm& world) {
  if (o.rollout_mode == "colocated") return train_rank(o, world, nullptr);
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
    rl_example::serve_rollouts(o, remote, world.device());
    return {};
  }
  return train_rank(o, *role, &remote);
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
      "qwen3_moe_rl: GRPO/GSPO/CISPO on a Qwen3-MoE model with slime (FSDP, expert parallel, colocated or "
      "disaggregated rollout engines, TIS/MIS)"};
  Options o;
  o.add_to(app);
  CLI11_PARSE(app, argc, argv);
  o.resolve(app);
  // Before any rank starts: every engine and trainer op runs in this mode.
  ops::set_batch_invariant(o.batch_invariant == "on");
  try {
    // Ranks as threads of this process (CPU: LocalComm; CUDA: one GPU each,
    // at most the visible GPUs), or one process per rank under torchrun,
    // mpirun (OpenMPI) or srun (Slurm).
    const comm::Launch launch =
        comm::plan_launch({.device = o.device, .ranks = o.ranks, .fit_to_devices = true, .share_device = o.share_gpu});
    if (!launch.note.empty() && launch.has_rank_zero()) fmt::print("{}\n", launch.note);
    const std::optional<std::vector<StepReport>> reports =
        comm::run_ranks(launch, [&](comm::Comm& comm) { return run_rank(o, comm); });
    if (reports && !reports->empty()) {
      const std::vector<StepReport>& r = *reports;
      const std::size_t k = std::min<std::size_t>(10, r.size() / 2);
      const double first = mean_reward(r, 0, k), last = mean_reward(r, r.size() - k, r.size());
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
