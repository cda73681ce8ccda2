// slime/rollout/weight_sync.hpp: refreshing the rollout engine's weights from
// the trainer after an optimizer step.
//
// A weight source is anything with
//   std::vector<WeightMeta> meta();                      names, shapes, dtypes, in order
//   template <class F> void for_each(F&& f);             f(name, const Tensor& full) in that order
// (ModelWeights below wraps a Qwen3Model or a Qwen3VLModel; ShardedWeights a sharded trainer,
// gathering one parameter at a time inside for_each, so it never holds the
// whole model twice).
//
// Colocated (trainer and engine in one process, `sync_colocated`): each
// tensor the source yields is copied, cast when the dtypes differ, straight
// into the engine's parameter of the same name: no round trip through files
// and no staging buffer, so the extra memory is what the source itself holds
// while it yields a tensor.
//
// Distributed (trainer ranks and engine ranks apart, `send_weights` on the
// trainer's sending rank, `receive_weights` on every engine rank, all on one
// Comm whose other members are engine ranks): first the metadata (weight
// version, names, shapes, dtype), then the tensors packed in order into
// buckets of at most `bucket_bytes` (a tensor larger than that travels alone),
// each bucket one broadcast from the sender. Both sides derive the bucket
// boundaries from the metadata. On CUDA the buckets are pipelined: each side
// stages through two buffers of half a bucket, and the broadcasts run on a
// stream of their own, so the sender packs piece k+1 while piece k is on the
// wire and the engine unpacks piece k while k+1 arrives (the wire time then
// hides the copies). The extra memory is one bucket on each side.
// With `verify`, the sender hashes (FNV-1a 64) the bytes it sent and
// broadcasts the hash; every engine hashes its parameters after the update
// and throws if they differ: the engine then holds the trainer's weights bit
// for bit. The engine reports the version it serves (Engine::weight_version).
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/tensor.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/rollout/engine.hpp"

namespace slime::rollout {

struct WeightMeta {
  std::string name;
  Shape shape;
  DType dtype = DType::f32;
};

struct WeightSyncConfig {
  std::size_t bucket_bytes = std::size_t(512) << 20;  // distributed buckets
  bool verify = false;                                // hash check after the update
};

struct WeightSyncStats {
  int64_t version = 0;
  std::size_t bytes = 0;  // payload bytes moved
  int buckets = 0;        // broadcasts of payload (distributed)
  double seconds = 0;
  uint64_t hash = 0;  // FNV-1a 64 of the payload (when verify)
  double gbps() const { return seconds > 0 ? double(bytes) / seconds / 1e9 : 0; }
};

// FNV-1a 64 over bytes, continuing from `h`.
inline uint64_t fnv1a(const void* data, std::size_t n, uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

// FNV-1a 64 of a tensor's bytes (a host copy for device tensors), continuing from h.
inline uint64_t tensor_hash(const Tensor& t, uint64_t h = 0xcbf29ce484222325ull, const Stream& stream = {}) {
  if (t.device().is_cpu()) return fnv1a(t.data_ptr(), t.nbytes(), h);
  const Tensor host = t.to(Device::cpu(), stream);
  stream.synchronize();
  Stream::default_for(t.device()).synchronize();
  return fnv1a(host.data_ptr(), host.nbytes(), h);
}

// Hash of every parameter of a model (or an Engine's model), in its
// parameter order.
template <class Model>
uint64_t weights_hash(Model& model, const Stream& stream = {}) {
  uint64_t h = 0xcbf29ce484222325ull;
  model.for_each_parameter([&](nn::Parameter& p) { h = tensor_hash(p.value, h, stream); });
  return h;
}

// A model (Qwen3Model, Qwen3VLModel) as a weight source (its parameters, as
// they are).
template <class Model = nn::Qwen3Model>
struct ModelWeights {
  Model* model;
  std::vector<WeightMeta> meta() const {
    std::vector<WeightMeta> m;
    model->for_each_parameter([&](nn::Parameter& p) { m.push_back({p.name, p.value.shape(), p.value.dtype()}); });
    return m;
  }
  template <class F>
  void for_each(F&& f) const {
    model->for_each_parameter([&](nn::Parameter& p) { f(p.name, p.value); });
  }
};

// A sharded trainer (parallel::Sharded, anything with parameter_names,
// parameter_shape, gather_parameter and is_expert_parameter) as a weight
// source: one whole parameter gathered at a time, so the extra memory is one
// parameter. Under expert parallelism (`ep`) an expert stack is gathered
// over the ep ranks' slices too (ExpertParallel::gather_expert_stack), so
// the engine receives every expert. Collective over the trainer's ranks:
// every rank must iterate (for_each, or whole() per name in the same order),
// also those that send nothing.
template <class Policy>
struct ShardedWeights {
  Policy* policy;
  parallel::ExpertParallel<>* ep = nullptr;

  // The whole parameter `name` (f32 master values).
  Tensor whole(const std::string& name) const {
    Tensor t = policy->gather_parameter(name);
    if (ep != nullptr && policy->is_expert_parameter(name)) t = ep->gather_expert_stack(t);
    return t;
  }
  // Names, whole shapes and the master dtype, in for_each's order.
  std::vector<WeightMeta> meta() const {
    std::vector<WeightMeta> m;
    for (const std::string& name : policy->parameter_names()) {
      const Shape& shape = policy->parameter_shape(name);
      std::vector<int64_t> dims(shape.begin(), shape.end());
      if (ep != nullptr && policy->is_expert_parameter(name)) dims[0] = ep->num_experts();
      m.push_back({name, Shape(dims), DType::f32});
    }
    return m;
  }
  template <class F>
  void for_each(F&& f) const {
    for (const std::string& name : policy->parameter_names()) f(name, whole(name));
  }
};

namespace detail::weight_sync {

inline std::map<std::string, nn::Parameter*> params_by_name(Engine& engine) {
  std::map<std::string, nn::Parameter*> m;
  engine.for_each_parameter([&](nn::Parameter& p) { m[p.name] = &p; });
  return m;
}

inline nn::Parameter& find(std::map<std::string, nn::Parameter*>& params, const std::string& name, const Shape& shape,
                           std::string_view where) {
  auto it = params.find(name);
  SLIME_CHECK(it != params.end(), where, ": the engine's model has no parameter '", name, "'");
  SLIME_CHECK(it->second->value.shape() == shape, where, ": parameter '", name, "' is ", it->second->value.str(),
              " in the engine but ", shape, " in the trainer");
  return *it->second;
}

// dst = src, cast when the dtypes differ; any devices.
inline void copy_cast(const Tensor& src, const Tensor& dst, const Stream& stream) {
  if (src.dtype() == dst.dtype()) {
    Tensor d = dst;
    d.copy_from(src, stream);
    return;
  }
  if (src.device() == dst.device()) {
    ops::cast(src, dst, stream);
    return;
  }
  Tensor tmp = Tensor::empty(src.shape(), src.dtype(), dst.device(), stream);
  tmp.copy_from(src, stream);
  ops::cast(tmp, dst, stream);
}

// Metadata as bytes: "version\nbucket_bytes\n" then "name\tdtype\td0,d1,..\n" lines.
inline std::string encode(int64_t version, std::size_t bucket_bytes, const std::vector<WeightMeta>& meta) {
  std::string s = std::to_string(version) + "\n" + std::to_string(bucket_bytes) + "\n";
  for (const auto& m : meta) {
    SLIME_CHECK(m.name.find_first_of("\t\n") == std::string::npos, "weight sync: parameter name '", m.name,
                "' holds a tab or newline");
    s += m.name + "\t" + std::to_string(int(m.dtype)) + "\t";
    for (int d = 0; d < m.shape.rank(); ++d) {
      if (d > 0) s += ',';
      s += std::to_string(m.shape[d]);
    }
    s += "\n";
  }
  return s;
}

inline void decode(const std::string& s, int64_t& version, std::size_t& bucket_bytes, std::vector<WeightMeta>& meta) {
  std::size_t at = 0;
  auto line = [&]() {
    const std::size_t end = s.find('\n', at);
    SLIME_CHECK(end != std::string::npos, "weight sync: truncated metadata");
    std::string l = s.substr(at, end - at);
    at = end + 1;
    return l;
  };
  version = std::stoll(line());
  bucket_bytes = std::size_t(std::stoull(line()));
  meta.clear();
  while (at < s.size()) {
    const std::string l = line();
    const auto t1 = l.find('\t'), t2 = l.find('\t', t1 + 1);
    SLIME_CHECK(t1 != std::string::npos && t2 != std::string::npos, "weight sync: bad metadata line '", l, "'");
    WeightMeta m;
    m.name = l.substr(0, t1);
    m.dtype = DType(std::stoi(l.substr(t1 + 1, t2 - t1 - 1)));
    std::vector<int64_t> dims;
    for (std::size_t p = t2 + 1; p < l.size();) {
      const auto c = l.find(',', p);
      dims.push_back(std::stoll(l.substr(p, c == std::string::npos ? std::string::npos : c - p)));
      p = c == std::string::npos ? l.size() : c + 1;
    }
    m.shape = Shape(dims);
    meta.push_back(std::move(m));
  }
}

// Bucket boundaries: [first, last) tensor indices and byte size of each.
struct Bucket {
  std::size_t first = 0, last = 0, bytes = 0;
};
inline std::vector<Bucket> plan_buckets(const std::vector<WeightMeta>& meta, std::size_t bucket_bytes) {
  std::vector<Bucket> out;
  Bucket cur;
  for (std::size_t i = 0; i < meta.size(); ++i) {
    const std::size_t n = std::size_t(meta[i].shape.numel()) * dtype_size(meta[i].dtype);
    if (cur.last > cur.first && cur.bytes + n > bucket_bytes) {
      out.push_back(cur);
      cur = Bucket{i, i, 0};
    }
    cur.last = i + 1;
    cur.bytes += n;
  }
  if (cur.last > cur.first) out.push_back(cur);
  return out;
}

// Broadcast a byte string from root (its value on root, filled elsewhere).
inline std::string broadcast_string(comm::Comm& comm, int root, std::string s, Device device, const Stream& stream) {
  Tensor len = Tensor::from_vector(std::vector<int64_t>{int64_t(s.size())}, {1}, device, stream);
  comm.broadcast(len, root, stream);
  const int64_t n = len.to_vector<int64_t>(stream)[0];
  std::vector<uint8_t> bytes(s.begin(), s.end());
  bytes.resize(std::size_t(n));
  Tensor t = Tensor::from_vector(bytes, {std::max<int64_t>(n, 1)}, device, stream);
  if (n > 0) comm.broadcast(t, root, stream);
  const auto v = t.to_vector<uint8_t>(stream);
  return std::string(v.begin(), v.begin() + n);
}

inline int64_t broadcast_u64(comm::Comm& comm, int root, uint64_t v, Device device, const Stream& stream) {
  int64_t x;
  std::memcpy(&x, &v, sizeof x);
  Tensor t = Tensor::from_vector(std::vector<int64_t>{x}, {1}, device, stream);
  comm.broadcast(t, root, stream);
  return t.to_vector<int64_t>(stream)[0];
}

// The stream a sync's copies run on: `stream`, or the device's default
// stream where the caller passed the CPU stream (the library's default).
inline Stream work_stream(const Stream& stream, Device device) {
  return stream.device() == device ? stream : Stream::default_for(device);
}

// Two staging buffers and the ordering between the copy stream (`work`) and
// the broadcast stream (`wire`). On the CPU both are the calling thread and
// the events do nothing. Piece k uses buffer k % 2.
struct Staging {
  Stream work, wire;
  Tensor buffers[2];
  Event copied[2], sent[2];  // copies into / out of buffer i done; broadcast of buffer i done
  bool used[2] = {false, false};

  Staging(Device device, const Stream& stream, DType dtype, int64_t elements)
      : work(work_stream(stream, device)),
        wire(device.is_cuda() ? Stream::create(device) : work),
        copied{Event(device, false), Event(device, false)},
        sent{Event(device, false), Event(device, false)} {
    for (Tensor& b : buffers) b = Tensor::empty({std::max<int64_t>(elements, 1)}, dtype, device, work);
    // Broadcasts start after everything queued on `work` so far (the metadata's).
    Event start(device, false);
    start.record(work);
    start.wait(wire);
  }
  // Sender: buffer k % 2, once its previous broadcast is done (work waits).
  Tensor& fill(std::size_t k) {
    const std::size_t i = k % 2;
    if (used[i]) sent[i].wait(work);
    return buffers[i];
  }
  // Sender: broadcast the first `elements` of buffer k % 2 after its copies.
  void send(comm::Comm& comm, int root, std::size_t k, int64_t elements) {
    const std::size_t i = k % 2;
    copied[i].record(work);
    copied[i].wait(wire);
    Tensor part = buffers[i].slice_rows(0, elements);
    comm.broadcast(part, root, wire);
    sent[i].record(wire);
    used[i] = true;
  }
  // Receiver: broadcast into buffer k % 2 (once its previous contents were
  // copied out), then make `work` wait for the data.
  Tensor& receive(comm::Comm& comm, int root, std::size_t k, int64_t elements) {
    const std::size_t i = k % 2;
    if (used[i]) copied[i].wait(wire);
    Tensor part = buffers[i].slice_rows(0, elements);
    comm.broadcast(part, root, wire);
    sent[i].record(wire);
    sent[i].wait(work);
    return buffers[i];
  }
  // Receiver: the copies out of buffer k % 2 are queued.
  void unpacked(std::size_t k) {
    const std::size_t i = k % 2;
    copied[i].record(work);
    used[i] = true;
  }
  // `work` waits for every broadcast queued so far: the end of a sync, and
  // before the buffers are freed (stream-ordered on `work`).
  void drain() {
    if (!wire.device().is_cuda()) return;
    Event done(wire.device(), false);
    done.record(wire);
    done.wait(work);
  }
  ~Staging() {
    try {
      drain();
    } catch (...) {
    }
  }
};

// Bytes per staged piece: half a bucket where the pieces are pipelined (CUDA),
// so that the two buffers together are one bucket.
inline std::size_t piece_bytes(std::size_t bucket_bytes, Device device) {
  return device.is_cuda() ? std::max<std::size_t>(bucket_bytes / 2, 1) : bucket_bytes;
}

// Waits for the work of a sync: `stream`, or the device's default stream
// where the caller passed the CPU stream (the library's default argument).
inline void finish(const Stream& stream, Device device) {
  stream.synchronize();
  if (device.is_cuda() && stream.device() != device) Stream::default_for(device).synchronize();
}

}  // namespace detail::weight_sync

// Colocated: copies every tensor of `source` into `engine`'s parameter of the
// same name (cast to the engine's dtype), sets the engine's weight version.
template <class Source>
WeightSyncStats sync_colocated(Source&& source, Engine& engine, int64_t version, const WeightSyncConfig& cfg = {},
                               const Stream& stream = {}) {
  namespace ws = detail::weight_sync;
  const auto t0 = std::chrono::steady_clock::now();
  auto params = ws::params_by_name(engine);
  WeightSyncStats st;
  st.version = version;
  std::size_t seen = 0;
  uint64_t h = 0xcbf29ce484222325ull;
  source.for_each([&](const std::string& name, const Tensor& full) {
    nn::Parameter& p = ws::find(params, name, full.shape(), "sync_colocated");
    ws::copy_cast(full, p.value, stream);
    st.bytes += p.value.nbytes();
    if (cfg.verify) h = tensor_hash(p.value, h, stream);
    ++seen;
  });
  SLIME_CHECK(seen == params.size(), "sync_colocated: the source gave ", seen, " tensors, the engine has ",
              params.size(), " parameters");
  if (cfg.verify) {
    st.hash = h;
    SLIME_CHECK(weights_hash(engine, stream) == h, "sync_colocated: the engine's weights hash differs");
  }
  engine.set_weight_version(version);
  ws::finish(stream, engine.model().device());
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// Distributed, sender side (rank `comm.rank()` is the root): metadata then
// buckets by broadcast. `wire_dtype` is the engines' parameter dtype (the
// sender casts). Buckets live on `device` (the comm's device).
template <class Source>
WeightSyncStats send_weights(comm::Comm& comm, Source&& source, int64_t version, DType wire_dtype, Device device,
                             const WeightSyncConfig& cfg = {}, const Stream& stream = {}) {
  namespace ws = detail::weight_sync;
  const auto t0 = std::chrono::steady_clock::now();
  const int root = comm.rank();
  std::vector<WeightMeta> meta = source.meta();
  for (auto& m : meta) m.dtype = wire_dtype;
  // The metadata carries the piece size, so both sides plan the same pieces.
  const std::size_t piece = ws::piece_bytes(cfg.bucket_bytes, device);
  ws::broadcast_string(comm, root, ws::encode(version, piece, meta), device, stream);
  ws::broadcast_u64(comm, root, cfg.verify ? 1 : 0, device, stream);
  const auto buckets = ws::plan_buckets(meta, piece);
  const int64_t esize = int64_t(dtype_size(wire_dtype));
  int64_t largest = 1;  // elements
  for (const auto& b : buckets) largest = std::max(largest, int64_t(b.bytes) / esize);
  ws::Staging staging(device, stream, wire_dtype, largest);
  WeightSyncStats st;
  st.version = version;
  uint64_t h = 0xcbf29ce484222325ull;
  std::size_t index = 0, bucket = 0;
  int64_t offset = 0;  // elements into the bucket
  source.for_each([&](const std::string& name, const Tensor& full) {
    SLIME_CHECK(index < meta.size() && meta[index].name == name && meta[index].shape == full.shape(),
                "send_weights: the source yielded '", name, "' ", full.str(), " where its metadata says '",
                index < meta.size() ? meta[index].name : std::string("<end>"), "'");
    const Tensor& buffer = staging.fill(bucket);
    ws::copy_cast(full, buffer.view(offset, full.shape()), staging.work);
    offset += full.numel();
    if (++index == buckets[bucket].last) {
      if (cfg.verify) h = tensor_hash(buffer.slice_rows(0, offset), h, staging.work);
      staging.send(comm, root, bucket, offset);
      st.bytes += std::size_t(offset * esize);
      ++st.buckets;
      ++bucket;
      offset = 0;
    }
  });
  staging.drain();
  SLIME_CHECK(index == meta.size(), "send_weights: the source yielded ", index, " tensors, its metadata ", meta.size());
  st.hash = h;
  if (cfg.verify) ws::broadcast_u64(comm, root, h, device, stream);
  ws::finish(stream, device);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

// Distributed, engine side: receives the metadata and buckets sent by rank
// `root` of `comm` into `engine`'s parameters (names and shapes must match,
// dtype = the wire dtype), verifies the hash when the sender asked for it, and
// sets the engine's weight version. Buckets live on the engine's device.
inline WeightSyncStats receive_weights(comm::Comm& comm, int root, Engine& engine, const Stream& stream = {}) {
  namespace ws = detail::weight_sync;
  const auto t0 = std::chrono::steady_clock::now();
  const Device device = engine.model().device();
  int64_t version = 0;
  std::size_t bucket_bytes = 0;
  std::vector<WeightMeta> meta;
  ws::decode(ws::broadcast_string(comm, root, {}, device, stream), version, bucket_bytes, meta);
  const bool verify = ws::broadcast_u64(comm, root, 0, device, stream) != 0;
  auto params = ws::params_by_name(engine);
  SLIME_CHECK(meta.size() == params.size(), "receive_weights: the sender has ", meta.size(),
              " tensors, the engine's model ", params.size(), " parameters");
  std::vector<nn::Parameter*> targets;
  for (const auto& m : meta) {
    nn::Parameter& p = ws::find(params, m.name, m.shape, "receive_weights");
    SLIME_CHECK(p.value.dtype() == m.dtype, "receive_weights: parameter '", m.name, "' is ", p.value.str(),
                " in the engine but the sender sends ", dtype_name(m.dtype));
    targets.push_back(&p);
  }
  WeightSyncStats st;
  st.version = version;
  if (!meta.empty()) {
    const DType wire = meta[0].dtype;
    const int64_t esize = int64_t(dtype_size(wire));
    const auto buckets = ws::plan_buckets(meta, bucket_bytes);
    int64_t largest = 1;
    for (const auto& b : buckets) largest = std::max(largest, int64_t(b.bytes) / esize);
    ws::Staging staging(device, stream, wire, largest);
    for (std::size_t k = 0; k < buckets.size(); ++k) {
      const ws::Bucket& b = buckets[k];
      const Tensor& buffer = staging.receive(comm, root, k, int64_t(b.bytes) / esize);
      int64_t offset = 0;
      for (std::size_t i = b.first; i < b.last; ++i) {
        Tensor dst = targets[i]->value;
        dst.copy_from(buffer.view(offset, dst.shape()), staging.work);
        offset += dst.numel();
      }
      staging.unpacked(k);
      st.bytes += b.bytes;
      ++st.buckets;
    }
    staging.drain();
  }
  if (verify) {
    uint64_t mine = 0xcbf29ce484222325ull;
    for (nn::Parameter* p : targets) mine = tensor_hash(p->value, mine, stream);
    const int64_t theirs = ws::broadcast_u64(comm, root, 0, device, stream);
    uint64_t t;
    std::memcpy(&t, &theirs, sizeof t);
    SLIME_CHECK(t == mine, "receive_weights: the engine's weights hash ", mine, " differs from the sender's ", t,
                " (version ", version, ")");
    st.hash = mine;
  }
  engine.set_weight_version(version);
  ws::finish(stream, device);
  st.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace slime::rollout
