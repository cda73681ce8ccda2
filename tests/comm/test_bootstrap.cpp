// Tests for slime/comm/bootstrap.hpp: launcher detection and broadcast_blob over TCP and files.
// Ranks run as fork()ed processes; each reports back through a pipe and its exit status.
#include "slime/comm/bootstrap.hpp"

#include <signal.h>
#include <sys/wait.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "comm_test_util.hpp"

namespace {

using namespace std::chrono_literals;
using Catch::Matchers::ContainsSubstring;
using slime::comm::broadcast_blob;
using slime::comm::process_info_from_env;
using slime::comm::ProcessInfo;
using slime::comm::RendezvousOptions;
using Env = std::map<std::string, std::string>;
using Clock = std::chrono::steady_clock;

slime::comm::GetenvFn lookup(const Env& env) {
  return [env](const char* name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

// The message of the slime::Error thrown by `fn`, or "" when it does not throw.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const slime::Error& e) {
    return e.what();
  }
  return "";
}

// 128 bytes like an ncclUniqueId, with zero bytes inside and at both ends.
std::string binary_blob(std::size_t size = 128) {
  std::string blob(size, '\0');
  for (std::size_t i = 0; i < size; ++i) {
    blob[i] = i % 16 == 0 ? '\0' : static_cast<char>((i * 37 + 11) % 256);
  }
  if (size > 0) blob[size - 1] = '\0';
  return blob;
}

using slime::comm::test::free_port;
using slime::comm::test::rank_of;

RendezvousOptions tcp_options(int port, std::chrono::milliseconds timeout = 5s) {
  RendezvousOptions opt;
  opt.host = "127.0.0.1";
  opt.port = port;
  opt.timeout = timeout;
  return opt;
}

// A rank running in a forked process. Its function returns a report ("ok" by convention for
// success); an escaping exception becomes the report with exit status 2.
struct Child {
  pid_t pid = -1;
  int report_fd = -1;
};

struct ChildResult {
  int exit_code = -1;
  std::string report;
};

Child spawn(const std::function<std::string()>& fn) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    std::string report;
    int code = 0;
    try {
      report = fn();
    } catch (const std::exception& e) {
      report = std::string("exception: ") + e.what();
      code = 2;
    } catch (...) {
      report = "unknown exception";
      code = 3;
    }
    std::size_t done = 0;
    while (done < report.size()) {
      ssize_t n = ::write(fds[1], report.data() + done, report.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    ::_exit(code);  // no atexit handlers, no Catch2 teardown in the child
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

// Collects a child's report and exit status. A child still running after `limit` is killed, so a
// hang fails the test instead of stalling it.
ChildResult finish(Child child, std::chrono::milliseconds limit = 15s) {
  const Clock::time_point deadline = Clock::now() + limit;
  ChildResult result;
  bool killed = false;
  char buf[4096];
  for (;;) {
    int ms = slime::comm::detail::remaining_ms(deadline);
    pollfd p{child.report_fd, POLLIN, 0};
    int n = ms == 0 ? 0 : ::poll(&p, 1, ms);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::kill(child.pid, SIGKILL);
      killed = true;
      break;
    }
    ssize_t got = ::read(child.report_fd, buf, sizeof(buf));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;
    result.report.append(buf, static_cast<std::size_t>(got));
  }
  ::close(child.report_fd);
  int status = 0;
  while (::waitpid(child.pid, &status, 0) < 0 && errno == EINTR) {
  }
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (killed) result.report = "killed after timeout; report so far: " + result.report;
  return result;
}

// Child body: receive the blob as `rank` and report whether it matches.
std::function<std::string()> expect_blob(ProcessInfo info, RendezvousOptions opt, std::string expected,
                                         std::string blob_on_root = "", std::chrono::milliseconds delay = 0ms) {
  return [=] {
    std::this_thread::sleep_for(delay);
    std::string got = broadcast_blob(info, info.rank == 0 ? blob_on_root : std::string(), opt);
    if (got == expected) return std::string("ok");
    return "rank " + std::to_string(info.rank) + " got " + std::to_string(got.size()) +
           " bytes that differ from the expected " + std::to_string(expected.size());
  };
}

// Child body: expect broadcast_blob to throw; report the message.
std::function<std::string()> expect_error(ProcessInfo info, RendezvousOptions opt,
                                          std::chrono::milliseconds delay = 0ms) {
  return [=] {
    std::this_thread::sleep_for(delay);
    try {
      broadcast_blob(info, "", opt);
    } catch (const slime::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
}

void require_ok(const ChildResult& r) {
  INFO("child report: " << r.report);
  CHECK(r.exit_code == 0);
  CHECK(r.report == "ok");
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "slime-bootstrap-XXXXXX").string();
    REQUIRE(::mkdtemp(tmpl.data()) != nullptr);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

RendezvousOptions file_options(const std::string& dir, std::string run_id = "",
                               std::chrono::milliseconds timeout = 5s) {
  RendezvousOptions opt;
  opt.port = 29501;
  opt.file_dir = dir;
  opt.timeout = timeout;
  opt.run_id = std::move(run_id);
  return opt;
}

}  // namespace

TEST_CASE("process_info_from_env reads torchrun variables", "[comm][bootstrap]") {
  ProcessInfo info = process_info_from_env(lookup({{"RANK", "5"},
                                                   {"WORLD_SIZE", "8"},
                                                   {"LOCAL_RANK", "1"},
                                                   {"LOCAL_WORLD_SIZE", "4"},
                                                   {"MASTER_ADDR", "node017"},
                                                   {"MASTER_PORT", "12345"},
                                                   // Lower priority launchers are ignored.
                                                   {"OMPI_COMM_WORLD_RANK", "0"},
                                                   {"SLURM_PROCID", "0"}}));
  CHECK(info.launcher == "torchrun");
  CHECK(info.rank == 5);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "node017");
  CHECK(info.master_port == 12345);
}

TEST_CASE("process_info_from_env reads OpenMPI variables", "[comm][bootstrap]") {
  Env env{{"OMPI_COMM_WORLD_RANK", "3"},
          {"OMPI_COMM_WORLD_SIZE", "4"},
          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
          {"SLURM_PROCID", "0"}};
  ProcessInfo info = process_info_from_env(lookup(env));
  CHECK(info.launcher == "openmpi");
  CHECK(info.rank == 3);
  CHECK(info.world_size == 4);
  CHECK(info.local_rank == 1);
  CHECK(info.local_world_size == 2);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);

  env["MASTER_ADDR"] = "10.0.0.7";
  env["MASTER_PORT"] = "4000";
  info = process_info_from_env(lookup(env));
  CHECK(info.master_addr == "10.0.0.7");
  CHECK(info.master_port == 4000);
}

TEST_CASE("process_info_from_env reads Slurm variables", "[comm][bootstrap]") {
  Env env{{"SLURM_PROCID", "6"},
          {"SLURM_NTASKS", "8"},
          {"SLURM_LOCALID", "2"},
          {"SLURM_NTASKS_PER_NODE", "4"},
          {"SLURM_LAUNCH_NODE_IPADDR", "10.1.2.3"}};
  ProcessInfo info = process_info_from_env(lookup(env));
  CHECK(info.launcher == "slurm");
  CHECK(info.rank == 6);
  CHECK(info.world_size == 8);
  CHECK(info.local_rank == 2);
  CHECK(info.local_world_size == 4);
  CHECK(info.master_addr == "10.1.2.3");
  CHECK(info.master_port == 29500);

  // Without SLURM_NTASKS_PER_NODE every task counts as local.
  env.erase("SLURM_NTASKS_PER_NODE");
  env["SLURM_LOCALID"] = "6";
  info = process_info_from_env(lookup(env));
  CHECK(info.local_rank == 6);
  CHECK(info.local_world_size == 8);

  // MASTER_ADDR/MASTER_PORT win over the launch node; without either, loopback.
  env["MASTER_ADDR"] = "head";
  env["MASTER_PORT"] = "30000";
  info = process_info_from_env(lookup(env));
  CHECK(info.master_addr == "head");
  CHECK(info.master_port == 30000);
  env.erase("MASTER_ADDR");
  env.erase("MASTER_PORT");
  env.erase("SLURM_LAUNCH_NODE_IPADDR");
  CHECK(process_info_from_env(lookup(env)).master_addr == "127.0.0.1");
}

TEST_CASE("process_info_from_env falls back to a single process", "[comm][bootstrap]") {
  ProcessInfo info = process_info_from_env(lookup({{"PATH", "/usr/bin"}}));
  CHECK(info.launcher == "single");
  CHECK(info.rank == 0);
  CHECK(info.world_size == 1);
  CHECK(info.local_rank == 0);
  CHECK(info.local_world_size == 1);
  CHECK(info.master_addr == "127.0.0.1");
  CHECK(info.master_port == 29500);
}

TEST_CASE("process_info_from_env rejects bad values naming the variable", "[comm][bootstrap]") {
  const Env torchrun{{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "4"}};
  const Env slurm{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "0"}};
  struct Case {
    Env base;
    std::string variable;
    std::optional<std::string> value;   // nullopt: remove the variable
    std::vector<std::string> expected;  // empty: a valid control case, no error
  };
  const std::vector<Case> cases = {
      {torchrun, "RANK", "abc", {"RANK", "'abc'", "not an integer"}},
      {torchrun, "RANK", "1x", {"RANK", "'1x'", "not an integer"}},
      {torchrun, "RANK", "", {"RANK", "not an integer"}},
      {torchrun, "WORLD_SIZE", "99999999999", {"WORLD_SIZE", "not an integer"}},
      {torchrun, "RANK", "4", {"RANK=4", "WORLD_SIZE=4"}},
      {torchrun, "RANK", "-1", {"RANK=-1"}},
      {torchrun, "WORLD_SIZE", "0", {"WORLD_SIZE=0"}},
      {torchrun, "LOCAL_RANK", "4", {"LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"}},
      {torchrun, "LOCAL_RANK", std::nullopt, {"LOCAL_RANK", "not set"}},
      {torchrun, "MASTER_PORT", "0", {"MASTER_PORT=0"}},
      {torchrun, "MASTER_PORT", "65535", {"MASTER_PORT=65535", "+1"}},
      {torchrun, "MASTER_PORT", "70000", {"MASTER_PORT=70000"}},
      {torchrun, "MASTER_PORT", "29500 ", {"MASTER_PORT", "not an integer"}},
      {torchrun, "MASTER_ADDR", "", {"MASTER_ADDR"}},
      {slurm, "SLURM_NTASKS", "four", {"SLURM_NTASKS", "'four'"}},
      {slurm, "SLURM_PROCID", "4", {"SLURM_PROCID=4", "SLURM_NTASKS=4"}},
      {slurm, "SLURM_NTASKS_PER_NODE", "2(x2)", {"SLURM_NTASKS_PER_NODE", "'2(x2)'"}},
      {slurm, "SLURM_LOCALID", "2", {}},  // valid: without NTASKS_PER_NODE all 4 are local
      {slurm, "SLURM_LOCALID", "4", {"SLURM_LOCALID=4", "SLURM_NTASKS"}},
      {{{"OMPI_COMM_WORLD_RANK", "2"},
        {"OMPI_COMM_WORLD_SIZE", "2"},
        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
        {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}},
       "OMPI_COMM_WORLD_LOCAL_RANK",
       "0",
       {"OMPI_COMM_WORLD_RANK=2", "OMPI_COMM_WORLD_SIZE=2"}},
  };
  for (const Case& c : cases) {
    Env env = c.base;
    if (c.value) {
      env[c.variable] = *c.value;
    } else {
      env.erase(c.variable);
    }
    INFO(c.variable << "=" << c.value.value_or("<unset>"));
    std::string message = error_of([&] { process_info_from_env(lookup(env)); });
    if (c.expected.empty()) CHECK(message.empty());
    for (const std::string& piece : c.expected) CHECK_THAT(message, ContainsSubstring(piece));
  }
}

TEST_CASE("rendezvous_options listens one above MASTER_PORT and reads the SLIME_BOOTSTRAP variables",
          "[comm][bootstrap]") {
  ProcessInfo info;
  info.master_addr = "node3";
  info.master_port = 29500;
  RendezvousOptions opt = slime::comm::rendezvous_options(info, lookup({}));
  CHECK(opt.host == "node3");
  CHECK(opt.port == 29501);
  CHECK(opt.timeout == std::chrono::minutes(5));
  CHECK(opt.file_dir.empty());
  CHECK(opt.run_id.empty());

  opt = slime::comm::rendezvous_options(info, lookup({{"SLIME_BOOTSTRAP_TIMEOUT_S", "2.5"},
                                                      {"SLIME_BOOTSTRAP_DIR", "/shared/x"},
                                                      {"SLIME_BOOTSTRAP_RUN_ID", "job42"}}));
  CHECK(opt.timeout == 2500ms);
  CHECK(opt.file_dir == "/shared/x");
  CHECK(opt.run_id == "job42");

  for (const char* bad : {"0", "-3", "ten", "5s", ""}) {
    INFO("SLIME_BOOTSTRAP_TIMEOUT_S=" << bad);
    CHECK_THAT(error_of([&] {
                 slime::comm::rendezvous_options(info, lookup({{"SLIME_BOOTSTRAP_TIMEOUT_S", bad}}));
               }),
               ContainsSubstring("SLIME_BOOTSTRAP_TIMEOUT_S"));
  }
  info.master_port = 65535;
  CHECK_THAT(error_of([&] { slime::comm::rendezvous_options(info, lookup({})); }), ContainsSubstring("master_port"));
}

TEST_CASE("broadcast_blob with one process returns at once and checks the size", "[comm][bootstrap]") {
  const std::string blob = binary_blob();
  RendezvousOptions opt;  // no host, no port: never used with one process
  auto start = Clock::now();
  CHECK(broadcast_blob(ProcessInfo{}, blob, opt) == blob);
  CHECK(Clock::now() - start < 1s);
  CHECK_THAT(error_of([&] { broadcast_blob(ProcessInfo{}, std::string(slime::comm::kMaxBlobBytes + 1, 'x'), opt); }),
             ContainsSubstring("exceeds"));
  CHECK_THAT(error_of([&] { broadcast_blob(rank_of(2, 2), "", tcp_options(1)); }), ContainsSubstring("rank"));
}

TEST_CASE("broadcast_blob over TCP reaches 2, 3 and 5 processes", "[comm][bootstrap]") {
  for (int world : {2, 3, 5}) {
    INFO("world size " << world);
    // 2 and 5: the test process is rank 0. 3: every rank is a child and the test only waits.
    // The 3-rank run carries the largest allowed blob, which forces partial reads and writes.
    const bool parent_is_root = world != 3;
    const std::string blob = world == 3 ? binary_blob(slime::comm::kMaxBlobBytes) : binary_blob();
    const RendezvousOptions opt = tcp_options(free_port());
    std::vector<Child> children;
    for (int r = parent_is_root ? 1 : 0; r < world; ++r) {
      children.push_back(spawn(expect_blob(rank_of(r, world), opt, blob, blob)));
    }
    if (parent_is_root) CHECK(broadcast_blob(rank_of(0, world), blob, opt) == blob);
    for (Child& c : children) require_ok(finish(c));
  }
}

TEST_CASE("broadcast_blob over TCP works when rank 0 starts last", "[comm][bootstrap]") {
  const std::string blob = binary_blob();
  const RendezvousOptions opt = tcp_options(free_port());
  std::vector<Child> children;
  children.push_back(spawn(expect_blob(rank_of(1, 3), opt, blob)));
  children.push_back(spawn(expect_blob(rank_of(2, 3), opt, blob)));
  children.push_back(spawn(expect_blob(rank_of(0, 3), opt, blob, blob, 200ms)));
  for (Child& c : children) require_ok(finish(c));
}

TEST_CASE("broadcast_blob over TCP names the ranks that never arrived", "[comm][bootstrap]") {
  const RendezvousOptions opt = tcp_options(free_port(), 1s);
  // Rank 1's own timeout is longer, so what it reports is rank 0's abort message.
  Child rank1 = spawn(expect_error(rank_of(1, 3), tcp_options(opt.port, 4s)));
  auto start = Clock::now();
  REQUIRE_THROWS_WITH(broadcast_blob(rank_of(0, 3), binary_blob(), opt),
                      ContainsSubstring("rank 2 of 3 never arrived") && ContainsSubstring("timed out after 1 s") &&
                          ContainsSubstring("127.0.0.1:" + std::to_string(opt.port)));
  CHECK(Clock::now() - start < 3s);
  ChildResult r = finish(rank1);
  CHECK_THAT(r.report, ContainsSubstring("rank 0 aborted") && ContainsSubstring("rank 2 of 3 never arrived"));
}

TEST_CASE("broadcast_blob client without a server times out naming the address", "[comm][bootstrap]") {
  const RendezvousOptions opt = tcp_options(free_port(), 500ms);
  auto start = Clock::now();
  REQUIRE_THROWS_WITH(broadcast_blob(rank_of(1, 2), "", opt),
                      ContainsSubstring("could not reach rank 0 at 127.0.0.1:" + std::to_string(opt.port)) &&
                          ContainsSubstring("timed out after 500 ms"));
  auto elapsed = Clock::now() - start;
  CHECK(elapsed >= 450ms);
  CHECK(elapsed < 2s);
}

TEST_CASE("broadcast_blob over TCP rejects a world-size mismatch", "[comm][bootstrap]") {
  const RendezvousOptions opt = tcp_options(free_port(), 3s);
  Child client = spawn(expect_error(rank_of(1, 2), opt));
  auto start = Clock::now();
  REQUIRE_THROWS_WITH(broadcast_blob(rank_of(0, 3), binary_blob(), opt),
                      ContainsSubstring("rank 1 reports world size 2") && ContainsSubstring("rank 0 has world size 3"));
  CHECK(Clock::now() - start < 2s);  // rejected on arrival, not at the timeout
  CHECK_THAT(finish(client).report, ContainsSubstring("rank 0 aborted") && ContainsSubstring("reports world size 2"));
}

TEST_CASE("broadcast_blob over TCP rejects duplicate and out-of-range ranks", "[comm][bootstrap]") {
  SECTION("two processes claim the same rank") {
    const RendezvousOptions opt = tcp_options(free_port(), 3s);
    Child a = spawn(expect_error(rank_of(1, 3), opt));
    Child b = spawn(expect_error(rank_of(1, 3), opt));
    REQUIRE_THROWS_WITH(broadcast_blob(rank_of(0, 3), binary_blob(), opt),
                        ContainsSubstring("two processes claim rank 1"));
    CHECK_THAT(finish(a).report, ContainsSubstring("two processes claim rank 1"));
    CHECK_THAT(finish(b).report, ContainsSubstring("two processes claim rank 1"));
  }
  SECTION("a hand-made hello with a rank outside the world") {
    // broadcast_blob itself refuses such a rank before connecting, so speak the wire format.
    const RendezvousOptions opt = tcp_options(free_port(), 3s);
    Child raw = spawn([opt] {
      namespace d = slime::comm::detail;
      const Clock::time_point deadline = Clock::now() + 3s;
      d::Fd fd = d::connect_with_retry(opt, 7, deadline, d::endpoint(opt.host, opt.port));
      auto hello = d::encode_hello(7, 3);
      if (d::send_all(fd.get(), hello.data(), hello.size(), deadline).status != d::IoStatus::kDone) {
        return std::string("send failed");
      }
      std::array<unsigned char, d::kReplyHeaderBytes> header{};
      if (d::recv_all(fd.get(), header.data(), header.size(), deadline).status != d::IoStatus::kDone) {
        return std::string("no reply");
      }
      return d::get_u32(header.data() + 4) == d::kStatusAbort ? std::string("ok") : std::string("not aborted");
    });
    REQUIRE_THROWS_WITH(broadcast_blob(rank_of(0, 3), binary_blob(), opt),
                        ContainsSubstring("claims rank 7") && ContainsSubstring("out of range"));
    require_ok(finish(raw));
  }
}

TEST_CASE("broadcast_blob over TCP ignores stray connections", "[comm][bootstrap]") {
  const std::string blob = binary_blob();
  const RendezvousOptions opt = tcp_options(free_port(), 5s);
  namespace d = slime::comm::detail;
  // One stray sends 16 bytes of HTTP, the other connects and stays silent until rank 0 closes
  // it. Both arrive before the real ranks, which start 300 ms late.
  Child http = spawn([opt] {
    const Clock::time_point deadline = Clock::now() + 3s;
    d::Fd fd = d::connect_with_retry(opt, 1, deadline, d::endpoint(opt.host, opt.port));
    const std::string junk = "GET / HTTP/1.1\r\n";
    d::send_all(fd.get(), junk.data(), junk.size(), deadline);
    char c;
    d::recv_all(fd.get(), &c, 1, deadline);  // wait for rank 0 to drop the connection
    return std::string("ok");
  });
  Child silent = spawn([opt] {
    const Clock::time_point deadline = Clock::now() + 3s;
    d::Fd fd = d::connect_with_retry(opt, 1, deadline, d::endpoint(opt.host, opt.port));
    char c;
    d::recv_all(fd.get(), &c, 1, deadline);
    return std::string("ok");
  });
  Child rank1 = spawn(expect_blob(rank_of(1, 3), opt, blob, "", 300ms));
  Child rank2 = spawn(expect_blob(rank_of(2, 3), opt, blob, "", 300ms));
  CHECK(broadcast_blob(rank_of(0, 3), blob, opt) == blob);
  require_ok(finish(rank1));
  require_ok(finish(rank2));
  require_ok(finish(http));
  require_ok(finish(silent));
}

TEST_CASE("broadcast_blob through a shared directory reaches 3 processes", "[comm][bootstrap]") {
  TempDir dir;
  const std::string blob = binary_blob();
  const RendezvousOptions opt = file_options(dir.path, "run-1");
  std::vector<Child> children;
  // Readers start first and must poll; rank 0 writes 200 ms later.
  children.push_back(spawn(expect_blob(rank_of(1, 3), opt, blob)));
  children.push_back(spawn(expect_blob(rank_of(2, 3), opt, blob)));
  children.push_back(spawn(expect_blob(rank_of(0, 3), opt, blob, blob, 200ms)));
  for (Child& c : children) require_ok(finish(c));
  // Only the final file remains: the temp file was renamed, not copied.
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path)) {
    names.push_back(entry.path().filename().string());
  }
  CHECK(names == std::vector<std::string>{"slime-bootstrap-29501.bin"});
}

TEST_CASE("broadcast_blob through a shared directory skips a file left by another run", "[comm][bootstrap]") {
  TempDir dir;
  const std::string blob = binary_blob();
  // A previous run left its file behind; same port and world size, different run id.
  broadcast_blob(rank_of(0, 3), "stale", file_options(dir.path, "old"));
  const RendezvousOptions opt = file_options(dir.path, "new");
  Child rank1 = spawn(expect_blob(rank_of(1, 3), opt, blob));
  Child rank2 = spawn(expect_blob(rank_of(2, 3), opt, blob));
  std::this_thread::sleep_for(300ms);
  CHECK(broadcast_blob(rank_of(0, 3), blob, opt) == blob);
  require_ok(finish(rank1));
  require_ok(finish(rank2));

  // With no new rank 0, the timeout says what was found instead.
  CHECK_THAT(error_of([&] { broadcast_blob(rank_of(1, 3), "", file_options(dir.path, "newer", 300ms)); }),
             ContainsSubstring("another run") && ContainsSubstring("'new'"));
}

TEST_CASE("broadcast_blob through a shared directory rejects a world-size mismatch", "[comm][bootstrap]") {
  TempDir dir;
  broadcast_blob(rank_of(0, 3), binary_blob(), file_options(dir.path));
  CHECK_THAT(error_of([&] { broadcast_blob(rank_of(1, 2), "", file_options(dir.path)); }),
             ContainsSubstring("world size 3") && ContainsSubstring("world size 2"));
}

TEST_CASE("broadcast_blob through a shared directory times out naming the file", "[comm][bootstrap]") {
  TempDir dir;
  const RendezvousOptions opt = file_options(dir.path, "", 500ms);
  auto start = Clock::now();
  REQUIRE_THROWS_WITH(
      broadcast_blob(rank_of(1, 3), "", opt),
      ContainsSubstring(dir.path + "/slime-bootstrap-29501.bin") && ContainsSubstring("timed out after 500 ms"));
  CHECK(Clock::now() - start < 2s);
}
