// slime/data/packer.hpp: Packer, which splits a global batch of samples into
// optimizer steps, data-parallel ranks and micro-batches (by a token budget or
// a fixed sample count), and packs each micro-batch into flat varlen arrays
// (token ids, cu_seqlens, positions, loss mask, sample map).
//
// The main API is the pure function plan(): every data-parallel rank runs it
// on the same global batch (the lengths of every sample) and takes its own
// share, plan.steps[s].ranks[dp_rank]. The plan is a deterministic function of
// its input (stable orders, ties broken by sample index), so every rank
// computes the same plan, and in particular the same micro-batch count: no
// communication is needed. Where each rank only knows its own samples, use
// local_micro_batch_count -> agree_micro_batch_count (slime/data/distributed.hpp,
// an all_reduce max) -> split_micro_batches instead.
//
// How plan() splits a batch of n samples (lengths counted after per-sequence
// alignment padding, see PackConfig::pad_sequence_to):
//   1. Steps. The samples are cut into num_steps contiguous runs of about
//      n / num_steps samples. With keep_groups_in_step, cuts fall only between
//      prompt groups (group_index, in order of first appearance), so the
//      samples of one prompt always train in the same optimizer step.
//   2. Ranks. Within a step, Karmarkar–Karp splits the samples into dp_size
//      parts of balanced total tokens (largest part to rank 0). With a fixed
//      micro_batch_size the parts also hold equal sample counts (+-1).
//      balance_dp = false keeps contiguous runs instead.
//   3. Micro-batches, token budget (max_tokens_per_gpu): first-fit decreasing
//      gives each rank the fewest micro-batches its samples need; every rank
//      of the step then uses the largest such count (so all ranks run the same
//      number), and Karmarkar–Karp balances the rank's samples over that many
//      micro-batches. Balancing never breaks the budget: when KK's result has
//      a micro-batch over it, LPT under the capacity is used, and when that
//      fails too, the first-fit packing itself (always within budget).
//      Fixed size (micro_batch_size): ceil(samples / size) micro-batches, the
//      largest count over the step's ranks, balanced by equal-size KK.
//      When many small samples fill each micro-batch, first-fit's count leaves
//      almost no slack (100k rollouts at 32k tokens: 99.9% full), KK's parts
//      straddle the budget by a few tokens and the first-fit packing is kept:
//      every micro-batch but the last is then within a few tokens of the
//      budget, as balanced as that count allows. RankPlan::method and
//      PackStats say which method each rank used.
//      A rank with fewer samples than the agreed count gets empty micro-batches
//      (zero tokens): it must still run them, to match its peers' collectives.
//   4. Micro-batches of a rank are ordered by padded tokens (plus image
//      patches, see below), largest first
//      (ties: lowest first sample), so the i-th micro-batches of all ranks are
//      alike in size; samples inside one are in ascending index order.
//
// Padding happens only where alignment is asked for, and the budget counts it:
// a micro-batch's padded total never exceeds max_tokens_per_gpu.
//
// Images (vision-language samples). A sample's images reach the vision tower
// as rows of pixel_values, one per patch (data::GridTHW::patches(), summed
// over the sample's images), and those rows share the micro-batch's memory
// with the tokens. So a sample's cost is its (padded) tokens plus its image
// patches: Sample::image_patches (set after preprocessing; plan(samples)
// reads it), or an image_patches vector beside the lengths (plan,
// local_micro_batch_count, split_micro_batches). Every step above weighs
// samples by that cost: rank balance, the first-fit count, micro-batch
// balance and the largest-first order. The budget holds
//   round_up(padded tokens, pad_micro_batch_to) + image patches
//     <= max_tokens_per_gpu
// for every micro-batch, and a sample whose cost alone exceeds it is an error.
// With images the partitioners take the capacity max_tokens_per_gpu -
// (pad_micro_batch_to - 1): the token padding of a micro-batch is not known
// until its samples are, and that slack bounds it (pad_micro_batch_to = 1:
// exact). MicroBatchPlan, RankPlan, MicroBatch and PackStats report tokens
// and image patches apart. Without image patches (all zero, or the vector
// empty) nothing above changes: text-only plans are exactly as before.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <span>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "slime/core/tensor.hpp"
#include "slime/data/partition.hpp"
#include "slime/data/sample.hpp"

namespace slime::data {

struct PackConfig {
  int dp_size = 1;
  // Optimizer steps the batch is split into (slime's num_steps_per_rollout).
  int num_steps = 1;
  // Exactly one of the two is set (> 0): a token budget per micro-batch
  // (dynamic micro-batches) or a fixed number of samples per micro-batch.
  int64_t max_tokens_per_gpu = 0;
  int micro_batch_size = 0;
  // Balance total tokens across data-parallel ranks with Karmarkar–Karp;
  // false: rank r takes the r-th contiguous run of the step's samples.
  bool balance_dp = true;
  // Step cuts fall only between prompt groups (see group_index).
  bool keep_groups_in_step = true;
  // Each sequence padded to a multiple of this (e.g. 2 * context-parallel
  // degree for load-balanced ring attention); the padding ends the sequence's
  // cu_seqlens segment.
  int pad_sequence_to = 1;
  // A micro-batch's total tokens padded to a multiple of this (e.g. the
  // sequence-parallel degree), by one trailing padding sequence.
  int pad_micro_batch_to = 1;
  int32_t pad_token_id = 0;
};

// How a rank's micro-batches were balanced (see step 3 at the top).
enum class BalanceMethod : uint8_t { karmarkar_karp, lpt_with_capacity, first_fit };

inline std::string_view balance_method_name(BalanceMethod m) {
  switch (m) {
    case BalanceMethod::karmarkar_karp:
      return "karmarkar_karp";
    case BalanceMethod::lpt_with_capacity:
      return "lpt_with_capacity";
    case BalanceMethod::first_fit:
      return "first_fit";
  }
  return "?";
}

struct MicroBatchPlan {
  std::vector<int32_t> samples;  // sample indices, ascending
  int64_t tokens = 0;            // real tokens
  int64_t padded_tokens = 0;     // tokens after alignment padding: what the micro-batch holds
  int64_t image_patches = 0;     // vision-tower rows of the samples' images

  // What the token budget counts: padded tokens plus image patches.
  int64_t cost() const { return padded_tokens + image_patches; }
};

struct RankPlan {
  std::vector<int32_t> samples;  // every sample of this rank in this step, ascending
  std::vector<MicroBatchPlan> micro_batches;
  int64_t tokens = 0;         // real tokens
  int64_t image_patches = 0;  //
  BalanceMethod method = BalanceMethod::karmarkar_karp;
};

struct StepPlan {
  std::vector<int32_t> samples;  // every sample of this step, ascending
  std::vector<RankPlan> ranks;   // [dp_size]
  int micro_batches_per_rank = 0;
};

struct PackStats {
  int64_t samples = 0;
  int64_t real_tokens = 0;
  int64_t padded_tokens = 0;  // all micro-batches, alignment padding included
  int64_t padding_tokens = 0;
  double padding_fraction = 0;  // padding_tokens / padded_tokens
  // The same micro-batches stored as dense [samples, longest sample] blocks.
  int64_t pad_to_longest_tokens = 0;
  double pad_to_longest_fraction = 0;
  int64_t micro_batches = 0;  // over all steps and ranks
  int64_t empty_micro_batches = 0;
  int64_t max_micro_batch_tokens = 0;  // padded
  int64_t image_patches = 0;           // all micro-batches
  int64_t max_micro_batch_cost = 0;    // padded tokens + image patches
  // Ranks whose micro-batches fell back from Karmarkar–Karp (BalanceMethod).
  int64_t lpt_fallbacks = 0;
  int64_t first_fit_fallbacks = 0;
};

struct PackPlan {
  PackConfig config;
  std::vector<StepPlan> steps;
  PackStats stats;
};

namespace detail {

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

inline void check_config(const PackConfig& c) {
  SLIME_CHECK(c.dp_size >= 1, "PackConfig: dp_size must be >= 1, got ", c.dp_size);
  SLIME_CHECK(c.num_steps >= 1, "PackConfig: num_steps must be >= 1, got ", c.num_steps);
  SLIME_CHECK((c.max_tokens_per_gpu > 0) != (c.micro_batch_size > 0),
              "PackConfig: set exactly one of max_tokens_per_gpu (", c.max_tokens_per_gpu, ") and micro_batch_size (",
              c.micro_batch_size, ") to a positive value");
  SLIME_CHECK(c.max_tokens_per_gpu >= 0 && c.micro_batch_size >= 0,
              "PackConfig: max_tokens_per_gpu and micro_batch_size must not be negative");
  SLIME_CHECK(c.max_tokens_per_gpu <= std::numeric_limits<int32_t>::max(), "PackConfig: max_tokens_per_gpu ",
              c.max_tokens_per_gpu, " does not fit the int32 cu_seqlens");
  SLIME_CHECK(c.pad_sequence_to >= 1, "PackConfig: pad_sequence_to must be >= 1, got ", c.pad_sequence_to);
  SLIME_CHECK(c.pad_micro_batch_to >= 1, "PackConfig: pad_micro_batch_to must be >= 1, got ", c.pad_micro_batch_to);
  if (c.max_tokens_per_gpu > 0)
    SLIME_CHECK(c.max_tokens_per_gpu >= c.pad_micro_batch_to, "PackConfig: max_tokens_per_gpu ", c.max_tokens_per_gpu,
                " is below pad_micro_batch_to ", c.pad_micro_batch_to);
}

// The largest unpadded micro-batch total whose padded total fits the budget:
// round_up(t, m) <= B  <=>  t <= floor(B / m) * m.
inline int64_t effective_budget(const PackConfig& c) {
  return c.max_tokens_per_gpu / c.pad_micro_batch_to * c.pad_micro_batch_to;
}

// Whether any sample has image patches (empty: none); checks them.
inline bool check_image_patches(std::span<const int64_t> lengths, std::span<const int64_t> image_patches) {
  SLIME_CHECK(image_patches.empty() || image_patches.size() == lengths.size(), "Packer: ", image_patches.size(),
              " image patch counts for ", lengths.size(), " samples");
  bool any = false;
  for (std::size_t i = 0; i < image_patches.size(); ++i) {
    SLIME_CHECK(image_patches[i] >= 0, "Packer: sample ", i, " has ", image_patches[i],
                " image patches; expected >= 0");
    SLIME_CHECK(image_patches[i] <= std::numeric_limits<int32_t>::max(), "Packer: sample ", i, " has ",
                image_patches[i], " image patches, more than int32 hold");
    any = any || image_patches[i] > 0;
  }
  return any;
}

// The capacity the partitioners pack costs into. Text only: the largest
// unpadded total whose padded total fits (effective_budget). With images,
// cost = padded tokens + patches and the micro-batch's token padding (at most
// pad_micro_batch_to - 1) is reserved; see "Images" at the top.
inline int64_t cost_capacity(const PackConfig& c, bool images) {
  return images ? c.max_tokens_per_gpu - (c.pad_micro_batch_to - 1) : effective_budget(c);
}

// Lengths after per-sequence padding; checks each sample (positive length,
// within the budget) and names the offender.
inline std::vector<int64_t> padded_lengths(const PackConfig& c, std::span<const int64_t> lengths) {
  SLIME_CHECK(lengths.size() < std::size_t(std::numeric_limits<int32_t>::max()), "Packer: ", lengths.size(),
              " samples; at most 2^31 - 2 are supported");
  const int64_t budget = c.max_tokens_per_gpu > 0 ? effective_budget(c) : 0;
  std::vector<int64_t> out(lengths.size());
  for (std::size_t i = 0; i < lengths.size(); ++i) {
    const int64_t len = lengths[i];
    SLIME_CHECK(len > 0, "Packer: sample ", i, " has length ", len, "; every sample needs at least one token");
    SLIME_CHECK(len <= std::numeric_limits<int32_t>::max(), "Packer: sample ", i, " has length ", len,
                ", more than int32 cu_seqlens hold");
    out[i] = round_up(len, c.pad_sequence_to);
    if (budget > 0 && out[i] > budget) {
      if (out[i] != len || budget != c.max_tokens_per_gpu) {
        SLIME_FAIL("Packer: sample ", i, " has ", len, " tokens (", out[i],
                   " with its padding to a multiple of pad_sequence_to = ", c.pad_sequence_to,
                   "), more than max_tokens_per_gpu = ", c.max_tokens_per_gpu, " allows (", budget,
                   " after rounding down to a multiple of pad_micro_batch_to = ", c.pad_micro_batch_to, ")");
      }
      SLIME_FAIL("Packer: sample ", i, " has ", len, " tokens, more than max_tokens_per_gpu = ", c.max_tokens_per_gpu,
                 "; raise the budget or drop the sample");
    }
  }
  return out;
}

// Costs (padded length + image patches) with images; checks that each sample
// alone fits the budget: round_up(padded, pad_micro_batch_to) + patches <=
// max_tokens_per_gpu, and its cost within the reserved capacity.
inline std::vector<int64_t> image_costs(const PackConfig& c, std::span<const int64_t> lengths,
                                        std::span<const int64_t> padded, std::span<const int64_t> image_patches) {
  std::vector<int64_t> out(padded.size());
  const int64_t capacity = c.max_tokens_per_gpu > 0 ? cost_capacity(c, true) : 0;
  for (std::size_t i = 0; i < padded.size(); ++i) {
    out[i] = padded[i] + image_patches[i];
    if (capacity == 0) continue;
    const int64_t alone = round_up(padded[i], c.pad_micro_batch_to) + image_patches[i];
    SLIME_CHECK(alone <= c.max_tokens_per_gpu, "Packer: sample ", i, " has ", lengths[i], " tokens (", padded[i],
                " padded) and ", image_patches[i], " image patches, ", alone,
                " together, more than max_tokens_per_gpu = ", c.max_tokens_per_gpu,
                "; raise the budget, shrink the images (max_pixels) or drop the sample");
    SLIME_CHECK(out[i] <= capacity, "Packer: sample ", i, " has ", lengths[i], " tokens (", padded[i], " padded) and ",
                image_patches[i], " image patches, ", out[i], " together, more than the ", capacity,
                " that max_tokens_per_gpu = ", c.max_tokens_per_gpu, " leaves with images after reserving ",
                c.pad_micro_batch_to - 1, " tokens for the padding to pad_micro_batch_to = ", c.pad_micro_batch_to);
  }
  return out;
}

// One rank's costs (padded lengths, plus image patches with images), their
// descending order (computed once for every algorithm below) and, in budget
// mode, their first-fit packing.
struct RankLengths {
  std::span<const int64_t> cost;
  int64_t capacity = 0;  // budget mode only
  std::vector<int32_t> order;
  Partition ffd;  // budget mode only

  RankLengths(const PackConfig& c, std::span<const int64_t> w, bool images = false)
      : cost(w), order(order_by_weight_desc(w)) {
    if (c.max_tokens_per_gpu > 0) {
      capacity = cost_capacity(c, images);
      ffd = detail::ffd(cost, order, capacity);
    }
  }

  // The fewest micro-batches these samples need.
  int count(const PackConfig& c) const {
    if (cost.empty()) return 0;
    if (c.micro_batch_size > 0) return int((int64_t(cost.size()) + c.micro_batch_size - 1) / c.micro_batch_size);
    return ffd.size();
  }
};

// `count` micro-batches over one rank's costs; indices are positions in
// r.cost. See step 3 at the top of the file.
inline Partition balance_micro_batches(const PackConfig& c, const RankLengths& r, int count, BalanceMethod& method) {
  method = BalanceMethod::karmarkar_karp;
  SLIME_CHECK(count >= r.count(c), "Packer: ", count, " micro-batches requested, but the ", r.cost.size(),
              " samples need ", r.count(c), "; agree on the largest local_micro_batch_count");
  if (c.micro_batch_size > 0) return kk(r.cost, r.order, count, /*equal_size=*/true);
  const int64_t budget = r.capacity;
  Partition balanced = kk(r.cost, r.order, count, /*equal_size=*/false);
  if (balanced.max_sum() <= budget) return balanced;
  if (auto by_lpt = lpt(r.cost, r.order, count, budget)) {
    method = BalanceMethod::lpt_with_capacity;
    return std::move(*by_lpt);
  }
  method = BalanceMethod::first_fit;
  Partition packed = r.ffd;
  packed.parts.resize(std::size_t(count));
  packed.sums.resize(std::size_t(count), 0);
  return packed;
}

// Micro-batch plans from a partition: indices mapped through `ids`, ordered
// largest cost first (ties: lowest first sample; empty ones last).
// image_patches: empty, or per local index.
inline std::vector<MicroBatchPlan> to_micro_batches(const PackConfig& c, const Partition& p,
                                                    std::span<const int32_t> ids, std::span<const int64_t> lengths,
                                                    std::span<const int64_t> padded,
                                                    std::span<const int64_t> image_patches = {}) {
  std::vector<MicroBatchPlan> out(p.parts.size());
  for (std::size_t b = 0; b < p.parts.size(); ++b) {
    int64_t padded_sum = 0;
    for (int32_t local : p.parts[b]) {
      out[b].samples.push_back(ids.empty() ? local : ids[std::size_t(local)]);
      out[b].tokens += lengths[std::size_t(local)];
      padded_sum += padded[std::size_t(local)];
      if (!image_patches.empty()) out[b].image_patches += image_patches[std::size_t(local)];
    }
    std::sort(out[b].samples.begin(), out[b].samples.end());
    out[b].padded_tokens = round_up(padded_sum, c.pad_micro_batch_to);
  }
  std::sort(out.begin(), out.end(), [](const MicroBatchPlan& a, const MicroBatchPlan& b) {
    if (a.cost() != b.cost()) return a.cost() > b.cost();
    if (a.samples.empty() || b.samples.empty()) return !a.samples.empty() && b.samples.empty();
    return a.samples.front() < b.samples.front();
  });
  return out;
}

// Samples of each step (global indices, ascending within a step).
inline std::vector<std::vector<int32_t>> split_steps(const PackConfig& c, int32_t n,
                                                     std::span<const int64_t> group_index) {
  std::vector<std::vector<int32_t>> steps(static_cast<std::size_t>(c.num_steps));
  auto target = [&](int s) { return int64_t(n) * (s + 1) / c.num_steps; };  // cumulative end of step s
  if (!c.keep_groups_in_step || group_index.empty() || c.num_steps == 1) {
    int s = 0;
    for (int32_t i = 0; i < n; ++i) {
      while (i >= target(s)) ++s;
      steps[std::size_t(s)].push_back(i);
    }
    return steps;
  }
  // Groups in order of first appearance; a sample without a group (-1) is a
  // group of its own.
  std::vector<std::vector<int32_t>> groups;
  std::unordered_map<int64_t, std::size_t> slot;
  for (int32_t i = 0; i < n; ++i) {
    const int64_t g = group_index[std::size_t(i)];
    SLIME_CHECK(g >= -1, "Packer: sample ", i, " has group_index ", g, " (expected >= 0, or -1 for none)");
    if (g == -1) {
      groups.push_back({i});
      continue;
    }
    auto [it, inserted] = slot.try_emplace(g, groups.size());
    if (inserted) groups.emplace_back();
    groups[it->second].push_back(i);
  }
  int s = 0;
  int64_t taken = 0;
  for (const auto& g : groups) {
    steps[std::size_t(s)].insert(steps[std::size_t(s)].end(), g.begin(), g.end());
    taken += int64_t(g.size());
    if (taken >= target(s) && s + 1 < c.num_steps) ++s;
  }
  for (auto& step : steps) std::sort(step.begin(), step.end());
  return steps;
}

}  // namespace detail

// The plan for one global batch: lengths[i] = tokens of sample i (prompt +
// response); group_index empty or one per sample (-1: no group);
// image_patches empty or one per sample (vision-tower rows of its images, see
// "Images" at the top). Throws on a length <= 0, a negative patch count, a
// sample over the budget, or a step with fewer samples than dp_size.
inline PackPlan plan(const PackConfig& config, std::span<const int64_t> lengths,
                     std::span<const int64_t> group_index = {}, std::span<const int64_t> image_patches = {}) {
  detail::check_config(config);
  SLIME_CHECK(group_index.empty() || group_index.size() == lengths.size(), "Packer: ", group_index.size(),
              " group indices for ", lengths.size(), " samples");
  const bool images = detail::check_image_patches(lengths, image_patches);
  const std::vector<int64_t> padded = detail::padded_lengths(config, lengths);
  const std::vector<int64_t> image_cost =
      images ? detail::image_costs(config, lengths, padded, image_patches) : std::vector<int64_t>{};
  const std::span<const int64_t> cost =
      images ? std::span<const int64_t>(image_cost) : std::span<const int64_t>(padded);
  PackPlan result;
  result.config = config;
  const int k = config.dp_size;
  for (std::vector<int32_t>& step_samples : detail::split_steps(config, int32_t(lengths.size()), group_index)) {
    const int s = int(result.steps.size());
    SLIME_CHECK(int64_t(step_samples.size()) >= k, "Packer: step ", s, " has ", step_samples.size(),
                " samples, fewer than dp_size = ", k, (config.num_steps > 1 ? " (see num_steps and groups)" : ""));
    StepPlan step;
    step.samples = std::move(step_samples);
    step.ranks.resize(std::size_t(k));
    // Ranks: balanced parts of the step's samples.
    if (config.balance_dp) {
      std::vector<int64_t> w(step.samples.size());
      for (std::size_t j = 0; j < w.size(); ++j) w[j] = cost[std::size_t(step.samples[j])];
      const Partition parts = karmarkar_karp(w, k, /*equal_size=*/config.micro_batch_size > 0);
      for (int r = 0; r < k; ++r)
        for (int32_t j : parts.parts[std::size_t(r)])
          step.ranks[std::size_t(r)].samples.push_back(step.samples[std::size_t(j)]);
    } else {
      const std::size_t m = step.samples.size();
      for (int r = 0; r < k; ++r)
        step.ranks[std::size_t(r)].samples.assign(step.samples.begin() + std::ptrdiff_t(m * std::size_t(r) / k),
                                                  step.samples.begin() + std::ptrdiff_t(m * std::size_t(r + 1) / k));
    }
    // Micro-batches: count agreed over the step's ranks, then balanced.
    // With images, rank_cost and rank_patches are filled too; without, the
    // cost is the padded length.
    std::vector<std::vector<int64_t>> rank_padded(static_cast<std::size_t>(k)),
        rank_lengths(static_cast<std::size_t>(k)), rank_cost(static_cast<std::size_t>(k)),
        rank_patches(static_cast<std::size_t>(k));
    std::vector<detail::RankLengths> rank_info;
    rank_info.reserve(std::size_t(k));
    for (int r = 0; r < k; ++r) {
      RankPlan& rank = step.ranks[std::size_t(r)];
      for (int32_t i : rank.samples) {
        rank_padded[std::size_t(r)].push_back(padded[std::size_t(i)]);
        rank_lengths[std::size_t(r)].push_back(lengths[std::size_t(i)]);
        rank.tokens += lengths[std::size_t(i)];
        if (images) {
          rank_cost[std::size_t(r)].push_back(cost[std::size_t(i)]);
          rank_patches[std::size_t(r)].push_back(image_patches[std::size_t(i)]);
          rank.image_patches += image_patches[std::size_t(i)];
        }
      }
      rank_info.emplace_back(config, images ? rank_cost[std::size_t(r)] : rank_padded[std::size_t(r)], images);
      step.micro_batches_per_rank = std::max(step.micro_batches_per_rank, rank_info.back().count(config));
    }
    for (int r = 0; r < k; ++r) {
      RankPlan& rank = step.ranks[std::size_t(r)];
      const Partition p =
          detail::balance_micro_batches(config, rank_info[std::size_t(r)], step.micro_batches_per_rank, rank.method);
      rank.micro_batches = detail::to_micro_batches(config, p, rank.samples, rank_lengths[std::size_t(r)],
                                                    rank_padded[std::size_t(r)], rank_patches[std::size_t(r)]);
    }
    result.steps.push_back(std::move(step));
  }

  PackStats& st = result.stats;
  st.samples = int64_t(lengths.size());
  for (const StepPlan& step : result.steps) {
    for (const RankPlan& rank : step.ranks) {
      st.lpt_fallbacks += rank.method == BalanceMethod::lpt_with_capacity;
      st.first_fit_fallbacks += rank.method == BalanceMethod::first_fit;
      for (const MicroBatchPlan& mb : rank.micro_batches) {
        ++st.micro_batches;
        st.empty_micro_batches += mb.samples.empty();
        st.real_tokens += mb.tokens;
        st.padded_tokens += mb.padded_tokens;
        st.max_micro_batch_tokens = std::max(st.max_micro_batch_tokens, mb.padded_tokens);
        st.image_patches += mb.image_patches;
        st.max_micro_batch_cost = std::max(st.max_micro_batch_cost, mb.cost());
        int64_t longest = 0;
        for (int32_t i : mb.samples) longest = std::max(longest, lengths[std::size_t(i)]);
        st.pad_to_longest_tokens += longest * int64_t(mb.samples.size());
      }
    }
  }
  st.padding_tokens = st.padded_tokens - st.real_tokens;
  st.padding_fraction = st.padded_tokens ? double(st.padding_tokens) / double(st.padded_tokens) : 0.0;
  st.pad_to_longest_fraction =
      st.pad_to_longest_tokens ? double(st.pad_to_longest_tokens - st.real_tokens) / double(st.pad_to_longest_tokens)
                               : 0.0;
  return result;
}

// plan() over samples: their lengths, group indices and image patches.
inline PackPlan plan(const PackConfig& config, std::span<const Sample> samples) {
  std::vector<int64_t> lengths(samples.size()), groups(samples.size()), patches(samples.size());
  for (std::size_t i = 0; i < samples.size(); ++i) {
    lengths[i] = samples[i].length();
    groups[i] = samples[i].group_index;
    patches[i] = samples[i].image_patches;
  }
  return plan(config, lengths, groups, patches);
}

// ---- per-rank path (each rank knows only its own samples) -------------------

// The fewest micro-batches this rank's samples need (first-fit decreasing
// under the budget, or ceil(n / micro_batch_size)). Agree on the maximum over
// ranks (agree_micro_batch_count) before split_micro_batches.
// image_patches: empty, or one per sample (see "Images" at the top).
inline int local_micro_batch_count(const PackConfig& config, std::span<const int64_t> lengths,
                                   std::span<const int64_t> image_patches = {}) {
  detail::check_config(config);
  const bool images = detail::check_image_patches(lengths, image_patches);
  const std::vector<int64_t> padded = detail::padded_lengths(config, lengths);
  if (!images) return detail::RankLengths(config, padded).count(config);
  const std::vector<int64_t> cost = detail::image_costs(config, lengths, padded, image_patches);
  return detail::RankLengths(config, cost, true).count(config);
}

// This rank's samples in exactly `count` micro-batches (count >=
// local_micro_batch_count), balanced as plan() does; sample indices are
// positions in `lengths`. image_patches: empty, or one per sample.
inline std::vector<MicroBatchPlan> split_micro_batches(const PackConfig& config, std::span<const int64_t> lengths,
                                                       std::span<const int64_t> image_patches, int count,
                                                       BalanceMethod* method = nullptr) {
  detail::check_config(config);
  SLIME_CHECK(count >= 1, "split_micro_batches: count must be >= 1, got ", count);
  const bool images = detail::check_image_patches(lengths, image_patches);
  const std::vector<int64_t> padded = detail::padded_lengths(config, lengths);
  const std::vector<int64_t> cost =
      images ? detail::image_costs(config, lengths, padded, image_patches) : std::vector<int64_t>{};
  BalanceMethod m;
  const Partition p = detail::balance_micro_batches(
      config, detail::RankLengths(config, images ? std::span<const int64_t>(cost) : padded, images), count, m);
  if (method != nullptr) *method = m;
  return detail::to_micro_batches(config, p, {}, lengths, padded, images ? image_patches : std::span<const int64_t>{});
}
inline std::vector<MicroBatchPlan> split_micro_batches(const PackConfig& config, std::span<const int64_t> lengths,
                                                       int count, BalanceMethod* method = nullptr) {
  return split_micro_batches(config, lengths, {}, count, method);
}

// ---- packing ----------------------------------------------------------------

// A micro-batch's tensors (see MicroBatch for each one's meaning).
struct MicroBatchTensors {
  Tensor tokens;        // [T] i32
  Tensor positions;     // [T] i32
  Tensor loss_mask;     // [T] u8
  Tensor cu_seqlens;    // [S + 1] i32
  Tensor sample_index;  // [S] i32
  int32_t max_seqlen = 0;
};

// One packed micro-batch: S sequences, T tokens, no padding dimension.
// Sequence q occupies tokens [cu_seqlens[q], cu_seqlens[q + 1]): its sample's
// tokens (lengths[q] of them), then its alignment padding. A trailing padding
// sequence (sample_index -1) fills the micro-batch to pad_micro_batch_to.
// Padding tokens are pad_token_id with loss mask 0.
struct MicroBatch {
  std::vector<int32_t> tokens;            // [T]
  std::vector<int32_t> positions;         // [T], 0, 1, ... within each sequence
  std::vector<uint8_t> loss_mask;         // [T], 0 on prompt and padding, the sample's mask on response tokens
  std::vector<int32_t> cu_seqlens;        // [S + 1], cu_seqlens[0] = 0, cu_seqlens[S] = T
  std::vector<int32_t> sample_index;      // [S], the sample each sequence holds; -1: padding
  std::vector<int32_t> lengths;           // [S], real tokens of each sequence (0 for padding)
  std::vector<int32_t> response_lengths;  // [S]
  int32_t max_seqlen = 0;                 // longest cu_seqlens segment
  int64_t padding_tokens = 0;
  int64_t image_patches = 0;  // the samples' Sample::image_patches, summed (not in the tensors)

  int64_t num_tokens() const { return int64_t(tokens.size()); }
  int num_sequences() const { return int(sample_index.size()); }

  MicroBatchTensors to_tensors(Device device = Device::cpu(), const Stream& stream = {}) const {
    const int64_t t = num_tokens(), s = num_sequences();
    return {Tensor::from_vector(tokens, Shape{t}, device, stream),
            Tensor::from_vector(positions, Shape{t}, device, stream),
            Tensor::from_vector(loss_mask, Shape{t}, device, stream),
            Tensor::from_vector(cu_seqlens, Shape{s + 1}, device, stream),
            Tensor::from_vector(sample_index, Shape{s}, device, stream),
            max_seqlen};
  }
};

// Packs the planned samples (indices into `samples`) with the config's
// alignment. The samples' lengths must be those the plan was made from.
inline MicroBatch pack_micro_batch(const PackConfig& config, const MicroBatchPlan& mb,
                                   std::span<const Sample> samples) {
  SLIME_CHECK(config.pad_sequence_to >= 1 && config.pad_micro_batch_to >= 1,
              "pack_micro_batch: pad_sequence_to and pad_micro_batch_to must be >= 1");
  MicroBatch out;
  int64_t total = 0;
  for (int32_t i : mb.samples) {
    SLIME_CHECK(i >= 0 && std::size_t(i) < samples.size(), "pack_micro_batch: sample index ", i, " out of range for ",
                samples.size(), " samples");
    const Sample& s = samples[std::size_t(i)];
    SLIME_CHECK(s.image_patches >= 0, "pack_micro_batch: sample ", i, " has ", s.image_patches, " image patches");
    total += detail::round_up(s.length(), config.pad_sequence_to);
    out.image_patches += s.image_patches;
  }
  const int64_t padded_total = detail::round_up(total, config.pad_micro_batch_to);
  SLIME_CHECK(padded_total <= std::numeric_limits<int32_t>::max(), "pack_micro_batch: ", padded_total,
              " tokens do not fit int32 cu_seqlens");
  SLIME_CHECK(mb.padded_tokens == 0 || mb.padded_tokens == padded_total, "pack_micro_batch: the samples pack to ",
              padded_total, " tokens but the plan expects ", mb.padded_tokens,
              "; their lengths differ from those the plan was made from");
  SLIME_CHECK(mb.padded_tokens == 0 || mb.image_patches == out.image_patches, "pack_micro_batch: the samples have ",
              out.image_patches, " image patches but the plan counted ", mb.image_patches,
              "; make the plan from these samples (Sample::image_patches) or their image_patches");
  SLIME_CHECK(config.max_tokens_per_gpu == 0 || padded_total <= config.max_tokens_per_gpu,
              "pack_micro_batch: ", padded_total, " tokens exceed max_tokens_per_gpu = ", config.max_tokens_per_gpu);
  SLIME_CHECK(config.max_tokens_per_gpu == 0 || padded_total + out.image_patches <= config.max_tokens_per_gpu,
              "pack_micro_batch: ", padded_total, " tokens and ", out.image_patches, " image patches (",
              padded_total + out.image_patches, ") exceed max_tokens_per_gpu = ", config.max_tokens_per_gpu);
  out.tokens.reserve(std::size_t(padded_total));
  out.positions.reserve(std::size_t(padded_total));
  out.loss_mask.reserve(std::size_t(padded_total));
  out.cu_seqlens.reserve(mb.samples.size() + 2);
  out.cu_seqlens.push_back(0);
  auto add_padding = [&](int64_t count, int32_t start_position) {
    out.tokens.insert(out.tokens.end(), std::size_t(count), config.pad_token_id);
    for (int64_t p = 0; p < count; ++p) out.positions.push_back(start_position + int32_t(p));
    out.loss_mask.insert(out.loss_mask.end(), std::size_t(count), 0);
  };
  for (int32_t i : mb.samples) {
    const Sample& s = samples[std::size_t(i)];
    const int32_t len = int32_t(s.length());
    SLIME_CHECK(len > 0, "pack_micro_batch: sample ", i, " has no tokens");
    SLIME_CHECK(s.response_length >= 0 && s.response_length <= len && int64_t(s.loss_mask.size()) == s.response_length,
                "pack_micro_batch: sample ", i, " has response_length ", s.response_length, " and ", s.loss_mask.size(),
                " loss-mask entries for ", len, " tokens");
    const int32_t seq = int32_t(detail::round_up(len, config.pad_sequence_to));
    out.tokens.insert(out.tokens.end(), s.tokens.begin(), s.tokens.end());
    for (int32_t p = 0; p < len; ++p) out.positions.push_back(p);
    out.loss_mask.insert(out.loss_mask.end(), std::size_t(len - s.response_length), 0);
    out.loss_mask.insert(out.loss_mask.end(), s.loss_mask.begin(), s.loss_mask.end());
    add_padding(seq - len, len);
    out.cu_seqlens.push_back(int32_t(out.tokens.size()));
    out.sample_index.push_back(i);
    out.lengths.push_back(len);
    out.response_lengths.push_back(s.response_length);
    out.max_seqlen = std::max(out.max_seqlen, seq);
    out.padding_tokens += seq - len;
  }
  if (padded_total > total) {
    const int32_t tail = int32_t(padded_total - total);
    add_padding(tail, 0);
    out.cu_seqlens.push_back(int32_t(out.tokens.size()));
    out.sample_index.push_back(-1);
    out.lengths.push_back(0);
    out.response_lengths.push_back(0);
    out.max_seqlen = std::max(out.max_seqlen, tail);
    out.padding_tokens += tail;
  }
  return out;
}

// Which tokens of each sample unpack() hands back.
enum class UnpackPart : uint8_t { all, response };

// Splits per-token values of a packed micro-batch ([T], e.g. logprobs or
// entropies) back to their samples: per_sample[sample_index[q]] = the values of
// sequence q's real tokens (all of them, or the last response_length). Padding
// is dropped. per_sample must have room for every sample index.
template <class T>
void unpack(const MicroBatch& mb, std::span<const T> per_token, std::vector<std::vector<T>>& per_sample,
            UnpackPart part = UnpackPart::all) {
  SLIME_CHECK(int64_t(per_token.size()) == mb.num_tokens(), "unpack: ", per_token.size(),
              " per-token values for a micro-batch of ", mb.num_tokens(), " tokens");
  for (int q = 0; q < mb.num_sequences(); ++q) {
    const int32_t i = mb.sample_index[std::size_t(q)];
    if (i < 0) continue;
    SLIME_CHECK(std::size_t(i) < per_sample.size(), "unpack: sample index ", i, " out of range for ", per_sample.size(),
                " outputs");
    const int32_t begin = mb.cu_seqlens[std::size_t(q)], len = mb.lengths[std::size_t(q)];
    const int32_t skip = part == UnpackPart::all ? 0 : len - mb.response_lengths[std::size_t(q)];
    per_sample[std::size_t(i)].assign(per_token.begin() + begin + skip, per_token.begin() + begin + len);
  }
}

// plan() and pack_micro_batch() bound to one configuration.
class Packer {
 public:
  explicit Packer(PackConfig config) : config_(config) { detail::check_config(config_); }

  const PackConfig& config() const { return config_; }
  PackPlan plan(std::span<const int64_t> lengths, std::span<const int64_t> group_index = {},
                std::span<const int64_t> image_patches = {}) const {
    return data::plan(config_, lengths, group_index, image_patches);
  }
  PackPlan plan(std::span<const Sample> samples) const { return data::plan(config_, samples); }
  MicroBatch pack(const MicroBatchPlan& mb, std::span<const Sample> samples) const {
    return pack_micro_batch(config_, mb, samples);
  }
  // Every micro-batch of one rank in one step, in the plan's order.
  std::vector<MicroBatch> pack_rank(const PackPlan& p, int step, int dp_rank, std::span<const Sample> samples) const {
    SLIME_CHECK(step >= 0 && step < int(p.steps.size()), "Packer::pack_rank: step ", step, " out of range for ",
                p.steps.size(), " steps");
    SLIME_CHECK(dp_rank >= 0 && dp_rank < int(p.steps[std::size_t(step)].ranks.size()), "Packer::pack_rank: rank ",
                dp_rank, " out of range for dp_size ", p.steps[std::size_t(step)].ranks.size());
    std::vector<MicroBatch> out;
    for (const MicroBatchPlan& mb : p.steps[std::size_t(step)].ranks[std::size_t(dp_rank)].micro_batches)
      out.push_back(pack_micro_batch(config_, mb, samples));
    return out;
  }

 private:
  PackConfig config_;
};

}  // namespace slime::data
