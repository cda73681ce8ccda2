// Helpers shared by the io tests: temporary directories, whole-file reads and
// writes, and tensors with deterministic byte patterns.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "slime/core/tensor.hpp"

namespace slime::io::test {

namespace fs = std::filesystem;

// A fresh directory under the system temp dir, removed with its contents.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> counter{0};
    path =
        fs::temp_directory_path() / ("slime_io_test_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  fs::path operator/(const std::string& name) const { return path / name; }
};

inline std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
}

inline std::vector<std::string> list_dir(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A tensor filled with a deterministic byte pattern (any bits are fine: reads
// in the stored dtype are bit copies).
inline Tensor patterned(const Shape& shape, DType dtype, uint32_t seed) {
  Tensor t = Tensor::empty(shape, dtype);
  auto* p = static_cast<unsigned char*>(t.data_ptr());
  uint32_t x = seed * 2654435761u + 12345u;
  for (std::size_t i = 0; i < t.nbytes(); ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<unsigned char>(x >> 24);
  }
  return t;
}

inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() && a.nbytes() == b.nbytes() &&
         (a.nbytes() == 0 || std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

}  // namespace slime::io::test
