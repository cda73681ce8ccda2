// safetensors: round trips, the exact on-disk layout, dtype conversion on
// load, files from independent writers (hand-built bytes and the reference
// implementation's fixtures), corrupt and truncated files, atomic writes, and
// sharded checkpoint directories.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io_test_util.hpp"
#include "slime/io/safetensors.hpp"

using namespace slime;
using namespace slime::io;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;
using namespace slime::io::test;

namespace {

bool has_temp_files(const fs::path& dir) {
  for (const auto& name : list_dir(dir))
    if (name.find(".tmp.") != std::string::npos) return true;
  return false;
}

// Little-endian bytes built with shifts, independent of the library.
void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

// A file: 8-byte length, `header` verbatim (no padding), then `data`.
std::string file_bytes(const std::string& header, const std::string& data) {
  std::string out;
  put_le(out, header.size(), 8);
  return out + header + data;
}

using Named = std::vector<std::pair<std::string, Tensor>>;

}  // namespace

TEST_CASE("round trip of every dtype and odd shapes", "[io][safetensors]") {
  TempDir dir;
  const fs::path path = dir / "all.safetensors";
  const Named tensors = {
      {"f32.odd", patterned({3, 5, 7}, DType::f32, 1)},
      {"bf16", patterned({1, 13}, DType::bf16, 2)},
      {"f16", patterned({17}, DType::f16, 3)},
      {"i32", patterned({2, 3, 1}, DType::i32, 4)},
      {"i64", patterned({4}, DType::i64, 5)},
      {"u8", patterned({3, 3, 3}, DType::u8, 6)},
      {"scalar", Tensor::from_vector(std::vector<float>{3.25f}, Shape{})},
      {"empty", Tensor::empty({0}, DType::f32)},
      {"empty.3d", Tensor::empty({2, 0, 3}, DType::i64)},
      {"rank8", patterned({1, 2, 1, 2, 1, 2, 1, 3}, DType::u8, 7)},
      {"name with spaces/and.dots \u00e9", patterned({5}, DType::bf16, 8)},
  };
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"note", "quote \" and \\ backslash"}};
  write_safetensors(path, tensors, metadata);

  SafetensorsFile file(path);
  CHECK(file.path() == path);
  CHECK(file.size() == tensors.size());
  CHECK(file.metadata() == metadata);
  CHECK(file.data_offset() % 8 == 0);
  std::vector<std::string> expected_names;
  for (const auto& [name, t] : tensors) expected_names.push_back(name);
  CHECK(file.names() == expected_names);  // data order is the given order

  for (const auto& [name, t] : tensors) {
    INFO(name);
    REQUIRE(file.contains(name));
    const auto& info = file.info(name);
    CHECK(info.dtype == t.dtype());
    CHECK(info.dtype_name == safetensors_dtype_name(t.dtype()));
    CHECK(info.shape() == t.shape());
    CHECK(info.nbytes() == t.nbytes());
    CHECK(file.raw_bytes(name).size() == t.nbytes());
    Tensor back = file.read(name);
    CHECK(same_bytes(back, t));
    CHECK(back.device() == Device::cpu());
  }
  CHECK(file.read("scalar").dim() == 0);
  CHECK(file.read("scalar").to_vector<float>() == std::vector<float>{3.25f});
  CHECK(file.read("empty.3d").numel() == 0);
  CHECK_FALSE(file.contains("missing"));
  CHECK_THROWS_WITH(file.read("missing"),
                    ContainsSubstring(path.string()) && ContainsSubstring("no tensor named 'missing'"));

  // No tensors at all is a valid file too.
  write_safetensors(dir / "none.safetensors", {});
  SafetensorsFile none(dir / "none.safetensors");
  CHECK(none.size() == 0);
  CHECK(read_file(dir / "none.safetensors") == file_bytes("{}      ", ""));
}

TEST_CASE("the data section starts 8-byte aligned and the header is exactly as specified", "[io][safetensors]") {
  TempDir dir;
  // Name lengths 1..9 move the JSON length through every residue mod 8.
  for (int len = 1; len <= 9; ++len) {
    const std::string name(std::size_t(len), 'n');
    const fs::path path = dir / ("aligned" + std::to_string(len) + ".safetensors");
    const Tensor a = Tensor::from_vector(std::vector<float>{1.0f, -2.0f}, {2});
    const Tensor b = Tensor::from_vector(std::vector<uint8_t>{1, 2, 3}, {3});
    write_safetensors(path, {{name, a}, {"b", b}}, {{"k", "v"}});

    const std::string bytes = read_file(path);
    REQUIRE(bytes.size() >= 8);
    uint64_t n = 0;
    for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[std::size_t(i)])) << (8 * i);
    INFO("name length " << len << ", header length " << n);
    CHECK((8 + n) % 8 == 0);
    const std::string json_text = std::string("{\"__metadata__\":{\"k\":\"v\"},\"") + name +
                                  "\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                                  "\"b\":{\"dtype\":\"U8\",\"shape\":[3],\"data_offsets\":[8,11]}}";
    const std::size_t padded = (json_text.size() + 7) / 8 * 8;
    CHECK(n == padded);
    CHECK(bytes.substr(8, json_text.size()) == json_text);
    CHECK(bytes.substr(8 + json_text.size(), padded - json_text.size()) == std::string(padded - json_text.size(), ' '));
    CHECK(bytes.size() == 8 + n + 11);
    // Data: float 1.0 = 0x3f800000, -2.0 = 0xc0000000, little-endian; then the bytes.
    const std::string data = bytes.substr(8 + n);
    const std::string expected_data("\x00\x00\x80\x3f\x00\x00\x00\xc0\x01\x02\x03", 11);
    CHECK(data == expected_data);
    CHECK(SafetensorsFile(path).data_offset() == 8 + n);
  }
}

TEST_CASE("dtype conversion on load", "[io][safetensors]") {
  TempDir dir;
  const fs::path path = dir / "conv.safetensors";
  // Values around bf16/f16 rounding boundaries, ties, specials, subnormals.
  const std::vector<float> values = {0.0f,
                                     -0.0f,
                                     1.0f,
                                     1.0f + 0x1p-8f,      // bf16 tie, rounds to even (down)
                                     1.0f + 3 * 0x1p-8f,  // bf16 tie, rounds to even (up)
                                     1.0f + 0x1p-8f + 0x1p-20f,
                                     1.0f + 0x1p-11f,  // f16 tie
                                     3.14159265f,
                                     -65504.0f,
                                     65520.0f,  // f16 overflow to inf
                                     1e-40f,    // f32 subnormal
                                     6e-8f,     // f16 subnormal
                                     3.4e38f,
                                     std::numeric_limits<float>::infinity(),
                                     -std::numeric_limits<float>::infinity(),
                                     std::numeric_limits<float>::quiet_NaN()};
  const int64_t n = int64_t(values.size());
  std::vector<BFloat16> bf16;
  for (float v : values) bf16.push_back(BFloat16(v));
  std::vector<Half> f16;
  for (float v : values) f16.push_back(Half(v));
  write_safetensors(path, {
                              {"f32", Tensor::from_vector(values, {2, n / 2})},
                              {"bf16", Tensor::from_vector(bf16, {2, n / 2})},
                              {"f16", Tensor::from_vector(f16, {2, n / 2})},
                              {"i64", Tensor::from_vector(std::vector<int64_t>{1, -5, 2147483647, 0}, {4})},
                              {"i64.big", Tensor::from_vector(std::vector<int64_t>{0, 1, 2147483648LL}, {3})},
                              {"i32.neg", Tensor::from_vector(std::vector<int32_t>{3, -1}, {2})},
                              {"u8", Tensor::from_vector(std::vector<uint8_t>{0, 200, 255}, {3})},
                          });
  SafetensorsFile file(path);

  SECTION("bf16 file -> f32 is exact") {
    Tensor t = file.read("bf16", DType::f32);
    CHECK(t.dtype() == DType::f32);
    CHECK(t.shape() == Shape{2, n / 2});
    const auto got = t.to_vector<float>();
    for (std::size_t i = 0; i < values.size(); ++i) {
      INFO(i);
      const float want = bf16[i].to_float();
      CHECK((std::isnan(want) ? std::isnan(got[i])
                              : slime::detail::float_bits(got[i]) == slime::detail::float_bits(want)));
    }
  }
  SECTION("f32 file -> bf16 / f16 rounds like BFloat16 / Half") {
    const auto b = file.read("f32", DType::bf16).to_vector<BFloat16>();
    const auto h = file.read("f32", DType::f16).to_vector<Half>();
    for (std::size_t i = 0; i < values.size(); ++i) {
      INFO(i << ": " << values[i]);
      CHECK(b[i].bits == bf16[i].bits);
      CHECK(h[i].bits == f16[i].bits);
    }
    CHECK(b[3].bits == 0x3f80);  // the tie went to even
    CHECK(b[4].bits == 0x3f82);
    CHECK(h[9].bits == 0x7c00);  // 65520 -> +inf in f16
  }
  SECTION("f16 <-> bf16 go through f32 with one rounding") {
    const auto b = file.read("f16", DType::bf16).to_vector<BFloat16>();
    const auto h = file.read("bf16", DType::f16).to_vector<Half>();
    for (std::size_t i = 0; i < values.size(); ++i) {
      INFO(i);
      CHECK(b[i].bits == BFloat16(f16[i].to_float()).bits);
      CHECK(h[i].bits == Half(bf16[i].to_float()).bits);
    }
  }
  SECTION("integers convert when every value fits") {
    CHECK(file.read("i64", DType::i32).to_vector<int32_t>() == std::vector<int32_t>{1, -5, 2147483647, 0});
    CHECK(file.read("u8", DType::i64).to_vector<int64_t>() == std::vector<int64_t>{0, 200, 255});
    CHECK(file.read("u8", DType::i32).to_vector<int32_t>() == std::vector<int32_t>{0, 200, 255});
    CHECK_THROWS_WITH(file.read("i64.big", DType::i32),
                      ContainsSubstring(path.string()) && ContainsSubstring("tensor 'i64.big'") &&
                          ContainsSubstring("element 2 = 2147483648 does not fit in i32"));
    CHECK_THROWS_WITH(file.read("i32.neg", DType::u8),
                      ContainsSubstring("tensor 'i32.neg'") && ContainsSubstring("element 1 = -1 does not fit in u8"));
  }
  SECTION("float <-> integer is an error") {
    CHECK_THROWS_WITH(file.read("f32", DType::i32), ContainsSubstring(path.string()) &&
                                                        ContainsSubstring("tensor 'f32'") &&
                                                        ContainsSubstring("cannot convert f32 to i32"));
    CHECK_THROWS_WITH(file.read("u8", DType::bf16), ContainsSubstring("cannot convert u8 to bf16"));
  }
  SECTION("read_into converts into an existing tensor and checks the shape") {
    Tensor dst = Tensor::zeros({2, n / 2}, DType::f32);
    file.read_into("bf16", dst);
    CHECK(dst.to_vector<float>()[2] == 1.0f);
    CHECK(dst.to_vector<float>()[7] == bf16[7].to_float());

    // Into a view: only those rows change.
    Tensor big = Tensor::zeros({3, 4}, DType::i32);
    Tensor rows = big.slice_rows(1, 1).reshape({4});
    file.read_into("i64", rows);
    CHECK(big.to_vector<int32_t>() == std::vector<int32_t>{0, 0, 0, 0, 1, -5, 2147483647, 0, 0, 0, 0, 0});

    Tensor wrong = Tensor::zeros({n / 2, 2}, DType::f32);
    CHECK_THROWS_WITH(file.read_into("bf16", wrong), ContainsSubstring(path.string()) &&
                                                         ContainsSubstring("tensor 'bf16'") &&
                                                         ContainsSubstring("shape (2, 8) in the file") &&
                                                         ContainsSubstring("destination has shape (8, 2)"));
    Tensor undefined;
    CHECK_THROWS_WITH(file.read_into("bf16", undefined), ContainsSubstring("undefined"));
    Tensor ints = Tensor::zeros({2, n / 2}, DType::i32);
    CHECK_THROWS_WITH(file.read_into("f32", ints), ContainsSubstring("cannot convert f32 to i32"));
  }
  SECTION("a CUDA destination needs a CUDA device") {
    // Without CUDA or without a GPU, asking for cuda:0 is a clear error; with
    // a GPU the read must succeed and keep the values.
    if (cuda_device_count() == 0) {
      CHECK_THROWS_AS(file.read("f32", std::nullopt, Device::cuda(0)), Error);
    } else {
      // Compare bits: the data holds a NaN, which never equals itself.
      const std::vector<float> on_gpu = file.read("f32", std::nullopt, Device::cuda(0)).to_vector<float>();
      const std::vector<float> on_cpu = file.read("f32").to_vector<float>();
      REQUIRE(on_gpu.size() == on_cpu.size());
      CHECK(std::memcmp(on_gpu.data(), on_cpu.data(), on_cpu.size() * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("reads a file built byte by byte by an independent writer", "[io][safetensors]") {
  TempDir dir;
  const fs::path path = dir / "hand.safetensors";
  // Keys out of data order, fields out of the usual order, whitespace and a
  // header length that leaves the data section unaligned.
  const std::string header =
      "{ \"z_last\": {\"dtype\": \"I32\", \"shape\": [2], \"data_offsets\": [8, 16]},\n"
      "  \"__metadata__\": {\"who\": \"hand\"},\n"
      "  \"a_first\": {\"data_offsets\": [0, 8], \"shape\": [2, 2], \"dtype\": \"BF16\"},\n"
      "  \"f64\": {\"shape\": [1], \"dtype\": \"F64\", \"data_offsets\": [16, 24]},\n"
      "  \"fp4\": {\"dtype\": \"F4\", \"shape\": [4], \"data_offsets\": [24, 26]} }";
  REQUIRE((8 + header.size()) % 8 != 0);
  std::string data;
  for (uint16_t bits : {0x3f80, 0x4000, 0xbf00, 0x3e20}) put_le(data, bits, 2);  // 1, 2, -0.5, 0.15625
  put_le(data, 7, 4);
  put_le(data, uint32_t(-8), 4);
  put_le(data, 0x3ff0000000000000ull, 8);  // 1.0 as f64
  data += std::string("\x12\x34", 2);
  write_file(path, file_bytes(header, data));

  SafetensorsFile file(path);
  CHECK(file.names() == std::vector<std::string>{"a_first", "z_last", "f64", "fp4"});
  CHECK(file.metadata() == std::map<std::string, std::string>{{"who", "hand"}});
  CHECK(file.data_offset() == 8 + header.size());
  CHECK(file.read("a_first", DType::f32).to_vector<float>() == std::vector<float>{1.0f, 2.0f, -0.5f, 0.15625f});
  CHECK(file.read("a_first").shape() == Shape{2, 2});
  CHECK(file.read("z_last").to_vector<int32_t>() == std::vector<int32_t>{7, -8});
  CHECK(file.read("z_last", DType::i64).to_vector<int64_t>() == std::vector<int64_t>{7, -8});
  // Valid safetensors dtypes that slime cannot hold fail only when read.
  CHECK(file.info("f64").dtype_name == "F64");
  CHECK_FALSE(file.info("f64").dtype.has_value());
  CHECK(file.info("fp4").nbytes() == 2);
  CHECK(file.raw_bytes("fp4")[1] == std::byte{0x34});
  CHECK_THROWS_WITH(file.read("f64"), ContainsSubstring(path.string()) && ContainsSubstring("tensor 'f64'") &&
                                          ContainsSubstring("unsupported dtype F64"));
  Tensor dst = Tensor::zeros({1}, DType::f32);
  CHECK_THROWS_WITH(file.read_into("fp4", dst), ContainsSubstring("unsupported dtype F4"));
}

TEST_CASE("reads files written by the reference implementation", "[io][safetensors]") {
  const fs::path data = SLIME_IO_TEST_DATA;
  SECTION("safetensors.numpy: F32, F16, I64, I32, U8, 0-d and empty") {
    SafetensorsFile file(data / "numpy_fixture.safetensors");
    CHECK(file.metadata().at("format") == "np");
    CHECK(file.size() == 7);
    std::vector<float> weight;
    for (int i = 0; i < 15; ++i) weight.push_back(float(i) * 0.25f - 1.5f);
    CHECK(file.read("weight").shape() == Shape{3, 5});
    CHECK(file.read("weight").to_vector<float>() == weight);
    CHECK(file.read("half").dtype() == DType::f16);
    CHECK(file.read("half", DType::f32).to_vector<float>() ==
          std::vector<float>{0.0f, 1.0f, -2.0f, 0.5f, 65504.0f, 0x1p-14f, 0x1p-24f});
    CHECK(file.read("ids").to_vector<int64_t>() == std::vector<int64_t>{0, -1, int64_t(1) << 40, -(int64_t(1) << 62)});
    CHECK(file.read("count").to_vector<int32_t>() == std::vector<int32_t>{-7, 0, 2147483647});
    CHECK(file.read("bytes").shape() == Shape{2, 3});
    CHECK(file.read("bytes").to_vector<uint8_t>() == std::vector<uint8_t>{0, 1, 127, 128, 254, 255});
    CHECK(file.read("scalar").dim() == 0);
    CHECK(file.read("scalar").to_vector<float>() == std::vector<float>{3.5f});
    CHECK(file.read("empty").shape() == Shape{0, 4});
  }
  SECTION("low-level serialize_file: BF16 and F64") {
    SafetensorsFile file(data / "bf16_fixture.safetensors");
    const std::vector<float> values = {1.0f, -2.5f, 3.140625f, 1e-3f};
    const auto got = file.read("bf16").to_vector<BFloat16>();
    REQUIRE(got.size() == values.size());
    for (std::size_t i = 0; i < values.size(); ++i) CHECK(got[i].bits == BFloat16(values[i]).bits);
    CHECK(file.read("bf16", DType::f32).to_vector<float>()[2] == 3.140625f);
    CHECK_THROWS_WITH(file.read("f64"), ContainsSubstring("unsupported dtype F64"));
  }
}

TEST_CASE("corrupt headers give an error naming the file", "[io][safetensors]") {
  TempDir dir;
  int counter = 0;
  // Writes `bytes` to a new file and expects opening it to fail with `what`.
  auto expect = [&](const std::string& bytes, const std::string& what) {
    const fs::path path = dir / ("bad" + std::to_string(counter++) + ".safetensors");
    write_file(path, bytes);
    INFO("case: " << what);
    CHECK_THROWS_WITH(SafetensorsFile(path), ContainsSubstring(path.string()) && ContainsSubstring(what));
  };
  auto with_header = [&](const std::string& header, const std::string& data, const std::string& what) {
    expect(file_bytes(header, data), what);
  };
  const std::string f32x2 = std::string(8, '\0');

  expect("", "file is 0 bytes, shorter than the 8-byte header length");
  expect(std::string("\x05\x00\x00\x00\x00", 5), "file is 5 bytes, shorter than the 8-byte header length");
  {
    std::string b;
    put_le(b, 1000, 8);
    expect(b + "{}", "header length 1000 runs past the end of the file (10 bytes");
  }
  {
    std::string b;
    put_le(b, 200'000'000, 8);
    expect(b + "{}", "header length 200000000 exceeds the 100000000-byte limit");
    std::string c;
    put_le(c, ~uint64_t(0), 8);
    expect(c + "{}", "exceeds the 100000000-byte limit");
  }
  with_header("{not json", "", "header is not valid JSON");
  with_header("{\"a\": \"\xff\xfe\"}", "", "header is not valid JSON");  // invalid UTF-8
  with_header("[1, 2]", "", "header is not a JSON object (it is a JSON array)");
  with_header(R"({"a":{"dtype":"F12","shape":[2],"data_offsets":[0,8]}})", f32x2, "tensor 'a' has unknown dtype 'F12'");
  with_header(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", f32x2,
              "tensor 'a': shape [-2] has a negative extent -2");
  with_header(R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", f32x2, "non-integer extent");
  with_header(R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", f32x2, "shape is not an array");
  with_header(R"({"a":{"dtype":"F32","shape":[1099511627776,1099511627776],"data_offsets":[0,8]}})", f32x2,
              "overflows");
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", f32x2,
              "tensor 'a': data_offsets [8] is not [begin, end]");
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,7]}})", f32x2, "is not [begin, end]");
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", f32x2,
              "data_offsets [8, 0] has begin > end");
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", f32x2,
              "data_offsets [0, 4] span 4 bytes but F32 [2] needs 8");
  with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", std::string(4, '\0'),
              "run past the data section (4 bytes");
  with_header(R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", std::string(2, '\0'),
              "do not fill a whole number of bytes");
  with_header(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
      std::string(12, '\0'), "tensor 'b' bytes [4, 12) overlap tensor 'a' bytes [0, 8)");
  with_header(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
      std::string(12, '\0'), "hole in the data section: bytes [4, 8)");
  with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f32x2,
              "data section is 8 bytes but the tensors cover only 4");
  with_header(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
      f32x2, "duplicate tensor name 'a'");
  with_header(R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", f32x2,
              "duplicate key 'dtype'");
  with_header(R"({"__metadata__":{"k":1}})", "", "__metadata__ value for key 'k' is not a string");
  with_header(R"({"__metadata__":["x"]})", "", "__metadata__ is not an object");
  with_header(R"({"a":5})", "", "entry for tensor 'a' is not an object");
  with_header(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", f32x2, "tensor 'a' has no \"dtype\"");
  with_header(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", f32x2, "dtype is not a string");

  CHECK_THROWS_WITH(SafetensorsFile(dir / "does_not_exist.safetensors"),
                    ContainsSubstring("does_not_exist.safetensors") && ContainsSubstring("cannot open"));
  CHECK_THROWS_WITH(SafetensorsFile(dir.path),
                    ContainsSubstring(dir.path.string()) && ContainsSubstring("not a regular file"));
}

TEST_CASE("truncated files are detected", "[io][safetensors]") {
  TempDir dir;
  const fs::path path = dir / "full.safetensors";
  write_safetensors(path, {{"a", patterned({64}, DType::f32, 1)}, {"b", patterned({3, 3}, DType::bf16, 2)}});
  const std::string full = read_file(path);
  const uint64_t header = SafetensorsFile(path).data_offset();

  const fs::path cut = dir / "cut.safetensors";
  write_file(cut, full.substr(0, full.size() - 1));
  CHECK_THROWS_WITH(SafetensorsFile(cut), ContainsSubstring(cut.string()) && ContainsSubstring("tensor 'b'") &&
                                              ContainsSubstring("run past the data section"));
  write_file(cut, full.substr(0, header));  // header only, no data
  CHECK_THROWS_WITH(SafetensorsFile(cut), ContainsSubstring("run past the data section (0 bytes"));
  write_file(cut, full.substr(0, header / 2));
  CHECK_THROWS_WITH(SafetensorsFile(cut), ContainsSubstring("runs past the end of the file"));
  write_file(cut, full.substr(0, 4));
  CHECK_THROWS_WITH(SafetensorsFile(cut), ContainsSubstring("shorter than the 8-byte header length"));
  write_file(cut, full + "x");
  CHECK_THROWS_WITH(SafetensorsFile(cut), ContainsSubstring("trailing bytes"));
}

TEST_CASE("writes are atomic: failures leave the old file and no temporary", "[io][safetensors]") {
  TempDir dir;
  const fs::path path = dir / "model.safetensors";
  const Tensor a = patterned({4, 4}, DType::f32, 1);
  write_safetensors(path, {{"a", a}});
  const std::string before = read_file(path);
  CHECK(list_dir(dir.path) == std::vector<std::string>{"model.safetensors"});

  const Tensor b = patterned({8}, DType::bf16, 2);
  CHECK_THROWS_WITH(write_safetensors(path, {{"b", b}, {"a", a}, {"b", b}}),
                    ContainsSubstring(path.string()) && ContainsSubstring("duplicate tensor name 'b'"));
  CHECK_THROWS_WITH(write_safetensors(path, {{"__metadata__", a}}), ContainsSubstring("'__metadata__' is reserved"));
  CHECK_THROWS_WITH(write_safetensors(path, {{"u", Tensor()}}), ContainsSubstring("tensor 'u' is undefined"));
  CHECK(read_file(path) == before);
  CHECK_FALSE(has_temp_files(dir.path));

  SECTION("a failure in the middle of writing the data") {
    // Cap the file size so that write() fails with EFBIG part way through.
    struct LimitGuard {
      rlimit old{};
      void (*old_handler)(int) = nullptr;
      LimitGuard() {
        getrlimit(RLIMIT_FSIZE, &old);
        old_handler = std::signal(SIGXFSZ, SIG_IGN);
        rlimit small = old;
        small.rlim_cur = 4096;
        setrlimit(RLIMIT_FSIZE, &small);
      }
      ~LimitGuard() {
        setrlimit(RLIMIT_FSIZE, &old);
        std::signal(SIGXFSZ, old_handler);
      }
    };
    {
      LimitGuard guard;
      CHECK_THROWS_WITH(write_safetensors(path, {{"big", patterned({1 << 16}, DType::f32, 3)}}),
                        ContainsSubstring(path.string()) && ContainsSubstring("failed"));
    }
    CHECK(read_file(path) == before);
    CHECK_FALSE(has_temp_files(dir.path));
  }
  SECTION("a missing directory") {
    const fs::path nowhere = dir / "missing" / "x.safetensors";
    CHECK_THROWS_WITH(write_safetensors(nowhere, {{"a", a}}), ContainsSubstring(nowhere.string()));
    CHECK_FALSE(fs::exists(dir / "missing"));
  }
  SECTION("a successful overwrite replaces the file") {
    write_safetensors(path, {{"b", b}});
    CHECK(list_dir(dir.path) == std::vector<std::string>{"model.safetensors"});
    SafetensorsFile file(path);
    CHECK(file.names() == std::vector<std::string>{"b"});
    CHECK(same_bytes(file.read("b"), b));
  }
}

TEST_CASE("sharded checkpoint directories", "[io][safetensors]") {
  TempDir dir;
  const fs::path ckpt = dir / "ckpt";
  const Named tensors = {
      {"model.embed_tokens.weight", patterned({16, 8}, DType::f32, 1)},  // 512 B
      {"model.layers.0.mlp.weight", patterned({8, 8}, DType::bf16, 2)},  // 128 B
      {"model.layers.0.norm.weight", patterned({8}, DType::f32, 3)},     // 32 B
      {"model.layers.1.mlp.weight", patterned({8, 8}, DType::bf16, 4)},  // 128 B
      {"lm_head.weight", patterned({300}, DType::f32, 5)},               // 1200 B, over the limit
      {"model.norm.weight", patterned({8}, DType::f32, 6)},              // 32 B
  };
  write_safetensors_dir(ckpt, tensors, 600);

  const std::vector<std::string> shard_names = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                                "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};
  std::vector<std::string> expected_files = shard_names;
  expected_files.push_back("model.safetensors.index.json");
  std::sort(expected_files.begin(), expected_files.end());
  CHECK(list_dir(ckpt) == expected_files);

  const auto index = nlohmann::json::parse(read_file(ckpt / "model.safetensors.index.json"));
  CHECK(index["metadata"]["total_size"] == 2032);
  const std::map<std::string, std::string> expected_map = {{"model.embed_tokens.weight", shard_names[0]},
                                                           {"model.layers.0.mlp.weight", shard_names[1]},
                                                           {"model.layers.0.norm.weight", shard_names[1]},
                                                           {"model.layers.1.mlp.weight", shard_names[1]},
                                                           {"lm_head.weight", shard_names[2]},
                                                           {"model.norm.weight", shard_names[3]}};
  CHECK(index["weight_map"].get<std::map<std::string, std::string>>() == expected_map);
  CHECK(SafetensorsFile(ckpt / shard_names[1]).metadata().at("format") == "pt");
  CHECK(SafetensorsFile(ckpt / shard_names[1]).names() == std::vector<std::string>{"model.layers.0.mlp.weight",
                                                                                   "model.layers.0.norm.weight",
                                                                                   "model.layers.1.mlp.weight"});

  {
    SafetensorsDir d(ckpt);
    CHECK(d.sharded());
    CHECK(d.index_path() == ckpt / "model.safetensors.index.json");
    CHECK(d.size() == tensors.size());
    std::vector<std::string> sorted_names;
    for (const auto& [name, t] : tensors) sorted_names.push_back(name);
    std::sort(sorted_names.begin(), sorted_names.end());
    CHECK(d.names() == sorted_names);
    for (const auto& [name, t] : tensors) {
      INFO(name);
      CHECK(same_bytes(d.read(name), t));
      CHECK(d.info(name).shape() == t.shape());
    }
    CHECK(d.file_of("lm_head.weight").path() == ckpt / shard_names[2]);
    const Tensor& mlp = tensors[1].second;
    Tensor as_f32 = d.read("model.layers.0.mlp.weight", DType::f32);
    CHECK(as_f32.to_vector<float>()[5] == mlp.to_vector<BFloat16>()[5].to_float());
    Tensor dst = Tensor::zeros({8, 8}, DType::f32);
    d.read_into("model.layers.1.mlp.weight", dst);
    CHECK(dst.to_vector<float>()[9] == tensors[3].second.to_vector<BFloat16>()[9].to_float());
    CHECK_THROWS_WITH(d.read("nope"),
                      ContainsSubstring("model.safetensors.index.json") && ContainsSubstring("no tensor named 'nope'"));
  }

  SECTION("rewriting as one file removes the shards and the index") {
    write_safetensors_dir(ckpt, tensors);
    CHECK(list_dir(ckpt) == std::vector<std::string>{"model.safetensors"});
    SafetensorsDir d(ckpt);
    CHECK_FALSE(d.sharded());
    CHECK(d.size() == tensors.size());
    for (const auto& [name, t] : tensors) CHECK(same_bytes(d.read(name), t));
    CHECK(SafetensorsFile(ckpt / "model.safetensors").metadata().at("format") == "pt");
    CHECK_THROWS_WITH(d.read("nope"), ContainsSubstring((ckpt / "model.safetensors").string()) &&
                                          ContainsSubstring("no tensor named 'nope'"));

    // And back to shards: the single file must go (it would shadow the index).
    write_safetensors_dir(ckpt, tensors, 2000, {{"format", "custom"}});
    CHECK(list_dir(ckpt) == std::vector<std::string>{"model-00001-of-00002.safetensors",
                                                     "model-00002-of-00002.safetensors",
                                                     "model.safetensors.index.json"});
    CHECK(SafetensorsFile(ckpt / "model-00001-of-00002.safetensors").metadata().at("format") == "custom");
    SafetensorsDir again(ckpt);
    CHECK(again.sharded());
    for (const auto& [name, t] : tensors) CHECK(same_bytes(again.read(name), t));
  }
  SECTION("a missing shard names the index and the shard") {
    fs::remove(ckpt / shard_names[2]);
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring((ckpt / "model.safetensors.index.json").string()) &&
                                                ContainsSubstring("tensor 'lm_head.weight'") &&
                                                ContainsSubstring(shard_names[2]) &&
                                                ContainsSubstring("does not exist"));
  }
  SECTION("an index that maps a tensor to the wrong shard") {
    auto bad = index;
    bad["weight_map"]["model.norm.weight"] = shard_names[0];
    write_file(ckpt / "model.safetensors.index.json", bad.dump());
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring("model.safetensors.index.json") &&
                                                ContainsSubstring("tensor 'model.norm.weight'") &&
                                                ContainsSubstring("does not contain it"));
  }
  SECTION("malformed indexes") {
    const fs::path idx = ckpt / "model.safetensors.index.json";
    write_file(idx, "{\"weight_map\": ");
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring(idx.string()) && ContainsSubstring("not valid JSON"));
    write_file(idx, R"({"metadata": {}})");
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring("has no \"weight_map\" object"));
    write_file(idx, R"({"weight_map": {"a": 3}})");
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring("weight_map entry for 'a' is not a file name"));
    write_file(idx, R"({"weight_map": {"a": "../outside.safetensors"}})");
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring("is not a file inside"));
    write_file(idx, R"({"weight_map": {"a": "/etc/passwd"}})");
    CHECK_THROWS_WITH(SafetensorsDir(ckpt), ContainsSubstring("is not a file inside"));
  }
  SECTION("directories without a checkpoint and bad arguments") {
    fs::create_directories(dir / "empty");
    CHECK_THROWS_WITH(SafetensorsDir(dir / "empty"),
                      ContainsSubstring((dir / "empty").string()) &&
                          ContainsSubstring("has neither model.safetensors nor model.safetensors.index.json"));
    CHECK_THROWS_WITH(SafetensorsDir(dir / "nothing"), ContainsSubstring("does not exist"));
    const auto listing = list_dir(ckpt);
    Named dup = tensors;
    dup.push_back(tensors[0]);
    CHECK_THROWS_WITH(
        write_safetensors_dir(ckpt, dup, 600),
        ContainsSubstring(ckpt.string()) && ContainsSubstring("duplicate tensor name 'model.embed_tokens.weight'"));
    CHECK_THROWS_WITH(write_safetensors_dir(ckpt, tensors, 0), ContainsSubstring("max_shard_bytes must be positive"));
    CHECK(list_dir(ckpt) == listing);
    CHECK_FALSE(has_temp_files(ckpt));
  }
}
