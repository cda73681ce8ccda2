// slime/comm/watchdog.hpp: PeerWatchdog, a heartbeat between the processes of
// a job, so that a rank whose peer died stops instead of waiting for NCCL's
// timeout (or forever, in a collective that has none).
//
// Star topology over TCP on the rendezvous host at MASTER_PORT+2 (the
// bootstrap uses MASTER_PORT+1, torchrun's store MASTER_PORT): rank 0 listens,
// every other rank connects. Each side sends a heartbeat every timeout / 4; a
// connection that closes without a goodbye, or sends nothing for `timeout`,
// is a lost peer. Rank 0 relays a loss (or a rank's failure) to every other
// rank, so all of them learn which rank was lost.
//
// On a loss the watchdog thread records the error ("rank 1 of 2 was lost:
// ..."), calls the abort function (ncclCommAbort of the rank's communicator:
// its collectives stop and its next call fails), and waits `grace` for the
// rank to unwind and destroy the watchdog; a rank still blocked then (a wait
// nothing can abort) is ended: the error on stderr and _exit(kExitCode).
// The rank's own error path calls check(), which throws the recorded
// slime::Error naming the lost rank instead of the communicator's.
//
// comm::run_ranks starts one for every rank of a launcher's job of several
// processes. SLIME_WATCHDOG_TIMEOUT_S (seconds, fractions allowed; default
// 60) sets the timeout, 0 turns the watchdog off. Compiled once in
// src/comm/watchdog.cpp (slime::core); host only.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "slime/comm/bootstrap.hpp"

namespace slime::comm {

struct WatchdogOptions {
  std::string host;  // rank 0 listens here, the others connect here
  int port = 0;
  // A peer that sends nothing for this long is lost; also the time every
  // rank has to connect to rank 0.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // Heartbeat period; 0: timeout / 4.
  std::chrono::milliseconds interval{0};
  // After a loss and the abort, how long the rank may take to unwind before
  // the process is ended; negative: the timeout.
  std::chrono::milliseconds grace{-1};
  bool enabled = true;
};

// The process exit status when the watchdog ends a rank that did not unwind.
inline constexpr int kWatchdogExitCode = 75;

// From the launcher's environment: rank 0's host at MASTER_PORT+2,
// SLIME_WATCHDOG_TIMEOUT_S (0: enabled = false). Throws naming the variable
// for a bad value, or a MASTER_PORT above 65533.
WatchdogOptions watchdog_options(const ProcessInfo& info, const GetenvFn& getenv_fn);
WatchdogOptions watchdog_options(const ProcessInfo& info);

class PeerWatchdog {
 public:
  // Starts watching (a background thread). Rank 0 binds its port here (a
  // bind failure throws); the other ranks connect in the background.
  // `abort` is called once, from the watchdog thread, when a peer is lost;
  // it must not throw.
  PeerWatchdog(const ProcessInfo& info, const WatchdogOptions& options, std::function<void()> abort = {});
  // Says goodbye to the peers (a clean end, not a loss) and stops.
  ~PeerWatchdog();
  PeerWatchdog(const PeerWatchdog&) = delete;
  PeerWatchdog& operator=(const PeerWatchdog&) = delete;

  // Tells the peers that this rank failed (they abort and name it), before
  // the destructor. For the rank's error path.
  void report_failure();

  // Throws the slime::Error of the loss, if a peer was lost.
  void check() const;
  // The lost rank, once one is.
  std::optional<int> lost_rank() const;

 private:
  void run();
  // Records the loss (the first only) and calls abort_.
  void lose(int rank, const std::string& why);

  ProcessInfo info_;
  WatchdogOptions options_;
  std::function<void()> abort_;
  detail::Fd listener_;
  detail::Fd wake_read_, wake_write_;  // a pipe: the destructor and report_failure wake the thread
  std::atomic<bool> stop_{false}, failed_{false};
  mutable std::mutex mutex_;
  std::condition_variable stopped_;
  std::optional<int> lost_rank_;
  std::string lost_message_;
  std::thread thread_;
};

}  // namespace slime::comm
