// Packer with images: a sample's cost in the token budget is its padded
// tokens plus its image patches (the vision tower's rows). Budgets hold for
// random VL batches (with and without alignment, several ranks and steps, the
// per-rank path too), images weigh in the balance across ranks and
// micro-batches, text-only plans are unchanged by all-zero patch counts, and
// bad input is a clear error.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <vector>

#include "slime/core/random.hpp"
#include "slime/data/packer.hpp"

using namespace slime;
using namespace slime::data;
using Catch::Matchers::ContainsSubstring;

namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

struct VLBatchLengths {
  std::vector<int64_t> lengths, patches, groups;
};

// n samples of 8..max_len tokens; about half carry images of 16..max_patches
// patches (multiples of 4, as merge 2 gives); groups of 4 samples.
VLBatchLengths random_vl(int n, uint64_t seed, int64_t max_len, int64_t max_patches) {
  VLBatchLengths b;
  for (int i = 0; i < n; ++i) {
    const uint32_t r = philox_word(seed, uint64_t(i) * 3);
    b.lengths.push_back(8 + int64_t(r % uint32_t(max_len - 7)));
    const uint32_t with = philox_word(seed, uint64_t(i) * 3 + 1);
    const uint32_t size = philox_word(seed, uint64_t(i) * 3 + 2);
    b.patches.push_back(with % 2 == 0 ? 4 * (4 + int64_t(size % uint32_t(max_patches / 4 - 3))) : 0);
    b.groups.push_back(i / 4);
  }
  return b;
}

std::vector<Sample> make_samples(const VLBatchLengths& b) {
  std::vector<Sample> out(b.lengths.size());
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i].tokens.resize(std::size_t(b.lengths[i]));
    std::iota(out[i].tokens.begin(), out[i].tokens.end(), int32_t(i));
    out[i].response_length = 1;
    out[i].loss_mask = {1};
    out[i].group_index = b.groups[i];
    out[i].image_patches = b.patches[i];
  }
  return out;
}

// Every sample once; each micro-batch's tokens, padded tokens and patches
// match its samples, and its cost fits the budget.
void check_vl_plan(const PackPlan& p, const PackConfig& c, const VLBatchLengths& b) {
  std::vector<int> seen(b.lengths.size(), 0);
  for (const StepPlan& step : p.steps) {
    for (const RankPlan& rank : step.ranks) {
      REQUIRE(int(rank.micro_batches.size()) == step.micro_batches_per_rank);
      int64_t rank_patches = 0;
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        int64_t tokens = 0, padded = 0, patches = 0;
        for (int32_t i : mb.samples) {
          ++seen[std::size_t(i)];
          tokens += b.lengths[std::size_t(i)];
          padded += round_up(b.lengths[std::size_t(i)], c.pad_sequence_to);
          patches += b.patches[std::size_t(i)];
        }
        CHECK(mb.tokens == tokens);
        CHECK(mb.padded_tokens == round_up(padded, c.pad_micro_batch_to));
        CHECK(mb.image_patches == patches);
        CHECK(mb.cost() == mb.padded_tokens + mb.image_patches);
        if (c.max_tokens_per_gpu > 0) CHECK(mb.cost() <= c.max_tokens_per_gpu);
        rank_patches += patches;
      }
      CHECK(rank.image_patches == rank_patches);
      // Largest cost first.
      for (std::size_t m = 1; m < rank.micro_batches.size(); ++m)
        CHECK(rank.micro_batches[m - 1].cost() >= rank.micro_batches[m].cost());
    }
  }
  for (int s : seen) CHECK(s == 1);
  CHECK(p.stats.image_patches == std::accumulate(b.patches.begin(), b.patches.end(), int64_t(0)));
}

}  // namespace

TEST_CASE("plan with images: every micro-batch's tokens plus patches fit the budget") {
  for (uint64_t seed : {1u, 2u, 3u}) {
    const VLBatchLengths b = random_vl(200, seed, 600, 400);
    for (int dp : {1, 3}) {
      for (int align : {1, 8}) {
        PackConfig c;
        c.dp_size = dp;
        c.num_steps = 2;
        c.max_tokens_per_gpu = 2048;
        c.pad_sequence_to = align;
        c.pad_micro_batch_to = align;
        const PackPlan p = plan(c, b.lengths, b.groups, b.patches);
        check_vl_plan(p, c, b);
        CHECK(p.stats.max_micro_batch_cost <= c.max_tokens_per_gpu);
        // The samples' image_patches give the same plan, and pack within it.
        const std::vector<Sample> samples = make_samples(b);
        const PackPlan q = plan(c, samples);
        for (std::size_t s = 0; s < p.steps.size(); ++s)
          for (int r = 0; r < dp; ++r) {
            const RankPlan& a = p.steps[s].ranks[std::size_t(r)];
            const RankPlan& z = q.steps[s].ranks[std::size_t(r)];
            REQUIRE(a.micro_batches.size() == z.micro_batches.size());
            for (std::size_t m = 0; m < a.micro_batches.size(); ++m)
              CHECK(a.micro_batches[m].samples == z.micro_batches[m].samples);
            for (const MicroBatch& mb : Packer(c).pack_rank(q, int(s), r, samples)) {
              CHECK(mb.num_tokens() + mb.image_patches <= c.max_tokens_per_gpu);
              int64_t patches = 0;
              for (int32_t i : mb.sample_index)
                if (i >= 0) patches += b.patches[std::size_t(i)];
              CHECK(mb.image_patches == patches);
            }
          }
      }
    }
  }
}

TEST_CASE("plan with images: fixed micro-batch size counts samples, reports patches") {
  const VLBatchLengths b = random_vl(40, 7, 300, 200);
  PackConfig c;
  c.dp_size = 2;
  c.micro_batch_size = 4;
  const PackPlan p = plan(c, b.lengths, {}, b.patches);
  check_vl_plan(p, c, b);
  CHECK(p.steps[0].micro_batches_per_rank == 5);
}

TEST_CASE("plan with images: patches weigh in the balance across ranks and micro-batches") {
  // Equal tokens; samples 0 and 1 carry big images. By tokens alone any split
  // is balanced; by cost each rank must take one image sample.
  const std::vector<int64_t> lengths{100, 100, 100, 100, 100, 100};
  const std::vector<int64_t> patches{400, 400, 0, 0, 0, 0};
  PackConfig c;
  c.dp_size = 2;
  c.max_tokens_per_gpu = 1000;
  const PackPlan p = plan(c, lengths, {}, patches);
  REQUIRE(p.steps.size() == 1);
  for (const RankPlan& rank : p.steps[0].ranks) {
    CHECK(rank.tokens == 300);
    CHECK(rank.image_patches == 400);
  }
  // One rank: 1400 of cost in 1000 per micro-batch -> 2 micro-batches, each
  // with one image sample: 600 and 800 (the best split of {500, 500, 100 x 4}).
  PackConfig one = c;
  one.dp_size = 1;
  const PackPlan q = plan(one, lengths, {}, patches);
  const RankPlan& rank = q.steps[0].ranks[0];
  REQUIRE(rank.micro_batches.size() == 2);
  CHECK(rank.micro_batches[0].cost() == 700);
  CHECK(rank.micro_batches[1].cost() == 700);
  CHECK(rank.micro_batches[0].image_patches == 400);
  CHECK(rank.micro_batches[1].image_patches == 400);
  CHECK(q.stats.max_micro_batch_tokens == 300);
  CHECK(q.stats.max_micro_batch_cost == 700);
  // Tokens alone fit one micro-batch; the images need a second.
  CHECK(local_micro_batch_count(one, lengths) == 1);
  CHECK(local_micro_batch_count(one, lengths, patches) == 2);

  // Random batches: the ranks' costs are balanced as tokens are without images.
  const VLBatchLengths r = random_vl(400, 11, 600, 400);
  PackConfig four;
  four.dp_size = 4;
  four.max_tokens_per_gpu = 4096;
  const PackPlan rp = plan(four, r.lengths, {}, r.patches);
  int64_t lo = INT64_MAX, hi = 0, longest = 0;
  for (const RankPlan& rk : rp.steps[0].ranks) {
    const int64_t cost = rk.tokens + rk.image_patches;
    lo = std::min(lo, cost);
    hi = std::max(hi, cost);
  }
  for (std::size_t i = 0; i < r.lengths.size(); ++i) longest = std::max(longest, r.lengths[i] + r.patches[i]);
  CHECK(hi - lo <= longest);  // Karmarkar–Karp's spread bound: at most the largest item
}

TEST_CASE("plan with images: text-only plans are unchanged by all-zero patch counts") {
  const VLBatchLengths b = random_vl(300, 5, 900, 400);
  const std::vector<int64_t> zeros(b.lengths.size(), 0);
  for (int align : {1, 8}) {
    PackConfig c;
    c.dp_size = 2;
    c.num_steps = 2;
    c.max_tokens_per_gpu = 3000;
    c.pad_sequence_to = align;
    c.pad_micro_batch_to = align;
    const PackPlan a = plan(c, b.lengths, b.groups);
    const PackPlan z = plan(c, b.lengths, b.groups, zeros);
    REQUIRE(a.steps.size() == z.steps.size());
    for (std::size_t s = 0; s < a.steps.size(); ++s) {
      CHECK(a.steps[s].micro_batches_per_rank == z.steps[s].micro_batches_per_rank);
      for (std::size_t r = 0; r < a.steps[s].ranks.size(); ++r) {
        const RankPlan& x = a.steps[s].ranks[r];
        const RankPlan& y = z.steps[s].ranks[r];
        CHECK(x.samples == y.samples);
        CHECK(x.method == y.method);
        CHECK(y.image_patches == 0);
        for (std::size_t m = 0; m < x.micro_batches.size(); ++m) {
          CHECK(x.micro_batches[m].samples == y.micro_batches[m].samples);
          CHECK(x.micro_batches[m].padded_tokens == y.micro_batches[m].padded_tokens);
          CHECK(y.micro_batches[m].image_patches == 0);
        }
      }
    }
    CHECK(a.stats.max_micro_batch_cost == a.stats.max_micro_batch_tokens);
    CHECK(local_micro_batch_count(c, b.lengths) == local_micro_batch_count(c, b.lengths, zeros));
    const int count = local_micro_batch_count(c, b.lengths) + 1;
    const auto x = split_micro_batches(c, b.lengths, count);
    const auto y = split_micro_batches(c, b.lengths, zeros, count);
    REQUIRE(x.size() == y.size());
    for (std::size_t m = 0; m < x.size(); ++m) CHECK(x[m].samples == y[m].samples);
  }
}

TEST_CASE("per-rank path with images: the count and the split respect the budget") {
  const VLBatchLengths b = random_vl(120, 9, 500, 300);
  for (int align : {1, 4}) {
    PackConfig c;
    c.max_tokens_per_gpu = 1500;
    c.pad_micro_batch_to = align;
    const int count = local_micro_batch_count(c, b.lengths, b.patches);
    CHECK(count == plan(c, b.lengths, {}, b.patches).steps[0].micro_batches_per_rank);
    for (int extra : {0, 2}) {
      BalanceMethod method;
      const std::vector<MicroBatchPlan> mbs = split_micro_batches(c, b.lengths, b.patches, count + extra, &method);
      REQUIRE(int(mbs.size()) == count + extra);
      int64_t patches = 0;
      for (const MicroBatchPlan& mb : mbs) {
        CHECK(mb.cost() <= c.max_tokens_per_gpu);
        patches += mb.image_patches;
      }
      CHECK(patches == std::accumulate(b.patches.begin(), b.patches.end(), int64_t(0)));
    }
    CHECK_THROWS_WITH(split_micro_batches(c, b.lengths, b.patches, count - 1),
                      ContainsSubstring("agree on the largest local_micro_batch_count"));
  }
}

TEST_CASE("plan with images: bad input is a clear error") {
  PackConfig c;
  c.max_tokens_per_gpu = 1000;
  const std::vector<int64_t> lengths{100, 200, 300};
  // A sample whose tokens fit but whose tokens and patches together do not.
  const std::vector<int64_t> over{0, 801, 0};
  CHECK_THROWS_WITH(plan(c, lengths, {}, over),
                    ContainsSubstring("sample 1 has 200 tokens (200 padded) and 801 image patches, 1001 together, "
                                      "more than max_tokens_per_gpu = 1000"));
  CHECK_THROWS_WITH(local_micro_batch_count(c, lengths, over), ContainsSubstring("801 image patches"));
  CHECK_THROWS_WITH(split_micro_batches(c, lengths, over, 3), ContainsSubstring("801 image patches"));
  const std::vector<int64_t> exact{0, 800, 0};
  CHECK(plan(c, lengths, {}, exact).stats.max_micro_batch_cost == 1000);
  // With pad_micro_batch_to, the padding's slack is reserved: the sample fits
  // alone (round_up(200, 8) + 800 = 1000) only without that slack.
  PackConfig aligned = c;
  aligned.pad_micro_batch_to = 8;
  const std::vector<int64_t> tight{0, 796, 0};
  CHECK_THROWS_WITH(plan(aligned, lengths, {}, tight),
                    ContainsSubstring("more than the 993 that max_tokens_per_gpu = 1000 leaves with images after "
                                      "reserving 7 tokens"));
  const std::vector<int64_t> negative{0, -4, 0};
  CHECK_THROWS_WITH(plan(c, lengths, {}, negative), ContainsSubstring("sample 1 has -4 image patches"));
  const std::vector<int64_t> short_list{0, 4};
  CHECK_THROWS_WITH(plan(c, lengths, {}, short_list), ContainsSubstring("2 image patch counts for 3 samples"));

  // Packing samples whose patches differ from the plan's.
  VLBatchLengths b{lengths, {0, 100, 0}, {}};
  b.groups.assign(3, -1);
  std::vector<Sample> samples = make_samples(b);
  const PackPlan text_only = plan(c, lengths);
  CHECK_THROWS_WITH(pack_micro_batch(c, text_only.steps[0].ranks[0].micro_batches[0], samples),
                    ContainsSubstring("the samples have 100 image patches but the plan counted 0"));
  // A hand-made micro-batch over the budget only with its patches.
  MicroBatchPlan all;
  all.samples = {0, 1, 2};
  samples[1].image_patches = 401;
  CHECK_THROWS_WITH(pack_micro_batch(c, all, samples),
                    ContainsSubstring("600 tokens and 401 image patches (1001) exceed max_tokens_per_gpu = 1000"));
  samples[1].image_patches = 400;
  CHECK(pack_micro_batch(c, all, samples).image_patches == 400);
}
