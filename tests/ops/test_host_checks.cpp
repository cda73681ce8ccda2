// slime/ops/host_checks.hpp: cu_seqlens and token targets checked on the
// host, so a bad batch is a slime::Error instead of a device trap.
#include "slime/ops/host_checks.hpp"

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cstdint>
#include <vector>

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

int64_t check_cu(const std::vector<int32_t>& cu, int64_t tokens, int64_t sequences = -1) {
  return ops::check_cu_seqlens(cu, tokens, "batch 7", sequences);
}

}  // namespace

TEST_CASE("check_cu_seqlens accepts packed batches and returns the longest sequence", "[ops]") {
  CHECK(check_cu({0, 3, 3, 10}, 10) == 7);  // an empty sequence is allowed
  CHECK(check_cu({0, 4}, 4, 1) == 4);
  CHECK(check_cu({0}, 0) == 0);  // no sequences, no tokens
  CHECK(ops::check_cu_seqlens(std::vector<int32_t>{0, 2}, 2, "x", -1, "cu_seqlens_q") == 2);
}

TEST_CASE("check_cu_seqlens names what is wrong", "[ops]") {
  CHECK_THROWS_WITH(check_cu({1, 3, 10}, 10), ContainsSubstring("batch 7: cu_seqlens[0] must be 0, got 1"));
  CHECK_THROWS_WITH(check_cu({0, 5, 3, 10}, 10),
                    ContainsSubstring("cu_seqlens must be non-decreasing: cu_seqlens[2] = 3 < cu_seqlens[1] = 5"));
  CHECK_THROWS_WITH(check_cu({0, 3, 9}, 10), ContainsSubstring("must end at the token count 10, got 9"));
  CHECK_THROWS_WITH(check_cu({0, 3, 11}, 10), ContainsSubstring("must end at the token count 10, got 11"));
  CHECK_THROWS_WITH(check_cu({0, 3, 10}, 10, 3), ContainsSubstring("must hold 4 entries (3 sequences), got 3"));
  CHECK_THROWS_WITH(check_cu({}, 0), ContainsSubstring("cu_seqlens is empty"));
  CHECK_THROWS_WITH(ops::check_cu_seqlens(std::vector<int32_t>{2}, 0, "x", -1, "cu_seqlens_k"),
                    ContainsSubstring("x: cu_seqlens_k[0] must be 0"));
}

TEST_CASE("check_token_targets: every target inside the vocabulary", "[ops]") {
  const std::vector<int32_t> ok = {0, 5, 9};
  CHECK_NOTHROW(ops::check_token_targets(std::span<const int32_t>(ok), 10, "mb"));
  CHECK_NOTHROW(ops::check_token_targets(std::span<const int32_t>(), 10, "mb"));
  const std::vector<int32_t> high = {0, 10, 3};
  CHECK_THROWS_WITH(ops::check_token_targets(std::span<const int32_t>(high), 10, "mb"),
                    ContainsSubstring("mb: targets[1] = 10 is outside the vocabulary [0, 10)"));
  const std::vector<int64_t> negative = {3, -1};
  CHECK_THROWS_WITH(ops::check_token_targets(std::span<const int64_t>(negative), 10, "mb"),
                    ContainsSubstring("targets[1] = -1 is outside"));
  const std::vector<int64_t> huge = {int64_t(1) << 40};
  CHECK_THROWS_WITH(ops::check_token_targets(std::span<const int64_t>(huge), 10, "mb"),
                    ContainsSubstring("targets[0] = 1099511627776"));
  CHECK_THROWS_WITH(ops::check_token_targets(std::span<const int32_t>(ok), 0, "mb"),
                    ContainsSubstring("vocabulary size must be positive"));
  // Tensors on the CPU, i32 and i64.
  CHECK_NOTHROW(ops::check_token_targets(Tensor::from_vector(ok, {3}), 10, "t"));
  CHECK_THROWS_WITH(ops::check_token_targets(Tensor::from_vector(negative, {2}), 10, "t"),
                    ContainsSubstring("t: targets[1] = -1"));
  CHECK_THROWS_WITH(ops::check_token_targets(Tensor::from_vector(std::vector<float>{1.f}, {1}), 10, "t"),
                    ContainsSubstring("must be i32 or i64"));
}
