// The comm headers together in one translation unit: bootstrap.hpp and
// local_comm.hpp (and mesh.hpp) share their detail helpers instead of each
// defining them, so a program may include all of them (the header checks
// compile each header alone, which cannot catch a clash).
#include <catch2/catch_test_macros.hpp>

#include <chrono>

#include "slime/comm/bootstrap.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"

TEST_CASE("comm headers: bootstrap and local_comm in one translation unit") {
  using std::chrono::milliseconds;
  CHECK(slime::comm::detail::format_duration(milliseconds(300)) == "300 ms");
  CHECK(slime::comm::detail::format_duration(milliseconds(2000)) == "2 s");
  CHECK(slime::comm::detail::format_duration(milliseconds(1500)) == "1500 ms");
}
