// save_sharded_state / load_sharded_state (slime/parallel/sharded_checkpoint.hpp)
// on LocalComm: a run of one configuration trains kSteps AdamW steps, saves,
// and a run of another configuration (rank count, strategy, expert-parallel
// degree, cpu_offload) loads the checkpoint and trains kSteps more; its
// parameters must equal those of the first configuration trained 2 kSteps
// without interruption.
//
// Every step's global batch is the same 12 data slots whatever the rank
// count (rank r of W takes slots [12 r / W, 12 (r + 1) / W) as one packed
// batch; the loss normaliser is the global token count), so the runs differ
// only in how the gradient sums are grouped. Where the resumed configuration
// groups them as the uninterrupted one (the same configuration; cpu_offload
// on or off, whose CPU AdamW rounds as the device one), the result is
// bitwise equal. Otherwise the per-rank backward passes sum other subsets of
// tokens and the reductions add other partial sums: f32 rounding of the
// gradients (~1e-7 relative), which AdamW's normalised update passes on
// without amplifying it much once the moments are established (the resume
// starts at step kSteps + 1, not at the sign-like first steps), so the
// parameters agree to <= 1e-6 relative (2-norm per tensor; the measured
// differences are printed).
//
// Also: the checkpoint's element coverage (every tensor's pieces, read from
// metadata.json, tile [0, numel) exactly once; replicas and dp replicas of
// expert slices write once, each ep rank its slice of the whole stack [E, ...]),
// and errors (another model, no checkpoint, runtime-offloaded Sharded; a
// failed load changes nothing).
#include <unistd.h>
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "sharded_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/comm/mesh.hpp"
#include "slime/io/train_state.hpp"
#include "slime/nn/qwen3.hpp"
#include "slime/parallel/expert_parallel.hpp"
#include "slime/parallel/sharded.hpp"
#include "slime/parallel/sharded_checkpoint.hpp"
#include "thread_checks.hpp"

using namespace slime;
namespace fs = std::filesystem;
using Catch::Matchers::ContainsSubstring;
using parallel::ExpertParallel;
using parallel::FullShard;
using parallel::HybridShard;
using parallel::NoShard;
using parallel::Sharded;
using slime_test::fsdp::error_of;
using slime_test::fsdp::max_rel_diff;
using slime_test::fsdp::micro_batch;
using slime_test::fsdp::MicroBatch;
using slime_test::fsdp::Params;
using slime_test::fsdp::thread_checks;
using slime_test::fsdp::tiny_config;

namespace {

constexpr int kSteps = 3;   // before and after the checkpoint
constexpr int kSlots = 12;  // data slots per step: divides over 1, 2, 3 and 4 ranks
constexpr int64_t kVocab = 37;
constexpr int64_t kExperts = 4;  // tiny_config(moe)
constexpr double kLr = 1e-2;

enum class Strategy { full, no, hybrid };

struct Setup {
  const char* what = "";
  Strategy strategy = Strategy::full;
  int world = 1;
  bool use_mesh = false;  // a comm::Mesh of `mesh` (HybridShard, expert parallelism)
  comm::MeshShape mesh{};
  bool moe = false;  // Qwen3-MoE (expert parallelism when mesh.ep > 1)
  bool tied = false;
  bool cpu_offload = false;
};

Setup plain(const char* what, Strategy s, int world, bool moe = false) {
  Setup r;
  r.what = what;
  r.strategy = s;
  r.world = world;
  r.moe = moe;
  return r;
}

Setup meshed(const char* what, Strategy s, comm::MeshShape m, bool moe) {
  Setup r;
  r.what = what;
  r.strategy = s;
  r.world = m.dp_replicate * m.dp_shard * m.cp * m.ep;
  r.use_mesh = true;
  r.mesh = m;
  r.moe = moe;
  return r;
}

comm::MeshShape dp_ep(int dp, int ep) { return comm::MeshShape{.dp_replicate = 1, .dp_shard = dp, .cp = 1, .ep = ep}; }

// Slots [first, last) of `step`, one packed batch.
MicroBatch slots(int step, int first, int last) {
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int32_t> targets;
  for (int slot = first; slot < last; ++slot) {
    const MicroBatch mb = micro_batch(step, slot, 0, kVocab);
    const std::vector<int32_t> tokens = mb.batch.tokens.to_vector<int32_t>();
    const std::vector<int32_t> cu = mb.batch.cu_seqlens.to_vector<int32_t>();
    for (std::size_t i = 0; i + 1 < cu.size(); ++i)
      seqs.emplace_back(tokens.begin() + cu[i], tokens.begin() + cu[i + 1]);
    for (int32_t t : mb.targets.to_vector<int32_t>()) targets.push_back(t);
  }
  MicroBatch m;
  m.batch = nn::make_packed_batch(seqs);
  m.targets = Tensor::from_vector(targets, {int64_t(targets.size())});
  return m;
}

int64_t global_tokens(int step) {
  int64_t n = 0;
  for (int slot = 0; slot < kSlots; ++slot) n += micro_batch(step, slot, 0, kVocab).batch.num_tokens();
  return n;
}

// What one run does: load (unless empty), train steps [first_step,
// first_step + steps), save (unless empty).
struct Phase {
  int first_step = 0;
  int steps = kSteps;
  fs::path load, save;
};

struct RunResult {
  Params params;                    // gathered; expert stacks reassembled as [E, ...]
  std::vector<std::string> errors;  // per rank, when Phase::load fails (then no training)
};

template <class S>
RunResult run_as(const Setup& s, const Phase& ph) {
  RunResult res;
  res.errors.resize(std::size_t(s.world));
  std::mutex mutex;
  comm::run_local_ranks(s.world, [&](comm::Comm& world) {
    std::unique_ptr<comm::Mesh> mesh;
    std::unique_ptr<ExpertParallel<>> ep;
    if (s.use_mesh) mesh = std::make_unique<comm::Mesh>(world, s.mesh);
    if (mesh && s.moe && s.mesh.ep > 1) ep = std::make_unique<ExpertParallel<>>(*mesh, kExperts);
    // Every rank the values of the unsplit model (init_parameters gives an
    // expert slice the values it has in the whole stack).
    nn::Qwen3Model model(tiny_config(s.tied, s.moe), {}, ep.get());
    model.init_random(7, 0.2f);
    parallel::ShardedOptions opt;
    opt.cpu_offload = s.cpu_offload;
    using Sh = Sharded<nn::Qwen3Model, S>;
    std::unique_ptr<Sh> sh;
    if constexpr (std::is_same_v<S, HybridShard>) {
      sh = std::make_unique<Sh>(std::move(model), *mesh, opt);
    } else {
      sh = mesh ? std::make_unique<Sh>(std::move(model), *mesh, opt)
                : std::make_unique<Sh>(std::move(model), world, opt);
    }
    if (!ph.load.empty()) {
      nlohmann::json meta;
      const std::string err = error_of([&] { meta = parallel::load_sharded_state(*sh, ph.load); });
      if (err != "(no error)") {
        res.errors[std::size_t(world.rank())] = err;
        return;
      }
      TCHECK(meta.at("step").get<int>() == ph.first_step);
      TCHECK(meta.at("note").get<std::string>() == "sharded checkpoint test");
      TCHECK(meta.at("adamw_steps").get<int>() == ph.first_step);
      TCHECK(sh->optimizer().step_count() == ph.first_step);
    }
    for (int step = ph.first_step; step < ph.first_step + ph.steps; ++step) {
      sh->zero_grad();
      const int r = world.rank(), w = world.size();
      const MicroBatch mb = slots(step, r * kSlots / w, (r + 1) * kSlots / w);
      sh->loss_and_backward(mb.batch, mb.targets, 1.f, double(global_tokens(step)));
      sh->optimizer_step(kLr);
    }
    if (!ph.save.empty())
      parallel::save_sharded_state(*sh, world, ph.save, ph.first_step + ph.steps,
                                   {{"note", "sharded checkpoint test"}});
    for (const std::string& name : sh->parameter_names()) {
      const Tensor t = sh->gather_parameter(name);  // collective: every rank
      const std::vector<float> v = t.to_vector<float>();
      std::lock_guard lock(mutex);
      std::vector<float>& full = res.params[name];
      if (!sh->is_expert_parameter(name)) {
        full = v;
        continue;
      }
      const int64_t per = t.numel() / t.size(0);
      full.resize(std::size_t(kExperts * per));
      std::memcpy(full.data() + sh->parameter_first_expert(name) * per, v.data(), v.size() * sizeof(float));
    }
  });
  thread_checks().require_none();
  return res;
}

RunResult run(const Setup& s, const Phase& ph) {
  INFO(s.what);
  switch (s.strategy) {
    case Strategy::full:
      return run_as<FullShard>(s, ph);
    case Strategy::no:
      return run_as<NoShard>(s, ph);
    case Strategy::hybrid:
      return run_as<HybridShard>(s, ph);
  }
  return {};
}

struct TempDir {
  fs::path path;
  explicit TempDir(const std::string& tag) {
    path = fs::temp_directory_path() / ("slime_test_sharded_ckpt_" + tag + "_" + std::to_string(::getpid()));
    fs::remove_all(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// `from` trains kSteps and saves; `to` loads and trains kSteps more. Returns
// the largest relative difference from `from` trained 2 kSteps (`baseline`).
double resume_difference(const Setup& from, const Setup& to, const Params& baseline, const std::string& tag) {
  TempDir dir(tag);
  run(from, Phase{.first_step = 0, .steps = kSteps, .load = {}, .save = dir.path});
  const RunResult resumed = run(to, Phase{.first_step = kSteps, .steps = kSteps, .load = dir.path, .save = {}});
  for (const std::string& e : resumed.errors) REQUIRE(e.empty());
  return max_rel_diff(resumed.params, baseline);
}

Params uninterrupted(const Setup& s) {
  return run(s, Phase{.first_step = 0, .steps = 2 * kSteps, .load = {}, .save = {}}).params;
}

// metadata.json of the newest checkpoint of `dir`.
nlohmann::json checkpoint_index(const fs::path& dir) {
  const io::TrainStateReader reader = io::TrainStateReader::open_latest(dir);
  std::ifstream in(reader.path() / "metadata.json");
  return nlohmann::json::parse(in);
}

}  // namespace

TEST_CASE("Sharded checkpoint: dense Qwen3 resumes with another rank count and strategy", "[fsdp][checkpoint]") {
  SECTION("FullShard 1 -> 1 and 2 -> 2: bitwise") {
    for (int n : {1, 2}) {
      const Setup s = plain("FullShard", Strategy::full, n);
      INFO(n << " ranks");
      CHECK(resume_difference(s, s, uninterrupted(s), "same") == 0.0);
    }
  }
  SECTION("FullShard 2 cpu_offload -> 2 without, and back: bitwise") {
    Setup off = plain("FullShard cpu_offload", Strategy::full, 2);
    off.cpu_offload = true;
    const Setup on = plain("FullShard", Strategy::full, 2);
    const Params want = uninterrupted(on);
    CHECK(max_rel_diff(uninterrupted(off), want) == 0.0);
    CHECK(resume_difference(off, on, want, "off_on") == 0.0);
    CHECK(resume_difference(on, off, want, "on_off") == 0.0);
  }
  SECTION("FullShard 2 -> 3 and 3 -> 1") {
    const Setup two = plain("FullShard 2", Strategy::full, 2), three = plain("FullShard 3", Strategy::full, 3);
    const double a = resume_difference(two, three, uninterrupted(two), "2_3");
    const double b = resume_difference(three, plain("FullShard 1", Strategy::full, 1), uninterrupted(three), "3_1");
    INFO("2 -> 3: " << a << ", 3 -> 1: " << b);
    CHECK(a <= 1e-6);
    CHECK(b <= 1e-6);
    WARN("dense FullShard 2 -> 3: max relative difference " << a << ", 3 -> 1: " << b);
  }
  SECTION("NoShard 2 -> FullShard 4, HybridShard 2x2 -> FullShard 2") {
    const Setup no = plain("NoShard 2", Strategy::no, 2);
    const Setup hybrid = meshed("HybridShard 2x2", Strategy::hybrid,
                                comm::MeshShape{.dp_replicate = 2, .dp_shard = 2, .cp = 1, .ep = 1}, false);
    const double a = resume_difference(no, plain("FullShard 4", Strategy::full, 4), uninterrupted(no), "no_full");
    const double b =
        resume_difference(hybrid, plain("FullShard 2", Strategy::full, 2), uninterrupted(hybrid), "hy_full");
    INFO("NoShard 2 -> FullShard 4: " << a << ", HybridShard 2x2 -> FullShard 2: " << b);
    CHECK(a <= 1e-6);
    CHECK(b <= 1e-6);
    WARN("dense NoShard 2 -> FullShard 4: " << a << ", HybridShard 2x2 -> FullShard 2: " << b);
  }
}

TEST_CASE("Sharded checkpoint: Qwen3-MoE resumes with another expert-parallel degree", "[fsdp][checkpoint][moe]") {
  const Setup full_1x2 = meshed("FullShard dp 1 x ep 2", Strategy::full, dp_ep(1, 2), true);
  const Setup no_1x2 = meshed("NoShard dp 1 x ep 2", Strategy::no, dp_ep(1, 2), true);
  const Setup full_2x2 = meshed("FullShard dp 2 x ep 2", Strategy::full, dp_ep(2, 2), true);
  const Setup dp2 = plain("FullShard dp 2 x ep 1", Strategy::full, 2, true);
  SECTION("dp 2 x ep 2 -> dp 2 x ep 2: bitwise") {
    CHECK(resume_difference(full_2x2, full_2x2, uninterrupted(full_2x2), "moe_same") == 0.0);
  }
  SECTION("dp 1 x ep 2 (FullShard, NoShard) -> dp 2 x ep 1") {
    const double a = resume_difference(full_1x2, dp2, uninterrupted(full_1x2), "moe_full_dp2");
    const double b = resume_difference(no_1x2, dp2, uninterrupted(no_1x2), "moe_no_dp2");
    INFO("FullShard 1x2 -> 2x1: " << a << ", NoShard 1x2 -> 2x1: " << b);
    CHECK(a <= 1e-6);
    CHECK(b <= 1e-6);
    WARN("MoE FullShard 1x2 -> 2x1: " << a << ", NoShard 1x2 -> 2x1: " << b);
  }
  SECTION("dp 2 x ep 2 -> dp 1 x ep 4 and -> 1 rank") {
    const Params want = uninterrupted(full_2x2);
    const double a =
        resume_difference(full_2x2, meshed("FullShard dp 1 x ep 4", Strategy::full, dp_ep(1, 4), true), want, "moe_4");
    const double b = resume_difference(full_2x2, plain("1 rank", Strategy::full, 1, true), want, "moe_1");
    INFO("2x2 -> 1x4: " << a << ", 2x2 -> 1 rank: " << b);
    CHECK(a <= 1e-6);
    CHECK(b <= 1e-6);
    WARN("MoE 2x2 -> 1x4: " << a << ", 2x2 -> 1 rank: " << b);
  }
}

TEST_CASE("Sharded checkpoint: every element of every tensor is written exactly once", "[fsdp][checkpoint]") {
  struct Case {
    Setup setup;
    std::set<int> writers;  // the ranks that may write (replicate coordinate 0)
  };
  const std::vector<Case> cases = {
      {plain("FullShard 3", Strategy::full, 3), {0, 1, 2}},
      {plain("NoShard 2", Strategy::no, 2), {0}},
      {meshed("HybridShard 2x2", Strategy::hybrid, comm::MeshShape{.dp_replicate = 2, .dp_shard = 2, .cp = 1, .ep = 1},
              false),
       {0, 1}},  // rank = dp_replicate_i * 2 + dp_shard_i
      {meshed("NoShard dp 2 x ep 2", Strategy::no, dp_ep(2, 2), true), {0, 1}},  // ep innermost: dp 0 is ranks 0, 1
      {meshed("FullShard dp 2 x ep 2", Strategy::full, dp_ep(2, 2), true), {0, 1, 2, 3}},
  };
  int index = 0;
  for (const Case& c : cases) {
    INFO(c.setup.what);
    TempDir dir("cover" + std::to_string(index++));
    const Params params = run(c.setup, Phase{.first_step = 0, .steps = 1, .load = {}, .save = dir.path}).params;
    const nlohmann::json meta = checkpoint_index(dir.path);
    CHECK(meta.at("world_size").get<int>() == c.setup.world);
    const nlohmann::json& tensors = meta.at("tensors");
    std::set<std::string> want_names, names;
    for (const auto& [name, v] : params)
      for (const std::string& n : {name, name + "/exp_avg", name + "/exp_avg_sq"}) want_names.insert(n);
    std::set<int> writers;
    bool all_tiled = true;
    for (const auto& [name, t] : tensors.items()) {
      names.insert(name);
      int64_t numel = 1;
      for (const auto& d : t.at("shape")) numel *= d.get<int64_t>();
      const std::string base = name.substr(0, name.find('/'));
      if (params.count(base)) all_tiled &= int64_t(params.at(base).size()) == numel;  // expert stacks: [E, ...]
      if (base.find("{}") != std::string::npos) all_tiled &= t.at("shape")[0].get<int64_t>() == kExperts;
      std::vector<int> cover(std::size_t(numel), 0);
      std::map<int, int> pieces_of;  // one piece per rank and tensor
      for (const auto& p : t.at("pieces")) {
        const int rank = p[0].get<int>();
        const int64_t b = p[1].get<int64_t>(), e = p[2].get<int64_t>();
        writers.insert(rank);
        all_tiled &= ++pieces_of[rank] == 1 && 0 <= b && b < e && e <= numel;
        for (int64_t i = std::max<int64_t>(b, 0); i < std::min(e, numel); ++i) ++cover[std::size_t(i)];
      }
      for (int k : cover) all_tiled &= k == 1;
      if (!all_tiled) FAIL_CHECK("tensor '" << name << "' is not tiled exactly once");
    }
    CHECK(all_tiled);
    CHECK(names == want_names);
    CHECK(std::includes(c.writers.begin(), c.writers.end(), writers.begin(), writers.end()));
    if (c.setup.use_mesh && c.setup.moe)
      CHECK(writers == c.writers);  // each ep rank writes its slice, dp replicas do not
    // The saved masters are the trained values.
    const io::TrainStateReader reader = io::TrainStateReader::open_latest(dir.path);
    bool equal = true;
    for (const auto& [name, v] : params) equal &= reader.read_range(name, 0, int64_t(v.size())).to_vector<float>() == v;
    CHECK(equal);
    CHECK(reader.metadata().at("adamw_steps").get<int>() == 1);
  }
}

TEST_CASE("Sharded checkpoint: errors are clear and a failed load changes nothing", "[fsdp][checkpoint]") {
  TempDir moe_dir("err_moe"), dense_dir("err_dense"), empty_dir("err_empty");
  run(meshed("MoE dp 1 x ep 2", Strategy::full, dp_ep(1, 2), true),
      Phase{.first_step = 0, .steps = 1, .load = {}, .save = moe_dir.path});
  run(plain("dense", Strategy::full, 2), Phase{.first_step = 0, .steps = 1, .load = {}, .save = dense_dir.path});

  SECTION("a checkpoint of another model") {
    // The dense model lacks the MoE checkpoint's experts and has MLP weights it lacks.
    const RunResult a = run(plain("dense <- MoE", Strategy::full, 2),
                            Phase{.first_step = 1, .steps = kSteps, .load = moe_dir.path, .save = {}});
    for (const std::string& e : a.errors) {
      CHECK_THAT(e, ContainsSubstring("the checkpoint has no tensor 'model.layers.1.mlp."));
      CHECK_THAT(e, ContainsSubstring("not a checkpoint of this model"));
    }
    // Tied embeddings: the checkpoint holds an lm_head this model does not have.
    Setup tied = plain("tied <- untied", Strategy::full, 2);
    tied.tied = true;
    const RunResult b = run(tied, Phase{.first_step = 1, .steps = kSteps, .load = dense_dir.path, .save = {}});
    for (const std::string& e : b.errors)
      CHECK_THAT(e, ContainsSubstring("holds tensor 'lm_head.weight' that this model does not have"));
    // A MoE with other expert counts: the whole stack's shape differs.
    const RunResult c = run(plain("MoE", Strategy::full, 1, true),
                            Phase{.first_step = 1, .steps = kSteps, .load = dense_dir.path, .save = {}});
    for (const std::string& e : c.errors) CHECK_THAT(e, ContainsSubstring("the checkpoint has no tensor"));
  }
  SECTION("no checkpoint") {
    const RunResult r = run(plain("empty", Strategy::full, 1),
                            Phase{.first_step = 0, .steps = kSteps, .load = empty_dir.path, .save = {}});
    REQUIRE(r.errors.size() == 1);
    CHECK_THAT(r.errors[0], ContainsSubstring("no checkpoint in"));
  }
  SECTION("a failed load leaves the state as it was, offloaded Sharded refused") {
    std::vector<std::string> load_err(2), save_err(2), offloaded_load(2);
    comm::run_local_ranks(2, [&](comm::Comm& world) {
      const std::size_t r = std::size_t(world.rank());
      Sharded<nn::Qwen3Model, FullShard> sh(slime_test::fsdp::make_model(tiny_config(true)), world);
      std::vector<std::vector<float>> before, moments_before;
      for (const std::string& name : sh.parameter_names())
        before.push_back(sh.gather_parameter(name).to_vector<float>());
      for (const auto& [n, t] : sh.optimizer().state_tensors()) moments_before.push_back(t.to_vector<float>());
      load_err[r] = error_of([&] { parallel::load_sharded_state(sh, dense_dir.path); });
      std::size_t i = 0;
      for (const std::string& name : sh.parameter_names())
        TCHECK(sh.gather_parameter(name).to_vector<float>() == before[i++]);
      i = 0;
      for (const auto& [n, t] : sh.optimizer().state_tensors()) TCHECK(t.to_vector<float>() == moments_before[i++]);
      TCHECK(sh.optimizer().step_count() == 0);
      sh.offload();
      save_err[r] = error_of([&] { parallel::save_sharded_state(sh, world, empty_dir.path / "x", 1, {}); });
      offloaded_load[r] = error_of([&] { parallel::load_sharded_state(sh, dense_dir.path); });
      sh.onload();
    });
    thread_checks().require_none();
    for (int r = 0; r < 2; ++r) {
      CHECK_THAT(load_err[std::size_t(r)], ContainsSubstring("lm_head.weight"));
      CHECK_THAT(save_err[std::size_t(r)], ContainsSubstring("Sharded is offloaded: call onload() first"));
      CHECK_THAT(offloaded_load[std::size_t(r)], ContainsSubstring("Sharded is offloaded: call onload() first"));
    }
    CHECK(!fs::exists(empty_dir.path / "x"));
  }
}
