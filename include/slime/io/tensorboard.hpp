// slime/io/tensorboard.hpp: a TensorBoard event-file writer (scalars) with no
// TensorBoard or protobuf dependency: TFRecord framing and the Event protobuf
// are encoded by hand.
//
// File: <log_dir>/events.out.tfevents.<unix seconds>.<hostname>[.<n>], a
// sequence of TFRecords:
//   u64 length (little endian) | u32 masked CRC-32C(length bytes) | data | u32 masked CRC-32C(data)
// with mask(crc) = ((crc >> 15) | (crc << 17)) + 0xa282ead8. Each record's data
// is one Event message (tensorflow/core/util/event.proto):
//   1 wall_time double, 2 step int64, 3 file_version string ("brain.Event:2",
//   first record only), 5 summary Summary, 6 session_log SessionLog
//   Summary: repeated 1 value Summary.Value { 1 tag string, 2 simple_value float }
//   SessionLog: 1 status enum (START = 1)
#pragma once

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/error.hpp"

namespace slime::io {

namespace detail {

inline constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli polynomial
    table[i] = c;
  }
  return table;
}

inline constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

}  // namespace detail

// CRC-32C (Castagnoli), as used by TFRecord; continues from `crc` (0 to start).
inline uint32_t crc32c(const void* data, std::size_t size, uint32_t crc = 0) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
  for (std::size_t i = 0; i < size; ++i) crc = detail::kCrc32cTable[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return ~crc;
}
inline uint32_t crc32c(std::string_view bytes) { return crc32c(bytes.data(), bytes.size()); }

// The TFRecord "masked" CRC (a CRC of data that holds CRCs is weak otherwise).
inline uint32_t masked_crc32c(const void* data, std::size_t size) {
  const uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

namespace detail {

// Minimal protobuf wire-format encoding (little-endian host assumed, as on
// every platform slime builds for).
inline void pb_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char(uint8_t(v) | 0x80u));
    v >>= 7;
  }
  out.push_back(char(uint8_t(v)));
}
inline void pb_tag(std::string& out, uint32_t field, uint32_t wire_type) {
  pb_varint(out, (uint64_t(field) << 3) | wire_type);
}
inline void pb_double(std::string& out, uint32_t field, double v) {
  pb_tag(out, field, 1);
  char b[8];
  std::memcpy(b, &v, 8);
  out.append(b, 8);
}
inline void pb_float(std::string& out, uint32_t field, float v) {
  pb_tag(out, field, 5);
  char b[4];
  std::memcpy(b, &v, 4);
  out.append(b, 4);
}
inline void pb_int64(std::string& out, uint32_t field, int64_t v) {
  pb_tag(out, field, 0);
  pb_varint(out, uint64_t(v));  // negative int64 takes ten bytes, as protobuf specifies
}
inline void pb_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  pb_tag(out, field, 2);
  pb_varint(out, bytes.size());
  out.append(bytes);
}

inline void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(char(uint8_t(v >> (8 * i))));
}
inline void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(char(uint8_t(v >> (8 * i))));
}

inline double unix_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

inline std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

}  // namespace detail

// One TFRecord around `data`.
inline std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  detail::put_u64(out, data.size());
  detail::put_u32(out, masked_crc32c(out.data(), 8));
  out.append(data);
  detail::put_u32(out, masked_crc32c(data.data(), data.size()));
  return out;
}

// An Event holding scalar summaries (tag, value); an empty list encodes an
// Event with no summary.
inline std::string encode_scalar_event(double wall_time, int64_t step,
                                       const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    detail::pb_bytes(v, 1, tag);
    detail::pb_float(v, 2, value);
    detail::pb_bytes(summary, 1, v);
  }
  std::string event;
  detail::pb_double(event, 1, wall_time);
  detail::pb_int64(event, 2, step);
  if (!values.empty()) detail::pb_bytes(event, 5, summary);
  return event;
}

// Writes scalar summaries to a new event file in `log_dir` (created if
// missing). Thread-safe; records reach the OS on flush(), on destruction, and
// every `flush_every` records.
class TensorBoardWriter {
 public:
  explicit TensorBoardWriter(const std::filesystem::path& log_dir, int flush_every = 1) : flush_every_(flush_every) {
    SLIME_CHECK(flush_every >= 1, "TensorBoardWriter: flush_every must be >= 1, got ", flush_every);
    std::error_code ec;
    std::filesystem::create_directories(log_dir, ec);
    SLIME_CHECK(!ec, "TensorBoardWriter: cannot create log directory '", log_dir.string(), "': ", ec.message());
    const double now = detail::unix_time_now();
    const std::string base = "events.out.tfevents." + std::to_string(int64_t(now)) + "." + detail::host_name();
    // Two writers started in the same second in one directory get distinct
    // names; TensorBoard reads every file whose name holds "tfevents".
    path_ = log_dir / base;
    for (int n = 1; std::filesystem::exists(path_); ++n) path_ = log_dir / (base + "." + std::to_string(n));
    file_ = std::fopen(path_.c_str(), "wb");
    SLIME_CHECK(file_ != nullptr, "TensorBoardWriter: cannot create '", path_.string(), "': ", std::strerror(errno));
    std::string event;
    detail::pb_double(event, 1, now);
    detail::pb_int64(event, 2, 0);
    detail::pb_bytes(event, 3, "brain.Event:2");
    write_record(event);
    flush_locked();
  }

  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  ~TensorBoardWriter() {
    if (file_ != nullptr) std::fclose(file_);  // flushes; errors cannot be reported from here
  }

  const std::filesystem::path& path() const { return path_; }

  // One scalar (stored as float32, as TensorBoard's simple_value is).
  void add_scalar(std::string_view tag, double value, int64_t step, double wall_time = -1) {
    add_scalars_impl({{std::string(tag), float(value)}}, step, wall_time);
  }

  // Several scalars of one step in one Event (one record).
  void add_scalars(const std::map<std::string, double>& values, int64_t step, double wall_time = -1) {
    add_scalars(std::vector<std::pair<std::string, double>>(values.begin(), values.end()), step, wall_time);
  }
  void add_scalars(const std::vector<std::pair<std::string, double>>& values, int64_t step, double wall_time = -1) {
    std::vector<std::pair<std::string, float>> v;
    v.reserve(values.size());
    for (const auto& [tag, value] : values) v.emplace_back(tag, float(value));
    add_scalars_impl(v, step, wall_time);
  }

  // Marks a (re)start at `step`: TensorBoard's event accumulator then drops
  // events of earlier files with step >= `step` (the steps a resumed run
  // writes again).
  void add_session_start(int64_t step, double wall_time = -1) {
    std::string session_log;
    detail::pb_tag(session_log, 1, 0);
    detail::pb_varint(session_log, 1);  // SessionLog.START
    std::string event;
    detail::pb_double(event, 1, wall_time >= 0 ? wall_time : detail::unix_time_now());
    detail::pb_int64(event, 2, step);
    detail::pb_bytes(event, 6, session_log);
    std::lock_guard<std::mutex> lock(mutex_);
    write_record(event);
    flush_locked();
  }

  void flush() {
    std::lock_guard<std::mutex> lock(mutex_);
    flush_locked();
  }

 private:
  void add_scalars_impl(const std::vector<std::pair<std::string, float>>& values, int64_t step, double wall_time) {
    for (const auto& v : values) SLIME_CHECK(!v.first.empty(), "TensorBoardWriter: empty tag at step ", step);
    const std::string event = encode_scalar_event(wall_time >= 0 ? wall_time : detail::unix_time_now(), step, values);
    std::lock_guard<std::mutex> lock(mutex_);
    write_record(event);
    if (++unflushed_ >= flush_every_) flush_locked();
  }

  void write_record(std::string_view event) {
    const std::string record = tfrecord(event);
    if (std::fwrite(record.data(), 1, record.size(), file_) != record.size()) {
      SLIME_FAIL("TensorBoardWriter: write to '", path_.string(), "' failed: ", std::strerror(errno));
    }
  }

  void flush_locked() {
    unflushed_ = 0;
    if (std::fflush(file_) != 0) {
      SLIME_FAIL("TensorBoardWriter: flush of '", path_.string(), "' failed: ", std::strerror(errno));
    }
  }

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::mutex mutex_;
  int flush_every_ = 1;
  int unflushed_ = 0;
};

}  // namespace slime::io
