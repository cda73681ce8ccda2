// slime/core/tensor.hpp: Tensor, an owning, contiguous, typed buffer on the CPU
// or one CUDA device, with views (offset, reshape, rows) and copies between
// devices. No autograd, no strides: layouts are always row-major contiguous.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "slime/core/dtype.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/shape.hpp"
#include "slime/core/stream.hpp"

namespace slime {

// A block of memory shared by a tensor and its views. Device memory is freed
// in order on the stream it was allocated on: a tensor used on another stream
// must stay alive until an event orders that work before the allocation
// stream (as with torch's record_stream).
class Storage {
 public:
  Storage(MemoryKind kind, std::size_t bytes, const Stream& stream)
      : kind_(kind), bytes_(bytes), stream_(stream), data_(allocate(kind, bytes, stream)) {}
  ~Storage() { deallocate(kind_, data_, bytes_, stream_); }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  MemoryKind kind() const { return kind_; }
  Device device() const { return kind_ == MemoryKind::device ? stream_.device() : Device::cpu(); }
  const Stream& stream() const { return stream_; }

 private:
  MemoryKind kind_;
  std::size_t bytes_;
  Stream stream_;
  void* data_;
};

class Tensor {
 public:
  // An undefined tensor: no storage; most calls on it throw.
  Tensor() = default;

  // Uninitialised memory. On CUDA the memory is ordered on `stream` (the
  // device's default stream when none is given).
  static Tensor empty(const Shape& shape, DType dtype, Device device = Device::cpu(), const Stream& stream = {}) {
    check_device_exists(device);
    const Stream s = device.is_cuda() && stream.device() != device ? Stream::default_for(device) : stream;
    const MemoryKind kind = device.is_cuda() ? MemoryKind::device : MemoryKind::host;
    Tensor t;
    t.storage_ = std::make_shared<Storage>(kind, std::size_t(shape.nbytes(dtype_size(dtype))), s);
    t.shape_ = shape;
    t.dtype_ = dtype;
    return t;
  }

  // Page-locked host memory: the source or target of asynchronous copies.
  static Tensor empty_pinned(const Shape& shape, DType dtype) {
    Tensor t;
    t.storage_ = std::make_shared<Storage>(MemoryKind::pinned, std::size_t(shape.nbytes(dtype_size(dtype))), Stream{});
    t.shape_ = shape;
    t.dtype_ = dtype;
    return t;
  }

  static Tensor zeros(const Shape& shape, DType dtype, Device device = Device::cpu(), const Stream& stream = {}) {
    Tensor t = empty(shape, dtype, device, stream);
    t.fill_bytes_(0, t.storage_->stream());
    return t;
  }

  // A tensor holding `values` (host data), placed on `device`.
  template <class T>
  static Tensor from_vector(const std::vector<T>& values, const Shape& shape, Device device = Device::cpu(),
                            const Stream& stream = {}) {
    SLIME_CHECK(int64_t(values.size()) == shape.numel(), "from_vector: ", values.size(),
                " values do not fill shape ", shape, " (", shape.numel(), " elements)");
    Tensor host;
    host.storage_ = std::make_shared<Storage>(MemoryKind::host, values.size() * sizeof(T), Stream{});
    host.shape_ = shape;
    host.dtype_ = dtype_of<T>;
    if (!values.empty()) std::memcpy(host.data_ptr(), values.data(), values.size() * sizeof(T));
    if (device.is_cpu()) return host;
    return host.to(device, stream);
  }

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return require().device(); }
  MemoryKind memory_kind() const { return require().kind(); }
  bool is_pinned() const { return defined() && storage_->kind() == MemoryKind::pinned; }
  const Shape& shape() const { return shape_; }
  int dim() const { return shape_.rank(); }
  int64_t size(int d) const { return shape_[d]; }
  int64_t numel() const { return shape_.numel(); }
  std::size_t nbytes() const { return std::size_t(numel()) * dtype_size(dtype_); }
  // The stream the memory was allocated on (and will be freed on).
  const Stream& stream() const { return require().stream(); }

  void* data_ptr() const { return static_cast<char*>(require().data()) + offset_bytes_; }
  // True when this tensor spans its whole storage (not a view into a part).
  bool spans_storage() const { return offset_bytes_ == 0 && nbytes() == require().bytes(); }

  // Typed pointer; throws if T is not the stored type.
  template <class T>
  T* data() const {
    SLIME_CHECK(dtype_of<T> == dtype_, "data<", dtype_name(dtype_of<T>), ">() on a ", dtype_name(dtype_),
                " tensor");
    return static_cast<T*>(data_ptr());
  }

  bool shares_storage_with(const Tensor& other) const { return defined() && storage_ == other.storage_; }

  // A view of `shape.numel()` elements starting `element_offset` elements in.
  Tensor view(int64_t element_offset, const Shape& shape) const {
    require();
    SLIME_CHECK(element_offset >= 0 && element_offset + shape.numel() <= numel(), "view of ", shape.numel(),
                " elements at offset ", element_offset, " does not fit in ", str());
    Tensor t = *this;
    t.offset_bytes_ += std::size_t(element_offset) * dtype_size(dtype_);
    t.shape_ = shape;
    return t;
  }

  // Same elements, new shape; one extent may be -1 (inferred).
  Tensor reshape(std::initializer_list<int64_t> dims) const { return reshape_impl(std::vector<int64_t>(dims)); }
  Tensor reshape(const Shape& shape) const { return view(0, checked_same_numel(shape)); }

  // Rows [start, start + length) along dim 0, as a view.
  Tensor slice_rows(int64_t start, int64_t length) const {
    require();
    SLIME_CHECK(dim() >= 1, "slice_rows on a 0-d tensor");
    SLIME_CHECK(start >= 0 && length >= 0 && start + length <= shape_[0], "rows [", start, ", ", start + length,
                ") out of range for ", str());
    Shape s = shape_;
    s[0] = length;
    return view(start * (numel() / std::max<int64_t>(shape_[0], 1)), s);
  }

  Tensor flatten() const { return view(0, Shape{numel()}); }

  // Copies `src` into this tensor: same dtype and shape, any pair of devices.
  // Ordered on `stream` (its device or the default stream of a CUDA side);
  // host-to-host copies run at once.
  void copy_from(const Tensor& src, const Stream& stream = {}) {
    SLIME_CHECK(src.dtype_ == dtype_, "copy_from: dtype mismatch: destination ", str(), ", source ", src.str());
    SLIME_CHECK(src.shape_ == shape_, "copy_from: shape mismatch: destination ", str(), ", source ", src.str());
    const Device dd = device(), sd = src.device();
    if (nbytes() == 0) return;
    if (dd.is_cpu() && sd.is_cpu()) {
      std::memmove(data_ptr(), src.data_ptr(), nbytes());
      return;
    }
#if SLIME_HAS_CUDA
    const Device on = dd.is_cuda() ? dd : sd;
    const Stream s = stream.device().is_cuda() ? stream : Stream::default_for(on);
    DeviceGuard guard(s.device());
    if (dd.is_cuda() && sd.is_cuda() && dd != sd) {
      SLIME_CUDA_CHECK(cudaMemcpyPeerAsync(data_ptr(), dd.index, src.data_ptr(), sd.index, nbytes(), s.handle()));
    } else {
      // Into pageable host memory the copy returns only when done: a host wait.
      if (dd.is_cpu() && !is_pinned()) note_host_sync();
      SLIME_CUDA_CHECK(cudaMemcpyAsync(data_ptr(), src.data_ptr(), nbytes(), cudaMemcpyDefault, s.handle()));
    }
#else
    (void)stream;
    SLIME_FAIL("copy between ", sd, " and ", dd, " needs CUDA");
#endif
  }

  // A copy on `device` (a new storage, even when the device is the same).
  Tensor to(Device device, const Stream& stream = {}) const {
    Tensor t = empty(shape_, dtype_, device, stream);
    t.copy_from(*this, device.is_cuda() ? t.stream() : stream);
    return t;
  }
  Tensor clone(const Stream& stream = {}) const { return to(device(), stream); }

  // Sets every byte to `value`: zero-fill, or poison before a kernel so that
  // elements it fails to write show up in tests (0xff is NaN in every float
  // type).
  void fill_bytes_(uint8_t value, const Stream& stream = {}) {
    if (nbytes() == 0) return;
    if (device().is_cpu()) {
      std::memset(data_ptr(), value, nbytes());
      return;
    }
#if SLIME_HAS_CUDA
    const Stream s = stream.device() == device() ? stream : Stream::default_for(device());
    DeviceGuard guard(device());
    SLIME_CUDA_CHECK(cudaMemsetAsync(data_ptr(), value, nbytes(), s.handle()));
#else
    (void)stream;
#endif
  }
  void zero_(const Stream& stream = {}) { fill_bytes_(0, stream); }

  // The elements as a host vector (waits for the copy).
  template <class T>
  std::vector<T> to_vector(const Stream& stream = {}) const {
    SLIME_CHECK(dtype_of<T> == dtype_, "to_vector<", dtype_name(dtype_of<T>), ">() on a ", dtype_name(dtype_),
                " tensor");
    std::vector<T> out(static_cast<std::size_t>(numel()));
    if (out.empty()) return out;
    if (device().is_cpu()) {
      std::memcpy(out.data(), data_ptr(), nbytes());
      return out;
    }
#if SLIME_HAS_CUDA
    const Stream s = stream.device() == device() ? stream : Stream::default_for(device());
    DeviceGuard guard(device());
    SLIME_CUDA_CHECK(cudaMemcpyAsync(out.data(), data_ptr(), nbytes(), cudaMemcpyDeviceToHost, s.handle()));
    s.synchronize();
#else
    (void)stream;
#endif
    return out;
  }

  // "Tensor[bf16, (4, 8), cuda:0]"
  std::string str() const {
    if (!defined()) return "Tensor[undefined]";
    return "Tensor[" + std::string(dtype_name(dtype_)) + ", " + shape_.str() + ", " + device().str() + "]";
  }

 private:
  const Storage& require() const {
    SLIME_CHECK(storage_ != nullptr, "operation on an undefined tensor");
    return *storage_;
  }

  Shape checked_same_numel(const Shape& shape) const {
    SLIME_CHECK(shape.numel() == numel(), "cannot reshape ", str(), " (", numel(), " elements) to ", shape, " (",
                shape.numel(), " elements)");
    return shape;
  }

  Tensor reshape_impl(std::vector<int64_t> dims) const {
    int infer = -1;
    int64_t known = 1;
    for (std::size_t i = 0; i < dims.size(); ++i) {
      if (dims[i] == -1) {
        SLIME_CHECK(infer < 0, "reshape: more than one -1 extent");
        infer = int(i);
      } else {
        SLIME_CHECK(dims[i] >= 0, "reshape: negative extent ", dims[i]);
        known *= dims[i];
      }
    }
    if (infer >= 0) {
      SLIME_CHECK(known > 0 && numel() % known == 0, "reshape: cannot infer the -1 extent of ", str());
      dims[std::size_t(infer)] = numel() / known;
    }
    return reshape(Shape(std::span<const int64_t>(dims)));
  }

  std::shared_ptr<Storage> storage_;
  std::size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

// A tensor of `shape` over the front of `cache`, which is reallocated only
// when too small (then to max(need, 1.5 x its size)) or of another dtype or
// device: a buffer that keeps its capacity across steps, so a steady-state
// call allocates nothing. The view is valid until the next call that grows
// `cache`.
inline Tensor reuse_buffer(Tensor& cache, const Shape& shape, DType dtype, Device device, const Stream& stream) {
  const int64_t need = shape.numel();
  const bool same_kind = cache.defined() && cache.dtype() == dtype && cache.device() == device;
  if (!same_kind || cache.numel() < need) {
    const int64_t grown = same_kind ? cache.numel() + cache.numel() / 2 : 0;
    cache = Tensor::empty(Shape{need > grown ? need : grown}, dtype, device, stream);
  }
  return cache.view(0, shape);
}

// Precondition helpers for ops: the error names the argument.
inline void check_dtype(const Tensor& t, DType expected, std::string_view name) {
  SLIME_CHECK(t.defined(), name, " is undefined");
  SLIME_CHECK(t.dtype() == expected, name, " must be ", dtype_name(expected), ", got ", t.str());
}
inline void check_shape(const Tensor& t, const Shape& expected, std::string_view name) {
  SLIME_CHECK(t.defined(), name, " is undefined");
  SLIME_CHECK(t.shape() == expected, name, " must have shape ", expected, ", got ", t.str());
}
inline void check_same_device(const Tensor& a, const Tensor& b, std::string_view name_a, std::string_view name_b) {
  SLIME_CHECK(a.device() == b.device(), name_a, " and ", name_b, " are on different devices: ", a.str(), " vs ",
              b.str());
}

}  // namespace slime
