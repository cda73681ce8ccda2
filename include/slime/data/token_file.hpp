// slime/data/token_file.hpp: token files for SFT (a header and uint32 token
// ids, memory-mapped for reading, written atomically).
//
// Format, all integers little-endian:
//   offset  size  field
//   0       8     magic "SLMTOK\0\0"
//   8       4     u32 version (1)
//   12      4     u32 bytes per token (4)
//   16      8     u64 count: the number of tokens
//   24      4*count  u32 token ids
// The 24-byte header keeps `count` and the tokens naturally aligned in the
// mapping. A file is valid only if its size is exactly 24 + 4 * count, so a
// truncated (or over-long) file is an error that names the file. uint32 and not
// uint16: Qwen's vocabulary (151,936) exceeds 65,535.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <span>
#include <string>
#include <utility>

#include "slime/core/error.hpp"
#include "slime/core/file_descriptor.hpp"
#include "slime/core/regular_file.hpp"

namespace slime::data {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian; a big-endian host needs byte swapping that is not implemented");

inline constexpr char kTokenFileMagic[8] = {'S', 'L', 'M', 'T', 'O', 'K', '\0', '\0'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr std::size_t kTokenFileHeaderBytes = 24;

namespace detail {

inline std::string errno_string(int err) { return std::strerror(err); }

inline void write_all(int fd, const void* data, std::size_t bytes, const std::filesystem::path& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) SLIME_FAIL("writing '", path.string(), "' failed: ", errno_string(errno));
    p += n;
    bytes -= std::size_t(n);
  }
}

inline void write_header(unsigned char (&h)[kTokenFileHeaderBytes], uint64_t count) {
  const uint32_t version = kTokenFileVersion, token_bytes = 4;
  std::memcpy(h, kTokenFileMagic, 8);
  std::memcpy(h + 8, &version, 4);
  std::memcpy(h + 12, &token_bytes, 4);
  std::memcpy(h + 16, &count, 8);
}

}  // namespace detail

// Writes a token file by appending chunks to "<path>.tmp.<pid>.<n>"; commit()
// writes the final count into the header, fsyncs and renames the file over
// `path`, so readers see either the old file or the complete new one. A
// writer destroyed before commit() removes its temporary file.
class TokenFileWriter {
 public:
  explicit TokenFileWriter(std::filesystem::path path)
      : path_(std::move(path)),
        tmp_(path_.string() + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(next_id())) {
    fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd_.valid())
      SLIME_FAIL("cannot create '", tmp_.string(), "' to write '", path_.string(), "': ", detail::errno_string(errno));
    unsigned char header[kTokenFileHeaderBytes];
    detail::write_header(header, 0);
    detail::write_all(fd_.get(), header, sizeof header, tmp_);
  }
  ~TokenFileWriter() {
    if (!committed_) {
      fd_.close();
      (void)::unlink(tmp_.c_str());
    }
  }
  TokenFileWriter(const TokenFileWriter&) = delete;
  TokenFileWriter& operator=(const TokenFileWriter&) = delete;

  void append(std::span<const uint32_t> tokens) {
    SLIME_CHECK(!committed_, "TokenFileWriter: append after commit of '", path_.string(), "'");
    detail::write_all(fd_.get(), tokens.data(), tokens.size_bytes(), tmp_);
    count_ += tokens.size();
  }
  uint64_t count() const { return count_; }

  void commit() {
    SLIME_CHECK(!committed_, "TokenFileWriter: '", path_.string(), "' committed twice");
    unsigned char header[kTokenFileHeaderBytes];
    detail::write_header(header, count_);
    if (::pwrite(fd_.get(), header, sizeof header, 0) != ssize_t(sizeof header))
      SLIME_FAIL("writing the header of '", tmp_.string(), "' failed: ", detail::errno_string(errno));
    if (::fsync(fd_.get()) != 0) SLIME_FAIL("fsync of '", tmp_.string(), "' failed: ", detail::errno_string(errno));
    if (const int err = fd_.close(); err != 0)
      SLIME_FAIL("closing '", tmp_.string(), "' failed: ", detail::errno_string(err));
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      SLIME_FAIL("renaming '", tmp_.string(), "' to '", path_.string(), "' failed: ", detail::errno_string(errno));
    committed_ = true;
    // Make the rename durable.
    std::filesystem::path dir = path_.parent_path();
    if (dir.empty()) dir = ".";
    FileDescriptor d(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (d.valid()) (void)::fsync(d.get());
  }

 private:
  // Distinguishes writers of one process (two may target the same path).
  static uint64_t next_id() {
    static std::atomic<uint64_t> counter{0};
    return counter.fetch_add(1);
  }

  std::filesystem::path path_, tmp_;
  FileDescriptor fd_;
  uint64_t count_ = 0;
  bool committed_ = false;
};

// Writes `tokens` to `path` atomically.
inline void write_token_file(const std::filesystem::path& path, std::span<const uint32_t> tokens) {
  TokenFileWriter w(path);
  w.append(tokens);
  w.commit();
}

// A token file mapped read-only. The header and the size are checked on open;
// the token ids are not read until used (check_vocab scans them).
class TokenFile {
 public:
  explicit TokenFile(std::filesystem::path path) : path_(std::move(path)) {
    const std::string name = path_.string();
    FileDescriptor fd = open_regular_file(path_, "token file");  // a FIFO is refused, not waited on
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) SLIME_FAIL("cannot stat '", name, "': ", detail::errno_string(errno));
    const uint64_t size = uint64_t(st.st_size);
    if (size < kTokenFileHeaderBytes)
      SLIME_FAIL("token file '", name, "' is truncated: ", size, " bytes, shorter than the ", kTokenFileHeaderBytes,
                 "-byte header");
    map_bytes_ = std::size_t(size);
    void* p = ::mmap(nullptr, map_bytes_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) SLIME_FAIL("cannot mmap '", name, "' (", size, " bytes): ", detail::errno_string(errno));
    map_ = static_cast<const unsigned char*>(p);
    uint32_t version = 0, token_bytes = 0;
    std::memcpy(&version, map_ + 8, 4);
    std::memcpy(&token_bytes, map_ + 12, 4);
    std::memcpy(&count_, map_ + 16, 8);
    try {
      SLIME_CHECK(std::memcmp(map_, kTokenFileMagic, 8) == 0, "'", name,
                  "' is not a slime token file (bad magic; expected \"SLMTOK\\0\\0\")");
      SLIME_CHECK(version == kTokenFileVersion, "token file '", name, "' has version ", version, "; this build reads ",
                  kTokenFileVersion);
      SLIME_CHECK(token_bytes == 4, "token file '", name, "' has ", token_bytes, "-byte tokens; expected 4");
      SLIME_CHECK(count_ <= (size - kTokenFileHeaderBytes) / 4, "token file '", name,
                  "' is truncated: the header says ", count_, " tokens (", kTokenFileHeaderBytes + 4 * count_,
                  " bytes) but the file has ", size, " bytes");
      SLIME_CHECK(size == kTokenFileHeaderBytes + 4 * count_, "token file '", name, "' has ",
                  size - kTokenFileHeaderBytes - 4 * count_, " bytes after its ", count_, " tokens");
    } catch (...) {
      ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
      throw;
    }
  }
  ~TokenFile() {
    if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
  }
  TokenFile(TokenFile&& o) noexcept
      : path_(std::move(o.path_)),
        map_(std::exchange(o.map_, nullptr)),
        map_bytes_(std::exchange(o.map_bytes_, 0)),
        count_(std::exchange(o.count_, 0)) {}
  TokenFile& operator=(TokenFile&& o) noexcept {
    if (this != &o) {
      if (map_ != nullptr) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
      path_ = std::move(o.path_);
      map_ = std::exchange(o.map_, nullptr);
      map_bytes_ = std::exchange(o.map_bytes_, 0);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  uint64_t size() const { return count_; }
  std::span<const uint32_t> tokens() const {
    return {reinterpret_cast<const uint32_t*>(map_ + kTokenFileHeaderBytes), std::size_t(count_)};
  }
  uint32_t operator[](uint64_t i) const { return tokens()[std::size_t(i)]; }

  // Tokens [start, start + length), checked against the file's size.
  std::span<const uint32_t> slice(uint64_t start, uint64_t length) const {
    SLIME_CHECK(start <= count_ && length <= count_ - start, "token file '", path_.string(), "': tokens [", start, ", ",
                start + length, ") out of range for ", count_, " tokens");
    return tokens().subspan(std::size_t(start), std::size_t(length));
  }

  // Throws naming the file and the token's index when an id is >= vocab_size.
  void check_vocab(uint64_t vocab_size) const {
    const std::span<const uint32_t> t = tokens();
    for (std::size_t i = 0; i < t.size(); ++i)
      if (t[i] >= vocab_size)
        SLIME_FAIL("token file '", path_.string(), "': token ", i, " = ", t[i], " is out of the vocabulary [0, ",
                   vocab_size, ")");
  }

 private:
  std::filesystem::path path_;
  const unsigned char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  uint64_t count_ = 0;
};

}  // namespace slime::data
