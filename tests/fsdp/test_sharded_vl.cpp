// Sharded<Qwen3VLModel, Strategy> on LocalComm: the vision tower's units and
// the language model's under one wrapper. With 1 to 3 ranks (FullShard,
// ShardGradOp, NoShard), dense and MoE, each rank a different mix of image
// and text-only samples (one rank has no image at all, so its tower units
// only run their hooks), the losses and the reduced gradients equal the
// unwrapped model's on all samples at once (bitwise at one rank, <= 1e-5
// relative otherwise), and an optimizer step runs. A frozen tower
// (set_vision_trainable(false)) under every strategy and 1 to 3 ranks: the
// tower's parameters stay bit for bit, the language model's equal the
// unwrapped model trained by AdamW on the language parameters only, the
// frozen units hold no gradient or optimizer bytes (allocator statistics),
// and a checkpoint resumed with another rank count equals the uninterrupted
// run. Expert parallelism (dp x ep = 1 x 2, 2 x 2) on Qwen3-VL-MoE: the
// gradients equal the unsharded model's without EP. The HF export of a
// Sharded (and EP) model loads back equal to the unsharded model.
#include <catch2/catch_template_test_macros.hpp>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/random.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/qwen3_vl.hpp"
#include "slime/nn/qwen3_vl_checkpoint.hpp"
#include "slime/optim/adamw.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/export_hf.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"
#include "thread_checks.hpp"

using namespace slime;
using Catch::Matchers::ContainsSubstring;
using parallel::ExpertParallel;
using parallel::FullShard;
using parallel::NoShard;
using parallel::Sharded;
using parallel::ShardGradOp;
using slime_test::fsdp::max_rel_diff;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;

namespace {

nn::Qwen3VLConfig vl_config(bool moe, int64_t experts = 3) {
  nn::Qwen3VLConfig c;
  c.model_type = moe ? "qwen3_vl_moe" : "qwen3_vl";
  c.text.model_type = moe ? "qwen3_vl_moe_text" : "qwen3_vl_text";
  c.text.vocab_size = 37;
  c.text.hidden_size = 16;
  c.text.intermediate_size = 20;
  c.text.num_hidden_layers = 2;
  c.text.num_attention_heads = 2;
  c.text.num_key_value_heads = 1;
  c.text.head_dim = 16;
  c.text.mrope_section = {3, 3, 2};
  if (moe) {
    c.text.num_experts = experts;
    c.text.num_experts_per_tok = 2;
    c.text.moe_intermediate_size = 8;
    c.text.norm_topk_prob = true;
  }
  c.vision.depth = 2;
  c.vision.hidden_size = 8;
  c.vision.intermediate_size = 12;
  c.vision.num_heads = 1;
  c.vision.in_channels = 1;
  c.vision.patch_size = 2;
  c.vision.temporal_patch_size = 1;
  c.vision.spatial_merge_size = 2;
  c.vision.out_hidden_size = 16;
  c.vision.num_position_embeddings = 4;
  c.vision.deepstack_visual_indexes = {0};
  c.image_token_id = 30;
  c.vision_start_token_id = 31;
  c.vision_end_token_id = 32;
  c.video_token_id = 33;
  c.validate();
  return c;
}

Tensor pixels(int64_t rows, int64_t width, uint64_t seed) {
  Tensor t = Tensor::empty({rows, width}, DType::f32);
  fill_normal(t, seed, 0, 0.f, 1.f);
  return t;
}

// Rank r's samples (of `world`): rank 0 one image and text, rank 1 two
// images in one sample, rank 2 text only.
std::vector<nn::VLSequence> samples_of(int rank, const nn::Qwen3VLConfig& c) {
  const int32_t img = c.image_token_id, s = c.vision_start_token_id, e = c.vision_end_token_id;
  const int64_t w = c.vision.patch_dim();
  std::vector<nn::VLSequence> out;
  if (rank == 0) {
    out.push_back({{4, 5, s, img, img, e, 6, 7}, {{1, 4, 2}}, pixels(8, w, 100)});
    out.push_back({{8, 9, 10}, {}, {}});
  } else if (rank == 1) {
    out.push_back({{s, img, e, 3, s, img, img, img, img, e, 2}, {{1, 2, 2}, {1, 4, 4}}, pixels(20, w, 200)});
  } else {
    out.push_back({{1, 2, 3, 4, 5, 6}, {}, {}});
    out.push_back({{11, 12}, {}, {}});
  }
  return out;
}

std::vector<int32_t> targets_of(const std::vector<nn::VLSequence>& seqs, int32_t vocab) {
  std::vector<int32_t> t;
  for (const auto& s : seqs)
    for (std::size_t i = 0; i < s.tokens.size(); ++i) t.push_back(int32_t((s.tokens[i] * 7 + int32_t(i)) % vocab));
  return t;
}

int64_t tokens_of(const std::vector<nn::VLSequence>& seqs) {
  int64_t n = 0;
  for (const auto& s : seqs) n += int64_t(s.tokens.size());
  return n;
}

nn::Qwen3VLModel make(const nn::Qwen3VLConfig& c) {
  nn::Qwen3VLModel m(c, {});
  m.init_random(17, 0.3f);
  return m;
}

// max |a - b| / max |b| (b all zero: max |a - b|).
double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, double(std::abs(a[i] - b[i])));
    m = std::max(m, double(std::abs(b[i])));
  }
  return a.size() != b.size() ? 1e30 : (m > 0 ? d / m : d);
}

struct Result {
  double loss = 0;
  Params grads;
};

// The unwrapped model on every rank's samples in one batch.
Result reference(const nn::Qwen3VLConfig& c, int world) {
  std::vector<nn::VLSequence> all;
  for (int r = 0; r < world; ++r)
    for (auto& s : samples_of(r, c)) all.push_back(std::move(s));
  nn::Qwen3VLModel m = make(c);
  nn::zero_grad(m);
  const nn::VLBatch b = nn::make_vl_batch(all, c, Device::cpu(), DType::f32);
  const std::vector<int32_t> t = targets_of(all, int32_t(c.text.vocab_size));
  Result out;
  out.loss = m.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())})).loss;
  m.for_each_parameter([&](nn::Parameter& p) { out.grads[p.name] = p.grad.to_vector<float>(); });
  return out;
}

// zero_grad and loss_and_backward of rank w.rank()'s samples_of with the
// normaliser `total`; returns the loss over all ranks' tokens (each rank's
// share summed).
template <class S>
double step_loss(S& sh, const nn::Qwen3VLConfig& c, comm::Comm& w, int64_t total) {
  sh.zero_grad();
  const std::vector<nn::VLSequence> mine = samples_of(w.rank(), c);
  const nn::VLBatch b = nn::make_vl_batch(mine, c, Device::cpu(), DType::f32);
  const std::vector<int32_t> t = targets_of(mine, int32_t(c.text.vocab_size));
  const double loss = sh.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())}), 1.f, double(total)).loss;
  Tensor l = Tensor::from_vector(std::vector<float>{float(loss)}, {1});
  w.all_reduce(l, comm::ReduceOp::sum);
  return double(l.to_vector<float>()[0]);
}

template <class S>
Result sharded(const nn::Qwen3VLConfig& c, int world) {
  int64_t total = 0;
  for (int r = 0; r < world; ++r) total += tokens_of(samples_of(r, c));
  Result out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    Sharded<nn::Qwen3VLModel, S> sh(make(c), w);
    TCHECK(sh.num_units() == sh.module().units().size());
    TCHECK(sh.unit_name(0) == "model.visual.patch_embed");
    const double loss = step_loss(sh, c, w, total);
    for (const std::string& name : sh.parameter_names()) {
      const std::vector<float> g = sh.gather_gradient(name).template to_vector<float>();
      if (w.rank() == 0) {
        std::lock_guard lock(mutex);
        out.grads[name] = g;
      }
    }
    if (w.rank() == 0) out.loss = loss;
    sh.optimizer_step(1e-2);
  });
  thread_checks().require_none();
  return out;
}

// The loss and every gradient of `got` against `want`: bitwise when
// `exact`, else <= 1e-5 relative. Returns the largest gradient difference.
double check_result(const Result& got, const Result& want, bool exact) {
  CHECK(std::abs(got.loss - want.loss) <= 1e-6 * std::abs(want.loss));
  REQUIRE(got.grads.size() == want.grads.size());
  double worst = 0;
  for (const auto& [name, g] : want.grads) {
    INFO(name);
    REQUIRE(got.grads.count(name) == 1);
    const double d = rel_diff(got.grads.at(name), g);
    worst = std::max(worst, d);
    if (exact) {
      CHECK(got.grads.at(name) == g);
    } else {
      CHECK(d <= 1e-5);
    }
  }
  return worst;
}

template <class S>
void check(bool moe, int world) {
  INFO((moe ? "MoE" : "dense") << ", " << world << " rank(s)");
  const nn::Qwen3VLConfig c = vl_config(moe);
  const double worst = check_result(sharded<S>(c, world), reference(c, world), world == 1);
  std::printf("sharded vl %s world %d: worst gradient %.3g\n", moe ? "moe" : "dense", world, worst);
}

}  // namespace

TEMPLATE_TEST_CASE("Sharded<Qwen3VLModel> equals the unwrapped model (tower and language units, mixed batches)",
                   "[fsdp][vl]", FullShard, ShardGradOp, NoShard) {
  for (const bool moe : {false, true})
    for (const int world : {1, 2, 3}) check<TestType>(moe, world);
}

namespace {

// ---- a frozen tower ---------------------------------------------------------

constexpr double kLr = 1e-2;
constexpr int kDataRanks = 3;  // the step's data: samples_of(d) for d < 3, whatever the world

bool in_tower(const std::string& name) { return name.rfind("model.visual.", 0) == 0; }

nn::Qwen3VLModel make_frozen(const nn::Qwen3VLConfig& c) {
  nn::Qwen3VLModel m = make(c);
  m.set_vision_trainable(false);
  return m;
}

// Rank r of `world` holds the samples of data ranks d = r, r + world, ...
std::vector<nn::VLSequence> rank_samples(int rank, int world, const nn::Qwen3VLConfig& c) {
  std::vector<nn::VLSequence> out;
  for (int d = rank; d < kDataRanks; d += world)
    for (auto& s : samples_of(d, c)) out.push_back(std::move(s));
  return out;
}

int64_t all_tokens(const nn::Qwen3VLConfig& c) {
  int64_t n = 0;
  for (int d = 0; d < kDataRanks; ++d) n += tokens_of(samples_of(d, c));
  return n;
}

Params values_of(nn::Qwen3VLModel& m) {
  Params out;
  m.for_each_parameter([&](nn::Parameter& p) { out[p.name] = p.value.to_vector<float>(); });
  return out;
}

// The unwrapped model with a frozen tower, `steps` steps on every data rank's
// samples (one batch) and AdamW on the language model's parameters only.
Params frozen_reference(const nn::Qwen3VLConfig& c, int steps) {
  nn::Qwen3VLModel m = make_frozen(c);
  std::vector<nn::VLSequence> all = rank_samples(0, 1, c);
  const nn::VLBatch b = nn::make_vl_batch(all, c, Device::cpu(), DType::f32);
  const std::vector<int32_t> t = targets_of(all, int32_t(c.text.vocab_size));
  optim::AdamW opt;
  for (int step = 0; step < steps; ++step) {
    nn::zero_grad(m);
    m.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())}));
    std::vector<Tensor> params, grads;
    m.for_each_parameter([&](nn::Parameter& p) {
      if (in_tower(p.name)) return;
      params.push_back(p.value);
      grads.push_back(p.grad);
    });
    opt.step(params, grads, kLr);
  }
  return values_of(m);
}

struct FrozenRun {
  int first_step = 0, steps = 1;
  std::filesystem::path load, save;  // empty: none
  parallel::ShardedOptions options = {};
  bool offload = false;  // runtime offload / onload after every step
};

// Sharded<S> with a frozen tower on `world` ranks: a run of `run.steps`
// steps, loading and saving a checkpoint when asked; every parameter gathered.
template <class S>
Params frozen_sharded(const nn::Qwen3VLConfig& c, int world, const FrozenRun& run) {
  const int64_t total = all_tokens(c);
  Params out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    Sharded<nn::Qwen3VLModel, S> sh(make_frozen(c), w, run.options);
    const std::size_t nv = sh.module().num_vision_units();
    for (std::size_t u = 0; u < sh.num_units(); ++u) TCHECK(sh.unit_trainable(u) == (u >= nv));
    // AdamW's state: the trainable units' moments only, shaped as their masters.
    const auto state = sh.optimizer().state_tensors();
    TCHECK(state.size() == 2 * (sh.num_units() - nv));
    for (std::size_t i = 0; i < state.size(); ++i)
      TCHECK(state[i].second.numel() == sh.unit_layout(nv + i / 2).shard_numel());
    if (!run.load.empty()) {
      const nlohmann::json meta = parallel::load_sharded_state(sh, run.load);
      TCHECK(meta.at("step").get<int64_t>() == run.first_step);
      TCHECK(sh.optimizer().step_count() == run.first_step);
    }
    const std::vector<nn::VLSequence> mine = rank_samples(w.rank(), world, c);
    const nn::VLBatch b = nn::make_vl_batch(mine, c, Device::cpu(), DType::f32);
    const std::vector<int32_t> t = targets_of(mine, int32_t(c.text.vocab_size));
    for (int step = 0; step < run.steps; ++step) {
      sh.zero_grad();
      sh.loss_and_backward(b, Tensor::from_vector(t, {int64_t(t.size())}), 1.f, double(total));
      sh.optimizer_step(kLr, 1e3);  // a clip that does not bind: the norm over the language units runs
      if (run.offload) {
        sh.offload();
        sh.onload();
      }
    }
    TCHECK(slime_test::fsdp::error_of([&] {
             (void)sh.gather_gradient("model.visual.merger.linear_fc1.weight");
           }).find("not trainable") != std::string::npos);
    if (!run.save.empty()) parallel::save_sharded_state(sh, w, run.save, run.first_step + run.steps, {});
    for (const std::string& name : sh.parameter_names()) {
      const std::vector<float> v = sh.gather_parameter(name).template to_vector<float>();
      if (w.rank() == 0) {
        std::lock_guard lock(mutex);
        out[name] = v;
      }
    }
  });
  thread_checks().require_none();
  return out;
}

// The tower bit for bit as initialised; the language model within `tol`
// (2-norm relative, each parameter) of `want`.
void check_frozen(const nn::Qwen3VLConfig& c, const Params& got, const Params& want, double tol) {
  nn::Qwen3VLModel init = make(c);
  const Params before = values_of(init);
  REQUIRE(got.size() == before.size());
  Params got_lang, want_lang;
  int64_t tower = 0;
  for (const auto& [name, v] : got) {
    INFO(name);
    if (in_tower(name)) {
      CHECK(v == before.at(name));
      ++tower;
    } else {
      CHECK(v != before.at(name));  // trained
      got_lang[name] = v;
      want_lang[name] = want.at(name);
    }
  }
  CHECK(tower > 0);
  const double d = max_rel_diff(got_lang, want_lang);
  INFO("language model: largest relative difference " << d);
  if (tol == 0) {
    CHECK(got_lang == want_lang);
  } else {
    CHECK(d <= tol);
  }
}

struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag) {
    path = std::filesystem::temp_directory_path() / ("slime_test_sharded_vl_" + tag + "_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// Bytes a freshly built Sharded<S> with a frozen tower frees on each rank
// against its units' shards: f32 master (the compute shard too, f32 on the
// CPU) for every unit, and for trainable units the grad shard and AdamW's
// two moments (4 + 4 + 8 bytes per element); the frozen ones add nothing.
template <class S>
void check_frozen_memory(const nn::Qwen3VLConfig& c, int world) {
  INFO(world << " rank(s)");
  const auto ranks = static_cast<std::size_t>(world);
  std::vector<int64_t> freed(ranks), want(ranks), frozen(ranks);
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    std::optional<Sharded<nn::Qwen3VLModel, S>> sh;
    sh.emplace(make_frozen(c), w);
    const std::size_t r = std::size_t(w.rank());
    for (std::size_t u = 0; u < sh->num_units(); ++u) {
      const int64_t n = sh->unit_layout(u).shard_numel();
      want[r] += n * (sh->unit_trainable(u) ? 16 : 4);
      if (!sh->unit_trainable(u)) frozen[r] += n;
    }
    for (int q = 0; q < w.size(); ++q) {  // one rank at a time: the ranks share the CPU allocator
      w.barrier();
      if (q == w.rank()) {
        const int64_t before = memory_stats(Device::cpu()).current_bytes;
        sh.reset();
        freed[r] = before - memory_stats(Device::cpu()).current_bytes;
      }
      w.barrier();
    }
  });
  thread_checks().require_none();
  for (int r = 0; r < world; ++r) {
    INFO("rank " << r << ": frozen shard elements " << frozen[std::size_t(r)]);
    CHECK(frozen[std::size_t(r)] > 0);
    CHECK(freed[std::size_t(r)] == want[std::size_t(r)]);
  }
}

}  // namespace

TEMPLATE_TEST_CASE("Sharded<Qwen3VLModel> with a frozen tower: the tower stays, the language model trains",
                   "[fsdp][vl][frozen]", FullShard, ShardGradOp, NoShard) {
  for (const bool moe : {false, true}) {
    const nn::Qwen3VLConfig c = vl_config(moe);
    const Params want = frozen_reference(c, 2);
    for (const int world : {1, 2, 3}) {
      INFO((moe ? "MoE" : "dense") << ", " << world << " rank(s)");
      // One rank: the unwrapped model's numbers, bit for bit.
      check_frozen(c, frozen_sharded<TestType>(c, world, {.first_step = 0, .steps = 2}), want, world == 1 ? 0 : 1e-5);
    }
  }
  for (const int world : {1, 2, 3}) check_frozen_memory<TestType>(vl_config(true), world);
  {
    INFO("cpu_offload, and runtime offload after every step, 2 ranks");
    const nn::Qwen3VLConfig c = vl_config(true);
    const Params want = frozen_reference(c, 3);
    check_frozen(c, frozen_sharded<TestType>(c, 2, {.steps = 3, .options = {.cpu_offload = true}}), want, 1e-5);
    check_frozen(c, frozen_sharded<TestType>(c, 2, {.steps = 3, .offload = true}), want, 1e-5);
  }
}

TEST_CASE("Sharded<Qwen3VLModel> with a frozen tower: a checkpoint resumes with another rank count",
          "[fsdp][vl][frozen]") {
  const nn::Qwen3VLConfig c = vl_config(true);
  struct Case {
    int from, to;
  };
  for (const Case k : {Case{2, 3}, Case{3, 1}, Case{1, 2}}) {
    INFO("saved on " << k.from << " rank(s), resumed on " << k.to);
    TempDir dir("frozen_" + std::to_string(k.from) + "_" + std::to_string(k.to));
    (void)frozen_sharded<FullShard>(c, k.from, {.first_step = 0, .steps = 1, .load = {}, .save = dir.path});
    {  // the tower's masters only; the language model's with their moments
      const io::TrainStateReader reader = io::TrainStateReader::open_latest(dir.path);
      int64_t tower = 0;
      for (const std::string& n : reader.names()) {
        INFO(n);
        if (!in_tower(n)) continue;
        CHECK(n.find('/') == std::string::npos);
        ++tower;
      }
      CHECK(tower > 0);
      CHECK(reader.contains(parallel::exp_avg_name("lm_head.weight")));
    }
    const Params resumed =
        frozen_sharded<NoShard>(c, k.to, {.first_step = 1, .steps = 1, .load = dir.path, .save = {}});
    const Params uninterrupted = frozen_sharded<NoShard>(c, k.to, {.first_step = 0, .steps = 2});
    check_frozen(c, resumed, uninterrupted, 1e-5);
  }
}

namespace {

// ---- expert parallelism and the HF export -----------------------------------

constexpr int64_t kExperts = 4;

// The model with `ep`'s slice of the experts, its values those of make(c).
nn::Qwen3VLModel ep_model(const nn::Qwen3VLConfig& c, ExpertParallel<>& ep) {
  nn::Qwen3VLModel full = make(c);
  nn::Qwen3VLModel m(c, {}, &ep);
  slime_test::fsdp::copy_expert_slices(full, m);
  return m;
}

// The HF directory `dir` loaded back equals make(c) bit for bit.
void check_export(const nn::Qwen3VLConfig& c, const std::filesystem::path& dir) {
  nn::Qwen3VLModel back = nn::load_hf_vl(dir);
  nn::Qwen3VLModel init = make(c);
  const Params want = values_of(init), got = values_of(back);
  REQUIRE(got.size() == want.size());
  for (const auto& [name, v] : want) {
    INFO(name);
    REQUIRE(got.count(name) == 1);
    CHECK(got.at(name) == v);
  }
}

// Sharded<FullShard> over dp x ep with ExpertParallel, rank r the samples of
// samples_of(r): the loss, the reduced gradients (expert stacks reassembled)
// and the HF export taken before the step.
Result ep_sharded(const nn::Qwen3VLConfig& c, int dp, int nep, const std::filesystem::path& export_dir) {
  const int world = dp * nep;
  int64_t total = 0;
  for (int r = 0; r < world; ++r) total += tokens_of(samples_of(r, c));
  Result out;
  std::mutex mutex;
  comm::run_local_ranks(world, [&](comm::Comm& w) {
    const comm::Mesh mesh(w, comm::MeshShape{.dp_replicate = 1, .dp_shard = dp, .cp = 1, .ep = nep});
    ExpertParallel<> ep(mesh, kExperts);
    Sharded<nn::Qwen3VLModel, FullShard> sh(ep_model(c, ep), mesh);
    TCHECK(sh.shard_world() == world);
    TCHECK(sh.expert_shard_world() == dp);
    std::size_t expert_units = 0;
    for (std::size_t u = 0; u < sh.num_units(); ++u) expert_units += sh.is_expert_unit(u) ? 1 : 0;
    TCHECK(expert_units == std::size_t(c.text.num_hidden_layers));  // every layer sparse
    parallel::save_hf_vl(sh, w, export_dir, {.ep = &ep});
    const double loss = step_loss(sh, c, w, total);
    slime_test::fsdp::gather_full(sh, mesh, kExperts, out.grads, mutex, slime_test::fsdp::Gathered::gradients);
    if (w.rank() == 0) out.loss = loss;
    sh.optimizer_step(kLr);
  });
  thread_checks().require_none();
  return out;
}

}  // namespace

TEST_CASE("Sharded<Qwen3VLModel> with ExpertParallel equals the unsharded Qwen3-VL-MoE, and its HF export loads back",
          "[fsdp][vl][ep]") {
  const nn::Qwen3VLConfig c = vl_config(true, kExperts);
  struct Case {
    int dp, ep;
  };
  for (const Case k : {Case{1, 2}, Case{2, 2}}) {
    INFO("dp " << k.dp << " x ep " << k.ep);
    TempDir dir("ep_" + std::to_string(k.dp) + "x" + std::to_string(k.ep));
    const double worst = check_result(ep_sharded(c, k.dp, k.ep, dir.path), reference(c, k.dp * k.ep), false);
    std::printf("sharded vl ep dp %d x ep %d: worst gradient %.3g\n", k.dp, k.ep, worst);
    check_export(c, dir.path);
  }
}

TEMPLATE_TEST_CASE("parallel::save_hf_vl of a Sharded<Qwen3VLModel> loads back equal to the unsharded model",
                   "[fsdp][vl][export]", FullShard, NoShard) {
  for (const bool moe : {false, true})
    for (const int world : {1, 3}) {
      INFO((moe ? "MoE" : "dense") << ", " << world << " rank(s)");
      const nn::Qwen3VLConfig c = vl_config(moe);
      TempDir dir("export_" + std::to_string(world));
      comm::run_local_ranks(world, [&](comm::Comm& w) {
        Sharded<nn::Qwen3VLModel, TestType> sh(make_frozen(c), w);
        parallel::save_hf_vl(sh, w, dir.path);
        // Offloaded: gathered from the host masters.
        sh.offload();
        std::optional<nn::Qwen3VLModel> full = parallel::gather_vl_model(sh, w);
        TCHECK(full.has_value() == (w.rank() == 0));
        sh.onload();
      });
      thread_checks().require_none();
      check_export(c, dir.path);
    }
}
