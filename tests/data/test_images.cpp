// Images: PNG/JPEG decoding against what PIL + transformers make of the same
// files, PNGs of every colour type and bit depth written here with libpng,
// every kind of bad file (each error naming the file), Qwen-VL smart_resize
// against transformers' own results, the bicubic resize against a
// double-precision reference, the patch order on a hand-worked example, the
// whole preprocessing against transformers' Qwen2VLImageProcessor
// (tools/make_qwen3_vl_image_fixture.py), preprocessor_config.json parsing and
// placeholder expansion. Decoding tests SKIP when slime was built without
// libpng/libjpeg.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/data/image.hpp"
#include "slime/data/qwen_vl_image.hpp"
#include "slime/io/safetensors.hpp"

#if SLIME_TEST_HAVE_LIBPNG
#include <csetjmp>

#include <png.h>
#include <zlib.h>
#endif

using namespace slime;
using namespace slime::data;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

const fs::path kFixtures = SLIME_DATA_TEST_FIXTURES;

#define SKIP_WITHOUT_IMAGES() \
  if (!images_supported()) SKIP("slime was built without libpng/libjpeg: image decoding is not tested")

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("slime_test_images_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
  fs::path write(const std::string& name, const std::vector<uint8_t>& bytes) const {
    std::ofstream(path / name, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path / name;
  }
};

std::vector<uint8_t> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// what() of the error that reading `path` raises ("no error" when none).
std::string read_error(const fs::path& path, const ImageReadOptions& o = {}) {
  try {
    (void)read_image(path, o);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Tensor `name` of a fixture file as bytes, checking its dtype and shape.
template <class T>
std::vector<T> fixture_tensor(const io::SafetensorsFile& f, const std::string& name, const std::string& dtype,
                              std::vector<int64_t>* dims = nullptr) {
  const io::SafetensorsTensorInfo& info = f.info(name);
  REQUIRE(info.dtype_name == dtype);
  if (dims != nullptr) *dims = info.dims;
  const std::span<const std::byte> raw = f.raw_bytes(name);
  std::vector<T> out(raw.size() / sizeof(T));
  std::memcpy(out.data(), raw.data(), raw.size());
  return out;
}

// PIL's alpha_composite of (c, a) over opaque white, as a rational rounded to nearest.
uint8_t over_white_ref(int c, int a) { return uint8_t(std::floor((c * a + 255.0 * (255 - a)) / 255.0 + 0.5)); }

#if SLIME_TEST_HAVE_LIBPNG
// A PNG written by libpng from rows in PNG's own sample layout.
struct PngSpec {
  int width = 0, height = 0, color_type = PNG_COLOR_TYPE_RGB, bit_depth = 8;
  bool interlace = false;
  std::vector<png_color> palette;
  std::vector<png_byte> trans_alpha;  // palette tRNS
  bool has_trans_color = false;
  png_color_16 trans_color{};
};

PngSpec spec(int width, int height, int color_type, int bit_depth, bool interlace = false) {
  PngSpec s;
  s.width = width, s.height = height, s.color_type = color_type, s.bit_depth = bit_depth, s.interlace = interlace;
  return s;
}

void png_write_to_vector(png_structp png, png_bytep data, png_size_t n) {
  auto* out = static_cast<std::vector<uint8_t>*>(png_get_io_ptr(png));
  out->insert(out->end(), data, data + n);
}
void png_flush_nothing(png_structp) {}

// Trivial locals only between setjmp and the libpng calls.
bool png_encode(png_structp png, png_infop info, const PngSpec* s, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_IHDR(png, info, png_uint_32(s->width), png_uint_32(s->height), s->bit_depth, s->color_type,
               s->interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT,
               PNG_FILTER_TYPE_DEFAULT);
  if (!s->palette.empty()) png_set_PLTE(png, info, s->palette.data(), int(s->palette.size()));
  if (!s->trans_alpha.empty()) png_set_tRNS(png, info, s->trans_alpha.data(), int(s->trans_alpha.size()), nullptr);
  if (s->has_trans_color) png_set_tRNS(png, info, nullptr, 0, &s->trans_color);
  png_write_info(png, info);
  png_write_image(png, rows);
  png_write_end(png, nullptr);
  return true;
}

std::vector<uint8_t> encode_png(const PngSpec& s, std::vector<std::vector<uint8_t>> rows) {
  std::vector<uint8_t> out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  png_set_write_fn(png, &out, png_write_to_vector, png_flush_nothing);
  std::vector<png_bytep> ptrs;
  for (auto& r : rows) ptrs.push_back(r.data());
  const bool ok = png_encode(png, info, &s, ptrs.data());
  png_destroy_write_struct(&png, &info);
  REQUIRE(ok);
  return out;
}

// A PNG file of only a signature and an IHDR claiming height x width (then IEND).
std::vector<uint8_t> png_header_only(uint32_t height, uint32_t width) {
  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  auto be32 = [&](uint32_t v) {
    for (int s = 24; s >= 0; s -= 8) out.push_back(uint8_t(v >> s));
  };
  auto chunk = [&](const char* type, std::vector<uint8_t> data) {
    be32(uint32_t(data.size()));
    std::vector<uint8_t> body(type, type + 4);
    body.insert(body.end(), data.begin(), data.end());
    out.insert(out.end(), body.begin(), body.end());
    be32(uint32_t(crc32(0, body.data(), uInt(body.size()))));
  };
  std::vector<uint8_t> ihdr;
  for (uint32_t v : {width, height})
    for (int s = 24; s >= 0; s -= 8) ihdr.push_back(uint8_t(v >> s));
  ihdr.insert(ihdr.end(), {8, 2, 0, 0, 0});  // 8-bit RGB, deflate, no filter, no interlace
  chunk("IHDR", ihdr);
  chunk("IEND", {});
  return out;
}
#endif

}  // namespace

TEST_CASE("images: a build without libpng/libjpeg says so, one with them decodes") {
  if (images_supported()) {
    const Image img = read_image(kFixtures / "rgb.png");
    CHECK(img.height == 13);
    CHECK(img.width == 21);
    CHECK(img.rgb.size() == 13 * 21 * 3);
  } else {
    CHECK_THAT(read_error(kFixtures / "rgb.png"),
               ContainsSubstring("slime was built without libpng/libjpeg") && ContainsSubstring("rgb.png"));
    SKIP("slime was built without libpng/libjpeg");
  }
}

TEST_CASE("images: PNG and JPEG files decode to the RGB that PIL and transformers' convert_to_rgb give") {
  SKIP_WITHOUT_IMAGES();
  const io::SafetensorsFile ref(kFixtures / "decoded.safetensors");
  int checked = 0;
  for (const std::string& name : ref.names()) {
    const bool over_white = name.starts_with("over_white.");
    const std::string file = name.substr(name.find('.') + 1);
    INFO(name);
    std::vector<int64_t> dims;
    const std::vector<uint8_t> want = fixture_tensor<uint8_t>(ref, name, "U8", &dims);
    REQUIRE(dims.size() == 3);
    ImageReadOptions o;
    o.alpha = over_white ? ImageReadOptions::Alpha::kOverWhite : ImageReadOptions::Alpha::kIgnore;
    const Image got = read_image(kFixtures / file, o);
    REQUIRE(got.height == dims[0]);
    REQUIRE(got.width == dims[1]);
    REQUIRE(dims[2] == 3);
    int64_t differ = 0, max_diff = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const int64_t d = std::abs(int64_t(got.rgb[i]) - int64_t(want[i]));
      differ += d != 0;
      max_diff = std::max(max_diff, d);
    }
    INFO("differing samples " << differ << " of " << want.size() << ", max " << max_diff);
    CHECK(differ == 0);  // libjpeg-turbo's ISLOW IDCT and fancy upsampling are exact across versions
    ++checked;
  }
  // 9 files, 5 of them with transparency (rgba, la, gray_trns, palette; the ignore_alpha copies)
  CHECK(checked == 13);
}

#if SLIME_TEST_HAVE_LIBPNG
TEST_CASE("images: PNGs of every colour type and bit depth written by libpng") {
  SKIP_WITHOUT_IMAGES();
  TempDir dir;
  const int w = 11, h = 5;
  std::mt19937 rng(7);
  auto byte = [&] { return uint8_t(rng() & 0xff); };
  auto decode = [&](const PngSpec& s, const std::vector<std::vector<uint8_t>>& rows,
                    ImageReadOptions::Alpha alpha = ImageReadOptions::Alpha::kOverWhite) {
    ImageReadOptions o;
    o.alpha = alpha;
    const Image img = read_image(dir.write("t.png", encode_png(s, rows)), o);
    REQUIRE(img.height == s.height);
    REQUIRE(img.width == s.width);
    return img;
  };

  SECTION("gray at 1, 2, 4 bits: samples scaled to 0..255 (v * 255 / (2^bits - 1))") {
    for (int bits : {1, 2, 4}) {
      INFO("bits " << bits);
      const int per_byte = 8 / bits, maxv = (1 << bits) - 1;
      std::vector<std::vector<uint8_t>> rows(h, std::vector<uint8_t>((w + per_byte - 1) / per_byte));
      std::vector<int> v(w * h);
      for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
          v[y * w + x] = int(rng() % (maxv + 1));
          rows[y][x / per_byte] |= uint8_t(v[y * w + x] << (8 - bits * (x % per_byte + 1)));
        }
      const Image img = decode(spec(w, h, PNG_COLOR_TYPE_GRAY, bits), rows);
      for (int i = 0; i < w * h; ++i)
        for (int c = 0; c < 3; ++c) REQUIRE(img.rgb[i * 3 + c] == v[i] * 255 / maxv);
    }
  }
  SECTION("16-bit gray, gray+alpha, RGB, RGBA: the high byte of each sample, alpha over white") {
    for (int type : {PNG_COLOR_TYPE_GRAY, PNG_COLOR_TYPE_GRAY_ALPHA, PNG_COLOR_TYPE_RGB, PNG_COLOR_TYPE_RGBA}) {
      const int ch = type == PNG_COLOR_TYPE_GRAY         ? 1
                     : type == PNG_COLOR_TYPE_GRAY_ALPHA ? 2
                     : type == PNG_COLOR_TYPE_RGB        ? 3
                                                         : 4;
      INFO("colour type " << type);
      std::vector<std::vector<uint8_t>> rows(h, std::vector<uint8_t>(w * ch * 2));
      for (auto& r : rows)
        for (auto& b : r) b = byte();
      for (bool interlace : {false, true}) {
        const PngSpec s = spec(w, h, type, 16, interlace);
        const Image img = decode(s, rows);
        const Image raw = decode(s, rows, ImageReadOptions::Alpha::kIgnore);
        for (int y = 0; y < h; ++y)
          for (int x = 0; x < w; ++x)
            for (int c = 0; c < 3; ++c) {
              const uint8_t* px = rows[y].data() + x * ch * 2;  // big-endian samples: [hi, lo]
              const int colour = px[(ch >= 3 ? c : 0) * 2];
              const int alpha = ch == 2 || ch == 4 ? px[(ch - 1) * 2] : 255;
              REQUIRE(raw.at(y, x, c) == colour);
              REQUIRE(img.at(y, x, c) == over_white_ref(colour, alpha));
            }
      }
    }
  }
  SECTION("8-bit RGBA, interlaced: alpha over white, or ignored") {
    std::vector<std::vector<uint8_t>> rows(h, std::vector<uint8_t>(w * 4));
    for (auto& r : rows)
      for (auto& b : r) b = byte();
    rows[0][3] = 0, rows[0][7] = 255;  // fully transparent and opaque pixels
    const Image img = decode(spec(w, h, PNG_COLOR_TYPE_RGBA, 8, true), rows);
    const Image raw = decode(spec(w, h, PNG_COLOR_TYPE_RGBA, 8, true), rows, ImageReadOptions::Alpha::kIgnore);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x)
        for (int c = 0; c < 3; ++c) {
          REQUIRE(raw.at(y, x, c) == rows[y][x * 4 + c]);
          REQUIRE(img.at(y, x, c) == over_white_ref(rows[y][x * 4 + c], rows[y][x * 4 + 3]));
        }
    CHECK(img.at(0, 0, 0) == 255);
    CHECK(img.at(0, 1, 2) == rows[0][6]);
  }
  SECTION("4-bit palette with tRNS, and 8-bit gray with a transparent gray value") {
    PngSpec s = spec(w, h, PNG_COLOR_TYPE_PALETTE, 4);
    for (int i = 0; i < 16; ++i) s.palette.push_back({byte(), byte(), byte()});
    s.trans_alpha = {0, 128, 255, 3};  // entries 4..15 opaque
    std::vector<std::vector<uint8_t>> rows(h, std::vector<uint8_t>((w + 1) / 2));
    std::vector<int> idx(w * h);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        idx[y * w + x] = int(rng() % 16);
        rows[y][x / 2] |= uint8_t(idx[y * w + x] << (x % 2 ? 0 : 4));
      }
    const Image img = decode(s, rows);
    for (int i = 0; i < w * h; ++i) {
      const png_color& p = s.palette[idx[i]];
      const int a = idx[i] < 4 ? s.trans_alpha[idx[i]] : 255;
      REQUIRE(img.rgb[i * 3 + 0] == over_white_ref(p.red, a));
      REQUIRE(img.rgb[i * 3 + 1] == over_white_ref(p.green, a));
      REQUIRE(img.rgb[i * 3 + 2] == over_white_ref(p.blue, a));
    }

    PngSpec g = spec(w, h, PNG_COLOR_TYPE_GRAY, 8);
    g.has_trans_color = true;
    g.trans_color.gray = 77;
    std::vector<std::vector<uint8_t>> grows(h, std::vector<uint8_t>(w));
    for (auto& r : grows)
      for (auto& b : r) b = byte();
    grows[1][1] = 77;
    const Image gi = decode(g, grows);
    const Image graw = decode(g, grows, ImageReadOptions::Alpha::kIgnore);
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        REQUIRE(gi.at(y, x, 1) == (grows[y][x] == 77 ? 255 : grows[y][x]));
        REQUIRE(graw.at(y, x, 1) == grows[y][x]);
      }
  }
}

TEST_CASE("images: a PNG header claiming a huge image is refused before any pixel is allocated") {
  SKIP_WITHOUT_IMAGES();
  TempDir dir;
  const fs::path side = dir.write("wide.png", png_header_only(10, 100000));
  CHECK_THAT(read_error(side), ContainsSubstring("wide.png") && ContainsSubstring("max_side"));
  const fs::path many = dir.write("many.png", png_header_only(40000, 40000));
  CHECK_THAT(read_error(many), ContainsSubstring("many.png") && ContainsSubstring("max_pixels"));
  // Within the limits, the missing pixel data is what fails.
  const fs::path empty = dir.write("nodata.png", png_header_only(4, 4));
  CHECK_THAT(read_error(empty), ContainsSubstring("nodata.png") && ContainsSubstring("PNG image"));
}
#endif

TEST_CASE("images: bad files give clear errors naming the file") {
  SKIP_WITHOUT_IMAGES();
  TempDir dir;
  const std::vector<uint8_t> png = file_bytes(kFixtures / "rgb.png");
  const std::vector<uint8_t> jpg = file_bytes(kFixtures / "photo.jpg");
  REQUIRE(png.size() > 100);
  REQUIRE(jpg.size() > 1000);

  SECTION("missing, a directory, a FIFO, empty") {
    CHECK_THAT(read_error(dir.path / "missing.png"),
               ContainsSubstring("missing.png") && ContainsSubstring("No such file"));
    fs::create_directory(dir.path / "adir.png");
    CHECK_THAT(read_error(dir.path / "adir.png"), ContainsSubstring("adir.png") && ContainsSubstring("a directory"));
    REQUIRE(::mkfifo((dir.path / "fifo.png").c_str(), 0600) == 0);
    CHECK_THAT(read_error(dir.path / "fifo.png"), ContainsSubstring("fifo.png") && ContainsSubstring("a FIFO"));
    CHECK_THAT(read_error(dir.write("empty.png", {})), ContainsSubstring("empty.png") && ContainsSubstring("empty"));
  }
  SECTION("neither PNG nor JPEG, by content") {
    const std::string text = "hello, not an image";
    CHECK_THAT(
        read_error(dir.write("text.png", std::vector<uint8_t>(text.begin(), text.end()))),
        ContainsSubstring("text.png") && ContainsSubstring("neither PNG nor JPEG") && ContainsSubstring("68 65 6c 6c"));
    const std::string gif = "GIF89a\x01\x00\x01\x00";
    CHECK_THAT(read_error(dir.write("anim.jpg", std::vector<uint8_t>(gif.begin(), gif.end()))),
               ContainsSubstring("anim.jpg") && ContainsSubstring("GIF"));
    // A PNG named .jpg decodes: the content decides.
    CHECK(read_image(dir.write("png.jpg", png)).width == 21);
  }
  SECTION("truncated PNG: inside the pixel data, before IEND, inside the signature") {
    for (std::size_t keep : {png.size() / 2, png.size() - 12, std::size_t(40), std::size_t(6)}) {
      INFO("kept " << keep << " of " << png.size() << " bytes");
      const std::string err = read_error(dir.write("cut.png", std::vector<uint8_t>(png.begin(), png.begin() + keep)));
      CHECK_THAT(err, ContainsSubstring("cut.png"));
      if (keep > 8) CHECK_THAT(err, ContainsSubstring("truncated"));
    }
  }
  SECTION("corrupt PNG: a flipped byte in the pixel data (CRC), a bad IHDR") {
    std::vector<uint8_t> bad = png;
    bad[bad.size() / 2] ^= 0x5a;
    CHECK_THAT(read_error(dir.write("crc.png", bad)), ContainsSubstring("crc.png") && ContainsSubstring("corrupt"));
    bad = png;
    bad[16] = bad[17] = bad[18] = bad[19] = 0;  // width 0 (the IHDR CRC no longer matches either)
    CHECK_THAT(read_error(dir.write("ihdr.png", bad)), ContainsSubstring("ihdr.png") && ContainsSubstring("corrupt"));
  }
  SECTION("truncated and corrupt JPEG") {
    for (std::size_t keep : {jpg.size() / 2, jpg.size() - 2, std::size_t(300), std::size_t(3)}) {
      INFO("kept " << keep << " of " << jpg.size() << " bytes");
      const std::string err = read_error(dir.write("cut.jpg", std::vector<uint8_t>(jpg.begin(), jpg.begin() + keep)));
      CHECK_THAT(err, ContainsSubstring("cut.jpg") && ContainsSubstring("JPEG image"));
    }
    CHECK_THAT(read_error(dir.write("cut.jpg", std::vector<uint8_t>(jpg.begin(), jpg.begin() + jpg.size() / 2))),
               ContainsSubstring("truncated"));
    std::vector<uint8_t> bad = jpg;
    for (std::size_t i = 0; i < 64; ++i) bad[bad.size() / 2 + i] = 0xff;  // markers in the entropy-coded data
    CHECK_THAT(read_error(dir.write("garbage.jpg", bad)),
               ContainsSubstring("garbage.jpg") && ContainsSubstring("corrupt"));
    bad = jpg;
    bad.resize(200);
    bad.insert(bad.end(), {0xff, 0xd9});  // EOI before any scan
    CHECK_THAT(read_error(dir.write("noscan.jpg", bad)), ContainsSubstring("noscan.jpg"));
  }
  SECTION("CMYK JPEG is refused") {
    CHECK_THAT(read_error(kFixtures / "cmyk.jpg"), ContainsSubstring("cmyk.jpg") && ContainsSubstring("CMYK"));
  }
  SECTION("size limits: pixels, side, file bytes") {
    ImageReadOptions o;
    o.max_pixels = 13 * 21 - 1;
    CHECK_THAT(read_error(kFixtures / "rgb.png", o), ContainsSubstring("rgb.png") && ContainsSubstring("max_pixels"));
    o.max_pixels = 150 * 110 - 1;
    CHECK_THAT(read_error(kFixtures / "photo.jpg", o),
               ContainsSubstring("photo.jpg") && ContainsSubstring("max_pixels"));
    o = {};
    o.max_side = 20;
    CHECK_THAT(read_error(kFixtures / "rgb.png", o), ContainsSubstring("rgb.png") && ContainsSubstring("max_side"));
    o = {};
    o.max_file_bytes = int64_t(png.size()) - 1;
    CHECK_THAT(read_error(kFixtures / "rgb.png", o),
               ContainsSubstring("rgb.png") && ContainsSubstring("max_file_bytes"));
    o.max_file_bytes = int64_t(png.size());
    CHECK(read_image(kFixtures / "rgb.png", o).height == 13);
  }
}

TEST_CASE("smart_resize: transformers' own results, Qwen3-VL's and Qwen2-VL's bounds") {
  std::ifstream in(kFixtures / "qwen3_vl_golden.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const nlohmann::json& cases = meta.at("smart_resize_cases").at("cases");
  REQUIRE(cases.size() >= 60);
  int refused = 0;
  for (const nlohmann::json& c : cases) {
    const int64_t h = c[0], w = c[1], f = c[2], lo = c[3], hi = c[4], oh = c[5], ow = c[6];
    INFO(h << "x" << w << " factor " << f << " pixels [" << lo << ", " << hi << "]");
    if (oh < 0) {
      CHECK_THROWS_WITH(smart_resize(h, w, f, lo, hi), ContainsSubstring("aspect ratio"));
      ++refused;
      continue;
    }
    const ImageSize got = smart_resize(h, w, f, lo, hi);
    CHECK(got.height == oh);
    CHECK(got.width == ow);
  }
  CHECK(refused >= 3);
}

TEST_CASE("smart_resize: ties round to even, bounds, multiples of the factor") {
  // 48 / 32 = 1.5 rounds to 2, 80 / 32 = 2.5 rounds to 2 (Python's round).
  CHECK(smart_resize(48, 80, 32, 0, 1 << 30) == ImageSize{64, 64});
  CHECK(smart_resize(112, 144, 32, 0, 1 << 30) == ImageSize{128, 128});  // 3.5 -> 4, 4.5 -> 4
  // Already a multiple and within bounds: unchanged.
  CHECK(smart_resize(256, 320, 32, 65536, 16777216) == ImageSize{256, 320});
  // Too small: scaled up to at least min_pixels.
  const ImageSize up = smart_resize(10, 10, 32, 65536, 16777216);
  CHECK(up == ImageSize{256, 256});
  // Too large: scaled down to at most max_pixels.
  const ImageSize down = smart_resize(5000, 7000, 32, 65536, 16777216);
  CHECK(down.height * down.width <= 16777216);
  CHECK(down.height % 32 == 0);
  CHECK(down.width % 32 == 0);
  CHECK_THROWS_WITH(smart_resize(1, 201, 32, 65536, 16777216), ContainsSubstring("aspect ratio"));
  CHECK_THROWS_WITH(smart_resize(0, 10, 32, 65536, 16777216), ContainsSubstring("must be positive"));
  CHECK_THROWS_WITH(smart_resize(10, 10, 32, 0, 16777216), ContainsSubstring("raise min_pixels"));
  // Random sizes: multiples of the factor, within the bounds unless a side hit its minimum.
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; ++i) {
    const int64_t h = 1 + rng() % 5000, w = std::max<int64_t>(1 + rng() % 5000, (h + 199) / 200);
    if (std::max(h, w) > 200 * std::min(h, w)) continue;
    const ImageSize s = smart_resize(h, w, 32, 65536, 16777216);
    INFO(h << "x" << w << " -> " << s.height << "x" << s.width);
    REQUIRE(s.height % 32 == 0);
    REQUIRE(s.width % 32 == 0);
    REQUIRE(s.height * s.width >= 65536 - 0);
    if (s.height > 32 && s.width > 32) REQUIRE(s.height * s.width <= 16777216);
  }
}

TEST_CASE("resize_bicubic: a hand-worked row, constants, identity, and a double-precision reference") {
  SECTION("4 -> 2 columns: Keys a = -0.5 weights widened by 2, normalised") {
    // Output 0: centre 1.0, taps 0..3 at (j - 1 + 0.5) / 2 = -0.25, 0.25, 0.75, 1.25:
    // k = 0.8671875, 0.8671875, 0.2265625, -0.0703125 (sum 1.890625), so
    // (0 k0 + 100 k1 + 200 k2 + 250 k3) / 1.890625 = 114.453125 / 1.890625 = 60.54 -> 61.
    // Output 1 mirrors it: centre 3.0, taps 0..3 at -1.25, -0.75, -0.25, 0.25:
    // (0 k3 + 100 k2 + 200 k1 + 250 k0) / 1.890625 = 412.890625 / 1.890625 = 218.39 -> 218.
    // (torchvision's resize of this row gives 61, 218 too.)
    Image src{1, 4, {0, 0, 0, 100, 100, 100, 200, 200, 200, 250, 250, 250}};
    const Image out = resize_bicubic(src, 1, 2);
    REQUIRE(out.rgb.size() == 6);
    CHECK(out.at(0, 0, 0) == 61);
    CHECK(out.at(0, 1, 1) == 218);
  }
  SECTION("a constant image stays constant, the same size is the identity") {
    Image c{7, 9, std::vector<uint8_t>(7 * 9 * 3, 200)};
    for (auto [h, w] : {std::pair{3, 4}, {14, 20}, {7, 30}, {2, 9}}) {
      const Image r = resize_bicubic(c, h, w);
      for (uint8_t v : r.rgb) REQUIRE(v == 200);
    }
    Image rnd{5, 6, std::vector<uint8_t>(90)};
    std::mt19937 rng(1);
    for (auto& v : rnd.rgb) v = uint8_t(rng());
    CHECK(resize_bicubic(rnd, 5, 6).rgb == rnd.rgb);
  }
  SECTION("within one level of a double-precision two-pass reference") {
    // The same filter with double weights and no int16 rounding; each pass
    // rounded to uint8 as the fixed-point one is.
    auto keys = [](double x) {  // Keys' cubic, a = -0.5: 1.5|x|^3 - 2.5|x|^2 + 1, -0.5|x|^3 + 2.5|x|^2 - 4|x| + 2
      x = std::abs(x);
      return x < 1 ? 1.5 * x * x * x - 2.5 * x * x + 1 : x < 2 ? -0.5 * x * x * x + 2.5 * x * x - 4 * x + 2 : 0.0;
    };
    auto pass = [&](const std::vector<double>& in, int64_t n_in, int64_t n_out, int64_t lines, bool rows) {
      std::vector<double> out(std::size_t(n_out * lines));
      const double scale = double(n_in) / double(n_out), support = scale >= 1 ? 2 * scale : 2;
      for (int64_t i = 0; i < n_out; ++i) {
        const double center = scale * (i + 0.5);
        std::vector<std::pair<int64_t, double>> taps;
        double total = 0;
        for (int64_t j = std::max<int64_t>(0, int64_t(center - support + 0.5));
             j < std::min<int64_t>(n_in, int64_t(center + support + 0.5)); ++j) {
          const double k = keys((j - center + 0.5) / std::max(scale, 1.0));
          taps.push_back({j, k});
          total += k;
        }
        for (int64_t l = 0; l < lines; ++l) {
          double acc = 0;
          for (auto [j, k] : taps) acc += k / total * in[std::size_t(rows ? j * lines + l : l * n_in + j)];
          out[std::size_t(rows ? i * lines + l : l * n_out + i)] = std::clamp(std::round(acc), 0.0, 255.0);
        }
      }
      return out;
    };
    std::mt19937 rng(11);
    int64_t total = 0, off = 0;
    for (auto [h, w, oh, ow] :
         {std::array<int64_t, 4>{13, 21, 32, 64}, {150, 110, 64, 64}, {40, 90, 32, 96}, {33, 17, 7, 5}}) {
      Image src{h, w, std::vector<uint8_t>(std::size_t(h * w * 3))};
      for (auto& v : src.rgb) v = uint8_t(rng() % 256);
      const Image got = resize_bicubic(src, oh, ow);
      for (int c = 0; c < 3; ++c) {
        std::vector<double> plane(std::size_t(h * w));
        for (int64_t k = 0; k < h * w; ++k) plane[std::size_t(k)] = src.rgb[std::size_t(k * 3 + c)];
        const std::vector<double> mid = pass(plane, w, ow, h, false);  // [h, ow]
        const std::vector<double> ref = pass(mid, h, oh, ow, true);    // [oh, ow]
        for (int64_t k = 0; k < oh * ow; ++k) {
          const double d = std::abs(double(got.rgb[std::size_t(k * 3 + c)]) - ref[std::size_t(k)]);
          REQUIRE(d <= 1.0);
          off += d != 0;
          ++total;
        }
      }
    }
    INFO(off << " of " << total << " samples differ by one level");
    CHECK(off * 50 < total);  // int16 weights move under 2% of samples by one level
  }
}

TEST_CASE("patchify: rows in merge-block order, columns (channel, t, y, x), a hand-worked 4x8 image") {
  // patch 2, merge 2, temporal 2, no resize, raw values: R = 8y + x, G = R + 64, B = R + 128.
  QwenVLImageOptions o;
  o.patch_size = 2;
  o.do_resize = o.do_rescale = o.do_normalize = false;
  Image img{4, 8, std::vector<uint8_t>(4 * 8 * 3)};
  for (int y = 0; y < 4; ++y)
    for (int x = 0; x < 8; ++x)
      for (int c = 0; c < 3; ++c) img.rgb[(y * 8 + x) * 3 + c] = uint8_t(8 * y + x + 64 * c);
  const Image images[] = {img};
  const VisionInput v = preprocess_images(images, o);
  REQUIRE(v.patch_dim == 24);  // 3 * 2 * 2 * 2
  REQUIRE(v.rows() == 8);      // grid 2 x 4
  REQUIRE(v.grid_thw == std::vector<GridTHW>{{1, 2, 4}});
  auto row = [&](int r) {
    return std::vector<float>(v.pixel_values.begin() + r * 24, v.pixel_values.begin() + (r + 1) * 24);
  };
  // Row 0: block (0, 0), patch (0, 0): pixels (0,0) (0,1) (1,0) (1,1), each channel twice (t = 0, 1).
  CHECK(row(0) == std::vector<float>{0,  1,  8,  9,  0,   1,   8,   9,   64,  65,  72,  73,
                                     64, 65, 72, 73, 128, 129, 136, 137, 128, 129, 136, 137});
  // Row 2: block (0, 0), patch (1, 0): pixels (2,0) (2,1) (3,0) (3,1).
  CHECK(row(2) == std::vector<float>{16, 17, 24, 25, 16,  17,  24,  25,  80,  81,  88,  89,
                                     80, 81, 88, 89, 144, 145, 152, 153, 144, 145, 152, 153});
  // Row 5: block (0, 1), patch (0, 3): pixels (0,6) (0,7) (1,6) (1,7).
  CHECK(row(5) == std::vector<float>{6,  7,  14, 15, 6,   7,   14,  15,  70,  71,  78,  79,
                                     70, 71, 78, 79, 134, 135, 142, 143, 134, 135, 142, 143});
  // Row 6: block (0, 1), patch (1, 2): pixels (2,4) (2,5) (3,4) (3,5).
  CHECK(row(6) == std::vector<float>{20, 21, 28, 29, 20,  21,  28,  29,  84,  85,  92,  93,
                                     84, 85, 92, 93, 148, 149, 156, 157, 148, 149, 156, 157});

  SECTION("rescale and normalise with mean = std = 0.5: (x / 255 - 0.5) / 0.5") {
    QwenVLImageOptions n = o;
    n.do_rescale = n.do_normalize = true;
    Image px{4, 8, std::vector<uint8_t>(4 * 8 * 3, 0)};
    px.rgb[0] = 255, px.rgb[1] = 128, px.rgb[2] = 0;
    const Image one[] = {px};
    const VisionInput p = preprocess_images(one, n);
    CHECK(p.pixel_values[0] == 1.0f);                        // R of (0, 0)
    CHECK(p.pixel_values[8] == (128.0f - 127.5f) / 127.5f);  // G of (0, 0)
    CHECK(p.pixel_values[16] == -1.0f);                      // B of (0, 0)
  }
  SECTION("without resize, a side not a multiple of patch * merge is an error") {
    Image odd{4, 6, std::vector<uint8_t>(4 * 6 * 3)};
    const Image one[] = {odd};
    CHECK_THROWS_WITH(preprocess_images(one, o), ContainsSubstring("not a multiple of patch_size * merge_size = 4"));
  }
}

TEST_CASE("Qwen3-VL preprocessing equals transformers' Qwen2VLImageProcessor (torchvision backend)") {
  SKIP_WITHOUT_IMAGES();
  std::ifstream in(kFixtures / "qwen3_vl_golden.json");
  const nlohmann::json meta = nlohmann::json::parse(in);
  const QwenVLImageOptions o = read_preprocessor_config(kFixtures / "preprocessor_config.json");
  std::vector<Image> images;
  for (const nlohmann::json& f : meta.at("golden_files"))
    images.push_back(read_image(kFixtures / f.get<std::string>()));
  const VisionInput got = preprocess_images(images, o);

  const io::SafetensorsFile ref(kFixtures / "qwen3_vl_golden.safetensors");
  std::vector<int64_t> dims;
  const std::vector<float> want = fixture_tensor<float>(ref, "pixel_values", "F32", &dims);
  const std::vector<int64_t> grid = fixture_tensor<int64_t>(ref, "image_grid_thw", "I64");
  REQUIRE(dims == std::vector<int64_t>{got.rows(), 1536});
  REQUIRE(got.grid_thw.size() * 3 == grid.size());
  for (std::size_t i = 0; i < got.grid_thw.size(); ++i)
    CHECK(got.grid_thw[i] == GridTHW{grid[3 * i], grid[3 * i + 1], grid[3 * i + 2]});
  // Both sides hold (u - 127.5) / 127.5 for the same uint8 u wherever the
  // resize agrees, so the tolerance is float rounding only; a resize off by
  // one level would show as 2 / 255 = 0.0078.
  double max_abs = 0;
  int64_t differ = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(double(got.pixel_values[i]) - double(want[i]));
    max_abs = std::max(max_abs, d);
    differ += d > 0;
  }
  INFO("max |slime - transformers| = " << max_abs << ", " << differ << " of " << want.size() << " values differ");
  CHECK(max_abs <= 1e-6);
}

TEST_CASE("preprocessor_config.json: Qwen3-VL-2B's values, overrides, and bad fields") {
  const QwenVLImageOptions q = read_preprocessor_config(kFixtures / "qwen3_vl_2b_preprocessor_config.json");
  const QwenVLImageOptions d;
  CHECK(q.patch_size == 16);
  CHECK(q.merge_size == 2);
  CHECK(q.temporal_patch_size == 2);
  CHECK(q.min_pixels == 65536);
  CHECK(q.max_pixels == 16777216);
  CHECK(q.image_mean == std::array<double, 3>{0.5, 0.5, 0.5});
  CHECK(q.image_std == std::array<double, 3>{0.5, 0.5, 0.5});
  CHECK(q.patch_dim() == 1536);
  CHECK((d.patch_size == q.patch_size && d.min_pixels == q.min_pixels && d.max_pixels == q.max_pixels &&
         d.image_mean == q.image_mean && d.rescale_factor == q.rescale_factor));
  const QwenVLImageOptions fixture = read_preprocessor_config(kFixtures / "preprocessor_config.json");
  CHECK(fixture.min_pixels == 1024);
  CHECK(fixture.max_pixels == 6144);

  using nlohmann::json;
  const json legacy = {{"min_pixels", 3136},
                       {"max_pixels", 12845056},
                       {"patch_size", 14},
                       {"image_mean", {0.48145466, 0.4578275, 0.40821073}},
                       {"size", {{"shortest_edge", 1}, {"longest_edge", 2}}}};
  const QwenVLImageOptions l = QwenVLImageOptions::from_json(legacy, "legacy");
  CHECK(l.min_pixels == 3136);  // min_pixels / max_pixels override size, as in transformers
  CHECK(l.max_pixels == 12845056);
  CHECK(l.patch_size == 14);
  CHECK(l.image_mean[2] == 0.40821073);

  auto error = [](const json& j) {
    try {
      (void)QwenVLImageOptions::from_json(j, "cfg.json");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  CHECK_THAT(error(json::array()), ContainsSubstring("cfg.json") && ContainsSubstring("JSON object"));
  CHECK_THAT(error({{"patch_size", "16"}}), ContainsSubstring("cfg.json") && ContainsSubstring("'patch_size'"));
  CHECK_THAT(error({{"patch_size", 0}}), ContainsSubstring("patch_size = 0"));
  CHECK_THAT(error({{"size", {{"shortest_edge", 10}}}}), ContainsSubstring("longest_edge"));
  CHECK_THAT(error({{"size", {{"shortest_edge", 10}, {"longest_edge", 1.5}}}}), ContainsSubstring("size.longest_edge"));
  CHECK_THAT(error({{"size", {{"shortest_edge", 100}, {"longest_edge", 10}}}}),
             ContainsSubstring("min_pixels <= max_pixels"));
  CHECK_THAT(error({{"image_mean", {0.5, 0.5}}}), ContainsSubstring("'image_mean'"));
  CHECK_THAT(error({{"image_std", {0.5, 0.0, 0.5}}}), ContainsSubstring("image_std[1]"));
  CHECK_THAT(error({{"resample", 2}}), ContainsSubstring("'resample' = 2"));
  CHECK_THAT(error({{"do_normalize", 1}}), ContainsSubstring("'do_normalize'"));
  CHECK_THAT(error({{"do_convert_rgb", false}}), ContainsSubstring("do_convert_rgb"));

  TempDir dir;
  const std::string bad = "{\"patch_size\": 16,";
  const fs::path broken = dir.write("preprocessor_config.json", std::vector<uint8_t>(bad.begin(), bad.end()));
  CHECK_THROWS_WITH(read_preprocessor_config(broken),
                    ContainsSubstring("preprocessor_config.json") && ContainsSubstring("not valid JSON"));
  CHECK_THROWS_WITH(read_preprocessor_config(dir.path / "nope.json"), ContainsSubstring("nope.json"));
  // A model directory: its preprocessor_config.json.
  fs::copy_file(kFixtures / "qwen3_vl_2b_preprocessor_config.json", dir.path / "preprocessor_config.json",
                fs::copy_options::overwrite_existing);
  CHECK(read_preprocessor_config(dir.path).min_pixels == 65536);
}

TEST_CASE("image placeholders expand to t * h * w / merge^2 tokens each") {
  const VisionTokenIds ids{151655, 151652, 151653};
  const int32_t S = ids.vision_start_token_id, I = ids.image_token_id, E = ids.vision_end_token_id;
  const std::vector<int32_t> prompt = {1, S, I, E, 2, 3, S, I, E, 4};
  const std::vector<GridTHW> grids = {{1, 2, 4}, {1, 4, 6}};  // 8 / 4 = 2 tokens, 24 / 4 = 6 tokens
  const std::vector<int32_t> got = expand_image_placeholders(prompt, grids, 2, ids);
  CHECK(got == std::vector<int32_t>{1, S, I, I, E, 2, 3, S, I, I, I, I, I, I, E, 4});
  CHECK(expand_image_placeholders(std::vector<int32_t>{5, 6}, {}, 2, ids) == std::vector<int32_t>{5, 6});
  CHECK(expand_image_placeholders(std::vector<int32_t>{S, I, E}, std::vector<GridTHW>{{2, 4, 4}}, 2, ids).size() ==
        2 + 8);  // t = 2 (a video-like grid): 32 / 4

  CHECK_THROWS_WITH(expand_image_placeholders(prompt, std::vector<GridTHW>{{1, 2, 4}}, 2, ids),
                    ContainsSubstring("2 image placeholders") && ContainsSubstring("1 images"));
  CHECK_THROWS_WITH(expand_image_placeholders(prompt, std::vector<GridTHW>{{1, 2, 4}, {1, 2, 4}, {1, 2, 4}}, 2, ids),
                    ContainsSubstring("2 image placeholders") && ContainsSubstring("3 images"));
  CHECK_THROWS_WITH(expand_image_placeholders(std::vector<int32_t>{S, I, I, E}, grids, 2, ids),
                    ContainsSubstring("already expanded"));
  CHECK_THROWS_WITH(expand_image_placeholders(std::vector<int32_t>{1, I, E}, std::vector<GridTHW>{{1, 2, 2}}, 2, ids),
                    ContainsSubstring("position 1"));
  CHECK_THROWS_WITH(expand_image_placeholders(std::vector<int32_t>{S, I, E}, std::vector<GridTHW>{{1, 3, 3}}, 2, ids),
                    ContainsSubstring("merge_size^2 = 4"));
  CHECK_THROWS_WITH(expand_image_placeholders(prompt, grids, 2, VisionTokenIds{}), ContainsSubstring("must be set"));
}
