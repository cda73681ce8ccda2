// slime/comm/nccl_comm.hpp: NcclComm, the Comm backend over NCCL (one CUDA
// device per rank, ranks as processes or as threads of one process), and
// run_nccl_ranks, which runs n ranks as threads of this process.
//
// The header does not include nccl.h: the communicator is held through NCCL's
// opaque `struct ncclComm*`, and src/comm/nccl_comm.cpp makes every NCCL call.
// In builds without CUDA, NcclComm exists with the same factories, which throw
// a slime::Error saying that slime was built without CUDA.
//
// NVLink multicast (NVLS): the library never enables it (it sets no NCCL
// environment variable and no config field that would), and the GPU scripts
// (tools/gpu-test.sh, the multi-process test wrapper) export
// NCCL_NVLS_ENABLE=0. On shared hosts a program using multicast can take the
// GPUs out of service; keep NCCL_NVLS_ENABLE=0 in any launch script.
//
// Streams: every call is ordered on the given stream; a default Stream (the
// CPU stream) means the communicator device's legacy default stream. Calls
// return once the work is queued (barrier excepted).
//
// Determinism: all_gather, all_to_all(_v), broadcast and send/recv move bits
// exactly. Reductions (all_reduce, reduce_scatter) are NCCL's: the summation
// order depends on NCCL's algorithm, so bits may differ across NCCL versions,
// rank counts and topologies, and run to run is not guaranteed by NCCL
// (reductions of small integers, as in the tests, are exact in any order).
//
// Thread safety (NCCL's rules): one thread at a time may issue calls on a
// communicator; communicators of one process must sit on different devices
// when several threads issue calls concurrently. abort() may be called from
// any thread; aborting a communicator whose owner is inside an NCCL call (not
// just waiting on a stream) races with that call, as any NCCL abort does, so
// aborts are for failure paths.
//
// Lifetime: ncclCommDestroy waits for the communicator's queued work, and
// across processes for the destroys of the other ranks on the host. Destroy
// communicators in the same order on every rank, once the work queued on them
// has completed on every rank; a communicator destroyed by an exception is
// aborted instead (see NcclAbortGroup).
#pragma once

#include <cstddef>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/macros.hpp"

#if SLIME_HAS_CUDA
#include <atomic>
#include <mutex>
#include <thread>
#endif

// NCCL's opaque communicator: ncclComm_t is `struct ncclComm*` in nccl.h.
struct ncclComm;

namespace slime::comm {

#if SLIME_HAS_CUDA

class NcclComm;

// Communicators that fail together. When a member is destroyed while an
// exception is in flight, or abort_all() is called, every member still alive
// is aborted (ncclCommAbort): its queued kernels stop and its later calls
// throw, so no rank waits forever for a peer that failed. Communicators split
// from a member join its group. run_nccl_ranks puts all its ranks in one group;
// a communicator from init_rank or from_env gets a group of its own.
class NcclAbortGroup {
 public:
  NcclAbortGroup() = default;
  NcclAbortGroup(const NcclAbortGroup&) = delete;
  NcclAbortGroup& operator=(const NcclAbortGroup&) = delete;

  // Aborts every member; idempotent, never throws. Records the calling thread
  // as the initiator the first time.
  void abort_all() noexcept;
  bool aborted() const noexcept;
  // The thread that first called abort_all (a default id before then).
  std::thread::id initiator() const noexcept;

 private:
  friend class NcclComm;
  // Adds `c`, or aborts it at once (returning false) when the group has
  // already been aborted.
  bool add(NcclComm* c) noexcept;
  void remove(NcclComm* c) noexcept;

  mutable std::mutex mutex_;
  std::vector<NcclComm*> members_;
  bool aborted_ = false;
  std::thread::id initiator_;
};

class NcclComm final : public Comm {
 public:
  static constexpr std::size_t kUniqueIdBytes = 128;  // sizeof(ncclUniqueId)

  // A fresh ncclUniqueId as a 128-byte string, made once (on rank 0 or by the
  // thread that starts the ranks) and handed to every rank.
  static std::string unique_id();

  // Joins the communicator named by `unique_id` as `rank` of `world`, on CUDA
  // device `device` (one device per rank). Blocks until all `world` ranks have
  // called it, so ranks that are threads of one process must call it
  // concurrently, from one thread each (see run_nccl_ranks).
  static std::unique_ptr<NcclComm> init_rank(const std::string& unique_id, int rank, int world, Device device);
  // The same, joining `group` (see NcclAbortGroup).
  static std::unique_ptr<NcclComm> init_rank(const std::string& unique_id, int rank, int world, Device device,
                                             std::shared_ptr<NcclAbortGroup> group);

  // The communicator of all processes of this job: rank and world from the
  // launcher (torchrun, OpenMPI, Slurm; a lone process is a world of one),
  // rank 0's unique id sent to the others by broadcast_blob over
  // MASTER_ADDR:MASTER_PORT+1 (see slime/comm/bootstrap.hpp). The device
  // defaults to cuda:LOCAL_RANK (cuda:0 when the launcher leaves each process
  // exactly one visible GPU).
  static std::unique_ptr<NcclComm> from_env(std::optional<Device> device = {});

  // Brackets calls on several communicators (for example all ranks' halves of
  // a collective, issued by one thread) so NCCL launches them together; errors
  // of the calls inside surface at group_end. Nests. barrier() and split()
  // must not be called inside a group.
  static void group_start();
  static void group_end();

  // The NCCL library linked at run time, "2.28.9".
  static std::string nccl_version();

  // ncclCommDestroy; ncclCommAbort (of the whole group) instead when destroyed
  // during stack unwinding, so a failing rank does not wait for its peers.
  // Never throws.
  ~NcclComm() override;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return device_; }
  std::string_view backend() const override { return "nccl"; }

  // Aborts this communicator (ncclCommAbort): queued work stops, later calls
  // throw. Callable from any thread, idempotent, never throws.
  void abort() noexcept;
  bool aborted() const noexcept { return handle_.load() == nullptr; }
  const std::shared_ptr<NcclAbortGroup>& abort_group() const { return group_; }

 protected:
  void do_all_gather(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) override;
  void do_reduce_scatter(const void* send, void* recv, Elems per_rank, DType dtype, ReduceOp op,
                         const Stream& s) override;
  void do_all_reduce(const void* send, void* recv, Elems count, DType dtype, ReduceOp op, const Stream& s) override;
  void do_all_to_all(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) override;
  void do_all_to_all_v(const void* send, std::span<const Elems> send_counts, void* recv,
                       std::span<const Elems> recv_counts, DType dtype, const Stream& s) override;
  void do_broadcast(void* buffer, Elems count, DType dtype, int root, const Stream& s) override;
  void do_send(const void* buffer, Elems count, DType dtype, int peer, const Stream& s) override;
  void do_recv(void* buffer, Elems count, DType dtype, int peer, const Stream& s) override;
  void do_barrier() override;
  std::unique_ptr<Comm> do_split(int color, int key) override;

 private:
  struct Call;  // per-call checks: live handle, current device, stream
  friend class NcclAbortGroup;

  NcclComm(::ncclComm* handle, int rank, int size, Device device, std::shared_ptr<NcclAbortGroup> group);
  // Barrier stream and buffer, group membership; runs once the object owns
  // the handle, so a failure here still destroys the communicator.
  void finish_setup();
  void abort_handle() noexcept;  // the abort itself; the group's mutex may be held

  std::atomic<::ncclComm*> handle_;
  int rank_;
  int size_;
  Device device_;
  Stream barrier_stream_;           // non-blocking stream of barrier()'s all-reduce
  void* barrier_buffer_ = nullptr;  // one i32 on device_, stream-ordered on barrier_stream_
  std::shared_ptr<NcclAbortGroup> group_;
};

// Runs fn(NcclComm&) for ranks 0 .. n-1, each on its own thread with its own
// GPU (rank r on cuda:r), the communicators created concurrently with
// init_rank and put in one NcclAbortGroup. Returns after every thread has
// joined. When a rank throws, every communicator of the group (splits
// included) is aborted so that the other ranks stop waiting for it, and after
// the join the exception of the rank that failed first is rethrown (the
// others' are consequences of the abort).
//
// Catch2 (before 3.9) does not allow assertions off the main thread: have fn
// store what it computed, per rank, and check it after run_nccl_ranks returns.
template <class F>
void run_nccl_ranks(int n, F&& fn) {
  SLIME_CHECK(n >= 1, "run_nccl_ranks needs at least one rank, got ", n);
  const int devices = cuda_device_count();
  // Checked here, before any rank starts: a rank that failed before joining
  // ncclCommInitRank would leave the others waiting inside it.
  SLIME_CHECK(n <= devices, "run_nccl_ranks: ", n, " ranks need ", n, " CUDA devices (one each), this process sees ",
              devices);
  const std::string id = NcclComm::unique_id();
  auto group = std::make_shared<NcclAbortGroup>();
  const auto count = static_cast<std::size_t>(n);
  std::vector<std::exception_ptr> errors(count);
  std::vector<std::thread::id> thread_ids(count);
  // Destroyed after the join, not by their threads: a rank that is done must
  // not destroy its communicator while a peer may still fail and need it
  // aborted (ncclCommDestroy would wait for work that peer never joins).
  std::vector<std::unique_ptr<NcclComm>> comms(count);
  std::vector<std::thread> threads;
  threads.reserve(count);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      const auto slot = static_cast<std::size_t>(r);
      thread_ids[slot] = std::this_thread::get_id();
      try {
        DeviceGuard guard(Device::cuda(r));  // work that fn queues without naming a device lands on its GPU
        comms[slot] = NcclComm::init_rank(id, r, n, Device::cuda(r), group);
        fn(*comms[slot]);
      } catch (...) {
        errors[slot] = std::current_exception();
        group->abort_all();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  comms.clear();
  // The rank that started the abort failed first; the others failed because
  // of it. Without an abort (a lone rank failed) take the lowest failing rank.
  const std::thread::id initiator = group->initiator();
  for (int r = 0; r < n; ++r) {
    const auto slot = static_cast<std::size_t>(r);
    if (errors[slot] && thread_ids[slot] == initiator) std::rethrow_exception(errors[slot]);
  }
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

#else  // !SLIME_HAS_CUDA

// Builds without CUDA have no NCCL backend. The class keeps its factories so
// that code naming it compiles everywhere; each throws. No instance can exist.
class NcclComm final : public Comm {
 public:
  static constexpr std::size_t kUniqueIdBytes = 128;

  static std::string unique_id() { unavailable(); }
  static std::unique_ptr<NcclComm> init_rank(const std::string&, int, int, Device) { unavailable(); }
  static std::unique_ptr<NcclComm> from_env(std::optional<Device> = {}) { unavailable(); }
  static void group_start() { unavailable(); }
  static void group_end() { unavailable(); }
  static std::string nccl_version() { unavailable(); }

  int rank() const override { unavailable(); }
  int size() const override { unavailable(); }
  Device device() const override { unavailable(); }
  std::string_view backend() const override { return "nccl"; }
  void abort() noexcept {}
  bool aborted() const noexcept { return true; }

  [[noreturn]] static void unavailable() {
    SLIME_FAIL(
        "NcclComm needs the CUDA backend: slime was built without CUDA (configure with "
        "SLIME_ENABLE_CUDA=ON and link slime::cuda)");
  }

 protected:
  void do_all_gather(const void*, void*, Elems, DType, const Stream&) override { unavailable(); }
  void do_reduce_scatter(const void*, void*, Elems, DType, ReduceOp, const Stream&) override { unavailable(); }
  void do_all_reduce(const void*, void*, Elems, DType, ReduceOp, const Stream&) override { unavailable(); }
  void do_all_to_all(const void*, void*, Elems, DType, const Stream&) override { unavailable(); }
  void do_all_to_all_v(const void*, std::span<const Elems>, void*, std::span<const Elems>, DType,
                       const Stream&) override {
    unavailable();
  }
  void do_broadcast(void*, Elems, DType, int, const Stream&) override { unavailable(); }
  void do_send(const void*, Elems, DType, int, const Stream&) override { unavailable(); }
  void do_recv(void*, Elems, DType, int, const Stream&) override { unavailable(); }
  void do_barrier() override { unavailable(); }
  std::unique_ptr<Comm> do_split(int, int) override { unavailable(); }

 private:
  NcclComm() = default;
};

template <class F>
void run_nccl_ranks(int, F&&) {
  NcclComm::unavailable();
}

#endif  // SLIME_HAS_CUDA

}  // namespace slime::comm
