// slime/core/stream.hpp: Stream (an ordered queue of device work) and Event
// (a marker in one, for ordering and timing). On the CPU both are trivial:
// CPU work runs synchronously on the calling thread.
#pragma once

#include <memory>
#include <utility>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/device.hpp"
#include "slime/core/host_sync.hpp"

namespace slime {

class Stream {
 public:
  // The CPU "stream": work runs on the calling thread, in call order.
  Stream() = default;

  // The legacy default stream of `d` (for CUDA), or the CPU stream.
  static Stream default_for(Device d) {
    Stream s;
    s.device_ = d;
    return s;
  }

  // A new non-blocking stream on CUDA device `d`, destroyed with the last copy.
  static Stream create(Device d) {
    check_device_exists(d);
    Stream s;
    s.device_ = d;
#if SLIME_HAS_CUDA
    if (d.is_cuda()) {
      DeviceGuard guard(d);
      cudaStream_t h = nullptr;
      SLIME_CUDA_CHECK(cudaStreamCreateWithFlags(&h, cudaStreamNonBlocking));
      s.owner_ = std::shared_ptr<void>(h, [](void* p) { (void)cudaStreamDestroy(static_cast<cudaStream_t>(p)); });
      s.handle_ = h;
    }
#endif
    return s;
  }

  // Wraps a stream someone else owns (e.g. PyTorch's current stream).
  static Stream borrow(Device d, StreamHandle h) {
    Stream s;
    s.device_ = d;
    s.handle_ = h;
    return s;
  }

  Device device() const { return device_; }
  StreamHandle handle() const { return handle_; }

  // Blocks the host until all work queued so far has finished.
  void synchronize() const {
#if SLIME_HAS_CUDA
    if (device_.is_cuda()) {
      DeviceGuard guard(device_);
      note_host_sync();
      SLIME_CUDA_CHECK(cudaStreamSynchronize(handle_));
    }
#endif
  }

 private:
  Device device_{};
  StreamHandle handle_{};
  std::shared_ptr<void> owner_;  // set for streams this object created
};

class Event {
 public:
  // timing=false gives a lighter event usable only for ordering.
  explicit Event(Device d = Device::cpu(), bool timing = true) : device_(d) {
#if SLIME_HAS_CUDA
    if (d.is_cuda()) {
      DeviceGuard guard(d);
      cudaEvent_t h = nullptr;
      SLIME_CUDA_CHECK(cudaEventCreateWithFlags(&h, timing ? cudaEventDefault : cudaEventDisableTiming));
      owner_ = std::shared_ptr<void>(h, [](void* p) { (void)cudaEventDestroy(static_cast<cudaEvent_t>(p)); });
      handle_ = h;
    }
#else
    (void)timing;
#endif
  }

  void record(const Stream& s) {
    SLIME_CHECK(s.device() == device_, "event on ", device_, " recorded on a stream of ", s.device());
#if SLIME_HAS_CUDA
    if (device_.is_cuda()) {
      DeviceGuard guard(device_);
      SLIME_CUDA_CHECK(cudaEventRecord(handle_, s.handle()));
    }
#endif
  }

  // Makes later work on `s` wait for this event, without blocking the host.
  void wait(const Stream& s) const {
#if SLIME_HAS_CUDA
    if (device_.is_cuda() && s.device().is_cuda()) {
      DeviceGuard guard(s.device());
      SLIME_CUDA_CHECK(cudaStreamWaitEvent(s.handle(), handle_, 0));
    }
#else
    (void)s;
#endif
  }

  void synchronize() const {
#if SLIME_HAS_CUDA
    if (device_.is_cuda()) {
      note_host_sync();
      SLIME_CUDA_CHECK(cudaEventSynchronize(handle_));
    }
#endif
  }

  // Milliseconds from `start` to `end`, both recorded and complete (CUDA only).
  static float elapsed_ms(const Event& start, const Event& end) {
    SLIME_CHECK(start.device_.is_cuda() && end.device_.is_cuda(), "elapsed_ms needs CUDA events");
    float ms = 0.f;
#if SLIME_HAS_CUDA
    SLIME_CUDA_CHECK(cudaEventElapsedTime(&ms, start.handle_, end.handle_));
#endif
    return ms;
  }

  EventHandle handle() const { return handle_; }
  Device device() const { return device_; }

 private:
  Device device_;
  EventHandle handle_{};
  std::shared_ptr<void> owner_;
};

// Blocks the host until all work on device `d` (every stream) has finished;
// nothing on the CPU. For phase timings, not for hot paths.
inline void synchronize_device(Device d) {
#if SLIME_HAS_CUDA
  if (d.is_cuda()) {
    DeviceGuard guard(d);
    note_host_sync();
    SLIME_CUDA_CHECK(cudaDeviceSynchronize());
  }
#else
  (void)d;
#endif
}

}  // namespace slime
