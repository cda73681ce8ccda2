// slime/data/qwen_vl_image.hpp: Qwen-VL image preprocessing (smart resize,
// bicubic resize, rescale, normalise, patchify to the vision tower's rows)
// and the expansion of image placeholders in a prompt, as transformers'
// Qwen3-VL processor does them.
//
// transformers preprocesses Qwen2-VL, Qwen2.5-VL and Qwen3-VL images with one
// image processor (qwen2_vl/image_processing_qwen2_vl.py); the models differ
// only in its configuration. QwenVLImageOptions defaults to Qwen3-VL's
// (Qwen/Qwen3-VL-2B-Instruct's preprocessor_config.json: patch 16, merge 2,
// temporal patch 2, pixels in [2^16, 2^24], mean = std = 0.5), and
// read_preprocessor_config() reads any of them.
//
// Which processor is matched: AutoImageProcessor picks the torchvision
// backend (Qwen2VLImageProcessor, "Fast" in the configs) whenever torchvision
// is installed, so that is the one slime reproduces. It resizes the uint8
// image with torch's antialiased bicubic (Keys a = -0.5, the filter widened
// by the scale when shrinking), which on uint8 CPU tensors runs in fixed
// point: weights rounded to int16 with a per-pass precision, a horizontal
// pass rounded to uint8, then a vertical pass rounded to uint8.
// resize_bicubic() does exactly that, and tests/data/test_images.cpp checks
// the whole pipeline against transformers' pixel_values (fixture made by
// tools/make_qwen3_vl_image_fixture.py; the measured difference is stated
// there and in docs/images.md). PIL's bicubic (transformers' "pil" backend)
// differs: it resamples a shrinking axis first and uses 22-bit weights, so
// its pixel_values differ by up to 13 uint8 levels at hard edges.
//
// pixel_values layout, per image, concatenated over images:
//   [grid_t * grid_h * grid_w, C * T * P * P]      C = 3, T = temporal_patch_size, P = patch_size
// rows ordered (block_row, block_col, r, c) with r, c in [0, merge): the
// merge x merge patches that the tower's patch merger fuses are consecutive;
// columns ordered (channel, t, y, x) within the P x P patch, the one frame
// repeated T times. An image is one temporal patch: grid_t = 1.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "slime/core/error.hpp"
#include "slime/core/json.hpp"
#include "slime/data/image.hpp"

namespace slime::data {

// The grid of one image or video in patches: frames / T, height / P, width / P.
struct GridTHW {
  int64_t t = 1, h = 0, w = 0;

  int64_t patches() const { return t * h * w; }  // rows of pixel_values
  // Tokens in the language model after the merge x merge patch merger.
  int64_t merged_tokens(int64_t merge_size) const { return patches() / (merge_size * merge_size); }
  bool operator==(const GridTHW&) const = default;
};

struct QwenVLImageOptions {
  int64_t patch_size = 16;
  int64_t merge_size = 2;
  int64_t temporal_patch_size = 2;
  int64_t min_pixels = int64_t(1) << 16;  // "size": {"shortest_edge"}: the resized image has at least this many
  int64_t max_pixels = int64_t(1) << 24;  // "size": {"longest_edge"}: ... and at most this many (see smart_resize)
  bool do_resize = true;
  bool do_rescale = true;
  bool do_normalize = true;
  double rescale_factor = 1.0 / 255.0;
  std::array<double, 3> image_mean{0.5, 0.5, 0.5};
  std::array<double, 3> image_std{0.5, 0.5, 0.5};

  // Both resized sides are multiples of this.
  int64_t factor() const { return patch_size * merge_size; }
  // Columns of pixel_values: C * T * P * P (1536 for Qwen3-VL).
  int64_t patch_dim() const { return 3 * temporal_patch_size * patch_size * patch_size; }

  void validate(const std::string& where = "QwenVLImageOptions") const {
    SLIME_CHECK(patch_size >= 1 && patch_size <= 1024, where, ": patch_size = ", patch_size, " must be in [1, 1024]");
    SLIME_CHECK(merge_size >= 1 && merge_size <= 64, where, ": merge_size = ", merge_size, " must be in [1, 64]");
    SLIME_CHECK(temporal_patch_size >= 1 && temporal_patch_size <= 64, where,
                ": temporal_patch_size = ", temporal_patch_size, " must be in [1, 64]");
    SLIME_CHECK(min_pixels >= 0 && max_pixels >= 1 && min_pixels <= max_pixels, where, ": min_pixels = ", min_pixels,
                " and max_pixels = ", max_pixels, " must satisfy 0 <= min_pixels <= max_pixels, max_pixels >= 1");
    SLIME_CHECK(max_pixels <= (int64_t(1) << 40), where, ": max_pixels = ", max_pixels, " exceeds 2^40");
    SLIME_CHECK(std::isfinite(rescale_factor) && rescale_factor > 0, where, ": rescale_factor = ", rescale_factor,
                " must be positive");
    for (int c = 0; c < 3; ++c) {
      SLIME_CHECK(std::isfinite(image_mean[c]), where, ": image_mean[", c, "] = ", image_mean[c], " is not finite");
      SLIME_CHECK(std::isfinite(image_std[c]) && image_std[c] != 0, where, ": image_std[", c, "] = ", image_std[c],
                  " must be finite and non-zero");
    }
  }

  // From a preprocessor_config.json object. Fields read (others ignored):
  // patch_size, merge_size, temporal_patch_size, size.{shortest_edge,
  // longest_edge}, min_pixels / max_pixels (older configs; they override
  // size, as in transformers), do_resize, do_rescale, do_normalize,
  // rescale_factor, image_mean, image_std, resample (3 = bicubic, the only
  // one supported), do_convert_rgb (must be true). Absent fields keep the
  // Qwen3-VL defaults; a present field of the wrong type or value is an error
  // naming `where` and the field.
  static QwenVLImageOptions from_json(const nlohmann::json& j, const std::string& where) {
    SLIME_CHECK(j.is_object(), where, ": a preprocessor config must be a JSON object, got ", j.type_name());
    QwenVLImageOptions o;
    auto integer = [&](const nlohmann::json& obj, const char* key, int64_t& out, const std::string& path) {
      auto it = obj.find(key);
      if (it == obj.end() || it->is_null()) return;
      SLIME_CHECK(it->is_number_integer(), where, ": '", path, "' must be an integer, got ", it->dump());
      out = it->get<int64_t>();
    };
    auto boolean = [&](const char* key, bool& out) {
      auto it = j.find(key);
      if (it == j.end() || it->is_null()) return;
      SLIME_CHECK(it->is_boolean(), where, ": '", key, "' must be true or false, got ", it->dump());
      out = it->get<bool>();
    };
    auto triple = [&](const char* key, std::array<double, 3>& out) {
      auto it = j.find(key);
      if (it == j.end() || it->is_null()) return;
      if (it->is_number()) {
        out.fill(it->get<double>());
        return;
      }
      SLIME_CHECK(it->is_array() && it->size() == 3, where, ": '", key, "' must be a number or 3 numbers, got ",
                  it->dump());
      for (int c = 0; c < 3; ++c) {
        SLIME_CHECK((*it)[c].is_number(), where, ": '", key, "'[", c, "] must be a number, got ",
                    json_excerpt((*it)[c]));
        out[c] = (*it)[c].get<double>();
      }
    };
    integer(j, "patch_size", o.patch_size, "patch_size");
    integer(j, "merge_size", o.merge_size, "merge_size");
    integer(j, "temporal_patch_size", o.temporal_patch_size, "temporal_patch_size");
    if (auto it = j.find("size"); it != j.end() && !it->is_null()) {
      SLIME_CHECK(it->is_object(), where, ": 'size' must be an object with shortest_edge and longest_edge, got ",
                  it->dump());
      SLIME_CHECK(it->contains("shortest_edge") && it->contains("longest_edge"), where,
                  ": 'size' must have shortest_edge and longest_edge (min and max pixels), got ", it->dump());
      integer(*it, "shortest_edge", o.min_pixels, "size.shortest_edge");
      integer(*it, "longest_edge", o.max_pixels, "size.longest_edge");
    }
    integer(j, "min_pixels", o.min_pixels, "min_pixels");
    integer(j, "max_pixels", o.max_pixels, "max_pixels");
    boolean("do_resize", o.do_resize);
    boolean("do_rescale", o.do_rescale);
    boolean("do_normalize", o.do_normalize);
    if (auto it = j.find("rescale_factor"); it != j.end() && !it->is_null()) {
      SLIME_CHECK(it->is_number(), where, ": 'rescale_factor' must be a number, got ", it->dump());
      o.rescale_factor = it->get<double>();
    }
    triple("image_mean", o.image_mean);
    triple("image_std", o.image_std);
    int64_t resample = 3;
    integer(j, "resample", resample, "resample");
    SLIME_CHECK(resample == 3, where, ": 'resample' = ", resample, " is not supported; slime resizes bicubic (3)");
    bool convert_rgb = true;
    boolean("do_convert_rgb", convert_rgb);
    SLIME_CHECK(convert_rgb, where, ": 'do_convert_rgb' = false is not supported; images are decoded to RGB");
    o.validate(where);
    return o;
  }
};

// Reads preprocessor_config.json (a file, or a model directory holding one).
inline QwenVLImageOptions read_preprocessor_config(const std::filesystem::path& path) {
  std::filesystem::path file = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) file = path / "preprocessor_config.json";
  const std::vector<uint8_t> bytes = read_regular_file(file, int64_t(1) << 24, "preprocessor config");
  const nlohmann::json j = parse_json(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                      "preprocessor config '" + file.string() + "'");
  return QwenVLImageOptions::from_json(j, "preprocessor config '" + file.string() + "'");
}

struct ImageSize {
  int64_t height = 0, width = 0;
  bool operator==(const ImageSize&) const = default;
};

namespace detail {

// Python's round() of a double: to nearest, ties to even.
inline double round_half_even(double x) {
  const double r = std::round(x);  // ties away from zero
  if (std::abs(x - std::trunc(x)) == 0.5) return 2.0 * std::round(x / 2.0);
  return r;
}

}  // namespace detail

// The size an image of height x width is resized to, with transformers'
// smart_resize arithmetic (double precision, Python's rounding):
//   h, w = round(height / f) * f, round(width / f) * f       (ties to even)
//   if h * w > max_pixels:  beta = sqrt(height * width / max_pixels)
//                           h, w = max(f, floor(height / beta / f) * f), ...
//   elif h * w < min_pixels: beta = sqrt(min_pixels / (height * width))
//                           h, w = ceil(height * beta / f) * f, ...
// Aspect ratios above 200 are refused, as transformers refuses them. The
// result can exceed max_pixels (both sides at their minimum f) or fall below
// min_pixels only where transformers' does too.
inline ImageSize smart_resize(int64_t height, int64_t width, int64_t factor, int64_t min_pixels, int64_t max_pixels) {
  SLIME_CHECK(height > 0 && width > 0, "smart_resize: image size ", height, "x", width, " must be positive");
  SLIME_CHECK(factor > 0, "smart_resize: factor = ", factor, " must be positive");
  SLIME_CHECK(height <= (int64_t(1) << 26) && width <= (int64_t(1) << 26), "smart_resize: image size ", height, "x",
              width, " exceeds 2^26 on a side");
  const double ratio = double(std::max(height, width)) / double(std::min(height, width));
  SLIME_CHECK(ratio <= 200.0, "smart_resize: image ", height, "x", width, " (height x width) has aspect ratio ", ratio,
              "; Qwen-VL's processor refuses aspect ratios above 200");
  const double f = double(factor);
  int64_t h = int64_t(detail::round_half_even(double(height) / f)) * factor;
  int64_t w = int64_t(detail::round_half_even(double(width) / f)) * factor;
  if (h * w > max_pixels) {
    const double beta = std::sqrt(double(height * width) / double(max_pixels));
    h = std::max(factor, int64_t(std::floor(double(height) / beta / f)) * factor);
    w = std::max(factor, int64_t(std::floor(double(width) / beta / f)) * factor);
  } else if (h * w < min_pixels) {
    const double beta = std::sqrt(double(min_pixels) / double(height * width));
    h = int64_t(std::ceil(double(height) * beta / f)) * factor;
    w = int64_t(std::ceil(double(width) * beta / f)) * factor;
  }
  SLIME_CHECK(h > 0 && w > 0, "smart_resize: image ", height, "x", width, " resizes to ", h, "x", w, " with factor ",
              factor, " and min_pixels = ", min_pixels, "; raise min_pixels");
  return {h, w};
}

namespace detail {

// Keys' cubic convolution kernel with a = -0.5 (torch's and PIL's antialiased
// bicubic), support [-2, 2].
inline double bicubic_filter(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a;
  return 0.0;
}

// One separable pass of antialiased bicubic from `in` to `out` samples: for
// output i, taps [first[i], first[i] + count[i]) with int16 weights
// weights[i * taps + j] scaled by 2^precision. Double-precision weights as
// torch computes them (_compute_indices_min_size_weights_aa), then rounded
// to int16 with the largest precision (< 22 bits) that keeps the largest
// weight below 2^15 (_compute_index_ranges_int16_weights).
struct ResampleTaps {
  std::vector<int64_t> first, count;
  std::vector<int32_t> weights;  // [out, taps], int16 values
  int64_t taps = 0;
  int precision = 0;

  ResampleTaps(int64_t in, int64_t out) : first(std::size_t(out)), count(std::size_t(out)) {
    const double scale = double(in) / double(out);
    const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
    const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    taps = int64_t(std::ceil(support)) * 2 + 1;
    std::vector<double> w(std::size_t(out * taps), 0.0);
    double w_max = 0.0;
    for (int64_t i = 0; i < out; ++i) {
      const double center = scale * (double(i) + 0.5);
      const int64_t lo = std::max(int64_t(center - support + 0.5), int64_t(0));
      const int64_t n = std::clamp(std::min(int64_t(center + support + 0.5), in) - lo, int64_t(0), taps);
      double* wi = w.data() + i * taps;
      double total = 0.0;
      for (int64_t j = 0; j < n; ++j) {
        wi[j] = bicubic_filter((double(j + lo) - center + 0.5) * invscale);
        total += wi[j];
      }
      if (total != 0.0)
        for (int64_t j = 0; j < n; ++j) {
          wi[j] /= total;
          w_max = std::max(w_max, wi[j]);
        }
      first[std::size_t(i)] = lo;
      count[std::size_t(i)] = n;
    }
    for (precision = 0; precision < 22; ++precision)
      if (int(0.5 + w_max * double(1 << (precision + 1))) >= (1 << 15)) break;
    SLIME_CHECK(precision >= 1, "resize_bicubic: no int16 precision for weights up to ", w_max);
    weights.resize(w.size());
    for (std::size_t k = 0; k < w.size(); ++k) {
      const double v = w[k] * double(1 << precision);
      weights[k] = v < 0 ? int32_t(-0.5 + v) : int32_t(0.5 + v);
    }
  }

  // Output sample i from samples src[0], src[stride], ... (uint8).
  uint8_t apply(const uint8_t* src, int64_t stride, int64_t i) const {
    const int32_t* wi = weights.data() + i * taps;
    const uint8_t* s = src + first[std::size_t(i)] * stride;
    int32_t acc = int32_t(1) << (precision - 1);
    for (int64_t j = 0; j < count[std::size_t(i)]; ++j) acc += int32_t(s[j * stride]) * wi[j];
    return uint8_t(std::clamp(acc >> precision, 0, 255));
  }
};

}  // namespace detail

// Resizes an RGB image to height x width with torch's antialiased bicubic on
// uint8 (what torchvision's resize does to a uint8 CPU image, as transformers'
// Qwen-VL processor calls it): horizontal pass, rounded to uint8, then the
// vertical pass; a side of unchanged length is not resampled. Deterministic.
inline Image resize_bicubic(const Image& src, int64_t height, int64_t width) {
  SLIME_CHECK(src.height > 0 && src.width > 0 && std::size_t(src.pixels()) * 3 == src.rgb.size(),
              "resize_bicubic: source image ", src.height, "x", src.width, " holds ", src.rgb.size(),
              " bytes, expected height * width * 3");
  SLIME_CHECK(height > 0 && width > 0 && height <= (int64_t(1) << 20) && width <= (int64_t(1) << 20),
              "resize_bicubic: target size ", height, "x", width, " must be in [1, 2^20] on each side");
  if (height == src.height && width == src.width) return src;
  Image mid;  // [src.height, width, 3]
  if (width != src.width) {
    const detail::ResampleTaps taps(src.width, width);
    mid.height = src.height;
    mid.width = width;
    mid.rgb.resize(std::size_t(mid.pixels()) * 3);
    for (int64_t y = 0; y < src.height; ++y) {
      const uint8_t* row = src.rgb.data() + y * src.width * 3;
      uint8_t* out = mid.rgb.data() + y * width * 3;
      for (int64_t x = 0; x < width; ++x)
        for (int c = 0; c < 3; ++c) out[x * 3 + c] = taps.apply(row + c, 3, x);
    }
  } else {
    mid = src;
  }
  if (height == mid.height) return mid;
  const detail::ResampleTaps taps(mid.height, height);
  Image dst;
  dst.height = height;
  dst.width = width;
  dst.rgb.resize(std::size_t(dst.pixels()) * 3);
  const int64_t stride = width * 3;
  for (int64_t y = 0; y < height; ++y)
    for (int64_t k = 0; k < stride; ++k)
      dst.rgb[std::size_t(y * stride + k)] = taps.apply(mid.rgb.data() + k, stride, y);
  return dst;
}

// The preprocessed images of one sample (or batch): the vision tower's input.
struct VisionInput {
  int64_t patch_dim = 0;            // C * T * P * P
  std::vector<float> pixel_values;  // [rows(), patch_dim], images one after another
  std::vector<GridTHW> grid_thw;    // one per image, in order

  int64_t rows() const { return patch_dim == 0 ? 0 : int64_t(pixel_values.size()) / patch_dim; }
};

// Appends one image's rows and grid to `out` (see the layout at the top).
// The per-channel arithmetic is torchvision's, in float32: with rescale and
// normalise (x - m) / s where m = float(mean) * float(1 / rescale_factor) and
// s likewise (transformers fuses the two), with only one of them x * factor
// or (x - mean) / std.
inline void append_image(VisionInput& out, const Image& image, const QwenVLImageOptions& o) {
  o.validate();
  SLIME_CHECK(out.patch_dim == 0 || out.patch_dim == o.patch_dim(), "append_image: the VisionInput has patch_dim ",
              out.patch_dim, " but these options give ", o.patch_dim());
  const int64_t P = o.patch_size, M = o.merge_size, T = o.temporal_patch_size, f = o.factor();
  ImageSize size{image.height, image.width};
  if (o.do_resize) size = smart_resize(image.height, image.width, f, o.min_pixels, o.max_pixels);
  SLIME_CHECK(size.height % f == 0 && size.width % f == 0, "append_image: an image of ", size.height, "x", size.width,
              " is not a multiple of patch_size * merge_size = ", f, " on both sides (do_resize = false)");
  const Image resized = o.do_resize ? resize_bicubic(image, size.height, size.width) : image;
  SLIME_CHECK(std::size_t(resized.pixels()) * 3 == resized.rgb.size(), "append_image: image ", resized.height, "x",
              resized.width, " holds ", resized.rgb.size(), " bytes, expected height * width * 3");

  // The value of each uint8 level per channel, computed once.
  std::array<std::array<float, 256>, 3> lut{};
  for (int c = 0; c < 3; ++c)
    for (int v = 0; v < 256; ++v) {
      const float x = float(v);
      if (o.do_rescale && o.do_normalize) {
        const float inv = float(1.0 / o.rescale_factor);
        lut[c][v] = (x - float(o.image_mean[c]) * inv) / (float(o.image_std[c]) * inv);
      } else if (o.do_normalize) {
        lut[c][v] = (x - float(o.image_mean[c])) / float(o.image_std[c]);
      } else if (o.do_rescale) {
        lut[c][v] = x * float(o.rescale_factor);
      } else {
        lut[c][v] = x;
      }
    }

  const GridTHW grid{1, resized.height / P, resized.width / P};
  const int64_t dim = o.patch_dim();
  out.patch_dim = dim;
  const std::size_t base = out.pixel_values.size();
  out.pixel_values.resize(base + std::size_t(grid.patches() * dim));
  float* row = out.pixel_values.data() + base;
  for (int64_t bh = 0; bh < grid.h / M; ++bh)
    for (int64_t bw = 0; bw < grid.w / M; ++bw)
      for (int64_t mh = 0; mh < M; ++mh)
        for (int64_t mw = 0; mw < M; ++mw, row += dim) {
          const int64_t y0 = (bh * M + mh) * P, x0 = (bw * M + mw) * P;
          float* col = row;
          for (int c = 0; c < 3; ++c)
            for (int64_t t = 0; t < T; ++t)
              for (int64_t py = 0; py < P; ++py)
                for (int64_t px = 0; px < P; ++px) *col++ = lut[c][resized.at(y0 + py, x0 + px, c)];
        }
  out.grid_thw.push_back(grid);
}

// All images of one sample, in order.
inline VisionInput preprocess_images(std::span<const Image> images, const QwenVLImageOptions& o) {
  VisionInput out;
  out.patch_dim = o.patch_dim();
  for (const Image& image : images) append_image(out, image, o);
  return out;
}

// The special token ids of a Qwen-VL model (its config.json: image_token_id,
// vision_start_token_id, vision_end_token_id; Qwen3-VL's are 151655, 151652
// and 151653, but take them from the checkpoint).
struct VisionTokenIds {
  int32_t image_token_id = -1;
  int32_t vision_start_token_id = -1;
  int32_t vision_end_token_id = -1;
};

// Expands each image placeholder of a tokenised prompt,
//   <|vision_start|> <|image_pad|> <|vision_end|>,
// into <|vision_start|>, grid.t * grid.h * grid.w / merge_size^2 copies of
// <|image_pad|>, <|vision_end|>, taking the grids in order (what the
// Qwen3-VL processor does to the text before tokenising). Errors: the number
// of placeholders differs from the number of grids; an image token not
// directly between vision_start and vision_end (a prompt already expanded,
// or a stray token); a grid whose patch count merge_size^2 does not divide.
inline std::vector<int32_t> expand_image_placeholders(std::span<const int32_t> tokens, std::span<const GridTHW> grids,
                                                      int64_t merge_size, const VisionTokenIds& ids) {
  SLIME_CHECK(ids.image_token_id >= 0 && ids.vision_start_token_id >= 0 && ids.vision_end_token_id >= 0,
              "expand_image_placeholders: token ids must be set (image ", ids.image_token_id, ", vision_start ",
              ids.vision_start_token_id, ", vision_end ", ids.vision_end_token_id, ")");
  SLIME_CHECK(merge_size >= 1, "expand_image_placeholders: merge_size = ", merge_size, " must be >= 1");
  const int64_t placeholders = std::count(tokens.begin(), tokens.end(), ids.image_token_id);
  SLIME_CHECK(placeholders == int64_t(grids.size()), "expand_image_placeholders: the prompt has ", placeholders,
              " image placeholders (token ", ids.image_token_id, ") but ", grids.size(), " images were given");
  std::size_t total = tokens.size();
  for (std::size_t k = 0; k < grids.size(); ++k) {
    const GridTHW& g = grids[k];
    SLIME_CHECK(g.t > 0 && g.h > 0 && g.w > 0 && g.patches() % (merge_size * merge_size) == 0,
                "expand_image_placeholders: image ", k, " has grid_thw (", g.t, ", ", g.h, ", ", g.w,
                "), whose patch count is not a positive multiple of merge_size^2 = ", merge_size * merge_size);
    total += std::size_t(g.merged_tokens(merge_size)) - 1;
  }
  std::vector<int32_t> out;
  out.reserve(total);
  std::size_t image = 0;
  for (std::size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] != ids.image_token_id) {
      out.push_back(tokens[i]);
      continue;
    }
    const bool framed = i > 0 && tokens[i - 1] == ids.vision_start_token_id && i + 1 < tokens.size() &&
                        tokens[i + 1] == ids.vision_end_token_id;
    SLIME_CHECK(framed, "expand_image_placeholders: image token ", ids.image_token_id, " at position ", i,
                " is not directly between vision_start (", ids.vision_start_token_id, ") and vision_end (",
                ids.vision_end_token_id, "); is the prompt already expanded?");
    out.insert(out.end(), std::size_t(grids[image].merged_tokens(merge_size)), ids.image_token_id);
    ++image;
  }
  return out;
}

}  // namespace slime::data
