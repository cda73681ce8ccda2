// NcclComm on the GPUs of one process (ranks as threads, run_nccl_ranks, one
// GPU each: min(device count, 2) ranks) against values computed on the host,
// and the CUDA side of core that the NCCL work stands on: tensor copies, pool
// statistics, the counter-based RNG and the bf16/fp16 conversions (this file
// is .cu for the conversion kernels).
//
// Catch2 assertions stay on the main thread: rank functions store what they
// computed, per rank, and the test checks it after run_nccl_ranks returns.
// Every value a collective handles is exact in its dtype, so results are
// compared exactly.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "slime/comm/nccl_comm.hpp"
#include "slime/core/half.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/core/tensor.hpp"

namespace {

using slime::BFloat16;
using slime::Device;
using slime::DType;
using slime::Half;
using slime::Shape;
using slime::Stream;
using slime::Tensor;
using slime::comm::NcclComm;
using slime::comm::ReduceOp;
using slime::comm::run_nccl_ranks;

// NVLink multicast stays off on the shared GPU hosts, also when this binary is
// run by hand (tools/gpu-test.sh exports it as well); an explicit setting wins.
[[maybe_unused]] const bool kNvlsOff = (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0), true);

int test_ranks() { return std::min(slime::cuda_device_count(), 2); }

// Ends the process when `fn` has not returned after `seconds`: a hung
// collective fails its test at once instead of holding the GPUs until
// ctest's timeout.
template <class F>
void within_seconds(int seconds, F&& fn) {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread watchdog([&] {
    std::unique_lock<std::mutex> lock(m);
    if (!cv.wait_for(lock, std::chrono::seconds(seconds), [&] { return done; })) {
      std::fprintf(stderr, "test did not finish within %d s (a collective hung?); exiting\n", seconds);
      std::fflush(stderr);
      std::_Exit(3);
    }
  });
  auto finish = [&] {
    {
      std::lock_guard<std::mutex> lock(m);
      done = true;
    }
    cv.notify_all();
    watchdog.join();
  };
  try {
    fn();
  } catch (...) {
    finish();
    throw;
  }
  finish();
}

constexpr int kDeadlineS = 90;

// ---- host values -------------------------------------------------------------

template <class T>
constexpr bool is_half_type = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

template <class T>
T from_double(double v) {
  if constexpr (is_half_type<T>) {
    return T(float(v));
  } else {
    return static_cast<T>(v);
  }
}

template <class T>
double to_double(T x) {
  if constexpr (is_half_type<T>) {
    return double(x.to_float());
  } else {
    return double(x);
  }
}

// Element i of rank r's data. Small integers for the floating types (exact in
// bf16, as are their sums, extremes and halves over two ranks); for i64,
// multiples of 2^42 plus the rank, which need more than 32 bits (and stay
// exact in a double).
double value(DType dt, int rank, int64_t i) {
  const double small = double((i * 7 + rank * 5) % 23 - 11);
  if (dt == DType::i64) return small * 4398046511104.0 + rank;
  return small;
}

std::vector<double> values(DType dt, int rank, int64_t n, int64_t first = 0) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = value(dt, rank, first + i);
  return v;
}

Tensor make(DType dt, const std::vector<double>& v, const Shape& shape, Device d, const Stream& s = {}) {
  return slime::visit_dtype(dt, [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> typed(v.size());
    for (std::size_t i = 0; i < v.size(); ++i) typed[i] = from_double<T>(v[i]);
    return Tensor::from_vector(typed, shape, d, s);
  });
}

std::vector<double> read(const Tensor& t, const Stream& s = {}) {
  return slime::visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const std::vector<T> typed = t.to_vector<T>(s);
    std::vector<double> out(typed.size());
    for (std::size_t i = 0; i < typed.size(); ++i) out[i] = to_double(typed[i]);
    return out;
  });
}

double reduce(ReduceOp op, const std::vector<double>& xs) {
  double acc = xs.at(0);
  for (std::size_t i = 1; i < xs.size(); ++i) {
    switch (op) {
      case ReduceOp::sum:
      case ReduceOp::avg:
        acc += xs[i];
        break;
      case ReduceOp::max:
        acc = std::max(acc, xs[i]);
        break;
      case ReduceOp::min:
        acc = std::min(acc, xs[i]);
        break;
    }
  }
  return op == ReduceOp::avg ? acc / double(xs.size()) : acc;
}

std::vector<ReduceOp> ops_for(DType dt) {
  if (slime::is_floating(dt)) return {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
  return {ReduceOp::sum, ReduceOp::max, ReduceOp::min};
}

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::i64};

// What each rank computed, by name; written by its own thread only.
using Results = std::vector<std::map<std::string, std::vector<double>>>;

std::string key(const char* what, DType dt, const std::string& extra = "") {
  return std::string(what) + "/" + std::string(slime::dtype_name(dt)) + (extra.empty() ? "" : "/" + extra);
}

void check_results(const Results& got, const Results& expected) {
  REQUIRE(got.size() == expected.size());
  for (std::size_t r = 0; r < got.size(); ++r) {
    for (const auto& [name, want] : expected[r]) {
      INFO("rank " << r << ": " << name);
      const auto it = got[r].find(name);
      REQUIRE(it != got[r].end());
      CHECK(it->second == want);
    }
  }
}

}  // namespace

// ---- collectives ---------------------------------------------------------------

TEST_CASE("NcclComm all_gather and broadcast match the host", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  constexpr int64_t k = 7;  // per-rank length that divides nothing
  Results got(static_cast<std::size_t>(n));
  std::vector<std::string> identity(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      const int r = c.rank();
      auto& mine = got[std::size_t(r)];
      identity[std::size_t(r)] = slime::detail::concat(c.backend(), " ", c.rank(), "/", c.size(), " ", c.device());
      for (DType dt : kDtypes) {
        // [k, 3] rows in, [n k, 3] out: the collective sees element counts.
        Tensor in = make(dt, values(dt, r, 3 * k), Shape{k, 3}, c.device());
        Tensor out = Tensor::empty(Shape{k * n, 3}, dt, c.device());
        out.fill_bytes_(0xff);
        c.all_gather(in, out);
        mine[key("all_gather", dt)] = read(out);

        Tensor t = make(dt, values(dt, r, 11), Shape{11}, c.device());
        c.broadcast(t, n - 1);
        mine[key("broadcast", dt)] = read(t);

        Tensor empty_in = Tensor::empty(Shape{0}, dt, c.device());
        Tensor empty_out = Tensor::empty(Shape{0}, dt, c.device());
        c.all_gather(empty_in, empty_out);  // zero elements: no NCCL call, no hang
      }
    });
  });

  for (int r = 0; r < n; ++r)
    CHECK(identity[std::size_t(r)] == slime::detail::concat("nccl ", r, "/", n, " ", Device::cuda(r)));
  Results expected(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (DType dt : kDtypes) {
      std::vector<double> all;
      for (int q = 0; q < n; ++q)
        for (double x : values(dt, q, 3 * k)) all.push_back(x);
      expected[std::size_t(r)][key("all_gather", dt)] = all;
      expected[std::size_t(r)][key("broadcast", dt)] = values(dt, n - 1, 11);
    }
  }
  check_results(got, expected);
}

TEST_CASE("NcclComm reduce_scatter and all_reduce match the host for every op", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  constexpr int64_t k = 7;
  const int64_t len = 7 * n + 3;  // all_reduce length: odd, not a multiple of n
  Results got(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      const int r = c.rank();
      auto& mine = got[std::size_t(r)];
      for (DType dt : kDtypes) {
        for (ReduceOp op : ops_for(dt)) {
          const std::string o(slime::comm::reduce_op_name(op));
          Tensor in = make(dt, values(dt, r, k * n), Shape{k * n}, c.device());
          Tensor out = Tensor::empty(Shape{k}, dt, c.device());
          out.fill_bytes_(0xff);
          c.reduce_scatter(in, out, op);
          mine[key("reduce_scatter", dt, o)] = read(out);

          Tensor t = make(dt, values(dt, r, len), Shape{len}, c.device());
          c.all_reduce(t, op);
          mine[key("all_reduce", dt, o)] = read(t);
        }
      }
    });
  });

  Results expected(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (DType dt : kDtypes) {
      for (ReduceOp op : ops_for(dt)) {
        const std::string o(slime::comm::reduce_op_name(op));
        std::vector<double> rs(k), ar(static_cast<std::size_t>(len));
        for (int64_t i = 0; i < k; ++i) {
          std::vector<double> xs;
          for (int q = 0; q < n; ++q) xs.push_back(value(dt, q, r * k + i));
          rs[std::size_t(i)] = reduce(op, xs);
        }
        for (int64_t i = 0; i < len; ++i) {
          std::vector<double> xs;
          for (int q = 0; q < n; ++q) xs.push_back(value(dt, q, i));
          ar[std::size_t(i)] = reduce(op, xs);
        }
        expected[std::size_t(r)][key("reduce_scatter", dt, o)] = rs;
        expected[std::size_t(r)][key("all_reduce", dt, o)] = ar;
      }
    }
  }
  check_results(got, expected);
}

namespace {
// Ragged all_to_all_v: rows (of 3 elements) that rank `from` sends to rank
// `to`; zero for some pairs, and rank 1 sends nothing at all in round 1.
int64_t ragged_rows(int round, int from, int to) {
  if (round == 1 && from == 1) return 0;
  return int64_t((from * 3 + to * 5 + 1 + round) % 4);
}
// Row j of the block `from` sends to `to`, column c (an index into value()).
int64_t ragged_index(int from, int to, int64_t j, int64_t c) { return 1000 + 100 * to + 3 * j + c + from; }
}  // namespace

TEST_CASE("NcclComm all_to_all and ragged all_to_all_v match the host", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  constexpr int64_t k = 7;  // per-peer chunk of all_to_all
  Results got(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      const int r = c.rank();
      auto& mine = got[std::size_t(r)];
      // A stream of its own: tensors are allocated, filled, exchanged and read
      // on it, so nothing relies on the legacy default stream's ordering.
      const Stream s = Stream::create(c.device());
      for (DType dt : kDtypes) {
        // Chunk j of rank r's input (for rank j) holds value(r, 100 j + i).
        std::vector<double> in_values;
        for (int j = 0; j < n; ++j)
          for (double x : values(dt, r, k, 100 * j)) in_values.push_back(x);
        Tensor in = make(dt, in_values, Shape{k * n}, c.device(), s);
        Tensor out = Tensor::empty(Shape{k * n}, dt, c.device(), s);
        out.fill_bytes_(0xff, s);
        c.all_to_all(in, out, s);
        mine[key("all_to_all", dt)] = read(out, s);

        for (int round = 0; round < 2; ++round) {
          std::vector<int64_t> send_rows, recv_rows;
          std::vector<double> rows_in;
          int64_t send_total = 0, recv_total = 0;
          for (int q = 0; q < n; ++q) {
            send_rows.push_back(ragged_rows(round, r, q));
            recv_rows.push_back(ragged_rows(round, q, r));
            send_total += send_rows.back();
            recv_total += recv_rows.back();
            for (int64_t j = 0; j < send_rows.back(); ++j)
              for (int64_t col = 0; col < 3; ++col) rows_in.push_back(value(dt, r, ragged_index(r, q, j, col)));
          }
          // One spare row each side: the input's is never sent, the output's
          // must keep its -5.
          for (int col = 0; col < 3; ++col) rows_in.push_back(-5);
          Tensor vin = make(dt, rows_in, Shape{send_total + 1, 3}, c.device(), s);
          Tensor vout = make(dt, std::vector<double>(std::size_t(3 * (recv_total + 1)), -5), Shape{recv_total + 1, 3},
                             c.device(), s);
          c.all_to_all_v(vin, send_rows, vout, recv_rows, s);
          mine[key("all_to_all_v", dt, std::to_string(round))] = read(vout, s);
        }
      }
      s.synchronize();
    });
  });

  Results expected(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    for (DType dt : kDtypes) {
      std::vector<double> a2a;
      for (int q = 0; q < n; ++q)
        for (double x : values(dt, q, k, 100 * r)) a2a.push_back(x);
      expected[std::size_t(r)][key("all_to_all", dt)] = a2a;
      for (int round = 0; round < 2; ++round) {
        std::vector<double> rows_out;
        for (int q = 0; q < n; ++q)
          for (int64_t j = 0; j < ragged_rows(round, q, r); ++j)
            for (int64_t col = 0; col < 3; ++col) rows_out.push_back(value(dt, q, ragged_index(q, r, j, col)));
        for (int col = 0; col < 3; ++col) rows_out.push_back(-5);
        expected[std::size_t(r)][key("all_to_all_v", dt, std::to_string(round))] = rows_out;
      }
    }
  }
  check_results(got, expected);
}

TEST_CASE("NcclComm send/recv, barrier, and arguments checked before anything is sent", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  Results got(static_cast<std::size_t>(n));
  std::vector<std::vector<std::string>> errors(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      const int r = c.rank();
      auto& mine = got[std::size_t(r)];
      auto& errs = errors[std::size_t(r)];
      // Ring exchange: r sends to r + 1 and receives from r - 1. A lone send
      // blocks the GPU until its receive runs, so even ranks send first and
      // odd ranks receive first (n = 2 pairs them; a lone rank has no peer).
      if (n >= 2) {
        for (DType dt : {DType::bf16, DType::i64}) {
          const int next = (r + 1) % n, prev = (r + n - 1) % n;
          Tensor out = make(dt, values(dt, r, 9, 50), Shape{9}, c.device());
          Tensor in = Tensor::empty(Shape{9}, dt, c.device());
          in.fill_bytes_(0xff);
          if (r % 2 == 0) {
            c.send(out, next);
            c.recv(in, prev);
          } else {
            c.recv(in, prev);
            c.send(out, next);
          }
          mine[key("recv", dt)] = read(in);
        }
      }
      for (int i = 0; i < 3; ++i) c.barrier();

      // Each bad call throws on every rank alike, before NCCL sees it, so the
      // ranks stay in step; the all_reduce after them proves it.
      auto expect_throw = [&](auto&& call) {
        try {
          call();
          errs.push_back("no exception");
        } catch (const slime::Error& e) {
          errs.push_back(e.what());
        }
      };
      Tensor host = Tensor::zeros(Shape{4}, DType::f32);
      Tensor dev4 = Tensor::zeros(Shape{4}, DType::f32, c.device());
      Tensor dev5 = Tensor::zeros(Shape{5}, DType::f32, c.device());
      Tensor dev_i64 = Tensor::zeros(Shape{4}, DType::i64, c.device());
      expect_throw([&] { c.all_reduce(host); });                    // wrong device
      expect_throw([&] { c.all_gather(dev4, dev5); });              // wrong output size
      expect_throw([&] { c.all_gather(dev4, dev_i64); });           // dtype mismatch
      expect_throw([&] { c.all_reduce(dev_i64, ReduceOp::avg); });  // avg on integers
      expect_throw([&] { c.broadcast(dev4, n); });                  // root out of range
      expect_throw([&] { c.all_reduce(dev4, ReduceOp::sum, Stream::create(Device::cuda((r + 1) % 2))); });
      Tensor ones = make(DType::f32, std::vector<double>(4, 1.0), Shape{4}, c.device());
      c.all_reduce(ones);
      mine["after_errors"] = read(ones);
    });
  });

  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    if (n >= 2) {
      const int prev = (r + n - 1) % n;
      for (DType dt : {DType::bf16, DType::i64}) CHECK(got[std::size_t(r)][key("recv", dt)] == values(dt, prev, 9, 50));
    }
    CHECK(got[std::size_t(r)]["after_errors"] == std::vector<double>(4, double(n)));
    const auto& errs = errors[std::size_t(r)];
    REQUIRE(errs.size() == 6);
    CHECK_THAT(errs[0], Catch::Matchers::ContainsSubstring("communicator works on cuda:"));
    CHECK_THAT(errs[1], Catch::Matchers::ContainsSubstring("times the input"));
    CHECK_THAT(errs[2], Catch::Matchers::ContainsSubstring("dtype mismatch"));
    CHECK_THAT(errs[3], Catch::Matchers::ContainsSubstring("avg reduction needs a floating dtype"));
    CHECK_THAT(errs[4], Catch::Matchers::ContainsSubstring("out of range"));
    // With one GPU the "other" device is cuda:1, which does not exist.
    CHECK(errs[5] != "no exception");
  }
}

TEST_CASE("NcclComm split renumbers by key, groups by color, and leaves out negative colors", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  Results got(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      const int r = c.rank();
      auto& mine = got[std::size_t(r)];
      auto reversed = c.split(0, n - 1 - r);
      mine["reversed/shape"] = {double(reversed->rank()), double(reversed->size()),
                                double(reversed->device() == c.device())};
      Tensor in = make(DType::i64, {double(r), double(100 + r)}, Shape{2}, c.device());
      Tensor out = Tensor::empty(Shape{2 * n}, DType::i64, c.device());
      reversed->all_gather(in, out);
      mine["reversed/all_gather"] = read(out);

      auto parity = c.split(r % 2, r);
      mine["parity/shape"] = {double(parity->rank()), double(parity->size())};
      Tensor ones = make(DType::f32, std::vector<double>(5, 1.0), Shape{5}, c.device());
      parity->all_reduce(ones);
      mine["parity/all_reduce"] = read(ones);

      auto only_root = c.split(r == 0 ? 3 : -1, 0);
      mine["only_root"] = {double(only_root != nullptr), only_root ? double(only_root->size()) : -1.0};

      // A split of a split, and a barrier on each.
      auto nested = reversed->split(0, r);
      mine["nested/shape"] = {double(nested->rank()), double(nested->size())};
      nested->barrier();
      parity->barrier();
      reversed->barrier();
      c.barrier();
    });
  });

  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    auto& mine = got[std::size_t(r)];
    CHECK(mine["reversed/shape"] == std::vector<double>{double(n - 1 - r), double(n), 1.0});
    std::vector<double> gathered;
    for (int q = n - 1; q >= 0; --q) {
      gathered.push_back(q);
      gathered.push_back(100 + q);
    }
    CHECK(mine["reversed/all_gather"] == gathered);
    const int parity_size = (n - r % 2 + 1) / 2;
    CHECK(mine["parity/shape"] == std::vector<double>{double(r / 2), double(parity_size)});
    CHECK(mine["parity/all_reduce"] == std::vector<double>(5, double(parity_size)));
    CHECK(mine["only_root"] == (r == 0 ? std::vector<double>{1.0, 1.0} : std::vector<double>{0.0, -1.0}));
    CHECK(mine["nested/shape"] == std::vector<double>{double(r), double(n)});
  }
}

TEST_CASE("run_nccl_ranks rethrows a failing rank's exception and aborts the others", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const int n = test_ranks();
  std::vector<std::string> seen(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    CHECK_THROWS_WITH(run_nccl_ranks(n,
                                     [&](NcclComm& c) {
                                       const int r = c.rank();
                                       Tensor t = make(DType::f32, {1.0, 2.0, 3.0}, Shape{3}, c.device());
                                       c.all_reduce(t);
                                       (void)read(t);  // every rank connected and in step
                                       if (r == n - 1) {
                                         // Let the others reach their wait first.
                                         std::this_thread::sleep_for(std::chrono::milliseconds(300));
                                         throw std::runtime_error("rank failed on purpose");
                                       }
                                       // Waits for a rank that never comes, until the abort ends it.
                                       try {
                                         c.all_reduce(t);
                                         (void)read(t);
                                         c.all_reduce(t);
                                         seen[std::size_t(r)] = "no exception";
                                       } catch (const slime::Error& e) {
                                         seen[std::size_t(r)] = e.what();
                                         throw;
                                       }
                                     }),
                      Catch::Matchers::ContainsSubstring("failed on purpose"));
  });
  for (int r = 0; r + 1 < n; ++r) {
    INFO("rank " << r);
    CHECK_THAT(seen[std::size_t(r)], Catch::Matchers::ContainsSubstring("aborted"));
  }
  // The GPUs are usable afterwards: a fresh clique works.
  std::vector<double> sums(static_cast<std::size_t>(n));
  within_seconds(kDeadlineS, [&] {
    run_nccl_ranks(n, [&](NcclComm& c) {
      Tensor t = make(DType::f32, {double(c.rank() + 1)}, Shape{1}, c.device());
      c.all_reduce(t);
      sums[std::size_t(c.rank())] = read(t).at(0);
    });
  });
  for (double s : sums) CHECK(s == double(n * (n + 1) / 2));
}

TEST_CASE("NcclComm::from_env without a launcher is a one-rank communicator", "[comm][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  for (const char* var : {"RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID"})
    if (std::getenv(var) != nullptr) SKIP(std::string(var) + " is set: this process was started by a launcher");
  std::vector<double> result;
  within_seconds(kDeadlineS, [&] {
    std::unique_ptr<NcclComm> c = NcclComm::from_env();
    REQUIRE(c->rank() == 0);
    REQUIRE(c->size() == 1);
    REQUIRE(c->device() == Device::cuda(0));
    Tensor in = make(DType::bf16, values(DType::bf16, 0, 6), Shape{6}, c->device());
    Tensor out = Tensor::empty(Shape{6}, DType::bf16, c->device());
    c->all_to_all(in, out);  // a send and receive to itself
    c->all_reduce(out, ReduceOp::max);
    result = read(out);
    c->barrier();
  });
  CHECK(result == values(DType::bf16, 0, 6));
  CHECK_FALSE(NcclComm::nccl_version().empty());
}

// ---- core on the GPU -------------------------------------------------------------

TEST_CASE("Tensor copies between host, pinned host and device keep every byte", "[core][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const int64_t n = 1'000'003;
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[std::size_t(i)] = float(i % 4099) * 0.5f - 1000.f;

  Tensor host = Tensor::from_vector(v, Shape{n});
  Tensor dev = host.to(d);
  CHECK(dev.device() == d);
  CHECK(dev.memory_kind() == slime::MemoryKind::device);
  CHECK(dev.to_vector<float>() == v);
  CHECK(dev.to(Device::cpu()).to_vector<float>() == v);

  // Poison, then overwrite: any element the copy missed would stay NaN.
  Tensor poisoned = Tensor::empty(Shape{n}, DType::f32, d);
  poisoned.fill_bytes_(0xff);
  const std::vector<float> p = poisoned.to_vector<float>();
  CHECK(std::all_of(p.begin(), p.end(), [](float x) { return slime::detail::float_bits(x) == 0xffffffffu; }));
  poisoned.copy_from(dev);
  CHECK(poisoned.to_vector<float>() == v);
  CHECK(dev.clone().to_vector<float>() == v);

  // Pinned host memory, asynchronous copies on a stream of their own.
  const Stream s = Stream::create(d);
  Tensor pinned = Tensor::empty_pinned(Shape{n}, DType::f32);
  CHECK(pinned.is_pinned());
  std::memcpy(pinned.data_ptr(), v.data(), v.size() * sizeof(float));
  Tensor staged = Tensor::empty(Shape{n}, DType::f32, d, s);
  staged.fill_bytes_(0xff, s);
  staged.copy_from(pinned, s);
  Tensor pinned_back = Tensor::empty_pinned(Shape{n}, DType::f32);
  std::memset(pinned_back.data_ptr(), 0xff, pinned_back.nbytes());
  pinned_back.copy_from(staged, s);
  s.synchronize();
  CHECK(std::memcmp(pinned_back.data_ptr(), v.data(), v.size() * sizeof(float)) == 0);

  // A row view as the target of a copy: only its rows change.
  Tensor rows = Tensor::zeros(Shape{1000, 3}, DType::f32, d);
  std::vector<float> five(15);
  for (int i = 0; i < 15; ++i) five[std::size_t(i)] = float(i + 1);
  Tensor view = rows.slice_rows(10, 5);
  view.copy_from(Tensor::from_vector(five, Shape{5, 3}));
  const std::vector<float> all = rows.to_vector<float>();
  for (int64_t i = 0; i < 3000; ++i) {
    const float want = (i >= 30 && i < 45) ? float(i - 30 + 1) : 0.f;
    if (all[std::size_t(i)] != want) FAIL("row view copy: element " << i << " is " << all[std::size_t(i)]);
  }

  // bf16 and i64 round trips, bit for bit.
  std::vector<BFloat16> b(4097);
  for (std::size_t i = 0; i < b.size(); ++i) b[i] = BFloat16::from_bits(uint16_t(i * 16 + 3));
  const std::vector<BFloat16> b_back = Tensor::from_vector(b, Shape{4097}, d).to_vector<BFloat16>();
  CHECK(std::memcmp(b_back.data(), b.data(), b.size() * sizeof(BFloat16)) == 0);
  std::vector<int64_t> big{INT64_MIN, -1, 0, 1, INT64_MAX, int64_t(1) << 40};
  CHECK(Tensor::from_vector(big, Shape{6}, d).to_vector<int64_t>() == big);

  if (slime::cuda_device_count() >= 2) {  // peer copy
    Tensor other = dev.to(Device::cuda(1));
    CHECK(other.device() == Device::cuda(1));
    CHECK(other.to_vector<float>() == v);
  }
}

TEST_CASE("Device pool statistics count a 64 MiB tensor exactly", "[core][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const int64_t bytes = int64_t(64) << 20;
  (void)Tensor::zeros(Shape{16}, DType::f32, d);  // the pool exists and is configured
  Stream::default_for(d).synchronize();
  const slime::MemoryStats before = slime::memory_stats(d);
  {
    Tensor t = Tensor::empty(Shape{bytes}, DType::u8, d);
    const slime::MemoryStats during = slime::memory_stats(d);
    CHECK(during.current_bytes - before.current_bytes == bytes);
    CHECK(during.peak_bytes >= during.current_bytes);
    CHECK(during.peak_bytes >= bytes);
    CHECK(during.allocations == before.allocations + 1);
    CHECK(during.allocated_bytes == before.allocated_bytes + bytes);
    CHECK(during.reserved_bytes >= bytes);
  }
  Stream::default_for(d).synchronize();
  const slime::MemoryStats after = slime::memory_stats(d);
  CHECK(after.current_bytes == before.current_bytes);
  CHECK(after.frees == before.frees + 1);
  CHECK(after.peak_bytes >= before.current_bytes + bytes);
  CHECK(after.reserved_bytes > 0);  // freed memory stays cached in the pool
  slime::reset_peak_memory_stats(d);
  CHECK(slime::memory_stats(d).peak_bytes == slime::memory_stats(d).current_bytes);
}

namespace {
// Distance in units in the last place between two values of one float type,
// given as raw bits of `width` (32 or 16) bits: maps sign-magnitude to a
// monotonic integer line.
int64_t ulp_distance(uint32_t a, uint32_t b, int width) {
  const uint32_t sign = 1u << (width - 1);
  auto line = [&](uint32_t x) { return (x & sign) ? -int64_t(x & (sign - 1)) : int64_t(x); };
  const int64_t d = line(a) - line(b);
  return d < 0 ? -d : d;
}

std::vector<uint32_t> raw_bits(const Tensor& host) {
  std::vector<uint32_t> out(static_cast<std::size_t>(host.numel()));
  const auto* p = static_cast<const unsigned char*>(host.data_ptr());
  const std::size_t w = slime::dtype_size(host.dtype());
  for (std::size_t i = 0; i < out.size(); ++i) {
    uint32_t x = 0;
    std::memcpy(&x, p + i * w, w);  // little endian: the low bytes
    out[i] = x;
  }
  return out;
}
}  // namespace

TEST_CASE("GPU random fills equal the CPU's", "[core][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const int64_t n = 1'000'003;  // odd, so the last Philox block is partial
  const uint64_t seed = 0x5EED0123456789ULL;
  const uint64_t offset = 777'777;  // not a multiple of 4: starts mid-block
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    INFO("dtype " << dt);
    const int width = int(slime::dtype_size(dt)) * 8;

    Tensor cpu = Tensor::empty(Shape{n}, dt);
    Tensor gpu = Tensor::empty(Shape{n}, dt, d);
    slime::fill_uniform(cpu, seed, offset, -3.f, 5.f);
    slime::fill_uniform(gpu, seed, offset, -3.f, 5.f);
    const std::vector<uint32_t> uc = raw_bits(cpu), ug = raw_bits(gpu.to(Device::cpu()));
    int64_t uniform_diff = 0;
    for (std::size_t i = 0; i < uc.size(); ++i) uniform_diff += uc[i] != ug[i];
    CHECK(uniform_diff == 0);

    // mean 0, stddev 2: the scaling is exact, so a one-ulp difference of the
    // standard normal stays one ulp (adding a mean could cancel and magnify it).
    slime::fill_normal(cpu, seed, offset, 0.f, 2.f);
    slime::fill_normal(gpu, seed, offset, 0.f, 2.f);
    const std::vector<uint32_t> nc = raw_bits(cpu), ng = raw_bits(gpu.to(Device::cpu()));
    int64_t equal = 0, worst = 0;
    for (std::size_t i = 0; i < nc.size(); ++i) {
      equal += nc[i] == ng[i];
      worst = std::max(worst, ulp_distance(nc[i], ng[i], width));
    }
    // Box-Muller in double: host libm and CUDA may differ in the last double
    // bit, so a float may differ by one ulp (one ulp of bf16/f16 after
    // rounding); anything more is a bug.
    WARN(dt << " fill_normal: " << equal << " of " << n << " values bitwise equal on CPU and GPU, worst " << worst
            << " ulp");
    CHECK(worst <= 1);
  }
}

namespace {

__global__ void float_to_16bit_kernel(const uint32_t* in, int64_t n, uint16_t* bf16, uint16_t* fp16) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const float f = __uint_as_float(in[i]);
    bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(f));
    fp16[i] = __half_as_ushort(__float2half_rn(f));
  }
}

__global__ void from_16bit_kernel(uint32_t* bf16_to_float, uint32_t* fp16_to_float) {
  const int i = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= 65536) return;
  bf16_to_float[i] = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(uint16_t(i))));
  fp16_to_float[i] = __float_as_uint(__half2float(__ushort_as_half(uint16_t(i))));
}

bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// Float bit patterns to convert: every 97th of all 2^32, every bf16 and fp16
// rounding tie (and its neighbours), the fp16 subnormal ties, and specials.
std::vector<uint32_t> conversion_inputs() {
  std::vector<uint32_t> in;
  in.reserve(47'000'000);
  for (uint64_t b = 0; b < (uint64_t(1) << 32); b += 97) in.push_back(uint32_t(b));
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x7fffu, 0x8000u, 0x8001u}) in.push_back((hi << 16) | lo);
  for (uint32_t k = 0; k < (1u << 19); ++k)
    for (uint32_t lo : {0x0fffu, 0x1000u, 0x1001u}) in.push_back((k << 13) | lo);
  // fp16 subnormals: a float with exponent e has its significand shifted
  // right by 126 - e bits; the tie sits at half of the last kept bit.
  for (uint32_t e = 102; e <= 112; ++e) {
    const uint32_t shift = 126 - e;
    for (uint32_t q = 0x800000u >> shift; q <= (0xffffffu >> shift); ++q) {
      const uint32_t tie = (q << shift) | (1u << (shift - 1));
      if (tie < 0x800000u || tie > 0xffffffu) continue;
      for (uint32_t m : {tie - 1, tie, tie + 1}) {
        if (m < 0x800000u || m > 0xffffffu) continue;
        const uint32_t bits = (e << 23) | (m & 0x7fffffu);
        in.push_back(bits);
        in.push_back(bits | 0x80000000u);
      }
    }
  }
  for (uint32_t s : {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u,
                     0xff800001u, 0x7fffffffu, 0xffffffffu, 0x7f7fffffu, 0xff7fffffu, 0x00000001u, 0x00800000u,
                     0x477fe000u, 0x477fefffu, 0x477ff000u, 0x47800000u, 0x38800000u, 0x387fffffu, 0x33000000u,
                     0x33000001u, 0x32ffffffu, 0x33800000u, 0x3f808000u, 0x3f818000u})
    in.push_back(s);
  return in;
}

}  // namespace

TEST_CASE("bf16 and fp16 conversions on the GPU match the host types bit for bit", "[core][gpu]") {
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");
  const Device d = Device::cuda(0);
  const std::vector<uint32_t> in = conversion_inputs();
  const auto n = int64_t(in.size());
  std::vector<int32_t> in_i32(in.size());
  std::memcpy(in_i32.data(), in.data(), in.size() * sizeof(uint32_t));
  Tensor dev_in = Tensor::from_vector(in_i32, Shape{n}, d);
  Tensor dev_bf16 = Tensor::empty(Shape{n}, DType::bf16, d);
  Tensor dev_fp16 = Tensor::empty(Shape{n}, DType::f16, d);
  dev_bf16.fill_bytes_(0xaa);
  dev_fp16.fill_bytes_(0xaa);
  {
    slime::DeviceGuard guard(d);
    float_to_16bit_kernel<<<4096, 256>>>(static_cast<const uint32_t*>(dev_in.data_ptr()), n,
                                         static_cast<uint16_t*>(dev_bf16.data_ptr()),
                                         static_cast<uint16_t*>(dev_fp16.data_ptr()));
    SLIME_CUDA_CHECK_LAUNCH();
  }
  const std::vector<BFloat16> got_bf16 = dev_bf16.to_vector<BFloat16>();
  const std::vector<Half> got_fp16 = dev_fp16.to_vector<Half>();

  int64_t bf16_bad = 0, fp16_bad = 0, nan_bad = 0, nan_inputs = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    float f;
    std::memcpy(&f, &in[i], sizeof f);
    const uint16_t hb = BFloat16(f).bits, hh = Half(f).bits;
    const uint16_t db = got_bf16[i].bits, dh = got_fp16[i].bits;
    const bool nan = is_nan_bits(in[i]);
    nan_inputs += nan;
    if (nan) {
      if (hb != 0x7fff || db != 0x7fff || hh != 0x7fff || dh != 0x7fff) {
        if (nan_bad++ < 5)
          UNSCOPED_INFO("NaN " << std::hex << in[i] << ": bf16 host " << hb << " gpu " << db << ", fp16 host " << hh
                               << " gpu " << dh);
      }
      continue;
    }
    if (hb != db && bf16_bad++ < 5)
      UNSCOPED_INFO("bf16 of float bits " << std::hex << in[i] << ": host " << hb << ", gpu " << db);
    if (hh != dh && fp16_bad++ < 5)
      UNSCOPED_INFO("fp16 of float bits " << std::hex << in[i] << ": host " << hh << ", gpu " << dh);
  }
  INFO(in.size() << " float patterns, " << nan_inputs << " of them NaN");
  CHECK(nan_inputs > 0);
  CHECK(bf16_bad == 0);
  CHECK(fp16_bad == 0);
  CHECK(nan_bad == 0);

  // Every 16-bit pattern back to float.
  Tensor back_bf16 = Tensor::empty(Shape{65536}, DType::i32, d);
  Tensor back_fp16 = Tensor::empty(Shape{65536}, DType::i32, d);
  {
    slime::DeviceGuard guard(d);
    from_16bit_kernel<<<256, 256>>>(static_cast<uint32_t*>(back_bf16.data_ptr()),
                                    static_cast<uint32_t*>(back_fp16.data_ptr()));
    SLIME_CUDA_CHECK_LAUNCH();
  }
  const std::vector<int32_t> gb = back_bf16.to_vector<int32_t>(), gh = back_fp16.to_vector<int32_t>();
  // NaN patterns are counted apart from the rest: a NaN's payload and sign
  // after the conversion is a separate claim of half.hpp (CUDA canonicalises
  // where the hardware conversion does).
  int64_t bf16_back_bad = 0, bf16_back_nan_bad = 0, fp16_back_bad = 0, fp16_back_nan_bad = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t hb = slime::detail::float_bits(BFloat16::from_bits(uint16_t(h)).to_float());
    const uint32_t hh = slime::detail::float_bits(Half::from_bits(uint16_t(h)).to_float());
    const auto db = uint32_t(gb[h]), dh = uint32_t(gh[h]);
    const bool bf16_nan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0;
    const bool fp16_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    if (hb != db) {
      int64_t& bad = bf16_nan ? bf16_back_nan_bad : bf16_back_bad;
      if (bad++ < 5) UNSCOPED_INFO("bf16 " << std::hex << h << " to float: host " << hb << ", gpu " << db);
    }
    if (hh != dh) {
      int64_t& bad = fp16_nan ? fp16_back_nan_bad : fp16_back_bad;
      if (bad++ < 5) UNSCOPED_INFO("fp16 " << std::hex << h << " to float: host " << hh << ", gpu " << dh);
    }
  }
  CHECK(bf16_back_bad == 0);
  CHECK(fp16_back_bad == 0);
  CHECK(bf16_back_nan_bad == 0);
  CHECK(fp16_back_nan_bad == 0);
}
