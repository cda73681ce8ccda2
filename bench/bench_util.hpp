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
//   copy_seconds(bytes, stream, warmup, batch, reps)     (CUDA builds)
//                                     median seconds of one device-to-device
//                                     cudaMemcpyAsync of `bytes`, cached
//   copy_fraction_counters(state, bytes, seconds, copy_seconds)
//                                     bytes, GBps, copy_GBps, frac_of_copy
//   CopyBoundCase / run_copy_bound_case(state, name, setup, warmup, batch,
//                                     copy_reps)  a memory-bound op timed
//                                     beside a copy of bytes / 2 (CUDA builds)
#pragma once

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

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

#if SLIME_HAS_CUDA
// Median seconds of one cudaMemcpyAsync of `bytes` device to device on
// `stream`'s device: `warmup` untimed copies, then `reps` timed batches of
// `batch` copies each (a CUDA event either side; the median batch / batch).
// Cached per size (and settings) for the process.
inline double copy_seconds(std::size_t bytes, const Stream& s, int warmup, int batch, int reps) {
  static std::map<std::tuple<std::size_t, int, int, int>, double> cache;
  const auto key = std::make_tuple(bytes, warmup, batch, reps);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const Device d = s.device();
  Tensor a = Tensor::empty({int64_t(bytes)}, DType::u8, d, s), b = Tensor::empty({int64_t(bytes)}, DType::u8, d, s);
  a.fill_bytes_(1, s);
  auto copy = [&] {
    SLIME_CUDA_CHECK(cudaMemcpyAsync(b.data_ptr(), a.data_ptr(), bytes, cudaMemcpyDeviceToDevice, s.handle()));
  };
  warm_up(s, warmup, copy);
  Event start(d), stop(d);
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    start.record(s);
    for (int i = 0; i < batch; ++i) copy();
    stop.record(s);
    stop.synchronize();
    times.push_back(double(Event::elapsed_ms(start, stop)) * 1e-3 / batch);
  }
  std::sort(times.begin(), times.end());
  return cache[key] = times[times.size() / 2];
}

// Counters bytes, GBps (bytes / seconds), copy_GBps (bytes / copy_seconds)
// and frac_of_copy = GBps / copy_GBps.
inline void copy_fraction_counters(benchmark::State& state, double bytes, double seconds, double copy_s) {
  const double gbps = per_second(bytes, seconds, 1e9);
  const double copy_gbps = bytes / copy_s / 1e9;
  state.counters["bytes"] = bytes;
  state.counters["GBps"] = gbps;
  state.counters["copy_GBps"] = copy_gbps;
  state.counters["frac_of_copy"] = gbps / copy_gbps;
}

// One memory-bound benchmark case: buffers are made by the setup function,
// launch() runs the op once, check() returns "" or what is wrong (run once per
// case name; may be empty).
struct CopyBoundCase {
  double bytes = 0;
  std::function<void(const Stream&)> launch;
  std::function<std::string(const Stream&)> check;
};

// Skips without a GPU; on one stream of `device` (made once): setup(), the
// check on the first run of `name`, time_batches(warmup, batch) of launch(),
// then copy_fraction_counters against a copy of bytes / 2 (the same traffic)
// timed with copy_seconds(.., warmup, batch, copy_reps).
inline void run_copy_bound_case(benchmark::State& state, const std::string& name,
                                const std::function<CopyBoundCase(const Stream&)>& setup, Device device, int warmup,
                                int batch, int copy_reps) {
  if (skip_without_cuda(state)) return;
  run_or_skip(state, [&] {
    static Stream stream = Stream::create(device);
    const Stream& s = stream;
    CopyBoundCase c = setup(s);
    static std::map<std::string, std::string> verdicts;
    if (!passed_check(state, verdicts, name, [&] { return c.check ? c.check(s) : std::string(); })) return;
    const double t = time_batches(state, s, warmup, batch, [&] { c.launch(s); });
    const double copy_t = copy_seconds(static_cast<std::size_t>(c.bytes / 2), s, warmup, batch, copy_reps);
    copy_fraction_counters(state, c.bytes, t, copy_t);
    s.synchronize();
  });
}
#endif

}  // namespace slime::bench
