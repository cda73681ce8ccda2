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

inline constexpr std::array<SafetensorsDType, 22> kSafetensorsDTypes{{
    {"BOOL", 8, std::nullopt},
    {"F4", 4, std::nullopt},
    {"F6_E2M3", 6, std::nullopt},
    {"F6_E3M2", 6, std::nullopt},
    {"U8", 8, DType::u8},
    {"I8", 8, std::nullopt},
    {"F8_E5M2", 8, std::nullopt},
    {"F8_E4M3", 8, std::nullopt},
    {"F8_E8M0", 8, std::nullopt},
    {"F8_E4M3FNUZ", 8, std::nullopt},
    {"F8_E5M2FNUZ", 8, std::nullopt},
    {"I16", 16, std::nullopt},
    {"U16", 16, std::nullopt},
    {"F16", 16, DType::f16},
    {"BF16", 16, DType::bf16},
    {"I32", 32, DType::i32},
    {"U32", 32, std::nullopt},
    {"F32", 32, DType::f32},
    {"C64", 64, std::nullopt},
    {"F64", 64, std::nullopt},
    {"I64", 64, DType::i64},
    {"U64", 64, std::nullopt},
}};

inline const SafetensorsDType* find_safetensors_dtype(std::string_view name) {
  for (const auto& d : kSafetensorsDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

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

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

// An open file descriptor, closed on destruction.
class FileDescriptor {
 public:
  FileDescriptor() = default;
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() { reset(); }
  FileDescriptor(FileDescriptor&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  FileDescriptor& operator=(FileDescriptor&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Closes and reports the error close() returned (0 when none).
  int close() {
    if (fd_ < 0) return 0;
    const int rc = ::close(std::exchange(fd_, -1));
    return rc == 0 ? 0 : errno;
  }
  void reset() noexcept {
    if (fd_ >= 0) (void)::close(std::exchange(fd_, -1));
  }

 private:
  int fd_ = -1;
};

// A whole file mapped read-only; unmapped on destruction. The descriptor is
// closed as soon as the mapping exists (the mapping keeps the file alive).
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path) {
    FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) SLIME_FAIL("cannot open '", path.string(), "': ", errno_text(errno));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) SLIME_FAIL("cannot stat '", path.string(), "': ", errno_text(errno));
    if (!S_ISREG(st.st_mode)) SLIME_FAIL("'", path.string(), "' is not a regular file");
    size_ = std::size_t(st.st_size);
    if (size_ == 0) return;  // mmap refuses empty mappings; callers see size() == 0
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
    if (p == MAP_FAILED) SLIME_FAIL("cannot mmap '", path.string(), "' (", size_, " bytes): ", errno_text(errno));
    data_ = static_cast<const std::byte*>(p);
  }
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
  void unmap() noexcept {
    if (data_ != nullptr) (void)::munmap(const_cast<std::byte*>(data_), size_);
    data_ = nullptr;
  }
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

template <class T>
inline constexpr bool is_float_storage_v =
    std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

template <class T>
float storage_to_float(T v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return v.to_float();
  }
}

template <class T>
T float_to_storage(float f) {
  if constexpr (std::is_same_v<T, float>) {
    return f;
  } else {
    return T(f);  // round to nearest even (half.hpp)
  }
}

// Converts n elements of S at `src` (any alignment) into D at `out`: floats
// among themselves with round-to-nearest-even, integers among themselves when
// every value fits; anything else throws. `what` names the tensor and file.
template <class S, class D>
void convert_typed(const std::byte* src, D* out, int64_t n, std::string_view what) {
  constexpr DType from = dtype_of<S>, to = dtype_of<D>;
  if constexpr (is_float_storage_v<S> && is_float_storage_v<D>) {
    for (int64_t i = 0; i < n; ++i) {
      S v;
      std::memcpy(&v, src + std::size_t(i) * sizeof(S), sizeof(S));
      out[i] = float_to_storage<D>(storage_to_float(v));
    }
  } else if constexpr (std::is_integral_v<S> && std::is_integral_v<D>) {
    for (int64_t i = 0; i < n; ++i) {
      S v;
      std::memcpy(&v, src + std::size_t(i) * sizeof(S), sizeof(S));
      if (!std::in_range<D>(v))
        SLIME_FAIL(what, ": cannot convert ", dtype_name(from), " to ", dtype_name(to), ": element ", i, " = ",
                   int64_t(v), " does not fit in ", dtype_name(to));
      out[i] = static_cast<D>(v);
    }
  } else {
    (void)src, (void)out, (void)n;
    SLIME_FAIL(what, ": cannot convert ", dtype_name(from), " to ", dtype_name(to),
               ": conversion between floating-point and integer dtypes is not supported");
  }
}

// The same with runtime dtypes; equal dtypes are a plain copy.
inline void convert_elements(const std::byte* src, DType from, void* dst, DType to, int64_t n, std::string_view what) {
  if (n == 0) return;
  if (from == to) {
    std::memcpy(dst, src, std::size_t(n) * dtype_size(to));
    return;
  }
  visit_dtype(from, [&](auto s) {
    visit_dtype(to, [&](auto d) { convert_typed<decltype(s)>(src, static_cast<decltype(d)*>(dst), n, what); });
  });
}

// a * b for non-negative values; false on overflow past int64.
inline bool checked_mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

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
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back(t.name);
    return out;
  }
  bool contains(std::string_view name) const { return index_.find(name) != index_.end(); }
  const SafetensorsTensorInfo& info(std::string_view name) const {
    auto it = index_.find(name);
    if (it == index_.end()) fail("no tensor named '", name, "' (the file holds ", tensors_.size(), " tensors)");
    return tensors_[it->second];
  }
  // The free-form "__metadata__" map (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Byte offset of the data section in the file (8 + header length).
  uint64_t data_offset() const { return data_offset_; }
  // The tensor's bytes as stored (little-endian, row-major), in the mapping.
  std::span<const std::byte> raw_bytes(std::string_view name) const {
    const auto& t = info(name);
    return {map_.data() + data_offset_ + t.begin, std::size_t(t.nbytes())};
  }

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

  std::string describe(std::string_view name) const {
    return slime::detail::concat("safetensors file '", path_.string(), "': tensor '", name, "'");
  }

  DType supported_dtype(const SafetensorsTensorInfo& t) const {
    if (!t.dtype)
      fail("tensor '", t.name, "' has unsupported dtype ", t.dtype_name,
           " (slime reads F32, BF16, F16, I32, I64 and U8)");
    if (t.dims.size() > std::size_t(Shape::kMaxDims))
      fail("tensor '", t.name, "' has ", t.dims.size(), " dims; slime tensors have at most ", Shape::kMaxDims);
    return *t.dtype;
  }

  void parse_header() {
    using nlohmann::json;
    const uint64_t file_size = map_.size();
    if (file_size < 8)
      fail("file is ", file_size, " bytes, shorter than the 8-byte header length (truncated or not safetensors)");
    uint64_t n = 0;
    std::memcpy(&n, map_.data(), 8);
    if (n > kSafetensorsMaxHeaderBytes)
      fail("header length ", n, " exceeds the ", kSafetensorsMaxHeaderBytes,
           "-byte limit (corrupt or not safetensors)");
    if (n > file_size - 8)
      fail("header length ", n, " runs past the end of the file (", file_size, " bytes; truncated?)");
    data_offset_ = 8 + n;
    const uint64_t data_size = file_size - data_offset_;
    const char* text = reinterpret_cast<const char*>(map_.data() + 8);

    // nlohmann keeps the last of duplicate keys silently; the callback keeps
    // one key set per open object so that duplicates are an error.
    std::vector<std::set<std::string>> open_objects;
    std::string duplicate;
    int duplicate_depth = 0;
    auto on_event = [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::object_start) open_objects.emplace_back();
      if (event == json::parse_event_t::object_end && !open_objects.empty()) open_objects.pop_back();
      if (event == json::parse_event_t::key && !open_objects.empty() && duplicate.empty()) {
        auto key = parsed.get<std::string>();
        if (!open_objects.back().insert(key).second) {
          duplicate = std::move(key);
          duplicate_depth = depth;
        }
      }
      return true;
    };
    json header;
    try {
      header = json::parse(text, text + n, on_event);
    } catch (const json::exception& e) {
      fail("header is not valid JSON: ", e.what());
    }
    if (!duplicate.empty()) {
      if (duplicate_depth == 1) fail("duplicate tensor name '", duplicate, "' in the header");
      fail("duplicate key '", duplicate, "' in the header");
    }
    if (!header.is_object()) fail("header is not a JSON object (it is a JSON ", header.type_name(), ")");

    for (auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        if (!value.is_object()) fail("__metadata__ is not an object of strings");
        for (auto& [k, v] : value.items()) {
          if (!v.is_string()) fail("__metadata__ value for key '", k, "' is not a string (", v.dump(), ")");
          metadata_.emplace(k, v.get<std::string>());
        }
        continue;
      }
      tensors_.push_back(parse_entry(key, value, data_size));
    }

    // Ranges must tile [0, data_size) exactly: sort by offset, then each
    // range starts where the previous one ended.
    std::sort(tensors_.begin(), tensors_.end(),
              [](const auto& a, const auto& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
    uint64_t covered = 0;
    const SafetensorsTensorInfo* previous = nullptr;
    for (const auto& t : tensors_) {
      if (t.begin < covered)
        fail("tensor '", t.name, "' bytes [", t.begin, ", ", t.end, ") overlap tensor '", previous->name, "' bytes [",
             previous->begin, ", ", previous->end, ")");
      if (t.begin > covered)
        fail("hole in the data section: bytes [", covered, ", ", t.begin, ") before tensor '", t.name,
             "' belong to no tensor");
      covered = t.end;
      previous = &t;
    }
    if (covered != data_size)
      fail("data section is ", data_size, " bytes but the tensors cover only ", covered,
           " (trailing bytes belong to no tensor)");
    for (std::size_t i = 0; i < tensors_.size(); ++i) index_.emplace(tensors_[i].name, i);
  }

  SafetensorsTensorInfo parse_entry(const std::string& name, const nlohmann::json& entry, uint64_t data_size) const {
    SafetensorsTensorInfo t;
    t.name = name;
    if (!entry.is_object()) fail("entry for tensor '", name, "' is not an object: ", entry.dump());
    auto field = [&](const char* key) -> const nlohmann::json& {
      auto it = entry.find(key);
      if (it == entry.end()) fail("tensor '", name, "' has no \"", key, "\"");
      return *it;
    };
    const auto& dtype = field("dtype");
    if (!dtype.is_string()) fail("tensor '", name, "': dtype is not a string: ", dtype.dump());
    t.dtype_name = dtype.get<std::string>();
    const SafetensorsDType* d = detail::find_safetensors_dtype(t.dtype_name);
    if (d == nullptr) fail("tensor '", name, "' has unknown dtype '", t.dtype_name, "'");
    t.dtype = d->dtype;

    const auto& shape = field("shape");
    if (!shape.is_array()) fail("tensor '", name, "': shape is not an array: ", shape.dump());
    for (const auto& e : shape) {
      if (!e.is_number_integer()) fail("tensor '", name, "': shape ", shape.dump(), " has a non-integer extent");
      if (e.is_number_unsigned()) {
        if (e.get<uint64_t>() > uint64_t(INT64_MAX))
          fail("tensor '", name, "': shape ", shape.dump(), " has an extent too large");
        t.dims.push_back(int64_t(e.get<uint64_t>()));
      } else {
        const int64_t v = e.get<int64_t>();
        if (v < 0) fail("tensor '", name, "': shape ", shape.dump(), " has a negative extent ", v);
        t.dims.push_back(v);
      }
    }
    t.numel = 1;
    for (int64_t e : t.dims)
      if (!detail::checked_mul(t.numel, e, t.numel))
        fail("tensor '", name, "': element count of shape ", shape.dump(), " overflows");

    const auto& offsets = field("data_offsets");
    if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
        !offsets[1].is_number_unsigned())
      fail("tensor '", name, "': data_offsets ", offsets.dump(), " is not [begin, end] of non-negative integers");
    t.begin = offsets[0].get<uint64_t>();
    t.end = offsets[1].get<uint64_t>();
    if (t.begin > t.end) fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] has begin > end");

    int64_t bits = 0;
    if (!detail::checked_mul(t.numel, d->bits, bits))
      fail("tensor '", name, "': byte size of shape ", shape.dump(), " overflows");
    if (bits % 8 != 0)
      fail("tensor '", name, "': ", t.numel, " elements of ", t.dtype_name, " do not fill a whole number of bytes");
    const uint64_t expected = uint64_t(bits / 8);
    if (t.nbytes() != expected)
      fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] span ", t.nbytes(), " bytes but ",
           t.dtype_name, " ", shape.dump(), " needs ", expected);
    if (t.end > data_size)
      fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] run past the data section (", data_size,
           " bytes; truncated?)");
    return t;
  }

  std::filesystem::path path_;
  detail::MappedFile map_;
  uint64_t data_offset_ = 0;
  std::vector<SafetensorsTensorInfo> tensors_;  // ascending offsets
  std::map<std::string, std::size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

namespace detail {

// fsync on a directory makes a rename in it durable.
inline void fsync_directory(const std::filesystem::path& dir) {
  const std::filesystem::path d = dir.empty() ? std::filesystem::path(".") : dir;
  FileDescriptor fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) SLIME_FAIL("cannot open directory '", d.string(), "' to fsync it: ", errno_text(errno));
  if (::fsync(fd.get()) != 0) SLIME_FAIL("fsync of directory '", d.string(), "' failed: ", errno_text(errno));
}

// Writes `path` atomically: the bytes go to "<path>.tmp.<pid>" in the same
// directory, which commit() fsyncs and renames over `path` (then fsyncs the
// directory). Destroyed without commit() (an exception), the temporary file
// is removed and `path` is untouched.
class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::filesystem::path path)
      : path_(std::move(path)), tmp_(path_.string() + ".tmp." + std::to_string(::getpid())) {
    fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
    if (!fd_.valid())
      SLIME_FAIL("cannot create '", tmp_.string(), "' to write '", path_.string(), "': ", errno_text(errno));
  }
  ~AtomicFileWriter() {
    if (!committed_) {
      fd_.reset();
      (void)::unlink(tmp_.c_str());
    }
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  void write(const void* data, std::size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_.get(), p, std::min<std::size_t>(n, std::size_t(1) << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        SLIME_FAIL("writing '", path_.string(), "' (via '", tmp_.string(), "') failed: ", errno_text(errno));
      }
      p += w;
      n -= std::size_t(w);
      written_ += uint64_t(w);
    }
  }
  uint64_t written() const { return written_; }

  void commit() {
    if (::fsync(fd_.get()) != 0) SLIME_FAIL("fsync of '", tmp_.string(), "' failed: ", errno_text(errno));
    if (const int err = fd_.close(); err != 0) SLIME_FAIL("closing '", tmp_.string(), "' failed: ", errno_text(err));
    if (::rename(tmp_.c_str(), path_.c_str()) != 0)
      SLIME_FAIL("renaming '", tmp_.string(), "' to '", path_.string(), "' failed: ", errno_text(errno));
    committed_ = true;
    fsync_directory(path_.parent_path());
  }

 private:
  std::filesystem::path path_, tmp_;
  FileDescriptor fd_;
  uint64_t written_ = 0;
  bool committed_ = false;
};

inline void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFileWriter out(path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

// The header bytes (JSON padded with spaces to a multiple of 8) for
// `entries` laid out contiguously in order. Checks the names.
inline std::string safetensors_header(const std::filesystem::path& path, std::span<const SafetensorsEntry> entries,
                                      const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    nlohmann::ordered_json m = nlohmann::ordered_json::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    header["__metadata__"] = std::move(m);
  }
  std::set<std::string_view> seen;
  uint64_t offset = 0;
  for (const auto& e : entries) {
    if (e.name == "__metadata__")
      SLIME_FAIL("writing '", path.string(), "': '__metadata__' is reserved and cannot name a tensor");
    if (!seen.insert(e.name).second) SLIME_FAIL("writing '", path.string(), "': duplicate tensor name '", e.name, "'");
    nlohmann::ordered_json entry = nlohmann::ordered_json::object();
    entry["dtype"] = safetensors_dtype_name(e.dtype);
    entry["shape"] = std::vector<int64_t>(e.shape.begin(), e.shape.end());
    entry["data_offsets"] = {offset, offset + e.nbytes()};
    offset += e.nbytes();
    header[e.name] = std::move(entry);
  }
  std::string text = header.dump();
  text.append((kSafetensorsAlignment - text.size() % kSafetensorsAlignment) % kSafetensorsAlignment, ' ');
  if (text.size() > kSafetensorsMaxHeaderBytes)
    SLIME_FAIL("writing '", path.string(), "': header of ", text.size(), " bytes exceeds the ",
               kSafetensorsMaxHeaderBytes, "-byte limit readers accept");
  return text;
}

// The same for tensors; checks that each is defined.
inline std::string safetensors_header(const std::filesystem::path& path,
                                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                                      const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    if (!t.defined()) SLIME_FAIL("writing '", path.string(), "': tensor '", name, "' is undefined");
    entries.push_back({name, t.dtype(), t.shape()});
  }
  return safetensors_header(path, entries, metadata);
}

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

}  // namespace detail

// Writes `tensors` (in this order, contiguous, data section 8-byte aligned)
// and `metadata` as a safetensors file, atomically: on any error `path` is
// left as it was and no temporary file remains. CUDA tensors are copied to
// the host first.
inline void write_safetensors(const std::filesystem::path& path,
                              const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {}) {
  const std::string header = detail::safetensors_header(path, tensors, metadata);
  detail::AtomicFileWriter out(path);
  const uint64_t n = header.size();
  out.write(&n, 8);
  out.write(header.data(), header.size());
  for (const auto& [name, t] : tensors) detail::write_tensor_bytes(out, t);
  out.commit();
}

// A Hugging Face checkpoint directory: model.safetensors, or shards listed by
// model.safetensors.index.json ("weight_map": tensor -> shard file). When both
// exist, model.safetensors wins, as in transformers. Every shard is opened
// (mapped) and checked against the index up front.
class SafetensorsDir {
 public:
  explicit SafetensorsDir(std::filesystem::path dir) : dir_(std::move(dir)) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!fs::is_directory(dir_, ec)) SLIME_FAIL("checkpoint directory '", dir_.string(), "' does not exist");
    const fs::path single = dir_ / kSafetensorsSingleFile;
    const fs::path index = dir_ / kSafetensorsIndexFile;
    if (fs::exists(single, ec)) {
      files_.emplace_back(single);
      for (const auto& name : files_[0].names()) where_.emplace(name, 0);
      return;
    }
    if (!fs::exists(index, ec))
      SLIME_FAIL("checkpoint directory '", dir_.string(), "' has neither ", kSafetensorsSingleFile, " nor ",
                 kSafetensorsIndexFile);
    index_path_ = index;
    load_index();
  }

  const std::filesystem::path& path() const { return dir_; }
  // The index file; empty for a single-file checkpoint.
  const std::filesystem::path& index_path() const { return index_path_; }
  bool sharded() const { return !index_path_.empty(); }
  std::size_t size() const { return where_.size(); }
  // All tensor names, sorted.
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    out.reserve(where_.size());
    for (const auto& [name, file] : where_) out.push_back(name);
    return out;
  }
  bool contains(std::string_view name) const { return where_.find(name) != where_.end(); }
  const SafetensorsFile& file_of(std::string_view name) const {
    auto it = where_.find(name);
    if (it == where_.end())
      SLIME_FAIL("checkpoint '", describe(), "': no tensor named '", name, "' (", where_.size(), " tensors)");
    return files_[it->second];
  }
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

  void load_index() {
    namespace fs = std::filesystem;
    nlohmann::json index;
    {
      const detail::MappedFile text(index_path_);
      const char* p = reinterpret_cast<const char*>(text.data());
      try {
        index = nlohmann::json::parse(p, p + text.size());
      } catch (const nlohmann::json::exception& e) {
        fail_index("not valid JSON: ", e.what());
      }
    }
    if (!index.is_object()) fail_index("not a JSON object");
    auto wm = index.find("weight_map");
    if (wm == index.end() || !wm->is_object()) fail_index("has no \"weight_map\" object");
    std::map<std::string, std::size_t> shard_of_file;
    for (auto& [tensor, shard] : wm->items()) {
      if (!shard.is_string()) fail_index("weight_map entry for '", tensor, "' is not a file name: ", shard.dump());
      const fs::path rel(shard.get<std::string>());
      const bool escapes = std::any_of(rel.begin(), rel.end(), [](const fs::path& c) { return c == ".."; });
      if (rel.empty() || rel.is_absolute() || escapes)
        fail_index("weight_map entry for '", tensor, "' names '", rel.string(), "', which is not a file inside '",
                   dir_.string(), "'");
      auto [it, added] = shard_of_file.emplace(rel.string(), files_.size());
      if (added) {
        const fs::path file = dir_ / rel;
        std::error_code ec;
        if (!fs::exists(file, ec))
          fail_index("tensor '", tensor, "' is in shard '", rel.string(), "', which does not exist in '", dir_.string(),
                     "'");
        files_.emplace_back(file);
      }
      if (!files_[it->second].contains(tensor))
        fail_index("tensor '", tensor, "' is mapped to shard '", rel.string(), "', which does not contain it");
      where_.emplace(tensor, it->second);
    }
  }

  std::filesystem::path dir_;
  std::filesystem::path index_path_;
  std::vector<SafetensorsFile> files_;
  std::map<std::string, std::size_t, std::less<>> where_;  // tensor -> files_ index
};

namespace detail {

// "model-00001-of-00003.safetensors": the shard names save_pretrained uses.
inline std::string shard_file_name(std::size_t i, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

inline bool is_shard_file_name(std::string_view s) {
  constexpr std::string_view pre = "model-", mid = "-of-", post = ".safetensors";
  if (!s.starts_with(pre) || !s.ends_with(post)) return false;
  s = s.substr(pre.size(), s.size() - pre.size() - post.size());
  const auto digits = [](std::string_view d) {
    return d.size() >= 5 && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  const auto at = s.find(mid);
  return at != std::string_view::npos && digits(s.substr(0, at)) && digits(s.substr(at + mid.size()));
}

// Splits tensors of `sizes` bytes, in order, into shards of at most
// `max_shard_bytes` (a new shard when the next tensor would overflow the
// current one; a tensor larger than the limit gets a shard of its own).
// Returns the index of each shard's first tensor; always at least one shard.
inline std::vector<std::size_t> plan_shards(std::span<const uint64_t> sizes, uint64_t max_shard_bytes) {
  std::vector<std::size_t> first{0};
  uint64_t in_shard = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (i > first.back() && in_shard + sizes[i] > max_shard_bytes) {
      first.push_back(i);
      in_shard = 0;
    }
    in_shard += sizes[i];
  }
  return first;
}

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
  namespace fs = std::filesystem;
  SLIME_CHECK(max_shard_bytes > 0, "write_safetensors_dir('", dir.string(), "'): max_shard_bytes must be positive");
  std::set<std::string_view> seen;
  for (const auto& [name, t] : tensors) {
    if (!seen.insert(name).second)
      SLIME_FAIL("writing checkpoint '", dir.string(), "': duplicate tensor name '", name, "'");
    if (!t.defined()) SLIME_FAIL("writing checkpoint '", dir.string(), "': tensor '", name, "' is undefined");
  }
  metadata.emplace("format", "pt");

  std::vector<uint64_t> sizes;
  sizes.reserve(tensors.size());
  for (const auto& entry : tensors) sizes.push_back(entry.second.nbytes());
  const std::vector<std::size_t> first = detail::plan_shards(sizes, max_shard_bytes);
  std::vector<std::vector<std::pair<std::string, Tensor>>> shards(first.size());
  uint64_t total = 0;
  for (std::size_t s = 0; s < first.size(); ++s) {
    const std::size_t stop = s + 1 < first.size() ? first[s + 1] : tensors.size();
    for (std::size_t i = first[s]; i < stop; ++i) {
      shards[s].push_back(tensors[i]);
      total += sizes[i];
    }
  }

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) SLIME_FAIL("cannot create checkpoint directory '", dir.string(), "': ", ec.message());

  // Removes the files of an earlier checkpoint that loaders would read
  // (model.safetensors, the index, shards) unless `keep` names them.
  const auto remove_stale = [&](const std::set<std::string>& keep) {
    bool removed = false;
    std::error_code list_ec;
    for (const auto& e : fs::directory_iterator(dir, list_ec)) {
      const std::string name = e.path().filename().string();
      const bool checkpoint_file =
          name == kSafetensorsSingleFile || name == kSafetensorsIndexFile || detail::is_shard_file_name(name);
      if (checkpoint_file && !keep.count(name)) {
        if (::unlink(e.path().c_str()) != 0)
          SLIME_FAIL("cannot remove stale checkpoint file '", e.path().string(), "': ", detail::errno_text(errno));
        removed = true;
      }
    }
    if (list_ec) SLIME_FAIL("cannot list checkpoint directory '", dir.string(), "': ", list_ec.message());
    if (removed) detail::fsync_directory(dir);
  };

  if (shards.size() == 1) {
    // model.safetensors takes precedence over an index, so the directory
    // reads as the new checkpoint from the rename on.
    write_safetensors(dir / kSafetensorsSingleFile, shards[0], metadata);
    remove_stale({std::string(kSafetensorsSingleFile)});
    return;
  }
  std::set<std::string> keep;
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string file = detail::shard_file_name(i + 1, shards.size());
    write_safetensors(dir / file, shards[i], metadata);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
    keep.insert(file);
  }
  // A stale model.safetensors would shadow the index: remove it (and stale
  // shards) before the index appears, so that a crash in between leaves a
  // directory that fails to load rather than one that loads old weights.
  remove_stale(keep);
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  detail::write_file_atomically(dir / kSafetensorsIndexFile, index.dump(2) + "\n");
}

}  // namespace slime::io
