// shapes_task.hpp (qwen3_vl_rl example): a synthetic image task the example
// draws itself, and its verifier.
//
// Each prompt is one small RGB image (side x side pixels, grey background
// with noise) holding 1 to 4 filled shapes (squares and discs, radius 2 to
// side / 8, never overlapping), followed by a question token:
//   colour  all shapes share one of 4 colours; answer: the colour's token
//   count   shapes of random colours; answer: the count's token
// The model answers with one token, then EOS. Reward 1 when the first
// generated token is the answer, else 0 (a float label is never involved:
// answers are token ids).
//
// Tokens (a vocabulary of 64): 0 pad, 1 EOS, 2 / 3 the colour / count
// questions, 10..13 the colours (red, green, blue, yellow), 20..23 the
// counts 1..4, 60 image pad, 61 vision start, 62 vision end, 63 video pad.
// A prompt is [vision_start, image_pad x merged patches, vision_end, question].
//
// Everything is a function of (seed, prompt index): a prompt is the same on
// every rank and in every run.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "slime/core/error.hpp"
#include "slime/core/random.hpp"
#include "slime/data/image.hpp"
#include "slime/data/qwen_vl_image.hpp"

namespace vl_example {

using namespace slime;

struct ShapesVocab {
  static constexpr int32_t kPad = 0, kEos = 1, kAskColour = 2, kAskCount = 3;
  static constexpr int32_t kColour0 = 10, kCount1 = 20;
  static constexpr int32_t kImagePad = 60, kVisionStart = 61, kVisionEnd = 62, kVideoPad = 63;
  static constexpr int64_t kSize = 64;
};

enum class ShapesQuestion { colour, count };

struct ShapesPrompt {
  std::vector<int32_t> tokens;  // the prompt, placeholders expanded
  data::VisionInput image;      // its one image's pixel rows and grid
  int32_t answer = 0;           // the token that earns reward 1
  data::Image picture;          // the drawn image (for inspection)
};

class ShapesTask {
 public:
  // side: the image's side in pixels, a multiple of patch_size * merge_size.
  ShapesTask(ShapesQuestion question, int64_t side, data::QwenVLImageOptions image_options)
      : question_(question), side_(side), options_(image_options) {
    options_.do_resize = false;  // drawn at the tower's grid already
    options_.validate();
    SLIME_CHECK(side > 0 && side % options_.factor() == 0, "ShapesTask: side ", side,
                " must be a positive multiple of patch_size * merge_size = ", options_.factor());
  }

  int64_t merged_tokens() const {
    const int64_t g = side_ / options_.patch_size;
    return g * g / (options_.merge_size * options_.merge_size);
  }

  ShapesPrompt prompt(uint64_t seed, uint64_t index) const {
    Draw rng{seed, index};
    ShapesPrompt p;
    const int count = 1 + int(rng.below(4));
    const int colour = int(rng.below(4));
    p.picture = draw(rng, count, colour);
    data::append_image(p.image, p.picture, options_);
    p.tokens.push_back(ShapesVocab::kVisionStart);
    p.tokens.insert(p.tokens.end(), std::size_t(merged_tokens()), ShapesVocab::kImagePad);
    p.tokens.push_back(ShapesVocab::kVisionEnd);
    p.tokens.push_back(question_ == ShapesQuestion::colour ? ShapesVocab::kAskColour : ShapesVocab::kAskCount);
    p.answer = question_ == ShapesQuestion::colour ? ShapesVocab::kColour0 + colour : ShapesVocab::kCount1 + count - 1;
    return p;
  }

  static double reward(const ShapesPrompt& p, const std::vector<int32_t>& response) {
    return !response.empty() && response.front() == p.answer ? 1.0 : 0.0;
  }

 private:
  // Counter-based draws: word k of the Philox stream whose key mixes the
  // seed and the prompt index.
  struct Draw {
    uint64_t seed, index;
    uint64_t k = 0;
    uint32_t next() { return philox_word(seed ^ (index * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull), k++); }
    uint32_t below(uint32_t n) { return next() % n; }
  };

  data::Image draw(Draw& rng, int count, int colour) const {
    static constexpr std::array<std::array<uint8_t, 3>, 4> kRgb = {
        {{220, 40, 40}, {40, 180, 60}, {50, 80, 220}, {230, 210, 40}}};
    data::Image img;
    img.height = img.width = side_;
    img.rgb.resize(std::size_t(side_ * side_ * 3));
    for (auto& v : img.rgb) v = uint8_t(110 + rng.below(30));  // grey with noise
    struct Placed {
      int64_t y, x, r;
    };
    std::vector<Placed> placed;
    const int64_t max_r = std::max<int64_t>(2, side_ / 8);
    for (int s = 0; s < count; ++s) {
      for (int attempt = 0; attempt < 200; ++attempt) {
        const int64_t r = 2 + int64_t(rng.below(uint32_t(max_r - 1)));
        const int64_t y = r + int64_t(rng.below(uint32_t(side_ - 2 * r))),
                      x = r + int64_t(rng.below(uint32_t(side_ - 2 * r)));
        const bool clear = std::all_of(placed.begin(), placed.end(), [&](const Placed& o) {
          return std::max(std::abs(o.y - y), std::abs(o.x - x)) > o.r + r + 1;
        });
        if (!clear) continue;
        placed.push_back({y, x, r});
        const bool disc = rng.below(2) == 1;
        const auto& rgb = kRgb[std::size_t(question_ == ShapesQuestion::colour ? colour : int(rng.below(4)))];
        for (int64_t dy = -r; dy <= r; ++dy)
          for (int64_t dx = -r; dx <= r; ++dx) {
            if (disc && dy * dy + dx * dx > r * r) continue;
            for (int c = 0; c < 3; ++c)
              img.rgb[std::size_t(((y + dy) * side_ + (x + dx)) * 3 + c)] = rgb[std::size_t(c)];
          }
        break;
      }
    }
    SLIME_CHECK(int(placed.size()) == count, "ShapesTask: could not place ", count, " shapes on a ", side_, "x", side_,
                " image");
    return img;
  }

  ShapesQuestion question_;
  int64_t side_;
  data::QwenVLImageOptions options_;
};

}  // namespace vl_example
