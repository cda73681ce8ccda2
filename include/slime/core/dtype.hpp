// slime/core/dtype.hpp: the element types a Tensor can hold, their sizes and
// names, and the mapping from C++ types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string_view>

#include "slime/core/error.hpp"
#include "slime/core/half.hpp"

namespace slime {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
  }
  return "?";
}

constexpr bool is_floating(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

// Parses the names dtype_name() prints and the spellings Hugging Face and
// safetensors use ("float32", "bfloat16", "F32", "BF16", ...).
inline DType parse_dtype(std::string_view s) {
  if (s == "f32" || s == "float32" || s == "F32" || s == "float") return DType::f32;
  if (s == "bf16" || s == "bfloat16" || s == "BF16") return DType::bf16;
  if (s == "f16" || s == "float16" || s == "F16" || s == "half") return DType::f16;
  if (s == "i32" || s == "int32" || s == "I32") return DType::i32;
  if (s == "i64" || s == "int64" || s == "I64") return DType::i64;
  if (s == "u8" || s == "uint8" || s == "U8") return DType::u8;
  SLIME_FAIL("unknown dtype '", s, "' (expected one of f32, bf16, f16, i32, i64, u8)");
}

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

// dtype_of<T>: the DType that stores T.
template <class T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::f32;
};
template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::bf16;
};
template <>
struct DTypeOf<Half> {
  static constexpr DType value = DType::f16;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::i32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::i64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::u8;
};
template <class T>
inline constexpr DType dtype_of = DTypeOf<T>::value;

// Calls f(T{}) with the C++ type stored by `t`: the one place a runtime dtype
// becomes a compile-time type.
template <class F>
decltype(auto) visit_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f(float{});
    case DType::bf16: return f(BFloat16{});
    case DType::f16: return f(Half{});
    case DType::i32: return f(int32_t{});
    case DType::i64: return f(int64_t{});
    case DType::u8: return f(uint8_t{});
  }
  SLIME_FAIL("invalid dtype value ", int(t));
}

// Element counts, kept apart from byte counts by type: a function taking Elems
// cannot be handed a byte size by mistake.
struct Elems {
  int64_t n = 0;
  constexpr explicit Elems(int64_t count) : n(count) {}
  constexpr std::size_t bytes(DType t) const { return std::size_t(n) * dtype_size(t); }
  friend constexpr bool operator==(Elems a, Elems b) = default;
};

}  // namespace slime
