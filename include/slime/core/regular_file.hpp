// slime/core/regular_file.hpp: opening and reading user files only when they are regular files, so
// that a FIFO, a device or a directory given as a model, config or data file is an error naming it
// instead of a process blocked in open() or read().
#pragma once

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>

#include "slime/core/error.hpp"
#include "slime/core/file_descriptor.hpp"

namespace slime {

namespace detail {

inline const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace detail

// Throws slime::Error "<what> '<path>': ..." unless `path` names a regular file (links followed).
// `what` says what the file is for ("config", "token file", ...).
inline void require_regular_file(const std::filesystem::path& path, std::string_view what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    SLIME_FAIL("cannot open ", what, " '", path.string(), "': ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    SLIME_FAIL(what, " '", path.string(), "' is ", detail::file_kind(st.st_mode), ", not a regular file");
}

// Opens `path` read-only, refusing anything but a regular file. O_NONBLOCK keeps open() from
// blocking on a FIFO that appears between a stat and the open; fstat then refuses it. On a regular
// file O_NONBLOCK changes nothing.
inline FileDescriptor open_regular_file(const std::filesystem::path& path, std::string_view what) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY));
  if (!fd.valid()) SLIME_FAIL("cannot open ", what, " '", path.string(), "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) SLIME_FAIL(what, " '", path.string(), "': cannot stat: ", std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    SLIME_FAIL(what, " '", path.string(), "' is ", detail::file_kind(st.st_mode), ", not a regular file");
  return fd;
}

// The whole contents of a regular file (config.json, an index, a metadata file).
inline std::string read_regular_file(const std::filesystem::path& path, std::string_view what) {
  FileDescriptor fd = open_regular_file(path, what);
  std::string out;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) SLIME_FAIL(what, " '", path.string(), "': read failed: ", std::strerror(errno));
    if (n == 0) break;
    out.append(buf, std::size_t(n));
  }
  return out;
}

}  // namespace slime
