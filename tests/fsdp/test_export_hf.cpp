// parallel::save_hf: a tiny Qwen3 and Qwen3-MoE sharded over 2 LocalComm
// ranks (every strategy; the MoE also with expert parallelism 2, each rank
// holding half the experts, and offloaded) exported as a Hugging Face
// directory that nn::load_hf reads back equal to the unsharded model (bit for
// bit in f32; in bf16 equal to the rounded values), one tensor per expert.
#include <catch2/catch_test_macros.hpp>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <unistd.h>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/nn/checkpoint.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/ops/elementwise.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/export_hf.hpp"
#include "slime/parallel/sharded.hpp"
#include "thread_checks.hpp"

using namespace slime;
using slime_test::fsdp::make_model;
using slime_test::fsdp::parameters_of;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;
using slime_test::fsdp::tiny_config;
namespace fs = std::filesystem;

namespace {

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag)
      : path(fs::temp_directory_path() / ("slime_test_export_hf_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The unsharded model's parameters under HF's names: one entry per expert.
Params hf_parameters(nn::Qwen3Model& model, DType dtype) {
  Params out;
  model.for_each_parameter([&](nn::Parameter& p) {
    Tensor v = p.value;
    if (dtype != DType::f32) {  // the values a bf16 file holds, read back as f32
      Tensor low = Tensor::empty(v.shape(), dtype);
      ops::cast(v, low);
      v = Tensor::empty(v.shape(), DType::f32);
      ops::cast(low, v);
    }
    if (!p.is_expert_stack()) {
      out[p.name] = v.to_vector<float>();
      return;
    }
    for (int64_t e = 0; e < v.size(0); ++e) out[p.expert_name(e)] = v.slice_rows(e, 1).to_vector<float>();
  });
  return out;
}

// Every tensor of an HF directory's safetensors file(s), by name, as f32.
Params hf_parameters(const fs::path& dir) {
  nn::Qwen3Model loaded = nn::load_hf(dir);
  return hf_parameters(loaded, DType::f32);
}

// Exports the model of `config` (the values of make_model) sharded with
// Strategy over 2 ranks, the experts split over ep ranks, into `dir`
// (offloaded first: the export gathers from the host masters).
template <class Strategy>
void export_sharded(const nn::Qwen3Config& config, int ep, DType dtype, const fs::path& dir, bool offloaded = false) {
  comm::run_local_ranks(2, [&](comm::Comm& comm) {
    comm::Mesh mesh(comm, {.dp_replicate = 1, .dp_shard = 2 / ep, .cp = 1, .ep = ep});
    std::unique_ptr<parallel::ExpertParallel<>> experts;
    if (config.is_moe()) experts = std::make_unique<parallel::ExpertParallel<>>(mesh, config.num_experts);
    nn::Qwen3Model model(config, {}, experts.get());
    // This rank's slice of make_model's values.
    nn::Qwen3Model full = make_model(config);
    std::map<std::string, nn::Parameter*> src;
    full.for_each_parameter([&](nn::Parameter& p) { src[p.name] = &p; });
    model.for_each_parameter([&](nn::Parameter& p) {
      const Tensor& v = src.at(p.name)->value;
      if (p.is_expert_stack()) {
        p.value.copy_from(v.slice_rows(p.first_expert, p.value.size(0)));
      } else {
        p.value.copy_from(v);
      }
    });
    parallel::Sharded<nn::Qwen3Model, Strategy> sharded(std::move(model), mesh);
    if (offloaded) sharded.offload();
    parallel::save_hf(sharded, comm, config, dir, {.dtype = dtype, .ep = experts.get()});
  });
}

}  // namespace

TEST_CASE("save_hf: a sharded Qwen3 loads back equal to the unsharded model") {
  const nn::Qwen3Config config = tiny_config(/*tied=*/false);
  nn::Qwen3Model full = make_model(config);
  const Params want = hf_parameters(full, DType::f32);
  {
    TempDir tmp("dense_full");
    export_sharded<parallel::FullShard>(config, 1, DType::f32, tmp.path / "hf");
    CHECK(hf_parameters(tmp.path / "hf") == want);
    CHECK(nn::Qwen3Config::from_file(tmp.path / "hf" / "config.json").torch_dtype == DType::f32);
    // Nothing but the directory: the temporary one was renamed into place.
    int entries = 0;
    for (const auto& e : fs::directory_iterator(tmp.path)) entries += e.path().filename() == "hf" ? 1 : 100;
    CHECK(entries == 1);
  }
  {
    TempDir tmp("dense_no_shard");
    export_sharded<parallel::NoShard>(config, 1, DType::f32, tmp.path / "hf");
    CHECK(hf_parameters(tmp.path / "hf") == want);
  }
  {
    TempDir tmp("dense_tied");
    const nn::Qwen3Config tied = tiny_config(/*tied=*/true);
    nn::Qwen3Model m = make_model(tied);
    export_sharded<parallel::ShardGradOp>(tied, 1, DType::f32, tmp.path / "hf");
    CHECK(hf_parameters(tmp.path / "hf") == hf_parameters(m, DType::f32));
  }
  thread_checks().require_none();
}

TEST_CASE("save_hf: a sharded Qwen3-MoE, with and without expert parallelism, holds every expert") {
  const nn::Qwen3Config config = tiny_config(/*tied=*/false, /*moe=*/true);
  nn::Qwen3Model full = make_model(config);
  const Params want = hf_parameters(full, DType::f32);
  REQUIRE(want.count("model.layers.1.mlp.experts.3.down_proj.weight") == 1);
  for (int ep : {1, 2}) {
    INFO("ep " << ep);
    TempDir tmp("moe_ep" + std::to_string(ep));
    export_sharded<parallel::FullShard>(config, ep, DType::f32, tmp.path / "hf", /*offloaded=*/ep == 2);
    const Params got = hf_parameters(tmp.path / "hf");
    CHECK(got.size() == want.size());
    CHECK(got == want);
    const nn::Qwen3Config back = nn::Qwen3Config::from_file(tmp.path / "hf" / "config.json");
    CHECK(back.model_type == "qwen3_moe");
    CHECK(back.num_experts == config.num_experts);
  }
  {
    TempDir tmp("moe_ep2_bf16");
    export_sharded<parallel::NoShard>(config, 2, DType::bf16, tmp.path / "hf");
    CHECK(nn::Qwen3Config::from_file(tmp.path / "hf" / "config.json").torch_dtype == DType::bf16);
    CHECK(hf_parameters(tmp.path / "hf") == hf_parameters(full, DType::bf16));
  }
  thread_checks().require_none();
}
