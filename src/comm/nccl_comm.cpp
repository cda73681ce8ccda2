// NcclComm: slime/comm/nccl_comm.hpp over NCCL. Every NCCL call is checked; a
// failure throws slime::Error naming the call, the rank and device, NCCL's
// error string and its last-error message.
//
// Nothing here sets NCCL_NVLS_ENABLE or any other NCCL variable or config
// field that would turn NVLink multicast on (see the header).
#include "slime/comm/nccl_comm.hpp"

#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <thread>

#include "slime/comm/bootstrap.hpp"
#include "slime/core/host_sync.hpp"

static_assert(sizeof(ncclUniqueId) == slime::comm::NcclComm::kUniqueIdBytes,
              "NcclComm::kUniqueIdBytes must equal sizeof(ncclUniqueId)");

namespace slime::comm {
namespace {

// Blocking communicators return ncclInProgress only when NCCL_COMM_BLOCKING=0
// overrides our config; the call's outcome is then the communicator's state
// once it leaves ncclInProgress.
ncclResult_t settle(ncclResult_t r, ncclComm_t comm) {
  while (r == ncclInProgress && comm != nullptr) {
    if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) return ncclInternalError;
    if (r == ncclInProgress) std::this_thread::yield();
  }
  return r;
}

[[noreturn]] void throw_nccl(ncclResult_t r, const char* expr, const std::string& where, ncclComm_t comm,
                             const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  const bool has_last = last != nullptr && *last != '\0';
  ::slime::detail::throw_error(
      file, line,
      ::slime::detail::concat("NCCL error ", int(r), " (", ncclGetErrorString(r), ") in ", expr, " on ", where,
                              has_last ? "; NCCL's last error: " : "", has_last ? last : ""));
}

}  // namespace
}  // namespace slime::comm

// Checks an NCCL call. `handle` is read after the call (it may be the call's
// output) and serves ncclGetLastError; `where` names the rank and device.
#define SLIME_NCCL_CHECK(expr, handle, where)                                                 \
  do {                                                                                        \
    ncclResult_t slime_nccl_r_ = (expr);                                                      \
    slime_nccl_r_ = ::slime::comm::settle(slime_nccl_r_, (handle));                           \
    if (slime_nccl_r_ != ncclSuccess) [[unlikely]]                                            \
      ::slime::comm::throw_nccl(slime_nccl_r_, #expr, (where), (handle), __FILE__, __LINE__); \
  } while (0)

namespace slime::comm {
namespace {

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::f32:
      return ncclFloat32;
    case DType::bf16:
      return ncclBfloat16;
    case DType::f16:
      return ncclFloat16;
    case DType::i32:
      return ncclInt32;
    case DType::i64:
      return ncclInt64;
    case DType::u8:
      return ncclUint8;
  }
  SLIME_FAIL("NcclComm: dtype ", int(t), " has no NCCL type");
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;  // floating dtypes only (Comm checks)
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  SLIME_FAIL("NcclComm: reduce op ", int(op), " has no NCCL op");
}

// "rank 1 of 2 on cuda:1"
std::string where(int rank, int size, Device d) {
  return ::slime::detail::concat("rank ", rank, " of ", size, " on ", d);
}

// Restores the calling thread's current device; for destructors and aborts,
// which must not throw and must not leave the device changed (NCCL's cleanup
// calls cudaSetDevice).
class DeviceRestore {
 public:
  explicit DeviceRestore(int device) noexcept {
    have_ = cudaGetDevice(&previous_) == cudaSuccess;
    if (device >= 0) (void)cudaSetDevice(device);
  }
  ~DeviceRestore() {
    if (have_) (void)cudaSetDevice(previous_);
    (void)cudaGetLastError();
  }
  DeviceRestore(const DeviceRestore&) = delete;
  DeviceRestore& operator=(const DeviceRestore&) = delete;

 private:
  int previous_ = 0;
  bool have_ = false;
};

// ncclGroupStart .. ncclGroupEnd; a group left by an exception is still
// closed, so the thread's NCCL group depth stays balanced. `Where` names the
// rank in an error message (built only on failure).
template <class Where>
class GroupScope {
 public:
  explicit GroupScope(Where where) : where_(where) { SLIME_NCCL_CHECK(ncclGroupStart(), nullptr, where_()); }
  ~GroupScope() {
    if (open_) (void)ncclGroupEnd();
  }
  void end() {
    open_ = false;
    SLIME_NCCL_CHECK(ncclGroupEnd(), nullptr, where_());
  }
  GroupScope(const GroupScope&) = delete;
  GroupScope& operator=(const GroupScope&) = delete;

 private:
  Where where_;
  bool open_ = true;
};

const char* byte_ptr(const void* p, std::size_t offset) { return static_cast<const char*>(p) + offset; }
char* byte_ptr(void* p, std::size_t offset) { return static_cast<char*>(p) + offset; }

}  // namespace

// ---- NcclAbortGroup --------------------------------------------------------

void NcclAbortGroup::abort_all() noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) {
    aborted_ = true;
    initiator_ = std::this_thread::get_id();
  }
  // Members cannot be destroyed meanwhile: their destructors take mutex_.
  for (NcclComm* c : members_) c->abort_handle();
}

bool NcclAbortGroup::aborted() const noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

std::thread::id NcclAbortGroup::initiator() const noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  return initiator_;
}

bool NcclAbortGroup::add(NcclComm* c) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_) {
    try {
      members_.push_back(c);
      return true;
    } catch (...) {
      // Out of memory: a communicator the group cannot abort is aborted now.
    }
  }
  c->abort_handle();
  return false;
}

void NcclAbortGroup::remove(NcclComm* c) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  members_.erase(std::remove(members_.begin(), members_.end(), c), members_.end());
}

// ---- NcclComm --------------------------------------------------------------

// What every call needs: a live handle, the communicator's device current,
// and the CUDA stream (a default Stream: the device's legacy default stream).
// Allocates nothing unless a check fails.
struct NcclComm::Call {
  Call(const NcclComm& c, const Stream& s, const char* what) : self(c), guard(c.device_), comm(c.handle_.load()) {
    if (comm == nullptr)
      SLIME_FAIL("NcclComm::", what, " on ", at(),
                 ": the communicator was aborted (a rank of its group failed, or abort() was called)");
    if (s.device().is_cuda() && s.device() != c.device_)
      SLIME_FAIL("NcclComm::", what, " on ", at(), ": the stream belongs to ", s.device());
    stream = s.device().is_cuda() ? s.handle() : nullptr;
  }
  std::string at() const { return where(self.rank_, self.size_, self.device_); }
  auto where_fn() const {
    return [this] { return at(); };
  }

  const NcclComm& self;
  DeviceGuard guard;
  ncclComm_t comm;
  cudaStream_t stream = nullptr;
};

NcclComm::NcclComm(::ncclComm* handle, int rank, int size, Device device, std::shared_ptr<NcclAbortGroup> group)
    : handle_(handle), rank_(rank), size_(size), device_(device), group_(std::move(group)) {}

NcclComm::~NcclComm() {
  // Destroyed by an exception: this rank failed. ncclCommDestroy would wait
  // for queued work and (across processes) for the peers' destroys, which may
  // never come, so abort instead, and the whole group with it.
  const bool unwinding = std::uncaught_exceptions() > 0;
  if (group_) {
    if (unwinding) group_->abort_all();
    group_->remove(this);
  } else if (unwinding) {
    abort_handle();
  }
  DeviceRestore restore(device_.index);
  if (ncclComm_t h = handle_.exchange(nullptr)) (void)ncclCommDestroy(h);
  if (barrier_buffer_ != nullptr) (void)cudaFreeAsync(barrier_buffer_, barrier_stream_.handle());
}

void NcclComm::abort_handle() noexcept {
  ncclComm_t h = handle_.exchange(nullptr);
  if (h == nullptr) return;
  DeviceRestore restore(device_.index);
  (void)ncclCommAbort(h);
}

void NcclComm::abort() noexcept { abort_handle(); }

void NcclComm::finish_setup() {
  const std::string at = where(rank_, size_, device_);
  barrier_stream_ = Stream::create(device_);
  {
    DeviceGuard guard(device_);
    SLIME_CUDA_CHECK(cudaMallocAsync(&barrier_buffer_, sizeof(int32_t), barrier_stream_.handle()));
    SLIME_CUDA_CHECK(cudaMemsetAsync(barrier_buffer_, 0, sizeof(int32_t), barrier_stream_.handle()));
  }
  if (group_ && !group_->add(this))
    SLIME_FAIL("NcclComm on ", at, ": another rank of its abort group failed; this communicator was aborted");
}

std::string NcclComm::unique_id() {
  ncclUniqueId id;
  SLIME_NCCL_CHECK(ncclGetUniqueId(&id), nullptr, std::string("this process (ncclGetUniqueId)"));
  return std::string(id.internal, sizeof(id.internal));
}

std::string NcclComm::nccl_version() {
  int v = 0;
  SLIME_NCCL_CHECK(ncclGetVersion(&v), nullptr, std::string("this process (ncclGetVersion)"));
  // NCCL_VERSION(X, Y, Z) is X * 10000 + Y * 100 + Z from 2.9 on.
  return ::slime::detail::concat(v / 10000, ".", (v / 100) % 100, ".", v % 100);
}

void NcclComm::group_start() { SLIME_NCCL_CHECK(ncclGroupStart(), nullptr, std::string("this thread")); }
void NcclComm::group_end() { SLIME_NCCL_CHECK(ncclGroupEnd(), nullptr, std::string("this thread")); }

std::unique_ptr<NcclComm> NcclComm::init_rank(const std::string& unique_id, int rank, int world, Device device) {
  return init_rank(unique_id, rank, world, device, nullptr);
}

std::unique_ptr<NcclComm> NcclComm::init_rank(const std::string& unique_id, int rank, int world, Device device,
                                              std::shared_ptr<NcclAbortGroup> group) {
  SLIME_CHECK(unique_id.size() == kUniqueIdBytes, "NcclComm::init_rank: the unique id must hold ", kUniqueIdBytes,
              " bytes (from NcclComm::unique_id()), got ", unique_id.size());
  SLIME_CHECK(world >= 1, "NcclComm::init_rank: world size ", world, " < 1");
  SLIME_CHECK(rank >= 0 && rank < world, "NcclComm::init_rank: rank ", rank, " outside [0, ", world, ")");
  SLIME_CHECK(device.is_cuda(), "NcclComm::init_rank: rank ", rank, " needs a CUDA device, got ", device);
  check_device_exists(device);
  if (!group) group = std::make_shared<NcclAbortGroup>();
  const std::string at = where(rank, world, device);
  SLIME_CHECK(!group->aborted(), "NcclComm::init_rank on ", at, ": its abort group was already aborted");

  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kUniqueIdBytes);
  DeviceGuard guard(device);  // NCCL binds the communicator to the current device
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 1;
  ncclComm_t handle = nullptr;
  SLIME_NCCL_CHECK(ncclCommInitRankConfig(&handle, world, id, rank, &config), handle, at);
  std::unique_ptr<NcclComm> c(new NcclComm(handle, rank, world, device, std::move(group)));
  c->finish_setup();
  return c;
}

std::unique_ptr<NcclComm> NcclComm::from_env(std::optional<Device> device) {
  const ProcessInfo info = process_info_from_env();
  Device d = Device::cpu();
  if (device) {
    d = *device;
  } else {
    const int count = cuda_device_count();
    if (info.local_rank < count) {
      d = Device::cuda(info.local_rank);
    } else if (count == 1) {
      d = Device::cuda(0);  // the launcher left each process one GPU (CUDA_VISIBLE_DEVICES per rank)
    } else {
      SLIME_FAIL("NcclComm::from_env: rank ", info.rank, " (", info.launcher, ") has local rank ", info.local_rank,
                 " but this process sees ", count,
                 " CUDA device(s); pass a device or give each process its own GPU (CUDA_VISIBLE_DEVICES)");
    }
  }
  check_device_exists(d);
  const std::string blob = info.rank == 0 ? unique_id() : std::string();
  const std::string id = broadcast_blob(info, blob, rendezvous_options(info));
  return init_rank(id, info.rank, info.world_size, d);
}

// ---- collectives -----------------------------------------------------------
// Zero-element calls return before NCCL: every rank passes the same count to
// a collective, so all of them skip it alike.

void NcclComm::do_all_gather(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) {
  if (per_rank.n == 0) return;
  Call call(*this, s, "all_gather");
  SLIME_NCCL_CHECK(ncclAllGather(send, recv, std::size_t(per_rank.n), nccl_dtype(dtype), call.comm, call.stream),
                   call.comm, call.at());
}

void NcclComm::do_reduce_scatter(const void* send, void* recv, Elems per_rank, DType dtype, ReduceOp op,
                                 const Stream& s) {
  if (per_rank.n == 0) return;
  Call call(*this, s, "reduce_scatter");
  SLIME_NCCL_CHECK(
      ncclReduceScatter(send, recv, std::size_t(per_rank.n), nccl_dtype(dtype), nccl_op(op), call.comm, call.stream),
      call.comm, call.at());
}

void NcclComm::do_all_reduce(const void* send, void* recv, Elems count, DType dtype, ReduceOp op, const Stream& s) {
  if (count.n == 0) return;
  Call call(*this, s, "all_reduce");
  SLIME_NCCL_CHECK(
      ncclAllReduce(send, recv, std::size_t(count.n), nccl_dtype(dtype), nccl_op(op), call.comm, call.stream),
      call.comm, call.at());
}

// One send and one receive per peer (self included) in one group, so all of
// them progress together. Rank j's chunk of `send` goes to rank j.
void NcclComm::do_all_to_all(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) {
  if (per_rank.n == 0) return;
  Call call(*this, s, "all_to_all");
  const ncclDataType_t type = nccl_dtype(dtype);
  const std::size_t chunk = per_rank.bytes(dtype);
  GroupScope group(call.where_fn());
  for (int peer = 0; peer < size_; ++peer) {
    const std::size_t offset = std::size_t(peer) * chunk;
    SLIME_NCCL_CHECK(ncclSend(byte_ptr(send, offset), std::size_t(per_rank.n), type, peer, call.comm, call.stream),
                     call.comm, call.at());
    SLIME_NCCL_CHECK(ncclRecv(byte_ptr(recv, offset), std::size_t(per_rank.n), type, peer, call.comm, call.stream),
                     call.comm, call.at());
  }
  group.end();
}

// As all_to_all with per-peer counts; chunks are packed in rank order (the
// offset of peer j's chunk is the sum of the counts before it). A zero count
// posts nothing: the peer's matching count is zero too, so it posts nothing
// either.
void NcclComm::do_all_to_all_v(const void* send, std::span<const Elems> send_counts, void* recv,
                               std::span<const Elems> recv_counts, DType dtype, const Stream& s) {
  Call call(*this, s, "all_to_all_v");
  SLIME_CHECK(int(send_counts.size()) == size_ && int(recv_counts.size()) == size_, "NcclComm::all_to_all_v on ",
              call.at(), ": ", send_counts.size(), " send and ", recv_counts.size(), " recv counts for ", size_,
              " ranks");
  const ncclDataType_t type = nccl_dtype(dtype);
  GroupScope group(call.where_fn());
  std::size_t send_offset = 0, recv_offset = 0;
  for (int peer = 0; peer < size_; ++peer) {
    const Elems sc = send_counts[std::size_t(peer)], rc = recv_counts[std::size_t(peer)];
    if (sc.n > 0)
      SLIME_NCCL_CHECK(ncclSend(byte_ptr(send, send_offset), std::size_t(sc.n), type, peer, call.comm, call.stream),
                       call.comm, call.at());
    if (rc.n > 0)
      SLIME_NCCL_CHECK(ncclRecv(byte_ptr(recv, recv_offset), std::size_t(rc.n), type, peer, call.comm, call.stream),
                       call.comm, call.at());
    send_offset += sc.bytes(dtype);
    recv_offset += rc.bytes(dtype);
  }
  group.end();
}

void NcclComm::do_broadcast(void* buffer, Elems count, DType dtype, int root, const Stream& s) {
  if (count.n == 0) return;
  Call call(*this, s, "broadcast");
  SLIME_NCCL_CHECK(ncclBroadcast(buffer, buffer, std::size_t(count.n), nccl_dtype(dtype), root, call.comm, call.stream),
                   call.comm, call.at());
}

// A lone send or receive blocks the GPU until its peer's match runs: two ranks
// exchanging must order their calls oppositely or group them.
void NcclComm::do_send(const void* buffer, Elems count, DType dtype, int peer, const Stream& s) {
  if (count.n == 0) return;
  Call call(*this, s, "send");
  SLIME_NCCL_CHECK(ncclSend(buffer, std::size_t(count.n), nccl_dtype(dtype), peer, call.comm, call.stream), call.comm,
                   call.at());
}

void NcclComm::do_recv(void* buffer, Elems count, DType dtype, int peer, const Stream& s) {
  if (count.n == 0) return;
  Call call(*this, s, "recv");
  SLIME_NCCL_CHECK(ncclRecv(buffer, std::size_t(count.n), nccl_dtype(dtype), peer, call.comm, call.stream), call.comm,
                   call.at());
}

// A one-element all-reduce on the communicator's own stream, then a host wait
// for it: it completes only once every rank has queued its part.
void NcclComm::do_barrier() {
  Call call(*this, barrier_stream_, "barrier");
  SLIME_NCCL_CHECK(ncclAllReduce(barrier_buffer_, barrier_buffer_, 1, ncclInt32, ncclSum, call.comm, call.stream),
                   call.comm, call.at());
  note_host_sync();
  SLIME_CUDA_CHECK(cudaStreamSynchronize(call.stream));
  // An abort ends the all-reduce early; that is no barrier.
  SLIME_CHECK(!aborted(), "NcclComm::barrier on ", call.at(), ": the communicator was aborted while waiting");
  ncclResult_t async = ncclSuccess;
  SLIME_NCCL_CHECK(ncclCommGetAsyncError(call.comm, &async), call.comm, call.at());
  if (async != ncclSuccess && async != ncclInProgress)
    throw_nccl(async, "barrier (asynchronous error)", call.at(), call.comm, __FILE__, __LINE__);
}

// ncclCommSplit is collective over this communicator: every rank calls it,
// those with a negative color too (as NCCL_SPLIT_NOCOLOR; they get nullptr).
// The child keeps this device and config and joins this abort group.
std::unique_ptr<Comm> NcclComm::do_split(int color, int key) {
  Call call(*this, Stream{}, "split");
  ncclComm_t child = nullptr;
  SLIME_NCCL_CHECK(ncclCommSplit(call.comm, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &child, nullptr),
                   child != nullptr ? child : call.comm, call.at());
  if (child == nullptr) return nullptr;
  std::unique_ptr<NcclComm> c(new NcclComm(child, -1, -1, device_, group_));
  SLIME_NCCL_CHECK(ncclCommUserRank(child, &c->rank_), child, call.at());
  SLIME_NCCL_CHECK(ncclCommCount(child, &c->size_), child, call.at());
  c->finish_setup();
  return c;
}

}  // namespace slime::comm
