// Tests for slime/core/file_descriptor.hpp: FileDescriptor closes exactly once, on every path.
#include "slime/core/file_descriptor.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <cerrno>
#include <utility>

namespace {

// True while `fd` names an open descriptor of this process.
bool is_open(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

int open_null() {
  const int fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  REQUIRE(fd >= 0);
  return fd;
}

}  // namespace

TEST_CASE("FileDescriptor closes on destruction and reset", "[io][fd]") {
  int raw = -1;
  {
    slime::FileDescriptor fd(open_null());
    raw = fd.get();
    CHECK(fd.valid());
    CHECK(static_cast<bool>(fd));
    CHECK(is_open(raw));
  }
  CHECK_FALSE(is_open(raw));

  slime::FileDescriptor fd(open_null());
  raw = fd.get();
  fd.reset();
  CHECK_FALSE(fd.valid());
  CHECK(fd.get() == -1);
  CHECK_FALSE(is_open(raw));
  fd.reset();  // a second reset does nothing
  CHECK(fd.close() == 0);

  slime::FileDescriptor none;
  CHECK_FALSE(none.valid());
  CHECK_FALSE(static_cast<bool>(none));
}

TEST_CASE("FileDescriptor moves ownership", "[io][fd]") {
  slime::FileDescriptor a(open_null());
  const int raw = a.get();
  slime::FileDescriptor b(std::move(a));
  CHECK_FALSE(a.valid());
  CHECK(b.get() == raw);

  slime::FileDescriptor c(open_null());
  const int other = c.get();
  c = std::move(b);  // closes what c held
  CHECK_FALSE(is_open(other));
  CHECK(c.get() == raw);
  CHECK(is_open(raw));
}

TEST_CASE("FileDescriptor::close reports the errno of close()", "[io][fd]") {
  slime::FileDescriptor fd(open_null());
  const int raw = fd.get();
  CHECK(fd.close() == 0);
  CHECK_FALSE(fd.valid());
  CHECK_FALSE(is_open(raw));
  CHECK(fd.close() == 0);  // nothing left to close

  // A number that is no open descriptor: close() fails with EBADF and ownership still ends.
  slime::FileDescriptor bad(1 << 20);
  CHECK(bad.close() == EBADF);
  CHECK_FALSE(bad.valid());
}
