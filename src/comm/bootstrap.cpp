// slime/comm/bootstrap.cpp: the bodies of slime/comm/bootstrap.hpp (launcher detection, the TCP
// and shared-directory rendezvous). Host-only: POSIX sockets and files, no CUDA.
#include "slime/comm/bootstrap.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "slime/comm/detail_time.hpp"
#include "slime/core/error.hpp"

namespace slime::comm {
namespace detail {

// Milliseconds left until `deadline`, rounded up so that a poll never spins with a 0 ms timeout
// while time remains; 0 once the deadline has passed.
int remaining_ms(Clock::time_point deadline) {
  Clock::duration left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  std::int64_t ms = std::chrono::ceil<std::chrono::milliseconds>(left).count();
  return static_cast<int>(std::min<std::int64_t>(ms, INT_MAX));
}

std::optional<std::string> system_getenv(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr) return std::nullopt;
  return std::string(value);
}

namespace {

// The whole string must be a base-10 integer: "12abc", " 12", "" and out-of-range values are
// errors, so a typo in a launch script fails here instead of becoming a wrong rank.
int parse_env_int(const char* name, const std::string& value) {
  int out = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  auto [ptr, ec] = std::from_chars(first, last, out);
  if (value.empty() || ec != std::errc() || ptr != last) {
    SLIME_FAIL("environment variable ", name, "='", value, "' is not an integer");
  }
  return out;
}

int require_env_int(const GetenvFn& getenv_fn, const char* name, const char* launcher) {
  std::optional<std::string> value = getenv_fn(name);
  if (!value) SLIME_FAIL("detected a ", launcher, " launch but ", name, " is not set");
  return parse_env_int(name, *value);
}

// The bootstrap listens on port+1 (see rendezvous_options), so port+1 must be a port too.
int parse_env_port(const char* name, const std::string& value) {
  int port = parse_env_int(name, value);
  if (port < 1 || port > 65534) {
    SLIME_FAIL("environment variable ", name, "=", value,
               " is not a usable port: it must lie in [1, 65534] because the bootstrap also "
               "listens on ",
               name, "+1");
  }
  return port;
}

}  // namespace

// A positive number of seconds, fractions allowed ("0.5").
std::chrono::milliseconds parse_env_seconds(const char* name, const std::string& value) {
  double seconds = 0;
  const char* first = value.data();
  const char* last = first + value.size();
  auto [ptr, ec] = std::from_chars(first, last, seconds);
  // The upper bound (~115 days) keeps the conversion to milliseconds from overflowing.
  if (value.empty() || ec != std::errc() || ptr != last || !(seconds > 0) || seconds > 1e7) {
    SLIME_FAIL("environment variable ", name, "='", value, "' is not a positive number of seconds");
  }
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(seconds * 1000)));
}

namespace {

// The variable each field came from, so a validation error names what the user has to fix.
struct EnvNames {
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

void validate_ranks(const ProcessInfo& info, const EnvNames& names) {
  if (info.world_size < 1) {
    SLIME_FAIL("environment variable ", names.world_size, "=", info.world_size, " must be at least 1");
  }
  if (info.rank < 0 || info.rank >= info.world_size) {
    SLIME_FAIL("environment variable ", names.rank, "=", info.rank, " is outside [0, ", names.world_size, "=",
               info.world_size, ")");
  }
  if (info.local_world_size < 1) {
    SLIME_FAIL("environment variable ", names.local_world_size, "=", info.local_world_size, " must be at least 1");
  }
  if (info.local_rank < 0 || info.local_rank >= info.local_world_size) {
    SLIME_FAIL("environment variable ", names.local_rank, "=", info.local_rank, " is outside [0, ",
               names.local_world_size, "=", info.local_world_size, ")");
  }
}

// MASTER_ADDR/MASTER_PORT when set; otherwise `fallback_addr_var` (may be null) or the defaults.
void read_master(const GetenvFn& getenv_fn, ProcessInfo& info, const char* fallback_addr_var) {
  if (std::optional<std::string> addr = getenv_fn("MASTER_ADDR")) {
    if (addr->empty()) SLIME_FAIL("environment variable MASTER_ADDR is set but empty");
    info.master_addr = *addr;
  } else if (fallback_addr_var != nullptr) {
    if (std::optional<std::string> node = getenv_fn(fallback_addr_var); node && !node->empty()) {
      info.master_addr = *node;
    }
  }
  if (std::optional<std::string> port = getenv_fn("MASTER_PORT")) {
    info.master_port = parse_env_port("MASTER_PORT", *port);
  }
}

}  // namespace

std::string errno_text(int err) { return std::system_category().message(err); }

// "host:port", with brackets around an IPv6 literal.
std::string endpoint(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return "[" + host + "]:" + std::to_string(port);
  return host + ":" + std::to_string(port);
}

namespace {

// "2", "2, 3", "2-9, 12": runs of three or more collapse so that a timeout at thousands of
// ranks still reads as one line.
std::string format_rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    if (j - i >= 2) {
      out += std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]);
      i = j + 1;
    } else {
      out += std::to_string(ranks[i]);
      i += 1;
    }
  }
  return out;
}

// Waits until `fd` reports one of `events`, or an error or hangup that the next I/O call turns
// into an errno. Returns false when the deadline passes first.
bool wait_fd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int ms = remaining_ms(deadline);
    if (ms == 0) return false;
    pollfd p{fd, events, 0};
    int n = ::poll(&p, 1, ms);
    if (n > 0) return true;
    if (n < 0 && errno != EINTR) SLIME_FAIL("poll failed: ", errno_text(errno));
  }
}

}  // namespace

// Sends every byte on a non-blocking socket, across partial writes and EINTR. MSG_NOSIGNAL: a
// peer that went away is an EPIPE here, not a SIGPIPE that kills the process.
IoResult send_all(int fd, const void* data, std::size_t size, Clock::time_point deadline) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::send(fd, p, size, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      size -= static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (!wait_fd(fd, POLLOUT, deadline)) return {IoStatus::kTimeout};
    } else {
      return {IoStatus::kError, n < 0 ? errno : EIO};
    }
  }
  return {};
}

// Receives exactly `size` bytes on a non-blocking socket, across partial reads and EINTR.
IoResult recv_all(int fd, void* data, std::size_t size, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (size > 0) {
    ssize_t n = ::recv(fd, p, size, 0);
    if (n > 0) {
      p += n;
      size -= static_cast<std::size_t>(n);
    } else if (n == 0) {
      return {IoStatus::kEof};
    } else if (errno == EINTR) {
      continue;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!wait_fd(fd, POLLIN, deadline)) return {IoStatus::kTimeout};
    } else {
      return {IoStatus::kError, errno};
    }
  }
  return {};
}

namespace {

class AddrInfoList {
 public:
  AddrInfoList() = default;
  AddrInfoList(const AddrInfoList&) = delete;
  AddrInfoList& operator=(const AddrInfoList&) = delete;
  ~AddrInfoList() {
    if (head_ != nullptr) ::freeaddrinfo(head_);
  }

  // Returns getaddrinfo's code: 0 on success.
  int resolve(const std::string& host, int port) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;
    std::string service = std::to_string(port);
    return ::getaddrinfo(host.c_str(), service.c_str(), &hints, &head_);
  }
  const addrinfo* head() const { return head_; }

 private:
  addrinfo* head_ = nullptr;
};

std::string gai_text(int code) { return code == EAI_SYSTEM ? errno_text(errno) : std::string(::gai_strerror(code)); }

Hello decode_hello(const unsigned char* p) {
  // Rank and size travel as u32 and are compared as int64, so junk above INT_MAX is out of
  // range rather than wrapping to a valid rank.
  return {get_u32(p), get_u32(p + 4), get_u32(p + 8), get_u32(p + 12)};
}

std::string encode_reply(std::uint32_t status, std::string_view payload) {
  std::string out(kReplyHeaderBytes + payload.size(), '\0');
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  put_u32(p, kMagic);
  put_u32(p + 4, status);
  put_u64(p + 8, payload.size());
  std::copy(payload.begin(), payload.end(), out.begin() + kReplyHeaderBytes);
  return out;
}

// One non-blocking attempt to tell a waiting client why rank 0 gives up, so it fails at once
// with rank 0's reason instead of at its own timeout. Failure to deliver changes nothing.
void try_send_abort(int fd, std::string_view message) {
  std::string reply = encode_reply(kStatusAbort, message.substr(0, std::min(message.size(), kMaxAbortMessageBytes)));
  (void)::send(fd, reply.data(), reply.size(), MSG_NOSIGNAL);
}

[[noreturn]] void abort_rendezvous(const std::vector<Fd>& ranks, int offender_fd, const std::string& message) {
  for (const Fd& fd : ranks) {
    if (fd) try_send_abort(fd.get(), message);
  }
  if (offender_fd >= 0) try_send_abort(offender_fd, message);
  SLIME_FAIL(message);
}

// Rank 0 holds one socket per rank until all have arrived, so a few thousand ranks overflow the
// common soft limit of 1024 descriptors. A process may raise its soft limit up to the hard limit
// by itself; beyond that accept() reports EMFILE and the error says what to raise.
void raise_fd_limit(int world_size) {
  const rlim_t wanted = static_cast<rlim_t>(world_size) + 256;
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0) return;
  if (lim.rlim_cur == RLIM_INFINITY || lim.rlim_cur >= wanted) return;
  lim.rlim_cur = lim.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, lim.rlim_max);
  (void)::setrlimit(RLIMIT_NOFILE, &lim);
}

}  // namespace

Fd listen_on(const RendezvousOptions& opt, int backlog, const std::string& where) {
  AddrInfoList addrs;
  if (int code = addrs.resolve(opt.host, opt.port); code != 0) {
    SLIME_FAIL("rank 0 cannot resolve the rendezvous host ", opt.host, ": ", gai_text(code));
  }
  int last_err = 0;
  for (const addrinfo* ai = addrs.head(); ai != nullptr; ai = ai->ai_next) {
    Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      last_err = errno;
      continue;
    }
    // A previous run's connections in TIME_WAIT must not block a restart on the same port.
    int one = 1;
    (void)::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), std::clamp(backlog, 16, 65535)) != 0) {
      last_err = errno;
      continue;
    }
    return fd;
  }
  std::string hint;
  if (last_err == EADDRNOTAVAIL) hint = " (the host must be an address of rank 0's machine)";
  if (last_err == EADDRINUSE) hint = " (another process holds the port)";
  SLIME_FAIL("rank 0 cannot listen on ", where, ": ", errno_text(last_err), hint);
}

namespace {

// Rank 0: wait until every other rank has connected and introduced itself, then send the blob.
// One poll() loop over the listener and the connections still owing their hello, so a slow or
// stray connection cannot hold up the others.
std::string tcp_root(const ProcessInfo& info, const std::string& blob, const RendezvousOptions& opt) {
  const Clock::time_point deadline = Clock::now() + opt.timeout;
  const std::string where = endpoint(opt.host, opt.port);
  const std::string prefix = "rendezvous at " + where + ": ";
  raise_fd_limit(info.world_size);
  Fd listener = listen_on(opt, info.world_size, where);

  struct Pending {
    Fd fd;
    std::array<unsigned char, kHelloBytes> hello{};
    std::size_t got = 0;
  };
  std::vector<Pending> pending;
  std::vector<Fd> ranks(static_cast<std::size_t>(info.world_size));  // [world]; [0] stays empty
  int arrived = 1;
  std::vector<pollfd> fds;

  // Handles a complete hello: registers the connection in `ranks` or leaves it to be dropped.
  // Throws when the hello shows a misconfigured job.
  auto take_hello = [&](Pending& p) {
    Hello h = decode_hello(p.hello.data());
    // Not our protocol (a port scanner, a health check): drop it and keep waiting.
    if (h.magic != kMagic) return;
    if (h.version != kProtocolVersion) {
      abort_rendezvous(ranks, p.fd.get(),
                       prefix + "a process speaks bootstrap protocol version " + std::to_string(h.version) +
                           " but rank 0 speaks version " + std::to_string(kProtocolVersion) + " (mixed slime builds?)");
    }
    if (h.world_size != info.world_size) {
      abort_rendezvous(ranks, p.fd.get(),
                       prefix + "rank " + std::to_string(h.rank) + " reports world size " +
                           std::to_string(h.world_size) + " but rank 0 has world size " +
                           std::to_string(info.world_size));
    }
    if (h.rank == 0) {
      abort_rendezvous(ranks, p.fd.get(), prefix + "a second process claims rank 0");
    }
    if (h.rank < 0 || h.rank >= info.world_size) {
      abort_rendezvous(ranks, p.fd.get(),
                       prefix + "a process claims rank " + std::to_string(h.rank) +
                           ", which is out of range for world size " + std::to_string(info.world_size));
    }
    Fd& slot = ranks[static_cast<std::size_t>(h.rank)];
    if (slot) {
      abort_rendezvous(ranks, p.fd.get(),
                       prefix + "two processes claim rank " + std::to_string(h.rank) + " (duplicate rank)");
    }
    slot = std::move(p.fd);
    ++arrived;
  };

  while (arrived < info.world_size) {
    int ms = remaining_ms(deadline);
    if (ms == 0) {
      std::vector<int> missing;
      for (int r = 1; r < info.world_size; ++r) {
        if (!ranks[static_cast<std::size_t>(r)]) missing.push_back(r);
      }
      abort_rendezvous(ranks, -1,
                       "rendezvous at " + where + " timed out after " + format_duration(opt.timeout) + ": " +
                           (missing.size() == 1 ? "rank " : "ranks ") + format_rank_list(missing) + " of " +
                           std::to_string(info.world_size) + " never arrived");
    }
    fds.clear();
    fds.push_back({listener.get(), POLLIN, 0});
    for (const Pending& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    int n = ::poll(fds.data(), fds.size(), ms);
    if (n < 0 && errno != EINTR) {
      const int err = errno;  // read before building the message can clobber it
      abort_rendezvous(ranks, -1, prefix + "poll failed: " + errno_text(err));
    }
    if (n <= 0) continue;

    // Backwards, so erasing entry i leaves the pollfd index of every unvisited entry intact.
    for (std::size_t i = pending.size(); i-- > 0;) {
      if (fds[i + 1].revents == 0) continue;
      Pending& p = pending[i];
      ssize_t got = ::recv(p.fd.get(), p.hello.data() + p.got, kHelloBytes - p.got, 0);
      bool keep = true;
      if (got > 0) {
        p.got += static_cast<std::size_t>(got);
        if (p.got == kHelloBytes) {
          take_hello(p);
          keep = false;  // registered (moved into `ranks`) or not ours
        }
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)) {
        keep = false;  // closed or failed before its hello: a client that gave up, or a stray
      }
      if (!keep) pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(i));
    }

    if (fds[0].revents == 0) continue;
    for (;;) {
      int fd = ::accept4(listener.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd >= 0) {
        pending.push_back(Pending{Fd(fd)});
        continue;
      }
      int err = errno;
      if (err == EAGAIN || err == EWOULDBLOCK) break;
      // Linux reports the new connection's own network errors through accept(); that
      // connection is gone, the listener is fine.
      if (err == EINTR || err == ECONNABORTED || err == EPROTO || err == ENETDOWN || err == ENOPROTOOPT ||
          err == EHOSTDOWN || err == ENONET || err == EHOSTUNREACH || err == EOPNOTSUPP || err == ENETUNREACH) {
        continue;
      }
      std::string hint =
          (err == EMFILE || err == ENFILE) ? " (raise the open-file limit, ulimit -n, above the world size)" : "";
      abort_rendezvous(ranks, -1,
                       prefix + "accept failed with " + std::to_string(arrived) + " of " +
                           std::to_string(info.world_size) + " ranks present: " + errno_text(err) + hint);
    }
  }

  // Everyone is here. The send phase gets a fresh timeout: ranks that arrived just before the
  // deadline must not fail for it, and a peer that stopped reading still cannot hang us.
  const std::string reply = encode_reply(kStatusBlob, blob);
  const Clock::time_point send_deadline = Clock::now() + opt.timeout;
  std::vector<int> failed;
  std::string first_error;
  for (int r = 1; r < info.world_size; ++r) {
    IoResult res = send_all(ranks[static_cast<std::size_t>(r)].get(), reply.data(), reply.size(), send_deadline);
    if (res.status == IoStatus::kDone) continue;
    failed.push_back(r);
    if (first_error.empty()) {
      first_error = res.status == IoStatus::kTimeout ? "timed out" : errno_text(res.err);
    }
  }
  if (!failed.empty()) {
    SLIME_FAIL(prefix, "rank 0 could not send the blob to ", failed.size() == 1 ? "rank " : "ranks ",
               format_rank_list(failed), ": ", first_error);
  }
  return blob;
}

}  // namespace

// Connects to rank 0, retrying with a short backoff: "connection refused" is normal while rank 0
// is still starting.
Fd connect_with_retry(const RendezvousOptions& opt, int rank, Clock::time_point deadline, const std::string& where) {
  std::chrono::milliseconds backoff(10);
  std::string last_error = "no attempt finished";
  for (;;) {
    AddrInfoList addrs;
    int code = addrs.resolve(opt.host, opt.port);
    if (code == 0) {
      for (const addrinfo* ai = addrs.head(); ai != nullptr; ai = ai->ai_next) {
        Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol));
        if (!fd) {
          last_error = errno_text(errno);
          continue;
        }
        int err = ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) == 0 ? 0 : errno;
        // A non-blocking connect, or one interrupted by a signal, completes in the background.
        if (err == EINPROGRESS || err == EINTR) {
          if (!wait_fd(fd.get(), POLLOUT, deadline)) {
            last_error = "connection attempt timed out";
            break;
          }
          socklen_t len = sizeof(err);
          if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
        }
        if (err == 0) return fd;
        last_error = errno_text(err);
      }
    } else if (code == EAI_AGAIN) {
      last_error = gai_text(code);  // DNS hiccup: retry like a refused connection
    } else {
      SLIME_FAIL("rendezvous at ", where, ": rank ", rank, " cannot resolve ", opt.host, ": ", gai_text(code));
    }
    int left = remaining_ms(deadline);
    if (left == 0) {
      SLIME_FAIL("rendezvous at ", where, " timed out after ", format_duration(opt.timeout), ": rank ", rank,
                 " could not reach rank 0 at ", where, " (last error: ", last_error, ")");
    }
    std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(left)));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

namespace {

std::string tcp_client(const ProcessInfo& info, const RendezvousOptions& opt) {
  const Clock::time_point deadline = Clock::now() + opt.timeout;
  const std::string where = endpoint(opt.host, opt.port);
  const std::string prefix = "rendezvous at " + where + ": rank " + std::to_string(info.rank);
  Fd sock = connect_with_retry(opt, info.rank, deadline, where);

  auto check = [&](IoResult res, const char* step) {
    switch (res.status) {
      case IoStatus::kDone:
        return;
      case IoStatus::kTimeout:
        SLIME_FAIL("rendezvous at ", where, " timed out after ", format_duration(opt.timeout), ": rank ", info.rank,
                   " reached rank 0 but timed out while ", step,
                   " (rank 0 waits for every rank; its error names the missing ones)");
      case IoStatus::kEof:
        SLIME_FAIL(prefix, ": rank 0 closed the connection while this rank was ", step, " (see rank 0's error)");
      case IoStatus::kError:
        SLIME_FAIL(prefix, ": connection to rank 0 failed while ", step, ": ", errno_text(res.err));
    }
  };

  std::array<unsigned char, kHelloBytes> hello = encode_hello(info.rank, info.world_size);
  check(send_all(sock.get(), hello.data(), hello.size(), deadline), "sending its hello");

  std::array<unsigned char, kReplyHeaderBytes> header{};
  check(recv_all(sock.get(), header.data(), header.size(), deadline), "waiting for the blob");
  const std::uint32_t magic = get_u32(header.data());
  const std::uint32_t status = get_u32(header.data() + 4);
  const std::uint64_t length = get_u64(header.data() + 8);
  if (magic != kMagic || (status != kStatusBlob && status != kStatusAbort)) {
    SLIME_FAIL(prefix, ": the peer is not a slime bootstrap rank 0 (bad reply header)");
  }
  const std::size_t limit = status == kStatusBlob ? kMaxBlobBytes : kMaxAbortMessageBytes;
  if (length > limit) {
    SLIME_FAIL(prefix, ": rank 0 announced ", length, " bytes, more than the limit of ", limit);
  }
  std::string payload(static_cast<std::size_t>(length), '\0');
  check(recv_all(sock.get(), payload.data(), payload.size(), deadline), "receiving the blob");
  if (status == kStatusAbort) SLIME_FAIL(prefix, ": rank 0 aborted the rendezvous: ", payload);
  return payload;
}

// ---- Shared-directory fallback. File layout, integers big-endian: magic, version, world_size,
// run_id length (u32 each), blob length (u64), run_id bytes, blob bytes. ----
constexpr std::uint32_t kFileMagic = 0x534c4d46;  // "SLMF"
constexpr std::uint32_t kFileVersion = 1;
constexpr std::size_t kFileHeaderBytes = 24;
constexpr std::size_t kMaxRunIdBytes = 4096;

std::string file_path(const RendezvousOptions& opt) {
  return opt.file_dir + "/slime-bootstrap-" + std::to_string(opt.port) + ".bin";
}

std::string encode_file(int world_size, const std::string& run_id, const std::string& blob) {
  std::string out(kFileHeaderBytes, '\0');
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  put_u32(p, kFileMagic);
  put_u32(p + 4, kFileVersion);
  put_u32(p + 8, static_cast<std::uint32_t>(world_size));
  put_u32(p + 12, static_cast<std::uint32_t>(run_id.size()));
  put_u64(p + 16, blob.size());
  out += run_id;
  out += blob;
  return out;
}

void write_all_fd(int fd, const std::string& data, const std::string& path) {
  std::size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<std::size_t>(n);
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      SLIME_FAIL("cannot write ", path, ": ", errno_text(n < 0 ? errno : EIO));
    }
  }
}

// Rank 0 in file mode: replace the file atomically (temp file in the same directory, fsync,
// rename), so a reader sees either no file or a complete one, never a partial write.
std::string file_root(const ProcessInfo& info, const std::string& blob, const RendezvousOptions& opt) {
  SLIME_CHECK(opt.run_id.size() <= kMaxRunIdBytes, "run id of ", opt.run_id.size(), " bytes exceeds ", kMaxRunIdBytes);
  const std::string path = file_path(opt);
  // Shortens the window in which a reader can find a previous run's file.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    SLIME_FAIL("cannot remove the old bootstrap file ", path, ": ", errno_text(errno));
  }
  std::string tmp = opt.file_dir + "/.slime-bootstrap-" + std::to_string(opt.port) + ".XXXXXX";
  Fd fd(::mkstemp(tmp.data()));
  if (!fd) SLIME_FAIL("cannot create a temporary file in ", opt.file_dir, ": ", errno_text(errno));
  // Removes the temp file on every early exit; disarmed once it has been renamed.
  struct TempGuard {
    const std::string& path;
    bool armed = true;
    ~TempGuard() {
      if (armed) ::unlink(path.c_str());
    }
  } guard{tmp};
  (void)::fcntl(fd.get(), F_SETFD, FD_CLOEXEC);
  write_all_fd(fd.get(), encode_file(info.world_size, opt.run_id, blob), tmp);
  if (::fsync(fd.get()) != 0) SLIME_FAIL("cannot fsync ", tmp, ": ", errno_text(errno));
  // EINTR: the descriptor is closed and the data was already fsynced.
  if (int err = fd.close(); err != 0 && err != EINTR) {
    SLIME_FAIL("cannot close ", tmp, ": ", errno_text(err));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    SLIME_FAIL("cannot rename ", tmp, " to ", path, ": ", errno_text(errno));
  }
  guard.armed = false;
  // Makes the rename durable; best effort, since readers on this host already see it and a
  // directory that cannot be opened for fsync has still accepted the file.
  if (Fd dir(::open(opt.file_dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); dir) {
    (void)::fsync(dir.get());
  }
  return blob;
}

// The whole file, or std::nullopt when it does not exist (yet).
std::optional<std::string> read_file_if_present(const std::string& path, std::size_t max_bytes) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    if (errno == ENOENT) return std::nullopt;
    SLIME_FAIL("cannot open the bootstrap file ", path, ": ", errno_text(errno));
  }
  std::string out;
  char buf[65536];
  for (;;) {
    ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n > 0) {
      out.append(buf, static_cast<std::size_t>(n));
      if (out.size() > max_bytes) {
        SLIME_FAIL("bootstrap file ", path, " is larger than ", max_bytes, " bytes: corrupt?");
      }
    } else if (n == 0) {
      return out;
    } else if (errno != EINTR) {
      SLIME_FAIL("cannot read the bootstrap file ", path, ": ", errno_text(errno));
    }
  }
}

// Other ranks in file mode: poll for the file until rank 0 has written one for this run.
std::string file_client(const ProcessInfo& info, const RendezvousOptions& opt) {
  const Clock::time_point deadline = Clock::now() + opt.timeout;
  const std::string path = file_path(opt);
  std::chrono::milliseconds backoff(10);
  std::optional<std::string> stale_run_id;
  for (;;) {
    std::optional<std::string> file = read_file_if_present(path, kFileHeaderBytes + kMaxRunIdBytes + kMaxBlobBytes);
    if (file) {
      const auto* p = reinterpret_cast<const unsigned char*>(file->data());
      if (file->size() < kFileHeaderBytes || get_u32(p) != kFileMagic) {
        SLIME_FAIL("rendezvous through file ", path, ": not a slime bootstrap file");
      }
      if (get_u32(p + 4) != kFileVersion) {
        SLIME_FAIL("rendezvous through file ", path, ": file format version ", get_u32(p + 4),
                   ", this build reads version ", kFileVersion, " (mixed slime builds?)");
      }
      const std::uint64_t world = get_u32(p + 8);
      const std::uint64_t run_id_bytes = get_u32(p + 12);
      const std::uint64_t blob_bytes = get_u64(p + 16);
      if (run_id_bytes > kMaxRunIdBytes || blob_bytes > kMaxBlobBytes ||
          file->size() != kFileHeaderBytes + run_id_bytes + blob_bytes) {
        SLIME_FAIL("rendezvous through file ", path, ": truncated or corrupt file");
      }
      std::string run_id = file->substr(kFileHeaderBytes, run_id_bytes);
      if (run_id != opt.run_id) {
        // Another run's file: this run's rank 0 has not replaced it yet, so keep waiting.
        stale_run_id = std::move(run_id);
      } else if (world != static_cast<std::uint64_t>(info.world_size)) {
        SLIME_FAIL("rendezvous through file ", path, ": the file was written for world size ", world, " but rank ",
                   info.rank, " has world size ", info.world_size,
                   " (a stale file from an earlier run? set SLIME_BOOTSTRAP_RUN_ID)");
      } else {
        return file->substr(kFileHeaderBytes + run_id_bytes);
      }
    }
    int left = remaining_ms(deadline);
    if (left == 0) {
      std::string found = stale_run_id ? "only a file from another run was there (run id '" + *stale_run_id +
                                             "', this run '" + opt.run_id + "')"
                                       : "rank 0 never wrote it";
      SLIME_FAIL("rendezvous through file ", path, " timed out after ", format_duration(opt.timeout), ": ", found);
    }
    std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(left)));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
}

}  // namespace
}  // namespace detail

ProcessInfo process_info_from_env(const GetenvFn& getenv_fn) {
  ProcessInfo info;
  detail::EnvNames names{};
  if (getenv_fn("RANK") || getenv_fn("WORLD_SIZE")) {
    info.launcher = "torchrun";
    names = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
    info.rank = detail::require_env_int(getenv_fn, names.rank, "torchrun");
    info.world_size = detail::require_env_int(getenv_fn, names.world_size, "torchrun");
    info.local_rank = detail::require_env_int(getenv_fn, names.local_rank, "torchrun");
    info.local_world_size = detail::require_env_int(getenv_fn, names.local_world_size, "torchrun");
    detail::read_master(getenv_fn, info, nullptr);
  } else if (getenv_fn("OMPI_COMM_WORLD_RANK") || getenv_fn("OMPI_COMM_WORLD_SIZE")) {
    info.launcher = "openmpi";
    names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"};
    info.rank = detail::require_env_int(getenv_fn, names.rank, "OpenMPI");
    info.world_size = detail::require_env_int(getenv_fn, names.world_size, "OpenMPI");
    info.local_rank = detail::require_env_int(getenv_fn, names.local_rank, "OpenMPI");
    info.local_world_size = detail::require_env_int(getenv_fn, names.local_world_size, "OpenMPI");
    detail::read_master(getenv_fn, info, nullptr);
  } else if (getenv_fn("SLURM_PROCID")) {
    info.launcher = "slurm";
    names = {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
    info.rank = detail::require_env_int(getenv_fn, names.rank, "Slurm");
    info.world_size = detail::require_env_int(getenv_fn, names.world_size, "Slurm");
    info.local_rank = detail::require_env_int(getenv_fn, names.local_rank, "Slurm");
    if (std::optional<std::string> per_node = getenv_fn(names.local_world_size)) {
      info.local_world_size = detail::parse_env_int(names.local_world_size, *per_node);
    } else {
      info.local_world_size = info.world_size;
      names.local_world_size = "SLURM_NTASKS (SLURM_NTASKS_PER_NODE is unset)";
    }
    detail::read_master(getenv_fn, info, "SLURM_LAUNCH_NODE_IPADDR");
  } else {
    return info;
  }
  detail::validate_ranks(info, names);
  return info;
}

ProcessInfo process_info_from_env() { return process_info_from_env(detail::system_getenv); }

RendezvousOptions rendezvous_options(const ProcessInfo& info, const GetenvFn& getenv_fn) {
  SLIME_CHECK(info.master_port >= 1 && info.master_port <= 65534, "master_port=", info.master_port,
              " leaves no room for the bootstrap port master_port+1");
  RendezvousOptions opt;
  opt.host = info.master_addr;
  opt.port = info.master_port + 1;
  if (std::optional<std::string> v = getenv_fn("SLIME_BOOTSTRAP_TIMEOUT_S")) {
    opt.timeout = detail::parse_env_seconds("SLIME_BOOTSTRAP_TIMEOUT_S", *v);
  }
  if (std::optional<std::string> v = getenv_fn("SLIME_BOOTSTRAP_DIR")) opt.file_dir = *v;
  if (std::optional<std::string> v = getenv_fn("SLIME_BOOTSTRAP_RUN_ID")) opt.run_id = *v;
  return opt;
}

RendezvousOptions rendezvous_options(const ProcessInfo& info) {
  return rendezvous_options(info, detail::system_getenv);
}

std::string broadcast_blob(const ProcessInfo& info, const std::string& blob_on_root, const RendezvousOptions& opt) {
  SLIME_CHECK(info.world_size >= 1, "world_size=", info.world_size);
  SLIME_CHECK(info.rank >= 0 && info.rank < info.world_size, "rank=", info.rank, " world_size=", info.world_size);
  if (info.rank == 0) {
    SLIME_CHECK(blob_on_root.size() <= kMaxBlobBytes, "blob of ", blob_on_root.size(),
                " bytes exceeds the bootstrap limit of ", kMaxBlobBytes);
  }
  if (info.world_size == 1) return blob_on_root;
  SLIME_CHECK(opt.timeout.count() > 0, "timeout=", opt.timeout.count(), " ms");
  SLIME_CHECK(opt.port >= 1 && opt.port <= 65535, "port=", opt.port);
  if (!opt.file_dir.empty()) {
    return info.rank == 0 ? detail::file_root(info, blob_on_root, opt) : detail::file_client(info, opt);
  }
  SLIME_CHECK(!opt.host.empty(), "rendezvous host is empty");
  return info.rank == 0 ? detail::tcp_root(info, blob_on_root, opt) : detail::tcp_client(info, opt);
}

}  // namespace slime::comm
