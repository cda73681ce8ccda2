// slime/comm/local_comm.hpp: LocalComm, ranks as threads of one process that
// exchange tensors of one device (the CPU, or one CUDA device that all ranks
// share) through memory they can all read; the CPU backend of every parallel
// feature, and the way to run several ranks on one GPU. Exact and
// deterministic.
//
// How a collective runs: each rank publishes its pointers and counts in its
// slot of the group's table, meets the others at a barrier, computes its own
// output by reading the peers' buffers directly, and meets them again before
// it returns, so no rank frees or overwrites a buffer while a peer still reads
// it. Between the two barriers a rank writes only memory no peer reads: a
// reduction goes to a private scratch that is copied to the output after the
// second barrier (so all_reduce in place, and a reduce_scatter whose output is
// a view inside its own input, are safe), and an input that overlaps the
// output (other than an all_gather input that is exactly the rank's own slot
// of the output, as FSDP passes it) is staged into the scratch before it is
// published. Buffers of different ranks must not overlap; that is checked.
//
// Accumulation rule (bitwise run to run, independent of thread timing): every
// element is reduced over ranks in the fixed order 0, 1, ..., n-1.
//   f32:        accumulates in f32.
//   bf16, f16:  accumulate in f32 and round once to the storage type.
//   avg:        the f32 sum above divided by n in f32, then rounded once
//               (floating dtypes only).
//   i32, i64, u8: reduce in their own type; sum wraps modulo 2^bits.
//   max, min:   a NaN on any rank gives NaN.
// The CPU fold and the CUDA kernel share this rule (slime/comm/detail_reduce.hpp),
// so a CUDA group gives the CPU group's bits for the same inputs. One
// exception: the payload of a NaN that an f32 sum or avg produces or carries
// is the hardware's (x86 keeps an operand's, CUDA gives 0x7FFFFFFF); it is a
// NaN on both. bf16 and f16 results round NaN to one canonical value anyway.
//
// CUDA groups (create_group(n, timeout, Device::cuda(i)), run_local_ranks(...,
// device)): every tensor of a call lives on that device and each rank passes
// its own stream (a default Stream: the device's legacy default stream).
// Ranks are threads of one process on one device, so a rank reads the peers'
// buffers directly: cudaMemcpyAsync device to device, and for reductions a
// kernel that applies the rule above, both on the calling rank's stream. The
// backend is host-synchronous: a rank synchronizes its stream before it
// publishes (its inputs, as queued on its stream, are complete when the peers
// read them), again after queueing its reads (before the second barrier, so
// the peers may reuse their buffers), and a reduction once more after copying
// its result out of the scratch. Every call has therefore completed when it
// returns, as on the CPU. The cost: two or three stream synchronizations and
// two host barriers per call, and no overlap of communication with the
// rank's other work. It is for tests and single-GPU development; NcclComm is
// the backend for speed. A CUDA group holds at most kLocalCudaMaxRanks ranks
// (the reduction kernel takes every rank's pointer as a parameter), and each
// rank keeps a device scratch (as large as its largest reduction output or
// staged input) until its LocalComm is destroyed. The CUDA code is compiled
// in src/comm/local_comm_cuda.cu (slime::cuda) and reaches
// src/comm/local_comm.cpp, which is built without CUDA, as a table of
// function pointers that create_group binds inline in the caller's
// translation unit; where that unit has no CUDA, a CUDA group cannot be
// created (the call throws).
//
// Failures never hang. Every wait ends after the group's timeout (default
// 300 s): the group is aborted and the call throws naming the ranks that did
// not arrive. LocalGroup::abort(reason) wakes every waiter with an Error
// carrying the reason; an aborted group stays aborted. A rank whose LocalComm
// is destroyed (run_local_ranks destroys it when the rank's function returns)
// has left: peers waiting for it fail at once. Calls that disagree across
// ranks (different collectives, dtypes, counts, ops or roots; all_to_all_v
// counts that do not match what the peers send) are detected from the slot
// table the same way on every rank, so every rank throws and the group stays
// usable. A CUDA error inside a collective aborts the group (the failing rank
// will not reach the next barrier) and is rethrown.
//
// A LocalComm belongs to one thread at a time: its rank's.
//
// Compiled once in src/comm/local_comm.cpp (slime::core); run_local_ranks
// stays a template here.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/comm/detail_time.hpp"

namespace slime::comm {

// How long any LocalComm wait lasts before the group is declared stuck.
inline constexpr std::chrono::milliseconds kLocalCommTimeout = std::chrono::seconds(300);

// The most ranks a LocalComm group on a CUDA device holds: the reduction
// kernel takes one pointer per rank as a parameter (8 bytes each).
inline constexpr int kLocalCudaMaxRanks = 64;

class LocalGroup;
class LocalComm;

namespace detail {

using ::slime::detail::concat;

enum class LocalOp : uint8_t {
  barrier,
  all_gather,
  reduce_scatter,
  all_reduce,
  all_to_all,
  all_to_all_v,
  broadcast,
  split,
  send,
  recv
};

// What run_local_ranks reports for a rank's exception.
std::string describe_exception(const std::exception_ptr& e);

// The CUDA work of a LocalComm group on one device, compiled in
// src/comm/local_comm_cuda.cu. Each function makes `device` current, queues
// its work on `stream` (a cudaStream_t; nullptr: the legacy default stream)
// and throws a slime::Error for a failed CUDA call. Streams travel as void*
// so that this table has one definition with and without CUDA.
struct LocalCudaOps {
  // Stream-ordered device memory from slime's pool (counted in memory_stats).
  void* (*allocate)(int device, std::size_t bytes, void* stream);
  void (*deallocate)(int device, void* p, std::size_t bytes, void* stream) noexcept;
  // `bytes` from src to dst, both device memory.
  void (*copy)(int device, void* dst, const void* src, std::size_t bytes, void* stream);
  // out[i] = inputs[0][i] op ... op inputs[ranks - 1][i] for i < count, by the
  // rule of detail_reduce.hpp; `inputs` is a host array of `ranks` device
  // pointers (ranks <= kLocalCudaMaxRanks).
  void (*reduce)(int device, const void* const* inputs, int ranks, void* out, int64_t count, DType dtype, ReduceOp op,
                 void* stream);
  // Blocks the host until the work queued on `stream` has finished.
  void (*synchronize)(int device, void* stream);
};

#if SLIME_HAS_CUDA
const LocalCudaOps& local_cuda_ops();  // src/comm/local_comm_cuda.cu
#endif

// The table a group on `d` uses: nullptr for the CPU, and for a CUDA device
// where this translation unit has no CUDA (the group then refuses it). Inline
// on purpose: the caller's translation unit decides, since
// src/comm/local_comm.cpp is built without CUDA.
inline const LocalCudaOps* local_device_ops(Device d) {
  check_device_exists(d);
#if SLIME_HAS_CUDA
  if (d.is_cuda()) return &local_cuda_ops();
#endif
  return nullptr;
}

// What one rank published for the collective in flight. Its rank writes it
// before the first barrier; any rank reads it until the last barrier.
struct LocalSlot {
  LocalOp op = LocalOp::barrier;
  DType dtype = DType::f32;
  ReduceOp reduce = ReduceOp::sum;
  int64_t count = 0;  // elements per rank (all_gather, reduce_scatter, all_to_all) or in all (all_reduce, broadcast)
  int root = -1;
  const void* send = nullptr;  // what peers read
  std::size_t send_bytes = 0;
  void* recv = nullptr;  // what this rank writes
  std::size_t recv_bytes = 0;
  std::span<const Elems> send_counts, recv_counts;  // all_to_all_v
  int color = -1, key = 0;                          // split
  std::shared_ptr<LocalGroup> created;              // split: the new group, in its lowest old rank's slot
};

// A point-to-point message in a mailbox. It lives on the sender's stack: the
// sender does not return while it is queued or being copied.
struct LocalMessage {
  enum class State : uint8_t { queued, copying, done, rejected };
  const void* data = nullptr;
  Elems count{0};
  DType dtype = DType::f32;
  State state = State::queued;
  std::string error;  // set with State::rejected
};

}  // namespace detail

// The state the ranks of one LocalComm group share: the slot table, a
// generation-counted barrier, point-to-point mailboxes, the timeout and abort
// flag that keep every wait finite, and the device with (for CUDA) the table
// of its functions. Made by LocalComm::create_group and by split(); reach it
// through LocalComm::group().
class LocalGroup {
 public:
  // A CUDA `device` needs `cuda` (detail::local_device_ops(device)); throws
  // without it.
  explicit LocalGroup(int size, std::chrono::milliseconds timeout = kLocalCommTimeout, Device device = Device::cpu(),
                      const detail::LocalCudaOps* cuda = nullptr);
  LocalGroup(const LocalGroup&) = delete;
  LocalGroup& operator=(const LocalGroup&) = delete;

  int size() const { return size_; }
  // Where every tensor of the group's calls lives.
  Device device() const { return device_; }

  std::chrono::milliseconds timeout() const;
  // Applies to waits that start after the call; groups split off later inherit it.
  void set_timeout(std::chrono::milliseconds timeout);

  // Wakes every rank waiting in this group and in the groups split from it;
  // each throws an Error carrying `reason`, as does every later call. The
  // first reason sticks.
  void abort(std::string reason);

  bool aborted() const;

 private:
  friend class LocalComm;
  using Op = detail::LocalOp;
  using Clock = std::chrono::steady_clock;

  // Sets the flag, wakes the waiters, then aborts the children with the lock
  // released (so a parent and a child lock are never held together).
  void abort_locked(std::unique_lock<std::mutex>& lock, std::string reason);

  [[noreturn]] void fail_locked(std::unique_lock<std::mutex>& lock, std::string message);

  void throw_if_aborted_locked(int rank, Op op) const;

  // The calling rank's LocalComm is gone: it can take part in nothing more.
  void leave(int rank);

  void adopt_child(const std::shared_ptr<LocalGroup>& child);

  // Returns once all ranks have arrived. Throws on every rank of the
  // generation when they arrived from different collectives; on timeout, on
  // abort, or when a missing rank has left, aborts the group and throws.
  void arrive_and_wait(int rank, Op op);

  std::vector<int> missing_ranks_locked(bool only_left) const;

  std::vector<detail::LocalMessage*>& mailbox(int src, int dst);

  // Queues `msg` for `dst` and waits until dst has copied it (or rejected it).
  void send(int src, int dst, detail::LocalMessage& msg);

  // Takes the oldest message from `src` to `dst`, checks it matches and
  // copies it into `data` (on CUDA: on `stream`, waited for).
  void recv(int src, int dst, void* data, Elems count, DType dtype, void* stream);

  // The device side of a collective. On the CPU: memcpy, and nothing to wait
  // for. On CUDA: queued on `stream` (a cudaStream_t, nullptr: the legacy
  // default stream); finish() blocks the host until it has completed.
  void copy(void* dst, const void* src, std::size_t bytes, void* stream) const;
  void finish(void* stream) const;

  const int size_;
  const Device device_;
  const detail::LocalCudaOps* const cuda_;  // set for a CUDA device
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::chrono::milliseconds timeout_;
  bool aborted_ = false;
  std::string abort_reason_;
  // Barrier state, guarded by mutex_.
  uint64_t generation_ = 0;
  int arrivals_ = 0;
  std::vector<bool> arrived_;                // [rank]: arrived in the current generation
  std::vector<detail::LocalOp> arrived_op_;  // [rank]: the collective it arrived from
  std::string mismatch_;                     // set for a generation whose ranks disagreed
  std::vector<bool> left_;                   // [rank]
  std::vector<std::weak_ptr<LocalGroup>> children_;
  // [src * size + dst], oldest first; guarded by mutex_. A send blocks until
  // received, so a mailbox holds at most one message per sending thread.
  std::vector<std::vector<detail::LocalMessage*>> mailboxes_;
  // [rank]: written by its rank outside the lock before a barrier, read by all
  // after it; the barrier's mutex orders the two.
  std::vector<detail::LocalSlot> slots_;
};

// Comm over the ranks of a LocalGroup, for tensors of the group's device.
// Every call completes before it returns (on the CPU the stream is ignored;
// on CUDA the work runs on it and is waited for). send blocks until the
// receiver has copied the data, so a ring in which every rank sends first
// deadlocks (until the timeout) as it can with NCCL: order the calls (even
// ranks send first) instead.
class LocalComm final : public Comm {
 public:
  // n ranks sharing one new group on `device` (the CPU, or a CUDA device all
  // ranks share); hand comms[r] to the thread of rank r. Inline so that the
  // CUDA functions are bound where the caller has CUDA.
  static std::vector<std::unique_ptr<LocalComm>> create_group(int n,
                                                              std::chrono::milliseconds timeout = kLocalCommTimeout,
                                                              Device device = Device::cpu()) {
    return create_group_on(n, timeout, device, detail::local_device_ops(device));
  }

  ~LocalComm() override;
  LocalComm(const LocalComm&) = delete;
  LocalComm& operator=(const LocalComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  Device device() const override { return group_->device(); }
  std::string_view backend() const override { return "local"; }

  // The shared state: abort(), set_timeout().
  const std::shared_ptr<LocalGroup>& group() const { return group_; }

 protected:
  void do_all_gather(const void* send, void* recv, Elems per_rank, DType dtype, const Stream&) override;
  void do_reduce_scatter(const void* send, void* recv, Elems per_rank, DType dtype, ReduceOp op,
                         const Stream&) override;
  void do_all_reduce(const void* send, void* recv, Elems count, DType dtype, ReduceOp op, const Stream&) override;
  void do_all_to_all(const void* send, void* recv, Elems per_rank, DType dtype, const Stream&) override;
  void do_all_to_all_v(const void* send, std::span<const Elems> send_counts, void* recv,
                       std::span<const Elems> recv_counts, DType dtype, const Stream&) override;
  void do_broadcast(void* buffer, Elems count, DType dtype, int root, const Stream&) override;
  void do_send(const void* buffer, Elems count, DType dtype, int peer, const Stream&) override;
  void do_recv(void* buffer, Elems count, DType dtype, int peer, const Stream&) override;
  // A host barrier: it waits for no stream.
  void do_barrier() override { group_->arrive_and_wait(rank_, detail::LocalOp::barrier); }

  // Publish (color, key); barrier; the lowest old rank of each color creates
  // the group; barrier; members pick it up; barrier (the creator's slot stays
  // put until every member has read it).
  std::unique_ptr<Comm> do_split(int color, int key) override;

 private:
  LocalComm(std::shared_ptr<LocalGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  static std::vector<std::unique_ptr<LocalComm>> create_group_on(int n, std::chrono::milliseconds timeout,
                                                                 Device device, const detail::LocalCudaOps* cuda);

  // The CUDA stream a call runs on (nullptr on the CPU, and for a default
  // Stream: the legacy default stream); throws for a stream of another device.
  void* stream_handle(const Stream& s, std::string_view what) const;

  static void check_count(Elems count, std::string_view what);
  static void check_buffer(const void* p, Elems count, std::string_view what);

  static detail::LocalSlot slot(detail::LocalOp op, DType dtype, int64_t count, const void* send,
                                std::size_t send_bytes, void* recv, std::size_t recv_bytes);

  // This rank's private buffer on the group's device; grows, never shrinks,
  // so steady-state calls allocate nothing. Reused by the next call only
  // after the last barrier of this one (and, on CUDA, once this call's work
  // has finished: every call ends with it finished).
  void* scratch(std::size_t bytes, void* stream);
  const void* stage(const void* src, std::size_t bytes, void* stream);
  // After the last barrier: a reduction's result from the scratch into the
  // output, finished before the call returns.
  void copy_result(void* out, const void* result, std::size_t bytes, void* stream);

  void reduce(std::span<const detail::LocalSlot> table, std::size_t byte_offset, void* out, Elems count, DType dtype,
              ReduceOp op, void* stream);

  // One collective: publish this rank's slot, finish its queued work,
  // barrier, compute (read the peers, write only memory no peer reads; on
  // CUDA queued on `stream`), finish, barrier. `compute` runs only when the
  // ranks agree on the call, which every rank decides from the same table:
  // all compute, or all throw after the second barrier. A failure in the
  // device work aborts the group: this rank will not reach the barrier.
  template <class Compute>
  void run_collective(detail::LocalSlot s, void* stream, Compute&& compute);

  // "" when every rank's slot agrees with the others; otherwise what differs.
  std::string check_agreement(std::span<const detail::LocalSlot> table) const;

  std::shared_ptr<LocalGroup> group_;
  int rank_;
  std::vector<std::byte> scratch_;  // CPU groups
  void* device_scratch_ = nullptr;  // CUDA groups: device memory of device_scratch_bytes_
  std::size_t device_scratch_bytes_ = 0;
  std::vector<const void*> inputs_;  // reduce(): one pointer per rank
};

// Runs fn(Comm&) for ranks 0..n-1 of a new LocalComm group on `device`, each
// on a thread of its own (rank = comm.rank(); a CUDA device is made current
// on it), and returns when all have finished. fn is called concurrently from
// n threads. A rank whose fn returns leaves the group: peers still waiting
// for it in a collective or a recv fail at once.
//
// When a rank throws, the group is aborted so the others stop waiting (they
// throw Errors carrying "rank r threw: ..."), every thread is joined, and the
// first exception by time is rethrown: the root cause, since the others
// follow from the abort it triggers. Exceptions never escape a std::thread.
template <class F>
void run_local_ranks(int n, F&& fn, std::chrono::milliseconds timeout = kLocalCommTimeout,
                     Device device = Device::cpu()) {
  std::vector<std::unique_ptr<LocalComm>> comms = LocalComm::create_group(n, timeout, device);
  const std::shared_ptr<LocalGroup> group = comms[0]->group();
  std::mutex first_mutex;
  std::exception_ptr first;
  auto body = [&](int r) {
    try {
      DeviceGuard current(device);
      fn(static_cast<Comm&>(*comms[std::size_t(r)]));
    } catch (...) {
      const std::exception_ptr e = std::current_exception();
      {
        std::lock_guard lock(first_mutex);
        if (!first) first = e;
      }
      group->abort(detail::concat("rank ", r, " threw: ", detail::describe_exception(e)));
    }
    comms[std::size_t(r)].reset();  // leave the group
  };
  std::vector<std::thread> threads;
  threads.reserve(std::size_t(n));
  try {
    for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  } catch (...) {
    group->abort("run_local_ranks could not start a thread for every rank");
    for (std::thread& t : threads) t.join();
    throw;
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace slime::comm
