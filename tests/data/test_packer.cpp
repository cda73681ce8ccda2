// Packer: property tests over random length distributions (every sample
// exactly once, no micro-batch over the budget, one micro-batch count per step
// on every rank, the Karmarkar–Karp spread bound across ranks and micro-batches,
// unpacking restores every sample), the capacity fallbacks, fixed micro-batch
// size, alignment padding, steps and prompt groups, to_tensors, errors, and
// the per-rank path agreed through a 3-rank LocalComm.
//
// Not here yet: packed micro-batches giving the same loss and gradients as
// one-sample batches needs the dense model, which does not exist yet.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <map>
#include <numeric>
#include <vector>

#include "rollout_lengths.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/core/random.hpp"
#include "slime/data/distributed.hpp"
#include "slime/data/packer.hpp"

using namespace slime;
using namespace slime::data;
using Catch::Matchers::ContainsSubstring;

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Lengths in [1, max_len] from one of several shapes.
std::vector<int64_t> random_lengths(int n, uint64_t seed, int shape, int64_t max_len) {
  std::vector<int64_t> out(static_cast<std::size_t>(n));
  if (shape == 0) {  // RL rollouts, scaled to max_len
    const auto b = testing::rollout_lengths(n, seed, 4, max_len / 4, max_len - max_len / 4);
    return b.lengths;
  }
  for (int i = 0; i < n; ++i) {
    const uint32_t u = philox_word(seed, uint64_t(i));
    int64_t len = 1;
    switch (shape) {
      case 1:
        len = 1 + int64_t(u % uint32_t(max_len));
        break;  // uniform
      case 2:
        len = max_len / 3;
        break;  // constant
      case 3:
        len = (u % 10 == 0) ? max_len - int64_t(u % 50) : 1 + int64_t(u % 40);
        break;  // bimodal
      default:
        len = max_len - int64_t(u % uint32_t(max_len / 4));
        break;  // all near the budget
    }
    out[std::size_t(i)] = std::clamp<int64_t>(len, 1, max_len);
  }
  return out;
}

// Deterministic samples of the given lengths: token t of sample i, a response
// of about half the sample, a loss mask with some zeros.
std::vector<Sample> make_samples(std::span<const int64_t> lengths, std::span<const int64_t> groups = {}) {
  std::vector<Sample> out(lengths.size());
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    Sample& s = out[i];
    for (int64_t t = 0; t < lengths[i]; ++t) s.tokens.push_back(int32_t((i * 7919 + std::size_t(t) * 31) % 151936));
    s.response_length = int32_t(std::max<int64_t>(1, lengths[i] / 2));
    for (int32_t t = 0; t < s.response_length; ++t) s.loss_mask.push_back(uint8_t((i + std::size_t(t)) % 5 != 0));
    s.group_index = groups.empty() ? -1 : groups[i];
  }
  return out;
}

// Every property of a plan that must hold whatever the input.
void check_plan(const PackPlan& plan, const PackConfig& c, std::span<const int64_t> lengths) {
  const std::size_t n = lengths.size();
  std::vector<int64_t> padded(n);
  int64_t max_padded = 0;
  for (std::size_t i = 0; i < n; ++i) {
    padded[i] = round_up(lengths[i], c.pad_sequence_to);
    max_padded = std::max(max_padded, padded[i]);
  }
  REQUIRE(int(plan.steps.size()) == c.num_steps);
  std::vector<int> seen(n, 0);
  int64_t real = 0, padded_total = 0;
  for (const StepPlan& step : plan.steps) {
    REQUIRE(int(step.ranks.size()) == c.dp_size);
    std::vector<int32_t> step_samples;
    std::vector<int64_t> rank_sums;
    int max_needed = 0;
    int64_t step_max = 0;
    for (int32_t i : step.samples) step_max = std::max(step_max, padded[std::size_t(i)]);
    for (const RankPlan& rank : step.ranks) {
      // All ranks run the agreed count of micro-batches.
      REQUIRE(int(rank.micro_batches.size()) == step.micro_batches_per_rank);
      std::vector<int64_t> rank_padded;
      int64_t rank_real = 0;
      for (int32_t i : rank.samples) {
        rank_padded.push_back(padded[std::size_t(i)]);
        rank_real += lengths[std::size_t(i)];
      }
      REQUIRE(rank.tokens == rank_real);
      rank_sums.push_back(std::accumulate(rank_padded.begin(), rank_padded.end(), int64_t(0)));
      // The agreed count is the fewest that first-fit decreasing needs on the
      // busiest rank (or ceil(n / micro_batch_size)).
      const int needed =
          c.max_tokens_per_gpu > 0
              ? first_fit_decreasing(rank_padded, c.max_tokens_per_gpu / c.pad_micro_batch_to * c.pad_micro_batch_to)
                    .size()
              : int((rank.samples.size() + std::size_t(c.micro_batch_size) - 1) / std::size_t(c.micro_batch_size));
      max_needed = std::max(max_needed, needed);
      std::vector<int32_t> from_mbs;
      std::vector<int64_t> mb_sums;
      int64_t rank_max = 0;
      for (int64_t p : rank_padded) rank_max = std::max(rank_max, p);
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        REQUIRE(std::is_sorted(mb.samples.begin(), mb.samples.end()));
        int64_t t = 0, pt = 0;
        for (int32_t i : mb.samples) {
          t += lengths[std::size_t(i)];
          pt += padded[std::size_t(i)];
          from_mbs.push_back(i);
        }
        REQUIRE(mb.tokens == t);
        REQUIRE(mb.padded_tokens == round_up(pt, c.pad_micro_batch_to));
        // No micro-batch over the budget, alignment padding included.
        if (c.max_tokens_per_gpu > 0) REQUIRE(mb.padded_tokens <= c.max_tokens_per_gpu);
        if (c.micro_batch_size > 0) REQUIRE(int(mb.samples.size()) <= c.micro_batch_size);
        mb_sums.push_back(pt);
        real += t;
        padded_total += mb.padded_tokens;
      }
      // Largest first.
      for (std::size_t b = 1; b < rank.micro_batches.size(); ++b)
        REQUIRE(rank.micro_batches[b - 1].padded_tokens >= rank.micro_batches[b].padded_tokens);
      // KK's bound across micro-batches when KK's result was kept.
      if (rank.method == BalanceMethod::karmarkar_karp && int(rank.samples.size()) >= step.micro_batches_per_rank &&
          !mb_sums.empty()) {
        const auto [lo, hi] = std::minmax_element(mb_sums.begin(), mb_sums.end());
        REQUIRE(*hi - *lo <= rank_max);
      }
      std::sort(from_mbs.begin(), from_mbs.end());
      REQUIRE(from_mbs == rank.samples);
      step_samples.insert(step_samples.end(), rank.samples.begin(), rank.samples.end());
    }
    REQUIRE(step.micro_batches_per_rank == max_needed);
    std::sort(step_samples.begin(), step_samples.end());
    REQUIRE(step_samples == step.samples);
    for (int32_t i : step.samples) ++seen[std::size_t(i)];
    // KK's bound across ranks: spread <= the largest sample of the step.
    if (c.balance_dp) {
      const auto [lo, hi] = std::minmax_element(rank_sums.begin(), rank_sums.end());
      REQUIRE(*hi - *lo <= step_max);
      if (c.micro_batch_size > 0) {
        std::size_t smin = n, smax = 0;
        for (const RankPlan& r : step.ranks)
          smin = std::min(smin, r.samples.size()), smax = std::max(smax, r.samples.size());
        REQUIRE(smax - smin <= 1);
      }
    }
  }
  // Every sample exactly once.
  REQUIRE(std::all_of(seen.begin(), seen.end(), [](int s) { return s == 1; }));
  REQUIRE(plan.stats.real_tokens == std::accumulate(lengths.begin(), lengths.end(), int64_t(0)));
  REQUIRE(plan.stats.real_tokens == real);
  REQUIRE(plan.stats.padded_tokens == padded_total);
  REQUIRE(plan.stats.padding_tokens == padded_total - real);
}

// Packs every micro-batch of the plan and checks the flat arrays; unpacking
// the token ids (as per-token values) must give back every sample.
void check_packing(const PackPlan& plan, std::span<const Sample> samples) {
  const PackConfig& c = plan.config;
  std::vector<std::vector<int32_t>> unpacked(samples.size());
  std::vector<std::vector<uint8_t>> masks(samples.size());
  std::vector<std::vector<int32_t>> responses(samples.size());
  int64_t padding = 0;
  for (const StepPlan& step : plan.steps) {
    for (const RankPlan& rank : step.ranks) {
      for (const MicroBatchPlan& mbp : rank.micro_batches) {
        const MicroBatch mb = pack_micro_batch(c, mbp, samples);
        REQUIRE(mb.num_tokens() == mbp.padded_tokens);
        REQUIRE(mb.positions.size() == mb.tokens.size());
        REQUIRE(mb.loss_mask.size() == mb.tokens.size());
        REQUIRE(mb.cu_seqlens.size() == std::size_t(mb.num_sequences()) + 1);
        REQUIRE(mb.cu_seqlens.front() == 0);
        REQUIRE(mb.cu_seqlens.back() == mb.num_tokens());
        REQUIRE(mb.num_tokens() % c.pad_micro_batch_to == 0);
        int32_t longest = 0;
        for (int q = 0; q < mb.num_sequences(); ++q) {
          const int32_t begin = mb.cu_seqlens[std::size_t(q)], end = mb.cu_seqlens[std::size_t(q) + 1];
          longest = std::max(longest, end - begin);
          const int32_t i = mb.sample_index[std::size_t(q)];
          if (i < 0) {  // trailing padding sequence
            REQUIRE(q == mb.num_sequences() - 1);
            REQUIRE(end - begin < c.pad_micro_batch_to);
          } else {
            REQUIRE((end - begin) % c.pad_sequence_to == 0);
            REQUIRE(mb.lengths[std::size_t(q)] == samples[std::size_t(i)].length());
          }
          bool positions_restart = true, padding_masked = true;
          for (int32_t t = begin; t < end; ++t) {
            positions_restart &= mb.positions[std::size_t(t)] == t - begin;
            if (t - begin >= mb.lengths[std::size_t(q)])
              padding_masked &= mb.loss_mask[std::size_t(t)] == 0 && mb.tokens[std::size_t(t)] == c.pad_token_id;
          }
          REQUIRE(positions_restart);
          REQUIRE(padding_masked);
        }
        REQUIRE(mb.max_seqlen == longest);
        padding += mb.padding_tokens;
        // Unpack: the tokens, the loss mask and the response part.
        unpack<int32_t>(mb, mb.tokens, unpacked);
        unpack<uint8_t>(mb, mb.loss_mask, masks);
        unpack<int32_t>(mb, mb.tokens, responses, UnpackPart::response);
      }
    }
  }
  REQUIRE(padding == plan.stats.padding_tokens);
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const Sample& s = samples[i];
    REQUIRE(unpacked[i] == s.tokens);
    REQUIRE(responses[i] == std::vector<int32_t>(s.tokens.end() - s.response_length, s.tokens.end()));
    std::vector<uint8_t> expected(std::size_t(s.prompt_length()), 0);
    expected.insert(expected.end(), s.loss_mask.begin(), s.loss_mask.end());
    REQUIRE(masks[i] == expected);
  }
}

}  // namespace

TEST_CASE("plan: properties over random length distributions (token budget)") {
  int plans = 0;
  std::map<BalanceMethod, int> methods;
  for (int shape = 0; shape < 5; ++shape) {
    for (int64_t budget : {int64_t(512), int64_t(8192)}) {
      for (int dp : {1, 2, 3, 8}) {
        for (int n : {40, 301}) {
          for (auto [ps, pm] : {std::pair{1, 1}, std::pair{1, 8}, std::pair{4, 1}, std::pair{2, 16}}) {
            PackConfig c;
            c.dp_size = dp;
            c.max_tokens_per_gpu = budget;
            c.pad_sequence_to = ps;
            c.pad_micro_batch_to = pm;
            c.num_steps = n > 100 ? 2 : 1;
            const uint64_t seed = uint64_t(shape * 1000 + n + dp * 7 + ps * 3 + pm);
            // Longest sample: within the budget after both paddings.
            const int64_t max_len = (budget / pm * pm) / ps * ps;
            const std::vector<int64_t> lengths = random_lengths(n, seed, shape, max_len);
            const PackPlan p = plan(c, lengths);
            check_plan(p, c, lengths);
            for (const StepPlan& s : p.steps)
              for (const RankPlan& r : s.ranks) ++methods[r.method];
            if (n == 40) check_packing(p, make_samples(lengths));
            // Deterministic.
            const PackPlan again = plan(c, lengths);
            for (std::size_t s = 0; s < p.steps.size(); ++s)
              for (int r = 0; r < dp; ++r)
                for (int b = 0; b < p.steps[s].micro_batches_per_rank; ++b)
                  REQUIRE(p.steps[s].ranks[std::size_t(r)].micro_batches[std::size_t(b)].samples ==
                          again.steps[s].ranks[std::size_t(r)].micro_batches[std::size_t(b)].samples);
            ++plans;
          }
        }
      }
    }
  }
  INFO("plans " << plans << "; ranks balanced by KK " << methods[BalanceMethod::karmarkar_karp] << ", LPT "
                << methods[BalanceMethod::lpt_with_capacity] << ", first fit " << methods[BalanceMethod::first_fit]);
  CHECK(methods[BalanceMethod::karmarkar_karp] > 0);
  CHECK(methods[BalanceMethod::first_fit] > 0);
}

TEST_CASE("plan: fixed micro-batch size") {
  for (int shape = 0; shape < 5; ++shape) {
    for (int dp : {1, 3, 4}) {
      for (int mbs : {1, 3, 8}) {
        for (bool balance : {true, false}) {
          PackConfig c;
          c.dp_size = dp;
          c.micro_batch_size = mbs;
          c.balance_dp = balance;
          c.pad_micro_batch_to = 4;
          const std::vector<int64_t> lengths = random_lengths(97, uint64_t(shape * 100 + dp * 10 + mbs), shape, 4000);
          const PackPlan p = plan(c, lengths);
          check_plan(p, c, lengths);
          check_packing(p, make_samples(lengths));
        }
      }
    }
  }
}

TEST_CASE("plan: balancing falls back rather than break the budget") {
  PackConfig c;
  c.max_tokens_per_gpu = 10;
  SECTION("first fit: KK and LPT both give 11 | 9") {
    const std::vector<int64_t> lengths{5, 5, 4, 3, 3};
    const PackPlan p = plan(c, lengths);
    check_plan(p, c, lengths);
    const RankPlan& r = p.steps[0].ranks[0];
    CHECK(r.method == BalanceMethod::first_fit);
    REQUIRE(r.micro_batches.size() == 2);
    CHECK(r.micro_batches[0].tokens == 10);
    CHECK(r.micro_batches[1].tokens == 10);
    CHECK(p.stats.first_fit_fallbacks == 1);
  }
  SECTION("LPT under the capacity: KK's largest part is 56, LPT's 55") {
    c.max_tokens_per_gpu = 55;
    const std::vector<int64_t> lengths{24, 35, 22, 8, 19, 34, 10, 14, 17, 26};
    CHECK(karmarkar_karp(lengths, 4).max_sum() == 56);
    const PackPlan p = plan(c, lengths);
    check_plan(p, c, lengths);
    CHECK(p.steps[0].ranks[0].method == BalanceMethod::lpt_with_capacity);
    CHECK(p.steps[0].micro_batches_per_rank == 4);
    CHECK(p.stats.lpt_fallbacks == 1);
  }
  SECTION("random tight budgets never overflow") {
    std::map<BalanceMethod, int> methods;
    for (uint64_t seed = 0; seed < 3000; ++seed) {
      PackConfig t;
      t.max_tokens_per_gpu = 40 + int64_t(seed % 17);
      t.dp_size = 1 + int(seed % 3);
      std::vector<int64_t> lengths(std::size_t(6 + seed % 20));
      for (std::size_t i = 0; i < lengths.size(); ++i) lengths[i] = 1 + philox_word(seed, i) % 40;
      const PackPlan p = plan(t, lengths);
      check_plan(p, t, lengths);
      for (const RankPlan& r : p.steps[0].ranks) ++methods[r.method];
    }
    // LPT succeeding where KK fails is rare on random inputs (the section
    // above pins one); KK and first fit both occur here.
    CHECK(methods[BalanceMethod::karmarkar_karp] > 0);
    CHECK(methods[BalanceMethod::first_fit] > 0);
  }
}

TEST_CASE("plan: ranks agree on the count, and short ranks get empty micro-batches") {
  // Contiguous ranks: rank 0 holds {9000, 4000, 4000, 4000} and needs 3
  // micro-batches of <= 9000 tokens, rank 1 holds four 4000s and needs 2; both
  // run 3.
  PackConfig c;
  c.dp_size = 2;
  c.max_tokens_per_gpu = 9000;
  c.balance_dp = false;
  const std::vector<int64_t> lengths{9000, 4000, 4000, 4000, 4000, 4000, 4000, 4000};
  const PackPlan p = plan(c, lengths);
  check_plan(p, c, lengths);
  const StepPlan& s = p.steps[0];
  CHECK(s.ranks[0].samples == std::vector<int32_t>{0, 1, 2, 3});
  CHECK(s.micro_batches_per_rank == 3);
  CHECK(s.ranks[0].micro_batches[0].samples == std::vector<int32_t>{0});
  CHECK(s.ranks[0].micro_batches[1].tokens == 8000);
  CHECK(s.ranks[1].micro_batches[0].tokens == 8000);
  CHECK(s.ranks[1].micro_batches[1].tokens == 4000);
  CHECK(s.ranks[1].micro_batches[2].tokens == 4000);
  // One sample per rank, two needed by the other: an empty micro-batch.
  const std::vector<int64_t> uneven{100, 60, 60};
  PackConfig e;
  e.dp_size = 2;
  e.max_tokens_per_gpu = 100;
  const PackPlan q = plan(e, uneven);
  check_plan(q, e, uneven);
  CHECK(q.steps[0].micro_batches_per_rank == 2);
  CHECK(q.stats.empty_micro_batches == 1);
  const std::vector<Sample> samples = make_samples(uneven);
  for (const RankPlan& r : q.steps[0].ranks)
    for (const MicroBatchPlan& mb : r.micro_batches)
      if (mb.samples.empty()) CHECK(pack_micro_batch(e, mb, samples).num_tokens() == 0);
}

TEST_CASE("plan: padding only where alignment is asked for") {
  const std::vector<int64_t> lengths = random_lengths(200, 5, 0, 4096);
  PackConfig c;
  c.dp_size = 2;
  c.max_tokens_per_gpu = 8192;
  const PackPlan none = plan(c, lengths);
  CHECK(none.stats.padding_tokens == 0);
  CHECK(none.stats.padding_fraction == 0.0);
  CHECK(none.stats.pad_to_longest_fraction > 0.0);

  c.pad_micro_batch_to = 8;
  const PackPlan aligned = plan(c, lengths);
  check_plan(aligned, c, lengths);
  CHECK(aligned.stats.padding_tokens > 0);
  CHECK(aligned.stats.padding_tokens <= 7 * aligned.stats.micro_batches);
  CHECK(aligned.stats.padding_fraction == double(aligned.stats.padding_tokens) / double(aligned.stats.padded_tokens));
  CHECK(aligned.stats.padding_fraction < 0.01);
  check_packing(aligned, make_samples(lengths));

  // A micro-batch of 5 + 7 tokens padded to 16: one padding sequence of 4;
  // each sequence padded to a multiple of 2 first: 6 + 8 = 14, then 16.
  PackConfig d;
  d.max_tokens_per_gpu = 64;
  d.pad_sequence_to = 2;
  d.pad_micro_batch_to = 16;
  d.pad_token_id = 99;
  const std::vector<int64_t> two{5, 7};
  const std::vector<Sample> samples = make_samples(two);
  const PackPlan p = plan(d, two);
  REQUIRE(p.steps[0].ranks[0].micro_batches.size() == 1);
  const MicroBatch mb = pack_micro_batch(d, p.steps[0].ranks[0].micro_batches[0], samples);
  CHECK(mb.cu_seqlens == std::vector<int32_t>{0, 6, 14, 16});
  CHECK(mb.sample_index == std::vector<int32_t>{0, 1, -1});
  CHECK(mb.lengths == std::vector<int32_t>{5, 7, 0});
  CHECK(mb.positions == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1});
  CHECK(mb.tokens[5] == 99);
  CHECK(mb.tokens[15] == 99);
  CHECK(mb.padding_tokens == 4);
  CHECK(mb.max_seqlen == 8);
  // Loss mask: 0 on the prompt (5 - 2 = 3 tokens), the sample's mask on the response.
  CHECK(mb.loss_mask[0] == 0);
  CHECK(mb.loss_mask[2] == 0);
  CHECK(mb.loss_mask[3] == samples[0].loss_mask[0]);
  CHECK(mb.loss_mask[4] == samples[0].loss_mask[1]);
  CHECK(mb.loss_mask[5] == 0);
}

TEST_CASE("plan: steps keep prompt groups together") {
  // 10 groups of 6 samples in 4 steps: 60 / 4 = 15 samples per step does not
  // fall on a group boundary.
  const testing::RolloutBatch b = testing::rollout_lengths(60, 9, 6, 1000, 3000);
  PackConfig c;
  c.dp_size = 2;
  c.num_steps = 4;
  c.max_tokens_per_gpu = 8192;
  const PackPlan kept = plan(c, b.lengths, b.group_index);
  check_plan(kept, c, b.lengths);
  std::map<int64_t, int> step_of;
  for (int s = 0; s < 4; ++s) {
    CHECK(kept.steps[std::size_t(s)].samples.size() % 6 == 0);
    for (int32_t i : kept.steps[std::size_t(s)].samples) {
      const int64_t g = b.group_index[std::size_t(i)];
      if (step_of.count(g)) CHECK(step_of[g] == s);
      step_of[g] = s;
    }
  }
  c.keep_groups_in_step = false;
  const PackPlan split = plan(c, b.lengths, b.group_index);
  check_plan(split, c, b.lengths);
  CHECK(split.steps[0].samples.size() == 15);
  CHECK(split.steps[0].samples.back() == 14);
  // From samples: their lengths and groups.
  const std::vector<Sample> samples = make_samples(b.lengths, b.group_index);
  c.keep_groups_in_step = true;
  const PackPlan from_samples = plan(c, samples);
  for (int s = 0; s < 4; ++s) CHECK(from_samples.steps[std::size_t(s)].samples == kept.steps[std::size_t(s)].samples);
  check_packing(from_samples, samples);
}

TEST_CASE("MicroBatch::to_tensors gives i32 and u8 tensors of the packed arrays") {
  const std::vector<int64_t> lengths{3, 4};
  const std::vector<Sample> samples = make_samples(lengths);
  PackConfig c;
  c.max_tokens_per_gpu = 16;
  c.pad_micro_batch_to = 4;
  Packer packer(c);
  const PackPlan p = packer.plan(samples);
  const std::vector<MicroBatch> mbs = packer.pack_rank(p, 0, 0, samples);
  REQUIRE(mbs.size() == 1);
  const MicroBatchTensors t = mbs[0].to_tensors();
  CHECK(t.tokens.dtype() == DType::i32);
  CHECK(t.tokens.shape() == Shape{8});
  CHECK(t.positions.to_vector<int32_t>() == mbs[0].positions);
  CHECK(t.loss_mask.dtype() == DType::u8);
  CHECK(t.loss_mask.to_vector<uint8_t>() == mbs[0].loss_mask);
  CHECK(t.cu_seqlens.to_vector<int32_t>() == std::vector<int32_t>{0, 3, 7, 8});
  CHECK(t.sample_index.to_vector<int32_t>() == std::vector<int32_t>{0, 1, -1});
  CHECK(t.max_seqlen == 4);
  CHECK_THROWS(packer.pack_rank(p, 1, 0, samples));
  CHECK_THROWS(packer.pack_rank(p, 0, 1, samples));
}

TEST_CASE("plan: bad input is a clear error") {
  PackConfig c;
  c.max_tokens_per_gpu = 4096;
  const std::vector<int64_t> zero{10, 20, 30, 0};
  CHECK_THROWS_WITH(plan(c, zero), ContainsSubstring("sample 3 has length 0"));
  const std::vector<int64_t> negative{10, -5};
  CHECK_THROWS_WITH(plan(c, negative), ContainsSubstring("sample 1 has length -5"));
  const std::vector<int64_t> too_long{10, 5000};
  CHECK_THROWS_WITH(plan(c, too_long),
                    ContainsSubstring("sample 1 has 5000 tokens, more than max_tokens_per_gpu = 4096"));
  PackConfig aligned = c;
  aligned.max_tokens_per_gpu = 4092;
  aligned.pad_sequence_to = 8;
  const std::vector<int64_t> padded_over{4090};
  CHECK_THROWS_WITH(plan(aligned, padded_over), ContainsSubstring("sample 0 has 4090 tokens (4096"));
  aligned.pad_sequence_to = 1;
  aligned.pad_micro_batch_to = 1000;
  CHECK_THROWS_WITH(plan(aligned, padded_over), ContainsSubstring("(4000 after rounding down"));

  PackConfig both = c;
  both.micro_batch_size = 4;
  const std::vector<int64_t> ok{10, 20};
  CHECK_THROWS_WITH(plan(both, ok), ContainsSubstring("exactly one of max_tokens_per_gpu"));
  PackConfig neither;
  CHECK_THROWS_WITH(plan(neither, ok), ContainsSubstring("exactly one of max_tokens_per_gpu"));
  PackConfig wide = c;
  wide.dp_size = 3;
  CHECK_THROWS_WITH(plan(wide, ok), ContainsSubstring("step 0 has 2 samples, fewer than dp_size = 3"));
  const std::vector<int64_t> groups{0};
  CHECK_THROWS_WITH(plan(c, ok, groups), ContainsSubstring("1 group indices for 2 samples"));
  PackConfig bad_pad = c;
  bad_pad.pad_sequence_to = 0;
  CHECK_THROWS_WITH(plan(bad_pad, ok), ContainsSubstring("pad_sequence_to must be >= 1"));
  CHECK_THROWS(Packer(neither));

  // Packing samples whose lengths differ from the plan's.
  const std::vector<int64_t> planned{10, 20};
  const PackPlan p = plan(c, planned);
  const std::vector<int64_t> other{10, 21};
  const std::vector<Sample> samples = make_samples(other);
  CHECK_THROWS_WITH(pack_micro_batch(c, p.steps[0].ranks[0].micro_batches[0], samples),
                    ContainsSubstring("the samples pack to 31 tokens but the plan expects 30"));
}

TEST_CASE("per-rank path: agree_micro_batch_count over 3 LocalComm ranks") {
  PackConfig c;
  c.max_tokens_per_gpu = 4096;
  c.pad_micro_batch_to = 8;
  // Each rank holds different samples; rank 1 needs the most micro-batches.
  std::array<std::vector<int64_t>, 3> lengths{random_lengths(20, 1, 0, 4096), random_lengths(90, 2, 1, 4096),
                                              random_lengths(7, 3, 3, 4096)};
  std::array<int, 3> local{}, agreed{};
  std::array<std::vector<MicroBatchPlan>, 3> mbs;
  comm::run_local_ranks(3, [&](comm::Comm& comm) {
    const int r = comm.rank();
    local[std::size_t(r)] = local_micro_batch_count(c, lengths[std::size_t(r)]);
    agreed[std::size_t(r)] = agree_micro_batch_count(comm, local[std::size_t(r)]);
    mbs[std::size_t(r)] = split_micro_batches(c, lengths[std::size_t(r)], agreed[std::size_t(r)]);
  });
  const int expected = *std::max_element(local.begin(), local.end());
  CHECK(local[1] == expected);
  CHECK(local[0] < expected);
  for (int r = 0; r < 3; ++r) {
    CHECK(agreed[std::size_t(r)] == expected);
    REQUIRE(int(mbs[std::size_t(r)].size()) == expected);
    std::vector<int32_t> all;
    for (const MicroBatchPlan& mb : mbs[std::size_t(r)]) {
      CHECK(mb.padded_tokens <= c.max_tokens_per_gpu);
      all.insert(all.end(), mb.samples.begin(), mb.samples.end());
    }
    std::sort(all.begin(), all.end());
    std::vector<int32_t> every(lengths[std::size_t(r)].size());
    std::iota(every.begin(), every.end(), 0);
    CHECK(all == every);
  }
  // The same lengths through plan() on one rank give the same micro-batches.
  const PackPlan p = plan(c, lengths[1]);
  REQUIRE(p.steps[0].micro_batches_per_rank == local[1]);
  const std::vector<MicroBatchPlan> alone = split_micro_batches(c, lengths[1], local[1]);
  for (std::size_t b = 0; b < alone.size(); ++b)
    CHECK(alone[b].samples == p.steps[0].ranks[0].micro_batches[b].samples);
  CHECK_THROWS_WITH(split_micro_batches(c, lengths[1], local[1] - 1), ContainsSubstring("micro-batches requested"));
}
