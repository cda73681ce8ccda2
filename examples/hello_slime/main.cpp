// hello_slime: prints what this build of slime can see (CPU, CUDA devices)
// and runs one all-reduce across ranks: threads on the CPU (LocalComm), one
// thread per GPU with NCCL, or one process per rank under a launcher
// (slime/comm/launch.hpp). The smallest complete use of the library.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <atomic>
#include <string>

#include "slime/comm/launch.hpp"
#include "slime/core/device.hpp"
#include "slime/core/tensor.hpp"

namespace {

void print_devices() {
  fmt::print("slime {} | CUDA backend: {}\n", "0.1.0", slime::built_with_cuda() ? "built" : "not built");
  const int n = slime::cuda_device_count();
  fmt::print("CUDA devices visible: {}\n", n);
#if SLIME_HAS_CUDA
  for (int i = 0; i < n; ++i) {
    cudaDeviceProp p{};
    SLIME_CUDA_CHECK(cudaGetDeviceProperties(&p, i));
    fmt::print("  cuda:{}  {}  sm_{}{}  {} SMs  {:.1f} GiB\n", i, p.name, p.major, p.minor, p.multiProcessorCount,
               double(p.totalGlobalMem) / (1 << 30));
  }
#endif
}

// Each rank contributes (rank + 1) in every element; the sum over ranks is
// n (n + 1) / 2, which every rank checks.
bool all_reduce_demo(slime::comm::Comm& comm, int64_t elements) {
  const slime::Device dev = comm.device();
  std::vector<float> mine(std::size_t(elements), float(comm.rank() + 1));
  slime::Tensor t = slime::Tensor::from_vector(mine, {elements}, dev);
  comm.all_reduce(t);
  const float want = float(comm.size() * (comm.size() + 1) / 2);
  for (float x : t.to_vector<float>())
    if (x != want) return false;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"hello_slime: list devices and run one all-reduce across ranks"};
  std::string device = "auto";
  int ranks = 2;
  int64_t elements = 1 << 20;
  app.add_option("--device", device, "auto (CUDA when a GPU is visible), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  app.add_option("--ranks", ranks, "ranks: CPU threads, or GPUs (at most the visible count)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--elements", elements, "f32 elements per rank in the all-reduce")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 30))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    print_devices();
    // Ranks as threads: CPU (LocalComm), or one GPU each with NCCL (at most
    // the visible GPUs); one process per rank under torchrun / mpirun / srun.
    const slime::comm::Launch launch =
        slime::comm::plan_launch({.device = device, .ranks = ranks, .fit_to_devices = true});
    if (!launch.note.empty()) fmt::print("{}\n", launch.note);
    ranks = launch.world_size;
    fmt::print("all_reduce over {} {} rank(s) ({}), {} floats each\n", ranks, launch.cuda() ? "GPU" : "CPU",
               launch.cuda() ? "NCCL" : "threads, LocalComm", elements);
    std::atomic<int> ok{0};
    slime::comm::run_ranks(launch, [&](slime::comm::Comm& comm) { ok += all_reduce_demo(comm, elements); });
    if (launch.mode == slime::comm::LaunchMode::processes) return ok.load() == 1 ? 0 : 1;  // this process's rank
    const bool pass = ok.load() == ranks;
    fmt::print("result: {} ({} of {} ranks saw sum {})\n", pass ? "OK" : "WRONG", ok.load(), ranks,
               ranks * (ranks + 1) / 2);
    return pass ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
