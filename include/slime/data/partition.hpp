// slime/data/partition.hpp: balanced k-way partitioning of weighted items
// (Karmarkar–Karp largest differencing, greedy LPT, LPT under a capacity) and
// bin packing by first-fit decreasing: the algorithms data::Packer is built on.
//
// Every function here is deterministic: items are ordered by (weight
// descending, index ascending) and every tie is broken by index, so the same
// input gives the same partition on every rank and every run.
//
// Quality of karmarkar_karp (k-way largest differencing method, LDM):
//   - Invariant (checked by the property tests): the final spread
//     max_sum - min_sum <= max weight. Combining two k-tuples A and B by
//     pairing A's largest subset with B's smallest gives a tuple whose spread is
//     at most max(spread A, spread B) (see detail::kk_merge), and a starting
//     tuple's spread is at most its largest weight. Hence also
//     max_sum <= total / k + (k - 1) / k * max weight.
//   - Worst-case ratio (Michiels, Korst, Aarts, van Leeuwen, Spieksma 2003,
//     "Performance ratios for the Karmarkar–Karp differencing method"):
//     max_sum <= (4/3 - 1/(3k)) * OPT, where OPT is the optimal largest part;
//     for k = 2 this is 7/6 (Fischetti and Martello 1987). Checked against a
//     brute-force optimum on small instances.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <queue>
#include <span>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"

namespace slime::data {

// Items split into parts: parts[p] lists item indices in ascending order,
// sums[p] is the total weight of part p.
struct Partition {
  std::vector<std::vector<int32_t>> parts;
  std::vector<int64_t> sums;

  int size() const { return int(parts.size()); }
  int64_t max_sum() const { return sums.empty() ? 0 : *std::max_element(sums.begin(), sums.end()); }
  int64_t min_sum() const { return sums.empty() ? 0 : *std::min_element(sums.begin(), sums.end()); }
  // max_sum - min_sum: the imbalance.
  int64_t spread() const { return max_sum() - min_sum(); }
};

namespace detail {

inline void check_weights(std::span<const int64_t> weights, const char* what) {
  SLIME_CHECK(weights.size() < std::size_t(std::numeric_limits<int32_t>::max()), what, ": ", weights.size(),
              " items; at most 2^31 - 2 are supported");
  for (std::size_t i = 0; i < weights.size(); ++i)
    SLIME_CHECK(weights[i] >= 0, what, ": item ", i, " has negative weight ", weights[i]);
}

// Item indices ordered by (weight descending, index ascending). Weights below
// 2^32 (token counts) sort as 64-bit keys (~weight << 32 | index) by an LSD
// radix sort that skips constant bytes: about 1 ms for 100k items, several
// times faster than a comparison sort through the weights.
inline std::vector<int32_t> order_by_weight_desc(std::span<const int64_t> weights) {
  const std::size_t n = weights.size();
  std::vector<int32_t> order(n);
  const bool small = std::all_of(weights.begin(), weights.end(), [](int64_t w) { return w < (int64_t(1) << 32); });
  if (!small || n < 256) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      return weights[std::size_t(a)] != weights[std::size_t(b)] ? weights[std::size_t(a)] > weights[std::size_t(b)]
                                                                : a < b;
    });
    return order;
  }
  std::vector<uint64_t> keys(n), swap(n);
  for (std::size_t i = 0; i < n; ++i) keys[i] = (uint64_t(0xffffffffu - uint32_t(weights[i])) << 32) | uint64_t(i);
  std::size_t counts[256];
  for (int shift = 0; shift < 64; shift += 8) {
    std::fill(std::begin(counts), std::end(counts), std::size_t(0));
    for (uint64_t key : keys) ++counts[(key >> shift) & 0xff];
    if (counts[(keys[0] >> shift) & 0xff] == n) continue;  // every key has this byte
    std::size_t offset = 0;
    for (std::size_t& c : counts) offset += std::exchange(c, offset);
    for (uint64_t key : keys) swap[counts[(key >> shift) & 0xff]++] = key;
    keys.swap(swap);
  }
  for (std::size_t i = 0; i < n; ++i) order[i] = int32_t(uint32_t(keys[i]));
  return order;
}

// parts[p] = the items whose part_of is p, ascending: a linear pass instead of
// sorting every part.
inline void collect_parts(std::span<const int32_t> part_of, Partition& result) {
  for (std::size_t i = 0; i < part_of.size(); ++i)
    if (part_of[i] >= 0) result.parts[std::size_t(part_of[i])].push_back(int32_t(i));
}

// One subset of a k-tuple during differencing: its items form a singly linked
// list head -> ... -> tail through the `next` array of karmarkar_karp.
struct KkSubset {
  int64_t sum;
  int32_t head, tail;
};

// Subsets of a tuple are kept in descending order of (sum, then -head); heads
// are unique (subsets are disjoint and never empty), so the order is total.
// A function object rather than a function, so the heap and sort calls inline it.
struct KkBefore {
  bool operator()(const KkSubset& a, const KkSubset& b) const {
    return a.sum != b.sum ? a.sum > b.sum : a.head < b.head;
  }
};
inline constexpr KkBefore kk_before{};

// The non-empty subsets of one k-tuple: a binary heap whose top is the last
// subset in kk_before order (the smallest), with the first (the largest) kept
// aside. Merges only take subsets from the small end (KkState::merge) and add
// new ones anywhere, so each subset moved costs O(log k). A sorted array costs
// O(k) per insertion into its middle instead, which is what a single item
// joining a full tuple does: with 100k rollouts over 7,134 micro-batches
// (one rank, 32k-token budget), ~95k such merges made karmarkar_karp take
// 58 ms that way, and 11 ms as a heap (plan() 86 -> 40 ms on one core).
//
// A tuple rebuilt whole (every subset joined, as in equal-size runs) is stored
// sorted, smallest first, which is also a valid heap; `ascending_` records it
// so that reading the tuple in order later costs a copy, not a sort.
class KkTuple {
 public:
  uint32_t size() const { return uint32_t(heap_.size()); }
  const KkSubset& largest() const { return largest_; }
  const KkSubset& smallest() const { return heap_.front(); }

  void clear() {
    heap_.clear();
    ascending_ = true;
  }
  void push(const KkSubset& s) {
    const bool new_largest = heap_.empty() || kk_before(s, largest_);
    if (new_largest) largest_ = s;
    heap_.push_back(s);  // a new largest extends the sorted order and stays put in the heap
    std::push_heap(heap_.begin(), heap_.end(), kk_before);
    ascending_ = ascending_ && new_largest;
  }
  // Replaces the contents by `sorted` (in kk_before order, non-empty).
  void assign_sorted(std::span<const KkSubset> sorted) {
    heap_.assign(sorted.rbegin(), sorted.rend());
    largest_ = sorted.front();
    ascending_ = true;
  }
  // Removes and returns the smallest subset. The largest stays valid while
  // another subset is left (heads are unique, so the two differ).
  KkSubset pop_smallest() {
    std::pop_heap(heap_.begin(), heap_.end(), kk_before);
    const KkSubset s = heap_.back();
    heap_.pop_back();
    ascending_ = heap_.size() <= 1;
    return s;
  }
  // The subsets into `out`, the last `tail` of them in kk_before order and
  // after all others, which are in any order (KkState::merge only pairs B's
  // smallest subsets; ordering the rest would be wasted).
  void ordered_tail(std::vector<KkSubset>& out, uint32_t tail) const {
    if (ascending_) {
      out.assign(heap_.rbegin(), heap_.rend());
      return;
    }
    out.assign(heap_.begin(), heap_.end());
    if (tail == 0) return;
    const auto first = out.end() - std::ptrdiff_t(std::min<std::size_t>(tail, out.size()));
    if (first != out.begin()) std::nth_element(out.begin(), first, out.end(), kk_before);
    std::sort(first, out.end(), kk_before);
  }
  // The subsets in kk_before order, into `out`.
  void sorted(std::vector<KkSubset>& out) const { ordered_tail(out, size()); }

 private:
  std::vector<KkSubset> heap_;
  KkSubset largest_{};
  bool ascending_ = true;
};

// The state of one karmarkar_karp run.
struct KkState {
  int k;
  std::vector<int32_t> next;  // item linked lists; -1 ends a list
  std::vector<KkSubset> scratch, tmp;

  KkSubset join(KkSubset a, const KkSubset& b) {
    next[std::size_t(a.tail)] = b.head;
    a.tail = b.tail;
    a.sum += b.sum;
    return a;
  }

  // A := A combined with B, the LDM step. b: B's m_B entries; those paired
  // with A's (the last m_A + m_B - k, if any) in kk_before order and after
  // the others, which may be in any order (KkTuple::ordered_tail).
  // With missing entries standing for empty subsets (sum 0), the dense result
  // is c_i = a_i + b_{k-1-i}: A's largest subsets take B's smallest. Then
  // c_i - c_j <= a_i - a_j <= spread A for i < j, and
  // c_j - c_i <= b_{k-1-j} - b_{k-1-i} <= spread B, so the spread never grows
  // beyond the larger of the two.
  //
  // Sparse form: A's entries i >= k - m_B (its tail, taken smallest first) are
  // joined with B's entries k-1-i, and B's entries j < k - m_A, which have no
  // partner, move over as they are: m_B new entries in all, added to A's
  // untouched prefix.
  void merge(KkTuple& a, std::span<const KkSubset> b) {
    const int ma = int(a.size()), mb = int(b.size());
    const int prefix = std::min(ma, std::max(0, k - mb));
    scratch.clear();
    if (prefix == 0) {  // all of A is joined: rebuild it sorted
      a.sorted(tmp);
      for (int i = 0; i < ma; ++i) scratch.push_back(join(tmp[std::size_t(i)], b[std::size_t(k - 1 - i)]));
      for (int j = 0; j < std::min(mb, k - ma); ++j) scratch.push_back(b[std::size_t(j)]);
      std::sort(scratch.begin(), scratch.end(), kk_before);
      a.assign_sorted(scratch);
      return;
    }
    for (int i = ma - 1; i >= prefix; --i) scratch.push_back(join(a.pop_smallest(), b[std::size_t(k - 1 - i)]));
    for (int j = 0; j < std::min(mb, k - ma); ++j) a.push(b[std::size_t(j)]);
    for (const KkSubset& s : scratch) a.push(s);
  }

  int64_t spread(const KkTuple& t) const {
    return int(t.size()) < k ? t.largest().sum : t.largest().sum - t.smallest().sum;
  }
};

// karmarkar_karp over a precomputed order (order_by_weight_desc).
inline Partition kk(std::span<const int64_t> weights, std::span<const int32_t> order, int k, bool equal_size) {
  const int32_t n = int32_t(weights.size());
  Partition result;
  result.parts.resize(std::size_t(k));
  result.sums.assign(std::size_t(k), 0);
  if (n == 0) return result;
  const int32_t n_pad = equal_size ? int32_t((int64_t(n) + k - 1) / k * k) : n;
  detail::KkState state{k, std::vector<int32_t>(std::size_t(n_pad), -1), {}, {}};
  // The subset of the item at rank r of the order; ranks >= n are fillers.
  auto single = [&](int32_t r) -> detail::KkSubset {
    const int32_t idx = r < n ? order[std::size_t(r)] : r;
    return {r < n ? weights[std::size_t(idx)] : 0, idx, idx};
  };

  std::vector<detail::KkTuple> rings;  // combined tuples; slots reused
  std::vector<int32_t> free_slots;
  auto new_slot = [&]() -> int32_t {
    if (!free_slots.empty()) {
      const int32_t s = free_slots.back();
      free_slots.pop_back();
      rings[std::size_t(s)].clear();
      return s;
    }
    rings.emplace_back();
    return int32_t(rings.size() - 1);
  };
  struct Entry {
    int64_t spread, id;
    int32_t slot;
  };
  // Largest spread first; ties: the smaller id (the older tuple) first.
  auto after = [](const Entry& a, const Entry& b) { return a.spread != b.spread ? a.spread < b.spread : a.id > b.id; };
  std::vector<Entry> heap;
  auto push = [&](int64_t id, int32_t slot) {
    heap.push_back({state.spread(rings[std::size_t(slot)]), id, slot});
    std::push_heap(heap.begin(), heap.end(), after);
  };

  // Uncombined items are ranks [next_single, n) of the order (id = rank,
  // spread = weight); with equal_size every item starts in a k-item tuple.
  int32_t next_single = 0;
  if (equal_size) {
    next_single = n;
    for (int32_t t = 0; t < n_pad / k; ++t) {
      const int32_t slot = new_slot();
      state.scratch.clear();
      for (int j = 0; j < k; ++j) state.scratch.push_back(single(t * k + j));  // already in kk_before order
      rings[std::size_t(slot)].assign_sorted(state.scratch);
      push(t, slot);
    }
  }
  // Pops the next tuple: {-1, rank} for an uncombined item, {slot, -1} else.
  auto pop = [&]() -> std::pair<int32_t, int32_t> {
    if (next_single < n) {
      const Entry s{weights[std::size_t(order[std::size_t(next_single)])], next_single, -1};
      if (heap.empty() || after(heap.front(), s)) return {-1, next_single++};
    }
    std::pop_heap(heap.begin(), heap.end(), after);
    const int32_t slot = heap.back().slot;
    heap.pop_back();
    return {slot, -1};
  };

  int64_t next_id = n_pad;
  std::vector<detail::KkSubset> b;
  while (int64_t(n - next_single) + int64_t(heap.size()) > 1) {
    auto [slot_a, rank_a] = pop();
    auto [slot_b, rank_b] = pop();
    if (slot_a < 0) std::swap(slot_a, slot_b), std::swap(rank_a, rank_b);
    if (slot_a < 0) {  // two items: a new tuple
      slot_a = new_slot();
      rings[std::size_t(slot_a)].push(single(rank_a));
    } else if (slot_b >= 0 && rings[std::size_t(slot_b)].size() > rings[std::size_t(slot_a)].size()) {
      std::swap(slot_a, slot_b);  // merge the smaller tuple into the larger
    }
    b.clear();
    if (slot_b < 0) {
      b.push_back(single(rank_b));
    } else {
      const uint32_t ma = rings[std::size_t(slot_a)].size(), mb = rings[std::size_t(slot_b)].size();
      rings[std::size_t(slot_b)].ordered_tail(b, ma + mb > uint32_t(k) ? ma + mb - uint32_t(k) : 0);
      free_slots.push_back(slot_b);
    }
    state.merge(rings[std::size_t(slot_a)], b);
    push(next_id++, slot_a);
  }

  // One tuple left: a combined one, or a single item (n == 1).
  std::vector<detail::KkSubset> final_tuple;  // largest first: part p = subset p
  if (heap.empty()) {
    final_tuple.push_back(single(0));
  } else {
    rings[std::size_t(heap.front().slot)].sorted(final_tuple);
  }
  std::vector<int32_t> part_of(std::size_t(n), -1);
  for (std::size_t p = 0; p < final_tuple.size(); ++p) {
    const detail::KkSubset& s = final_tuple[p];
    for (int32_t i = s.head; i >= 0; i = state.next[std::size_t(i)])
      if (i < n) part_of[std::size_t(i)] = int32_t(p);
    result.sums[p] = s.sum;
  }
  collect_parts(part_of, result);
  return result;
}

// greedy_lpt over a precomputed order; with capacity > 0, nullopt as soon as
// an item does not fit the least-loaded part.
inline std::optional<Partition> lpt(std::span<const int64_t> weights, std::span<const int32_t> order, int k,
                                    int64_t capacity) {
  Partition result;
  result.parts.resize(std::size_t(k));
  result.sums.assign(std::size_t(k), 0);
  using Load = std::pair<int64_t, int>;  // (sum, part): ties go to the lowest part
  std::vector<Load> heap;
  heap.reserve(std::size_t(k));
  for (int p = 0; p < k; ++p) heap.push_back({0, p});  // already a min-heap
  std::vector<int32_t> part_of(weights.size(), -1);
  for (int32_t i : order) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Load>());
    Load& least = heap.back();
    least.first += weights[std::size_t(i)];
    if (capacity > 0 && least.first > capacity) return std::nullopt;
    part_of[std::size_t(i)] = least.second;
    result.sums[std::size_t(least.second)] = least.first;
    std::push_heap(heap.begin(), heap.end(), std::greater<Load>());
  }
  collect_parts(part_of, result);
  return result;
}

// first_fit_decreasing over a precomputed order.
inline Partition ffd(std::span<const int64_t> weights, std::span<const int32_t> order, int64_t capacity) {
  Partition result;
  const std::size_t n = weights.size();
  if (n == 0) return result;
  std::size_t leaves = 1;
  while (leaves < n) leaves *= 2;
  // free_space[node] = the largest free space among the bins below node;
  // leaves start at `leaves`. Unopened bins have the whole capacity free, so
  // the leftmost bin with room is either open or the next one to open.
  std::vector<int64_t> free_space(2 * leaves, capacity);
  std::vector<int32_t> part_of(n, -1);
  for (int32_t i : order) {
    const int64_t w = weights[std::size_t(i)];
    SLIME_CHECK(w <= capacity, "first_fit_decreasing: item ", i, " of weight ", w, " exceeds the capacity ", capacity);
    std::size_t node = 1;
    while (node < leaves) node = free_space[2 * node] >= w ? 2 * node : 2 * node + 1;
    const std::size_t bin = node - leaves;
    if (bin >= result.sums.size()) result.sums.resize(bin + 1, 0);
    part_of[std::size_t(i)] = int32_t(bin);
    result.sums[bin] += w;
    free_space[node] -= w;
    for (node /= 2; node >= 1; node /= 2) free_space[node] = std::max(free_space[2 * node], free_space[2 * node + 1]);
  }
  result.parts.resize(result.sums.size());
  collect_parts(part_of, result);
  return result;
}

}  // namespace detail

// k-way Karmarkar–Karp (largest differencing method with k-tuples). Every
// item starts as a k-tuple holding it alone (the other subsets empty); the two
// tuples of largest spread (max - min subset sum; ties: the older first) are
// repeatedly combined largest-with-smallest (detail::KkState::merge) until one
// tuple remains: its k subsets are the parts, largest sum first. Items not
// yet combined are taken from the sorted list; only combined tuples go through
// the heap.
//
// equal_size: the parts get n / k items each (n % k == 0), or, when k does not
// divide n, item counts that differ by at most one: the items, padded with
// zero-weight fillers to a multiple of k, start as tuples of k consecutive
// items in descending order, so each part takes exactly one item (or filler)
// from every starting tuple. Needed where every part must hold as many
// samples as the others (fixed micro-batch size).
//
// Cost: O(n log n) for the sort and the heap, plus the entries moved by merges
// (small for a tuple absorbing a small one, O(k) for two full tuples).
inline Partition karmarkar_karp(std::span<const int64_t> weights, int k, bool equal_size = false) {
  SLIME_CHECK(k >= 1, "karmarkar_karp: k must be >= 1, got ", k);
  detail::check_weights(weights, "karmarkar_karp");
  return detail::kk(weights, detail::order_by_weight_desc(weights), k, equal_size);
}

// Greedy LPT (longest processing time first): items in descending order, each
// to the part with the smallest sum (ties: lowest part index). Graham's bound:
// max_sum <= (4/3 - 1/(3k)) * OPT.
inline Partition greedy_lpt(std::span<const int64_t> weights, int k) {
  SLIME_CHECK(k >= 1, "greedy_lpt: k must be >= 1, got ", k);
  detail::check_weights(weights, "greedy_lpt");
  return *detail::lpt(weights, detail::order_by_weight_desc(weights), k, 0);
}

// Greedy LPT that never lets a part exceed `capacity`: the capacity-aware
// balancer used when Karmarkar–Karp's result breaks the token budget. LPT puts
// each item on the least-loaded part, so if the item does not fit there it
// fits nowhere: then there is no LPT solution and the result is nullopt.
inline std::optional<Partition> lpt_with_capacity(std::span<const int64_t> weights, int k, int64_t capacity) {
  SLIME_CHECK(k >= 1, "lpt_with_capacity: k must be >= 1, got ", k);
  SLIME_CHECK(capacity > 0, "lpt_with_capacity: capacity must be positive, got ", capacity);
  detail::check_weights(weights, "lpt_with_capacity");
  return detail::lpt(weights, detail::order_by_weight_desc(weights), k, capacity);
}

// First-fit decreasing bin packing: items in descending order, each into the
// lowest-numbered bin with room left (a tournament tree over the bins' free
// space finds it in O(log n)). Returns the bins in opening order; the number
// of bins is at most 11/9 OPT + 6/9 (Dósa 2007). Every weight must be
// <= capacity.
inline Partition first_fit_decreasing(std::span<const int64_t> weights, int64_t capacity) {
  detail::check_weights(weights, "first_fit_decreasing");
  SLIME_CHECK(capacity > 0, "first_fit_decreasing: capacity must be positive, got ", capacity);
  return detail::ffd(weights, detail::order_by_weight_desc(weights), capacity);
}

}  // namespace slime::data
