// Tests for slime/comm/local_comm.hpp: every collective against a plain loop
// over what each rank holds, in-place variants, point to point, split, and
// failures that must throw on every rank instead of hanging.
//
// Catch2 assertions are not thread-safe: rank threads only record results,
// and the test thread checks them after run_local_ranks has joined.
#include "slime/comm/local_comm.hpp"

#include <atomic>
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "slime/core/random.hpp"

namespace {

using namespace std::chrono_literals;
using namespace slime;
using namespace slime::comm;
using Catch::Matchers::ContainsSubstring;
using Clock = std::chrono::steady_clock;

// Short enough that a broken implementation fails the test instead of hanging ctest.
constexpr std::chrono::milliseconds kTestTimeout = 20s;

template <class F>
void run(int world, F&& fn) {
  run_local_ranks(world, std::forward<F>(fn), kTestTimeout);
}

// Runs fn on every rank; returns what each rank's fn threw ("" where nothing).
template <class F>
std::vector<std::string> errors_per_rank(int world, F&& fn, std::chrono::milliseconds timeout = kTestTimeout) {
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  run_local_ranks(
      world,
      [&](Comm& comm) {
        try {
          fn(comm);
        } catch (const std::exception& e) {
          errors[std::size_t(comm.rank())] = e.what();
        }
      },
      timeout);
  return errors;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// What rank r holds at element i: small integers of both signs, exact in every
// dtype under test, different across ranks and elements.
int value_at(int rank, int64_t i) { return int((rank * 7 + i * 3 + 5) % 17) - 8; }

template <class T>
T from_int(int v) {
  if constexpr (std::is_integral_v<T>) {
    return T(v);
  } else {
    return T(float(v));
  }
}

template <class T>
double to_double(T x) {
  if constexpr (std::is_integral_v<T>) {
    return double(x);
  } else {
    return double(float(x));
  }
}

template <class T>
std::vector<double> doubles(const std::vector<T>& v) {
  std::vector<double> out;
  for (const T& x : v) out.push_back(to_double(x));
  return out;
}

// value_at(rank, first), ..., value_at(rank, first + n - 1) as T.
template <class T>
std::vector<T> rank_values(int rank, int64_t n, int64_t first = 0) {
  std::vector<T> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(from_int<T>(value_at(rank, first + i)));
  return v;
}

// op over ranks 0..world-1 of value_at(r, i), by the documented rule: floating
// types fold in f32 in rank order and round once to T; integers fold in T.
template <class T>
double reference_reduce(ReduceOp op, int world, int64_t i) {
  if constexpr (std::is_integral_v<T>) {
    int64_t acc = value_at(0, i);
    for (int r = 1; r < world; ++r) {
      const int64_t x = value_at(r, i);
      acc = op == ReduceOp::sum ? acc + x : op == ReduceOp::max ? std::max(acc, x) : std::min(acc, x);
    }
    return double(T(acc));
  } else {
    float acc = float(value_at(0, i));
    for (int r = 1; r < world; ++r) {
      const float x = float(value_at(r, i));
      acc = (op == ReduceOp::sum || op == ReduceOp::avg) ? acc + x
            : op == ReduceOp::max                        ? std::max(acc, x)
                                                         : std::min(acc, x);
    }
    if (op == ReduceOp::avg) acc /= float(world);
    return double(float(T(acc)));
  }
}

const char* type_name(DType t) { return dtype_name(t).data(); }

}  // namespace

TEST_CASE("create_group: ranks, size, backend and device", "[comm][local_comm]") {
  const int world = GENERATE(1, 2, 3, 4, 8);
  auto comms = LocalComm::create_group(world);
  REQUIRE(int(comms.size()) == world);
  for (int r = 0; r < world; ++r) {
    CHECK(comms[std::size_t(r)]->rank() == r);
    CHECK(comms[std::size_t(r)]->size() == world);
    CHECK(comms[std::size_t(r)]->backend() == "local");
    CHECK(comms[std::size_t(r)]->device() == Device::cpu());
    CHECK(comms[std::size_t(r)]->group() == comms[0]->group());
  }
  CHECK_THROWS_WITH(LocalComm::create_group(0), ContainsSubstring("needs n >= 1 ranks, got 0"));
  CHECK_THROWS_WITH(run_local_ranks(0, [](Comm&) {}), ContainsSubstring("needs n >= 1 ranks"));
  CHECK_THROWS_WITH(LocalComm::create_group(2, 0ms), ContainsSubstring("timeout must be positive"));
}

TEMPLATE_TEST_CASE("all_reduce: every op, world sizes 1 to 8", "[comm][local_comm]", float, BFloat16, Half, int32_t,
                   int64_t) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4, 8);
  const ReduceOp op = GENERATE(ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min);
  constexpr int64_t n = 13;
  CAPTURE(type_name(dtype_of<T>), world, reduce_op_name(op));

  if (std::is_integral_v<T> && op == ReduceOp::avg) {
    const auto errors = errors_per_rank(world, [&](Comm& comm) {
      Tensor t = Tensor::from_vector(rank_values<T>(comm.rank(), n), {n});
      comm.all_reduce(t, op);
    });
    for (const std::string& e : errors) CHECK_THAT(e, ContainsSubstring("avg reduction needs a floating dtype"));
    return;
  }

  std::vector<std::vector<T>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor t = Tensor::from_vector(rank_values<T>(comm.rank(), n), {n});
    comm.all_reduce(t, op);
    got[std::size_t(comm.rank())] = t.to_vector<T>();
  });
  std::vector<double> want;
  for (int64_t i = 0; i < n; ++i) want.push_back(reference_reduce<T>(op, world, i));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEMPLATE_TEST_CASE("reduce_scatter: every op, 5 elements per rank", "[comm][local_comm]", float, BFloat16, Half,
                   int32_t, int64_t) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4, 8);
  const ReduceOp op = GENERATE(ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min);
  if (std::is_integral_v<T> && op == ReduceOp::avg) return;  // rejected: see the all_reduce test
  constexpr int64_t n = 5;
  CAPTURE(type_name(dtype_of<T>), world, reduce_op_name(op));

  std::vector<std::vector<T>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor in = Tensor::from_vector(rank_values<T>(comm.rank(), n * world), {n * world});
    Tensor out = Tensor::empty({n}, dtype_of<T>);
    comm.reduce_scatter(in, out, op);
    got[std::size_t(comm.rank())] = out.to_vector<T>();
  });
  for (int r = 0; r < world; ++r) {
    std::vector<double> want;
    for (int64_t k = 0; k < n; ++k) want.push_back(reference_reduce<T>(op, world, r * n + k));
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEST_CASE("reduce_scatter in place: output a view inside the input", "[comm][local_comm]") {
  const int world = GENERATE(2, 3, 4, 8);
  // Where the output sits in the input: this rank's own chunk (as FSDP does),
  // or chunk 0, which the peer of rank 0 still reads while this rank writes.
  const bool own_chunk = GENERATE(true, false);
  constexpr int64_t n = 5;
  CAPTURE(world, own_chunk);
  std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor in = Tensor::from_vector(rank_values<float>(comm.rank(), n * world), {n * world});
    Tensor out = in.view(own_chunk ? comm.rank() * n : 0, {n});
    comm.reduce_scatter(in, out, ReduceOp::sum);
    got[std::size_t(comm.rank())] = out.to_vector<float>();
  });
  for (int r = 0; r < world; ++r) {
    std::vector<double> want;
    for (int64_t k = 0; k < n; ++k) want.push_back(reference_reduce<float>(ReduceOp::sum, world, r * n + k));
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEMPLATE_TEST_CASE("all_gather: counts 0, 1 and 7 per rank", "[comm][local_comm]", float, BFloat16, int64_t) {
  using T = TestType;
  const int world = GENERATE(1, 2, 3, 4, 8);
  const int64_t n = GENERATE(0, 1, 7);
  CAPTURE(world, n);
  std::vector<std::vector<T>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor in = Tensor::from_vector(rank_values<T>(comm.rank(), n), {n});
    Tensor out = Tensor::empty({n * world}, dtype_of<T>);
    comm.all_gather(in, out);
    got[std::size_t(comm.rank())] = out.to_vector<T>();
  });
  std::vector<double> want;
  for (int j = 0; j < world; ++j)
    for (int64_t i = 0; i < n; ++i) want.push_back(value_at(j, i));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEST_CASE("all_gather in place: input is the rank's slot of the output", "[comm][local_comm]") {
  const int world = GENERATE(1, 2, 3, 4, 8);
  constexpr int64_t rows = 7, cols = 3;
  CAPTURE(world);
  std::vector<std::vector<BFloat16>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    Tensor out = Tensor::empty({rows * world, cols}, DType::bf16);
    out.fill_bytes_(0xff);  // NaN: a slot left unwritten shows up
    Tensor slot = out.slice_rows(r * rows, rows);
    slot.copy_from(Tensor::from_vector(rank_values<BFloat16>(r, rows * cols), {rows, cols}));
    comm.all_gather(slot, out);
    got[std::size_t(r)] = out.to_vector<BFloat16>();
  });
  std::vector<double> want;
  for (int j = 0; j < world; ++j)
    for (int64_t i = 0; i < rows * cols; ++i) want.push_back(value_at(j, i));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEST_CASE("all_gather: input overlapping the output elsewhere is staged", "[comm][local_comm]") {
  // Every rank's input is the first slot of its output: rank r > 0 overwrites
  // it with slot 0 while its peers still need the original.
  const int world = GENERATE(2, 3, 4, 8);
  constexpr int64_t n = 7;
  CAPTURE(world);
  std::vector<std::vector<int32_t>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor out = Tensor::zeros({n * world}, DType::i32);
    Tensor in = out.view(0, {n});
    in.copy_from(Tensor::from_vector(rank_values<int32_t>(comm.rank(), n), {n}));
    comm.all_gather(in, out);
    got[std::size_t(comm.rank())] = out.to_vector<int32_t>();
  });
  std::vector<double> want;
  for (int j = 0; j < world; ++j)
    for (int64_t i = 0; i < n; ++i) want.push_back(value_at(j, i));
  for (int r = 0; r < world; ++r) CHECK(doubles(got[std::size_t(r)]) == want);
}

TEST_CASE("all_to_all: equal chunks, separate and in place", "[comm][local_comm]") {
  const int world = GENERATE(1, 2, 3, 4, 8);
  const bool in_place = GENERATE(false, true);
  constexpr int64_t n = 3;
  CAPTURE(world, in_place);
  std::vector<std::vector<int64_t>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    Tensor in = Tensor::from_vector(rank_values<int64_t>(comm.rank(), n * world), {n * world});
    Tensor out = in_place ? in : Tensor::empty({n * world}, DType::i64);
    comm.all_to_all(in, out);
    got[std::size_t(comm.rank())] = out.to_vector<int64_t>();
  });
  for (int r = 0; r < world; ++r) {
    // Chunk j of rank r's output is chunk r of rank j's input.
    std::vector<double> want;
    for (int j = 0; j < world; ++j)
      for (int64_t k = 0; k < n; ++k) want.push_back(value_at(j, r * n + k));
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEST_CASE("all_to_all_v: ragged and zero counts", "[comm][local_comm]") {
  const int world = GENERATE(1, 2, 3, 4, 8);
  const bool all_zero = GENERATE(false, true);
  constexpr int64_t cols = 2;
  CAPTURE(world, all_zero);
  // Rows rank src sends to rank dst: 0..3, zeros included; rank 1 sends nothing.
  auto rows = [&](int src, int dst) -> int64_t {
    if (all_zero || src == 1) return 0;
    return (src * 5 + dst * 3 + 1) % 4;
  };
  // Element c of row k that src sends to dst.
  auto cell = [](int src, int dst, int64_t k, int64_t c) { return float(src * 1000 + dst * 100 + k * 2 + c); };
  constexpr float kSentinel = -1.f;

  std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<int64_t> send_rows, recv_rows;
    std::vector<float> in_values;
    for (int dst = 0; dst < world; ++dst) {
      send_rows.push_back(rows(r, dst));
      recv_rows.push_back(rows(dst, r));
      for (int64_t k = 0; k < rows(r, dst); ++k)
        for (int64_t c = 0; c < cols; ++c) in_values.push_back(cell(r, dst, k, c));
    }
    // One spare row on each side: inputs may be longer than what is sent,
    // outputs longer than what arrives; the spare output row stays untouched.
    for (int64_t c = 0; c < cols; ++c) in_values.push_back(kSentinel);
    const int64_t in_rows = int64_t(in_values.size()) / cols;
    int64_t out_rows = 1;
    for (int64_t c : recv_rows) out_rows += c;
    Tensor in = Tensor::from_vector(in_values, {in_rows, cols});
    Tensor out = Tensor::from_vector(std::vector<float>(std::size_t(out_rows * cols), kSentinel), {out_rows, cols});
    comm.all_to_all_v(in, send_rows, out, recv_rows);
    got[std::size_t(r)] = out.to_vector<float>();
  });
  for (int r = 0; r < world; ++r) {
    std::vector<float> want;
    for (int src = 0; src < world; ++src)
      for (int64_t k = 0; k < rows(src, r); ++k)
        for (int64_t c = 0; c < cols; ++c) want.push_back(cell(src, r, k, c));
    for (int64_t c = 0; c < cols; ++c) want.push_back(kSentinel);
    CAPTURE(r);
    CHECK(got[std::size_t(r)] == want);
  }
}

TEST_CASE("all_to_all_v: a count mismatch throws on every rank", "[comm][local_comm]") {
  // Every rank sends one row of 2 elements to each rank, but rank 2 expects
  // two rows from rank 0. Every rank must throw (none may hang), and the
  // group must stay usable.
  constexpr int world = 3;
  std::vector<std::string> errors(world);
  std::vector<int64_t> sums(world);
  const auto t0 = Clock::now();
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::vector<int64_t> send_rows{1, 1, 1}, recv_rows{1, 1, 1};
    if (r == 2) recv_rows[0] = 2;
    Tensor in = Tensor::zeros({3, 2}, DType::i64);
    Tensor out = Tensor::zeros({4, 2}, DType::i64);
    try {
      comm.all_to_all_v(in, send_rows, out, recv_rows);
    } catch (const Error& e) {
      errors[std::size_t(r)] = e.message();
    }
    Tensor t = Tensor::from_vector(std::vector<int64_t>{r + 1}, {1});
    comm.all_reduce(t);
    sums[std::size_t(r)] = t.to_vector<int64_t>()[0];
  });
  CHECK(seconds_since(t0) < 5.0);
  const std::string pair = "rank 0 sends 2 elements to rank 2, but rank 2 expects 4 elements from rank 0";
  CHECK_THAT(errors[0], ContainsSubstring(pair));
  CHECK_THAT(errors[1], ContainsSubstring(pair));
  CHECK_THAT(errors[2], ContainsSubstring(pair));
  CHECK(sums == std::vector<int64_t>{6, 6, 6});
}

TEST_CASE("broadcast from a non-zero root", "[comm][local_comm]") {
  const int world = GENERATE(2, 3, 4, 8);
  const int root = GENERATE_COPY(world - 1, world / 2);
  const int64_t n = GENERATE(0, 9);
  CAPTURE(world, root, n);
  std::vector<std::vector<BFloat16>> got(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    Tensor t = Tensor::from_vector(
        r == root ? rank_values<BFloat16>(r, n) : std::vector<BFloat16>(std::size_t(n), BFloat16(99.f)), {n});
    comm.broadcast(t, root);
    got[std::size_t(r)] = t.to_vector<BFloat16>();
  });
  std::vector<double> want;
  for (int64_t i = 0; i < n; ++i) want.push_back(value_at(root, i));
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
}

TEST_CASE("send/recv: a ring of 3 ranks, FIFO per pair", "[comm][local_comm]") {
  constexpr int world = 3;
  // Rank r sends r + 2 elements of its values to (r + 1) % 3. Sends block
  // until received, so rank 0 sends first and the others receive first.
  std::vector<std::vector<float>> got(world);
  std::vector<std::vector<int32_t>> fifo(2);
  run(world, [&](Comm& comm) {
    const int r = comm.rank(), next = (r + 1) % world, prev = (r + world - 1) % world;
    Tensor mine = Tensor::from_vector(rank_values<float>(r, r + 2), {r + 2});
    Tensor theirs = Tensor::empty({prev + 2}, DType::f32);
    if (r == 0) {
      comm.send(mine, next);
      comm.recv(theirs, prev);
    } else {
      comm.recv(theirs, prev);
      comm.send(mine, next);
    }
    got[std::size_t(r)] = theirs.to_vector<float>();

    // Two messages from rank 0 to rank 1 arrive in the order sent. Rank 0
    // returns from each send only once rank 1 has copied it.
    if (r == 0) {
      comm.send(Tensor::from_vector(std::vector<int32_t>{1, 2}, {2}), 1);
      comm.send(Tensor::from_vector(std::vector<int32_t>{3, 4}, {2}), 1);
    } else if (r == 1) {
      std::this_thread::sleep_for(20ms);  // the first message waits in the mailbox
      for (int m = 0; m < 2; ++m) {
        Tensor t = Tensor::empty({2}, DType::i32);
        comm.recv(t, 0);
        fifo[std::size_t(m)] = t.to_vector<int32_t>();
      }
    }
  });
  for (int r = 0; r < world; ++r) {
    const int prev = (r + world - 1) % world;
    std::vector<double> want;
    for (int64_t i = 0; i < prev + 2; ++i) want.push_back(value_at(prev, i));
    CAPTURE(r);
    CHECK(doubles(got[std::size_t(r)]) == want);
  }
  CHECK(fifo[0] == std::vector<int32_t>{1, 2});
  CHECK(fifo[1] == std::vector<int32_t>{3, 4});
}

TEST_CASE("send/recv: count or dtype mismatch throws on both ends", "[comm][local_comm]") {
  const bool dtype_differs = GENERATE(false, true);
  CAPTURE(dtype_differs);
  std::vector<std::string> errors(2);
  std::vector<float> after;
  run(2, [&](Comm& comm) {
    try {
      if (comm.rank() == 0) {
        comm.send(Tensor::zeros({3}, DType::f32), 1);
      } else {
        Tensor t = Tensor::zeros({dtype_differs ? 3 : 4}, dtype_differs ? DType::bf16 : DType::f32);
        comm.recv(t, 0);
      }
    } catch (const Error& e) {
      errors[std::size_t(comm.rank())] = e.message();
    }
    // The pair still works afterwards.
    if (comm.rank() == 0) {
      comm.send(Tensor::from_vector(std::vector<float>{5.f, 6.f}, {2}), 1);
    } else {
      Tensor t = Tensor::empty({2}, DType::f32);
      comm.recv(t, 0);
      after = t.to_vector<float>();
    }
  });
  const std::string want = dtype_differs ? "rank 0 sends 3 f32 elements to rank 1, which receives 3 bf16"
                                         : "rank 0 sends 3 f32 elements to rank 1, which receives 4 f32";
  CHECK_THAT(errors[0], ContainsSubstring(want));
  CHECK_THAT(errors[1], ContainsSubstring(want));
  CHECK(after == std::vector<float>{5.f, 6.f});
}

TEST_CASE("split: even and odd ranks, each collective stays in its group", "[comm][local_comm]") {
  const int world = GENERATE(2, 4, 8);
  CAPTURE(world);
  std::vector<int> new_rank(static_cast<std::size_t>(world), -1), new_size(static_cast<std::size_t>(world), -1);
  std::vector<int64_t> sums(static_cast<std::size_t>(world));
  std::vector<std::vector<int32_t>> gathered(static_cast<std::size_t>(world));
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::unique_ptr<Comm> sub = comm.split(r % 2, r);
    if (!sub) throw std::runtime_error("split returned nullptr for a non-negative color");
    new_rank[std::size_t(r)] = sub->rank();
    new_size[std::size_t(r)] = sub->size();
    // Evens all_reduce while odds all_gather, concurrently, in their own groups.
    if (r % 2 == 0) {
      Tensor t = Tensor::from_vector(std::vector<int64_t>{r + 1}, {1});
      sub->all_reduce(t);
      sums[std::size_t(r)] = t.to_vector<int64_t>()[0];
    } else {
      Tensor in = Tensor::from_vector(std::vector<int32_t>{r, 10 * r}, {2});
      Tensor out = Tensor::empty({2 * sub->size()}, DType::i32);
      sub->all_gather(in, out);
      gathered[std::size_t(r)] = out.to_vector<int32_t>();
    }
  });
  int64_t even_sum = 0;
  std::vector<int32_t> odd_gather;
  for (int r = 0; r < world; ++r) {
    if (r % 2 == 0) {
      even_sum += r + 1;
    } else {
      odd_gather.push_back(r);
      odd_gather.push_back(10 * r);
    }
  }
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(new_rank[std::size_t(r)] == r / 2);
    CHECK(new_size[std::size_t(r)] == world / 2);
    if (r % 2 == 0) {
      CHECK(sums[std::size_t(r)] == even_sum);
    } else {
      CHECK(gathered[std::size_t(r)] == odd_gather);
    }
  }
}

TEST_CASE("split: ordered by key, negative color opts out", "[comm][local_comm]") {
  const int world = GENERATE(3, 4, 8);
  CAPTURE(world);
  // Keys in reverse: new rank = world - 1 - old rank. Then a second split in
  // which rank 0 passes color -1 and the rest tie on key (old rank decides).
  std::vector<std::vector<int32_t>> order(static_cast<std::size_t>(world));
  std::vector<int> rest_rank(static_cast<std::size_t>(world), -2), rest_size(static_cast<std::size_t>(world), -2);
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::unique_ptr<Comm> reversed = comm.split(0, -r);
    Tensor mine = Tensor::from_vector(std::vector<int32_t>{r}, {1});
    Tensor all = Tensor::empty({world}, DType::i32);
    reversed->all_gather(mine, all);  // old ranks in new-rank order
    order[std::size_t(r)] = all.to_vector<int32_t>();
    rest_rank[std::size_t(r)] = reversed->rank();

    std::unique_ptr<Comm> rest = comm.split(r == 0 ? -1 : 7, 0);
    if (rest) {
      rest_rank[std::size_t(r)] = rest->rank();
      rest_size[std::size_t(r)] = rest->size();
      rest->barrier();
    } else {
      rest_rank[std::size_t(r)] = -1;
      rest_size[std::size_t(r)] = -1;
    }
  });
  std::vector<int32_t> want;
  for (int r = world - 1; r >= 0; --r) want.push_back(r);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK(order[std::size_t(r)] == want);
    CHECK(rest_rank[std::size_t(r)] == r - 1);
    CHECK(rest_size[std::size_t(r)] == (r == 0 ? -1 : world - 1));
  }
}

TEST_CASE("barrier: nothing written before it is missed after it", "[comm][local_comm]") {
  const int world = GENERATE(1, 2, 4, 8);
  CAPTURE(world);
  // Plain ints, written before the barrier and read after: the barrier is the
  // only synchronisation (ThreadSanitizer checks it too).
  std::vector<int> written(static_cast<std::size_t>(world), 0), seen(static_cast<std::size_t>(world), 0);
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    std::this_thread::sleep_for(std::chrono::milliseconds(2 * (world - r)));
    written[std::size_t(r)] = 1;
    comm.barrier();
    int count = 0;
    for (int x : written) count += x;
    seen[std::size_t(r)] = count;
  });
  for (int r = 0; r < world; ++r) CHECK(seen[std::size_t(r)] == world);
}

TEST_CASE("all_reduce is deterministic: rank order, bitwise run to run", "[comm][local_comm]") {
  const int world = GENERATE(3, 8);
  constexpr int64_t n = 4096;
  constexpr uint64_t seed = 1234;
  CAPTURE(world);
  // Magnitudes that differ across ranks, so that the summation order shows in the bits.
  auto scale = [](int rank) { return std::ldexp(1.f, rank); };
  auto reduce_once = [&] {
    std::vector<std::vector<float>> got(static_cast<std::size_t>(world));
    run(world, [&](Comm& comm) {
      Tensor t = Tensor::empty({n}, DType::f32);
      fill_uniform(t, seed, uint64_t(comm.rank()) * n, -scale(comm.rank()), 1.5f * scale(comm.rank()));
      comm.all_reduce(t);
      got[std::size_t(comm.rank())] = t.to_vector<float>();
    });
    return got;
  };
  const auto first = reduce_once();
  const auto second = reduce_once();

  std::vector<std::vector<float>> inputs;
  for (int r = 0; r < world; ++r) {
    Tensor t = Tensor::empty({n}, DType::f32);
    fill_uniform(t, seed, uint64_t(r) * n, -scale(r), 1.5f * scale(r));
    inputs.push_back(t.to_vector<float>());
  }
  std::vector<float> in_order(n), reversed(n);
  for (int64_t i = 0; i < n; ++i) {
    float acc = inputs[0][std::size_t(i)];
    for (int r = 1; r < world; ++r) acc += inputs[std::size_t(r)][std::size_t(i)];
    in_order[std::size_t(i)] = acc;
    float back = inputs[std::size_t(world - 1)][std::size_t(i)];
    for (int r = world - 2; r >= 0; --r) back += inputs[std::size_t(r)][std::size_t(i)];
    reversed[std::size_t(i)] = back;
  }
  // The order is visible: summing in reverse gives different bits somewhere.
  CHECK(std::memcmp(in_order.data(), reversed.data(), n * sizeof(float)) != 0);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    REQUIRE(first[std::size_t(r)].size() == std::size_t(n));
    CHECK(std::memcmp(first[std::size_t(r)].data(), in_order.data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(second[std::size_t(r)].data(), first[std::size_t(r)].data(), n * sizeof(float)) == 0);
  }
}

TEST_CASE("integer sums wrap, max and min propagate NaN", "[comm][local_comm]") {
  std::vector<int32_t> i32(2);
  std::vector<uint8_t> u8(2);
  std::vector<int64_t> i64(2);
  std::vector<std::vector<float>> fmax(2), fmin(2);
  run(2, [&](Comm& comm) {
    const int r = comm.rank();
    Tensor a = Tensor::from_vector(std::vector<int32_t>{r == 0 ? std::numeric_limits<int32_t>::max() : 1}, {1});
    comm.all_reduce(a);
    i32[std::size_t(r)] = a.to_vector<int32_t>()[0];
    Tensor b = Tensor::from_vector(std::vector<uint8_t>{uint8_t(r == 0 ? 200 : 100)}, {1});
    comm.all_reduce(b);
    u8[std::size_t(r)] = b.to_vector<uint8_t>()[0];
    Tensor c = Tensor::from_vector(std::vector<int64_t>{r == 0 ? std::numeric_limits<int64_t>::min() : -1}, {1});
    comm.all_reduce(c);
    i64[std::size_t(r)] = c.to_vector<int64_t>()[0];
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (ReduceOp op : {ReduceOp::max, ReduceOp::min}) {
      Tensor f = Tensor::from_vector(std::vector<float>{r == 1 ? nan : 1.f, r == 0 ? nan : 2.f, float(r)}, {3});
      comm.all_reduce(f, op);
      (op == ReduceOp::max ? fmax : fmin)[std::size_t(r)] = f.to_vector<float>();
    }
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK(i32[std::size_t(r)] == std::numeric_limits<int32_t>::min());
    CHECK(u8[std::size_t(r)] == 44);
    CHECK(i64[std::size_t(r)] == std::numeric_limits<int64_t>::max());
    for (const auto* v : {&fmax[std::size_t(r)], &fmin[std::size_t(r)]}) {
      REQUIRE(v->size() == 3);
      CHECK(std::isnan((*v)[0]));
      CHECK(std::isnan((*v)[1]));
    }
    CHECK(fmax[std::size_t(r)][2] == 1.f);
    CHECK(fmin[std::size_t(r)][2] == 0.f);
  }
}

TEST_CASE("argument errors are thrown before any rank waits", "[comm][local_comm]") {
  // Called on rank 0 of a group of 2 with no peer running: each must throw at
  // once, from the checks, without entering the collective.
  auto comms = LocalComm::create_group(2, 5s);
  LocalComm& c = *comms[0];
  Tensor f4 = Tensor::zeros({4}, DType::f32);
  Tensor f8 = Tensor::zeros({8}, DType::f32);
  Tensor b8 = Tensor::zeros({8}, DType::bf16);
  Tensor i4 = Tensor::zeros({4}, DType::i32);
  CHECK_THROWS_WITH(c.all_gather(f4, b8), ContainsSubstring("all_gather: dtype mismatch"));
  CHECK_THROWS_WITH(c.all_gather(f4, f4), ContainsSubstring("must hold size() = 2 times the input's 4 elements"));
  CHECK_THROWS_WITH(c.reduce_scatter(f4, f8), ContainsSubstring("must hold size() = 2 times the output's 8"));
  CHECK_THROWS_WITH(c.reduce_scatter(b8, f4), ContainsSubstring("reduce_scatter: dtype mismatch"));
  CHECK_THROWS_WITH(c.all_reduce(i4, ReduceOp::avg), ContainsSubstring("avg reduction needs a floating dtype"));
  Tensor f3 = Tensor::zeros({3}, DType::f32);
  CHECK_THROWS_WITH(c.all_to_all(f3, f3), ContainsSubstring("3 elements do not split into 2 equal chunks"));
  CHECK_THROWS_WITH(c.all_to_all(f4, f8), ContainsSubstring("differ in size"));
  const std::vector<int64_t> two_rows{1, 1}, too_many{3, 2}, one_count{4};
  Tensor rows = Tensor::zeros({4, 2}, DType::f32);
  CHECK_THROWS_WITH(c.all_to_all_v(rows, too_many, rows, two_rows), ContainsSubstring("send counts add to 5 rows"));
  CHECK_THROWS_WITH(c.all_to_all_v(rows, two_rows, rows, too_many), ContainsSubstring("recv counts add to 5 rows"));
  CHECK_THROWS_WITH(c.all_to_all_v(rows, one_count, rows, two_rows), ContainsSubstring("1 send and 2 recv counts"));
  CHECK_THROWS_WITH(c.broadcast(f4, 2), ContainsSubstring("broadcast root 2 out of range for 2 ranks"));
  CHECK_THROWS_WITH(c.send(f4, -1), ContainsSubstring("send peer -1 out of range"));
  CHECK_THROWS_WITH(c.send(f4, 0), ContainsSubstring("to itself"));
  CHECK_THROWS_WITH(c.recv(f4, 0), ContainsSubstring("from itself"));
  Tensor undefined;
  CHECK_THROWS_WITH(c.all_reduce(undefined), ContainsSubstring("all_reduce tensor is undefined"));
  CHECK_FALSE(c.group()->aborted());
}

namespace {
// Reaches the protected do_* calls, to which the public API never passes a
// negative count.
struct RawCalls : Comm {
  static void all_gather(Comm& c, Elems n) { (c.*&RawCalls::do_all_gather)(nullptr, nullptr, n, DType::f32, {}); }
  static void reduce_scatter(Comm& c, Elems n) {
    (c.*&RawCalls::do_reduce_scatter)(nullptr, nullptr, n, DType::f32, ReduceOp::sum, {});
  }
  static void all_reduce(Comm& c, Elems n) {
    (c.*&RawCalls::do_all_reduce)(nullptr, nullptr, n, DType::f32, ReduceOp::sum, {});
  }
  static void all_to_all(Comm& c, Elems n) { (c.*&RawCalls::do_all_to_all)(nullptr, nullptr, n, DType::f32, {}); }
  static void all_to_all_v(Comm& c, std::span<const Elems> send, std::span<const Elems> recv) {
    (c.*&RawCalls::do_all_to_all_v)(nullptr, send, nullptr, recv, DType::f32, {});
  }
  static void broadcast(Comm& c, Elems n) { (c.*&RawCalls::do_broadcast)(nullptr, n, DType::f32, 0, {}); }
  static void send(Comm& c, Elems n) { (c.*&RawCalls::do_send)(nullptr, n, DType::f32, 1, {}); }
  static void recv(Comm& c, Elems n) { (c.*&RawCalls::do_recv)(nullptr, n, DType::f32, 1, {}); }
};
}  // namespace

TEST_CASE("do_* calls reject negative element counts", "[comm][local_comm]") {
  auto comms = LocalComm::create_group(2, 5s);
  Comm& c = *comms[0];
  const Elems bad(-1);
  CHECK_THROWS_WITH(RawCalls::all_gather(c, bad), ContainsSubstring("all_gather: negative element count -1"));
  CHECK_THROWS_WITH(RawCalls::reduce_scatter(c, bad), ContainsSubstring("reduce_scatter: negative element count"));
  CHECK_THROWS_WITH(RawCalls::all_reduce(c, bad), ContainsSubstring("all_reduce: negative element count"));
  CHECK_THROWS_WITH(RawCalls::all_to_all(c, bad), ContainsSubstring("all_to_all: negative element count"));
  const std::vector<Elems> good{Elems(0), Elems(0)}, negative{Elems(0), Elems(-3)};
  CHECK_THROWS_WITH(RawCalls::all_to_all_v(c, negative, good),
                    ContainsSubstring("all_to_all_v send: negative element count -3"));
  CHECK_THROWS_WITH(RawCalls::all_to_all_v(c, good, negative),
                    ContainsSubstring("all_to_all_v recv: negative element count -3"));
  CHECK_THROWS_WITH(RawCalls::broadcast(c, bad), ContainsSubstring("broadcast: negative element count"));
  CHECK_THROWS_WITH(RawCalls::send(c, bad), ContainsSubstring("send: negative element count"));
  CHECK_THROWS_WITH(RawCalls::recv(c, bad), ContainsSubstring("recv: negative element count"));
  CHECK_THROWS_WITH(RawCalls::all_gather(c, Elems(4)), ContainsSubstring("all_gather input is null for 4 elements"));
}

TEST_CASE("ranks that disagree on a call all throw, and the group stays usable", "[comm][local_comm]") {
  constexpr int world = 3;
  // What rank 1 does differently from ranks 0 and 2.
  const std::string what = GENERATE("count", "dtype", "op", "root", "collective", "shared buffer");
  CAPTURE(what);
  Tensor shared = Tensor::zeros({4}, DType::f32);  // the same memory handed to every rank
  std::vector<std::string> errors(world);
  std::vector<int64_t> sums(world);
  run(world, [&](Comm& comm) {
    const int r = comm.rank();
    const bool odd = r == 1;
    try {
      if (what == "count") {
        Tensor t = Tensor::zeros({odd ? 5 : 4}, DType::f32);
        comm.all_reduce(t);
      } else if (what == "dtype") {
        Tensor t = Tensor::zeros({4}, odd ? DType::bf16 : DType::f32);
        comm.all_reduce(t);
      } else if (what == "op") {
        Tensor t = Tensor::zeros({4}, DType::f32);
        comm.all_reduce(t, odd ? ReduceOp::max : ReduceOp::sum);
      } else if (what == "root") {
        Tensor t = Tensor::zeros({4}, DType::f32);
        comm.broadcast(t, odd ? 1 : 0);
      } else if (what == "collective") {
        Tensor t = Tensor::zeros({4}, DType::f32);
        if (odd) {
          comm.broadcast(t, 0);
        } else {
          comm.all_reduce(t);
        }
      } else {
        comm.all_reduce(shared);
      }
    } catch (const Error& e) {
      errors[std::size_t(r)] = e.message();
    }
    Tensor t = Tensor::from_vector(std::vector<int64_t>{r + 1}, {1});
    comm.all_reduce(t);
    sums[std::size_t(r)] = t.to_vector<int64_t>()[0];
  });
  const std::string want = what == "count"        ? "rank 0 passes 4 elements but rank 1 passes 5"
                           : what == "dtype"      ? "rank 0 passes f32 but rank 1 passes bf16"
                           : what == "op"         ? "rank 0 reduces with sum but rank 1 with max"
                           : what == "root"       ? "rank 0 broadcasts from root 0 but rank 1 from root 1"
                           : what == "collective" ? "rank 0: all_reduce, rank 1: broadcast, rank 2: all_reduce"
                                                  : "the output of rank 0 overlaps the input of rank 1";
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK_THAT(errors[std::size_t(r)], ContainsSubstring(want));
  }
  CHECK(sums == std::vector<int64_t>{6, 6, 6});
}

TEST_CASE("CUDA tensors are rejected", "[comm][local_comm]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device: the CPU-side errors are covered above");
  auto comms = LocalComm::create_group(1);
  Tensor t = Tensor::zeros({4}, DType::f32, Device::cuda(0));
  CHECK_THROWS_WITH(comms[0]->all_reduce(t), ContainsSubstring("but this local communicator works on cpu"));
}

TEST_CASE("a CUDA group needs CUDA and the device, the CPU stays the default", "[comm][local_comm]") {
  // A table of CUDA functions is what a CUDA group runs on; without one
  // (code built without CUDA) the group is refused, whatever the build.
  CHECK_THROWS_WITH(LocalGroup(2, kTestTimeout, Device::cuda(0), nullptr),
                    ContainsSubstring("LocalComm on cuda:0 needs the CUDA backend"));
  if (!built_with_cuda()) {
    CHECK_THROWS_WITH(LocalComm::create_group(2, kTestTimeout, Device::cuda(0)),
                      ContainsSubstring("device cuda:0 requested but slime was built without CUDA"));
    CHECK_THROWS_WITH(run_local_ranks(
                          2, [](Comm&) {}, kTestTimeout, Device::cuda(0)),
                      ContainsSubstring("built without CUDA"));
  } else if (cuda_device_count() == 0) {
    CHECK_THROWS_WITH(LocalComm::create_group(2, kTestTimeout, Device::cuda(0)),
                      ContainsSubstring("device cuda:0 does not exist"));
  }
  // The device argument, spelled out, and what split() hands down.
  std::vector<Device> devices(4, Device::cuda(0));
  run_local_ranks(
      4,
      [&](Comm& comm) {
        std::unique_ptr<Comm> sub = comm.split(comm.rank() % 2, 0);
        devices[std::size_t(comm.rank())] = sub->device();
      },
      kTestTimeout, Device::cpu());
  for (Device d : devices) CHECK(d == Device::cpu());
}

TEST_CASE("a rank that never calls: timeout names it on every waiting rank", "[comm][local_comm]") {
  const int world = GENERATE(3, 4);
  CAPTURE(world);
  // Ranks 0 and 1 call all_reduce; the others hold their comms but never call.
  auto comms = LocalComm::create_group(world, 300ms);
  std::vector<std::string> errors(2);
  std::vector<double> waited(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      const auto t0 = Clock::now();
      try {
        Tensor t = Tensor::zeros({4}, DType::f32);
        comms[std::size_t(r)]->all_reduce(t);
      } catch (const std::exception& e) {
        errors[std::size_t(r)] = e.what();
      }
      waited[std::size_t(r)] = seconds_since(t0);
    });
  }
  for (std::thread& t : threads) t.join();
  const std::string want = world == 3 ? "LocalComm barrier timed out after 300 ms: rank 2 of 3 did not arrive "
                                        "(collective all_reduce)"
                                      : "LocalComm barrier timed out after 300 ms: ranks 2, 3 of 4 did not arrive "
                                        "(collective all_reduce)";
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CHECK_THAT(errors[std::size_t(r)], ContainsSubstring(want));
    CHECK(waited[std::size_t(r)] < 5.0);
  }
  CHECK(std::max(waited[0], waited[1]) >= 0.29);  // the rank that timed out waited it out
  // The group is aborted: a late rank throws at once instead of waiting.
  CHECK(comms[0]->group()->aborted());
  Tensor t = Tensor::zeros({4}, DType::f32);
  CHECK_THROWS_WITH(comms[2]->all_reduce(t), ContainsSubstring("LocalComm aborted (rank 2 of"));
}

TEST_CASE("abort wakes waiters, including those of split groups", "[comm][local_comm]") {
  auto comms = LocalComm::create_group(2, 20s);
  std::string parent_error, child_error;
  std::atomic<bool> rank1_split{false}, release{false};
  const auto t0 = Clock::now();
  // Rank 0 splits, then waits in the child group's barrier; rank 1 splits and
  // never arrives. Aborting the parent must wake rank 0 in the child.
  std::thread rank0([&] {
    std::unique_ptr<Comm> sub = comms[0]->split(0, 0);
    try {
      sub->barrier();
    } catch (const std::exception& e) {
      child_error = e.what();
    }
    try {
      comms[0]->barrier();
    } catch (const std::exception& e) {
      parent_error = e.what();
    }
  });
  std::thread rank1([&] {
    std::unique_ptr<Comm> sub = comms[1]->split(0, 1);
    rank1_split = true;
    while (!release) std::this_thread::sleep_for(1ms);
  });
  while (!rank1_split) std::this_thread::sleep_for(1ms);
  std::this_thread::sleep_for(50ms);
  comms[0]->group()->abort("operator pressed stop");
  rank0.join();
  release = true;
  rank1.join();
  CHECK(seconds_since(t0) < 5.0);
  CHECK_THAT(child_error, ContainsSubstring("LocalComm aborted (rank 0 of 2 in barrier): operator pressed stop"));
  CHECK_THAT(parent_error, ContainsSubstring("operator pressed stop"));
}

namespace {
struct RankFailure : std::exception {
  const char* what() const noexcept override { return "rank 2 failed on purpose"; }
};
}  // namespace

TEST_CASE("run_local_ranks: one rank's exception stops the others and is rethrown", "[comm][local_comm]") {
  std::atomic<int> aborted_ranks{0};
  const auto t0 = Clock::now();
  bool caught = false;
  try {
    run_local_ranks(
        4,
        [&](Comm& comm) {
          if (comm.rank() == 2) throw RankFailure();
          Tensor t = Tensor::zeros({4}, DType::f32);
          try {
            comm.all_reduce(t);
          } catch (const Error& e) {
            if (e.message().find("rank 2 threw: rank 2 failed on purpose") != std::string::npos) ++aborted_ranks;
            throw;
          }
        },
        20s);
  } catch (const RankFailure&) {
    caught = true;
  }
  CHECK(caught);
  CHECK(aborted_ranks == 3);
  CHECK(seconds_since(t0) < 5.0);
}

TEST_CASE("run_local_ranks: a rank that returns early fails its peers at once", "[comm][local_comm]") {
  // Rank 3 returns at once; the others wait for it in a collective, a recv
  // or a send. Each must fail well before the 20 s timeout, naming rank 3.
  const std::string wait_in = GENERATE("all_reduce", "recv", "send");
  CAPTURE(wait_in);
  const auto t0 = Clock::now();
  const std::string want = wait_in == "all_reduce" ? "LocalComm all_reduce cannot complete: rank 3 of 4 left"
                           : wait_in == "recv"     ? "LocalComm recv on rank 1 from rank 3 cannot complete: rank 3 left"
                                               : "LocalComm send from rank 1 to rank 3 cannot complete: rank 3 left";
  CHECK_THROWS_WITH(run_local_ranks(
                        4,
                        [&](Comm& comm) {
                          if (comm.rank() == 3) return;
                          Tensor t = Tensor::zeros({4}, DType::f32);
                          if (wait_in == "all_reduce") {
                            comm.all_reduce(t);
                          } else if (comm.rank() == 1) {
                            if (wait_in == "recv") {
                              comm.recv(t, 3);
                            } else {
                              comm.send(t, 3);
                            }
                          }
                        },
                        20s),
                    ContainsSubstring(want));
  CHECK(seconds_since(t0) < 5.0);
}
