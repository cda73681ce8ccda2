// slime/comm/detail_time.hpp: how the comm headers (bootstrap.hpp,
// local_comm.hpp) print a timeout in their errors; one definition both
// include, so a translation unit may include both.
#pragma once

#include <chrono>
#include <string>

namespace slime::comm::detail {

// "300 ms", "1 s" (whole seconds print as seconds).
inline std::string format_duration(std::chrono::milliseconds d) {
  if (d.count() % 1000 == 0) return std::to_string(d.count() / 1000) + " s";
  return std::to_string(d.count()) + " ms";
}

}  // namespace slime::comm::detail
