// src/ops/attention_sm90_common.hpp: host-side checks shared by the Hopper
// attention forward and backward (src/ops/attention_{fwd,bwd}_sm90.cu): why a
// call cannot run there, and the environment switches. Not installed.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string_view>

#include "tensor_map.hpp"

namespace slime::ops::detail::attention_sm90 {

// "" when a Hopper attention kernel can run at `head_dim` on tensors at
// `bases` (their tensor maps need 16-byte aligned bases), else why not;
// `alignment_message` is the reason given for a misaligned base.
inline const char* refusal(int head_dim, std::initializer_list<const void*> bases, const char* alignment_message) {
  if (head_dim != 64 && head_dim != 128) return "it runs head_dim 64 and 128 only";
  if (!tma::sm90_device())
    return "it needs an sm_90 (Hopper) GPU and a build for sm_90a (CMAKE_CUDA_ARCHITECTURES 90a)";
  for (const void* b : bases)
    if ((reinterpret_cast<uintptr_t>(b) & 15) != 0) return alignment_message;
  return "";
}

// The environment variable `name` read once per process: unset -> `fallback`,
// "0" -> false, "1" -> true, anything else -> `fallback`.
inline bool env_switch(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr) return fallback;
  const std::string_view s(v);
  return s == "1" ? true : s == "0" ? false : fallback;
}

}  // namespace slime::ops::detail::attention_sm90
