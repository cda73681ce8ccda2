// PNG (libpng) and JPEG (libjpeg-turbo) decoding for slime/data/image.hpp.
//
// Error handling: both libraries report a fatal error through a callback that
// must not return. The callbacks here copy the message and longjmp back to a
// setjmp in a small decode function (png_read_header, jpeg_read_pixels, ...)
// whose locals are all trivially destructible and which calls nothing but the
// library between its setjmp and its return, so a longjmp never skips a C++
// destructor. The library objects are destroyed by guards in the calling C++
// function, which the jumps never leave. Allocation of the pixels happens in
// C++ between two such functions, never inside one.
#include "slime/data/image.hpp"

#include "slime/core/regular_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>

#include "slime/core/error.hpp"
#include "slime/core/file_descriptor.hpp"

#if SLIME_HAVE_IMAGES
#include <csetjmp>

#include <jpeglib.h>
// after jpeglib.h: the message codes (JWRN_*)
#include <jerror.h>
#include <png.h>
#endif

namespace slime::data {

namespace {

std::string hex_prefix(std::span<const uint8_t> bytes) {
  std::string out;
  char buf[4];
  for (std::size_t i = 0; i < bytes.size() && i < 8; ++i) {
    std::snprintf(buf, sizeof buf, i ? " %02x" : "%02x", unsigned(bytes[i]));
    out += buf;
  }
  return out;
}


}  // namespace

std::vector<uint8_t> read_regular_file(const std::filesystem::path& path, int64_t max_file_bytes, const char* what) {
  const std::string name = path.string();
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) SLIME_FAIL("cannot read ", what, " '", name, "': ", std::strerror(errno));
  // Refuses a FIFO or a device without blocking in open().
  FileDescriptor fd = open_regular_file(path, what);
  if (::fstat(fd.get(), &st) != 0) SLIME_FAIL("cannot stat ", what, " '", name, "': ", std::strerror(errno));
  const int64_t size = int64_t(st.st_size);
  SLIME_CHECK(size > 0, what, " '", name, "' is empty (0 bytes)");
  SLIME_CHECK(size <= max_file_bytes, what, " '", name, "' has ", size,
              " bytes, more than max_file_bytes = ", max_file_bytes);
  std::vector<uint8_t> bytes(static_cast<std::size_t>(size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd.get(), bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) SLIME_FAIL("reading ", what, " '", name, "' failed: ", std::strerror(errno));
    if (n == 0) SLIME_FAIL(what, " '", name, "' shrank while being read: ", done, " of ", size, " bytes");
    done += std::size_t(n);
  }
  return bytes;
}

ImageFormat detect_image_format(std::span<const uint8_t> bytes, const std::string& name) {
  static constexpr uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  auto starts = [&](std::string_view s, std::size_t at = 0) {
    return bytes.size() >= at + s.size() && std::memcmp(bytes.data() + at, s.data(), s.size()) == 0;
  };
  if (bytes.size() >= 8 && std::memcmp(bytes.data(), kPng, 8) == 0) return ImageFormat::kPng;
  if (bytes.size() >= 3 && bytes[0] == 0xff && bytes[1] == 0xd8 && bytes[2] == 0xff) return ImageFormat::kJpeg;
  SLIME_CHECK(!bytes.empty(), "image '", name, "' is empty (0 bytes)");
  const char* known = starts("GIF8")                        ? "GIF"
                      : starts("RIFF") && starts("WEBP", 8) ? "WebP"
                      : starts("BM")                        ? "BMP"
                      : starts("II*") || starts("MM\0*")    ? "TIFF"
                                                            : nullptr;
  if (known != nullptr) SLIME_FAIL("image '", name, "' is a ", known, " file; slime decodes PNG and JPEG only");
  SLIME_FAIL("image '", name, "' is neither PNG nor JPEG (", bytes.size(), " bytes, starting ", hex_prefix(bytes), ")");
}

#if !SLIME_HAVE_IMAGES

bool images_supported() { return false; }

Image decode_image(std::span<const uint8_t>, const std::string& name, const ImageReadOptions&) {
  SLIME_FAIL("cannot decode image '", name,
             "': slime was built without libpng/libjpeg (configure with them installed, e.g. Debian's libpng-dev "
             "libjpeg62-turbo-dev, and SLIME_WITH_IMAGES=AUTO or ON)");
}

#else  // SLIME_HAVE_IMAGES

bool images_supported() { return true; }

namespace {

void check_size(int64_t height, int64_t width, const ImageReadOptions& o, const std::string& name) {
  SLIME_CHECK(height > 0 && width > 0, "image '", name, "' has size ", height, "x", width, " (height x width)");
  SLIME_CHECK(height <= o.max_side && width <= o.max_side, "image '", name, "' is ", height, "x", width,
              " (height x width): a side exceeds max_side = ", o.max_side);
  SLIME_CHECK(height * width <= o.max_pixels, "image '", name, "' is ", height, "x", width, " = ", height * width,
              " pixels, more than max_pixels = ", o.max_pixels);
}

// Colour c of alpha a over opaque white, round((c * a + 255 * (255 - a)) / 255):
// equal, for all 65,536 (c, a), to PIL's alpha_composite onto a white image,
// which transformers' convert_to_rgb uses.
inline uint8_t over_white(unsigned c, unsigned a) {
  const unsigned v = c * a + 255u * (255u - a);
  return uint8_t((2u * v + 255u) / 510u);
}

// RGBA or RGB rows [height, width, channels] into the image's RGB.
void to_rgb(const uint8_t* src, int channels, Image& img, ImageReadOptions::Alpha alpha) {
  const std::size_t n = std::size_t(img.pixels());
  uint8_t* dst = img.rgb.data();
  if (channels == 3) {
    std::memcpy(dst, src, n * 3);
    return;
  }
  for (std::size_t i = 0; i < n; ++i, src += 4, dst += 3) {
    if (alpha == ImageReadOptions::Alpha::kIgnore) {
      dst[0] = src[0], dst[1] = src[1], dst[2] = src[2];
    } else {
      dst[0] = over_white(src[0], src[3]), dst[1] = over_white(src[1], src[3]), dst[2] = over_white(src[2], src[3]);
    }
  }
}

// ---- PNG --------------------------------------------------------------------

struct PngSource {
  const uint8_t* data;
  std::size_t size;
  std::size_t pos;
  bool truncated;
  char message[256];
};

[[noreturn]] void png_on_error(png_structp png, png_const_charp msg) {
  auto* src = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(src->message, sizeof src->message, "%s", msg != nullptr ? msg : "unknown libpng error");
  png_longjmp(png, 1);
}

void png_on_warning(png_structp, png_const_charp) {}

void png_read_bytes(png_structp png, png_bytep out, png_size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > src->size - src->pos) {
    src->truncated = true;
    png_error(png, "unexpected end of file");
  }
  std::memcpy(out, src->data + src->pos, n);
  src->pos += n;
}

struct PngHeader {
  png_uint_32 width, height;
  int channels;  // after the transforms: 3 (RGB) or 4 (RGBA)
  std::size_t rowbytes;
};

// Reads the header and sets the transforms to 8-bit RGB(A).
bool png_read_header(png_structp png, png_infop info, PngHeader* out) {
  if (setjmp(png_jmpbuf(png))) return false;
  // decode_png checked the size against slime's limits; lift libpng's (10^6 a side).
  png_set_user_limits(png, PNG_UINT_31_MAX, PNG_UINT_31_MAX);
  png_read_info(png, info);
  const int color = png_get_color_type(png, info);
  const int depth = png_get_bit_depth(png, info);
  if (color == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color == PNG_COLOR_TYPE_GRAY && depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if (png_get_valid(png, info, PNG_INFO_tRNS)) png_set_tRNS_to_alpha(png);
  if (depth == 16) png_set_strip_16(png);
  if (color == PNG_COLOR_TYPE_GRAY || color == PNG_COLOR_TYPE_GRAY_ALPHA) png_set_gray_to_rgb(png);
  (void)png_set_interlace_handling(png);
  png_read_update_info(png, info);
  out->width = png_get_image_width(png, info);
  out->height = png_get_image_height(png, info);
  out->channels = png_get_channels(png, info);
  out->rowbytes = png_get_rowbytes(png, info);
  return true;
}

bool png_read_pixels(png_structp png, png_infop info, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  png_read_end(png, info);
  return true;
}

Image decode_png(std::span<const uint8_t> bytes, const std::string& name, const ImageReadOptions& o) {
  // The size limits, from the IHDR chunk that must follow the signature, before
  // libpng reads (and allocates for) anything else. A zero side is left to
  // libpng, which reports the IHDR as invalid.
  if (bytes.size() >= 24 && std::memcmp(bytes.data() + 12, "IHDR", 4) == 0) {
    auto be32 = [&](std::size_t at) {
      return int64_t(bytes[at]) << 24 | int64_t(bytes[at + 1]) << 16 | int64_t(bytes[at + 2]) << 8 | bytes[at + 3];
    };
    const int64_t width = be32(16), height = be32(20);
    if (width > 0 && height > 0) check_size(height, width, o, name);
  }
  PngSource src{bytes.data(), bytes.size(), 0, false, {}};
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, png_on_error, png_on_warning);
  SLIME_CHECK(png != nullptr, "cannot decode PNG image '", name, "': png_create_read_struct failed");
  png_infop info = png_create_info_struct(png);
  struct Guard {
    png_structp* png;
    png_infop* info;
    ~Guard() { png_destroy_read_struct(png, info, nullptr); }
  } guard{&png, &info};
  SLIME_CHECK(info != nullptr, "cannot decode PNG image '", name, "': png_create_info_struct failed");
  png_set_read_fn(png, &src, png_read_bytes);

  auto fail = [&](const char* stage) {
    if (src.truncated)
      SLIME_FAIL("PNG image '", name, "' is truncated: ", stage, " needs more than its ", bytes.size(), " bytes");
    SLIME_FAIL("PNG image '", name, "' is corrupt (", stage, "): ", src.message);
  };
  PngHeader h{};
  if (!png_read_header(png, info, &h)) fail("header");
  Image img;
  img.height = int64_t(h.height);
  img.width = int64_t(h.width);
  check_size(img.height, img.width, o, name);
  SLIME_CHECK((h.channels == 3 || h.channels == 4) && h.rowbytes == std::size_t(h.width) * h.channels, "PNG image '",
              name, "': unexpected layout after conversion to RGB (", h.channels, " channels, ", h.rowbytes,
              " bytes per row)");
  std::vector<uint8_t> pixels(h.rowbytes * h.height);
  std::vector<png_bytep> rows(h.height);
  for (png_uint_32 y = 0; y < h.height; ++y) rows[y] = pixels.data() + std::size_t(y) * h.rowbytes;
  if (!png_read_pixels(png, info, rows.data())) fail("pixel data");
  img.rgb.resize(std::size_t(img.pixels()) * 3);
  to_rgb(pixels.data(), h.channels, img, o.alpha);
  return img;
}

// ---- JPEG -------------------------------------------------------------------

struct JpegErrors {
  jpeg_error_mgr mgr;  // first, so that a j_common_ptr's err points at the whole struct
  std::jmp_buf jump;
  bool truncated;
  char message[JMSG_LENGTH_MAX];
};

[[noreturn]] void jpeg_on_error(j_common_ptr cinfo) {
  auto* e = reinterpret_cast<JpegErrors*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, e->message);
  std::longjmp(e->jump, 1);
}

// Warnings that mean the entropy-coded data is cut short or damaged are
// errors: libjpeg would otherwise fill the rest of the image with gray and
// carry on. Other warnings (extraneous bytes before a marker, odd SOS
// parameters) are ignored, as PIL ignores them.
void jpeg_on_message(j_common_ptr cinfo, int level) {
  if (level >= 0) return;  // trace messages
  const int code = cinfo->err->msg_code;
  if (code == JWRN_JPEG_EOF || code == JWRN_HIT_MARKER || code == JWRN_MUST_RESYNC) {
    reinterpret_cast<JpegErrors*>(cinfo->err)->truncated = code == JWRN_JPEG_EOF;
    jpeg_on_error(cinfo);
  }
}

struct JpegHeader {
  int64_t width, height;
  bool cmyk;
};

bool jpeg_read_header_info(jpeg_decompress_struct* cinfo, JpegErrors* err, const uint8_t* data, std::size_t size,
                           JpegHeader* out) {
  if (setjmp(err->jump)) return false;
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, data, static_cast<unsigned long>(size));
  (void)jpeg_read_header(cinfo, TRUE);
  out->width = int64_t(cinfo->image_width);
  out->height = int64_t(cinfo->image_height);
  out->cmyk = cinfo->jpeg_color_space == JCS_CMYK || cinfo->jpeg_color_space == JCS_YCCK;
  return true;
}

// Starts decompression to RGB (libjpeg's defaults otherwise: ISLOW IDCT and
// fancy upsampling, as PIL decodes) and reads every scanline into `rgb`.
bool jpeg_read_pixels(jpeg_decompress_struct* cinfo, JpegErrors* err, uint8_t* rgb, std::size_t row_bytes) {
  if (setjmp(err->jump)) return false;
  cinfo->out_color_space = JCS_RGB;
  (void)jpeg_start_decompress(cinfo);
  if (cinfo->output_components != 3 || std::size_t(cinfo->output_width) * 3 != row_bytes) {
    std::snprintf(err->message, sizeof err->message, "libjpeg gives %d components of width %u, expected RGB",
                  cinfo->output_components, cinfo->output_width);
    return false;
  }
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = rgb + std::size_t(cinfo->output_scanline) * row_bytes;
    (void)jpeg_read_scanlines(cinfo, &row, 1);
  }
  (void)jpeg_finish_decompress(cinfo);
  return true;
}

Image decode_jpeg(std::span<const uint8_t> bytes, const std::string& name, const ImageReadOptions& o) {
  jpeg_decompress_struct cinfo;
  std::memset(&cinfo, 0, sizeof cinfo);  // jpeg_destroy of a struct never created is then a no-op
  JpegErrors err;
  std::memset(&err, 0, sizeof err);
  cinfo.err = jpeg_std_error(&err.mgr);
  err.mgr.error_exit = jpeg_on_error;
  err.mgr.emit_message = jpeg_on_message;
  struct Guard {
    jpeg_decompress_struct* cinfo;
    ~Guard() { jpeg_destroy_decompress(cinfo); }
  } guard{&cinfo};

  auto fail = [&](const char* stage) {
    if (err.truncated) SLIME_FAIL("JPEG image '", name, "' is truncated (", stage, "): ", err.message);
    SLIME_FAIL("JPEG image '", name, "' is corrupt (", stage, "): ", err.message);
  };
  JpegHeader h{};
  if (!jpeg_read_header_info(&cinfo, &err, bytes.data(), bytes.size(), &h)) fail("header");
  SLIME_CHECK(!h.cmyk, "JPEG image '", name,
              "' is CMYK/YCCK; slime decodes gray and YCbCr/RGB JPEGs only (convert "
              "it to RGB first)");
  check_size(h.height, h.width, o, name);
  Image img;
  img.height = h.height;
  img.width = h.width;
  img.rgb.resize(std::size_t(img.pixels()) * 3);
  if (!jpeg_read_pixels(&cinfo, &err, img.rgb.data(), std::size_t(img.width) * 3)) fail("pixel data");
  return img;
}

}  // namespace

Image decode_image(std::span<const uint8_t> bytes, const std::string& name, const ImageReadOptions& options) {
  switch (detect_image_format(bytes, name)) {
    case ImageFormat::kPng:
      return decode_png(bytes, name, options);
    case ImageFormat::kJpeg:
      return decode_jpeg(bytes, name, options);
  }
  SLIME_FAIL("image '", name, "': unknown format");
}

#endif  // SLIME_HAVE_IMAGES

Image read_image(const std::filesystem::path& path, const ImageReadOptions& options) {
  if (!images_supported()) return decode_image({}, path.string(), options);  // throws the "built without" error
  const std::vector<uint8_t> bytes = read_regular_file(path, options.max_file_bytes, "image");
  return decode_image(bytes, path.string(), options);
}

}  // namespace slime::data
