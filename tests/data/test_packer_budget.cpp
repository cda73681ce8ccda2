// The packer's time budget: planning 100k samples with RL rollout lengths
// (long tail) for 8 data-parallel ranks and 32k tokens per micro-batch. The
// issue asks for under 100 ms on one CPU core; this test asserts under 1 s
// (the best of 3 runs), loose enough for a slow or loaded CI machine, and
// prints what it measured. bench/bench_packer.cpp has the precise numbers.
// Also checks the padding: <= 1% with sequence-parallel alignment (8), printed
// beside the padding of dense [samples, longest] micro-batches.
#include <catch2/catch_test_macros.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "rollout_lengths.hpp"
#include "slime/data/packer.hpp"

using namespace slime::data;

// Sanitizer builds (the asan preset: -O1, instrumented) run many times slower:
// there the time is printed, not asserted.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kAssertTime = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kAssertTime = false;
#else
constexpr bool kAssertTime = true;
#endif
#else
constexpr bool kAssertTime = true;
#endif

TEST_CASE("plan packs 100k RL rollout samples well within the time budget") {
  const testing::RolloutBatch batch = testing::rollout_lengths(100000, 2024);
  PackConfig c;
  c.dp_size = 8;
  c.max_tokens_per_gpu = 32768;
  c.pad_micro_batch_to = 8;
  double best_ms = 1e30;
  PackPlan p;
  for (int run = 0; run < 3; ++run) {
    const auto t0 = std::chrono::steady_clock::now();
    p = plan(c, batch.lengths, batch.group_index);
    const auto t1 = std::chrono::steady_clock::now();
    best_ms = std::min(best_ms, std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  std::printf(
      "plan(100k samples, dp 8, 32768 tokens per micro-batch): %.1f ms (budget 100 ms, asserted < 1000 ms); "
      "%d micro-batches per rank; padding %.4f%% (pad to longest in each micro-batch: %.1f%%); "
      "fallbacks: %lld LPT, %lld first-fit of 8 ranks\n",
      best_ms, p.steps[0].micro_batches_per_rank, 100.0 * p.stats.padding_fraction,
      100.0 * p.stats.pad_to_longest_fraction, (long long)p.stats.lpt_fallbacks,
      (long long)p.stats.first_fit_fallbacks);
  if (kAssertTime) CHECK(best_ms < 1000.0);
  CHECK(p.stats.padding_fraction <= 0.01);
  CHECK(p.stats.max_micro_batch_tokens <= c.max_tokens_per_gpu);
  CHECK(p.stats.samples == 100000);
}
