// slime/parallel/flat_shard.hpp: FlatShardLayout, how the parameters of one
// FSDP unit are split along dim 0 over `world` ranks and packed into one flat
// shard per rank, and the two copies between the all-gather's rank-major
// buffer and the parameter-major buffer the modules see.
//
// Per-parameter dim-0 sharding (as PyTorch FSDP2): a parameter of `rows` rows
// of `row_elems` elements gives every rank a piece of `rows_per_rank` rows,
// rank r holding rows [r * rows_per_rank, (r + 1) * rows_per_rank) (rows past
// the end are zero padding), so any shape shards over any number of ranks.
// rows_per_rank is ceil(rows / world) rounded up so that a piece is a multiple
// of kFlatShardAlign elements: every piece, and every parameter in the
// gathered buffer, starts 16-element aligned (32-byte bf16, 64-byte f32
// vector loads), and the pieces tile the shard with no gaps.
//
//   shard of rank r   [shard_numel]:          piece(p0, r) | piece(p1, r) | ...
//   rank-major buffer [world * shard_numel]:  shard 0 | shard 1 | ...   (what all_gather produces)
//   gathered buffer   [world * shard_numel]:  p0 (rows of ranks 0..world-1) | p1 | ...
//
// In the gathered (parameter-major) buffer each parameter is contiguous and
// starts at world * shard_offset: its value is a view of its first numel
// elements. A 0-d parameter counts as one row of one element.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "slime/core/tensor.hpp"

namespace slime::parallel {

inline constexpr int64_t kFlatShardAlign = 16;  // elements

struct FlatShardEntry {
  std::string name;
  Shape shape;
  int64_t numel = 0;
  int64_t rows = 0;           // extent of dim 0 (1 for a 0-d parameter)
  int64_t row_elems = 0;      // elements of one row
  int64_t rows_per_rank = 0;  // rows of every rank's piece, padding rows included
  int64_t piece = 0;          // rows_per_rank * row_elems: elements of every rank's piece
  int64_t shard_offset = 0;   // where the piece starts in each rank's shard

  // The flat element range [begin, end) of the unpadded, flattened parameter
  // that rank r holds (empty when all of r's rows are padding).
  int64_t begin(int r) const { return std::min(numel, int64_t(r) * piece); }
  int64_t end(int r) const { return std::min(numel, int64_t(r + 1) * piece); }
};

class FlatShardLayout {
 public:
  FlatShardLayout() = default;

  // One entry per (name, shape), in order.
  FlatShardLayout(const std::vector<std::pair<std::string, Shape>>& params, int world) : world_(world) {
    SLIME_CHECK(world >= 1, "FlatShardLayout: world must be >= 1, got ", world);
    entries_.reserve(params.size());
    for (const auto& [name, shape] : params) {
      FlatShardEntry e;
      e.name = name;
      e.shape = shape;
      e.numel = shape.numel();
      e.rows = shape.rank() == 0 ? 1 : shape[0];
      e.row_elems = e.rows > 0 ? e.numel / e.rows : 0;
      // Rows per rank: ceil(rows / world), rounded up so that the piece is a
      // multiple of the alignment (row_elems * m % align == 0).
      const int64_t step = e.row_elems > 0 ? kFlatShardAlign / std::gcd(kFlatShardAlign, e.row_elems) : 1;
      const int64_t even = (e.rows + world - 1) / world;
      e.rows_per_rank = (even + step - 1) / step * step;
      e.piece = e.rows_per_rank * e.row_elems;
      e.shard_offset = shard_numel_;
      shard_numel_ += e.piece;
      entries_.push_back(std::move(e));
    }
  }

  int world() const { return world_; }
  const std::vector<FlatShardEntry>& entries() const { return entries_; }
  // Elements of each rank's shard (padding included).
  int64_t shard_numel() const { return shard_numel_; }
  // Elements of the gathered (and of the rank-major) buffer.
  int64_t gathered_numel() const { return shard_numel_ * world_; }
  // Elements of the parameters themselves (no padding).
  int64_t unpadded_numel() const {
    int64_t n = 0;
    for (const auto& e : entries_) n += e.numel;
    return n;
  }
  // Where entry i starts in the gathered buffer.
  int64_t gathered_offset(std::size_t i) const { return entries_[i].shard_offset * world_; }

 private:
  int world_ = 1;
  int64_t shard_numel_ = 0;
  std::vector<FlatShardEntry> entries_;
};

namespace detail {

// dst[h * dpitch + w] = src[h * spitch + w] for w < width, h < height
// (element counts), on the CPU or, for device tensors, as one
// cudaMemcpy2DAsync on `stream`.
inline void copy_2d(const Tensor& dst, int64_t dst_offset, int64_t dpitch, const Tensor& src, int64_t src_offset,
                    int64_t spitch, int64_t width, int64_t height, [[maybe_unused]] const Stream& stream) {
  if (width == 0 || height == 0) return;
  const std::size_t es = dtype_size(src.dtype());
  char* d = static_cast<char*>(dst.data_ptr()) + std::size_t(dst_offset) * es;
  const char* s = static_cast<const char*>(src.data_ptr()) + std::size_t(src_offset) * es;
  if (dst.device().is_cpu()) {
    for (int64_t h = 0; h < height; ++h)
      std::memcpy(d + std::size_t(h * dpitch) * es, s + std::size_t(h * spitch) * es, std::size_t(width) * es);
    return;
  }
#if SLIME_HAS_CUDA
  DeviceGuard guard(dst.device());
  SLIME_CUDA_CHECK(cudaMemcpy2DAsync(d, std::size_t(dpitch) * es, s, std::size_t(spitch) * es, std::size_t(width) * es,
                                     std::size_t(height), cudaMemcpyDeviceToDevice, stream.handle()));
#else
  SLIME_FAIL("copy_2d on ", dst.device(), " needs CUDA");
#endif
}

inline void check_flat_pair(const Tensor& a, const Tensor& b, const FlatShardLayout& layout, const char* what) {
  SLIME_CHECK(a.defined() && b.defined(), what, ": undefined buffer");
  SLIME_CHECK(a.dtype() == b.dtype() && a.device() == b.device(), what,
              ": buffers differ in dtype or device: ", a.str(), " vs ", b.str());
  SLIME_CHECK(a.numel() == layout.gathered_numel() && b.numel() == layout.gathered_numel(), what, ": buffers of ",
              layout.gathered_numel(), " elements expected, got ", a.str(), " and ", b.str());
}

}  // namespace detail

// gathered (parameter-major) <- rank_major (what all_gather wrote): one
// strided copy per parameter.
inline void unpack_rank_major(const Tensor& rank_major, const Tensor& gathered, const FlatShardLayout& layout,
                              const Stream& stream = {}) {
  detail::check_flat_pair(rank_major, gathered, layout, "unpack_rank_major");
  const auto& es = layout.entries();
  for (std::size_t i = 0; i < es.size(); ++i)
    detail::copy_2d(gathered, layout.gathered_offset(i), es[i].piece, rank_major, es[i].shard_offset,
                    layout.shard_numel(), es[i].piece, layout.world(), stream);
}

// rank_major <- gathered: the inverse, the input of a reduce-scatter.
inline void pack_rank_major(const Tensor& gathered, const Tensor& rank_major, const FlatShardLayout& layout,
                            const Stream& stream = {}) {
  detail::check_flat_pair(rank_major, gathered, layout, "pack_rank_major");
  const auto& es = layout.entries();
  for (std::size_t i = 0; i < es.size(); ++i)
    detail::copy_2d(rank_major, es[i].shard_offset, layout.shard_numel(), gathered, layout.gathered_offset(i),
                    es[i].piece, es[i].piece, layout.world(), stream);
}

}  // namespace slime::parallel
