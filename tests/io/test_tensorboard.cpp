// TensorBoard event files: CRC-32C vectors, then files written by
// TensorBoardWriter read back by an independent TFRecord + protobuf reader
// (CRCs verified, every Event field decoded), and by TensorBoard itself when
// python3 can import it.
#include <unistd.h>

#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "slime/io/tensorboard.hpp"

namespace fs = std::filesystem;

namespace {

fs::path fresh_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("slime_tb_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir;
}

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Bitwise CRC-32C, independent of the header's table.
uint32_t crc32c_bitwise(const std::string& s) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char c : s) {
    crc ^= c;
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}
uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

uint64_t le(const std::string& s, std::size_t pos, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(s[pos + i])) << (8 * i);
  return v;
}

// Splits a TFRecord file, checking both CRCs of every record.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> records;
  std::size_t pos = 0;
  while (pos < file.size()) {
    REQUIRE(pos + 12 <= file.size());
    const uint64_t length = le(file, pos, 8);
    CHECK(le(file, pos + 8, 4) == mask(crc32c_bitwise(file.substr(pos, 8))));
    REQUIRE(pos + 12 + length + 4 <= file.size());
    std::string data = file.substr(pos + 12, length);
    CHECK(le(file, pos + 12 + length, 4) == mask(crc32c_bitwise(data)));
    records.push_back(std::move(data));
    pos += 12 + length + 4;
  }
  return records;
}

// A protobuf field: number, wire type, and its payload.
struct Field {
  uint32_t number = 0;
  uint32_t wire = 0;
  uint64_t varint = 0;  // wire 0
  std::string bytes;    // wire 1 (8 bytes), 2 (payload), 5 (4 bytes)
};

uint64_t read_varint(const std::string& s, std::size_t& pos) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    REQUIRE(pos < s.size());
    REQUIRE(shift < 64);
    const uint8_t b = uint8_t(s[pos++]);
    v |= uint64_t(b & 0x7F) << shift;
    if ((b & 0x80) == 0) return v;
  }
}

std::vector<Field> decode(const std::string& s) {
  std::vector<Field> fields;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const uint64_t key = read_varint(s, pos);
    Field f;
    f.number = uint32_t(key >> 3);
    f.wire = uint32_t(key & 7);
    if (f.wire == 0) {
      f.varint = read_varint(s, pos);
    } else if (f.wire == 1 || f.wire == 5) {
      const std::size_t n = f.wire == 1 ? 8 : 4;
      REQUIRE(pos + n <= s.size());
      f.bytes = s.substr(pos, n);
      pos += n;
    } else {
      REQUIRE(f.wire == 2);
      const uint64_t n = read_varint(s, pos);
      REQUIRE(pos + n <= s.size());
      f.bytes = s.substr(pos, n);
      pos += n;
    }
    fields.push_back(std::move(f));
  }
  return fields;
}

struct Event {
  std::optional<double> wall_time;
  std::optional<int64_t> step;
  std::optional<std::string> file_version;
  std::vector<std::pair<std::string, float>> values;
  std::optional<uint64_t> session_status;
};

Event decode_event(const std::string& data) {
  Event e;
  for (const Field& f : decode(data)) {
    if (f.number == 1) {
      REQUIRE(f.wire == 1);
      double d;
      std::memcpy(&d, f.bytes.data(), 8);
      e.wall_time = d;
    } else if (f.number == 2) {
      REQUIRE(f.wire == 0);
      e.step = int64_t(f.varint);
    } else if (f.number == 3) {
      REQUIRE(f.wire == 2);
      e.file_version = f.bytes;
    } else if (f.number == 5) {
      REQUIRE(f.wire == 2);
      for (const Field& v : decode(f.bytes)) {
        REQUIRE(v.number == 1);
        REQUIRE(v.wire == 2);
        std::string tag;
        std::optional<float> value;
        for (const Field& g : decode(v.bytes)) {
          if (g.number == 1) {
            REQUIRE(g.wire == 2);
            tag = g.bytes;
          } else if (g.number == 2) {
            REQUIRE(g.wire == 5);
            float x;
            std::memcpy(&x, g.bytes.data(), 4);
            value = x;
          }
        }
        REQUIRE(value.has_value());
        e.values.emplace_back(tag, *value);
      }
    } else if (f.number == 6) {
      REQUIRE(f.wire == 2);
      for (const Field& g : decode(f.bytes))
        if (g.number == 1) e.session_status = g.varint;
    } else {
      FAIL("unexpected Event field " << f.number);
    }
  }
  return e;
}

std::vector<Event> read_events(const fs::path& path) {
  std::vector<Event> events;
  for (const std::string& r : read_records(read_all(path))) events.push_back(decode_event(r));
  return events;
}

bool python_has_tensorboard() { return std::system("python3 -c 'import tensorboard' >/dev/null 2>&1") == 0; }

std::string run_capture(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  INFO(out);
  REQUIRE(status == 0);
  return out;
}

}  // namespace

TEST_CASE("crc32c matches the known test vectors", "[io][tensorboard]") {
  CHECK(slime::io::crc32c("") == 0u);
  CHECK(slime::io::crc32c("123456789") == 0xE3069283u);
  CHECK(slime::io::crc32c("a") == 0xC1D04330u);
  // RFC 3720 (iSCSI) B.4: 32 bytes of zeros, of 0xFF, and ascending 0..31.
  CHECK(slime::io::crc32c(std::string(32, '\0')) == 0x8A9136AAu);
  CHECK(slime::io::crc32c(std::string(32, '\xff')) == 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(char(i));
  CHECK(slime::io::crc32c(ascending) == 0x46DD794Eu);
  // Incremental use continues the CRC.
  const std::string s = "The quick brown fox jumps over the lazy dog";
  CHECK(slime::io::crc32c(s.data() + 10, s.size() - 10, slime::io::crc32c(s.data(), 10)) == slime::io::crc32c(s));
  CHECK(slime::io::crc32c(s) == crc32c_bitwise(s));
}

TEST_CASE("tfrecord frames data with masked CRCs", "[io][tensorboard]") {
  const std::string data = "hello";
  const std::string r = slime::io::tfrecord(data);
  REQUIRE(r.size() == 8 + 4 + 5 + 4);
  CHECK(le(r, 0, 8) == 5u);
  CHECK(le(r, 8, 4) == mask(crc32c_bitwise(r.substr(0, 8))));
  CHECK(r.substr(12, 5) == data);
  CHECK(le(r, 17, 4) == mask(crc32c_bitwise(data)));
  CHECK(slime::io::masked_crc32c(data.data(), data.size()) == mask(0x9A71BB4Cu));  // crc32c("hello")
}

TEST_CASE("event encoding of negative and large steps", "[io][tensorboard]") {
  for (int64_t step :
       {int64_t(0), int64_t(1), int64_t(127), int64_t(128), int64_t(1) << 40, int64_t(-1), INT64_MIN, INT64_MAX}) {
    const Event e = decode_event(slime::io::encode_scalar_event(12.5, step, {{"a", 1.5f}}));
    CHECK(e.step == step);
    CHECK(e.wall_time == 12.5);
    REQUIRE(e.values.size() == 1);
    CHECK(e.values[0].first == "a");
    CHECK(e.values[0].second == 1.5f);
  }
  const Event empty = decode_event(slime::io::encode_scalar_event(1.0, 3, {}));
  CHECK(empty.values.empty());
}

TEST_CASE("TensorBoardWriter writes a readable event file", "[io][tensorboard]") {
  const fs::path dir = fresh_dir("write");
  const double before = std::floor(slime::io::detail::unix_time_now());
  fs::path path;
  {
    slime::io::TensorBoardWriter w(dir / "run");
    path = w.path();
    w.add_scalar("train/reward", 0.25, 0);
    w.add_scalar("train/reward", 0.5, 1, /*wall_time=*/1234.5);
    w.add_scalars(std::map<std::string, double>{{"loss", -0.125}, {"kl", 1e-3}, {"tokens_per_s", 12345.0}}, 2);
    w.add_session_start(2);
    w.flush();
    // Flushed records are on disk while the writer is still open.
    CHECK(read_events(path).size() == 5);
  }
  const double after = slime::io::detail::unix_time_now() + 1;

  // Name: events.out.tfevents.<unix time>.<hostname>
  const std::string name = path.filename().string();
  CHECK(path.parent_path() == dir / "run");
  REQUIRE_THAT(name, Catch::Matchers::StartsWith("events.out.tfevents."));
  const std::string rest = name.substr(std::strlen("events.out.tfevents."));
  const auto dot = rest.find('.');
  REQUIRE(dot != std::string::npos);
  const double stamp = std::stod(rest.substr(0, dot));
  CHECK(stamp >= before);
  CHECK(stamp <= after);
  CHECK(rest.substr(dot + 1) == slime::io::detail::host_name());

  const std::vector<Event> events = read_events(path);
  REQUIRE(events.size() == 5);
  CHECK(events[0].file_version == "brain.Event:2");
  CHECK(events[0].values.empty());
  REQUIRE(events[0].wall_time.has_value());
  CHECK(*events[0].wall_time >= before);
  CHECK(*events[0].wall_time <= after);
  for (std::size_t i = 1; i < events.size(); ++i) CHECK(!events[i].file_version.has_value());

  REQUIRE(events[1].values.size() == 1);
  CHECK(events[1].values[0].first == "train/reward");
  CHECK(events[1].values[0].second == 0.25f);
  CHECK(events[1].step == 0);
  CHECK(*events[1].wall_time >= before);

  CHECK(events[2].step == 1);
  CHECK(events[2].wall_time == 1234.5);
  CHECK(events[2].values[0].second == 0.5f);

  CHECK(events[3].step == 2);
  REQUIRE(events[3].values.size() == 3);  // one Event, map order
  CHECK(events[3].values[0] == std::pair<std::string, float>("kl", 1e-3f));
  CHECK(events[3].values[1] == std::pair<std::string, float>("loss", -0.125f));
  CHECK(events[3].values[2] == std::pair<std::string, float>("tokens_per_s", 12345.0f));

  CHECK(events[4].step == 2);
  CHECK(events[4].session_status == 1u);
  CHECK(events[4].values.empty());
  fs::remove_all(dir);
}

TEST_CASE("TensorBoardWriter gives writers of one second distinct files", "[io][tensorboard]") {
  const fs::path dir = fresh_dir("two");
  slime::io::TensorBoardWriter a(dir), b(dir);
  CHECK(a.path() != b.path());
  a.add_scalar("x", 1, 0);
  b.add_scalar("x", 2, 0);
  a.flush();
  b.flush();
  CHECK(read_events(a.path()).back().values[0].second == 1.0f);
  CHECK(read_events(b.path()).back().values[0].second == 2.0f);
  fs::remove_all(dir);
}

TEST_CASE("TensorBoardWriter is safe to use from several threads", "[io][tensorboard]") {
  const fs::path dir = fresh_dir("threads");
  fs::path path;
  {
    slime::io::TensorBoardWriter w(dir, /*flush_every=*/7);
    path = w.path();
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t)
      threads.emplace_back([&w, t] {
        for (int i = 0; i < 100; ++i) w.add_scalar("t" + std::to_string(t), i, i);
      });
    for (auto& th : threads) th.join();
  }
  const std::vector<Event> events = read_events(path);
  REQUIRE(events.size() == 401);
  std::map<std::string, int64_t> next;
  for (std::size_t i = 1; i < events.size(); ++i) {
    const auto& [tag, value] = events[i].values.at(0);
    CHECK(events[i].step == next[tag]);
    CHECK(value == float(next[tag]));
    ++next[tag];
  }
  CHECK(next.size() == 4);
  fs::remove_all(dir);
}

TEST_CASE("TensorBoardWriter reports bad arguments and unwritable directories", "[io][tensorboard]") {
  const fs::path dir = fresh_dir("bad");
  {
    slime::io::TensorBoardWriter w(dir);
    CHECK_THROWS_WITH(w.add_scalar("", 1.0, 0), Catch::Matchers::ContainsSubstring("empty tag"));
  }
  CHECK_THROWS_AS(slime::io::TensorBoardWriter(dir, 0), slime::Error);
  // A regular file where the directory should be.
  fs::create_directories(dir);
  { std::ofstream(dir / "file") << "x"; }
  CHECK_THROWS_WITH(slime::io::TensorBoardWriter(dir / "file" / "sub"),
                    Catch::Matchers::ContainsSubstring("cannot create log directory"));
  fs::remove_all(dir);
}

TEST_CASE("TensorBoard itself reads the event file", "[io][tensorboard]") {
  if (!python_has_tensorboard()) SKIP("python3 cannot import tensorboard");
  const fs::path dir = fresh_dir("python");
  {
    slime::io::TensorBoardWriter w(dir);
    for (int step = 0; step < 5; ++step) {
      w.add_scalars(std::map<std::string, double>{{"reward", 0.1 * step}, {"loss", 1.0 - step}}, step);
    }
  }
  const std::string script =
      "from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n"
      "acc = EventAccumulator('" +
      dir.string() +
      "')\n"
      "acc.Reload()\n"
      "for tag in sorted(acc.Tags()['scalars']):\n"
      "    for s in acc.Scalars(tag):\n"
      "        print('scalar', tag, s.step, repr(s.value))\n";
  const fs::path py = dir / "read.py";
  { std::ofstream(py) << script; }
  const std::string out = run_capture("python3 " + py.string() + " 2>&1");
  INFO(out);
  // TensorBoard may log warnings (e.g. no TensorFlow); keep our lines only.
  std::string scalars;
  for (std::size_t pos = 0; pos < out.size();) {
    std::size_t end = out.find('\n', pos);
    if (end == std::string::npos) end = out.size();
    if (out.compare(pos, 7, "scalar ") == 0) scalars += out.substr(pos + 7, end - pos - 7) + "\n";
    pos = end + 1;
  }
  // Tags sorted; values come back as float32 widened to double.
  CHECK(scalars ==
        "loss 0 1.0\nloss 1 0.0\nloss 2 -1.0\nloss 3 -2.0\nloss 4 -3.0\n"
        "reward 0 0.0\nreward 1 0.10000000149011612\nreward 2 0.20000000298023224\n"
        "reward 3 0.30000001192092896\nreward 4 0.4000000059604645\n");
  fs::remove_all(dir);
}
