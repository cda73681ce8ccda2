// Tests for LocalComm groups on one CUDA device (slime/comm/local_comm.hpp):
// every collective, run by 2, 3 and 4 ranks sharing the GPU, against the same
// call of a CPU LocalComm group on the same random inputs, bit for bit (the
// CPU group is itself checked against plain loops in test_local_comm.cpp).
// The two sides poison their outputs with different bytes, so an element
// either side leaves unwritten shows up. Even ranks pass a default Stream
// (the legacy default stream), odd ranks a stream of their own. Skips where
// no GPU exists.
//
// Catch2 assertions stay on the test thread: rank functions return tensors
// or record errors, and the test checks them after run_local_ranks joins.
#include <cuda_runtime.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/generators/catch_generators.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "slime/comm/launch.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

namespace {

using namespace std::chrono_literals;
using namespace slime;
using namespace slime::comm;
using Catch::Matchers::ContainsSubstring;

constexpr std::chrono::milliseconds kTimeout = 60s;
const Device kGpu = Device::cuda(0);

Stream rank_stream(const Comm& c) {
  if (c.device().is_cpu() || c.rank() % 2 == 0) return Stream{};
  return Stream::create(c.device());
}

// 0xFF is NaN in every float type and -1 in every integer type; the CPU side
// uses another byte, so an element neither side writes still differs.
uint8_t poison_byte(Device d) { return d.is_cuda() ? 0xFF : 0xA5; }

Tensor poisoned(const Shape& shape, DType dtype, const Comm& c, const Stream& s) {
  Tensor t = Tensor::empty(shape, dtype, c.device(), s);
  t.fill_bytes_(poison_byte(c.device()), s);
  return t;
}

// A quiet NaN of T with random sign and payload bits.
template <class T>
T random_nan(std::mt19937_64& gen) {
  const uint64_t bits = gen();
  if constexpr (std::is_same_v<T, float>) {
    const uint32_t u = 0x7fc00000u | uint32_t(bits & 0x803fffffu);
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return BFloat16::from_bits(uint16_t(0x7fc0u | (bits & 0x803fu)));
  } else {
    return Half::from_bits(uint16_t(0x7e00u | (bits & 0x81ffu)));
  }
}

// Integers: random bits over the whole range (sums wrap). Floats: normal
// values scaled by 2^-12 .. 2^12 (sums round, and differ with the order);
// with `specials`, one value in 8 is a NaN, +-inf or +-0.
template <class T>
T random_value(std::mt19937_64& gen, bool specials) {
  if constexpr (std::is_integral_v<T>) {
    return T(gen());
  } else {
    if (specials) {
      switch (gen() % 40) {
        case 0:
        case 1:
          return random_nan<T>(gen);
        case 2:
          return T(std::numeric_limits<float>::infinity());
        case 3:
          return T(-std::numeric_limits<float>::infinity());
        case 4:
          return T(-0.f);
        default:
          break;
      }
    }
    std::normal_distribution<float> normal;
    std::uniform_int_distribution<int> exponent(-12, 12);
    return T(std::ldexp(normal(gen), exponent(gen)));
  }
}

// Rank-specific random contents; the same on the CPU and the CUDA run.
Tensor random_tensor(const Shape& shape, DType dtype, uint64_t seed, int rank, bool specials, const Comm& c,
                     const Stream& s) {
  std::mt19937_64 gen(seed * 1000003u + uint64_t(rank));
  return visit_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    std::vector<T> values(std::size_t(shape.numel()));
    for (T& v : values) v = random_value<T>(gen, specials);
    return Tensor::from_vector(values, shape, c.device(), s);
  });
}

std::vector<uint8_t> host_bytes(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  synchronize_device(t.device());
  const auto* p = static_cast<const uint8_t*>(h.data_ptr());
  return std::vector<uint8_t>(p, p + h.nbytes());
}

// "" when the bytes agree, else the first element that differs.
std::string first_difference(const Tensor& cpu, const Tensor& gpu) {
  if (cpu.dtype() != gpu.dtype() || cpu.shape() != gpu.shape()) return "cpu " + cpu.str() + " vs cuda " + gpu.str();
  const std::vector<uint8_t> a = host_bytes(cpu), b = host_bytes(gpu);
  const std::size_t width = dtype_size(cpu.dtype());
  for (std::size_t i = 0; i < a.size(); i += width) {
    if (std::memcmp(&a[i], &b[i], width) == 0) continue;
    std::string hex_a, hex_b;
    char byte[3];
    for (std::size_t k = width; k-- > 0;) {
      std::snprintf(byte, sizeof byte, "%02x", a[i + k]);
      hex_a += byte;
      std::snprintf(byte, sizeof byte, "%02x", b[i + k]);
      hex_b += byte;
    }
    return "element " + std::to_string(i / width) + " of " + std::to_string(a.size() / width) + ": cpu 0x" + hex_a +
           ", cuda 0x" + hex_b;
  }
  return "";
}

// Runs body(comm) on `world` ranks of a CPU group, then of a group on the
// GPU; body returns the tensors to compare. Every tensor a CUDA rank returns
// must hold the bytes the CPU rank's does.
template <class F>
void expect_cuda_equals_cpu(int world, F&& body) {
  auto run_on = [&](Device d) {
    std::vector<std::vector<Tensor>> out(static_cast<std::size_t>(world));
    run_local_ranks(
        world, [&](Comm& c) { out[std::size_t(c.rank())] = body(c); }, kTimeout, d);
    return out;
  };
  const std::vector<std::vector<Tensor>> cpu = run_on(Device::cpu()), gpu = run_on(kGpu);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    REQUIRE(cpu[std::size_t(r)].size() == gpu[std::size_t(r)].size());
    for (std::size_t k = 0; k < cpu[std::size_t(r)].size(); ++k) {
      CAPTURE(k);
      CHECK(gpu[std::size_t(r)][k].device() == kGpu);
      CHECK(first_difference(cpu[std::size_t(r)][k], gpu[std::size_t(r)][k]) == "");
    }
  }
}

uint64_t seed_of(std::initializer_list<int64_t> parts) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t p : parts) h = (h ^ uint64_t(p)) * 1099511628211ull;
  return h;
}

bool reducible(DType dtype, ReduceOp op) { return op != ReduceOp::avg || is_floating(dtype); }
bool specials_for(ReduceOp op) { return op == ReduceOp::max || op == ReduceOp::min; }

}  // namespace

TEST_CASE("cuda group: device, backend, split inherits the device", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  auto comms = LocalComm::create_group(3, kTimeout, kGpu);
  for (auto& c : comms) {
    CHECK(c->device() == kGpu);
    CHECK(c->backend() == "local");
    CHECK(c->group()->device() == kGpu);
  }
  std::vector<Device> sub_device(4, Device::cpu());
  run_local_ranks(
      4,
      [&](Comm& c) {
        std::unique_ptr<Comm> sub = c.split(c.rank() % 2, c.rank());
        sub_device[std::size_t(c.rank())] = sub->device();
      },
      kTimeout, kGpu);
  for (Device d : sub_device) CHECK(d == kGpu);
}

// comm::plan_launch's share_device (the RL example's --share-gpu): run_ranks
// runs every rank on cuda:0 through LocalComm, with cuda:0 current.
TEST_CASE("run_ranks with share_device: the ranks share cuda:0 through LocalComm", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const Launch launch = plan_launch({.device = "cuda", .ranks = 3, .share_device = true});
  REQUIRE(launch.mode == LaunchMode::local_cuda);
  std::vector<Device> devices(3, Device::cpu());
  std::vector<int> current(3, -1);
  std::vector<std::string> backends(3);
  const std::optional<std::vector<float>> sum = run_ranks(launch, [&](Comm& c) {
    const std::size_t r = std::size_t(c.rank());
    devices[r] = c.device();
    backends[r] = c.backend();
    int d = -1;
    if (cudaGetDevice(&d) == cudaSuccess) current[r] = d;
    Tensor t = Tensor::from_vector(std::vector<float>{float(c.rank() + 1), 0.5f}, {2}, c.device());
    c.all_reduce(t, ReduceOp::sum);
    return t.to_vector<float>();
  });
  REQUIRE(sum.has_value());
  CHECK(*sum == std::vector<float>{6.f, 1.5f});
  for (std::size_t r = 0; r < 3; ++r) {
    CHECK(devices[r] == kGpu);
    CHECK(backends[r] == "local");
    CHECK(current[r] == 0);
  }
}

TEST_CASE("cuda all_reduce in place equals the CPU group bitwise", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64);
  const ReduceOp op = GENERATE(ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min);
  const int64_t count = GENERATE(1, 37, 4099, 300007);
  if (!reducible(dtype, op)) return;
  CAPTURE(world, dtype_name(dtype), reduce_op_name(op), count);
  const uint64_t seed = seed_of({1, world, int(dtype), int(op), count});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    Tensor t = random_tensor({count}, dtype, seed, c.rank(), specials_for(op), c, s);
    c.all_reduce(t, op, s);
    return std::vector<Tensor>{t};
  });
}

TEST_CASE("cuda reduce_scatter equals the CPU group, output separate or a view of the input",
          "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  const ReduceOp op = GENERATE(ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min);
  const int64_t per_rank = GENERATE(1, 5, 1001, 65537);
  // "own": the output is the rank's own chunk of its input; "next": the next
  // rank's chunk, which the peers read.
  const std::string output = GENERATE("separate", "own", "next");
  if (!reducible(dtype, op)) return;
  CAPTURE(world, dtype_name(dtype), reduce_op_name(op), per_rank, output);
  const uint64_t seed = seed_of({2, world, int(dtype), int(op), per_rank});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    Tensor in = random_tensor({per_rank * world}, dtype, seed, c.rank(), specials_for(op), c, s);
    if (output == "separate") {
      Tensor out = poisoned({per_rank}, dtype, c, s);
      c.reduce_scatter(in, out, op, s);
      return std::vector<Tensor>{out, in};
    }
    const int chunk = output == "own" ? c.rank() : (c.rank() + 1) % world;
    Tensor out = in.view(chunk * per_rank, {per_rank});
    c.reduce_scatter(in, out, op, s);
    return std::vector<Tensor>{in};
  });
}

TEST_CASE("cuda all_gather equals the CPU group: separate, in place, staged", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  const int64_t per_rank = GENERATE(0, 1, 7, 3001);
  // "in place": the input is the rank's slot of the output (as FSDP passes
  // it); "staged": the input is the output's first slot, which rank r > 0
  // overwrites while its peers still read it.
  const std::string input = GENERATE("separate", "in place", "staged");
  CAPTURE(world, dtype_name(dtype), per_rank, input);
  const uint64_t seed = seed_of({3, world, int(dtype), per_rank});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    Tensor mine = random_tensor({per_rank}, dtype, seed, c.rank(), true, c, s);
    Tensor out = poisoned({per_rank * world}, dtype, c, s);
    if (input == "separate") {
      c.all_gather(mine, out, s);
    } else {
      Tensor in = out.view(input == "in place" ? c.rank() * per_rank : 0, {per_rank});
      in.copy_from(mine, s);
      c.all_gather(in, out, s);
    }
    return std::vector<Tensor>{out};
  });
}

TEST_CASE("cuda all_to_all equals the CPU group, separate and in place", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  const int64_t per_rank = GENERATE(1, 7, 999);
  const bool in_place = GENERATE(false, true);
  CAPTURE(world, dtype_name(dtype), per_rank, in_place);
  const uint64_t seed = seed_of({4, world, int(dtype), per_rank});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    Tensor in = random_tensor({per_rank * world}, dtype, seed, c.rank(), true, c, s);
    Tensor out = in_place ? in : poisoned({per_rank * world}, dtype, c, s);
    c.all_to_all(in, out, s);
    return std::vector<Tensor>{out};
  });
}

TEST_CASE("cuda all_to_all_v equals the CPU group: ragged rows, zeros included", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  const int64_t cols = GENERATE(1, 3);
  CAPTURE(world, dtype_name(dtype), cols);
  // Rows src sends to dst: 0 to 6, zeros included; rank 1 sends nothing.
  auto rows = [](int src, int dst) -> int64_t { return src == 1 ? 0 : (src * 5 + dst * 3 + 1) % 7; };
  const uint64_t seed = seed_of({5, world, int(dtype), cols});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    std::vector<int64_t> send_rows, recv_rows;
    int64_t send_total = 0, recv_total = 0;
    for (int peer = 0; peer < world; ++peer) {
      send_rows.push_back(rows(c.rank(), peer));
      recv_rows.push_back(rows(peer, c.rank()));
      send_total += send_rows.back();
      recv_total += recv_rows.back();
    }
    Tensor in = random_tensor({send_total, cols}, dtype, seed, c.rank(), true, c, s);
    Tensor out = poisoned({recv_total, cols}, dtype, c, s);
    c.all_to_all_v(in, send_rows, out, recv_rows, s);
    return std::vector<Tensor>{out};
  });
}

TEST_CASE("cuda broadcast from the last rank equals the CPU group", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  const int64_t count = GENERATE(1, 1023);
  CAPTURE(world, dtype_name(dtype), count);
  const uint64_t seed = seed_of({6, world, int(dtype), count});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    const int root = world - 1;
    Tensor t =
        c.rank() == root ? random_tensor({count}, dtype, seed, root, true, c, s) : poisoned({count}, dtype, c, s);
    c.broadcast(t, root, s);
    return std::vector<Tensor>{t};
  });
}

TEST_CASE("cuda send/recv: a ring, two messages per pair, equals the CPU group", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  const DType dtype = GENERATE(DType::f32, DType::bf16, DType::i32, DType::i64);
  CAPTURE(world, dtype_name(dtype));
  const uint64_t seed = seed_of({7, world, int(dtype)});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    const int r = c.rank(), next = (r + 1) % world, prev = (r + world - 1) % world;
    // Two messages of different sizes: FIFO order per pair.
    Tensor send_a = random_tensor({11}, dtype, seed, r, true, c, s);
    Tensor send_b = random_tensor({5}, dtype, seed + 1, r, true, c, s);
    Tensor recv_a = poisoned({11}, dtype, c, s), recv_b = poisoned({5}, dtype, c, s);
    // Even ranks send first, odd ranks receive first: no cycle of blocked sends.
    auto send = [&] {
      c.send(send_a, next, s);
      c.send(send_b, next, s);
    };
    auto recv = [&] {
      c.recv(recv_a, prev, s);
      c.recv(recv_b, prev, s);
    };
    if (r % 2 == 0) {
      send();
      recv();
    } else {
      recv();
      send();
    }
    return std::vector<Tensor>{recv_a, recv_b};
  });
}

TEST_CASE("cuda split: each sub-group reduces and gathers like the CPU group", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const int world = GENERATE(2, 3, 4);
  CAPTURE(world);
  const uint64_t seed = seed_of({8, world});
  expect_cuda_equals_cpu(world, [&](Comm& c) {
    const Stream s = rank_stream(c);
    // Evens and odds, keys reversed; the groups run concurrently.
    std::unique_ptr<Comm> sub = c.split(c.rank() % 2, -c.rank());
    if (!sub) throw std::runtime_error("split returned nullptr for a non-negative color");
    Tensor sum = random_tensor({333}, DType::bf16, seed, c.rank(), false, *sub, s);
    sub->all_reduce(sum, ReduceOp::sum, s);
    Tensor mine = random_tensor({17}, DType::f32, seed + 1, c.rank(), true, *sub, s);
    Tensor gathered = poisoned({17 * sub->size()}, DType::f32, *sub, s);
    sub->all_gather(mine, gathered, s);
    sub->barrier();
    return std::vector<Tensor>{sum, gathered};
  });
}

TEST_CASE("cuda group: tensors of the wrong device and foreign streams are refused", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  auto cuda = LocalComm::create_group(1, kTimeout, kGpu);
  auto cpu = LocalComm::create_group(1, kTimeout);
  Tensor host = Tensor::zeros({4}, DType::f32);
  Tensor dev = Tensor::zeros({4}, DType::f32, kGpu);
  CHECK_THROWS_WITH(cuda[0]->all_reduce(host), ContainsSubstring("but this local communicator works on cuda:0"));
  Tensor dev_out = Tensor::zeros({4}, DType::f32, kGpu);
  CHECK_THROWS_WITH(cuda[0]->all_gather(dev, host), ContainsSubstring("works on cuda:0"));
  CHECK_THROWS_WITH(cpu[0]->all_reduce(dev), ContainsSubstring("but this local communicator works on cpu"));
  // A stream of another device (borrowed: no second GPU needed to name one).
  const Stream foreign = Stream::borrow(Device::cuda(1), nullptr);
  CHECK_THROWS_WITH(cuda[0]->all_reduce(dev, ReduceOp::sum, foreign),
                    ContainsSubstring("LocalComm all_reduce on cuda:0: the stream belongs to cuda:1"));
  CHECK_THROWS_WITH(cuda[0]->all_gather(dev, dev_out, foreign), ContainsSubstring("the stream belongs to cuda:1"));
  CHECK_THROWS_WITH(LocalComm::create_group(kLocalCudaMaxRanks + 1, kTimeout, kGpu),
                    ContainsSubstring("holds at most 64 ranks"));
}

TEST_CASE("cuda group: disagreeing ranks all throw and the group stays usable", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  constexpr int world = 3;
  std::vector<std::string> errors(world);
  std::vector<int64_t> sums(world);
  run_local_ranks(
      world,
      [&](Comm& c) {
        const int r = c.rank();
        try {
          Tensor t = Tensor::zeros({4}, r == 1 ? DType::bf16 : DType::f32, kGpu);
          c.all_reduce(t);
        } catch (const Error& e) {
          errors[std::size_t(r)] = e.message();
        }
        Tensor t = Tensor::from_vector(std::vector<int64_t>{r + 1}, {1}, kGpu);
        c.all_reduce(t);
        sums[std::size_t(r)] = t.to_vector<int64_t>()[0];
      },
      kTimeout, kGpu);
  for (int r = 0; r < world; ++r) {
    CAPTURE(r);
    CHECK_THAT(errors[std::size_t(r)], ContainsSubstring("rank 0 passes f32 but rank 1 passes bf16"));
    CHECK(sums[std::size_t(r)] == 6);
  }
}

TEST_CASE("cuda group: a rank that never calls times out, abort wakes the rest", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  auto comms = LocalComm::create_group(2, 300ms, kGpu);
  std::string error;
  std::thread rank0([&] {
    try {
      Tensor t = Tensor::zeros({4}, DType::f32, kGpu);
      comms[0]->all_reduce(t);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  rank0.join();
  CHECK_THAT(error, ContainsSubstring("LocalComm barrier timed out after 300 ms: rank 1 of 2 did not arrive"));
  CHECK(comms[0]->group()->aborted());
  Tensor t = Tensor::zeros({4}, DType::f32, kGpu);
  CHECK_THROWS_WITH(comms[1]->all_reduce(t), ContainsSubstring("LocalComm aborted (rank 1 of 2"));
}

TEST_CASE("cuda group: the scratch is freed with the communicator", "[comm][local_comm][gpu]") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  synchronize_device(kGpu);
  const int64_t before = memory_stats(kGpu).current_bytes;
  run_local_ranks(
      2,
      [&](Comm& c) {
        Tensor t = Tensor::zeros({1000}, DType::f32, kGpu);
        c.all_reduce(t);
        Tensor big = Tensor::zeros({5000}, DType::f32, kGpu);
        c.all_reduce(big);  // grows the scratch
      },
      kTimeout, kGpu);
  CHECK(memory_stats(kGpu).current_bytes == before);
}
