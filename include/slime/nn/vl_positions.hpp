// slime/nn/vl_positions.hpp: the rotary positions of Qwen3-VL, on the host.
//
// The language model rotates q and k by three positions per token (t, h, w)
// through interleaved MRoPE (ops::RopeSpec::mrope); the vision tower by two
// per patch (row, col) through its 2-D rotary (ops::RopeSpec::vision).
//
// mrope_positions: transformers' Qwen3VLModel.get_rope_index for images, one
// sequence at a time. Text tokens get t = h = w = the running text position;
// an image's run of image-pad tokens (grid t x h x w patches, merged by m x m:
// t * (h/m) * (w/m) tokens in row-major order of the merged grid) gets
//   (s + ti, s + hi, s + wi),  s = the position after the preceding text,
// and the text after it resumes at max(previous) + 1. A text-only sequence is
// 0, 1, 2, ... on every axis (the text rotary's positions). next_position is
// max + 1: where decoding continues (every axis), transformers' rope delta
// being next_position - tokens.
//
// vision_patch_positions: (row, col) of each patch in the order the
// processor emits them (per image, per temporal patch, merge blocks in
// row-major order, the m x m patches of a block row-major), transformers'
// Qwen3VLVisionModel.rot_pos_emb.
//
// Errors (never a silent misplacement): a run of image-pad tokens whose
// length is not its image's merged patch count, more or fewer runs than
// images, a grid side not divisible by the merge size, sizes that overflow
// the i32 positions.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "slime/core/error.hpp"

namespace slime::nn {

// grid_thw of one image or video: temporal, height and width in patches
// (before merging), as the processor's image_grid_thw.
using GridThw = std::array<int64_t, 3>;

struct MropePositions {
  std::vector<int32_t> positions;  // [tokens, 3]: (t, h, w) per token, row-major
  int32_t next_position = 0;       // max over every axis + 1 (0 for no tokens)
};

namespace detail {

inline void check_grid(const GridThw& g, int64_t merge, std::size_t index) {
  SLIME_CHECK(g[0] > 0 && g[1] > 0 && g[2] > 0, "image ", index, ": grid_thw [", g[0], ", ", g[1], ", ", g[2],
              "] must be positive");
  SLIME_CHECK(g[1] % merge == 0 && g[2] % merge == 0, "image ", index, ": grid_thw [", g[0], ", ", g[1], ", ", g[2],
              "] is not divisible by the spatial merge size ", merge);
  SLIME_CHECK(g[0] <= (int64_t(1) << 20) && g[1] <= (int64_t(1) << 20) && g[2] <= (int64_t(1) << 20) &&
                  g[0] * g[1] * g[2] <= (int64_t(1) << 31) - 1,
              "image ", index, ": grid_thw [", g[0], ", ", g[1], ", ", g[2], "] is too large");
}

}  // namespace detail

// The (t, h, w) positions of one sequence `ids` whose images, in order, have
// `grids` (patches before merging); image_token_id marks the image-pad tokens
// before `text_from` (the prompt's length, for a prompt + completion): a
// completion's tokens are text whatever their id, as the engine decoded them.
inline MropePositions mrope_positions(std::span<const int32_t> ids, std::span<const GridThw> grids,
                                      int32_t image_token_id, int64_t spatial_merge_size,
                                      std::size_t text_from = std::size_t(-1)) {
  SLIME_CHECK(spatial_merge_size > 0, "mrope_positions: spatial_merge_size must be positive, got ", spatial_merge_size);
  SLIME_CHECK(ids.size() <= std::size_t(INT32_MAX), "mrope_positions: ", ids.size(), " tokens are too many");
  MropePositions out;
  out.positions.reserve(ids.size() * 3);
  int64_t next = 0;  // the next text position
  std::size_t image = 0, t = 0;
  const auto check_pos = [&](int64_t p) {
    SLIME_CHECK(p < INT32_MAX, "mrope_positions: position ", p, " overflows i32");
    return int32_t(p);
  };
  while (t < ids.size()) {
    if (ids[t] != image_token_id || t >= text_from) {
      const int32_t p = check_pos(next++);
      out.positions.insert(out.positions.end(), {p, p, p});
      ++t;
      continue;
    }
    std::size_t run = 0;
    while (t + run < ids.size() && t + run < text_from && ids[t + run] == image_token_id) ++run;
    SLIME_CHECK(image < grids.size(), "mrope_positions: the sequence has more image-pad runs than the ", grids.size(),
                " images given (run ", image, " at token ", t, ")");
    const GridThw& g = grids[image];
    detail::check_grid(g, spatial_merge_size, image);
    const int64_t gt = g[0], gh = g[1] / spatial_merge_size, gw = g[2] / spatial_merge_size;
    SLIME_CHECK(int64_t(run) == gt * gh * gw, "mrope_positions: image ", image, " (grid_thw [", g[0], ", ", g[1], ", ",
                g[2], "], merge ", spatial_merge_size, ") needs ", gt * gh * gw, " image-pad tokens, the sequence has ",
                run, " at token ", t);
    int64_t top = next - 1;
    for (int64_t a = 0; a < gt; ++a)
      for (int64_t b = 0; b < gh; ++b)
        for (int64_t c = 0; c < gw; ++c) {
          out.positions.insert(out.positions.end(), {check_pos(next + a), check_pos(next + b), check_pos(next + c)});
          top = std::max({top, next + a, next + b, next + c});
        }
    next = top + 1;
    t += run;
    ++image;
  }
  SLIME_CHECK(image == grids.size(), "mrope_positions: ", grids.size(), " images given, the sequence has ", image,
              " image-pad runs");
  out.next_position = check_pos(next);
  return out;
}

// (row, col) of every patch of `grids`, in the processor's order:
// [sum t*h*w, 2] row-major.
inline std::vector<int32_t> vision_patch_positions(std::span<const GridThw> grids, int64_t spatial_merge_size) {
  SLIME_CHECK(spatial_merge_size > 0, "vision_patch_positions: spatial_merge_size must be positive, got ",
              spatial_merge_size);
  std::vector<int32_t> out;
  const int64_t m = spatial_merge_size;
  for (std::size_t i = 0; i < grids.size(); ++i) {
    const GridThw& g = grids[i];
    detail::check_grid(g, m, i);
    for (int64_t f = 0; f < g[0]; ++f)
      for (int64_t br = 0; br < g[1] / m; ++br)
        for (int64_t bc = 0; bc < g[2] / m; ++bc)
          for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < m; ++c) {
              out.push_back(int32_t(br * m + r));
              out.push_back(int32_t(bc * m + c));
            }
  }
  return out;
}

}  // namespace slime::nn
