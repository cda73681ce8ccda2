// slime/data/shuffle.hpp: deterministic shuffling by (seed, epoch) on slime's
// Philox stream, and DataPosition, the resumable place in an epoch that a
// checkpoint saves.
//
// epoch_permutation(n, seed, epoch) is a Fisher–Yates shuffle whose draws are
// Philox words keyed by a per-epoch key derived from (seed, epoch), so it is
// the same on every machine and every run, and independent across epochs.
// EpochSampler walks epoch after epoch of such permutations; restoring a saved
// DataPosition continues with exactly the indices the original run would have
// produced.
#pragma once

#include <cstdint>
#include <numeric>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/core/random.hpp"

namespace slime::data {

namespace detail {

// The Philox key for one epoch: a Philox block of (epoch, "shuf") under the
// user's seed, so epochs get unrelated streams.
inline uint64_t epoch_key(uint64_t seed, int64_t epoch) {
  const uint64_t e = uint64_t(epoch);
  const PhiloxBlock b =
      philox4x32_10(uint32_t(e), uint32_t(e >> 32), 0x73687566u /* "shuf" */, 0u, uint32_t(seed), uint32_t(seed >> 32));
  return uint64_t(b.v[0]) | (uint64_t(b.v[1]) << 32);
}

// Uniform 64-bit words from a Philox stream, four 32-bit lanes per block.
class PhiloxWords {
 public:
  explicit PhiloxWords(uint64_t key) : key_(key) {}
  uint64_t next64() {
    if (lane_ == 4) {
      block_ =
          philox4x32_10(uint32_t(counter_), uint32_t(counter_ >> 32), 0u, 0u, uint32_t(key_), uint32_t(key_ >> 32));
      ++counter_;
      lane_ = 0;
    }
    const uint64_t w = uint64_t(block_.v[lane_]) | (uint64_t(block_.v[lane_ + 1]) << 32);
    lane_ += 2;
    return w;
  }
  // Uniform in [0, bound), bound > 0, without modulo bias (Lemire's method:
  // multiply-shift, rejecting the few words that would bias the result).
  uint64_t below(uint64_t bound) {
    unsigned __int128 m = (unsigned __int128)next64() * bound;
    uint64_t low = uint64_t(m);
    if (low < bound) {
      const uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = (unsigned __int128)next64() * bound;
        low = uint64_t(m);
      }
    }
    return uint64_t(m >> 64);
  }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
  PhiloxBlock block_{};
  int lane_ = 4;
};

}  // namespace detail

// The order of n items in `epoch`: a permutation of 0..n-1.
inline std::vector<int64_t> epoch_permutation(int64_t n, uint64_t seed, int64_t epoch) {
  SLIME_CHECK(n >= 0, "epoch_permutation: negative size ", n);
  SLIME_CHECK(epoch >= 0, "epoch_permutation: negative epoch ", epoch);
  std::vector<int64_t> order(static_cast<std::size_t>(n));
  std::iota(order.begin(), order.end(), int64_t(0));
  detail::PhiloxWords words(detail::epoch_key(seed, epoch));
  for (int64_t i = n - 1; i > 0; --i)
    std::swap(order[std::size_t(i)], order[std::size_t(words.below(uint64_t(i) + 1))]);
  return order;
}

// Where a run is in its data: the next item is element `index` of epoch
// `epoch`'s order. Saved in checkpoints as {"epoch": e, "index": i}.
struct DataPosition {
  int64_t epoch = 0;
  int64_t index = 0;

  friend bool operator==(const DataPosition&, const DataPosition&) = default;

  nlohmann::json to_json() const { return {{"epoch", epoch}, {"index", index}}; }
  static DataPosition from_json(const nlohmann::json& j) {
    SLIME_CHECK(j.is_object(), "DataPosition: expected a JSON object, got ", json_excerpt(j));
    DataPosition p;
    for (auto [name, field] : {std::pair{"epoch", &p.epoch}, std::pair{"index", &p.index}}) {
      auto it = j.find(name);
      SLIME_CHECK(it != j.end(), "DataPosition: missing field '", name, "' in ", json_excerpt(j));
      SLIME_CHECK(it->is_number_integer() && it->get<int64_t>() >= 0, "DataPosition: field '", name,
                  "' must be a non-negative integer, got ", json_excerpt(*it));
      *field = it->get<int64_t>();
    }
    return p;
  }
};

// nlohmann::json conversions (json j = pos; pos = j.get<DataPosition>()).
inline void to_json(nlohmann::json& j, const DataPosition& p) { j = p.to_json(); }
inline void from_json(const nlohmann::json& j, DataPosition& p) { p = DataPosition::from_json(j); }

// Hands out the items 0..size-1 epoch after epoch, each epoch in the order of
// epoch_permutation(size, seed, epoch) (or in order when shuffle is false).
// Keeps the current epoch's order: O(size) memory.
class EpochSampler {
 public:
  EpochSampler(int64_t size, uint64_t seed, bool shuffle = true) : size_(size), seed_(seed), shuffle_(shuffle) {
    SLIME_CHECK(size >= 1, "EpochSampler: needs at least one item, got ", size);
    load_epoch(0);
  }

  int64_t size() const { return size_; }
  uint64_t seed() const { return seed_; }
  DataPosition position() const { return pos_; }

  // Continues from `p` (as saved by position()).
  void seek(DataPosition p) {
    SLIME_CHECK(p.epoch >= 0 && p.index >= 0 && p.index <= size_, "EpochSampler: position {epoch ", p.epoch, ", index ",
                p.index, "} is out of range for ", size_, " items");
    if (p.index == size_) p = {p.epoch + 1, 0};
    if (p.epoch != pos_.epoch || order_.empty()) load_epoch(p.epoch);
    pos_ = p;
  }

  // The next item; moves to the next epoch after the last one.
  int64_t next() {
    const int64_t item = order_[std::size_t(pos_.index)];
    if (++pos_.index == size_) load_epoch(pos_.epoch + 1);
    return item;
  }
  std::vector<int64_t> next_batch(int64_t count) {
    SLIME_CHECK(count >= 0, "EpochSampler::next_batch: negative count ", count);
    std::vector<int64_t> out(static_cast<std::size_t>(count));
    for (int64_t& x : out) x = next();
    return out;
  }

 private:
  void load_epoch(int64_t epoch) {
    if (shuffle_) {
      order_ = epoch_permutation(size_, seed_, epoch);
    } else {
      order_.resize(std::size_t(size_));
      std::iota(order_.begin(), order_.end(), int64_t(0));
    }
    pos_ = {epoch, 0};
  }

  int64_t size_;
  uint64_t seed_;
  bool shuffle_;
  DataPosition pos_;
  std::vector<int64_t> order_;
};

}  // namespace slime::data
