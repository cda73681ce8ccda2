// bench/bench_collectives.cpp: all_gather, reduce_scatter and all_to_all over
// NcclComm on 2 GPUs of one process, bf16, 1 MiB .. 1 GiB per rank. The PyTorch
// baseline is bench/torch_collectives.py; bench/compare_collectives.py puts the
// two side by side.
//
// How the ranks are driven: one host thread issues both ranks' halves of every
// collective between NcclComm::group_start() and group_end() (NCCL's "several
// GPUs from one thread" mode, as nccl-tests -g 2 does). This cannot deadlock:
// each ncclGroupEnd launches the matching halves of both ranks together, so no
// host call ever waits for a peer that has not been issued, and both ranks run
// exactly the same collectives because one loop issues them. A skip or an
// error stops both ranks at once. (Ranks as Google Benchmark threads,
// ->Threads(2), would need both threads to agree on every skip, error and
// iteration, and a thread that left early would leave its peer blocked inside
// a collective.)
//
// Sizes are nccl-tests' "size": the bytes of the larger buffer of one rank.
//   all_gather      output = bytes, input  = bytes / n
//   reduce_scatter  input  = bytes, output = bytes / n   (sum)
//   all_to_all      input  = output = bytes (bytes / n to each peer)
// Bandwidths, in GB/s (1e9 bytes per second), with nccl-tests' formulas:
//   algbw = bytes / t               t = time of one collective
//   busbw = algbw * (n - 1) / n     all_gather, reduce_scatter and all_to_all
//
// Timing: after a correctness check (first run of each benchmark only) and
// kWarmup untimed collectives, each Google Benchmark iteration records a CUDA
// event on each rank's stream, issues kBatch collectives back to back, records
// a second event, and reports the slower rank's time / kBatch as the iteration
// time (UseManualTime). Iterations and repetitions are fixed, so every run
// issues the same number of collectives; the JSON's median over repetitions is
// what compare_collectives.py reads. Counters: bytes, algbw_GBps, busbw_GBps
// (from the run's total event time), ranks.
//
// NVLink multicast stays off: main() sets NCCL_NVLS_ENABLE=0 unless the
// environment already says otherwise (tools/gpu-test.sh exports it too).
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/core/half.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Shape;
using slime::Stream;
using slime::Tensor;
using slime::comm::NcclComm;

constexpr int kRanks = 2;
constexpr int kWarmup = 5;       // untimed collectives per run
constexpr int kBatch = 10;       // collectives per timed iteration
constexpr int kIterations = 10;  // timed iterations per run
constexpr int kRepetitions = 5;  // runs; the median is reported
constexpr int64_t kMinBytes = int64_t(1) << 20;
constexpr int64_t kMaxBytes = int64_t(1) << 30;

enum class Op { all_gather, reduce_scatter, all_to_all };

// The two communicators (rank r on cuda:r) and a stream for each, created on
// first use and destroyed at the end of main.
struct Ranks {
  std::vector<Stream> streams;  // declared first: destroyed after the communicators
  std::vector<std::unique_ptr<NcclComm>> comms;
  std::string error;  // set when creating them failed
};

std::unique_ptr<Ranks> create_ranks() {
  auto r = std::make_unique<Ranks>();
  try {
    const std::string id = NcclComm::unique_id();
    auto group = std::make_shared<slime::comm::NcclAbortGroup>();
    r->comms.resize(kRanks);
    std::vector<std::string> errors(kRanks);
    std::vector<std::thread> threads;
    // ncclCommInitRank blocks until every rank has joined: one thread per rank.
    for (int i = 0; i < kRanks; ++i) {
      threads.emplace_back([&, i] {
        try {
          r->comms[std::size_t(i)] = NcclComm::init_rank(id, i, kRanks, Device::cuda(i), group);
        } catch (const std::exception& e) {
          errors[std::size_t(i)] = e.what();
          group->abort_all();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const std::string& e : errors)
      if (!e.empty() && r->error.empty()) r->error = e;
    if (r->error.empty())
      for (int i = 0; i < kRanks; ++i) r->streams.push_back(Stream::create(Device::cuda(i)));
  } catch (const std::exception& e) {
    r->error = e.what();
  }
  if (!r->error.empty()) r->comms.clear();
  return r;
}

std::unique_ptr<Ranks> g_ranks;  // created by the first benchmark that runs; Google Benchmark runs them on one thread

Ranks& ranks() {
  if (!g_ranks) g_ranks = create_ranks();
  return *g_ranks;
}

// Element i of rank r's input: ((i + 3 r) mod 17) - 8, small integers whose
// sums over the ranks are exact in bf16.
struct Pattern {
  uint16_t bits[17];
  Pattern() {
    for (int k = 0; k < 17; ++k) bits[k] = BFloat16(float(k - 8)).bits;
  }
  uint16_t at(int rank, int64_t i) const { return bits[(i + 3 * rank) % 17]; }
  float value(int rank, int64_t i) const { return float((i + 3 * rank) % 17 - 8); }
};

std::vector<BFloat16> pattern_values(const Pattern& p, int rank, int64_t n) {
  std::vector<BFloat16> v(static_cast<std::size_t>(n));
  int64_t k = (3 * rank) % 17;
  for (int64_t i = 0; i < n; ++i) {
    v[std::size_t(i)] = BFloat16::from_bits(p.bits[k]);
    if (++k == 17) k = 0;
  }
  return v;
}

struct Buffers {
  std::vector<Tensor> in, out;  // per rank
  int64_t in_elems = 0, out_elems = 0, chunk = 0;
};

Buffers make_buffers(Ranks& R, Op op, int64_t bytes) {
  Buffers b;
  const int64_t total = bytes / int64_t(sizeof(BFloat16));  // elements of the larger buffer
  b.chunk = total / kRanks;
  b.in_elems = op == Op::all_gather ? b.chunk : total;
  b.out_elems = op == Op::reduce_scatter ? b.chunk : total;
  for (int r = 0; r < kRanks; ++r) {
    const Device d = Device::cuda(r);
    b.in.push_back(Tensor::empty(Shape{b.in_elems}, DType::bf16, d, R.streams[std::size_t(r)]));
    b.out.push_back(Tensor::empty(Shape{b.out_elems}, DType::bf16, d, R.streams[std::size_t(r)]));
  }
  return b;
}

// Both ranks' halves of one collective, launched together.
void launch(Ranks& R, Op op, Buffers& b) {
  NcclComm::group_start();
  try {
    for (int r = 0; r < kRanks; ++r) {
      NcclComm& c = *R.comms[std::size_t(r)];
      const Stream& s = R.streams[std::size_t(r)];
      switch (op) {
        case Op::all_gather:
          c.all_gather(b.in[std::size_t(r)], b.out[std::size_t(r)], s);
          break;
        case Op::reduce_scatter:
          c.reduce_scatter(b.in[std::size_t(r)], b.out[std::size_t(r)], slime::comm::ReduceOp::sum, s);
          break;
        case Op::all_to_all:
          c.all_to_all(b.in[std::size_t(r)], b.out[std::size_t(r)], s);
          break;
      }
    }
  } catch (...) {
    try {
      NcclComm::group_end();  // close the group; the first error is the one to report
    } catch (...) {
    }
    throw;
  }
  NcclComm::group_end();
}

void synchronize(Ranks& R) {
  for (const Stream& s : R.streams) s.synchronize();
}

// Fills the inputs with the pattern, runs the collective once and compares
// every output element with the host's expectation. Returns "" or what went
// wrong.
std::string check_once(Ranks& R, Op op, Buffers& b) {
  const Pattern p;
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<BFloat16> v = pattern_values(p, r, b.in_elems);
    b.in[std::size_t(r)].copy_from(Tensor::from_vector(v, Shape{b.in_elems}), R.streams[std::size_t(r)]);
    b.out[std::size_t(r)].fill_bytes_(0xff, R.streams[std::size_t(r)]);  // NaN: a missed element shows
  }
  synchronize(R);
  launch(R, op, b);
  synchronize(R);
  // Index of the first element of got[0, len) that differs from rank src's
  // pattern from element `first` on, or -1.
  auto first_mismatch = [&](const BFloat16* got, int src, int64_t first, int64_t len) -> int64_t {
    int64_t k = (first + 3 * src) % 17;
    for (int64_t j = 0; j < len; ++j) {
      if (got[j].bits != p.bits[k]) return j;
      if (++k == 17) k = 0;
    }
    return -1;
  };
  for (int r = 0; r < kRanks; ++r) {
    const std::vector<BFloat16> got = b.out[std::size_t(r)].to_vector<BFloat16>(R.streams[std::size_t(r)]);
    int64_t bad = -1;
    uint16_t want = 0;
    switch (op) {
      case Op::all_gather:  // out[q chunk + j] = in_q[j]
      case Op::all_to_all:  // out_r[q chunk + j] = in_q[r chunk + j]
        for (int q = 0; q < kRanks && bad < 0; ++q) {
          const int64_t first = op == Op::all_gather ? 0 : r * b.chunk;
          const int64_t j = first_mismatch(got.data() + q * b.chunk, q, first, b.chunk);
          if (j >= 0) {
            bad = q * b.chunk + j;
            want = p.at(q, first + j);
          }
        }
        break;
      case Op::reduce_scatter:  // out_r[j] = sum_q in_q[r chunk + j]
        for (int64_t j = 0; j < b.out_elems; ++j) {
          float sum = 0.f;
          for (int q = 0; q < kRanks; ++q) sum += p.value(q, r * b.chunk + j);
          if (got[std::size_t(j)].bits != BFloat16(sum).bits) {
            bad = j;
            want = BFloat16(sum).bits;
            break;
          }
        }
        break;
    }
    if (bad >= 0)
      return slime::detail::concat("correctness check failed: rank ", r, " output element ", bad, " of ", b.out_elems,
                                   " is ", got[std::size_t(bad)].to_float(), ", expected ",
                                   BFloat16::from_bits(want).to_float());
  }
  return "";
}

void run_collective(benchmark::State& state, Op op) {
  const int64_t bytes = state.range(0);
  const int devices = slime::cuda_device_count();
  if (devices < kRanks) {
    state.SkipWithError(slime::detail::concat("needs ", kRanks, " CUDA devices, this process sees ", devices).c_str());
    return;
  }
  Ranks& R = ranks();
  if (!R.error.empty()) {
    state.SkipWithError(("creating the NCCL communicators failed: " + R.error).c_str());
    return;
  }
  slime::bench::run_or_skip(state, [&] {
    Buffers b = make_buffers(R, op, bytes);
    // The first run of each (op, bytes) is checked; its verdict holds for the
    // later repetitions too.
    static std::map<std::pair<int, int64_t>, std::string> verdicts;
    const auto id = std::make_pair(int(op), bytes);
    if (!slime::bench::passed_check(state, verdicts, id, [&] { return check_once(R, op, b); })) return;
    // Every rank's stream is timed; the slower rank's time is the iteration's.
    const double t = slime::bench::time_batches(state, R.streams, kWarmup, kBatch, [&] { launch(R, op, b); });
    const double algbw = slime::bench::per_second(double(bytes), t, 1e9);
    state.counters["bytes"] = double(bytes);
    state.counters["algbw_GBps"] = algbw;
    state.counters["busbw_GBps"] = algbw * double(kRanks - 1) / double(kRanks);
    state.counters["ranks"] = kRanks;
  });
}

}  // namespace

int main(int argc, char** argv) {
  // Never NVLink multicast (shared hosts); an explicit setting is left alone.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);

  const std::pair<const char*, Op> ops[] = {
      {"all_gather", Op::all_gather}, {"reduce_scatter", Op::reduce_scatter}, {"all_to_all", Op::all_to_all}};
  for (const auto& [name, op] : ops) {
    const Op which = op;
    slime::bench::register_manual(
        name, [which](benchmark::State& state) { run_collective(state, which); }, benchmark::kMicrosecond, kIterations,
        kRepetitions)
        ->RangeMultiplier(4)
        ->Range(kMinBytes, kMaxBytes)
        ->DisplayAggregatesOnly(true);
  }
  const int rc = slime::bench::run_benchmarks(argc, argv, [] {
    try {
      benchmark::AddCustomContext("nccl_version", NcclComm::nccl_version());
    } catch (const std::exception& e) {
      benchmark::AddCustomContext("nccl_version", std::string("unknown: ") + e.what());
    }
    benchmark::AddCustomContext("dtype", "bf16");
    benchmark::AddCustomContext("ranks", std::to_string(kRanks));
    benchmark::AddCustomContext("NCCL_NVLS_ENABLE", std::getenv("NCCL_NVLS_ENABLE"));
  });
  g_ranks.reset();  // ncclCommDestroy before static destruction and CUDA teardown
  return rc;
}
