// slime/core/shape.hpp: Shape, a fixed-capacity list of tensor extents that
// never touches the heap.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>

#include "slime/core/error.hpp"

namespace slime {

class Shape {
 public:
  static constexpr int kMaxDims = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) : Shape(std::span<const int64_t>(dims.begin(), dims.size())) {}
  explicit Shape(std::span<const int64_t> dims) {
    SLIME_CHECK(dims.size() <= std::size_t(kMaxDims), "a tensor has at most ", kMaxDims, " dims, got ",
                dims.size());
    for (int64_t d : dims) {
      SLIME_CHECK(d >= 0, "negative extent ", d, " in shape");
      dims_[rank_++] = d;
    }
  }

  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[wrap(i)]; }
  int64_t& operator[](int i) { return dims_[wrap(i)]; }
  const int64_t* begin() const { return dims_.data(); }
  const int64_t* end() const { return dims_.data() + rank_; }

  // The product of the extents; throws (naming the shape) where it does not fit in int64, so
  // that hostile dims never wrap into a small or zero-byte allocation.
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank_; ++i)
      if (__builtin_mul_overflow(n, dims_[i], &n)) overflow("elements");
    return n;
  }

  // numel() * element_bytes, checked the same way.
  int64_t nbytes(std::size_t element_bytes) const {
    int64_t n = 0;
    if (__builtin_mul_overflow(numel(), int64_t(element_bytes), &n)) overflow("bytes");
    return n;
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a.dims_[i] != b.dims_[i]) return false;
    return true;
  }

  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
    return s + (rank_ == 1 ? ",)" : ")");
  }

  [[noreturn]] void overflow(const char* what) const {
    SLIME_FAIL("shape ", str(), ": the number of ", what, " overflows int64");
  }

  // Negative indices count from the back, as in Python.
  int wrap(int i) const {
    const int j = i < 0 ? i + rank_ : i;
    SLIME_CHECK(j >= 0 && j < rank_, "dim ", i, " out of range for a ", rank_, "-d shape ", str());
    return j;
  }

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

}  // namespace slime
