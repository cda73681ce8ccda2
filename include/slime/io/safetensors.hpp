// slime/io/safetensors.hpp: safetensors files (mmap reader, atomic writer) and
// Hugging Face checkpoint directories (model.safetensors or sharded with
// model.safetensors.index.json), with dtype conversion on load.
//
// Format (https://github.com/huggingface/safetensors): 8 bytes little-endian
// u64 N, N bytes of UTF-8 JSON header {name: {dtype, shape, data_offsets:
// [begin, end]}, "__metadata__": {str: str}}, then the data section. Offsets
// are relative to the data section, tensors are row-major little-endian, and
// the ranges must tile the data section exactly (no overlaps, no holes, no
// trailing bytes) as the reference implementation checks.
//
// Reading validates the whole header when the file is opened; a tensor whose
// dtype is valid safetensors but not a slime dtype (F64, I8, BOOL, F8_*, ...)
// only fails when it is read. Every error names the file, and the tensor where
// one is involved. A mapped file must not be truncated by another process
// while open (the OS would raise SIGBUS on access).
//
// Compiled once in src/io/safetensors.cpp (slime::core). What allocates or
// copies tensors (read, read_into, the tensor bytes of a write) stays inline
// here, because its code depends on whether the caller builds with CUDA.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/file_descriptor.hpp"
#include "slime/core/tensor.hpp"

namespace slime::io {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; big-endian hosts are not supported");

// The reference implementation refuses headers above 100 MB.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;
// Writers pad the header with spaces so that the data section starts here.
inline constexpr uint64_t kSafetensorsAlignment = 8;
// Hugging Face file names and save_pretrained's default shard size (5 GB).
inline constexpr std::string_view kSafetensorsSingleFile = "model.safetensors";
inline constexpr std::string_view kSafetensorsIndexFile = "model.safetensors.index.json";
inline constexpr uint64_t kDefaultMaxShardBytes = 5'000'000'000;

// A dtype the format defines, with its width in bits and the slime dtype that
// holds it (none for the ones a Tensor cannot hold).
struct SafetensorsDType {
  std::string_view name;
  int bits;
  std::optional<DType> dtype;
};

namespace detail {

// The format's entry for `name` ("BF16", "F8_E4M3", ...); nullptr when the format has none.
const SafetensorsDType* find_safetensors_dtype(std::string_view name);

}  // namespace detail

// The name safetensors uses for a slime dtype ("F32", "BF16", ...).
constexpr std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "F32";
    case DType::bf16:
      return "BF16";
    case DType::f16:
      return "F16";
    case DType::i32:
      return "I32";
    case DType::i64:
      return "I64";
    case DType::u8:
      return "U8";
  }
  return "?";
}

// One tensor of a file, as its header describes it.
struct SafetensorsTensorInfo {
  std::string name;
  std::string dtype_name;      // as written in the file: "BF16", "F64", ...
  std::optional<DType> dtype;  // empty: a valid safetensors dtype slime cannot hold
  std::vector<int64_t> dims;   // may exceed Shape::kMaxDims; shape() checks
  int64_t numel = 1;
  uint64_t begin = 0, end = 0;  // byte range within the data section

  uint64_t nbytes() const { return end - begin; }
  Shape shape() const {
    SLIME_CHECK(dims.size() <= std::size_t(Shape::kMaxDims), "tensor '", name, "' has ", dims.size(),
                " dims; slime tensors have at most ", Shape::kMaxDims);
    return Shape(std::span<const int64_t>(dims));
  }
};

// A tensor to write: declared before its data (safetensors_writer.hpp streams
// the data afterwards).
struct SafetensorsEntry {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;

  uint64_t nbytes() const { return uint64_t(shape.numel()) * dtype_size(dtype); }
};

namespace detail {

std::string errno_text(int err);

// A whole file mapped read-only; unmapped on destruction. The descriptor is
// closed as soon as the mapping exists (the mapping keeps the file alive).
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile() { unmap(); }
  MappedFile(MappedFile&& o) noexcept : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void unmap() noexcept;
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// Converts n elements of `from` at `src` (any alignment) into `to` at `dst`:
// equal dtypes are a plain copy, floats convert among themselves with
// round-to-nearest-even, integers among themselves when every value fits;
// anything else throws. `what` names the tensor and file.
void convert_elements(const std::byte* src, DType from, void* dst, DType to, int64_t n, std::string_view what);

}  // namespace detail

// A safetensors file opened with mmap. The header is parsed and validated
// once; reads copy (and convert) into new or existing tensors. Reads of a
// const SafetensorsFile are safe from several threads.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::filesystem::path path) : path_(std::move(path)), map_(path_) { parse_header(); }

  const std::filesystem::path& path() const { return path_; }
  std::size_t size() const { return tensors_.size(); }
  // Tensor names in data order (ascending offsets).
  std::vector<std::string> names() const;
  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  const SafetensorsTensorInfo& info(std::string_view name) const;
  // The free-form "__metadata__" map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Byte offset of the data section in the file (8 + header length).
  uint64_t data_offset() const { return data_offset_; }
  // The tensor's bytes as stored (little-endian, row-major), in the mapping.
  std::span<const std::byte> raw_bytes(std::string_view name) const;

  // The tensor as a new CPU tensor of dtype `want` (the file's dtype when
  // empty), then moved to `device`; the result is ready when this returns.
  Tensor read(std::string_view name, std::optional<DType> want = std::nullopt, Device device = Device::cpu()) const {
    const auto& t = info(name);
    const DType src = supported_dtype(t);
    const DType to = want.value_or(src);
    Tensor host = Tensor::empty(t.shape(), to);
    detail::convert_elements(map_.data() + data_offset_ + t.begin, src, host.data_ptr(), to, t.numel, describe(name));
    if (device.is_cpu()) return host;
    Tensor out = host.to(device);
    out.stream().synchronize();
    return out;
  }

  // Reads into an existing tensor of the same shape (any dtype the file's
  // converts to; CPU, or CUDA through a CPU staging copy). Ready on return.
  void read_into(std::string_view name, Tensor& dst) const {
    const auto& t = info(name);
    if (!dst.defined()) fail("read_into: destination for tensor '", name, "' is undefined");
    const DType src = supported_dtype(t);
    const Shape shape = t.shape();
    if (!(shape == dst.shape()))
      fail("tensor '", name, "' has shape ", shape, " in the file but the destination has shape ", dst.shape(), " (",
           dst.str(), ")");
    const std::byte* bytes = map_.data() + data_offset_ + t.begin;
    if (dst.device().is_cpu()) {
      detail::convert_elements(bytes, src, dst.data_ptr(), dst.dtype(), t.numel, describe(name));
      return;
    }
    Tensor staging = Tensor::empty(shape, dst.dtype());
    detail::convert_elements(bytes, src, staging.data_ptr(), dst.dtype(), t.numel, describe(name));
    dst.copy_from(staging, dst.stream());
    dst.stream().synchronize();
  }

 private:
  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    SLIME_FAIL("safetensors file '", path_.string(), "': ", args...);
  }

  std::string describe(std::string_view name) const;

  DType supported_dtype(const SafetensorsTensorInfo& t) const;

  void parse_header();

  SafetensorsTensorInfo parse_entry(const std::string& name, const nlohmann::json& entry, uint64_t data_size) const;

  std::filesystem::path path_;
  detail::MappedFile map_;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;  // ascending offsets
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

namespace detail {

// fsync on a directory makes a rename in it durable.
void fsync_directory(const std::filesystem::path& dir);

// Writes `path` atomically: the bytes go to "<path>.tmp.<pid>" in the same
// directory, which commit() fsyncs and renames over `path` (then fsyncs the
// directory). Destroyed without commit() (an exception), the temporary file
// is removed and `path` is untouched.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path);
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, std::size_t n);
  uint64_t written() const { return written_; }

  void commit();

 private:
  std::filesystem::path path_, tmp_;
  FileDescriptor fd_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

// The header bytes (JSON padded with spaces to a multiple of 8) for
// `entries` laid out contiguously in order. Checks the names.
std::string safetensors_header(const std::filesystem::path& path, std::span<const SafetensorsEntry> entries,
                               const std::map<std::string, std::string>& metadata);

// The same for tensors; checks that each is defined.
std::string safetensors_header(const std::filesystem::path& path,
                               const std::vector<std::pair<std::string, Tensor>>& tensors,
                               const std::map<std::string, std::string>& metadata);

// Appends a tensor's bytes; CUDA tensors go through a host copy.
inline void write_tensor_bytes(AtomicFileWriter& out, const Tensor& t) {
  if (t.nbytes() == 0) return;
  if (t.device().is_cpu()) {
    out.write(t.data_ptr(), t.nbytes());
    return;
  }
  Tensor host = Tensor::empty(t.shape(), t.dtype());
  host.copy_from(t, t.stream());
  t.stream().synchronize();
  out.write(host.data_ptr(), host.nbytes());
}

// How the compiled writers append a tensor's bytes: write_tensor_bytes,
// passed from an inline caller so that the copy from a CUDA tensor is code of
// the caller's translation unit (src/ is built without CUDA).
using AppendTensorFn = void (*)(AtomicFileWriter& out, const Tensor& t);

void write_safetensors_with(const std::filesystem::path& path,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::map<std::string, std::string>& metadata, AppendTensorFn append);

void write_safetensors_dir_with(const std::filesystem::path& dir,
                                const std::vector<std::pair<std::string, Tensor>>& tensors, uint64_t max_shard_bytes,
                                std::map<std::string, std::string> metadata, AppendTensorFn append);

}  // namespace detail

// Writes `tensors` (in this order, contiguous, data section 8-byte aligned)
// and `metadata` as a safetensors file, atomically: on any error `path` is
// left as it was and no temporary file remains. CUDA tensors are copied to
// the host first.
inline void write_safetensors(const std::filesystem::path& path,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  detail::write_safetensors_with(path, tensors, metadata, &detail::write_tensor_bytes);
}

// A Hugging Face checkpoint directory: model.safetensors, or shards listed by
// model.safetensors.index.json ("weight_map": tensor -> shard file). When both
// exist, model.safetensors wins, as in transformers. Every shard is opened
// (mapped) and checked against the index up front.
class SafetensorsDir {
 public:
  explicit SafetensorsDir(std::filesystem::path dir);

  const std::filesystem::path& path() const { return dir_; }
  // The index file; empty for a single-file checkpoint.
  const std::filesystem::path& index_path() const { return index_path_; }
  bool sharded() const { return !index_path_.empty(); }
  std::size_t size() const { return where_.size(); }
  // All tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(std::string_view name) const { return where_.find(name) != where_.end(); }
  const SafetensorsFile& file_of(std::string_view name) const;
  const SafetensorsTensorInfo& info(std::string_view name) const { return file_of(name).info(name); }
  Tensor read(std::string_view name, std::optional<DType> want = std::nullopt, Device device = Device::cpu()) const {
    return file_of(name).read(name, want, device);
  }
  void read_into(std::string_view name, Tensor& dst) const { file_of(name).read_into(name, dst); }

 private:
  std::string describe() const { return sharded() ? index_path_.string() : (dir_ / kSafetensorsSingleFile).string(); }

  template <class... Args>
  [[noreturn]] void fail_index(const Args&... args) const {
    SLIME_FAIL("checkpoint index '", index_path_.string(), "': ", args...);
  }

  void load_index();

  std::filesystem::path dir_;
  std::filesystem::path index_path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor -> files_ index
};

namespace detail {

// "model-00001-of-00003.safetensors": the shard names save_pretrained uses.
std::string shard_file_name(std::size_t i, std::size_t n);

// Splits tensors of `sizes` bytes, in order, into shards of at most
// `max_shard_bytes` (a new shard when the next tensor would overflow the
// current one; a tensor larger than the limit gets a shard of its own).
// Returns the index of each shard's first tensor; always at least one shard.
std::vector<std::size_t> plan_shards(std::span<const uint64_t> sizes, uint64_t max_shard_bytes);

}  // namespace detail

// Writes `tensors` as a Hugging Face checkpoint in `dir` (created if needed):
// one model.safetensors when everything fits in `max_shard_bytes`, else
// model-0000i-of-0000N.safetensors shards (filled in order, a new shard when
// the next tensor would overflow the current one; a tensor larger than the
// limit gets a shard of its own) plus model.safetensors.index.json with
// metadata.total_size (data bytes) and weight_map. Each file is written
// atomically; the directory as a whole is not (write a fresh directory per
// checkpoint when that matters). Files of an earlier checkpoint in `dir` that
// loaders would pick up instead (model.safetensors, the index, other shards)
// are removed after the new files are in place. Every shard's metadata holds
// "format": "pt" (transformers refuses files without it) unless `metadata`
// sets "format".
inline void write_safetensors_dir(const std::filesystem::path& dir,
                                  const std::vector<std::pair<std::string, Tensor>>& tensors,
                                  uint64_t max_shard_bytes = kDefaultMaxShardBytes,
                                  std::map<std::string, std::string> metadata = {}) {
  detail::write_safetensors_dir_with(dir, tensors, max_shard_bytes, std::move(metadata), &detail::write_tensor_bytes);
}

}  // namespace slime::io
