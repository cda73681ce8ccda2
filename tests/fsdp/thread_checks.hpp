// tests/fsdp/thread_checks.hpp: checks made inside comm::run_local_ranks rank
// threads, where Catch2 assertions must not run (they are not thread-safe and
// abort): TCHECK(cond) records a failure in a locked list, and
// thread_checks().require_none() reports them on the main thread.
#pragma once

#include <catch2/catch_test_macros.hpp>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

namespace slime_test::fsdp {

struct ThreadChecks {
  std::mutex mutex;
  std::vector<std::string> failures;
  void check(bool ok, const char* what, int line) {
    if (ok) return;
    std::lock_guard lock(mutex);
    failures.push_back(std::string(what) + " (line " + std::to_string(line) + ")");
  }
  // Main thread only: one failed check per recorded failure (and one check
  // that there were none), then clears them.
  void require_none() {
    std::lock_guard lock(mutex);
    for (const std::string& f : failures) FAIL_CHECK("in a rank thread: " << f);
    const std::size_t n = failures.size();
    failures.clear();
    CHECK(n == 0);
  }
};

inline ThreadChecks& thread_checks() {
  static ThreadChecks c;
  return c;
}

}  // namespace slime_test::fsdp

#define TCHECK(...) ::slime_test::fsdp::thread_checks().check(bool(__VA_ARGS__), #__VA_ARGS__, __LINE__)
