// NcclComm across processes: one process per GPU, started by
//   torchrun --no-python --nproc-per-node 2 test_nccl_multiprocess
// (ctest does this through a wrapper, see tests/CMakeLists.txt). Each process
// builds NcclComm::from_env() on cuda:LOCAL_RANK and checks all_gather,
// reduce_scatter, all_reduce, all_to_all_v, broadcast, barrier and split
// against values computed on the host. Run alone (WORLD_SIZE unset) it skips.
//
// Every rank runs the same collectives in the same order whatever it finds:
// checks use CHECK (which records and goes on), never REQUIRE, so a wrong
// value on one rank cannot leave the other waiting in a collective.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "slime/comm/nccl_comm.hpp"
#include "slime/core/tensor.hpp"

namespace {

using slime::Device;
using slime::DType;
using slime::Shape;
using slime::Tensor;
using slime::comm::NcclComm;
using slime::comm::ReduceOp;

// NVLink multicast stays off on the shared GPU hosts (the ctest wrapper
// exports it too); an explicit setting wins.
[[maybe_unused]] const bool kNvlsOff = (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0), true);

// Small integers: exact in f32, and so are their sums over a few ranks.
float value(int rank, int64_t i) { return float((i * 7 + rank * 5) % 23 - 11); }

std::vector<float> values(int rank, int64_t n, int64_t first = 0) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = value(rank, first + i);
  return v;
}

}  // namespace

TEST_CASE("NcclComm across processes: collectives and split", "[comm][multi_gpu]") {
  if (std::getenv("WORLD_SIZE") == nullptr)
    SKIP("WORLD_SIZE is unset: run under torchrun --no-python --nproc-per-node 2 test_nccl_multiprocess");
  if (slime::cuda_device_count() < 1) SKIP("no CUDA device");  // the same answer on every rank

  std::unique_ptr<NcclComm> comm = NcclComm::from_env();
  const int r = comm->rank(), n = comm->size();
  const char* local_rank = std::getenv("LOCAL_RANK");
  INFO("rank " << r << " of " << n << " on " << comm->device() << ", NCCL " << NcclComm::nccl_version());
  CHECK(n == std::atoi(std::getenv("WORLD_SIZE")));
  if (local_rank != nullptr && slime::cuda_device_count() > 1)
    CHECK(comm->device() == Device::cuda(std::atoi(local_rank)));
  CHECK(comm->backend() == "nccl");
  const Device dev = comm->device();
  constexpr int64_t k = 7;  // per-rank chunk: does not divide any power of two

  // all_gather: chunk q of the output is rank q's input.
  {
    Tensor in = Tensor::from_vector(values(r, k), Shape{k}, dev);
    Tensor out = Tensor::empty(Shape{k * n}, DType::f32, dev);
    out.fill_bytes_(0xff);
    comm->all_gather(in, out);
    std::vector<float> expected;
    for (int q = 0; q < n; ++q)
      for (float x : values(q, k)) expected.push_back(x);
    CHECK(out.to_vector<float>() == expected);
  }

  // reduce_scatter (sum): rank r gets chunk r of the elementwise sum.
  {
    Tensor in = Tensor::from_vector(values(r, k * n), Shape{k * n}, dev);
    Tensor out = Tensor::empty(Shape{k}, DType::f32, dev);
    comm->reduce_scatter(in, out, ReduceOp::sum);
    std::vector<float> expected(k, 0.f);
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < k; ++i) expected[std::size_t(i)] += value(q, r * k + i);
    CHECK(out.to_vector<float>() == expected);
  }

  // all_reduce: sum and max over an odd length, in place.
  {
    const int64_t len = 1001;
    Tensor t = Tensor::from_vector(values(r, len), Shape{len}, dev);
    comm->all_reduce(t, ReduceOp::sum);
    Tensor m = Tensor::from_vector(values(r, len), Shape{len}, dev);
    comm->all_reduce(m, ReduceOp::max);
    std::vector<float> sum(len, 0.f), max(len, -1e30f);
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < len; ++i) {
        sum[std::size_t(i)] += value(q, i);
        max[std::size_t(i)] = std::max(max[std::size_t(i)], value(q, i));
      }
    CHECK(t.to_vector<float>() == sum);
    CHECK(m.to_vector<float>() == max);
  }

  // all_to_all_v over rows of 3 i64: rank s sends (s + 2 q) % 3 rows to rank q
  // (zero counts included); row j of the block from s to q holds
  // 1000000 s + 1000 q + 10 j + column.
  {
    auto rows = [](int from, int to) { return int64_t((from + 2 * to) % 3); };
    std::vector<int64_t> send_rows, recv_rows;
    std::vector<int64_t> in_values;
    for (int q = 0; q < n; ++q) {
      send_rows.push_back(rows(r, q));
      recv_rows.push_back(rows(q, r));
      for (int64_t j = 0; j < rows(r, q); ++j)
        for (int64_t c = 0; c < 3; ++c) in_values.push_back(1000000 * r + 1000 * q + 10 * j + c);
    }
    int64_t in_total = 0, out_total = 0;
    for (int q = 0; q < n; ++q) {
      in_total += send_rows[std::size_t(q)];
      out_total += recv_rows[std::size_t(q)];
    }
    // One spare row on each side: the input's is not sent, the output's stays -1.
    for (int64_t c = 0; c < 3; ++c) in_values.push_back(-7);
    Tensor in = Tensor::from_vector(in_values, Shape{in_total + 1, 3}, dev);
    Tensor out =
        Tensor::from_vector(std::vector<int64_t>(std::size_t((out_total + 1) * 3), -1), Shape{out_total + 1, 3}, dev);
    comm->all_to_all_v(in, send_rows, out, recv_rows);
    std::vector<int64_t> expected;
    for (int s = 0; s < n; ++s)
      for (int64_t j = 0; j < rows(s, r); ++j)
        for (int64_t c = 0; c < 3; ++c) expected.push_back(1000000 * s + 1000 * r + 10 * j + c);
    for (int64_t c = 0; c < 3; ++c) expected.push_back(-1);
    CHECK(out.to_vector<int64_t>() == expected);
  }

  // broadcast from the last rank.
  {
    const int root = n - 1;
    Tensor t = Tensor::from_vector(values(r, 11), Shape{11}, dev);
    comm->broadcast(t, root);
    CHECK(t.to_vector<float>() == values(root, 11));
  }

  comm->barrier();

  // split: all ranks in one color with reversed keys renumber in reverse;
  // even/odd colors give one communicator per parity; color -1 gives nullptr.
  {
    std::unique_ptr<slime::comm::Comm> reversed = comm->split(0, n - 1 - r);
    REQUIRE(reversed != nullptr);  // the same on every rank, so REQUIRE cannot desynchronise
    CHECK(reversed->size() == n);
    CHECK(reversed->rank() == n - 1 - r);
    CHECK(reversed->device() == dev);
    Tensor in = Tensor::from_vector(std::vector<int64_t>{r, 100 + r}, Shape{2}, dev);
    Tensor out = Tensor::empty(Shape{2 * n}, DType::i64, dev);
    reversed->all_gather(in, out);
    std::vector<int64_t> expected;
    for (int q = n - 1; q >= 0; --q) {
      expected.push_back(q);
      expected.push_back(100 + q);
    }
    CHECK(out.to_vector<int64_t>() == expected);

    std::unique_ptr<slime::comm::Comm> parity = comm->split(r % 2, r);
    REQUIRE(parity != nullptr);
    CHECK(parity->size() == (n - r % 2 + 1) / 2);
    CHECK(parity->rank() == r / 2);
    Tensor ones = Tensor::from_vector(std::vector<int32_t>(5, 1), Shape{5}, dev);
    parity->all_reduce(ones, ReduceOp::sum);
    CHECK(ones.to_vector<int32_t>() == std::vector<int32_t>(5, parity->size()));

    std::unique_ptr<slime::comm::Comm> only_root = comm->split(r == 0 ? 0 : -1, 0);
    CHECK((only_root != nullptr) == (r == 0));
    if (only_root) CHECK(only_root->size() == 1);
    parity->barrier();
    reversed->barrier();
  }
  comm->barrier();
}
