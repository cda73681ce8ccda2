// slime/data/image.hpp: PNG and JPEG files decoded to 8-bit RGB (libpng,
// libjpeg-turbo), with errors that name the file.
//
// What a decoded image holds, per source kind, chosen so that an image reaches
// the Qwen-VL preprocessing (data/qwen_vl_image.hpp) as transformers' processor
// sees a PIL image of the same file (`convert_to_rgb` of transformers'
// image_transforms, which composites transparency over white):
//   PNG gray, gray+alpha, RGB, RGBA, palette (with or without tRNS), 1/2/4/8/16
//     bits, interlaced or not: channels expanded to RGB; 16-bit samples keep
//     their high byte (PIL's "RGB;16B"; note PIL clips 16-bit *gray* to 255
//     instead, a PIL quirk slime does not copy); alpha, and tRNS transparency,
//     composited over white exactly as PIL's alpha_composite rounds it
//     (Alpha::kOverWhite, the default) or ignored (Alpha::kIgnore, what
//     PIL's convert("RGB") does).
//   JPEG gray or YCbCr: converted to RGB by libjpeg (ISLOW IDCT, fancy
//     upsampling: PIL's defaults). CMYK / YCCK JPEGs are refused.
//   EXIF orientation is not applied (transformers does not apply it to an
//     image given as a PIL image either).
//
// Errors (slime::Error, the message names the file): missing or unreadable
// file, not a regular file (directory, FIFO, device: checked with stat before
// opening, and opened non-blocking so a FIFO never hangs), empty, larger than
// max_file_bytes, neither PNG nor JPEG (by content, not by extension),
// truncated, corrupt, more than max_pixels pixels or a side longer than
// max_side. libpng and libjpeg report errors through callbacks that longjmp
// back into small C-style functions with only trivially destructible locals,
// so no C++ frame is ever skipped, and nothing calls exit().
//
// Builds without libpng or libjpeg (SLIME_WITH_IMAGES=AUTO and neither found,
// or OFF) keep this API: images_supported() is false and every decode throws
// "slime was built without libpng/libjpeg".
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

namespace slime::data {

// An 8-bit RGB image, rows top to bottom, pixels left to right.
struct Image {
  int64_t height = 0;
  int64_t width = 0;
  std::vector<uint8_t> rgb;  // [height, width, 3]

  int64_t pixels() const { return height * width; }
  uint8_t at(int64_t y, int64_t x, int c) const { return rgb[std::size_t((y * width + x) * 3 + c)]; }
};

enum class ImageFormat { kPng, kJpeg };

struct ImageReadOptions {
  enum class Alpha {
    kOverWhite,  // composite over opaque white, as transformers' convert_to_rgb does
    kIgnore,     // drop alpha, as PIL's convert("RGB") does
  };
  Alpha alpha = Alpha::kOverWhite;
  // Refuse images with more pixels than this (PIL refuses about 1.8e8), or a
  // side longer than max_side, before allocating anything for their pixels.
  int64_t max_pixels = int64_t(1) << 28;
  int64_t max_side = int64_t(1) << 16;
  // Refuse files larger than this before reading them.
  int64_t max_file_bytes = int64_t(1) << 30;
};

// True when this build decodes images (libpng and libjpeg were found).
bool images_supported();

// The format of an encoded image from its first bytes; throws naming `name`
// (and the format, for GIF, WebP, BMP and TIFF) when it is neither PNG nor JPEG.
ImageFormat detect_image_format(std::span<const uint8_t> bytes, const std::string& name);

// Decodes PNG or JPEG bytes; `name` (a path, an archive member) is what errors
// name.
Image decode_image(std::span<const uint8_t> bytes, const std::string& name, const ImageReadOptions& options = {});

// Reads and decodes the file at `path`.
Image read_image(const std::filesystem::path& path, const ImageReadOptions& options = {});

// The bytes of a regular file, with read_image's checks (regular file, not
// empty, at most max_file_bytes); `what` names the file's kind in errors
// ("image").
std::vector<uint8_t> read_regular_file(const std::filesystem::path& path, int64_t max_file_bytes,
                                       const char* what = "image");

}  // namespace slime::data
