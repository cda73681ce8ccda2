// parallel::ContextParallel on the CPU (f32, LocalComm ranks as threads):
// Ulysses, zigzag ring attention and their hybrid equal one attention over
// the whole packed batch (forward and backward, odd lengths, one-token
// samples, samples shorter than cp, very different lengths, GQA with one KV
// head), and a tiny Qwen3 (dense and MoE) trained with cp ranks gives the
// unsplit model's loss, logprobs and gradients; the plan's layout and the
// errors for what it cannot do.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "../fsdp/sharded_test_util.hpp"
#include "cp_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/nn/module.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/context_parallel.hpp"

namespace {

using namespace slime;
using slime_test::cp::cp_run;
using slime_test::cp::cu_of;
using slime_test::cp::Degrees;
using slime_test::cp::ModelRun;
using slime_test::cp::OpShape;
using slime_test::cp::reference_run;
using slime_test::cp::run_attention_op;

TEST_CASE("CpPlan: zigzag chunks, Ulysses parts, padding at each sequence's end") {
  // One sequence of 10 tokens, cp = 2 ring: padded to 12 (multiple of 2r = 4),
  // chunks of 3: rank 0 owns chunks 0 and 3, rank 1 chunks 1 and 2.
  const auto p0 = parallel::CpPlan::make({0, 10}, 1, 2, 0), p1 = parallel::CpPlan::make({0, 10}, 1, 2, 1);
  CHECK(p0.padded == std::vector<int64_t>{12});
  CHECK(p0.rows == std::vector<int64_t>{0, 1, 2, 9, -1, -1});
  CHECK(p0.positions == std::vector<int32_t>{0, 1, 2, 9, 10, 11});
  CHECK(p1.rows == std::vector<int64_t>{3, 4, 5, 6, 7, 8});
  CHECK(p0.cu_local == std::vector<int32_t>{0, 6});
  // Ulysses 2 x ring 2, sequences of 3 and 8: multiples of 8; rank 3 (ring
  // rank 1, Ulysses rank 1) holds part 1 of chunks 1 and 2 of each.
  const auto p3 = parallel::CpPlan::make({0, 3, 11}, 2, 2, 3);
  CHECK(p3.padded == std::vector<int64_t>{8, 8});
  CHECK(p3.rows == std::vector<int64_t>{-1, -1, 3 + 3, 3 + 5});
  CHECK(p3.cu_local == std::vector<int32_t>{0, 2, 4});
  CHECK(p3.take(std::vector<int>(11, 5), -1) == std::vector<int>{-1, -1, 5, 5});
  // Every token on exactly one rank.
  for (const Degrees dg : {Degrees{1, 4}, Degrees{4, 1}, Degrees{2, 2}, Degrees{1, 3}}) {
    const std::vector<int32_t> cu = cu_of({1, 7, 33, 2, 64});
    std::vector<int> seen(std::size_t(cu.back()), 0);
    for (int r = 0; r < dg.u * dg.r; ++r) {
      const auto p = parallel::CpPlan::make(cu, dg.u, dg.r, r);
      for (int64_t g : p.rows)
        if (g >= 0) ++seen[std::size_t(g)];
      CHECK(p.local_tokens() == parallel::CpPlan::make(cu, dg.u, dg.r, 0).local_tokens());
    }
    CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  }
}

TEST_CASE("CpPlan: short sequences stay whole on the ring rank with the fewest rows, padding evens the rows") {
  // Ring 2, min chunk 4: a sequence splits when it has >= 2r * 4 = 16 tokens.
  // 40 splits (20 rows per ring rank); 10 goes whole to rank 0 (tie: the
  // first), 3 to rank 1; rank 1's padding entry takes 30 - 23 = 7 rows.
  const std::vector<int32_t> cu = cu_of({10, 3, 40});
  const auto p0 = parallel::CpPlan::make(cu, 1, 2, 0, 4), p1 = parallel::CpPlan::make(cu, 1, 2, 1, 4);
  CHECK(p0.owner == std::vector<int>{0, 1, -1, 0, 1});
  CHECK(p0.ring_rows == std::vector<std::vector<int32_t>>{{10, 0}, {0, 3}, {20, 20}, {0, 0}, {0, 7}});
  CHECK(p0.local_tokens() == 30);
  CHECK(p1.local_tokens() == 30);
  CHECK(p0.cu_local == std::vector<int32_t>{0, 10, 10, 30, 30, 30});
  CHECK(p1.cu_local == std::vector<int32_t>{0, 0, 3, 23, 23, 30});
  std::vector<int> seen(std::size_t(cu.back()), 0);
  for (const auto* p : {&p0, &p1})
    for (int64_t g : p->rows)
      if (g >= 0) ++seen[std::size_t(g)];
  CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
  // Ulysses 2 x ring 2: a whole sequence is cut into 2 parts on its owner.
  const auto q = parallel::CpPlan::make(cu_of({6}), 2, 2, 1, 4);  // ring rank 0, Ulysses rank 1
  CHECK(q.rows == std::vector<int64_t>{3, 4, 5});
  CHECK(q.positions == std::vector<int32_t>{3, 4, 5});
}

TEST_CASE("ContextParallel attention equals one attention over the batch (f32, CPU)") {
  const std::vector<OpShape> shapes = {
      {{1, 7, 33, 2, 64}, 4, 2, 8},  // odd lengths, a one-token sample, samples shorter than cp
      {{5}, 4, 1, 8},                // GQA with one KV head
      {{3, 200, 1, 17}, 8, 4, 16},   // very different lengths
  };
  constexpr auto gather = parallel::RingKv::all_gather;
  constexpr auto p2p = parallel::RingKv::p2p;
  // min chunk 0: every sequence zigzag; 4: sequences shorter than 8 r stay
  // whole on one ring rank (a mix of both, and the padding entries); 1000:
  // every sequence whole.
  for (const Degrees dg :
       {Degrees{1, 2}, Degrees{2, 1}, Degrees{1, 4}, Degrees{4, 1}, Degrees{2, 2}, Degrees{1, 3}, Degrees{1, 2, gather},
        Degrees{1, 4, gather}, Degrees{2, 2, gather}, Degrees{1, 3, gather}, Degrees{1, 2, p2p, 4},
        Degrees{1, 4, p2p, 4}, Degrees{2, 2, p2p, 4}, Degrees{1, 3, p2p, 4}, Degrees{1, 4, gather, 4},
        Degrees{2, 2, gather, 4}, Degrees{1, 2, p2p, 1000}, Degrees{2, 2, gather, 1000}}) {
    for (const OpShape& s : shapes) {
      if (s.hkv % dg.u != 0 || s.hq % dg.u != 0) continue;  // Ulysses needs the heads to divide (errors below)
      INFO("ulysses " << dg.u << " x ring " << dg.r
                      << (dg.kv == parallel::RingKv::all_gather ? " (all-gather K/V)" : "") << ", min chunk "
                      << dg.min_chunk << ", hq " << s.hq << ", hkv " << s.hkv << ", " << s.lengths.size()
                      << " sequences");
      const auto res = run_attention_op(s, dg.u, dg.r, dg.kv, Device::cpu(), DType::f32, 1, dg.min_chunk);
      // Largest difference / largest reference magnitude, per tensor.
      slime_test::cp::check_op(res, 1e-6, 1e-6);
    }
  }
}

TEST_CASE("Qwen3 with context parallelism: loss, logprobs and gradients equal the unsplit model (f32, CPU)") {
  const std::vector<std::vector<int32_t>> seqs = {
      {3, 14, 15, 9, 2, 6, 5}, {35}, {8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4}, {1, 2}};
  std::vector<int32_t> targets;
  for (const auto& s : seqs)
    for (int32_t x : s) targets.push_back((x * 5 + 3) % 37);
  for (const bool moe : {false, true}) {
    const nn::Qwen3Config c = slime_test::fsdp::tiny_config(/*tied=*/false, moe);
    const ModelRun ref = reference_run(c, seqs, targets);
    for (const Degrees dg : {Degrees{1, 2}, Degrees{2, 1}, Degrees{1, 4}, Degrees{2, 2},
                             Degrees{1, 2, parallel::RingKv::all_gather}, Degrees{2, 2, parallel::RingKv::all_gather},
                             Degrees{1, 4, parallel::RingKv::p2p, 1}, Degrees{2, 2, parallel::RingKv::all_gather, 1}}) {
      INFO((moe ? "moe" : "dense") << ", ulysses " << dg.u << " x ring " << dg.r
                                   << (dg.kv == parallel::RingKv::all_gather ? " (all-gather K/V)" : "")
                                   << ", min chunk " << dg.min_chunk);
      const ModelRun run = cp_run(c, seqs, targets, dg);
      CHECK(std::abs(run.loss - ref.loss) <= 1e-6 * std::abs(ref.loss));
      REQUIRE(run.logprobs.size() == ref.logprobs.size());
      const double lp = slime_test::cp::max_abs_diff(run.logprobs, ref.logprobs);
      CHECK(lp <= 1e-6);
      REQUIRE(run.grads.size() == ref.grads.size());
      for (const auto& [name, g] : ref.grads) {
        INFO(name);
        const double rel = slime_test::cp::rel_norm_diff(run.grads.at(name), g);
        // Normwise relative difference. The q / k norm weights (head_dim
        // elements, each a sum over every token and head with much
        // cancellation) amplify f32 rounding: reordering the batch's sequences
        // alone moves them by 2.5e-7 (the rest by <= 1.5e-7), the ring's
        // blockwise softmax by up to 1.6e-6 (measured, ring 4).
        const bool head_norm =
            name.find("_norm.weight") != std::string::npos && name.find("self_attn") != std::string::npos;
        CHECK(rel <= (head_norm ? 2e-6 : 1e-6));
      }
    }
  }
}

TEST_CASE("ContextParallel: clear errors") {
  // Ulysses 2 with one KV head.
  std::string msg;
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    parallel::ContextParallel cpar(comm, {.ulysses = 2});
    cpar.plan(cu_of({4}));
    const nn::PackedBatch b = cpar.local_batch({1, 2, 3, 4});
    const Tensor q = Tensor::zeros({2, 4, 8}, DType::f32), kv = Tensor::zeros({2, 1, 8}, DType::f32);
    Tensor o = Tensor::empty({2, 4, 8}, DType::f32);
    nn::SequenceAttention::Saved saved;
    try {
      cpar.forward(q, kv, kv, b, o, saved, {});
    } catch (const Error& e) {
      if (comm.rank() == 0) msg = e.what();
    }
  });
  CHECK(msg.find("must divide the query heads (4) and the kv heads (1)") != std::string::npos);
  CHECK_THROWS_WITH(parallel::CpPlan::make({0, 3, 3}, 1, 2, 0),
                    Catch::Matchers::ContainsSubstring("sequence 1 has 0 tokens"));
  // Ulysses degree that does not divide cp.
  std::string split_msg;
  comm::run_local_ranks(3, [&](comm::Comm& comm) {
    try {
      parallel::ContextParallel cpar(comm, {.ulysses = 2});
    } catch (const Error& e) {
      if (comm.rank() == 0) split_msg = e.what();
    }
  });
  CHECK(split_msg.find("Ulysses degree 2 must divide the cp size 3") != std::string::npos);
  // A batch that is not the planned one; forward before any plan.
  std::string batch_msg, plan_msg;
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    parallel::ContextParallel cpar(comm);
    nn::SequenceAttention::Saved saved;
    const Tensor q = Tensor::zeros({2, 4, 8}, DType::f32), kv = Tensor::zeros({2, 2, 8}, DType::f32);
    Tensor o = Tensor::empty({2, 4, 8}, DType::f32);
    try {
      cpar.forward(q, kv, kv, nn::make_packed_batch({{1, 2}}), o, saved, {});
    } catch (const Error& e) {
      if (comm.rank() == 0) plan_msg = e.what();
    }
    cpar.plan(cu_of({4}));
    try {
      cpar.forward(q, kv, kv, nn::make_packed_batch({{1}, {2}}), o, saved, {});
    } catch (const Error& e) {
      if (comm.rank() == 0) batch_msg = e.what();
    }
  });
  CHECK(plan_msg.find("no batch planned") != std::string::npos);
  CHECK(batch_msg.find("not this rank's part of the planned batch") != std::string::npos);
}

}  // namespace
