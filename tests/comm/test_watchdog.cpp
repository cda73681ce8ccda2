// Tests for slime/comm/watchdog.hpp: ranks as fork()ed processes on the CPU.
// A rank whose peer dies (SIGKILL), stops answering (SIGSTOP) or fails ends
// with a slime::Error naming that rank within the timeout, through its abort
// function (which here unblocks a wait that stands in for a collective); a
// rank stuck where nothing can abort it is ended by the watchdog; clean ends
// are not losses.
#include "slime/comm/watchdog.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <thread>

#include "comm_test_util.hpp"

namespace {

using namespace std::chrono_literals;
using Catch::Matchers::ContainsSubstring;
using slime::comm::PeerWatchdog;
using slime::comm::ProcessInfo;
using slime::comm::WatchdogOptions;
using slime::comm::test::free_port;
using slime::comm::test::rank_of;
using Clock = std::chrono::steady_clock;

WatchdogOptions options(int port, std::chrono::milliseconds timeout) {
  WatchdogOptions o;
  o.host = "127.0.0.1";
  o.port = port;
  o.timeout = timeout;
  return o;
}

// A blocking wait that only the abort function ends, standing in for a
// collective on a communicator (a read of a pipe nobody else writes).
struct BlockingCollective {
  int fds[2] = {-1, -1};
  BlockingCollective() { REQUIRE(::pipe2(fds, O_CLOEXEC) == 0); }
  ~BlockingCollective() {
    ::close(fds[0]);
    ::close(fds[1]);
  }
  void abort() noexcept {
    const char b = 1;
    (void)!::write(fds[1], &b, 1);
  }
  void wait() {
    char b = 0;
    (void)!::read(fds[0], &b, 1);
  }
};

// Runs `body` in a child process; the child exits 0, or 1 on an exception.
template <class F>
pid_t spawn(F&& body) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      body();
    } catch (...) {
      code = 1;
    }
    std::_Exit(code);
  }
  return pid;
}

// The child's exit status (or 128 + signal), waiting at most `limit`; -1 if
// it is still running then (it is killed).
int wait_child(pid_t pid, std::chrono::milliseconds limit) {
  const Clock::time_point deadline = Clock::now() + limit;
  int status = 0;
  while (Clock::now() < deadline) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    std::this_thread::sleep_for(10ms);
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return -1;
}

// This process as rank `me`, blocked in a "collective" until the watchdog
// aborts it; returns the error check() throws and the seconds it took.
std::pair<std::string, double> block_until_lost(const ProcessInfo& info, const WatchdogOptions& o) {
  BlockingCollective collective;
  const Clock::time_point start = Clock::now();
  PeerWatchdog dog(info, o, [&] { collective.abort(); });
  collective.wait();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  try {
    dog.check();
  } catch (const slime::Error& e) {
    return {e.what(), seconds};
  }
  return {"", seconds};
}

}  // namespace

TEST_CASE("watchdog: a peer process that dies ends the other rank with an error naming it", "[comm][watchdog]") {
  const int port = free_port();
  SECTION("rank 1 dies, rank 0 learns it") {
    const pid_t child = spawn([&] {
      PeerWatchdog dog(rank_of(1, 2), options(port, 3s));
      std::this_thread::sleep_for(300ms);
      ::raise(SIGKILL);  // no goodbye, no destructor
    });
    const auto [error, seconds] = block_until_lost(rank_of(0, 2), options(port, 3s));
    CHECK_THAT(error, ContainsSubstring("rank 1 of 2 was lost"));
    CHECK_THAT(error, ContainsSubstring("closed without a goodbye"));
    CHECK(seconds < 3.0);  // a closed socket is seen at once, not after the timeout
    CHECK(wait_child(child, 5s) == 128 + SIGKILL);
  }
  SECTION("rank 0 dies, rank 1 learns it") {
    const pid_t child = spawn([&] {
      PeerWatchdog dog(rank_of(0, 2), options(port, 3s));
      std::this_thread::sleep_for(300ms);
      ::raise(SIGKILL);
    });
    const auto [error, seconds] = block_until_lost(rank_of(1, 2), options(port, 3s));
    CHECK_THAT(error, ContainsSubstring("rank 0 of 2 was lost"));
    CHECK(seconds < 3.0);
    CHECK(wait_child(child, 5s) == 128 + SIGKILL);
  }
  SECTION("of 3 ranks, rank 2 dies: rank 1 hears it from rank 0") {
    const pid_t dies = spawn([&] {
      PeerWatchdog dog(rank_of(2, 3), options(port, 3s));
      std::this_thread::sleep_for(300ms);
      ::raise(SIGKILL);
    });
    const pid_t hub = spawn([&] {
      const auto [error, seconds] = block_until_lost(rank_of(0, 3), options(port, 3s));
      if (error.find("rank 2 of 3 was lost") == std::string::npos) std::_Exit(2);
    });
    const auto [error, seconds] = block_until_lost(rank_of(1, 3), options(port, 3s));
    CHECK_THAT(error, ContainsSubstring("rank 2 of 3 was lost"));
    CHECK_THAT(error, ContainsSubstring("reported by rank 0"));
    CHECK(seconds < 3.0);
    CHECK(wait_child(hub, 5s) == 0);
    CHECK(wait_child(dies, 5s) == 128 + SIGKILL);
  }
}

TEST_CASE("watchdog: a peer that stops answering is lost after the timeout", "[comm][watchdog]") {
  const int port = free_port();
  const pid_t child = spawn([&] {
    PeerWatchdog dog(rank_of(1, 2), options(port, 1s));
    std::this_thread::sleep_for(200ms);
    ::raise(SIGSTOP);  // the socket stays open, the heartbeats stop
  });
  const auto [error, seconds] = block_until_lost(rank_of(0, 2), options(port, 1s));
  CHECK_THAT(error, ContainsSubstring("rank 1 of 2 was lost"));
  CHECK_THAT(error, ContainsSubstring("sent nothing for 1 s"));
  CHECK_THAT(error, ContainsSubstring("SLIME_WATCHDOG_TIMEOUT_S"));
  CHECK(seconds >= 1.0);
  CHECK(seconds < 4.0);
  ::kill(child, SIGKILL);
  CHECK(wait_child(child, 5s) == 128 + SIGKILL);
}

TEST_CASE("watchdog: a rank that nothing can abort is ended, not left hanging", "[comm][watchdog]") {
  const int port = free_port();
  WatchdogOptions o = options(port, 2s);
  o.grace = 500ms;
  // Rank 0 waits where no abort reaches (no abort function, a plain sleep).
  const pid_t stuck = spawn([&] {
    PeerWatchdog dog(rank_of(0, 2), o);
    std::this_thread::sleep_for(1h);
  });
  const pid_t dies = spawn([&] {
    PeerWatchdog dog(rank_of(1, 2), o);
    std::this_thread::sleep_for(300ms);
    ::raise(SIGKILL);
  });
  CHECK(wait_child(stuck, 10s) == slime::comm::kWatchdogExitCode);
  CHECK(wait_child(dies, 5s) == 128 + SIGKILL);
}

TEST_CASE("watchdog: a rank that fails is named by the others", "[comm][watchdog]") {
  const int port = free_port();
  const pid_t child = spawn([&] {
    PeerWatchdog dog(rank_of(1, 2), options(port, 5s));
    std::this_thread::sleep_for(300ms);
    dog.report_failure();  // its own error path, before unwinding
  });
  const auto [error, seconds] = block_until_lost(rank_of(0, 2), options(port, 5s));
  CHECK_THAT(error, ContainsSubstring("rank 1 of 2 was lost: it ended with an error"));
  CHECK(seconds < 5.0);
  CHECK(wait_child(child, 5s) == 0);
}

TEST_CASE("watchdog: clean ends are not losses", "[comm][watchdog]") {
  const int port = free_port();
  // Rank 1 ends first, then rank 0 (and the other way round): no loss, no abort.
  for (const int first : {1, 0}) {
    INFO("rank " << first << " ends first");
    const int other = 1 - first;
    const pid_t child = spawn([&] {
      bool aborted = false;
      {
        PeerWatchdog dog(rank_of(first, 2), options(port, 1s), [&] { aborted = true; });
        std::this_thread::sleep_for(500ms);
      }
      if (aborted) std::_Exit(3);
    });
    bool aborted = false;
    {
      PeerWatchdog dog(rank_of(other, 2), options(port, 1s), [&] { aborted = true; });
      std::this_thread::sleep_for(2500ms);  // longer than the timeout after the peer left
      CHECK_FALSE(dog.lost_rank().has_value());
      CHECK_NOTHROW(dog.check());
    }
    CHECK_FALSE(aborted);
    CHECK(wait_child(child, 5s) == 0);
  }
}

TEST_CASE("watchdog options from the environment", "[comm][watchdog]") {
  using Env = std::map<std::string, std::string>;
  const auto from = [](const Env& env, int master_port = 29500) {
    ProcessInfo info = rank_of(0, 2);
    info.master_addr = "10.0.0.1";
    info.master_port = master_port;
    return slime::comm::watchdog_options(info, [&](const char* name) -> std::optional<std::string> {
      auto it = env.find(name);
      if (it == env.end()) return std::nullopt;
      return it->second;
    });
  };
  const WatchdogOptions d = from({});
  CHECK(d.host == "10.0.0.1");
  CHECK(d.port == 29502);  // MASTER_PORT+2: torchrun's store and the bootstrap hold +0 and +1
  CHECK(d.timeout == 60s);
  CHECK(d.enabled);
  CHECK(from({{"SLIME_WATCHDOG_TIMEOUT_S", "2.5"}}).timeout == 2500ms);
  CHECK_FALSE(from({{"SLIME_WATCHDOG_TIMEOUT_S", "0"}}).enabled);
  CHECK_THROWS_WITH(from({{"SLIME_WATCHDOG_TIMEOUT_S", "soon"}}), ContainsSubstring("SLIME_WATCHDOG_TIMEOUT_S"));
  CHECK_THROWS_WITH(from({}, 65534), ContainsSubstring("MASTER_PORT+2"));
  // Disabled, or one process: nothing to watch, nothing started.
  WatchdogOptions off = d;
  off.enabled = false;
  PeerWatchdog a(rank_of(1, 2), off);
  PeerWatchdog b(rank_of(0, 1), d);
  CHECK_NOTHROW(a.check());
  CHECK_NOTHROW(b.check());
}
