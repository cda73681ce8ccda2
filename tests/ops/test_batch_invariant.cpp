// The batch-invariant mode's switch (slime/ops/batch_invariant.hpp): the
// environment variable, set_batch_invariant and the scope; and the CPU
// reference's row independence, which the mode relies on and does not change:
// a Linear row and a token's logprob are the same bits whatever the batch,
// in and out of the mode.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/linear.hpp"
#include "slime/ops/token_logprobs.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

// Sets SLIME_BATCH_INVARIANT for a scope (unset: nullptr), restoring it after.
class EnvVar {
 public:
  explicit EnvVar(const char* value) {
    if (const char* old = std::getenv(kName)) old_ = old, had_ = true;
    if (value != nullptr) {
      ::setenv(kName, value, 1);
    } else {
      ::unsetenv(kName);
    }
  }
  ~EnvVar() {
    if (had_) {
      ::setenv(kName, old_.c_str(), 1);
    } else {
      ::unsetenv(kName);
    }
  }

 private:
  static constexpr const char* kName = "SLIME_BATCH_INVARIANT";
  std::string old_;
  bool had_ = false;
};

bool same_rows(const Tensor& part, const Tensor& full, int64_t offset) {
  const std::size_t row = std::size_t(part.nbytes() / std::size_t(part.size(0)));
  return std::memcmp(part.data_ptr(), static_cast<const char*>(full.data_ptr()) + std::size_t(offset) * row,
                     part.nbytes()) == 0;
}

}  // namespace

TEST_CASE("batch-invariant mode: the environment variable", "[ops]") {
  {
    EnvVar v(nullptr);
    CHECK_FALSE(ops::detail::batch_invariant_from_env());
  }
  {
    EnvVar v("1");
    CHECK(ops::detail::batch_invariant_from_env());
  }
  for (const char* off : {"0", ""}) {
    EnvVar v(off);
    CHECK_FALSE(ops::detail::batch_invariant_from_env());
  }
  for (const char* bad : {"yes", "true", "2", " 1"}) {
    EnvVar v(bad);
    CHECK_THROWS_WITH(ops::detail::batch_invariant_from_env(),
                      ContainsSubstring("SLIME_BATCH_INVARIANT must be 0 or 1"));
  }
}

TEST_CASE("batch-invariant mode: set_batch_invariant and nested scopes restore the setting", "[ops]") {
  const bool initial = ops::batch_invariant();
  {
    ops::BatchInvariantScope on(true);
    CHECK(ops::batch_invariant());
    {
      ops::BatchInvariantScope off(false);
      CHECK_FALSE(ops::batch_invariant());
    }
    CHECK(ops::batch_invariant());
  }
  CHECK(ops::batch_invariant() == initial);
  const bool before = ops::set_batch_invariant(!initial);
  CHECK(before == initial);
  CHECK(ops::batch_invariant() == !initial);
  CHECK(ops::set_batch_invariant(initial) == !initial);
  CHECK(ops::batch_invariant() == initial);
}

TEST_CASE("batch-invariant mode: CPU rows do not depend on the batch, in and out of the mode", "[ops]") {
  const int64_t rows = 37, K = 29, N = 19, vocab = 53;
  Tensor x = Tensor::empty({rows, K}, DType::bf16), w = Tensor::empty({N, K}, DType::bf16);
  fill_normal(x, 1, 0, 0.f, 1.f);
  fill_normal(w, 2, 0, 0.f, 1.f);
  Tensor head = Tensor::empty({vocab, K}, DType::bf16);
  fill_normal(head, 3, 0, 0.f, 0.3f);
  std::vector<int32_t> t(static_cast<std::size_t>(rows));
  for (int64_t i = 0; i < rows; ++i) t[std::size_t(i)] = int32_t((i * 31) % vocab);
  const Tensor targets = Tensor::from_vector(t, {rows});
  for (bool mode : {false, true}) {
    INFO("mode " << mode);
    ops::BatchInvariantScope scope(mode);
    Tensor full = Tensor::empty({rows, N}, DType::bf16);
    ops::linear_forward(x, w, full);
    const ops::TokenLogprobs lp_full = ops::token_logprobs(x, head, targets, 0.8f);
    for (int64_t offset : {0, 5, 36}) {
      for (int64_t n : {int64_t(1), std::min<int64_t>(7, rows - offset)}) {
        INFO("rows [" << offset << ", " << offset + n << ")");
        Tensor part = Tensor::empty({n, N}, DType::bf16);
        ops::linear_forward(x.slice_rows(offset, n), w, part);
        CHECK(same_rows(part, full, offset));
        const ops::TokenLogprobs lp =
            ops::token_logprobs(x.slice_rows(offset, n), head, targets.slice_rows(offset, n), 0.8f);
        CHECK(same_rows(lp.logprobs, lp_full.logprobs, offset));
        CHECK(same_rows(lp.entropy, lp_full.entropy, offset));
      }
    }
  }
}

// The Hopper plain GEMM's cluster K split (opt-in, batch-invariant decode):
// its planner is host code and runs without a GPU, in any CUDA build.
#if SLIME_HAS_CUDA
TEST_CASE("the cluster K split's plan keeps every CTA busy and fits the SM", "[ops][gemm]") {
  using ops::cuda::grouped_gemm_sm90_cluster_k_plan;
  // A decode step's projections (hidden 1024) on 132 SMs.
  {
    const auto one = grouped_gemm_sm90_cluster_k_plan(1, 1024, 1024, 132);  // 4 chunks: n32, 32 tiles x 4
    CHECK(one.width == 32);
    CHECK(one.cluster == 4);
    CHECK(one.chunks_per_cta == 1);
    CHECK(one.ctas == 128);
    const auto down = grouped_gemm_sm90_cluster_k_plan(256, 1024, 3072, 132);  // 12 chunks: n128, 32 tiles x 4
    CHECK(down.width == 128);
    CHECK(down.cluster == 4);
    CHECK(down.chunks_per_cta == 3);
    CHECK(down.ctas == 128);
    // 192 n128 tiles already cover the SMs; past 256 rows, or one chunk: no split.
    CHECK(grouped_gemm_sm90_cluster_k_plan(256, 6144, 1024, 132).width == 0);
    CHECK(grouped_gemm_sm90_cluster_k_plan(257, 1024, 1024, 132).width == 0);
    CHECK(grouped_gemm_sm90_cluster_k_plan(1, 1024, 256, 132).width == 0);
    CHECK(grouped_gemm_sm90_cluster_k_plan(0, 1024, 1024, 132).width == 0);
  }
  int planned = 0;
  for (int64_t rows : {1, 7, 64, 65, 128, 200, 256}) {
    for (int64_t n : {8, 16, 100, 776, 1024, 1536, 6144, 32000}) {
      for (int64_t k : {64, 256, 257, 1000, 2048, 3072, 8192, 65536}) {
        for (int64_t sms : {1, 16, 78, 114, 132}) {
          const auto plan = grouped_gemm_sm90_cluster_k_plan(rows, n, k, sms);
          if (plan.width == 0) continue;
          ++planned;
          INFO(rows << " x " << k << " -> " << n << " on " << sms << " SMs: width " << plan.width << ", cluster "
                    << plan.cluster << ", " << plan.chunks_per_cta << " chunks per CTA");
          const int64_t chunks = ((k + 63) / 64 + 3) / 4;
          const int64_t tiles = (rows + 63) / 64 * ((n + plan.width - 1) / plan.width);
          CHECK((plan.width == 32 || plan.width == 64 || plan.width == 128));
          CHECK(plan.cluster >= 2);
          CHECK(plan.cluster <= std::min<int64_t>(8, chunks));
          // Every CTA has a chunk, and the CTAs cover all chunks.
          CHECK(int64_t(plan.cluster - 1) * plan.chunks_per_cta < chunks);
          CHECK(int64_t(plan.cluster) * plan.chunks_per_cta >= chunks);
          CHECK(plan.ctas == tiles * plan.cluster);
          CHECK(plan.ctas <= sms);
          CHECK(plan.smem_bytes > 0);
          CHECK(plan.smem_bytes <= 226 * 1024);
        }
      }
    }
  }
  CHECK(planned > 100);  // the sweep exercised the planner
}
#endif  // SLIME_HAS_CUDA
