// slime/io/safetensors_writer.hpp: a streaming safetensors writer (every
// tensor declared first, then the data appended one tensor at a time, so the
// caller never holds more than one tensor) and export_hf_directory, which
// writes a whole Hugging Face model directory atomically (temporary directory
// + rename) from tensors produced on demand.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/safetensors.hpp"

namespace slime::io {

namespace detail {

// A name component unique across processes and calls: pid, clock, counter
// and a random word, in hex.
inline std::string make_nonce() {
  static std::atomic<uint64_t> counter{0};
  const uint64_t now = uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  const uint64_t word = (uint64_t(std::random_device{}()) << 32) ^ uint64_t(std::random_device{}());
  char buf[80];
  std::snprintf(buf, sizeof buf, "%llx-%llx-%llx-%llx", static_cast<unsigned long long>(::getpid()),
                static_cast<unsigned long long>(now), static_cast<unsigned long long>(counter++),
                static_cast<unsigned long long>(word));
  return buf;
}

// Makes every file in `dir` (not recursive) and the directory itself durable.
inline void fsync_tree(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file()) continue;
    FileDescriptor fd(::open(e.path().c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) SLIME_FAIL("cannot open '", e.path().string(), "' to fsync it: ", errno_text(errno));
    if (::fsync(fd.get()) != 0) SLIME_FAIL("fsync of '", e.path().string(), "' failed: ", errno_text(errno));
  }
  if (ec) SLIME_FAIL("cannot list directory '", dir.string(), "': ", ec.message());
  fsync_directory(dir);
}

// Publishes the complete directory `tmp` as `target` in one atomic step: a
// rename, or, when `target` already exists, an exchange of the two (Linux
// renameat2 RENAME_EXCHANGE), after which the old contents (now at `tmp`) are
// removed. The parent directory is fsynced, so the result is durable.
inline void publish_directory(const std::filesystem::path& tmp, const std::filesystem::path& target) {
  namespace fs = std::filesystem;
  if (::rename(tmp.c_str(), target.c_str()) != 0) {
    const int err = errno;
    if (err != EEXIST && err != ENOTEMPTY)
      SLIME_FAIL("renaming '", tmp.string(), "' to '", target.string(), "' failed: ", errno_text(err));
#ifdef RENAME_EXCHANGE
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) != 0)
      SLIME_FAIL("'", target.string(), "' exists and exchanging it with '", tmp.string(),
                 "' failed: ", errno_text(errno));
    fsync_directory(target.parent_path());
    std::error_code ec;
    fs::remove_all(tmp, ec);  // the old contents; a leftover is harmless
    return;
#else
    SLIME_FAIL("'", target.string(), "' already exists and this platform cannot replace a directory atomically");
#endif
  }
  fsync_directory(target.parent_path());
}

// Removes a directory tree on destruction unless released.
class TempDirGuard {
 public:
  explicit TempDirGuard(std::filesystem::path path) : path_(std::move(path)) {}
  ~TempDirGuard() {
    if (path_.empty()) return;
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDirGuard(const TempDirGuard&) = delete;
  TempDirGuard& operator=(const TempDirGuard&) = delete;
  const std::filesystem::path& path() const { return path_; }
  void release() { path_.clear(); }

 private:
  std::filesystem::path path_;
};

}  // namespace detail

// Writes one safetensors file with the layout write_safetensors produces:
// the constructor declares every tensor (name, dtype, shape) and writes the
// header; write() then appends the tensors' data in declaration order;
// commit() makes the file appear atomically (fsync + rename). Destroyed
// without commit(), it leaves `path` untouched and no temporary file.
class SafetensorsWriter {
 public:
  SafetensorsWriter(std::filesystem::path path, std::vector<SafetensorsEntry> entries,
                    const std::map<std::string, std::string>& metadata = {})
      : path_(std::move(path)), entries_(std::move(entries)) {
    const std::string header = detail::safetensors_header(path_, entries_, metadata);
    out_.emplace(path_);
    const uint64_t n = header.size();
    out_->write(&n, 8);
    out_->write(header.data(), header.size());
  }

  const std::filesystem::path& path() const { return path_; }
  const std::vector<SafetensorsEntry>& entries() const { return entries_; }
  // Index of the next tensor write() expects (entries().size() when done).
  std::size_t next() const { return next_; }

  // Appends the data of the next declared tensor: `t` must have its dtype and
  // shape (CPU or CUDA; CUDA tensors are copied to the host first).
  void write(const Tensor& t) {
    if (next_ >= entries_.size())
      SLIME_FAIL("writing '", path_.string(), "': all ", entries_.size(), " declared tensors are already written");
    const SafetensorsEntry& e = entries_[next_];
    if (!t.defined()) SLIME_FAIL("writing '", path_.string(), "': data for tensor '", e.name, "' is undefined");
    if (t.dtype() != e.dtype || !(t.shape() == e.shape))
      SLIME_FAIL("writing '", path_.string(), "': tensor '", e.name, "' was declared ", dtype_name(e.dtype), " ",
                 e.shape, " but the data is ", t.str());
    detail::write_tensor_bytes(*out_, t);
    ++next_;
  }
  // The same, checking that `name` is the next declared tensor.
  void write(std::string_view name, const Tensor& t) {
    if (next_ < entries_.size() && entries_[next_].name != name)
      SLIME_FAIL("writing '", path_.string(), "': expected data for tensor '", entries_[next_].name,
                 "' (declaration order) but got '", name, "'");
    write(t);
  }

  // Checks that every declared tensor was written, then fsyncs and renames.
  void commit() {
    if (next_ != entries_.size())
      SLIME_FAIL("writing '", path_.string(), "': commit after ", next_, " of ", entries_.size(),
                 " declared tensors (next: '", entries_[next_].name, "')");
    out_->commit();
  }

 private:
  std::filesystem::path path_;
  std::vector<SafetensorsEntry> entries_;
  std::optional<detail::AtomicFileWriter> out_;
  std::size_t next_ = 0;
};

struct HfExportOptions {
  // Above this many data bytes the weights split into
  // model-0000i-of-0000N.safetensors shards plus model.safetensors.index.json
  // (greedy in declaration order, as write_safetensors_dir).
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  // Every shard's __metadata__; "format": "pt" is added unless set.
  std::map<std::string, std::string> metadata;
  // Files copied into the directory under their own names (tokenizer.json,
  // generation_config.json, ...).
  std::vector<std::filesystem::path> copy_files;
};

// Writes a Hugging Face model directory `dir`: config.json (`config`, which
// must be a JSON object), the weights declared by `entries`, and
// options.copy_files. `produce(entry)` is called exactly once per entry, in
// the order of `entries`, and must return that tensor (CPU or CUDA, the
// declared dtype and shape); its result is written and released before the
// next call, so at most one tensor is held at a time (ranks that gather
// sharded parameters for it run the same collectives in the same order).
// The directory appears atomically: everything is written and fsynced in
// "<dir>.tmp-<nonce>" next to it, which is then renamed to `dir` (an existing
// `dir` is replaced as a whole). On any error `dir` is left as it was and the
// temporary directory is removed.
inline void export_hf_directory(const std::filesystem::path& dir, const nlohmann::json& config,
                                const std::vector<SafetensorsEntry>& entries,
                                const std::function<Tensor(const SafetensorsEntry&)>& produce,
                                const HfExportOptions& options = {}) {
  namespace fs = std::filesystem;
  const std::string where = "export_hf_directory('" + dir.string() + "')";
  SLIME_CHECK(!dir.filename().empty(), where, ": the directory must have a name (no trailing '/')");
  SLIME_CHECK(config.is_object(), where, ": config must be a JSON object, got a JSON ", config.type_name());
  SLIME_CHECK(options.max_shard_bytes > 0, where, ": max_shard_bytes must be positive");
  SLIME_CHECK(bool(produce), where, ": no produce function");
  std::map<std::string, std::string> metadata = options.metadata;
  metadata.emplace("format", "pt");

  std::error_code ec;
  const fs::path parent = dir.parent_path().empty() ? fs::path(".") : dir.parent_path();
  fs::create_directories(parent, ec);
  if (ec) SLIME_FAIL(where, ": cannot create '", parent.string(), "': ", ec.message());
  const fs::path tmp = parent / (dir.filename().string() + ".tmp-" + detail::make_nonce());
  if (!fs::create_directory(tmp, ec) || ec)
    SLIME_FAIL(where, ": cannot create the temporary directory '", tmp.string(), "': ", ec.message());
  detail::TempDirGuard guard(tmp);

  std::vector<uint64_t> sizes;
  sizes.reserve(entries.size());
  for (const auto& e : entries) sizes.push_back(e.nbytes());
  const std::vector<std::size_t> first = detail::plan_shards(sizes, options.max_shard_bytes);
  const std::size_t n_shards = first.size();
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total = 0;
  for (std::size_t s = 0; s < n_shards; ++s) {
    const std::size_t stop = s + 1 < n_shards ? first[s + 1] : entries.size();
    const std::string file =
        n_shards == 1 ? std::string(kSafetensorsSingleFile) : detail::shard_file_name(s + 1, n_shards);
    SafetensorsWriter writer(tmp / file,
                             std::vector<SafetensorsEntry>(entries.begin() + std::ptrdiff_t(first[s]),
                                                           entries.begin() + std::ptrdiff_t(stop)),
                             metadata);
    for (std::size_t i = first[s]; i < stop; ++i) {
      writer.write(entries[i].name, produce(entries[i]));
      weight_map[entries[i].name] = file;
      total += sizes[i];
    }
    writer.commit();
  }
  if (n_shards > 1) {
    const nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", std::move(weight_map)}};
    detail::write_file_atomically(tmp / kSafetensorsIndexFile, index.dump(2) + "\n");
  }
  detail::write_file_atomically(tmp / "config.json", config.dump(2) + "\n");
  for (const fs::path& src : options.copy_files) {
    const fs::path to = tmp / src.filename();
    SLIME_CHECK(!fs::exists(to, ec), where, ": copy_files entry '", src.string(), "' collides with '",
                src.filename().string(), "', which the export already wrote");
    fs::copy_file(src, to, ec);
    if (ec) SLIME_FAIL(where, ": cannot copy '", src.string(), "': ", ec.message());
  }
  detail::fsync_tree(tmp);
  detail::publish_directory(tmp, dir);
  guard.release();
}

// The same for tensors already in memory (`tensors` in file order).
inline void export_hf_directory(const std::filesystem::path& dir, const nlohmann::json& config,
                                const std::vector<std::pair<std::string, Tensor>>& tensors,
                                const HfExportOptions& options = {}) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    SLIME_CHECK(t.defined(), "export_hf_directory('", dir.string(), "'): tensor '", name, "' is undefined");
    entries.push_back({name, t.dtype(), t.shape()});
  }
  std::size_t i = 0;
  export_hf_directory(
      dir, config, entries, [&](const SafetensorsEntry&) { return tensors[i++].second; }, options);
}

}  // namespace slime::io
