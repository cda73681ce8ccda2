// Qwen3-VL's rotary positions (slime/nn/vl_positions.hpp): hand-worked
// sequences in transformers' get_rope_index / rot_pos_emb conventions, the
// golden fixture's position_ids (tests/nn/data/qwen3_vl_tiny, written by
// tools/make_qwen3_vl_golden.py from transformers' get_rope_index), and every
// error.
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "slime/io/safetensors.hpp"
#include "slime/nn/vl_positions.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;

namespace {

constexpr int32_t kText = 11, kStart = 151652, kEnd = 151653, kImage = 151655;

// (t, h, w) triples, flattened.
std::vector<int32_t> triples(std::initializer_list<std::array<int32_t, 3>> xs) {
  std::vector<int32_t> out;
  for (const auto& x : xs) out.insert(out.end(), x.begin(), x.end());
  return out;
}

std::vector<int32_t> with_image(std::vector<int32_t> ids, int64_t pads) {
  ids.push_back(kStart);
  for (int64_t i = 0; i < pads; ++i) ids.push_back(kImage);
  ids.push_back(kEnd);
  return ids;
}

}  // namespace

TEST_CASE("text-only sequences get 0, 1, 2, ... on every axis", "[nn][vl]") {
  const std::vector<int32_t> ids = {kText, kText, kText, kText};
  const nn::MropePositions p = nn::mrope_positions(ids, {}, kImage, 2);
  CHECK(p.positions == triples({{0, 0, 0}, {1, 1, 1}, {2, 2, 2}, {3, 3, 3}}));
  CHECK(p.next_position == 4);
  const nn::MropePositions empty = nn::mrope_positions({}, {}, kImage, 2);
  CHECK(empty.positions.empty());
  CHECK(empty.next_position == 0);
}

TEST_CASE("an image's tokens take (s, s + row, s + col) of its merged grid, text resumes after its max", "[nn][vl]") {
  // Two text tokens, an image of 1 x 4 x 6 patches (merge 2: 2 x 3 tokens),
  // one text token after <|vision_end|>.
  std::vector<int32_t> ids = with_image({kText, kText}, 6);
  ids.push_back(kText);
  const std::vector<nn::GridThw> grids = {{1, 4, 6}};
  const nn::MropePositions p = nn::mrope_positions(ids, grids, kImage, 2);
  CHECK(p.positions == triples({{0, 0, 0},
                                {1, 1, 1},
                                {2, 2, 2},  // <|vision_start|>
                                {3, 3, 3},
                                {3, 3, 4},
                                {3, 3, 5},
                                {3, 4, 3},
                                {3, 4, 4},
                                {3, 4, 5},
                                {6, 6, 6},  // <|vision_end|>: max 5 + 1
                                {7, 7, 7}}));
  CHECK(p.next_position == 8);
}

TEST_CASE("several images, a tall one and one at the very start, each in order", "[nn][vl]") {
  // Image 0 at token 1 (after <|vision_start|>): 1 x 6 x 2 (3 x 1 tokens);
  // image 1 right after image 0's <|vision_end|>: 1 x 2 x 2 (1 token).
  std::vector<int32_t> ids = with_image({}, 3);
  ids = with_image(ids, 1);
  const std::vector<nn::GridThw> grids = {{1, 6, 2}, {1, 2, 2}};
  const nn::MropePositions p = nn::mrope_positions(ids, grids, kImage, 2);
  CHECK(p.positions == triples({{0, 0, 0},
                                {1, 1, 1},
                                {1, 2, 1},
                                {1, 3, 1},
                                {4, 4, 4},  // image 0's max is 3
                                {5, 5, 5},
                                {6, 6, 6},
                                {7, 7, 7}}));
  CHECK(p.next_position == 8);
}

TEST_CASE("a temporal grid counts frames on the t axis", "[nn][vl]") {
  const std::vector<int32_t> ids = {kImage, kImage, kImage, kImage};  // 2 x 2 x 4 patches: 2 frames of 1 x 2
  const std::vector<nn::GridThw> grids = {{2, 2, 4}};
  const nn::MropePositions p = nn::mrope_positions(ids, grids, kImage, 2);
  CHECK(p.positions == triples({{0, 0, 0}, {0, 0, 1}, {1, 0, 0}, {1, 0, 1}}));
  CHECK(p.next_position == 2);
}

TEST_CASE("mismatched image-pad counts and grids are errors", "[nn][vl]") {
  const std::vector<nn::GridThw> one = {{1, 4, 4}};  // 4 tokens at merge 2
  CHECK_THROWS_WITH(nn::mrope_positions(with_image({kText}, 3), one, kImage, 2),
                    ContainsSubstring("needs 4 image-pad tokens, the sequence has 3 at token 2"));
  CHECK_THROWS_WITH(nn::mrope_positions(with_image(with_image({}, 4), 4), one, kImage, 2),
                    ContainsSubstring("more image-pad runs than the 1 images given"));
  const std::vector<nn::GridThw> two = {{1, 4, 4}, {1, 2, 2}};
  CHECK_THROWS_WITH(nn::mrope_positions(with_image({}, 4), two, kImage, 2),
                    ContainsSubstring("2 images given, the sequence has 1 image-pad runs"));
  const std::vector<nn::GridThw> odd = {{1, 3, 4}};
  CHECK_THROWS_WITH(nn::mrope_positions(with_image({}, 3), odd, kImage, 2),
                    ContainsSubstring("not divisible by the spatial merge size 2"));
  const std::vector<nn::GridThw> zero = {{0, 2, 2}};
  CHECK_THROWS_WITH(nn::mrope_positions(with_image({}, 1), zero, kImage, 2), ContainsSubstring("must be positive"));
  const std::vector<nn::GridThw> huge = {{1, int64_t(1) << 21, 2}};
  CHECK_THROWS_WITH(nn::mrope_positions(with_image({}, 1), huge, kImage, 2), ContainsSubstring("too large"));
  CHECK_THROWS_WITH(nn::mrope_positions({}, {}, kImage, 0), ContainsSubstring("spatial_merge_size must be positive"));
}

TEST_CASE("vision patch positions follow the processor's merge-block order", "[nn][vl]") {
  // 1 x 4 x 6 patches, merge 2: blocks row-major (2 x 3), each block's 2 x 2
  // patches row-major.
  const std::vector<nn::GridThw> grids = {{1, 4, 6}, {2, 2, 2}};
  const std::vector<int32_t> p = nn::vision_patch_positions(grids, 2);
  std::vector<int32_t> want;
  for (int br = 0; br < 2; ++br)
    for (int bc = 0; bc < 3; ++bc)
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < 2; ++c) want.insert(want.end(), {br * 2 + r, bc * 2 + c});
  for (int f = 0; f < 2; ++f) want.insert(want.end(), {0, 0, 0, 1, 1, 0, 1, 1});  // each frame the same
  CHECK(p == want);
  // Spot checks of the first block and the start of the second.
  CHECK(std::vector<int32_t>(p.begin(), p.begin() + 10) == std::vector<int32_t>{0, 0, 0, 1, 1, 0, 1, 1, 0, 2});
  const std::vector<nn::GridThw> bad = {{1, 5, 4}};
  CHECK_THROWS_WITH(nn::vision_patch_positions(bad, 2), ContainsSubstring("not divisible"));
}

TEST_CASE("MRoPE positions equal transformers' get_rope_index on the golden samples", "[nn][vl][golden]") {
  const io::SafetensorsFile g(std::filesystem::path(SLIME_NN_TEST_DATA) / "qwen3_vl_tiny" / "golden.safetensors");
  const std::vector<int64_t> grid_flat = g.read("image_grid_thw", DType::i64).to_vector<int64_t>();
  std::vector<nn::GridThw> grids;
  for (std::size_t i = 0; i + 2 < grid_flat.size(); i += 3)
    grids.push_back({grid_flat[i], grid_flat[i + 1], grid_flat[i + 2]});
  REQUIRE(grids.size() == 3);
  // Sample 0 holds image 0, sample 1 images 1 and 2, sample 2 none (the
  // generator's SAMPLE_IMAGES); 120 is the fixture's image_token_id.
  const std::vector<std::vector<nn::GridThw>> per_sample = {{grids[0]}, {grids[1], grids[2]}, {}};
  for (int k = 0; k < 3; ++k) {
    INFO("sample " << k);
    const std::string s = "s" + std::to_string(k);
    std::vector<int32_t> ids;
    for (int64_t t : g.read(s + ".tokens", DType::i64).to_vector<int64_t>()) ids.push_back(int32_t(t));
    const std::vector<int64_t> want = g.read(s + ".position_ids", DType::i64).to_vector<int64_t>();  // [3, L]
    const nn::MropePositions got = nn::mrope_positions(ids, per_sample[std::size_t(k)], 120, 2);
    REQUIRE(got.positions.size() == want.size());
    const std::size_t L = ids.size();
    int mismatches = 0;
    int64_t top = -1;
    for (std::size_t t = 0; t < L; ++t)
      for (std::size_t a = 0; a < 3; ++a) {
        mismatches += got.positions[3 * t + a] != want[a * L + t];
        top = std::max(top, want[a * L + t]);
      }
    CHECK(mismatches == 0);
    CHECK(got.next_position == top + 1);
  }
}
