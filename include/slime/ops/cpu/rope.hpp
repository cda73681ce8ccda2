// slime/ops/cpu/rope.hpp: CPU reference for rotary position embedding in the
// rotate-half convention of Hugging Face Llama/Qwen3, and the positions of
// packed sequences.
//
// For head_dim d and i in [0, d/2), the pair (x[i], x[i + d/2]) of every head
// of token t turns by angle = positions[t] * inv_freq[i]:
//   inv_freq[i] = 1 / theta^((2i) / d)
//   y[i]         = x[i] * cos - x[i + d/2] * sin
//   y[i + d/2]   = x[i + d/2] * cos + x[i] * sin
// For float/bf16 elements every step is fp32, as HF computes it: the exponent
// fl(2i / d), powf, the reciprocal, angle = fl(float(pos) * inv_freq), then
// cosf/sinf of that fp32 angle. For double elements all of it is double.
#pragma once

#include <cmath>
#include <cstdint>

#include "slime/core/error.hpp"
#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops::cpu {

// HF's inv_freq[i] in fp32 (the GPU kernels take these exact values from the
// host, so both backends rotate by the same fp32 angles).
inline float rope_inv_freq_f32(double theta, int64_t head_dim, int64_t i) {
  const float exponent = float(2 * i) / float(head_dim);
  return 1.0f / std::pow(float(theta), exponent);
}

inline double rope_inv_freq_f64(double theta, int64_t head_dim, int64_t i) {
  return 1.0 / std::pow(theta, double(2 * i) / double(head_dim));
}

// Rotates x [tokens, heads, head_dim] into y (same shape; y may alias x) by
// +angle (sign = +1, the forward) or -angle (sign = -1: the backward, since a
// rotation's transpose is its inverse).
template <class T>
void rope_rotate(const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, double theta,
                 int sign, T* y) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      A c, s;
      if constexpr (std::is_same_v<A, double>) {
        const double angle = double(positions[t]) * rope_inv_freq_f64(theta, head_dim, i);
        c = std::cos(angle);
        s = std::sin(angle);
      } else {
        const float angle = float(positions[t]) * rope_inv_freq_f32(theta, head_dim, i);
        c = std::cos(angle);
        s = std::sin(angle);
      }
      if (sign < 0) s = -s;
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (t * heads + h) * head_dim;
        const A x1 = to_acc<A>(x[base + i]), x2 = to_acc<A>(x[base + i + half]);
        y[base + i] = memops::from_acc<T>(x1 * c - x2 * s);
        y[base + i + half] = memops::from_acc<T>(x2 * c + x1 * s);
      }
    }
  }
}

template <class T>
void rope_forward(const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, double theta,
                  T* y) {
  rope_rotate(x, positions, tokens, heads, head_dim, theta, +1, y);
}

// dx from dy: the rotation by -angle.
template <class T>
void rope_backward(const T* dy, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, double theta,
                   T* dx) {
  rope_rotate(dy, positions, tokens, heads, head_dim, theta, -1, dx);
}

// Throws unless cu_seqlens [num_seqs + 1] starts at 0, never decreases and
// ends at `tokens`.
inline void check_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t tokens) {
  SLIME_CHECK(cu_seqlens[0] == 0, "cu_seqlens[0] must be 0, got ", cu_seqlens[0]);
  for (int64_t s = 0; s < num_seqs; ++s) {
    SLIME_CHECK(cu_seqlens[s + 1] >= cu_seqlens[s], "cu_seqlens must not decrease: cu_seqlens[", s,
                "] = ", cu_seqlens[s], " > cu_seqlens[", s + 1, "] = ", cu_seqlens[s + 1]);
  }
  SLIME_CHECK(cu_seqlens[num_seqs] == tokens, "cu_seqlens[", num_seqs, "] = ", cu_seqlens[num_seqs],
              " must equal the number of tokens ", tokens);
}

// positions[t] = t - cu_seqlens[s] for the sequence s holding token t: every
// packed sequence starts again at position 0.
inline void positions_from_cu_seqlens(const int32_t* cu_seqlens, int64_t num_seqs, int64_t tokens, int32_t* positions) {
  check_cu_seqlens(cu_seqlens, num_seqs, tokens);
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) positions[t] = int32_t(t - cu_seqlens[s]);
}

}  // namespace slime::ops::cpu
