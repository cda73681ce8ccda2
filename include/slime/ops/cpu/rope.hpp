// slime/ops/cpu/rope.hpp: CPU reference for rotary position embedding in the
// rotate-half convention of Hugging Face Llama/Qwen3 (and its multi-axis
// forms: Qwen3-VL's interleaved MRoPE and its vision tower's 2-D rotary), and
// the positions of packed sequences.
//
// For head_dim d and pair i in [0, d/2), the pair (x[i], x[i + d/2]) of every
// head of token t turns by angle = positions[t, axis(i)] * inv_freq(i):
//   y[i]         = x[i] * cos - x[i + d/2] * sin
//   y[i + d/2]   = x[i + d/2] * cos + x[i] * sin
// RopeSpec says which of the token's positions (axis) and which frequency
// each pair uses (rope_pair_axis, rope_pair_inv_freq_f32):
//   text:              one position per token; inv_freq(i) = 1 / theta^(2i / d)
//   mrope_interleaved: positions (t, h, w) per token (Qwen3-VL's language
//                      model, transformers' apply_interleaved_mrope): pair i
//                      takes h when i % 3 == 1 and i < 3 * section[1], w when
//                      i % 3 == 2 and i < 3 * section[2], else t; the
//                      frequencies are text's (section sums to d/2)
//   vision_2d:         positions (row, col) per patch (Qwen3-VL's vision
//                      tower, rotary over d/2 of rotary dim): pairs i < d/4
//                      take the row, the others the column, with
//                      inv_freq(i) = 1 / theta^(2 (i mod d/4) / (d/2))
// For text tokens whose three MRoPE positions are equal, mrope_interleaved is
// text exactly. For float/bf16 elements every step is fp32, as HF computes it:
// the exponent fl(2j / n), powf, the reciprocal, angle = fl(float(pos) *
// inv_freq), then cosf/sinf of that fp32 angle. For double elements all of it
// is double.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "slime/core/error.hpp"
#include "slime/ops/cpu/elementwise.hpp"

namespace slime::ops {

// Which position of a token and which frequency each rotation pair uses (see
// the file comment). Build with RopeSpec::text / mrope / vision.
struct RopeSpec {
  enum class Kind : int { text, mrope_interleaved, vision_2d };
  Kind kind = Kind::text;
  double theta = 10000.0;
  std::array<int64_t, 3> mrope_section{};  // mrope_interleaved: pairs per (t, h, w), summing to head_dim / 2

  static RopeSpec text(double theta) { return {Kind::text, theta, {}}; }
  static RopeSpec mrope(double theta, std::array<int64_t, 3> section) {
    return {Kind::mrope_interleaved, theta, section};
  }
  static RopeSpec vision(double theta) { return {Kind::vision_2d, theta, {}}; }

  // Positions per token: the width of the positions tensor [tokens, axes].
  int axes() const { return kind == Kind::text ? 1 : kind == Kind::mrope_interleaved ? 3 : 2; }
  const char* name() const {
    return kind == Kind::text ? "text" : kind == Kind::mrope_interleaved ? "mrope_interleaved" : "vision_2d";
  }

  // Throws unless this spec fits head_dim (even; mrope: the sections are >= 0
  // and sum to head_dim / 2; vision: head_dim % 4 == 0) and theta > 0.
  void check(int64_t head_dim, std::string_view op) const {
    SLIME_CHECK(head_dim > 0 && head_dim % 2 == 0, op, ": head_dim must be even and positive, got ", head_dim);
    SLIME_CHECK(theta > 0.0, op, ": rope_theta must be positive, got ", theta);
    if (kind == Kind::mrope_interleaved) {
      const auto& s = mrope_section;
      SLIME_CHECK(s[0] >= 0 && s[1] >= 0 && s[2] >= 0 && s[0] + s[1] + s[2] == head_dim / 2, op,
                  ": mrope_section [", s[0], ", ", s[1], ", ", s[2], "] must be >= 0 and sum to head_dim / 2 = ",
                  head_dim / 2);
    } else if (kind == Kind::vision_2d) {
      SLIME_CHECK(head_dim % 4 == 0, op, ": the 2-D vision rotary needs head_dim divisible by 4, got ", head_dim);
    } else {
      SLIME_CHECK(kind == Kind::text, op, ": unknown RopeSpec kind ", int(kind));
    }
  }
};

}  // namespace slime::ops

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

// The column of positions [tokens, spec.axes()] that pair i reads.
inline int rope_pair_axis(const RopeSpec& spec, int64_t head_dim, int64_t i) {
  switch (spec.kind) {
    case RopeSpec::Kind::mrope_interleaved:
      if (i % 3 == 1 && i < 3 * spec.mrope_section[1]) return 1;
      if (i % 3 == 2 && i < 3 * spec.mrope_section[2]) return 2;
      return 0;
    case RopeSpec::Kind::vision_2d:
      return i < head_dim / 4 ? 0 : 1;
    default:
      return 0;
  }
}

// Pair i's inverse frequency, fp32 as HF computes it (the GPU takes these).
inline float rope_pair_inv_freq_f32(const RopeSpec& spec, int64_t head_dim, int64_t i) {
  if (spec.kind == RopeSpec::Kind::vision_2d) return rope_inv_freq_f32(spec.theta, head_dim / 2, i % (head_dim / 4));
  return rope_inv_freq_f32(spec.theta, head_dim, i);
}

inline double rope_pair_inv_freq_f64(const RopeSpec& spec, int64_t head_dim, int64_t i) {
  if (spec.kind == RopeSpec::Kind::vision_2d) return rope_inv_freq_f64(spec.theta, head_dim / 2, i % (head_dim / 4));
  return rope_inv_freq_f64(spec.theta, head_dim, i);
}

// Rotates x [tokens, heads, head_dim] into y (same shape; y may alias x) by
// +angle (sign = +1, the forward) or -angle (sign = -1: the backward, since a
// rotation's transpose is its inverse); positions [tokens, spec.axes()].
template <class T>
void rope_rotate(const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim,
                 const RopeSpec& spec, int sign, T* y) {
  using A = memops::acc_t<T>;
  using memops::to_acc;
  const int64_t half = head_dim / 2, axes = spec.axes();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const int32_t pos = positions[t * axes + rope_pair_axis(spec, head_dim, i)];
      A c, s;
      if constexpr (std::is_same_v<A, double>) {
        const double angle = double(pos) * rope_pair_inv_freq_f64(spec, head_dim, i);
        c = std::cos(angle);
        s = std::sin(angle);
      } else {
        const float angle = float(pos) * rope_pair_inv_freq_f32(spec, head_dim, i);
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

// The text rotary (one position per token) with base theta.
template <class T>
void rope_rotate(const T* x, const int32_t* positions, int64_t tokens, int64_t heads, int64_t head_dim, double theta,
                 int sign, T* y) {
  rope_rotate(x, positions, tokens, heads, head_dim, RopeSpec::text(theta), sign, y);
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
