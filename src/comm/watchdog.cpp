// slime/comm/watchdog.cpp: PeerWatchdog (slime/comm/watchdog.hpp).
//
// Wire format, one TCP connection between rank 0 and each other rank:
//   hello, rank r -> rank 0:  'W', rank (u32), world size (u32), big-endian
//   'H'                       heartbeat, both ways
//   'B'                       goodbye: the sender ends cleanly
//   'F'                       the sender failed (its own error); rank 0 relays it
//   'L', rank (u32), kind     rank 0 -> rank r: `rank` was lost (kind 0) or failed (kind 1)
#include "slime/comm/watchdog.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "slime/comm/detail_time.hpp"

namespace slime::comm {

namespace {

using detail::Clock;
using detail::Fd;

constexpr unsigned char kHello = 'W', kBeat = 'H', kBye = 'B', kFailed = 'F', kLost = 'L';
constexpr std::size_t kHelloSize = 9, kLostSize = 6;

// One byte or message on a non-blocking socket, never blocking: a full send
// buffer (a peer that stopped reading) drops a heartbeat; false on a closed
// connection.
bool send_now(int fd, const unsigned char* data, std::size_t size) {
  const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(200);
  const detail::IoResult r = detail::send_all(fd, data, size, deadline);
  return r.status == detail::IoStatus::kDone || r.status == detail::IoStatus::kTimeout;
}

struct Peer {
  int rank = -1;
  Fd fd;
  Clock::time_point last_heard;
  std::string in;  // bytes received and not yet parsed
  bool said_goodbye = false;
};

}  // namespace

WatchdogOptions watchdog_options(const ProcessInfo& info, const GetenvFn& getenv_fn) {
  WatchdogOptions o;
  o.host = info.master_addr;
  SLIME_CHECK(info.master_port >= 1 && info.master_port <= 65533, "MASTER_PORT=", info.master_port,
              " leaves no port for the peer watchdog, which listens on MASTER_PORT+2 (use a port <= 65533, or ",
              "SLIME_WATCHDOG_TIMEOUT_S=0 to turn the watchdog off)");
  o.port = info.master_port + 2;
  if (std::optional<std::string> v = getenv_fn("SLIME_WATCHDOG_TIMEOUT_S")) {
    if (*v == "0" || *v == "0.0" || *v == "off")
      o.enabled = false;
    else
      o.timeout = detail::parse_env_seconds("SLIME_WATCHDOG_TIMEOUT_S", *v);
  }
  return o;
}

WatchdogOptions watchdog_options(const ProcessInfo& info) { return watchdog_options(info, detail::system_getenv); }

PeerWatchdog::PeerWatchdog(const ProcessInfo& info, const WatchdogOptions& options, std::function<void()> abort)
    : info_(info), options_(options), abort_(std::move(abort)) {
  SLIME_CHECK(info.world_size >= 1 && info.rank >= 0 && info.rank < info.world_size, "PeerWatchdog: rank ", info.rank,
              " of ", info.world_size);
  SLIME_CHECK(options.timeout.count() > 0, "PeerWatchdog: the timeout must be positive");
  if (options_.interval.count() <= 0) options_.interval = std::max(std::chrono::milliseconds(1), options_.timeout / 4);
  if (options_.grace.count() < 0) options_.grace = options_.timeout;
  if (!options_.enabled || info.world_size == 1) return;
  int pipe_fds[2];
  SLIME_CHECK(::pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) == 0, "PeerWatchdog: pipe: ", detail::errno_text(errno));
  wake_read_ = Fd(pipe_fds[0]);
  wake_write_ = Fd(pipe_fds[1]);
  if (info.rank == 0) {
    RendezvousOptions ro;
    ro.host = options_.host;
    ro.port = options_.port;
    listener_ = detail::listen_on(ro, info.world_size, detail::endpoint(ro.host, ro.port) + " (peer watchdog)");
  }
  thread_ = std::thread([this] { run(); });
}

PeerWatchdog::~PeerWatchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  stopped_.notify_all();
  const unsigned char b = 0;
  (void)!::write(wake_write_.get(), &b, 1);
  thread_.join();
}

void PeerWatchdog::report_failure() {
  if (!thread_.joinable()) return;
  failed_ = true;
  const unsigned char b = 0;
  (void)!::write(wake_write_.get(), &b, 1);
}

void PeerWatchdog::check() const {
  std::lock_guard lock(mutex_);
  if (lost_rank_) SLIME_FAIL(lost_message_);
}

std::optional<int> PeerWatchdog::lost_rank() const {
  std::lock_guard lock(mutex_);
  return lost_rank_;
}

void PeerWatchdog::lose(int rank, const std::string& why) {
  {
    std::lock_guard lock(mutex_);
    if (lost_rank_) return;
    lost_rank_ = rank;
    lost_message_ = ::slime::detail::concat("peer watchdog (rank ", info_.rank, "): rank ", rank, " of ",
                                            info_.world_size, " was lost: ", why);
  }
  if (abort_) {
    try {
      abort_();
    } catch (...) {  // the abort is best effort; the grace exit below still ends the rank
    }
  }
}

void PeerWatchdog::run() {
  const int world = info_.world_size, me = info_.rank;
  const Clock::time_point start = Clock::now();
  const std::string timeout_text = detail::format_duration(options_.timeout) + " (SLIME_WATCHDOG_TIMEOUT_S)";
  std::vector<Peer> peers;    // rank 0: one per other rank (fd invalid until its hello); else: rank 0
  std::vector<Peer> pending;  // rank 0: accepted, hello not yet complete
  bool sent_failure = false;
  // (rank, kind) to relay to every other rank (rank 0 only).
  auto relay = [&](int rank, unsigned char kind) {
    if (me != 0) return;
    std::array<unsigned char, kLostSize> m{};
    m[0] = kLost;
    detail::put_u32(m.data() + 1, uint32_t(rank));
    m[5] = kind;
    for (Peer& p : peers)
      if (p.fd && p.rank != rank) (void)send_now(p.fd.get(), m.data(), m.size());
  };
  auto lost = [&](int rank, const std::string& why, unsigned char kind) {
    relay(rank, kind);
    lose(rank, why);
  };

  if (me == 0) {
    peers.resize(std::size_t(world));
    for (int r = 0; r < world; ++r) peers[std::size_t(r)].rank = r;
  } else {
    Peer p;
    p.rank = 0;
    try {
      RendezvousOptions ro;
      ro.host = options_.host;
      ro.port = options_.port;
      ro.timeout = options_.timeout;
      p.fd = detail::connect_with_retry(ro, me, start + options_.timeout,
                                        detail::endpoint(ro.host, ro.port) + " (peer watchdog)");
      std::array<unsigned char, kHelloSize> h{};
      h[0] = kHello;
      detail::put_u32(h.data() + 1, uint32_t(me));
      detail::put_u32(h.data() + 5, uint32_t(world));
      if (!send_now(p.fd.get(), h.data(), h.size())) SLIME_FAIL("the connection closed during the hello");
    } catch (const std::exception& e) {
      lose(0, ::slime::detail::concat("could not reach its watchdog: ", e.what()));
      p.fd.reset();
    }
    p.last_heard = Clock::now();
    peers.push_back(std::move(p));
  }

  Clock::time_point next_beat = Clock::now();
  while (!stop_ && !lost_rank()) {
    const Clock::time_point now = Clock::now();
    if (failed_ && !sent_failure) {
      sent_failure = true;
      const unsigned char f = kFailed;
      if (me == 0)
        relay(0, 1);
      else if (peers[0].fd)
        (void)send_now(peers[0].fd.get(), &f, 1);
    }
    if (now >= next_beat) {
      const unsigned char b = kBeat;
      for (Peer& p : peers)
        if (p.fd && !p.said_goodbye && !send_now(p.fd.get(), &b, 1))
          lost(p.rank, "its connection broke (the process died?)", 0);
      next_beat = now + options_.interval;
    }
    // Silence and ranks that never connected.
    for (Peer& p : peers) {
      if (p.rank == me || p.said_goodbye) continue;
      if (!p.fd && me == 0 && now - start > options_.timeout)
        lost(p.rank, "it never connected to rank 0's watchdog within " + timeout_text, 0);
      else if (p.fd && now - p.last_heard > options_.timeout)
        lost(p.rank, "it sent nothing for " + timeout_text + " (hung, stopped or unreachable)", 0);
    }
    if (lost_rank()) break;

    std::vector<pollfd> fds;
    fds.push_back({wake_read_.get(), POLLIN, 0});
    if (listener_) fds.push_back({listener_.get(), POLLIN, 0});
    const std::size_t first_pending = fds.size(), polled_pending = pending.size();
    for (Peer& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    const std::size_t first_peer = fds.size();
    std::vector<Peer*> polled;
    for (Peer& p : peers)
      if (p.fd && !p.said_goodbye) {
        fds.push_back({p.fd.get(), POLLIN, 0});
        polled.push_back(&p);
      }
    const int wait = std::max(1, detail::remaining_ms(next_beat));
    const int n = ::poll(fds.data(), fds.size(), wait);
    if (n < 0) {
      if (errno == EINTR) continue;
      lose(me, "poll failed: " + detail::errno_text(errno));
      break;
    }
    if (fds[0].revents != 0) {
      unsigned char drain[64];
      while (::read(wake_read_.get(), drain, sizeof drain) > 0) {
      }
    }
    // Rank 0: new connections, then hellos.
    if (listener_ && fds[1].revents != 0) {
      for (;;) {
        const int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) break;
        Peer p;
        p.fd = Fd(fd);
        p.last_heard = Clock::now();
        pending.push_back(std::move(p));
      }
    }
    for (std::size_t i = 0; i < polled_pending; ++i) {  // the ones accepted just now: next round
      if (fds[first_pending + i].revents == 0) continue;
      Peer& p = pending[i];
      unsigned char buf[kHelloSize];
      const ssize_t got = ::recv(p.fd.get(), buf, kHelloSize - p.in.size(), 0);
      if (got <= 0) {
        if (got == 0 || (errno != EAGAIN && errno != EINTR)) p.fd.reset();  // a stray connection
        continue;
      }
      p.in.append(reinterpret_cast<const char*>(buf), std::size_t(got));
      if (p.in.size() < kHelloSize) continue;
      const auto* h = reinterpret_cast<const unsigned char*>(p.in.data());
      const uint32_t rank = detail::get_u32(h + 1), size = detail::get_u32(h + 5);
      if (h[0] != kHello || size != uint32_t(world) || rank == 0 || rank >= uint32_t(world) || peers[rank].fd) {
        p.fd.reset();  // not one of this job's ranks, or a duplicate
        continue;
      }
      Peer& slot = peers[rank];
      slot.fd = std::move(p.fd);
      slot.last_heard = Clock::now();
    }
    std::erase_if(pending, [](const Peer& p) { return !p.fd || p.in.size() == kHelloSize; });

    // Messages from the peers.
    for (std::size_t i = 0; i < polled.size(); ++i) {
      if (fds[first_peer + i].revents == 0) continue;
      Peer& p = *polled[i];
      unsigned char buf[256];
      const ssize_t got = ::recv(p.fd.get(), buf, sizeof buf, 0);
      if (got < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (got <= 0) {
        lost(p.rank,
             got == 0 ? std::string("its connection closed without a goodbye (the process died?)")
                      : "its connection failed: " + detail::errno_text(errno),
             0);
        break;
      }
      p.last_heard = Clock::now();
      p.in.append(reinterpret_cast<const char*>(buf), std::size_t(got));
      std::size_t at = 0;
      while (at < p.in.size() && !lost_rank()) {
        const unsigned char type = static_cast<unsigned char>(p.in[at]);
        if (type == kBeat) {
          ++at;
        } else if (type == kBye) {
          ++at;
          p.said_goodbye = true;
        } else if (type == kFailed) {
          ++at;
          lost(p.rank, "it ended with an error", 1);
        } else if (type == kLost && me != 0) {
          if (p.in.size() - at < kLostSize) break;
          const auto* m = reinterpret_cast<const unsigned char*>(p.in.data()) + at;
          const int rank = int(detail::get_u32(m + 1));
          lose(rank, m[5] == 1 ? "it ended with an error (reported by rank 0)" : "reported by rank 0");
          at += kLostSize;
        } else {
          lost(p.rank, ::slime::detail::concat("it sent an unknown message byte ", int(type)), 0);
        }
      }
      p.in.erase(0, at);
    }
    // Rank r: rank 0 said goodbye, nothing left to watch.
    if (me != 0 && peers[0].said_goodbye) break;
  }

  if (!stop_ && lost_rank()) {
    // Lost: wait for the rank to unwind (the destructor), else end the process.
    std::unique_lock lock(mutex_);
    if (!stopped_.wait_for(lock, options_.grace, [&] { return stop_.load(); })) {
      std::fprintf(stderr, "slime: %s; the rank did not stop within %s after the abort: ending the process\n",
                   lost_message_.c_str(), detail::format_duration(options_.grace).c_str());
      std::fflush(stderr);
      std::_Exit(kWatchdogExitCode);
    }
  }
  // A clean end (or the rank unwound after a loss): goodbye to those still connected.
  if (!failed_ && !lost_rank()) {
    const unsigned char b = kBye;
    for (Peer& p : peers)
      if (p.fd) (void)send_now(p.fd.get(), &b, 1);
  } else if (failed_ && !sent_failure) {
    const unsigned char f = kFailed;
    if (me == 0)
      relay(0, 1);
    else if (!peers.empty() && peers[0].fd)
      (void)send_now(peers[0].fd.get(), &f, 1);
  }
}

}  // namespace slime::comm
