// slime/comm/launch.hpp: how a program starts its ranks, in one place.
// plan_launch decides from the command line's device and rank count and from
// what the process sees (a torchrun / mpirun / srun job, the CUDA devices);
// run_ranks then runs fn(Comm&) on every rank that lives in this process:
//
//   local_threads  ranks as CPU threads of this process (LocalComm)
//   nccl_threads   ranks as threads of this process, rank r on cuda:r (NcclComm)
//   local_cuda     ranks as threads of this process, all on cuda:0 (LocalComm
//                  on CUDA tensors: LaunchOptions::share_device; several ranks
//                  on one GPU, e.g. a 2-rank check where only one GPU is lent)
//   processes      this process is one rank of a launcher's job, on the GPU
//                  the launcher gives it (NcclComm::from_env)
//
//   const comm::Launch launch = comm::plan_launch({.device = "auto", .ranks = 2});
//   std::optional<Result> r = comm::run_ranks(launch, [&](comm::Comm& c) { return train(c); });
//   if (r) print(*r);   // world rank 0's result, in the process that ran it
//
// Each rank's device is comm.device(); the CUDA modes also make it the
// thread's current device (DeviceGuard). A rank that throws stops the others
// (their collectives fail) and run_ranks rethrows the first failure. In a
// launcher's job (processes) a PeerWatchdog does this across processes: a
// rank that fails or dies aborts the others' communicators, and they throw a
// slime::Error naming it (SLIME_WATCHDOG_TIMEOUT_S, MASTER_PORT+2).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "slime/comm/bootstrap.hpp"
#include "slime/comm/comm.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/comm/watchdog.hpp"
#include "slime/core/device.hpp"
#include "slime/core/error.hpp"

namespace slime::comm {

enum class LaunchMode : uint8_t { local_threads, nccl_threads, processes, local_cuda };

struct LaunchOptions {
  std::string device = "auto";  // auto (CUDA when a GPU is visible) | cpu | cuda
  int ranks = 1;                // ranks as threads of this process; ignored under a launcher
  // CUDA threads with fewer visible GPUs than `ranks`: run one rank per
  // visible GPU (Launch::note says so) instead of failing.
  bool fit_to_devices = false;
  // CUDA threads: every rank on cuda:0 through LocalComm (one process, any
  // rank count) instead of one GPU per rank through NCCL. Ignored on the CPU
  // and under a launcher.
  bool share_device = false;
};

// What this process sees; tests build their own.
struct LaunchEnvironment {
  ProcessInfo process;
  int cuda_devices = 0;
  bool cuda_built = false;

  static LaunchEnvironment current() { return {process_info_from_env(), cuda_device_count(), built_with_cuda()}; }
};

struct Launch {
  LaunchMode mode = LaunchMode::local_threads;
  int world_size = 1;   // ranks of the run, over all its processes
  ProcessInfo process;  // this process in its launcher's job
  std::string note;     // why world_size differs from LaunchOptions::ranks ("" when it does not)

  bool cuda() const { return mode != LaunchMode::local_threads; }
  // Whether world rank 0 runs in this process (the one that prints the run's summary).
  bool has_rank_zero() const { return mode != LaunchMode::processes || process.rank == 0; }
};

inline std::string_view launch_mode_name(LaunchMode m) {
  switch (m) {
    case LaunchMode::local_threads:
      return "local_threads";
    case LaunchMode::nccl_threads:
      return "nccl_threads";
    case LaunchMode::processes:
      return "processes";
    case LaunchMode::local_cuda:
      return "local_cuda";
  }
  return "?";
}

// The launch for `options` in `env` (see the top of the file). Throws a
// slime::Error naming the option for what cannot run: an unknown device,
// --device cuda without CUDA or without a GPU, a launcher's job of several
// processes on the CPU (CPU ranks are threads of one process), more CUDA
// ranks than GPUs (unless fit_to_devices).
inline Launch plan_launch(const LaunchOptions& options, const LaunchEnvironment& env = LaunchEnvironment::current()) {
  const std::string& d = options.device;
  SLIME_CHECK(d == "auto" || d == "cpu" || d == "cuda", "--device '", d, "': expected auto, cpu or cuda");
  if (d == "cuda") {
    SLIME_CHECK(env.cuda_built, "--device cuda, but slime was built without CUDA");
    SLIME_CHECK(env.cuda_devices > 0, "--device cuda, but no CUDA device is visible");
  }
  const bool cuda = d == "cuda" || (d == "auto" && env.cuda_built && env.cuda_devices > 0);
  Launch l;
  l.process = env.process;
  if (env.process.launcher != "single" && env.process.world_size > 1) {
    SLIME_CHECK(cuda, "started as rank ", env.process.rank, " of ", env.process.world_size, " processes by ",
                env.process.launcher, ", which needs CUDA and NCCL (one GPU per process); CPU ranks run as threads ",
                "of one process (--ranks)");
    l.mode = LaunchMode::processes;
    l.world_size = env.process.world_size;
    if (options.ranks != l.world_size)
      l.note = ::slime::detail::concat("--ranks ", options.ranks, " ignored: ", env.process.launcher, " started ",
                                       l.world_size, " processes");
    return l;
  }
  // One process: a launcher's job of one process runs one rank.
  l.world_size = env.process.launcher != "single" ? 1 : options.ranks;
  SLIME_CHECK(l.world_size >= 1, "--ranks must be >= 1, got ", options.ranks);
  if (l.world_size != options.ranks)
    l.note =
        ::slime::detail::concat("--ranks ", options.ranks, " ignored: ", env.process.launcher, " started one process");
  if (!cuda) return l;
  if (options.share_device) {
    l.mode = LaunchMode::local_cuda;
    return l;
  }
  l.mode = LaunchMode::nccl_threads;
  if (l.world_size > env.cuda_devices) {
    SLIME_CHECK(options.fit_to_devices, "--ranks ", l.world_size, " needs ", l.world_size, " GPUs (one per rank), ",
                env.cuda_devices, " visible");
    l.note = ::slime::detail::concat("only ", env.cuda_devices, " GPUs: running ", env.cuda_devices, " ranks");
    l.world_size = env.cuda_devices;
  }
  return l;
}

namespace detail {

template <class F>
void start_ranks(const Launch& l, F&& fn) {
  switch (l.mode) {
    case LaunchMode::local_threads:
      run_local_ranks(l.world_size, [&](Comm& c) { fn(c); });
      return;
    case LaunchMode::nccl_threads:
#if SLIME_HAS_CUDA
      run_nccl_ranks(l.world_size, [&](Comm& c) { fn(c); });
      return;
#else
      SLIME_FAIL("run_ranks: CUDA ranks, but slime was built without CUDA");
#endif
    case LaunchMode::local_cuda:
      // run_local_ranks makes cuda:0 current on each rank's thread.
      run_local_ranks(
          l.world_size, [&](Comm& c) { fn(c); }, kLocalCommTimeout, Device::cuda(0));
      return;
    case LaunchMode::processes: {
      const std::unique_ptr<NcclComm> comm = NcclComm::from_env();
      const DeviceGuard guard(comm->device());
      // A peer process that dies aborts this rank's communicator (its
      // collectives fail) instead of leaving it in NCCL until a timeout; the
      // error then names the lost rank (slime/comm/watchdog.hpp).
      PeerWatchdog watchdog(l.process, watchdog_options(l.process), [c = comm.get()] { c->abort(); });
      try {
        fn(static_cast<Comm&>(*comm));
      } catch (...) {
        watchdog.check();  // a lost peer: its error, not the aborted communicator's
        watchdog.report_failure();
        throw;
      }
      return;
    }
  }
}

}  // namespace detail

// Runs fn(Comm&) on every rank of `launch` in this process and returns when
// they have all finished. fn returning R: world rank 0's result when it ran
// in this process, else std::nullopt; fn returning void: nothing.
template <class F>
auto run_ranks(const Launch& launch, F&& fn) {
  using R = std::invoke_result_t<F&, Comm&>;
  if constexpr (std::is_void_v<R>) {
    detail::start_ranks(launch, fn);
  } else {
    std::optional<R> lead;
    detail::start_ranks(launch, [&](Comm& c) {
      R r = fn(c);
      if (c.rank() == 0) lead.emplace(std::move(r));
    });
    return lead;
  }
}

}  // namespace slime::comm
