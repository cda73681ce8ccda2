// Shared by the libFuzzer harnesses: the input written to a file of this process (the readers
// under test take paths), and the rule every harness enforces: hostile bytes may only end in
// slime::Error. Any other exception escapes LLVMFuzzerTestOneInput and libFuzzer reports it, as
// it reports crashes, hangs, leaks and sanitizer findings.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>

namespace slime::fuzz {

// A directory of this process, removed at exit.
inline const std::filesystem::path& work_dir() {
  static const std::filesystem::path dir = [] {
    // tmpfs where there is one: each input is written once per execution.
    const char* tmp = std::getenv("SLIME_FUZZ_TMPDIR");
    std::error_code ec;
    const char* base = tmp != nullptr ? tmp : std::filesystem::is_directory("/dev/shm", ec) ? "/dev/shm" : "/tmp";
    std::filesystem::path d = std::filesystem::path(base) / ("slime_fuzz_" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(work_dir(), ec);
    });
    return d;
  }();
  return dir;
}

// Writes `data` to `path` (truncating), aborting on failure: a harness that cannot write its
// input tests nothing.
inline void write_input(const std::filesystem::path& path, const uint8_t* data, std::size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) std::abort();
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, data + done, size - done);
    if (n <= 0) std::abort();
    done += std::size_t(n);
  }
  ::close(fd);
}

}  // namespace slime::fuzz
