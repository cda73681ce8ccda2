// tests/nn/vl_test_util.hpp: the Qwen3-VL golden run shared by the CPU and
// GPU tests: the fixture's samples (tools/make_qwen3_vl_golden.py) packed in
// one batch, compared with transformers' logits, logprobs, loss and every
// parameter gradient.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "nn_test_util.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"

namespace nn_test {

using namespace slime;

std::vector<nn::GridThw> grids_of(const Tensor& grid_thw) {
  const auto v = grid_thw.to_vector<int64_t>();
  std::vector<nn::GridThw> out;
  for (std::size_t i = 0; i + 2 < v.size(); i += 3) out.push_back({v[i], v[i + 1], v[i + 2]});
  return out;
}

int64_t patches_of(const nn::GridThw& g) { return g[0] * g[1] * g[2]; }

// The fixture's samples as VLSequences (images given out in order: a
// sample's image-pad runs take the next images of image_grid_thw).
struct VlGolden {
  io::SafetensorsFile file;
  std::vector<nn::VLSequence> sequences;
  std::vector<int64_t> targets;  // every sample's, concatenated
  int samples = 0;

  VlGolden(const std::filesystem::path& dir, int32_t image_token, int64_t merge) : file(dir / "golden.safetensors") {
    const Tensor pixels = file.read("pixel_values", DType::f32);
    const std::vector<nn::GridThw> grids = grids_of(file.read("image_grid_thw", DType::i64));
    std::size_t image = 0;
    int64_t row = 0;
    for (int k = 0; file.contains("s" + std::to_string(k) + ".tokens"); ++k) {
      const auto tok = file.read("s" + std::to_string(k) + ".tokens", DType::i64).to_vector<int64_t>();
      const auto tgt = file.read("s" + std::to_string(k) + ".targets", DType::i64).to_vector<int64_t>();
      nn::VLSequence s;
      for (int64_t t : tok) s.tokens.push_back(int32_t(t));
      targets.insert(targets.end(), tgt.begin(), tgt.end());
      // Each run of image-pad tokens is one image.
      for (std::size_t t = 0; t < s.tokens.size(); ++t)
        if (s.tokens[t] == image_token && (t == 0 || s.tokens[t - 1] != image_token)) s.grids.push_back(grids[image++]);
      int64_t n = 0;
      for (const auto& g : s.grids) n += patches_of(g);
      if (n > 0) s.pixel_values = pixels.slice_rows(row, n).clone();
      row += n;
      sequences.push_back(std::move(s));
      ++samples;
    }
    REQUIRE(image == grids.size());
    (void)merge;
  }
  Tensor read(const std::string& name) const { return file.read(name, DType::f32); }
};

struct VlErrors {
  double logits = 0, logprobs = 0, loss = 0, grad_max = 0;
  std::string worst_grad;
};

// One packed batch of every sample: logits and logprobs per sample against
// the golden, the loss -sum logprobs / tokens and every parameter gradient.
VlErrors run_vl_golden(const std::filesystem::path& dir, DType dtype, bool check_positions = true,
                       Device device = Device::cpu()) {
  nn::Qwen3VLModel model = nn::load_hf_vl(dir, device, dtype);
  const nn::Qwen3VLConfig& c = model.config();
  const VlGolden g(dir, c.image_token_id, c.vision.spatial_merge_size);
  const nn::VLBatch batch = nn::make_vl_batch(g.sequences, c, device, dtype);
  REQUIRE(batch.grids.size() >= 2);

  if (check_positions) {  // MRoPE positions as get_rope_index
    const auto pos = batch.text.positions.to(Device::cpu()).to_vector<int32_t>();
    for (int k = 0; k < g.samples; ++k) {
      const auto want = g.file.read("s" + std::to_string(k) + ".position_ids", DType::i64).to_vector<int64_t>();
      const int64_t n = int64_t(want.size() / 3), begin = batch.text.cu_seqlens_host[std::size_t(k)];
      for (int64_t t = 0; t < n; ++t)
        for (int a = 0; a < 3; ++a) REQUIRE(pos[std::size_t((begin + t) * 3 + a)] == want[std::size_t(a * n + t)]);
    }
  }

  const Tensor targets = Tensor::from_vector(g.targets, {int64_t(g.targets.size())}).to(device);
  VlErrors e;
  nn::Qwen3VLModel::Context ctx;
  const Tensor hidden = model.forward(batch, ctx);
  const Tensor logits = model.logits(hidden);
  const ops::TokenLogprobs lp = model.token_logprobs(hidden, targets);
  for (int k = 0; k < g.samples; ++k) {
    const int64_t b = batch.text.cu_seqlens_host[std::size_t(k)],
                  n = batch.text.cu_seqlens_host[std::size_t(k) + 1] - b;
    e.logits = std::max(e.logits, rel_error(logits.slice_rows(b, n), g.read("s" + std::to_string(k) + ".logits")));
    e.logprobs =
        std::max(e.logprobs, rel_error(lp.logprobs.slice_rows(b, n), g.read("s" + std::to_string(k) + ".logprobs")));
  }
  nn::zero_grad(model);
  const nn::LossResult loss = model.loss_and_backward(batch, targets);
  const double want = to_double(g.read("loss"))[0];
  e.loss = std::abs(loss.loss - want) / std::abs(want);
  int params = 0;
  model.for_each_parameter([&](nn::Parameter& p) {
    INFO("parameter " << p.name);
    REQUIRE(p.grad.defined());
    std::vector<double> golden;
    if (!p.is_expert_stack()) {
      REQUIRE(g.file.contains("grad." + p.name));
      golden = to_double(g.read("grad." + p.name));
      ++params;
    } else {  // the fixture has the fused gradients' per-expert slices
      for (int64_t i = 0; i < p.value.size(0); ++i) {
        REQUIRE(g.file.contains("grad." + p.expert_name(i)));
        const auto v = to_double(g.read("grad." + p.expert_name(i)));
        golden.insert(golden.end(), v.begin(), v.end());
      }
    }
    const double err = rel_error(to_double(p.grad), golden);
    if (err >= e.grad_max) {
      e.grad_max = err;
      e.worst_grad = p.name;
    }
  });
  int golden_grads = 0;
  for (const auto& name : g.file.names())
    golden_grads += name.starts_with("grad.") && name.find(".experts.") == std::string::npos ? 1 : 0;
  CHECK(params == golden_grads);
  std::printf("vl golden %s %s %s: logits %.3g, logprobs %.3g, loss %.3g, grads max %.3g (%s)\n",
              dir.filename().string().c_str(), device.str().c_str(), std::string(dtype_name(dtype)).c_str(), e.logits,
              e.logprobs, e.loss, e.grad_max, e.worst_grad.c_str());
  return e;
}

}  // namespace nn_test
