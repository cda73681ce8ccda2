// slime/io/safetensors.cpp: the bodies of slime/io/safetensors.hpp (mapping, header parsing and
// validation, dtype conversion, atomic writes, checkpoint directories). Nothing here allocates or
// copies tensors: the code that does depends on SLIME_HAS_CUDA and stays inline in the header.
#include "slime/io/safetensors.hpp"

#include "slime/core/json.hpp"
#include "slime/core/regular_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
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

namespace slime::io {
namespace detail {
namespace {

constexpr std::array<SafetensorsDType, 22> kSafetensorsDTypes{{
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

template <class T>
constexpr bool is_float_storage_v = std::is_same_v<T, float> || std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;

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

// a * b for non-negative values; false on overflow past int64.
bool checked_mul(int64_t a, int64_t b, int64_t& out) { return !__builtin_mul_overflow(a, b, &out); }

// A name shard_file_name produces (any width of five digits or more).
bool is_shard_file_name(std::string_view s) {
  constexpr std::string_view pre = "model-", mid = "-of-", post = ".safetensors";
  if (!s.starts_with(pre) || !s.ends_with(post)) return false;
  s = s.substr(pre.size(), s.size() - pre.size() - post.size());
  const auto digits = [](std::string_view d) {
    return d.size() >= 5 && std::all_of(d.begin(), d.end(), [](char c) { return c >= '0' && c <= '9'; });
  };
  const auto at = s.find(mid);
  return at != std::string_view::npos && digits(s.substr(0, at)) && digits(s.substr(at + mid.size()));
}

}  // namespace

const SafetensorsDType* find_safetensors_dtype(std::string_view name) {
  for (const auto& d : kSafetensorsDTypes)
    if (d.name == name) return &d;
  return nullptr;
}

std::string errno_text(int err) { return std::string(std::strerror(err)); }

MappedFile::MappedFile(const std::filesystem::path& path) {
  // Refuses FIFOs and devices without blocking in open().
  FileDescriptor fd = open_regular_file(path, "file");
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) SLIME_FAIL("cannot stat '", path.string(), "': ", errno_text(errno));
  size_ = std::size_t(st.st_size);
  if (size_ == 0) return;  // mmap refuses empty mappings; callers see size() == 0
  void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd.get(), 0);
  if (p == MAP_FAILED) SLIME_FAIL("cannot mmap '", path.string(), "' (", size_, " bytes): ", errno_text(errno));
  data_ = static_cast<const std::byte*>(p);
}

void MappedFile::unmap() noexcept {
  if (data_ != nullptr) (void)::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
}

void convert_elements(const std::byte* src, DType from, void* dst, DType to, int64_t n, std::string_view what) {
  if (n == 0) return;
  if (from == to) {
    std::memcpy(dst, src, std::size_t(n) * dtype_size(to));
    return;
  }
  visit_dtype(from, [&](auto s) {
    visit_dtype(to, [&](auto d) { convert_typed<decltype(s)>(src, static_cast<decltype(d)*>(dst), n, what); });
  });
}

}  // namespace detail

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.name);
  return out;
}

const SafetensorsTensorInfo& SafetensorsFile::info(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail("no tensor named '", name, "' (the file holds ", tensors_.size(), " tensors)");
  return tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::raw_bytes(std::string_view name) const {
  const auto& t = info(name);
  return {map_.data() + data_offset_ + t.begin, std::size_t(t.nbytes())};
}

std::string SafetensorsFile::describe(std::string_view name) const {
  return slime::detail::concat("safetensors file '", path_.string(), "': tensor '", name, "'");
}

DType SafetensorsFile::supported_dtype(const SafetensorsTensorInfo& t) const {
  if (!t.dtype)
    fail("tensor '", t.name, "' has unsupported dtype ", t.dtype_name,
         " (slime reads F32, BF16, F16, I32, I64 and U8)");
  if (t.dims.size() > std::size_t(Shape::kMaxDims))
    fail("tensor '", t.name, "' has ", t.dims.size(), " dims; slime tensors have at most ", Shape::kMaxDims);
  return *t.dtype;
}

void SafetensorsFile::parse_header() {
  using nlohmann::json;
  const uint64_t file_size = map_.size();
  if (file_size < 8)
    fail("file is ", file_size, " bytes, shorter than the 8-byte header length (truncated or not safetensors)");
  uint64_t n = 0;
  std::memcpy(&n, map_.data(), 8);
  if (n > kSafetensorsMaxHeaderBytes)
    fail("header length ", n, " exceeds the ", kSafetensorsMaxHeaderBytes, "-byte limit (corrupt or not safetensors)");
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
  const json header = parse_json(std::string_view(text, n),
                                 slime::detail::concat("safetensors file '", path_.string(), "': header"), on_event);
  if (!duplicate.empty()) {
    if (duplicate_depth == 1) fail("duplicate tensor name '", duplicate, "' in the header");
    fail("duplicate key '", duplicate, "' in the header");
  }
  if (!header.is_object()) fail("header is not a JSON object (it is a JSON ", header.type_name(), ")");

  for (auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      if (!value.is_object()) fail("__metadata__ is not an object of strings");
      for (auto& [k, v] : value.items()) {
        if (!v.is_string()) fail("__metadata__ value for key '", k, "' is not a string (", json_excerpt(v), ")");
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

SafetensorsTensorInfo SafetensorsFile::parse_entry(const std::string& name, const nlohmann::json& entry,
                                                   uint64_t data_size) const {
  SafetensorsTensorInfo t;
  t.name = name;
  if (!entry.is_object()) fail("entry for tensor '", name, "' is not an object: ", json_excerpt(entry));
  auto field = [&](const char* key) -> const nlohmann::json& {
    auto it = entry.find(key);
    if (it == entry.end()) fail("tensor '", name, "' has no \"", key, "\"");
    return *it;
  };
  const auto& dtype = field("dtype");
  if (!dtype.is_string()) fail("tensor '", name, "': dtype is not a string: ", json_excerpt(dtype));
  t.dtype_name = dtype.get<std::string>();
  const SafetensorsDType* d = detail::find_safetensors_dtype(t.dtype_name);
  if (d == nullptr) fail("tensor '", name, "' has unknown dtype '", t.dtype_name, "'");
  t.dtype = d->dtype;

  const auto& shape = field("shape");
  if (!shape.is_array()) fail("tensor '", name, "': shape is not an array: ", json_excerpt(shape));
  for (const auto& e : shape) {
    if (!e.is_number_integer()) fail("tensor '", name, "': shape ", json_excerpt(shape), " has a non-integer extent");
    if (e.is_number_unsigned()) {
      if (e.get<uint64_t>() > uint64_t(INT64_MAX))
        fail("tensor '", name, "': shape ", json_excerpt(shape), " has an extent too large");
      t.dims.push_back(int64_t(e.get<uint64_t>()));
    } else {
      const int64_t v = e.get<int64_t>();
      if (v < 0) fail("tensor '", name, "': shape ", json_excerpt(shape), " has a negative extent ", v);
      t.dims.push_back(v);
    }
  }
  t.numel = 1;
  for (int64_t e : t.dims)
    if (!detail::checked_mul(t.numel, e, t.numel))
      fail("tensor '", name, "': element count of shape ", json_excerpt(shape), " overflows");

  const auto& offsets = field("data_offsets");
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned())
    fail("tensor '", name, "': data_offsets ", json_excerpt(offsets), " is not [begin, end] of non-negative integers");
  t.begin = offsets[0].get<uint64_t>();
  t.end = offsets[1].get<uint64_t>();
  if (t.begin > t.end) fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] has begin > end");

  int64_t bits = 0;
  if (!detail::checked_mul(t.numel, d->bits, bits))
    fail("tensor '", name, "': byte size of shape ", json_excerpt(shape), " overflows");
  if (bits % 8 != 0)
    fail("tensor '", name, "': ", t.numel, " elements of ", t.dtype_name, " do not fill a whole number of bytes");
  const uint64_t expected = uint64_t(bits / 8);
  if (t.nbytes() != expected)
    fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] span ", t.nbytes(), " bytes but ",
         t.dtype_name, " ", json_excerpt(shape), " needs ", expected);
  if (t.end > data_size)
    fail("tensor '", name, "': data_offsets [", t.begin, ", ", t.end, "] run past the data section (", data_size,
         " bytes; truncated?)");
  return t;
}

namespace detail {

void fsync_directory(const std::filesystem::path& dir) {
  const std::filesystem::path d = dir.empty() ? std::filesystem::path(".") : dir;
  FileDescriptor fd(::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!fd.valid()) SLIME_FAIL("cannot open directory '", d.string(), "' to fsync it: ", errno_text(errno));
  if (::fsync(fd.get()) != 0) SLIME_FAIL("fsync of directory '", d.string(), "' failed: ", errno_text(errno));
}

AtomicFileWriter::AtomicFileWriter(std::filesystem::path path)
    : path_(std::move(path)), tmp_(path_.string() + ".tmp." + std::to_string(::getpid())) {
  fd_ = FileDescriptor(::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666));
  if (!fd_.valid())
    SLIME_FAIL("cannot create '", tmp_.string(), "' to write '", path_.string(), "': ", errno_text(errno));
}

AtomicFileWriter::~AtomicFileWriter() {
  if (!committed_) {
    fd_.reset();
    (void)::unlink(tmp_.c_str());
  }
}

void AtomicFileWriter::write(const void* data, std::size_t n) {
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

void AtomicFileWriter::commit() {
  if (::fsync(fd_.get()) != 0) SLIME_FAIL("fsync of '", tmp_.string(), "' failed: ", errno_text(errno));
  if (const int err = fd_.close(); err != 0) SLIME_FAIL("closing '", tmp_.string(), "' failed: ", errno_text(err));
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    SLIME_FAIL("renaming '", tmp_.string(), "' to '", path_.string(), "' failed: ", errno_text(errno));
  committed_ = true;
  fsync_directory(path_.parent_path());
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  AtomicFileWriter out(path);
  out.write(bytes.data(), bytes.size());
  out.commit();
}

// The header bytes (JSON padded with spaces to a multiple of 8) for
// `entries` laid out contiguously in order. Checks the names.
std::string safetensors_header(const std::filesystem::path& path, std::span<const SafetensorsEntry> entries,
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
std::string safetensors_header(const std::filesystem::path& path,
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

void write_safetensors_with(const std::filesystem::path& path,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const std::map<std::string, std::string>& metadata, AppendTensorFn append) {
  const std::string header = safetensors_header(path, tensors, metadata);
  AtomicFileWriter out(path);
  const uint64_t n = header.size();
  out.write(&n, 8);
  out.write(header.data(), header.size());
  for (const auto& [name, t] : tensors) append(out, t);
  out.commit();
}

std::string shard_file_name(std::size_t i, std::size_t n) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i, n);
  return buf;
}

std::vector<std::size_t> plan_shards(std::span<const uint64_t> sizes, uint64_t max_shard_bytes) {
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

void write_safetensors_dir_with(const std::filesystem::path& dir,
                                const std::vector<std::pair<std::string, Tensor>>& tensors, uint64_t max_shard_bytes,
                                std::map<std::string, std::string> metadata, AppendTensorFn append) {
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
  const std::vector<std::size_t> first = plan_shards(sizes, max_shard_bytes);
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
          name == kSafetensorsSingleFile || name == kSafetensorsIndexFile || is_shard_file_name(name);
      if (checkpoint_file && !keep.count(name)) {
        if (::unlink(e.path().c_str()) != 0)
          SLIME_FAIL("cannot remove stale checkpoint file '", e.path().string(), "': ", errno_text(errno));
        removed = true;
      }
    }
    if (list_ec) SLIME_FAIL("cannot list checkpoint directory '", dir.string(), "': ", list_ec.message());
    if (removed) fsync_directory(dir);
  };

  if (shards.size() == 1) {
    // model.safetensors takes precedence over an index, so the directory
    // reads as the new checkpoint from the rename on.
    write_safetensors_with(dir / kSafetensorsSingleFile, shards[0], metadata, append);
    remove_stale({std::string(kSafetensorsSingleFile)});
    return;
  }
  std::set<std::string> keep;
  nlohmann::json weight_map = nlohmann::json::object();
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const std::string file = shard_file_name(i + 1, shards.size());
    write_safetensors_with(dir / file, shards[i], metadata, append);
    for (const auto& [name, t] : shards[i]) weight_map[name] = file;
    keep.insert(file);
  }
  // A stale model.safetensors would shadow the index: remove it (and stale
  // shards) before the index appears, so that a crash in between leaves a
  // directory that fails to load rather than one that loads old weights.
  remove_stale(keep);
  nlohmann::json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
  write_file_atomically(dir / kSafetensorsIndexFile, index.dump(2) + "\n");
}

}  // namespace detail

SafetensorsDir::SafetensorsDir(std::filesystem::path dir) : dir_(std::move(dir)) {
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

std::vector<std::string> SafetensorsDir::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

const SafetensorsFile& SafetensorsDir::file_of(std::string_view name) const {
  auto it = where_.find(name);
  if (it == where_.end())
    SLIME_FAIL("checkpoint '", describe(), "': no tensor named '", name, "' (", where_.size(), " tensors)");
  return files_[it->second];
}

void SafetensorsDir::load_index() {
  namespace fs = std::filesystem;
  nlohmann::json index;
  {
    const detail::MappedFile text(index_path_);
    const char* p = reinterpret_cast<const char*>(text.data());
    index = parse_json(std::string_view(p, text.size()),
                       slime::detail::concat("checkpoint index '", index_path_.string(), "'"));
  }
  if (!index.is_object()) fail_index("not a JSON object");
  auto wm = index.find("weight_map");
  if (wm == index.end() || !wm->is_object()) fail_index("has no \"weight_map\" object");
  std::map<std::string, std::size_t> shard_of_file;
  for (auto& [tensor, shard] : wm->items()) {
    if (!shard.is_string()) fail_index("weight_map entry for '", tensor, "' is not a file name: ", json_excerpt(shard));
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

}  // namespace slime::io
