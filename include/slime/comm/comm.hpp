// slime/comm/comm.hpp: Comm, the collective-communication interface every
// parallel feature is written against (LocalComm on the CPU, NcclComm on GPUs).
//
// The public calls take tensors and check them (dtype, device, sizes) before
// anything is sent; backends implement the protected do_* calls, which take
// raw pointers and element counts (Elems, never bytes). Every call is
// collective over the communicator unless it says otherwise (send/recv), and is
// ordered on the given stream (ignored on the CPU, where calls complete before
// returning).
#pragma once

#include <memory>
#include <numeric>
#include <span>
#include <string_view>
#include <vector>

#include "slime/core/tensor.hpp"

namespace slime::comm {

enum class ReduceOp : uint8_t { sum, avg, max, min };

inline std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

class Comm {
 public:
  virtual ~Comm() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The device this communicator's tensors must live on.
  virtual Device device() const = 0;
  virtual std::string_view backend() const = 0;

  // out[r * n : (r + 1) * n] = in of rank r, with n = in.numel();
  // out.numel() == size() * in.numel().
  void all_gather(const Tensor& in, Tensor& out, const Stream& stream = {}) {
    check_tensor(in, "all_gather input");
    check_pair(in, out, "all_gather");
    SLIME_CHECK(out.numel() == in.numel() * size(), "all_gather: output ", out.str(), " must hold size() = ", size(),
                " times the input's ", in.numel(), " elements");
    do_all_gather(in.data_ptr(), out.data_ptr(), Elems(in.numel()), in.dtype(), stream);
  }

  // out = op over ranks r of in_r[rank * n : (rank + 1) * n], n = out.numel();
  // in.numel() == size() * out.numel().
  void reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op = ReduceOp::sum, const Stream& stream = {}) {
    check_tensor(in, "reduce_scatter input");
    check_pair(in, out, "reduce_scatter");
    SLIME_CHECK(in.numel() == out.numel() * size(), "reduce_scatter: input ", in.str(), " must hold size() = ",
                size(), " times the output's ", out.numel(), " elements");
    check_reducible(in.dtype(), op);
    do_reduce_scatter(in.data_ptr(), out.data_ptr(), Elems(out.numel()), in.dtype(), op, stream);
  }

  // In place: t = op over ranks of t.
  void all_reduce(Tensor& t, ReduceOp op = ReduceOp::sum, const Stream& stream = {}) {
    check_tensor(t, "all_reduce tensor");
    check_reducible(t.dtype(), op);
    do_all_reduce(t.data_ptr(), t.data_ptr(), Elems(t.numel()), t.dtype(), op, stream);
  }

  // in and out split into size() equal chunks: chunk j of in goes to rank j,
  // chunk i of out comes from rank i.
  void all_to_all(const Tensor& in, Tensor& out, const Stream& stream = {}) {
    check_tensor(in, "all_to_all input");
    check_pair(in, out, "all_to_all");
    SLIME_CHECK(in.numel() == out.numel(), "all_to_all: input ", in.str(), " and output ", out.str(),
                " differ in size");
    SLIME_CHECK(in.numel() % size() == 0, "all_to_all: ", in.numel(), " elements do not split into ", size(),
                " equal chunks");
    do_all_to_all(in.data_ptr(), out.data_ptr(), Elems(in.numel() / size()), in.dtype(), stream);
  }

  // Ragged all-to-all over rows (dim 0): the first send_rows[0] rows of in go
  // to rank 0, the next send_rows[1] to rank 1, ...; out receives recv_rows[i]
  // rows from rank i, in rank order. Counts are rows, so a row is
  // numel / size(0) elements of the tensor's dtype. recv_rows must match what
  // the peers send (exchange counts first, e.g. with all_to_all on an i64
  // tensor).
  void all_to_all_v(const Tensor& in, std::span<const int64_t> send_rows, Tensor& out,
                    std::span<const int64_t> recv_rows, const Stream& stream = {}) {
    check_tensor(in, "all_to_all_v input");
    check_pair(in, out, "all_to_all_v");
    SLIME_CHECK(in.dim() >= 1 && out.dim() >= 1, "all_to_all_v needs tensors with a row dim");
    const int64_t row = in.size(0) ? in.numel() / in.size(0) : out.size(0) ? out.numel() / out.size(0) : 0;
    SLIME_CHECK((out.size(0) ? out.numel() / out.size(0) : row) == row, "all_to_all_v: input rows of ", row,
                " elements, output rows differ: ", in.str(), " vs ", out.str());
    SLIME_CHECK(int(send_rows.size()) == size() && int(recv_rows.size()) == size(), "all_to_all_v: ",
                send_rows.size(), " send and ", recv_rows.size(), " recv counts for ", size(), " ranks");
    const int64_t send_total = sum_counts(send_rows, "send"), recv_total = sum_counts(recv_rows, "recv");
    SLIME_CHECK(send_total <= in.size(0), "all_to_all_v: send counts add to ", send_total, " rows but input has ",
                in.size(0));
    SLIME_CHECK(recv_total <= out.size(0), "all_to_all_v: recv counts add to ", recv_total,
                " rows but output has ", out.size(0));
    std::vector<Elems> send, recv;
    send.reserve(send_rows.size());
    recv.reserve(recv_rows.size());
    for (int64_t c : send_rows) send.push_back(Elems(c * row));
    for (int64_t c : recv_rows) recv.push_back(Elems(c * row));
    do_all_to_all_v(in.data_ptr(), send, out.data_ptr(), recv, in.dtype(), stream);
  }

  // t on every rank = t on `root`.
  void broadcast(Tensor& t, int root, const Stream& stream = {}) {
    check_tensor(t, "broadcast tensor");
    check_peer(root, "broadcast root");
    do_broadcast(t.data_ptr(), Elems(t.numel()), t.dtype(), root, stream);
  }

  // Point to point; not collective: only `peer` takes part in the match.
  void send(const Tensor& t, int peer, const Stream& stream = {}) {
    check_tensor(t, "send tensor");
    check_peer(peer, "send peer");
    do_send(t.data_ptr(), Elems(t.numel()), t.dtype(), peer, stream);
  }
  void recv(Tensor& t, int peer, const Stream& stream = {}) {
    check_tensor(t, "recv tensor");
    check_peer(peer, "recv peer");
    do_recv(t.data_ptr(), Elems(t.numel()), t.dtype(), peer, stream);
  }

  // Returns once every rank has called barrier (blocks the host).
  void barrier() { do_barrier(); }

  // A new communicator of the ranks that pass the same `color`, ranked by
  // (key, old rank). Collective over this communicator. A negative color
  // takes no part and gets nullptr.
  std::unique_ptr<Comm> split(int color, int key) { return do_split(color, key); }

 protected:
  virtual void do_all_gather(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) = 0;
  virtual void do_reduce_scatter(const void* send, void* recv, Elems per_rank, DType dtype, ReduceOp op,
                                 const Stream& s) = 0;
  virtual void do_all_reduce(const void* send, void* recv, Elems count, DType dtype, ReduceOp op,
                             const Stream& s) = 0;
  virtual void do_all_to_all(const void* send, void* recv, Elems per_rank, DType dtype, const Stream& s) = 0;
  virtual void do_all_to_all_v(const void* send, std::span<const Elems> send_counts, void* recv,
                               std::span<const Elems> recv_counts, DType dtype, const Stream& s) = 0;
  virtual void do_broadcast(void* buffer, Elems count, DType dtype, int root, const Stream& s) = 0;
  virtual void do_send(const void* buffer, Elems count, DType dtype, int peer, const Stream& s) = 0;
  virtual void do_recv(void* buffer, Elems count, DType dtype, int peer, const Stream& s) = 0;
  virtual void do_barrier() = 0;
  virtual std::unique_ptr<Comm> do_split(int color, int key) = 0;

  void check_tensor(const Tensor& t, std::string_view what) const {
    SLIME_CHECK(t.defined(), what, " is undefined");
    SLIME_CHECK(t.device() == device(), what, " is ", t.str(), " but this ", backend(), " communicator works on ",
                device());
  }
  void check_pair(const Tensor& in, const Tensor& out, std::string_view what) const {
    check_tensor(out, std::string(what) + " output");
    SLIME_CHECK(in.dtype() == out.dtype(), what, ": dtype mismatch: input ", in.str(), ", output ", out.str());
  }
  void check_peer(int peer, std::string_view what) const {
    SLIME_CHECK(peer >= 0 && peer < size(), what, " ", peer, " out of range for ", size(), " ranks");
  }
  static void check_reducible(DType dtype, ReduceOp op) {
    SLIME_CHECK(!(op == ReduceOp::avg && !is_floating(dtype)), "avg reduction needs a floating dtype, got ",
                dtype_name(dtype));
  }
  static int64_t sum_counts(std::span<const int64_t> counts, std::string_view what) {
    int64_t total = 0;
    for (int64_t c : counts) {
      SLIME_CHECK(c >= 0, "all_to_all_v: negative ", what, " count ", c);
      total += c;
    }
    return total;
  }
};

}  // namespace slime::comm
