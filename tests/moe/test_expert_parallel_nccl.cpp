// SparseMoeBlock with ExpertParallel over NcclComm across processes, bf16 on
// the GPU, against the unsharded block. One process per GPU, started by
//   torchrun --no-python --nproc-per-node 2 test_expert_parallel_nccl
// (ctest does this through tools/run-under-torchrun.sh, which skips with exit
// 4 when fewer than 2 GPUs are visible). Run alone (WORLD_SIZE unset) it skips.
//
// Every rank computes the unsharded block (ep = nullptr) over all ranks'
// tokens (regenerated from the same seeds), then the EP block over its own
// tokens, and compares its slice: y, dx, its experts' gradients, and the gate
// gradient summed over ranks (all_reduce), plus the routing itself.
//
// Routing is made exact: x is a multiple of 1/4 in [-1, 1] and the gate a
// multiple of 1/8 in [-1, 1], so every logit is a sum of multiples of 1/32
// below 2^6, exact in fp32 whatever the GEMM's summation order, and rounds to
// the same bf16 in both runs: the two runs pick the same experts. What remains
// is the accumulation order of GEMMs over different row counts (fp32, rounded
// once to bf16, so about one bf16 ulp, 2^-8 relative, per element) and the
// order of the gate-gradient sum: tolerance 1e-2 relative (Frobenius) on
// everything.
//
// Every rank runs the same collectives in the same order whatever it finds:
// checks use CHECK, never REQUIRE, so a wrong value on one rank cannot leave
// the other waiting in a collective.
#include <catch2/catch_test_macros.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "moe_test_util.hpp"
#include "slime/comm/nccl_comm.hpp"
#include "slime/nn/moe.hpp"
#include "slime/parallel/expert_parallel.hpp"

namespace {

using namespace slime;
using namespace moe_test;
using comm::NcclComm;

// NVLink multicast stays off on the shared GPU hosts (the ctest wrapper
// exports it too); an explicit setting wins.
[[maybe_unused]] const bool kNvlsOff = (setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0), true);

constexpr double kTolerance = 1e-2;

// Multiples of 1/q in [-1, 1].
Vec dyadic(int64_t n, uint64_t seed, double q) {
  Vec v = random_doubles(n, seed);
  for (double& x : v) x = std::round(x * q) / q;
  return v;
}

Vec bf16_rounded(Vec v) {
  for (double& x : v) x = double(float(BFloat16(float(x))));
  return v;
}

}  // namespace

TEST_CASE("SparseMoeBlock with ExpertParallel over NCCL equals the unsharded block (bf16)", "[moe][multi_gpu]") {
  if (std::getenv("WORLD_SIZE") == nullptr)
    SKIP("WORLD_SIZE is unset: run under torchrun --no-python --nproc-per-node 2 test_expert_parallel_nccl");
  if (cuda_device_count() < 1) SKIP("no CUDA device");  // the same answer on every rank

  std::unique_ptr<NcclComm> comm = NcclComm::from_env();
  const int r = comm->rank(), n = comm->size();
  const Device dev = comm->device();
  INFO("rank " << r << " of " << n << " on " << dev);
  const int64_t E = 8, H = 64, I = 48;
  if (E % n != 0) SKIP("the test splits 8 experts; world size " << n << " does not divide it");

  for (int64_t k : {2, 8}) {
    INFO("k " << k);
    std::vector<int64_t> tokens, first_token;
    int64_t T = 0;
    for (int q = 0; q < n; ++q) {
      first_token.push_back(T);
      tokens.push_back(37 + 11 * q);  // odd sizes
      T += tokens.back();
    }
    Weights w = Weights::random(H, I, E, 500 + uint64_t(k));
    w.gate = dyadic(E * H, 501, 8);
    w.wg = bf16_rounded(w.wg);
    w.wu = bf16_rounded(w.wu);
    w.wd = bf16_rounded(w.wd);
    const Vec x = dyadic(T * H, 502, 4);
    const Vec dy = bf16_rounded(random_doubles(T * H, 503));
    const nn::MoeBlockConfig cfg{H, I, E, k, true};
    const nn::ModuleOptions opt{dev, DType::bf16};
    const int64_t t0 = first_token[std::size_t(r)], mine = tokens[std::size_t(r)];

    // The unsharded block over all tokens, on this rank's GPU.
    nn::SparseMoeBlock full("model.layers.0.mlp", cfg, opt);
    load(full, w);
    nn::zero_grad(full);
    nn::SparseMoeBlock::Context fctx;
    const Vec y_full = to_double(full.forward(tensor_of(x, {T, H}, DType::bf16).to(dev), fctx));
    const Vec dx_full = to_double(full.backward(fctx, tensor_of(dy, {T, H}, DType::bf16).to(dev)));
    const auto idx_full = fctx.indices.to_vector<int32_t>();

    // The EP block over this rank's tokens.
    parallel::ExpertParallel<> ep(*comm, E);
    nn::SparseMoeBlock b("model.layers.0.mlp", cfg, opt, &ep);
    load(b, w);
    nn::zero_grad(b);
    nn::SparseMoeBlock::Context ctx;
    const Vec y = to_double(b.forward(tensor_of(rows_of(x, H, t0, mine), {mine, H}, DType::bf16).to(dev), ctx));
    const Vec dx = to_double(b.backward(ctx, tensor_of(rows_of(dy, H, t0, mine), {mine, H}, DType::bf16).to(dev)));
    comm->all_reduce(b.gate.grad);  // the data-parallel reduction of the replicated gate

    const auto idx = ctx.indices.to_vector<int32_t>();
    CHECK(idx == std::vector<int32_t>(idx_full.begin() + t0 * k, idx_full.begin() + (t0 + mine) * k));
    CHECK(rel_error(y, rows_of(y_full, H, t0, mine)) < kTolerance);
    CHECK(rel_error(dx, rows_of(dx_full, H, t0, mine)) < kTolerance);
    CHECK(rel_error(to_double(b.gate.grad), to_double(full.gate.grad)) < kTolerance);
    const int64_t El = E / n, first = b.gate_proj.first_expert;
    CHECK(first == r * El);
    CHECK(rel_error(to_double(b.gate_proj.grad), rows_of(to_double(full.gate_proj.grad), I * H, first, El)) <
          kTolerance);
    CHECK(rel_error(to_double(b.up_proj.grad), rows_of(to_double(full.up_proj.grad), I * H, first, El)) < kTolerance);
    CHECK(rel_error(to_double(b.down_proj.grad), rows_of(to_double(full.down_proj.grad), H * I, first, El)) <
          kTolerance);
    CHECK(max_abs(y) > 0);
    comm->barrier();
  }
}
