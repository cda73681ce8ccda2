// slime/parallel/buffer_cache.hpp: BufferCache, a free list of flat buffers
// that Sharded's communication stream hands from one unit to the next: the
// gathered parameters of a unit (FullShard frees them after the unit's
// forward and gathers them again for its backward), its full gradient, and
// the rank-major staging of the all-gather and reduce-scatter. After the
// first step every size a step needs is in the list, so a steady-state step
// allocates nothing (issue 19); the list holds at most what was alive at
// once, which the step's peak already counted.
//
// Stream order: a buffer is released after the stream that takes it next
// (the communication stream) was ordered after every reader (Sharded's
// params_free events), exactly as when it went back to the pool, so reuse
// needs no further synchronisation. clear() returns the memory to the pool
// (Sharded::offload).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/stream.hpp"
#include "slime/core/tensor.hpp"

namespace slime::parallel {

class BufferCache {
 public:
  // A buffer of `numel` elements of `dtype` on `device`: one released
  // earlier with exactly that size, or a new one (allocated on `stream`).
  // The contents are undefined.
  Tensor acquire(int64_t numel, DType dtype, Device device, const Stream& stream) {
    for (std::size_t i = 0; i < free_.size(); ++i) {
      const Tensor& t = free_[i];
      if (t.numel() == numel && t.dtype() == dtype && t.device() == device) {
        Tensor out = std::move(free_[i]);
        free_[i] = std::move(free_.back());
        free_.pop_back();
        return out;
      }
    }
    return Tensor::empty({numel}, dtype, device, stream);
  }

  // Back into the list; `t` must be a whole 1-D buffer that nothing else
  // refers to any more (a view into a live buffer would be handed out twice).
  void release(Tensor&& t) {
    if (!t.defined()) return;
    SLIME_CHECK(t.dim() == 1 && t.spans_storage(), "BufferCache::release: ", t.str(), " is not a whole flat buffer");
    free_.push_back(std::move(t));
    t = Tensor{};
  }

  // Every cached buffer back to the allocator.
  void clear() { free_.clear(); }

  std::size_t size() const { return free_.size(); }
  int64_t bytes() const {
    int64_t n = 0;
    for (const Tensor& t : free_) n += t.nbytes();
    return n;
  }

 private:
  std::vector<Tensor> free_;
};

}  // namespace slime::parallel
