// bench/bench_packer.cpp: the data packer on one CPU core.
//
//   BM_Plan/<dp>/<max_tokens_per_gpu>/<pad_micro_batch_to>
//       data::plan over 100k samples with RL rollout lengths (long tail: mean
//       ~2,350 tokens, longest ~18k; tests/data/rollout_lengths.hpp), groups
//       of 8. The budget: under 100 ms, padding <= 1%.
//   BM_KarmarkarKarp/<k>, BM_FirstFitDecreasing/<capacity>
//       the partitioning steps alone on the same 100k lengths.
//   BM_PackMicroBatches
//       materialising every micro-batch (token ids, cu_seqlens, positions,
//       loss mask) of 8k samples (~19M tokens); bytes = the arrays written.
//
// Counters (BM_Plan): mb_per_rank (agreed micro-batches per rank), padding_pct
// (alignment padding / packed tokens), pad_to_longest_pct (the same
// micro-batches as dense [samples, longest sample] blocks, for comparison),
// pad_to_batch_longest_pct (every sample padded to the batch's longest),
// first_fit_ranks / lpt_ranks (ranks whose micro-batches fell back from
// Karmarkar–Karp to stay within the budget; see slime/data/packer.hpp).
//
// Correctness check before timing (each benchmark, first run): every sample
// exactly once, no micro-batch over the budget, one count on every rank.
// Wall-clock time of the calling thread; the plan is single-threaded.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "rollout_lengths.hpp"
#include "slime/data/packer.hpp"

namespace {

using namespace slime::data;

constexpr int64_t kSamples = 100000;

const testing::RolloutBatch& batch() {
  static const testing::RolloutBatch b = testing::rollout_lengths(kSamples, 2024);
  return b;
}

// "" when the plan is sound, otherwise what is wrong.
std::string check(const PackPlan& p, const PackConfig& c, std::size_t n) {
  std::vector<int> seen(n, 0);
  for (const StepPlan& s : p.steps) {
    for (const RankPlan& r : s.ranks) {
      if (int(r.micro_batches.size()) != s.micro_batches_per_rank) return "ranks disagree on the micro-batch count";
      for (const MicroBatchPlan& mb : r.micro_batches) {
        if (c.max_tokens_per_gpu > 0 && mb.padded_tokens > c.max_tokens_per_gpu) return "micro-batch over budget";
        for (int32_t i : mb.samples) ++seen[std::size_t(i)];
      }
    }
  }
  if (!std::all_of(seen.begin(), seen.end(), [](int x) { return x == 1; })) return "a sample is lost or repeated";
  return "";
}

void BM_Plan(benchmark::State& state) {
  PackConfig c;
  c.dp_size = int(state.range(0));
  c.max_tokens_per_gpu = state.range(1);
  c.pad_micro_batch_to = int(state.range(2));
  const testing::RolloutBatch& b = batch();
  PackPlan p = plan(c, b.lengths, b.group_index);
  if (slime::bench::skip_if_error(state, check(p, c, b.lengths.size()))) return;
  for (auto _ : state) {
    p = plan(c, b.lengths, b.group_index);
    benchmark::DoNotOptimize(p.steps.data());
  }
  state.counters["samples"] = double(kSamples);
  state.counters["mb_per_rank"] = p.steps[0].micro_batches_per_rank;
  state.counters["padding_pct"] = 100.0 * p.stats.padding_fraction;
  state.counters["pad_to_longest_pct"] = 100.0 * p.stats.pad_to_longest_fraction;
  // Every sample padded to the longest of the whole batch ([n, max] layout).
  const int64_t longest = *std::max_element(b.lengths.begin(), b.lengths.end());
  state.counters["pad_to_batch_longest_pct"] =
      100.0 * (1.0 - double(p.stats.real_tokens) / (double(longest) * double(kSamples)));
  state.counters["first_fit_ranks"] = double(p.stats.first_fit_fallbacks);
  state.counters["lpt_ranks"] = double(p.stats.lpt_fallbacks);
  state.SetItemsProcessed(state.iterations() * kSamples);
}
BENCHMARK(BM_Plan)
    ->ArgNames({"dp", "max_tokens", "align"})
    ->Args({8, 32768, 1})
    ->Args({8, 32768, 8})
    ->Args({8, 20480, 8})
    ->Args({64, 24576, 8})
    ->Args({1, 32768, 1})
    ->Unit(benchmark::kMillisecond);

void BM_KarmarkarKarp(benchmark::State& state) {
  const std::vector<int64_t>& w = batch().lengths;
  const int k = int(state.range(0));
  Partition p = karmarkar_karp(w, k);
  if (p.spread() > *std::max_element(w.begin(), w.end())) {
    state.SkipWithError("spread above the largest weight");
    return;
  }
  for (auto _ : state) {
    p = karmarkar_karp(w, k);
    benchmark::DoNotOptimize(p.sums.data());
  }
  state.counters["spread"] = double(p.spread());
  state.SetItemsProcessed(state.iterations() * int64_t(w.size()));
}
BENCHMARK(BM_KarmarkarKarp)->ArgName("k")->Arg(8)->Arg(64)->Arg(1024)->Unit(benchmark::kMillisecond);

void BM_FirstFitDecreasing(benchmark::State& state) {
  const std::vector<int64_t>& w = batch().lengths;
  const int64_t capacity = state.range(0);
  Partition p = first_fit_decreasing(w, capacity);
  if (p.max_sum() > capacity) {
    state.SkipWithError("bin over capacity");
    return;
  }
  for (auto _ : state) {
    p = first_fit_decreasing(w, capacity);
    benchmark::DoNotOptimize(p.sums.data());
  }
  state.counters["bins"] = double(p.size());
  state.SetItemsProcessed(state.iterations() * int64_t(w.size()));
}
BENCHMARK(BM_FirstFitDecreasing)->ArgName("capacity")->Arg(32768)->Unit(benchmark::kMillisecond);

void BM_PackMicroBatches(benchmark::State& state) {
  const int64_t n = 8192;
  const testing::RolloutBatch b = testing::rollout_lengths(n, 7);
  std::vector<Sample> samples(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < samples.size(); ++i) {
    Sample& s = samples[i];
    s.tokens.resize(std::size_t(b.lengths[i]));
    for (std::size_t t = 0; t < s.tokens.size(); ++t) s.tokens[t] = int32_t((i * 31 + t) % 151936);
    s.response_length = int32_t(std::max<int64_t>(1, b.lengths[i] / 2));
    s.loss_mask.assign(std::size_t(s.response_length), 1);
  }
  PackConfig c;
  c.dp_size = 8;
  c.max_tokens_per_gpu = 32768;
  c.pad_micro_batch_to = 8;
  const PackPlan p = plan(c, b.lengths, b.group_index);
  int64_t tokens = 0;
  for (auto _ : state) {
    tokens = 0;
    for (const RankPlan& r : p.steps[0].ranks) {
      for (const MicroBatchPlan& mbp : r.micro_batches) {
        const MicroBatch mb = pack_micro_batch(c, mbp, samples);
        tokens += mb.num_tokens();
        benchmark::DoNotOptimize(mb.tokens.data());
      }
    }
  }
  if (tokens != p.stats.padded_tokens) {
    state.SkipWithError("packed token count differs from the plan");
    return;
  }
  state.counters["tokens"] = double(tokens);
  // Per token: id, position (i32 each) and mask (u8) written.
  state.SetBytesProcessed(state.iterations() * tokens * 9);
}
BENCHMARK(BM_PackMicroBatches)->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) { return slime::bench::run_benchmarks(argc, argv); }
