// parallel::ContextParallel on one GPU: 2-4 LocalComm ranks as threads
// sharing a CUDA device, bf16, the attention kernels of src/ops/: Ulysses,
// zigzag ring attention and their hybrid against the f32 attention of the
// whole batch (head dims 64 and 128, odd lengths, one-token samples, samples
// shorter than cp, GQA with one KV head), and a tiny Qwen3 (head_dim 64)
// trained with cp ranks against the same model on one rank of the GPU.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../fsdp/sharded_test_util.hpp"
#include "cp_test_util.hpp"
#include "slime/core/device.hpp"

namespace {

using namespace slime;
using slime_test::cp::Degrees;
using slime_test::cp::OpShape;

TEST_CASE("ContextParallel attention on CUDA (bf16) equals one attention over the batch") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  const std::vector<OpShape> shapes = {
      {{1, 7, 333, 2, 512, 65}, 16, 4, 128},
      {{129, 3, 700}, 8, 2, 64},
      {{257}, 8, 1, 64},  // GQA with one KV head (ring only)
  };
  constexpr auto gather = parallel::RingKv::all_gather;
  for (const Degrees dg : {Degrees{1, 2}, Degrees{2, 1}, Degrees{1, 4}, Degrees{4, 1}, Degrees{2, 2},
                           Degrees{1, 2, gather}, Degrees{2, 2, gather}}) {
    for (const OpShape& s : shapes) {
      if (s.hkv % dg.u != 0 || s.hq % dg.u != 0) continue;
      INFO("ulysses " << dg.u << " x ring " << dg.r
                      << (dg.kv == parallel::RingKv::all_gather ? " (all-gather K/V)" : "") << ", min chunk "
                      << dg.min_chunk << ", hq " << s.hq << ", hkv " << s.hkv << ", d " << s.d);
      const auto res =
          slime_test::cp::run_attention_op(s, dg.u, dg.r, dg.kv, Device::cuda(0), DType::bf16, 1, dg.min_chunk);
      // bf16 outputs (8 bits of mantissa) of f32-accumulating kernels,
      // relative to each tensor's largest magnitude.
      slime_test::cp::check_op(res, 1e-2, 2e-2);
    }
  }
}

TEST_CASE("Qwen3 with context parallelism on CUDA (bf16) matches the model on one rank") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  nn::Qwen3Config c = slime_test::fsdp::tiny_config(/*tied=*/false);
  c.head_dim = 64;  // a head dim the CUDA attention runs at full speed
  const std::vector<std::vector<int32_t>> seqs = {
      {3, 14, 15, 9, 2, 6, 5}, {35}, {8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 33, 2, 1, 0, 5, 6}, {1, 2}};
  std::vector<int32_t> targets;
  for (const auto& s : seqs)
    for (int32_t x : s) targets.push_back((x * 5 + 3) % 37);
  const Device gpu = Device::cuda(0);
  const auto ref = slime_test::cp::reference_run(c, seqs, targets, gpu);
  for (const Degrees dg : {Degrees{1, 2}, Degrees{2, 1}, Degrees{2, 2}, Degrees{1, 2, parallel::RingKv::all_gather}}) {
    INFO("ulysses " << dg.u << " x ring " << dg.r << (dg.kv == parallel::RingKv::all_gather ? " (all-gather K/V)" : "")
                    << ", min chunk " << dg.min_chunk);
    const auto run = slime_test::cp::cp_run(c, seqs, targets, dg, gpu);
    CHECK(std::abs(run.loss - ref.loss) <= 1e-2 * std::abs(ref.loss));
    REQUIRE(run.logprobs.size() == ref.logprobs.size());
    const double lp = slime_test::cp::max_abs_diff(run.logprobs, ref.logprobs);
    CHECK(lp <= 5e-2);
    for (const auto& [name, g] : ref.grads) {
      INFO(name);
      const double rel = slime_test::cp::rel_norm_diff(run.grads.at(name), g);
      CHECK(rel <= 5e-2);
    }
  }
}

}  // namespace

namespace {

TEST_CASE("ContextParallel's backward workspace is the model's: nn::release_workspaces frees it (CUDA)") {
  if (cuda_device_count() == 0) SKIP("no CUDA device");
  nn::Qwen3Config c = slime_test::fsdp::tiny_config(/*tied=*/false);
  c.head_dim = 64;
  const Device gpu = Device::cuda(0);
  std::vector<std::size_t> before(2), after(2);
  comm::run_local_ranks(
      2,
      [&](comm::Comm& comm) {
        nn::Qwen3Model m = slime_test::cp::model_of(c, gpu);
        parallel::ContextParallel cpar(comm, {.ulysses = 1, .ring_kv = parallel::RingKv::p2p});
        m.set_sequence_attention(&cpar);
        nn::zero_grad(m);
        const std::vector<int32_t> tokens = {3, 14, 15, 9, 2, 6, 5, 35, 8, 9, 7};
        cpar.plan({0, 7, 11});
        const nn::PackedBatch local = cpar.local_batch(tokens);
        const Tensor t = cpar.local_rows(Tensor::from_vector(tokens, {11}, gpu));
        (void)m.loss_and_backward(local, t);
        const auto cp_bytes = [&] {
          std::size_t n = 0;
          cpar.for_each_workspace([&](Tensor& w) { n += w.defined() ? w.nbytes() : 0; });
          return n;
        };
        before[std::size_t(comm.rank())] = cp_bytes();
        nn::release_workspaces(m);
        after[std::size_t(comm.rank())] = cp_bytes() + nn::workspace_bytes(m);
      },
      comm::kLocalCommTimeout, gpu);
  for (int r = 0; r < 2; ++r) {
    CHECK(before[std::size_t(r)] > 0);  // the ring's attention backward kept its workspace
    CHECK(after[std::size_t(r)] == 0);
  }
}

}  // namespace
