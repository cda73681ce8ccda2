// Tests for slime/comm/launch.hpp: plan_launch's choice for each device,
// rank count and launcher (pure: the environment is given), and run_ranks on
// LocalComm threads (rank 0's result, void functions, a failing rank).
#include "slime/comm/launch.hpp"

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <atomic>
#include <functional>
#include <stdexcept>
#include <string>

namespace {

using Catch::Matchers::ContainsSubstring;
using slime::comm::Launch;
using slime::comm::LaunchEnvironment;
using slime::comm::LaunchMode;
using slime::comm::LaunchOptions;
using slime::comm::plan_launch;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

LaunchEnvironment env(int gpus, bool built, std::string launcher = "single", int rank = 0, int world = 1) {
  LaunchEnvironment e;
  e.cuda_devices = gpus;
  e.cuda_built = built;
  e.process.launcher = std::move(launcher);
  e.process.rank = rank;
  e.process.world_size = world;
  return e;
}

}  // namespace

TEST_CASE("plan_launch: CPU threads where there is no GPU") {
  for (const char* device : {"auto", "cpu"}) {
    const Launch l = plan_launch({.device = device, .ranks = 3}, env(0, false));
    CHECK(l.mode == LaunchMode::local_threads);
    CHECK(l.world_size == 3);
    CHECK_FALSE(l.cuda());
    CHECK(l.has_rank_zero());
    CHECK(l.note.empty());
  }
  // A CUDA build on a machine with GPUs still runs CPU ranks when asked to.
  CHECK(plan_launch({.device = "cpu", .ranks = 2}, env(4, true)).mode == LaunchMode::local_threads);
}

TEST_CASE("plan_launch: NCCL threads, one GPU per rank") {
  const Launch l = plan_launch({.device = "auto", .ranks = 2}, env(2, true));
  CHECK(l.mode == LaunchMode::nccl_threads);
  CHECK(l.world_size == 2);
  CHECK(l.cuda());
  CHECK_THAT(error_of([] { plan_launch({.device = "cuda", .ranks = 4}, env(2, true)); }),
             ContainsSubstring("--ranks 4 needs 4 GPUs") && ContainsSubstring("2 visible"));
  const Launch fit = plan_launch({.device = "cuda", .ranks = 4, .fit_to_devices = true}, env(2, true));
  CHECK(fit.world_size == 2);
  CHECK_THAT(fit.note, ContainsSubstring("only 2 GPUs"));
}

TEST_CASE("plan_launch: ranks sharing one GPU through LocalComm") {
  const Launch l = plan_launch({.device = "auto", .ranks = 3, .share_device = true}, env(1, true));
  CHECK(l.mode == LaunchMode::local_cuda);
  CHECK(l.world_size == 3);  // more ranks than GPUs, no note: that is the point
  CHECK(l.note.empty());
  CHECK(l.cuda());
  CHECK(l.has_rank_zero());
  CHECK(slime::comm::launch_mode_name(l.mode) == "local_cuda");
  // On the CPU the ranks are CPU threads anyway; under a launcher it is ignored.
  CHECK(plan_launch({.device = "auto", .ranks = 2, .share_device = true}, env(0, false)).mode ==
        LaunchMode::local_threads);
  CHECK(plan_launch({.device = "cuda", .ranks = 2, .share_device = true}, env(1, true, "torchrun", 0, 2)).mode ==
        LaunchMode::processes);
  CHECK_THAT(error_of([] { plan_launch({.device = "cuda", .ranks = 2, .share_device = true}, env(0, true)); }),
             ContainsSubstring("no CUDA device is visible"));
}

TEST_CASE("plan_launch: one process per rank under a launcher") {
  const Launch l = plan_launch({.device = "auto", .ranks = 2}, env(1, true, "torchrun", 3, 8));
  CHECK(l.mode == LaunchMode::processes);
  CHECK(l.world_size == 8);
  CHECK_FALSE(l.has_rank_zero());
  CHECK_THAT(l.note, ContainsSubstring("--ranks 2 ignored"));
  CHECK(plan_launch({.device = "cuda", .ranks = 8}, env(1, true, "slurm", 0, 8)).has_rank_zero());
  CHECK_THAT(error_of([] { plan_launch({.device = "cpu", .ranks = 2}, env(0, false, "openmpi", 1, 2)); }),
             ContainsSubstring("rank 1 of 2 processes by openmpi") && ContainsSubstring("threads of one process"));
  // A launcher's job of one process runs one rank in it.
  const Launch one = plan_launch({.device = "cpu", .ranks = 2}, env(0, false, "torchrun", 0, 1));
  CHECK(one.mode == LaunchMode::local_threads);
  CHECK(one.world_size == 1);
}

TEST_CASE("plan_launch: bad options are named") {
  CHECK_THAT(error_of([] { plan_launch({.device = "tpu"}, env(0, false)); }), ContainsSubstring("--device 'tpu'"));
  CHECK_THAT(error_of([] { plan_launch({.device = "cuda"}, env(0, false)); }), ContainsSubstring("built without CUDA"));
  CHECK_THAT(error_of([] { plan_launch({.device = "cuda"}, env(0, true)); }),
             ContainsSubstring("no CUDA device is visible"));
  CHECK_THAT(error_of([] { plan_launch({.device = "cpu", .ranks = 0}, env(0, false)); }),
             ContainsSubstring("--ranks must be >= 1"));
}

TEST_CASE("run_ranks: every rank runs, and rank 0's result comes back") {
  const Launch l = plan_launch({.device = "cpu", .ranks = 3}, env(0, false));
  std::atomic<int> ran{0};
  const std::optional<int> r = slime::comm::run_ranks(l, [&](slime::comm::Comm& c) {
    ++ran;
    // A collective: every rank is there.
    slime::Tensor t = slime::Tensor::from_vector(std::vector<int64_t>{c.rank() + 1}, {1});
    c.all_reduce(t);
    return int(t.to_vector<int64_t>()[0]) * 10 + c.rank();
  });
  CHECK(ran == 3);
  REQUIRE(r.has_value());
  CHECK(*r == 60);
  std::atomic<int> sizes{0};
  slime::comm::run_ranks(l, [&](slime::comm::Comm& c) { sizes += c.size(); });  // void: nothing returned
  CHECK(sizes == 9);
}

TEST_CASE("run_ranks: a failing rank's error reaches the caller") {
  const Launch l = plan_launch({.device = "cpu", .ranks = 2}, env(0, false));
  CHECK_THAT(error_of([&] {
               slime::comm::run_ranks(l, [](slime::comm::Comm& c) {
                 if (c.rank() == 1) throw std::runtime_error("rank 1 gave up");
                 c.barrier();
               });
             }),
             ContainsSubstring("rank 1 gave up"));
}
