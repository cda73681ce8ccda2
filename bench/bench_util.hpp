// bench/bench_util.hpp: the harness shared by the Google Benchmark programs in
// bench/ (header only, no CUDA syntax: compiles in .cpp and .cu files, and in
// CPU-only programs, which use only the parts that need no device).
//
//   skip_without_cuda(state)          SkipWithError("no CUDA device") when none
//   passed_check(state, verdicts, id, check)
//                                     runs check() on the first run of `id`,
//                                     remembers its verdict ("" = passed) and
//                                     skips with it on every run when it failed
//   run_or_skip(state, body)          body(), an exception becomes SkipWithError
//   time_batches(state, stream(s), warmup, batch, launch)
//                                     warmup untimed calls, then per iteration a
//                                     CUDA event, batch calls, another event and
//                                     SetIterationTime(time / batch) (the
//                                     slowest stream's time when several);
//                                     returns the run's mean seconds per call
//   per_second / flop_byte_counters   rates from that time, 0 when it is 0
//   register_manual(name, fn, unit, iterations, repetitions)
//                                     RegisterBenchmark with UseManualTime
//   run_benchmarks(argc, argv)        Initialize, ReportUnrecognizedArguments,
//                                     RunSpecifiedBenchmarks, Shutdown
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/stream.hpp"

namespace slime::bench {

// True (after SkipWithError("no CUDA device")) when this process sees no GPU.
inline bool skip_without_cuda(benchmark::State& state) {
  if (slime::cuda_device_count() > 0) return false;
  state.SkipWithError("no CUDA device");
  return true;
}

// Skips the run with `error` when it is not empty; true when it skipped.
inline bool skip_if_error(benchmark::State& state, const std::string& error) {
  if (error.empty()) return false;
  state.SkipWithError(error.c_str());
  return true;
}

// The correctness check of a benchmark runs once, on its first run; its
// verdict ("" when it passed, else what is wrong) holds for the later
// repetitions too. False (after SkipWithError) when the check failed.
template <class Key, class Check>
bool passed_check(benchmark::State& state, std::map<Key, std::string>& verdicts, const Key& id, Check&& check) {
  auto it = verdicts.find(id);
  if (it == verdicts.end()) it = verdicts.emplace(id, std::forward<Check>(check)()).first;
  return !skip_if_error(state, it->second);
}

// Runs body(); an exception skips the run with its message.
template <class Body>
void run_or_skip(benchmark::State& state, Body&& body) {
  try {
    std::forward<Body>(body)();
  } catch (const std::exception& e) {
    state.SkipWithError(e.what());
  }
}

// `n` untimed calls of launch(), then waits for every stream.
template <class Launch>
void warm_up(std::span<const Stream> streams, int n, Launch&& launch) {
  for (int i = 0; i < n; ++i) launch();
  for (const Stream& s : streams) s.synchronize();
}

template <class Launch>
void warm_up(const Stream& stream, int n, Launch&& launch) {
  warm_up(std::span<const Stream>(&stream, 1), n, std::forward<Launch>(launch));
}

// The timing loop: `warmup` untimed calls, then for each iteration a CUDA
// event recorded on every stream, `batch` calls of launch(), a second event on
// every stream, and SetIterationTime(slowest stream's time / batch). Use with
// ->UseManualTime(). Returns the mean seconds per call over the run's
// iterations (from the total event time; 0 when nothing ran).
template <class Launch>
double time_batches(benchmark::State& state, std::span<const Stream> streams, int warmup, int batch, Launch&& launch) {
  warm_up(streams, warmup, launch);
  std::vector<Event> start, stop;
  for (const Stream& s : streams) {
    start.emplace_back(s.device());
    stop.emplace_back(s.device());
  }
  double seconds = 0;
  int64_t calls = 0;
  for (auto _ : state) {
    for (std::size_t r = 0; r < streams.size(); ++r) start[r].record(streams[r]);
    for (int i = 0; i < batch; ++i) launch();
    for (std::size_t r = 0; r < streams.size(); ++r) stop[r].record(streams[r]);
    double ms = 0;
    for (std::size_t r = 0; r < streams.size(); ++r) {
      stop[r].synchronize();
      ms = std::max(ms, double(Event::elapsed_ms(start[r], stop[r])));
    }
    state.SetIterationTime(ms * 1e-3 / batch);
    seconds += ms * 1e-3;
    calls += batch;
  }
  return seconds / double(std::max<int64_t>(calls, 1));
}

template <class Launch>
double time_batches(benchmark::State& state, const Stream& stream, int warmup, int batch, Launch&& launch) {
  return time_batches(state, std::span<const Stream>(&stream, 1), warmup, batch, std::forward<Launch>(launch));
}

// amount / seconds / scale, or 0 when seconds is 0.
inline double per_second(double amount, double seconds, double scale) {
  return seconds > 0 ? amount / seconds / scale : 0.0;
}

// Counters flop, bytes, TFLOPs and GBps for a call of `seconds`.
inline void flop_byte_counters(benchmark::State& state, double seconds, double flop, double bytes) {
  state.counters["flop"] = flop;
  state.counters["bytes"] = bytes;
  state.counters["TFLOPs"] = per_second(flop, seconds, 1e12);
  state.counters["GBps"] = per_second(bytes, seconds, 1e9);
}

// A benchmark timed with CUDA events: manual time, fixed iterations and
// repetitions (read the median over repetitions).
inline benchmark::internal::Benchmark* register_manual(const std::string& name,
                                                       std::function<void(benchmark::State&)> fn,
                                                       benchmark::TimeUnit unit, int iterations, int repetitions) {
  return benchmark::RegisterBenchmark(name.c_str(), std::move(fn))
      ->UseManualTime()
      ->Unit(unit)
      ->Iterations(iterations)
      ->Repetitions(repetitions);
}

// main()'s body once the benchmarks are registered; after_init (if any) runs
// after Initialize (for AddCustomContext). 1 on unrecognised arguments.
inline int run_benchmarks(int& argc, char** argv, const std::function<void()>& after_init = {}) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  if (after_init) after_init();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

}  // namespace slime::bench
