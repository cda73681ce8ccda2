// slime/rollout/kv_arena.hpp: the rollout engine's KV cache. One arena of
// `capacity` token rows per layer (K and V, [capacity, Hkv, d] each, in the
// model's dtype); every running sequence owns one contiguous region of rows,
// as long as the most tokens it may ever hold (prompt + max_new_tokens,
// capped by the context), allocated first-fit when it is admitted and freed
// when it finishes.
//
// Why regions and no paging: the packed attention (ops/attention.hpp) reads
// sequence b's keys from rows [cu_k[b], cu_k[b + 1]) of one tensor. The engine
// passes the arena itself as the key tensor and describes the rows between
// regions (free rows, and the unused tail of each region) as extra sequences
// with no queries, so decoding needs no gather of the cache. arena_layout
// builds those cu_seqlens, and KvArena::source turns the arena and a layout
// into the model's K/V source (nn::CachedKv, nn/kv_source.hpp): the model's
// own forward writes the new keys and values into the arena and attends over
// it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/kv_source.hpp"

namespace slime::rollout {

// First-fit allocator of row ranges [start, start + size) within [0, capacity).
class RegionAllocator {
 public:
  RegionAllocator() = default;
  explicit RegionAllocator(int64_t capacity) : capacity_(capacity) {
    SLIME_CHECK(capacity >= 0, "RegionAllocator: negative capacity ", capacity);
    if (capacity > 0) free_[0] = capacity;
  }

  int64_t capacity() const { return capacity_; }
  int64_t free_rows() const {
    int64_t n = 0;
    for (const auto& [start, size] : free_) n += size;
    return n;
  }

  // The start of a new region of `size` rows, or nothing when no free range
  // is large enough.
  std::optional<int64_t> allocate(int64_t size) {
    SLIME_CHECK(size > 0, "RegionAllocator::allocate: size must be positive, got ", size);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < size) continue;
      const int64_t start = it->first, rest = it->second - size;
      free_.erase(it);
      if (rest > 0) free_[start + size] = rest;
      return start;
    }
    return std::nullopt;
  }

  // Returns a region to the free list, merging it with free neighbours.
  void release(int64_t start, int64_t size) {
    SLIME_CHECK(start >= 0 && size > 0 && start + size <= capacity_, "RegionAllocator::release: region [", start, ", ",
                start + size, ") is outside [0, ", capacity_, ")");
    auto next = free_.lower_bound(start);
    SLIME_CHECK(next == free_.end() || next->first >= start + size, "RegionAllocator::release: region [", start, ", ",
                start + size, ") overlaps a free range (released twice?)");
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      SLIME_CHECK(prev->first + prev->second <= start, "RegionAllocator::release: region [", start, ", ", start + size,
                  ") overlaps a free range (released twice?)");
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    if (next != free_.end() && next->first == start + size) {
      size += next->second;
      free_.erase(next);
    }
    free_[start] = size;
  }

 private:
  int64_t capacity_ = 0;
  std::map<int64_t, int64_t> free_;  // start -> size
};

// One running sequence's view of the arena for a step.
struct ArenaSegment {
  int64_t start = 0;       // first row of its region
  int64_t cached = 0;      // rows already holding keys/values
  int64_t new_tokens = 0;  // rows this step appends (its queries)
};

// cu_seqlens for attention over the arena: segments must be sorted by start
// and not overlap. Sequence list = for each segment, the gap before it (no
// queries) then the segment (new_tokens queries over cached + new_tokens
// keys); then the tail gap. Also the rows where the new keys go (in segment
// order) and the largest lengths.
struct ArenaLayout {
  std::vector<int32_t> cu_q, cu_k, write_rows;
  int max_q = 0, max_k = 0;
};

inline ArenaLayout arena_layout(const std::vector<ArenaSegment>& segs, int64_t capacity) {
  ArenaLayout l;
  l.cu_q.push_back(0);
  l.cu_k.push_back(0);
  int64_t cursor = 0, queries = 0;
  auto push = [&](int64_t nq, int64_t nk) {
    queries += nq;
    cursor += nk;
    l.cu_q.push_back(int32_t(queries));
    l.cu_k.push_back(int32_t(cursor));
    l.max_q = std::max<int>(l.max_q, int(nq));
    l.max_k = std::max<int>(l.max_k, int(nk));
  };
  for (const ArenaSegment& s : segs) {
    SLIME_CHECK(s.start >= cursor, "arena_layout: segments overlap or are not sorted (start ", s.start, " < row ",
                cursor, ")");
    SLIME_CHECK(s.new_tokens >= 1 && s.cached >= 0, "arena_layout: a segment needs new tokens");
    if (s.start > cursor) push(0, s.start - cursor);
    for (int64_t i = 0; i < s.new_tokens; ++i) l.write_rows.push_back(int32_t(s.start + s.cached + i));
    push(s.new_tokens, s.cached + s.new_tokens);
  }
  SLIME_CHECK(cursor <= capacity, "arena_layout: segments end at row ", cursor, " past the capacity ", capacity);
  if (capacity > cursor) push(0, capacity - cursor);
  return l;
}

// The K and V arenas of every layer.
struct KvArena {
  std::vector<Tensor> k, v;  // per layer [capacity, Hkv, d]
  int64_t capacity = 0;

  void allocate(int64_t layers, int64_t rows, int64_t kv_heads, int64_t head_dim, DType dtype, Device device) {
    SLIME_CHECK(rows > 0, "KvArena: capacity must be positive, got ", rows);
    capacity = rows;
    k.assign(std::size_t(layers), Tensor{});
    v.assign(std::size_t(layers), Tensor{});
    // Zero-filled, not just allocated: the attention kernels load whole key
    // blocks and mask the keys past a sequence (P = 0), but 0 · V is NaN where
    // an unwritten row holds NaN bits (recycled pool memory), and that NaN
    // reaches the sequence's output (src/ops/attention_fwd_sm90.cu: "V rows
    // there must be finite"). Rows once written hold finite K and V.
    for (int64_t i = 0; i < layers; ++i) {
      k[std::size_t(i)] = Tensor::zeros({rows, kv_heads, head_dim}, dtype, device);
      v[std::size_t(i)] = Tensor::zeros({rows, kv_heads, head_dim}, dtype, device);
    }
  }
  void release() {
    k.clear();
    v.clear();
  }
  bool allocated() const { return !k.empty(); }

  // The arena as the K/V source of a step laid out by `lay` (arena_layout of
  // the step's segments, over this arena's capacity): the batch of the step
  // must have cu_seqlens lay.cu_q (the gaps are sequences without tokens) and
  // its tokens in segment order. The index tensors are made on the arena's
  // device; the returned source refers to k and v (keep the arena alive).
  nn::CachedKv source(const ArenaLayout& lay, const Stream& stream = {}) const {
    SLIME_CHECK(allocated(), "KvArena::source: the arena is not allocated");
    const Device dev = k.front().device();
    return source(lay, Tensor::from_vector(lay.write_rows, {int64_t(lay.write_rows.size())}, dev, stream),
                  Tensor::from_vector(lay.cu_k, {int64_t(lay.cu_k.size())}, dev, stream));
  }
  // The same with lay.write_rows and lay.cu_k already on the arena's device
  // (i32 [T] and [B' + 1]; the engine uploads every index of a step at once).
  nn::CachedKv source(const ArenaLayout& lay, Tensor write_rows, Tensor cu_seqlens_k) const {
    SLIME_CHECK(allocated(), "KvArena::source: the arena is not allocated");
    SLIME_CHECK(!lay.cu_k.empty() && lay.cu_k.back() == capacity, "KvArena::source: the layout covers ",
                lay.cu_k.empty() ? 0 : lay.cu_k.back(), " rows, the arena ", capacity);
    SLIME_CHECK(write_rows.dtype() == DType::i32 && write_rows.numel() == int64_t(lay.write_rows.size()) &&
                    cu_seqlens_k.dtype() == DType::i32 && cu_seqlens_k.numel() == int64_t(lay.cu_k.size()) &&
                    write_rows.device() == k.front().device() && cu_seqlens_k.device() == k.front().device(),
                "KvArena::source: write_rows must be i32 [", lay.write_rows.size(), "] and cu_seqlens_k i32 [",
                lay.cu_k.size(), "] on ", k.front().device(), ", got ", write_rows.str(), " and ", cu_seqlens_k.str());
    nn::CachedKv kv;
    kv.k = k;
    kv.v = v;
    kv.write_rows = std::move(write_rows);
    kv.cu_seqlens_k = std::move(cu_seqlens_k);
    kv.max_seqlen_k = lay.max_k;
    return kv;
  }
  std::size_t nbytes() const {
    std::size_t n = 0;
    for (const auto& t : k) n += t.nbytes();
    for (const auto& t : v) n += t.nbytes();
    return n;
  }
};

}  // namespace slime::rollout
