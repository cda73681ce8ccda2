// slime/core/host_sync.hpp: a process-wide count of the host's waits for a
// GPU (issue 19: a training step without expert parallelism, and a decode
// step, should have none). Every place in slime where the host blocks on
// CUDA work adds one: Stream, Event and device synchronisation (which
// to_vector and the grad-norm read-back use), copies from a GPU into
// pageable host memory, the collectives' host waits and the cuBLAS grouped
// GEMM's offsets. Tests read it before and after a step; the CPU never
// counts (nothing to wait for).
#pragma once

#include <atomic>
#include <cstdint>

namespace slime {

namespace detail {
inline std::atomic<int64_t> host_syncs{0};
}  // namespace detail

// One host wait for a GPU (called by the wait sites; any thread).
inline void note_host_sync() { detail::host_syncs.fetch_add(1, std::memory_order_relaxed); }

// Host waits for a GPU since the process started, over all threads.
inline int64_t host_sync_count() { return detail::host_syncs.load(std::memory_order_relaxed); }

}  // namespace slime
