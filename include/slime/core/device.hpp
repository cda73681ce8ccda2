// slime/core/device.hpp: where a tensor lives (the CPU or one CUDA device) and
// how many CUDA devices this process can see.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>

#include "slime/core/cuda_runtime.hpp"

namespace slime {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = -1;  // CUDA ordinal; -1 for the CPU

  static constexpr Device cpu() { return {}; }
  static constexpr Device cuda(int i) { return {DeviceKind::cuda, i}; }
  constexpr bool is_cpu() const { return kind == DeviceKind::cpu; }
  constexpr bool is_cuda() const { return kind == DeviceKind::cuda; }
  friend constexpr bool operator==(Device a, Device b) = default;

  std::string str() const { return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index); }
};

inline std::ostream& operator<<(std::ostream& os, Device d) { return os << d.str(); }

// True when the library was built with CUDA (whether or not a GPU exists).
constexpr bool built_with_cuda() { return SLIME_HAS_CUDA != 0; }

// CUDA devices visible to this process; 0 without CUDA, without a driver or
// without a GPU. Never throws, so tests can use it to decide to skip.
inline int cuda_device_count() {
#if SLIME_HAS_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
#else
  return 0;
#endif
}

// Throws unless `d` is the CPU or a CUDA device that exists.
inline void check_device_exists(Device d) {
  if (d.is_cpu()) return;
  SLIME_CHECK(built_with_cuda(), "device ", d, " requested but slime was built without CUDA (link slime::cuda)");
  const int n = cuda_device_count();
  SLIME_CHECK(d.index >= 0 && d.index < n, "device ", d, " does not exist: this process sees ", n,
              " CUDA device(s)");
}

#if SLIME_HAS_CUDA
// Makes `d` current for the lifetime of the guard and restores the previous
// device after; a CPU device changes nothing.
class DeviceGuard {
 public:
  explicit DeviceGuard(Device d) {
    if (!d.is_cuda()) return;
    SLIME_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != d.index) {
      SLIME_CUDA_CHECK(cudaSetDevice(d.index));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};
#else
class DeviceGuard {
 public:
  explicit DeviceGuard(Device) {}
};
#endif

}  // namespace slime
