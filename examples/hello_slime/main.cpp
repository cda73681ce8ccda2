// hello_slime: prints what this build of slime can see (CPU, CUDA devices)
// and runs one all-reduce across ranks: threads on the CPU (LocalComm), or one
// thread per GPU with NCCL. The smallest complete use of the library.
#include <CLI/CLI.hpp>
#include <fmt/core.h>

#include <atomic>
#include <string>

#include "slime/comm/local_comm.hpp"
#include "slime/core/device.hpp"
#include "slime/core/tensor.hpp"
#if SLIME_HAS_CUDA
#include "slime/comm/nccl_comm.hpp"
#endif

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
    const bool use_cuda = device == "cuda" || (device == "auto" && slime::cuda_device_count() > 0);
    std::atomic<int> ok{0};
    if (use_cuda) {
#if SLIME_HAS_CUDA
      const int n = std::min(ranks, slime::cuda_device_count());
      SLIME_CHECK(n >= 1, "--device cuda but no CUDA device is visible");
      fmt::print("all_reduce over {} GPU rank(s) with NCCL, {} floats each\n", n, elements);
      slime::comm::run_nccl_ranks(n, [&](slime::comm::Comm& comm) { ok += all_reduce_demo(comm, elements); });
      ranks = n;
#else
      SLIME_FAIL("--device cuda but slime was built without CUDA");
#endif
    } else {
      fmt::print("all_reduce over {} CPU rank(s) (threads, LocalComm), {} floats each\n", ranks, elements);
      slime::comm::run_local_ranks(ranks, [&](slime::comm::Comm& comm) { ok += all_reduce_demo(comm, elements); });
    }
    const bool pass = ok.load() == ranks;
    fmt::print("result: {} ({} of {} ranks saw sum {})\n", pass ? "OK" : "WRONG", ok.load(), ranks,
               ranks * (ranks + 1) / 2);
    return pass ? 0 : 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
}
