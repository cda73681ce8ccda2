// slime/core/memory.hpp: raw allocation for tensors (host, pinned host, CUDA's
// stream-ordered pool) and the per-device statistics that prove memory claims.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/device.hpp"
#include "slime/core/stream.hpp"

namespace slime {

enum class MemoryKind : uint8_t {
  host,    // pageable CPU memory
  pinned,  // page-locked CPU memory (cudaHostAlloc); plain host memory in builds without CUDA
  device,  // CUDA device memory from the device's stream-ordered pool
};

struct MemoryStats {
  int64_t current_bytes = 0;    // live bytes handed out by slime
  int64_t peak_bytes = 0;       // high-water mark of current_bytes since the last reset
  int64_t allocated_bytes = 0;  // sum of all allocation sizes since process start
  int64_t allocations = 0;
  int64_t frees = 0;
  int64_t reserved_bytes = 0;   // device only: bytes the CUDA pool holds from the driver
};

namespace detail {

inline constexpr int kMaxDevices = 64;
inline constexpr std::size_t kHostAlignment = 64;  // a cache line; also 16-byte vector loads

struct StatsCounter {
  std::atomic<int64_t> current{0}, peak{0}, allocated{0}, allocations{0}, frees{0};

  void on_alloc(int64_t bytes) {
    const int64_t now = current.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    int64_t p = peak.load(std::memory_order_relaxed);
    while (now > p && !peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
    }
    allocated.fetch_add(bytes, std::memory_order_relaxed);
    allocations.fetch_add(1, std::memory_order_relaxed);
  }
  void on_free(int64_t bytes) {
    current.fetch_sub(bytes, std::memory_order_relaxed);
    frees.fetch_add(1, std::memory_order_relaxed);
  }
  MemoryStats read() const {
    return {current.load(), peak.load(), allocated.load(), allocations.load(), frees.load(), 0};
  }
};

// Slot 0: pageable host, slot 1: pinned host, slot 2 + i: CUDA device i.
inline StatsCounter& stats_slot(MemoryKind kind, int device) {
  static std::array<StatsCounter, 2 + kMaxDevices> slots;
  switch (kind) {
    case MemoryKind::host: return slots[0];
    case MemoryKind::pinned: return slots[1];
    case MemoryKind::device:
      SLIME_CHECK(device >= 0 && device < kMaxDevices, "device index ", device, " out of range");
      return slots[2 + device];
  }
  SLIME_FAIL("invalid memory kind");
}

#if SLIME_HAS_CUDA
// The device's default memory pool, configured once to keep freed memory
// cached (release threshold = max) so steady-state steps do not return memory
// to the driver and fetch it again at every synchronisation.
inline cudaMemPool_t device_pool(int device) {
  static std::array<std::once_flag, kMaxDevices> once;
  static std::array<cudaMemPool_t, kMaxDevices> pools{};
  SLIME_CHECK(device >= 0 && device < kMaxDevices, "device index ", device, " out of range");
  std::call_once(once[device], [device] {
    cudaMemPool_t pool = nullptr;
    SLIME_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
    uint64_t threshold = UINT64_MAX;
    SLIME_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
    pools[device] = pool;
  });
  return pools[device];
}
#endif

}  // namespace detail

// Allocates `bytes` of `kind` memory. Device memory is stream-ordered on
// `stream` (usable by work queued on it after this call); host kinds ignore
// the stream. Zero bytes gives nullptr.
inline void* allocate(MemoryKind kind, std::size_t bytes, const Stream& stream = {}) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  int device = -1;
  switch (kind) {
    case MemoryKind::host:
      p = ::operator new(bytes, std::align_val_t(detail::kHostAlignment), std::nothrow);
      SLIME_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
      break;
    case MemoryKind::pinned:
#if SLIME_HAS_CUDA
      if (cuda_device_count() > 0) {
        SLIME_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
        break;
      }
#endif
      // No GPU: "pinned" is plain aligned host memory with the same API.
      p = ::operator new(bytes, std::align_val_t(detail::kHostAlignment), std::nothrow);
      SLIME_CHECK(p != nullptr, "out of host memory allocating ", bytes, " pinned bytes");
      break;
    case MemoryKind::device: {
      const Device d = stream.device();
      SLIME_CHECK(d.is_cuda(), "device memory needs a CUDA stream, got a stream of ", d);
      check_device_exists(d);
#if SLIME_HAS_CUDA
      DeviceGuard guard(d);
      const cudaError_t err =
          cudaMallocFromPoolAsync(&p, bytes, detail::device_pool(d.index), stream.handle());
      if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        size_t free_b = 0, total_b = 0;
        (void)cudaMemGetInfo(&free_b, &total_b);
        SLIME_FAIL("out of memory on ", d, ": requested ", bytes, " bytes, slime holds ",
                   detail::stats_slot(MemoryKind::device, d.index).current.load(), " bytes, device has ", free_b,
                   " free of ", total_b);
      }
      SLIME_CUDA_CHECK(err);
#endif
      device = d.index;
      break;
    }
  }
  detail::stats_slot(kind, device).on_alloc(int64_t(bytes));
  return p;
}

// Frees memory from allocate(); device memory is released in stream order on
// `stream`. Never throws (it runs in destructors); errors are dropped.
inline void deallocate(MemoryKind kind, void* p, std::size_t bytes, const Stream& stream = {}) noexcept {
  if (p == nullptr) return;
  int device = -1;
  switch (kind) {
    case MemoryKind::host: ::operator delete(p, std::align_val_t(detail::kHostAlignment)); break;
    case MemoryKind::pinned:
#if SLIME_HAS_CUDA
      if (cuda_device_count() > 0) {
        (void)cudaFreeHost(p);
        break;
      }
#endif
      ::operator delete(p, std::align_val_t(detail::kHostAlignment));
      break;
    case MemoryKind::device:
#if SLIME_HAS_CUDA
    {
      int previous = 0;
      (void)cudaGetDevice(&previous);
      (void)cudaSetDevice(stream.device().index);
      if (cudaFreeAsync(p, stream.handle()) != cudaSuccess) (void)cudaGetLastError();
      (void)cudaSetDevice(previous);
    }
#endif
      device = stream.device().index;
      break;
  }
  detail::stats_slot(kind, device).on_free(int64_t(bytes));
}

// Statistics of tensors on `d`: the CPU means pageable host memory.
inline MemoryStats memory_stats(Device d) {
  MemoryStats s = detail::stats_slot(d.is_cpu() ? MemoryKind::host : MemoryKind::device, d.index).read();
#if SLIME_HAS_CUDA
  if (d.is_cuda() && d.index < cuda_device_count()) {
    uint64_t reserved = 0;
    if (cudaMemPoolGetAttribute(detail::device_pool(d.index), cudaMemPoolAttrReservedMemCurrent, &reserved) ==
        cudaSuccess)
      s.reserved_bytes = int64_t(reserved);
  }
#endif
  return s;
}

inline MemoryStats pinned_memory_stats() { return detail::stats_slot(MemoryKind::pinned, -1).read(); }

// Sets the peak to the current value, so a later peak measures one region.
inline void reset_peak_memory_stats(Device d) {
  auto& s = detail::stats_slot(d.is_cpu() ? MemoryKind::host : MemoryKind::device, d.index);
  s.peak.store(s.current.load());
}
inline void reset_peak_pinned_memory_stats() {
  auto& s = detail::stats_slot(MemoryKind::pinned, -1);
  s.peak.store(s.current.load());
}

// Returns cached, unused pool memory on `d` to the driver (after the device
// is idle), e.g. before a colocated rollout engine takes the GPU.
inline void release_cached_memory(Device d) {
#if SLIME_HAS_CUDA
  if (!d.is_cuda()) return;
  check_device_exists(d);
  DeviceGuard guard(d);
  note_host_sync();
  SLIME_CUDA_CHECK(cudaDeviceSynchronize());
  SLIME_CUDA_CHECK(cudaMemPoolTrimTo(detail::device_pool(d.index), 0));
#else
  (void)d;
#endif
}

}  // namespace slime
