// slime/comm/local_comm.cpp: the bodies of slime/comm/local_comm.hpp (LocalGroup, LocalComm).
// Nothing here depends on SLIME_HAS_CUDA: CUDA groups reach the device through
// the detail::LocalCudaOps table they were created with.
#include "slime/comm/local_comm.hpp"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/comm/detail_reduce.hpp"
#include "slime/comm/detail_time.hpp"

namespace slime::comm {
namespace detail {

std::string describe_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

namespace {

std::string_view local_op_name(LocalOp op) {
  switch (op) {
    case LocalOp::barrier:
      return "barrier";
    case LocalOp::all_gather:
      return "all_gather";
    case LocalOp::reduce_scatter:
      return "reduce_scatter";
    case LocalOp::all_reduce:
      return "all_reduce";
    case LocalOp::all_to_all:
      return "all_to_all";
    case LocalOp::all_to_all_v:
      return "all_to_all_v";
    case LocalOp::broadcast:
      return "broadcast";
    case LocalOp::split:
      return "split";
    case LocalOp::send:
      return "send";
    case LocalOp::recv:
      return "recv";
  }
  return "?";
}

// "rank 2" or "ranks 2, 3".
std::string format_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (std::size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s;
}

bool bytes_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a), pb = reinterpret_cast<std::uintptr_t>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

// out[i] = in_0[i] op in_1[i] op ... op in_{n-1}[i], folded left in rank order
// (see the accumulation rule in detail_reduce.hpp).
template <class T>
void reduce_in_rank_order(std::span<const void* const> inputs, void* out_void, int64_t count, ReduceOp op) {
  T* out = static_cast<T*>(out_void);
  const int ranks = int(inputs.size());
  visit_reduce_op<T>(op, [&](auto combine, bool average) {
    using Combine = decltype(combine);
    for (int64_t i = 0; i < count; ++i) out[i] = reduce_over_ranks<T, Combine>(inputs.data(), ranks, i, average);
  });
}

}  // namespace
}  // namespace detail

LocalGroup::LocalGroup(int size, std::chrono::milliseconds timeout, Device device, const detail::LocalCudaOps* cuda)
    : size_(size), device_(device), cuda_(device.is_cuda() ? cuda : nullptr), timeout_(timeout) {
  SLIME_CHECK(size >= 1, "LocalComm group needs at least 1 rank, got ", size);
  SLIME_CHECK(timeout.count() > 0, "LocalComm timeout must be positive, got ", timeout.count(), " ms");
  SLIME_CHECK(device.is_cpu() || cuda != nullptr, "LocalComm on ", device,
              " needs the CUDA backend, but the group was created from code built without CUDA"
              " (SLIME_HAS_CUDA is 0 there; link slime::cuda)");
  SLIME_CHECK(device.is_cpu() || size <= kLocalCudaMaxRanks, "LocalComm on ", device, " holds at most ",
              kLocalCudaMaxRanks, " ranks (the reduction kernel takes one pointer per rank), got ", size);
  slots_.resize(std::size_t(size));
  arrived_.assign(std::size_t(size), false);
  arrived_op_.assign(std::size_t(size), detail::LocalOp::barrier);
  left_.assign(std::size_t(size), false);
  mailboxes_.resize(std::size_t(size) * std::size_t(size));
}

std::chrono::milliseconds LocalGroup::timeout() const {
  std::lock_guard lock(mutex_);
  return timeout_;
}

void LocalGroup::set_timeout(std::chrono::milliseconds timeout) {
  SLIME_CHECK(timeout.count() > 0, "LocalComm timeout must be positive, got ", timeout.count(), " ms");
  std::lock_guard lock(mutex_);
  timeout_ = timeout;
}

void LocalGroup::abort(std::string reason) {
  std::unique_lock lock(mutex_);
  abort_locked(lock, std::move(reason));
}

bool LocalGroup::aborted() const {
  std::lock_guard lock(mutex_);
  return aborted_;
}

void LocalGroup::abort_locked(std::unique_lock<std::mutex>& lock, std::string reason) {
  if (!aborted_) {
    aborted_ = true;
    abort_reason_ = std::move(reason);
  }
  const std::string r = abort_reason_;
  std::vector<std::weak_ptr<LocalGroup>> children = children_;
  cv_.notify_all();
  lock.unlock();
  for (auto& weak : children)
    if (auto child = weak.lock()) child->abort(r);
  lock.lock();
}

void LocalGroup::fail_locked(std::unique_lock<std::mutex>& lock, std::string message) {
  abort_locked(lock, message);
  throw Error(std::move(message), __FILE__, __LINE__);
}

void LocalGroup::throw_if_aborted_locked(int rank, Op op) const {
  if (aborted_) {
    throw Error(detail::concat("LocalComm aborted (rank ", rank, " of ", size_, " in ", detail::local_op_name(op),
                               "): ", abort_reason_),
                __FILE__, __LINE__);
  }
}

void LocalGroup::leave(int rank) {
  std::lock_guard lock(mutex_);
  left_[std::size_t(rank)] = true;
  cv_.notify_all();
}

void LocalGroup::adopt_child(const std::shared_ptr<LocalGroup>& child) {
  std::unique_lock lock(mutex_);
  std::erase_if(children_, [](const std::weak_ptr<LocalGroup>& w) { return w.expired(); });
  children_.push_back(child);
  if (aborted_) {
    const std::string reason = abort_reason_;
    lock.unlock();
    child->abort(reason);
  }
}

void LocalGroup::arrive_and_wait(int rank, Op op) {
  std::unique_lock lock(mutex_);
  throw_if_aborted_locked(rank, op);
  const uint64_t generation = generation_;
  arrived_[std::size_t(rank)] = true;
  arrived_op_[std::size_t(rank)] = op;
  if (++arrivals_ == size_) {
    mismatch_.clear();
    if (std::any_of(arrived_op_.begin(), arrived_op_.end(), [&](Op o) { return o != arrived_op_[0]; })) {
      mismatch_ = "LocalComm collective mismatch: ranks called different collectives (";
      for (int r = 0; r < size_; ++r)
        mismatch_ += detail::concat(r ? ", " : "", "rank ", r, ": ", detail::local_op_name(arrived_op_[r]));
      mismatch_ += ")";
    }
    arrivals_ = 0;
    std::fill(arrived_.begin(), arrived_.end(), false);
    ++generation_;
    cv_.notify_all();
  } else {
    const auto deadline = Clock::now() + timeout_;
    while (generation_ == generation) {
      throw_if_aborted_locked(rank, op);
      if (std::vector<int> gone = missing_ranks_locked(true); !gone.empty()) {
        fail_locked(lock, detail::concat("LocalComm ", detail::local_op_name(op),
                                         " cannot complete: ", detail::format_ranks(gone), " of ", size_,
                                         " left (communicator destroyed or rank function returned) without"
                                         " arriving"));
      }
      if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && generation_ == generation && !aborted_) {
        fail_locked(lock, detail::concat("LocalComm barrier timed out after ", detail::format_duration(timeout_), ": ",
                                         detail::format_ranks(missing_ranks_locked(false)), " of ", size_,
                                         " did not arrive (collective ", detail::local_op_name(op), ")"));
      }
    }
  }
  // mismatch_ belongs to the generation just completed: the next one cannot
  // complete (and overwrite it) before this rank arrives again.
  if (!mismatch_.empty()) throw Error(mismatch_, __FILE__, __LINE__);
}

std::vector<int> LocalGroup::missing_ranks_locked(bool only_left) const {
  std::vector<int> ranks;
  for (int r = 0; r < size_; ++r)
    if (!arrived_[std::size_t(r)] && (!only_left || left_[std::size_t(r)])) ranks.push_back(r);
  return ranks;
}

std::vector<detail::LocalMessage*>& LocalGroup::mailbox(int src, int dst) {
  return mailboxes_[std::size_t(src) * std::size_t(size_) + std::size_t(dst)];
}

void LocalGroup::send(int src, int dst, detail::LocalMessage& msg) {
  using State = detail::LocalMessage::State;
  std::unique_lock lock(mutex_);
  throw_if_aborted_locked(src, Op::send);
  auto& box = mailbox(src, dst);
  box.push_back(&msg);
  cv_.notify_all();
  const auto deadline = Clock::now() + timeout_;
  // Only a queued message can be withdrawn; one the receiver is copying is
  // waited for (the copy is bounded), so it never reads a freed buffer.
  auto withdraw = [&] { box.erase(std::find(box.begin(), box.end(), &msg)); };
  bool timed_out = false;
  while (true) {
    if (msg.state == State::done) return;
    if (msg.state == State::rejected) throw Error(msg.error, __FILE__, __LINE__);
    if (msg.state == State::queued) {
      if (aborted_) {
        withdraw();
        throw_if_aborted_locked(src, Op::send);
      }
      if (left_[std::size_t(dst)]) {
        withdraw();
        fail_locked(lock, detail::concat("LocalComm send from rank ", src, " to rank ", dst, " cannot complete: rank ",
                                         dst, " left (communicator destroyed or rank function returned)"));
      }
      if (timed_out) {
        withdraw();
        fail_locked(lock, detail::concat("LocalComm send timed out after ", detail::format_duration(timeout_),
                                         ": rank ", dst, " of ", size_, " did not receive from rank ", src));
      }
      timed_out = cv_.wait_until(lock, deadline) == std::cv_status::timeout;
    } else {
      cv_.wait(lock);  // copying: bounded
    }
  }
}

void LocalGroup::recv(int src, int dst, void* data, Elems count, DType dtype, void* stream) {
  using State = detail::LocalMessage::State;
  std::unique_lock lock(mutex_);
  auto& box = mailbox(src, dst);
  const auto deadline = Clock::now() + timeout_;
  while (true) {
    throw_if_aborted_locked(dst, Op::recv);
    if (!box.empty()) break;
    if (left_[std::size_t(src)]) {
      fail_locked(lock,
                  detail::concat("LocalComm recv on rank ", dst, " from rank ", src, " cannot complete: rank ", src,
                                 " left (communicator destroyed or rank function returned) without sending"));
    }
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout && box.empty() && !aborted_) {
      fail_locked(lock, detail::concat("LocalComm recv timed out after ", detail::format_duration(timeout_), ": rank ",
                                       src, " of ", size_, " did not send to rank ", dst));
    }
  }
  detail::LocalMessage* msg = box.front();
  box.erase(box.begin());
  if (msg->count != count || msg->dtype != dtype) {
    msg->error =
        detail::concat("LocalComm send/recv mismatch: rank ", src, " sends ", msg->count.n, " ", dtype_name(msg->dtype),
                       " elements to rank ", dst, ", which receives ", count.n, " ", dtype_name(dtype));
    msg->state = State::rejected;
    cv_.notify_all();
    throw Error(msg->error, __FILE__, __LINE__);
  }
  msg->state = State::copying;
  lock.unlock();
  std::string failure;
  try {
    if (count.n > 0) {
      copy(data, msg->data, count.bytes(dtype), stream);
      finish(stream);  // the sender reuses its buffer once it returns
    }
  } catch (const std::exception& e) {
    failure = detail::concat("LocalComm recv on rank ", dst, " from rank ", src, " failed copying: ", e.what());
  }
  lock.lock();
  if (!failure.empty()) {
    msg->error = failure;
    msg->state = State::rejected;
    cv_.notify_all();
    throw Error(std::move(failure), __FILE__, __LINE__);
  }
  msg->state = State::done;
  cv_.notify_all();
}

void LocalGroup::copy(void* dst, const void* src, std::size_t bytes, void* stream) const {
  if (cuda_ != nullptr) {
    cuda_->copy(device_.index, dst, src, bytes, stream);
  } else {
    std::memcpy(dst, src, bytes);
  }
}

void LocalGroup::finish(void* stream) const {
  if (cuda_ != nullptr) cuda_->synchronize(device_.index, stream);
}

template <class Compute>
void LocalComm::run_collective(detail::LocalSlot s, void* stream, Compute&& compute) {
  const detail::LocalOp op = s.op;
  auto& table = group_->slots_;
  table[std::size_t(rank_)] = std::move(s);
  // Device work before a barrier: a failure leaves the peers waiting for a
  // rank that will not arrive, so it aborts the group before propagating.
  auto device_step = [&](auto&& step) {
    try {
      step();
    } catch (const std::exception& e) {
      group_->abort(detail::concat("rank ", rank_, " failed in ", detail::local_op_name(op), ": ", e.what()));
      throw;
    }
  };
  device_step([&] { group_->finish(stream); });  // the inputs are complete before a peer reads them
  group_->arrive_and_wait(rank_, op);
  const std::string disagreement = check_agreement(table);
  if (disagreement.empty()) {
    device_step([&] {
      compute(std::span<const detail::LocalSlot>(table));
      group_->finish(stream);  // the peers' buffers are read before they return
    });
  }
  group_->arrive_and_wait(rank_, op);
  if (!disagreement.empty()) throw Error(disagreement, __FILE__, __LINE__);
}

std::vector<std::unique_ptr<LocalComm>> LocalComm::create_group_on(int n, std::chrono::milliseconds timeout,
                                                                   Device device, const detail::LocalCudaOps* cuda) {
  SLIME_CHECK(n >= 1, "LocalComm::create_group needs n >= 1 ranks, got ", n);
  auto group = std::make_shared<LocalGroup>(n, timeout, device, cuda);
  std::vector<std::unique_ptr<LocalComm>> comms;
  comms.reserve(std::size_t(n));
  for (int r = 0; r < n; ++r) comms.push_back(std::unique_ptr<LocalComm>(new LocalComm(group, r)));
  return comms;
}

LocalComm::~LocalComm() {
  // Every call ends with its work finished, so nothing still uses the scratch.
  if (device_scratch_ != nullptr)
    group_->cuda_->deallocate(group_->device_.index, device_scratch_, device_scratch_bytes_, nullptr);
  group_->leave(rank_);
}

void* LocalComm::stream_handle(const Stream& s, std::string_view what) const {
  if (device().is_cpu()) return nullptr;
  SLIME_CHECK(s.device().is_cpu() || s.device() == device(), "LocalComm ", what, " on ", device(),
              ": the stream belongs to ", s.device());
  return s.device().is_cuda() ? s.handle() : nullptr;
}

void LocalComm::do_all_gather(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) {
  check_count(per_rank, "all_gather");
  check_buffer(send, per_rank, "all_gather input");
  check_buffer(recv, Elems(per_rank.n * size()), "all_gather output");
  void* const stream = stream_handle(s, "all_gather");
  const std::size_t bytes = per_rank.bytes(dtype);
  char* out = static_cast<char*>(recv);
  // Peers read `send` while this rank writes `out`: stage an input that
  // overlaps the output, unless it is exactly this rank's slot, where the
  // copy is skipped and the bytes stay as they are.
  const void* published = send;
  if (detail::bytes_overlap(send, bytes, out, bytes * std::size_t(size())) &&
      send != out + std::size_t(rank_) * bytes) {
    published = stage(send, bytes, stream);
  }
  run_collective(
      slot(detail::LocalOp::all_gather, dtype, per_rank.n, published, bytes, recv, bytes * std::size_t(size())), stream,
      [&](std::span<const detail::LocalSlot> table) {
        for (int j = 0; j < size(); ++j) {
          char* dst = out + std::size_t(j) * bytes;
          if (bytes > 0 && table[std::size_t(j)].send != dst)
            group_->copy(dst, table[std::size_t(j)].send, bytes, stream);
        }
      });
}

void LocalComm::do_reduce_scatter(const void* send, void* recv, Elems per_rank, DType dtype, ReduceOp op,
                                  const Stream& s) {
  check_count(per_rank, "reduce_scatter");
  check_buffer(send, Elems(per_rank.n * size()), "reduce_scatter input");
  check_buffer(recv, per_rank, "reduce_scatter output");
  void* const stream = stream_handle(s, "reduce_scatter");
  const std::size_t bytes = per_rank.bytes(dtype);
  void* result = scratch(bytes, stream);
  detail::LocalSlot mine =
      slot(detail::LocalOp::reduce_scatter, dtype, per_rank.n, send, bytes * std::size_t(size()), recv, bytes);
  mine.reduce = op;
  run_collective(std::move(mine), stream, [&](std::span<const detail::LocalSlot> table) {
    reduce(table, std::size_t(rank_) * bytes, result, per_rank, dtype, op, stream);
  });
  copy_result(recv, result, bytes, stream);
}

void LocalComm::do_all_reduce(const void* send, void* recv, Elems count, DType dtype, ReduceOp op, const Stream& s) {
  check_count(count, "all_reduce");
  check_buffer(send, count, "all_reduce input");
  check_buffer(recv, count, "all_reduce output");
  void* const stream = stream_handle(s, "all_reduce");
  const std::size_t bytes = count.bytes(dtype);
  void* result = scratch(bytes, stream);
  // The output is written only after the second barrier: in place, it is
  // what the peers read.
  detail::LocalSlot mine = slot(detail::LocalOp::all_reduce, dtype, count.n, send, bytes, recv, bytes);
  mine.reduce = op;
  run_collective(std::move(mine), stream,
                 [&](std::span<const detail::LocalSlot> table) { reduce(table, 0, result, count, dtype, op, stream); });
  copy_result(recv, result, bytes, stream);
}

void LocalComm::do_all_to_all(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) {
  check_count(per_rank, "all_to_all");
  check_buffer(send, Elems(per_rank.n * size()), "all_to_all input");
  check_buffer(recv, Elems(per_rank.n * size()), "all_to_all output");
  void* const stream = stream_handle(s, "all_to_all");
  const std::size_t bytes = per_rank.bytes(dtype), total = bytes * std::size_t(size());
  const void* published = detail::bytes_overlap(send, total, recv, total) ? stage(send, total, stream) : send;
  char* out = static_cast<char*>(recv);
  run_collective(slot(detail::LocalOp::all_to_all, dtype, per_rank.n, published, total, recv, total), stream,
                 [&](std::span<const detail::LocalSlot> table) {
                   if (bytes == 0) return;
                   for (int j = 0; j < size(); ++j) {
                     const char* src = static_cast<const char*>(table[std::size_t(j)].send);
                     group_->copy(out + std::size_t(j) * bytes, src + std::size_t(rank_) * bytes, bytes, stream);
                   }
                 });
}

void LocalComm::do_all_to_all_v(const void* send, std::span<const Elems> send_counts, void* recv,
                                std::span<const Elems> recv_counts, DType dtype, const Stream& s) {
  SLIME_CHECK(int(send_counts.size()) == size() && int(recv_counts.size()) == size(),
              "LocalComm all_to_all_v: ", send_counts.size(), " send and ", recv_counts.size(), " recv counts for ",
              size(), " ranks");
  int64_t send_total = 0, recv_total = 0;
  for (Elems c : send_counts) {
    check_count(c, "all_to_all_v send");
    send_total += c.n;
  }
  for (Elems c : recv_counts) {
    check_count(c, "all_to_all_v recv");
    recv_total += c.n;
  }
  check_buffer(send, Elems(send_total), "all_to_all_v input");
  check_buffer(recv, Elems(recv_total), "all_to_all_v output");
  void* const stream = stream_handle(s, "all_to_all_v");
  const std::size_t send_bytes = Elems(send_total).bytes(dtype), recv_bytes = Elems(recv_total).bytes(dtype);
  const void* published =
      detail::bytes_overlap(send, send_bytes, recv, recv_bytes) ? stage(send, send_bytes, stream) : send;
  detail::LocalSlot mine = slot(detail::LocalOp::all_to_all_v, dtype, 0, published, send_bytes, recv, recv_bytes);
  mine.send_counts = send_counts;
  mine.recv_counts = recv_counts;
  char* out = static_cast<char*>(recv);
  run_collective(std::move(mine), stream, [&](std::span<const detail::LocalSlot> table) {
    // Rank j's chunk for this rank starts after what j sends to ranks < rank_.
    for (int j = 0; j < size(); ++j) {
      const detail::LocalSlot& peer = table[std::size_t(j)];
      int64_t offset = 0;
      for (int k = 0; k < rank_; ++k) offset += peer.send_counts[std::size_t(k)].n;
      const std::size_t bytes = recv_counts[std::size_t(j)].bytes(dtype);
      if (bytes > 0) group_->copy(out, static_cast<const char*>(peer.send) + Elems(offset).bytes(dtype), bytes, stream);
      out += bytes;
    }
  });
}

void LocalComm::do_broadcast(void* buffer, Elems count, DType dtype, int root, const Stream& s) {
  check_count(count, "broadcast");
  check_buffer(buffer, count, "broadcast buffer");
  check_peer(root, "LocalComm broadcast root");
  void* const stream = stream_handle(s, "broadcast");
  const std::size_t bytes = count.bytes(dtype);
  const bool is_root = rank_ == root;
  detail::LocalSlot mine = is_root ? slot(detail::LocalOp::broadcast, dtype, count.n, buffer, bytes, nullptr, 0)
                                   : slot(detail::LocalOp::broadcast, dtype, count.n, nullptr, 0, buffer, bytes);
  mine.root = root;
  run_collective(std::move(mine), stream, [&](std::span<const detail::LocalSlot> table) {
    if (!is_root && bytes > 0) group_->copy(buffer, table[std::size_t(root)].send, bytes, stream);
  });
}

void LocalComm::do_send(const void* buffer, Elems count, DType dtype, int peer, const Stream& s) {
  check_count(count, "send");
  check_buffer(buffer, count, "send buffer");
  check_peer(peer, "LocalComm send peer");
  SLIME_CHECK(peer != rank_, "LocalComm send from rank ", rank_, " to itself would wait forever for its own recv");
  void* const stream = stream_handle(s, "send");
  group_->finish(stream);  // the data is complete before the receiver copies it
  detail::LocalMessage msg;
  msg.data = buffer;
  msg.count = count;
  msg.dtype = dtype;
  group_->send(rank_, peer, msg);
}

void LocalComm::do_recv(void* buffer, Elems count, DType dtype, int peer, const Stream& s) {
  check_count(count, "recv");
  check_buffer(buffer, count, "recv buffer");
  check_peer(peer, "LocalComm recv peer");
  SLIME_CHECK(peer != rank_, "LocalComm recv on rank ", rank_, " from itself would wait forever for its own send");
  group_->recv(peer, rank_, buffer, count, dtype, stream_handle(s, "recv"));
}

std::unique_ptr<Comm> LocalComm::do_split(int color, int key) {
  auto& table = group_->slots_;
  detail::LocalSlot s;
  s.op = detail::LocalOp::split;
  s.color = color;
  s.key = key;
  table[std::size_t(rank_)] = std::move(s);
  group_->arrive_and_wait(rank_, detail::LocalOp::split);

  // [new rank] -> old rank, ordered by (key, old rank).
  std::vector<int> members;
  if (color >= 0) {
    for (int r = 0; r < size(); ++r)
      if (table[std::size_t(r)].color == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(),
                     [&](int a, int b) { return table[std::size_t(a)].key < table[std::size_t(b)].key; });
  }
  const int creator = members.empty() ? -1 : *std::min_element(members.begin(), members.end());
  if (creator == rank_) {
    // Allocation failure here would leave the peers waiting: abort them.
    try {
      auto child = std::make_shared<LocalGroup>(int(members.size()), group_->timeout(), group_->device_, group_->cuda_);
      group_->adopt_child(child);
      table[std::size_t(rank_)].created = std::move(child);
    } catch (const std::exception& e) {
      group_->abort(detail::concat("split failed on rank ", rank_, ": ", e.what()));
      throw;
    }
  }
  group_->arrive_and_wait(rank_, detail::LocalOp::split);

  std::shared_ptr<LocalGroup> child = creator >= 0 ? table[std::size_t(creator)].created : nullptr;
  group_->arrive_and_wait(rank_, detail::LocalOp::split);
  table[std::size_t(rank_)].created.reset();
  if (!child) return nullptr;
  const int new_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
  return std::unique_ptr<Comm>(new LocalComm(std::move(child), new_rank));
}

void LocalComm::check_count(Elems count, std::string_view what) {
  SLIME_CHECK(count.n >= 0, "LocalComm ", what, ": negative element count ", count.n);
}

void LocalComm::check_buffer(const void* p, Elems count, std::string_view what) {
  SLIME_CHECK(p != nullptr || count.n == 0, "LocalComm ", what, " is null for ", count.n, " elements");
}

detail::LocalSlot LocalComm::slot(detail::LocalOp op, DType dtype, int64_t count, const void* send,
                                  std::size_t send_bytes, void* recv, std::size_t recv_bytes) {
  detail::LocalSlot s;
  s.op = op;
  s.dtype = dtype;
  s.count = count;
  s.send = send;
  s.send_bytes = send_bytes;
  s.recv = recv;
  s.recv_bytes = recv_bytes;
  return s;
}

void* LocalComm::scratch(std::size_t bytes, void* stream) {
  const detail::LocalCudaOps* cuda = group_->cuda_;
  if (cuda == nullptr) {
    if (scratch_.size() < bytes) scratch_.resize(bytes);
    return scratch_.data();
  }
  if (device_scratch_bytes_ < bytes) {
    // Released first (the last call's work on it has finished); nothing
    // dangles if the allocation throws.
    const int device = group_->device_.index;
    if (device_scratch_ != nullptr) cuda->deallocate(device, device_scratch_, device_scratch_bytes_, stream);
    device_scratch_ = nullptr;
    device_scratch_bytes_ = 0;
    device_scratch_ = cuda->allocate(device, bytes, stream);
    device_scratch_bytes_ = bytes;
  }
  return device_scratch_;
}

const void* LocalComm::stage(const void* src, std::size_t bytes, void* stream) {
  void* p = scratch(bytes, stream);
  if (bytes > 0) group_->copy(p, src, bytes, stream);
  return p;
}

void LocalComm::copy_result(void* out, const void* result, std::size_t bytes, void* stream) {
  if (bytes == 0) return;
  group_->copy(out, result, bytes, stream);
  group_->finish(stream);
}

void LocalComm::reduce(std::span<const detail::LocalSlot> table, std::size_t byte_offset, void* out, Elems count,
                       DType dtype, ReduceOp op, void* stream) {
  if (count.n == 0) return;
  inputs_.clear();
  for (const detail::LocalSlot& s : table) inputs_.push_back(static_cast<const char*>(s.send) + byte_offset);
  if (const detail::LocalCudaOps* cuda = group_->cuda_) {
    cuda->reduce(group_->device_.index, inputs_.data(), size(), out, count.n, dtype, op, stream);
    return;
  }
  visit_dtype(dtype, [&](auto tag) {
    detail::reduce_in_rank_order<decltype(tag)>(std::span<const void* const>(inputs_), out, count.n, op);
  });
}

std::string LocalComm::check_agreement(std::span<const detail::LocalSlot> table) const {
  using detail::concat;
  using detail::LocalOp;
  const LocalOp op = table[0].op;
  const std::string name = concat("LocalComm ", detail::local_op_name(op), ": ");
  const bool same_count = op != LocalOp::all_to_all_v;
  const bool reduces = op == LocalOp::reduce_scatter || op == LocalOp::all_reduce;
  const detail::LocalSlot& first = table[0];
  for (int j = 1; j < size(); ++j) {
    const detail::LocalSlot& s = table[std::size_t(j)];
    if (s.dtype != first.dtype)
      return concat(name, "rank 0 passes ", first.dtype, " but rank ", j, " passes ", s.dtype);
    if (same_count && s.count != first.count)
      return concat(name, "rank 0 passes ", first.count, " elements but rank ", j, " passes ", s.count);
    if (reduces && s.reduce != first.reduce)
      return concat(name, "rank 0 reduces with ", reduce_op_name(first.reduce), " but rank ", j, " with ",
                    reduce_op_name(s.reduce));
    if (op == LocalOp::broadcast && s.root != first.root)
      return concat(name, "rank 0 broadcasts from root ", first.root, " but rank ", j, " from root ", s.root);
  }
  if (op == LocalOp::all_to_all_v) {
    // What j sends to i must be what i expects from j. Each rank reports a
    // mismatch it receives first, then one it sends, then any: every rank
    // throws, each naming the pair closest to it.
    auto mismatch = [&](int j, int i) {
      return table[std::size_t(j)].send_counts[std::size_t(i)] != table[std::size_t(i)].recv_counts[std::size_t(j)];
    };
    auto describe = [&](int j, int i) {
      return concat(name, "rank ", j, " sends ", table[std::size_t(j)].send_counts[std::size_t(i)].n,
                    " elements to rank ", i, ", but rank ", i, " expects ",
                    table[std::size_t(i)].recv_counts[std::size_t(j)].n, " elements from rank ", j);
    };
    for (int j = 0; j < size(); ++j)
      if (mismatch(j, rank_)) return describe(j, rank_);
    for (int i = 0; i < size(); ++i)
      if (mismatch(rank_, i)) return describe(rank_, i);
    for (int j = 0; j < size(); ++j)
      for (int i = 0; i < size(); ++i)
        if (mismatch(j, i)) return describe(j, i);
  }
  // A rank writes its output while the peers read their inputs.
  for (int r = 0; r < size(); ++r) {
    const detail::LocalSlot& a = table[std::size_t(r)];
    for (int p = 0; p < size(); ++p) {
      if (p == r) continue;
      const detail::LocalSlot& b = table[std::size_t(p)];
      if (detail::bytes_overlap(a.recv, a.recv_bytes, b.send, b.send_bytes))
        return concat(name, "the output of rank ", r, " overlaps the input of rank ", p,
                      "; every rank needs buffers of its own");
      if (p < r && detail::bytes_overlap(a.recv, a.recv_bytes, b.recv, b.recv_bytes))
        return concat(name, "the outputs of ranks ", p, " and ", r, " overlap; every rank needs buffers of its own");
    }
  }
  return {};
}

}  // namespace slime::comm
