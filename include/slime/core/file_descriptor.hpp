// slime/core/file_descriptor.hpp: FileDescriptor, the owner of one POSIX file descriptor that every
// layer uses (sockets in comm/, files in io/ and data/).
#pragma once

#include <unistd.h>

#include <cerrno>
#include <utility>

namespace slime {

// Owns one file descriptor (-1: none) and closes it on every path out, so early throws leak
// nothing. Movable, not copyable.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  ~FileDescriptor() { reset(); }

  int get() const noexcept { return fd_; }
  bool valid() const noexcept { return fd_ >= 0; }
  explicit operator bool() const noexcept { return valid(); }

  // Closes now, dropping any error (destructors, error paths). close() is never retried on EINTR:
  // on Linux the descriptor is released either way, and a retry could close a descriptor another
  // thread has just been given.
  void reset() noexcept {
    if (fd_ >= 0) (void)::close(std::exchange(fd_, -1));
  }

  // Closes now and returns 0 or close()'s errno: after writing a file, close() can report a
  // deferred write error (NFS). EINTR is returned like any other errno; the descriptor is
  // released either way.
  int close() noexcept {
    if (fd_ < 0) return 0;
    return ::close(std::exchange(fd_, -1)) == 0 ? 0 : errno;
  }

 private:
  int fd_ = -1;
};

}  // namespace slime
