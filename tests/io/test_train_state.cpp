// Sharded training state: round trips, resharding (saved by 4 ranks with
// FSDP-like padded dim-0 shards, loaded by 1, 2 and 3; saved by 3, loaded by
// 4), clear errors for bad requests and damaged checkpoints, keep_last, and
// crash safety (a child process killed with SIGKILL at every stage of a save,
// and at random times).
#include <catch2/catch_test_macros.hpp>
#include <catch2/matchers/catch_matchers_string.hpp>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "io_test_util.hpp"
#include "slime/comm/local_comm.hpp"
#include "slime/io/train_state.hpp"

using namespace slime;
using namespace slime::io;
using namespace slime::io::test;
using Catch::Matchers::ContainsSubstring;
namespace fs = std::filesystem;

namespace {

// The full (unsharded) tensors of a training state; `seed` varies the bytes.
struct Spec {
  std::string name;
  Shape shape;
  DType dtype;
};

const std::vector<Spec>& specs() {
  static const std::vector<Spec> s = {
      {"model.embed_tokens.weight", {13, 7}, DType::bf16},
      {"model.layers.0.mlp.weight", {5, 3, 2}, DType::f32},
      {"model.layers.0.mlp.weight/exp_avg", {5, 3, 2}, DType::f32},
      {"model.layers.0.mlp.weight/exp_avg_sq", {5, 3, 2}, DType::f32},
      {"model.norm.weight", {1}, DType::f16},  // one row: ranks > 0 hold nothing
      {"lm_head.bias", {3}, DType::f32},       // 4 ranks: the last holds nothing
      {"counts", {2, 2}, DType::i64},
      {"mask", {9, 5}, DType::u8},
      {"ids", {11}, DType::i32},
      {"empty", {0, 4}, DType::f32},
      {"scalar", {}, DType::f32},
  };
  return s;
}

std::vector<Tensor> full_state(uint32_t seed) {
  std::vector<Tensor> out;
  for (std::size_t i = 0; i < specs().size(); ++i)
    out.push_back(patterned(specs()[i].shape, specs()[i].dtype, seed * 1000 + uint32_t(i)));
  return out;
}

struct Range {
  int64_t begin, end, padded;  // padded: elements of the rank's shard buffer
};

// FSDP2-style dim-0 sharding: ceil(rows / world) rows per rank, the last
// ranks' shards padded (possibly entirely padding).
Range dim0_range(const Shape& shape, int world, int rank) {
  const int64_t rows = shape.rank() == 0 ? 1 : shape[0];
  const int64_t row = rows == 0 ? 0 : shape.numel() / rows;
  const int64_t chunk = (rows + world - 1) / world;
  const int64_t r0 = std::min(rows, rank * chunk), r1 = std::min(rows, r0 + chunk);
  return {r0 * row, r1 * row, chunk * row};
}

// Flat sharding: ceil(numel / world) elements per rank.
Range flat_range(const Shape& shape, int world, int rank) {
  const int64_t n = shape.numel(), chunk = (n + world - 1) / world;
  const int64_t b = std::min(n, rank * chunk), e = std::min(n, b + chunk);
  return {b, e, chunk};
}

// Rank `rank`'s pieces: views into padded shard buffers (the padding poisoned
// with 0xff), as FSDP holds them.
std::vector<TensorPiece> pieces_of(const std::vector<Tensor>& full, int world, int rank) {
  std::vector<TensorPiece> out;
  for (std::size_t i = 0; i < specs().size(); ++i) {
    const Range r = dim0_range(specs()[i].shape, world, rank);
    Tensor shard = Tensor::empty(Shape{r.padded}, specs()[i].dtype);
    shard.fill_bytes_(0xff);
    Tensor piece = shard.view(0, Shape{r.end - r.begin});
    piece.copy_from(full[i].flatten().view(r.begin, Shape{r.end - r.begin}));
    out.push_back({specs()[i].name, specs()[i].shape, r.begin, r.end, piece});
  }
  return out;
}

nlohmann::json metadata_for(int64_t step) {
  return {{"step", step},
          {"lr_schedule", {{"name", "cosine"}, {"warmup", 10}, {"last_lr", 2.5e-5}}},
          {"rng", {{"seed", 18446744073709551557ull}, {"offset", 123456789012ll}}},
          {"data", {{"epoch", 1}, {"position", 4242}}}};
}

void save_state(const fs::path& dir, int64_t step, int world, const std::vector<Tensor>& full,
                const TrainStateSaveOptions& options = {}) {
  comm::run_local_ranks(world, [&](comm::Comm& c) {
    save_train_state(c, dir, step, pieces_of(full, world, c.rank()), metadata_for(step), options);
  });
}

// Loads every tensor as `world` ranks would, with `range_of` sharding, into
// padded buffers; returns a description of the first mismatch ("" if none).
template <class RangeOf>
std::string check_load(const TrainStateReader& reader, const std::vector<Tensor>& full, int world, RangeOf range_of) {
  for (int rank = 0; rank < world; ++rank) {
    for (std::size_t i = 0; i < specs().size(); ++i) {
      const Spec& s = specs()[i];
      const Range r = range_of(s.shape, world, rank);
      Tensor shard = Tensor::empty(Shape{r.padded}, s.dtype);
      shard.fill_bytes_(0xa5);
      reader.read(TensorPiece{s.name, s.shape, r.begin, r.end, shard.view(0, Shape{r.end - r.begin})});
      const std::size_t es = dtype_size(s.dtype);
      const auto* got = static_cast<const unsigned char*>(shard.data_ptr());
      const auto* want = static_cast<const unsigned char*>(full[i].data_ptr()) + std::size_t(r.begin) * es;
      const std::string where = s.name + " rank " + std::to_string(rank) + "/" + std::to_string(world);
      // memcmp of an empty range: its pointers may be null (undefined behaviour).
      const std::size_t n = std::size_t(r.end - r.begin) * es;
      if (n > 0 && std::memcmp(got, want, n) != 0) return where + ": values differ";
      for (std::size_t b = std::size_t(r.end - r.begin) * es; b < shard.nbytes(); ++b)
        if (got[b] != 0xa5) return where + ": the read wrote past its range";
    }
  }
  return "";
}

// Every tensor of step `step` in `dir` equals `full`, read whole.
std::string check_whole(const fs::path& dir, int64_t step, const std::vector<Tensor>& full) {
  const TrainStateReader reader(dir, step);
  if (reader.metadata() != metadata_for(step)) return "metadata differs: " + reader.metadata().dump();
  for (std::size_t i = 0; i < specs().size(); ++i) {
    const Tensor t = reader.read_range(specs()[i].name, 0, specs()[i].shape.numel());
    if (!same_bytes(t, full[i].flatten())) return specs()[i].name + " differs";
  }
  return "";
}

bool has_leftovers(const fs::path& dir) {
  for (const auto& name : list_dir(dir))
    if (name.find(".tmp") != std::string::npos || name.find(".deleting-") != std::string::npos) return true;
  return false;
}

template <class F>
void expect_error(F&& f, const std::vector<std::string>& parts) {
  try {
    f();
    FAIL("expected slime::Error");
  } catch (const Error& e) {
    for (const auto& p : parts) CHECK_THAT(std::string(e.what()), ContainsSubstring(p));
  }
}

}  // namespace

TEST_CASE("train state round trip on one rank", "[io][train_state]") {
  TempDir dir;
  const fs::path ckpt = dir / "ckpt";
  CHECK_FALSE(latest_step(ckpt).has_value());
  CHECK(list_train_states(ckpt).empty());
  const auto full = full_state(1);
  save_state(ckpt, 7, 1, full);

  CHECK(latest_step(ckpt) == 7);
  CHECK(list_train_states(ckpt) == std::vector<int64_t>{7});
  CHECK(read_file(ckpt / "latest") == "step_7\n");
  CHECK(list_dir(ckpt / "step_7") == std::vector<std::string>{"metadata.json", "rank_0.safetensors"});
  CHECK_FALSE(has_leftovers(ckpt));

  const TrainStateReader reader = TrainStateReader::open_latest(ckpt);
  CHECK(reader.step() == 7);
  CHECK(reader.world_size() == 1);
  CHECK(reader.metadata() == metadata_for(7));
  CHECK(reader.metadata()["rng"]["seed"].get<uint64_t>() == 18446744073709551557ull);
  CHECK(reader.names().size() == specs().size());
  for (const Spec& s : specs()) {
    INFO(s.name);
    CHECK(reader.contains(s.name));
    CHECK(reader.shape(s.name) == s.shape);
    CHECK(reader.dtype(s.name) == s.dtype);
  }
  CHECK(check_whole(ckpt, 7, full) == "");
  CHECK(check_load(reader, full, 1, dim0_range) == "");

  // The rank file is a plain safetensors file: one 1-D tensor per piece.
  const SafetensorsFile f(ckpt / "step_7" / "rank_0.safetensors");
  CHECK(f.metadata().at("format") == "slime.train_state");
  CHECK(f.info("mask").dims == std::vector<int64_t>{45});
  CHECK_FALSE(f.contains("empty"));  // no elements, no data
  // A sub-range in the middle of one piece.
  const Tensor mid = reader.read_range("mask", 7, 30);
  CHECK(std::memcmp(mid.data_ptr(), static_cast<const char*>(full[7].data_ptr()) + 7, 23) == 0);
}

TEST_CASE("train state saved by 4 ranks loads into 1, 2 and 3 ranks bit-exact", "[io][train_state]") {
  TempDir dir;
  const auto full = full_state(2);
  save_state(dir.path, 100, 4, full);
  const TrainStateReader reader(dir.path, 100);
  CHECK(reader.world_size() == 4);
  // Which ranks hold what: "model.norm.weight" (1 row) only on rank 0.
  const nlohmann::json meta = nlohmann::json::parse(read_file(dir / "step_100" / "metadata.json"));
  CHECK(meta["tensors"]["model.norm.weight"]["pieces"] == nlohmann::json::parse("[[0, 0, 1]]"));
  CHECK(meta["tensors"]["lm_head.bias"]["pieces"] == nlohmann::json::parse("[[0, 0, 1], [1, 1, 2], [2, 2, 3]]"));
  CHECK(meta["tensors"]["empty"]["pieces"] == nlohmann::json::array());
  for (int world : {1, 2, 3, 4, 5}) {
    INFO("world " << world);
    CHECK(check_load(reader, full, world, dim0_range) == "");
    CHECK(check_load(reader, full, world, flat_range) == "");
  }
  CHECK(check_whole(dir.path, 100, full) == "");
}

TEST_CASE("train state saved by 3 ranks loads into 4 ranks, each with its own reader", "[io][train_state]") {
  TempDir dir;
  const auto full = full_state(3);
  save_state(dir.path, 5, 3, full);
  std::vector<std::string> results(4);
  comm::run_local_ranks(4, [&](comm::Comm& c) {
    const TrainStateReader reader = TrainStateReader::open_latest(dir.path);
    // check_load over one rank: shift the world so that only c.rank() runs.
    std::string r;
    for (std::size_t i = 0; i < specs().size() && r.empty(); ++i) {
      const Spec& s = specs()[i];
      const Range range = dim0_range(s.shape, 4, c.rank());
      const Tensor t = reader.read_range(s.name, range.begin, range.end);
      const std::size_t es = dtype_size(s.dtype);
      if (t.nbytes() > 0 &&
          std::memcmp(t.data_ptr(), static_cast<const char*>(full[i].data_ptr()) + std::size_t(range.begin) * es,
                      t.nbytes()) != 0)
        r = s.name + " differs";
    }
    results[std::size_t(c.rank())] = r;
  });
  for (int r = 0; r < 4; ++r) CHECK(results[std::size_t(r)] == "");
  CHECK(check_load(TrainStateReader(dir.path, 5), full, 4, dim0_range) == "");
}

TEST_CASE("train state load errors name what is wrong", "[io][train_state]") {
  TempDir dir;
  const auto full = full_state(4);
  save_state(dir.path, 3, 2, full);
  const TrainStateReader reader(dir.path, 3);
  Tensor f32 = Tensor::empty({4}, DType::f32);

  expect_error(
      [&] {
        reader.read(TensorPiece{"no.such.tensor", {4}, 0, 4, f32});
      },
      {"no tensor named 'no.such.tensor'", "step_3"});
  expect_error(
      [&] {
        reader.read(TensorPiece{"model.layers.0.mlp.weight", {6, 5}, 0, 4, f32});
      },
      {"model.layers.0.mlp.weight", "saved with shape (5, 3, 2)", "expects (6, 5)"});
  expect_error([&] { reader.read(TensorPiece{"mask", {9, 5}, 0, 4, f32}); }, {"'mask' was saved as u8", "f32"});
  expect_error(
      [&] {
        reader.read(TensorPiece{"lm_head.bias", {3}, 1, 5, f32});
      },
      {"range [1, 5)", "out of bounds", "(3,)"});
  expect_error([&] { (void)reader.read_range("lm_head.bias", -1, 2); }, {"range [-1, 2)", "out of bounds"});
  expect_error(
      [&] {
        reader.read(TensorPiece{"lm_head.bias", {3}, 0, 3, f32});
      },
      {"holds 3 elements", "destination", "holds 4"});
  expect_error([] { TrainStateReader(fs::temp_directory_path() / "slime_no_such_ckpt", 1); },
               {"step directory does not exist"});
  expect_error([&] { TrainStateReader(dir.path, 4); }, {"step_4", "does not exist"});
}

TEST_CASE("damaged train state checkpoints fail clearly", "[io][train_state]") {
  const auto full = full_state(5);
  const auto fresh = [&](const TempDir& dir) {
    save_state(dir.path, 1, 2, full);
    return dir.path / "step_1";
  };

  SECTION("missing rank file") {
    TempDir dir;
    const fs::path step = fresh(dir);
    fs::remove(step / "rank_1.safetensors");
    expect_error([&] { TrainStateReader(dir.path, 1); },
                 {"rank file 'rank_1.safetensors' is missing", "saved by 2 ranks"});
  }
  SECTION("truncated rank file") {
    TempDir dir;
    const fs::path step = fresh(dir);
    const std::string bytes = read_file(step / "rank_0.safetensors");
    write_file(step / "rank_0.safetensors", bytes.substr(0, bytes.size() - 3));
    const TrainStateReader reader(dir.path, 1);  // found when a read needs the file
    expect_error([&] { (void)reader.read_range("mask", 0, 45); },
                 {"rank_0.safetensors", "metadata.json records", "truncated"});
  }
  SECTION("corrupt rank file header, same size") {
    TempDir dir;
    const fs::path step = fresh(dir);
    std::string bytes = read_file(step / "rank_1.safetensors");
    bytes[9] = '!';  // inside the JSON header
    write_file(step / "rank_1.safetensors", bytes);
    const TrainStateReader reader(dir.path, 1);
    CHECK(reader.read_range("mask", 0, 20).numel() == 20);  // rank 0's rows only: rank 1 not opened
    expect_error([&] { (void)reader.read_range("mask", 0, 45); }, {"rank_1.safetensors", "is corrupt", "JSON"});
  }
  SECTION("rank file from another checkpoint") {
    TempDir dir;
    const fs::path step = fresh(dir);
    TempDir other;
    save_state(other.path, 1, 1, full);  // one rank: different pieces
    fs::copy_file(other / "step_1" / "rank_0.safetensors", step / "rank_0.safetensors",
                  fs::copy_options::overwrite_existing);
    const TrainStateReader reader(dir.path, 1);
    expect_error([&] { (void)reader.read_range("mask", 0, 45); }, {"rank_0.safetensors"});
  }
  SECTION("metadata.json with numbers outside an integer's range") {
    TempDir dir;
    const fs::path step = fresh(dir);
    const nlohmann::json good = nlohmann::json::parse(read_file(step / "metadata.json"));
    const auto with = [&](const nlohmann::json::json_pointer& at, const nlohmann::json& v) {
      nlohmann::json meta = good;
      meta[at] = v;
      write_file(step / "metadata.json", meta.dump());
    };
    using P = nlohmann::json::json_pointer;
    with(P("/world_size"), 1e300);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"metadata.json' is corrupt", "\"world_size\"", "1e+300"});
    with(P("/version"), -1e19);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "\"version\""});
    with(P("/step"), 9.3e18);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "\"step\""});
    with(P("/step"), 1.5);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "\"step\"", "not an integer"});
    with(P("/files/1/bytes"), -1);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "\"files\"[1].bytes"});
    with(P("/tensors/mask/shape/0"), 1e30);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "'mask' shape[0]"});
    with(P("/tensors/mask/shape"), nlohmann::json::array({int64_t(1) << 40, int64_t(1) << 40}));
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "'mask'", "2^63"});
    with(P("/tensors/mask/pieces/0/2"), 1e300);
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "'mask' piece[2]"});
    with(P("/world_size"), 2.0);  // an integral float is the integer
    CHECK(TrainStateReader(dir.path, 1).world_size() == 2);
  }
  SECTION("corrupt metadata.json") {
    TempDir dir;
    const fs::path step = fresh(dir);
    write_file(step / "metadata.json", "{\"format\": \"slime.train_state\", \"version\": 1, ");
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"metadata.json' is corrupt", "not valid JSON"});
    nlohmann::json meta = {{"format", "slime.train_state"}, {"version", 1}, {"step", 1}, {"world_size", 1}};
    write_file(step / "metadata.json", meta.dump());
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"metadata.json' is corrupt"});
  }
  SECTION("metadata.json with a hole in a tensor") {
    TempDir dir;
    const fs::path step = fresh(dir);
    nlohmann::json meta = nlohmann::json::parse(read_file(step / "metadata.json"));
    meta["tensors"]["mask"]["pieces"].erase(1);
    write_file(step / "metadata.json", meta.dump());
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"corrupt", "'mask'", "held by no rank"});
  }
  SECTION("missing metadata.json is an incomplete checkpoint") {
    TempDir dir;
    const fs::path step = fresh(dir);
    fs::remove(step / "metadata.json");
    expect_error([&] { TrainStateReader(dir.path, 1); }, {"metadata.json", "missing", "incomplete"});
    expect_error([&] { (void)latest_step(dir.path); }, {"latest", "names step 1", "incomplete"});
    CHECK(list_train_states(dir.path).empty());
  }
  SECTION("corrupt latest") {
    TempDir dir;
    fresh(dir);
    write_file(dir / "latest", "garbage\n");
    expect_error([&] { (void)latest_step(dir.path); }, {"latest", "corrupt", "garbage"});
    expect_error([&] { (void)TrainStateReader::open_latest(dir.path); }, {"corrupt"});
  }
}

// Rank files that are whole, valid safetensors files of the right format, but
// not this checkpoint's file of this rank: the identity in their headers
// (rank, world size, step, run id, save id) must fail the read, naming the
// file and the field, whatever their size.
TEST_CASE("train state rank files of another rank, step or run fail clearly", "[io][train_state]") {
  const auto full = full_state(6);
  const auto save = [&](const fs::path& dir, int64_t step, const std::string& run_id) {
    TrainStateSaveOptions options;
    options.run_id = run_id;
    save_state(dir, step, 2, full, options);
    return train_state_step_dir(dir, step);
  };
  const auto read_all = [&](const fs::path& dir, int64_t step) {
    const TrainStateReader reader(dir, step);
    for (const Spec& s : specs()) (void)reader.read_range(s.name, 0, s.shape.numel());
  };

  SECTION("the ids are recorded in metadata.json and every rank file") {
    TempDir dir;
    const fs::path step = save(dir.path, 4, "run-a");
    const TrainStateReader reader(dir.path, 4);
    CHECK(reader.version() == kTrainStateVersion);
    CHECK(reader.run_id() == "run-a");
    CHECK(reader.save_id().size() == 32);
    for (int r = 0; r < 2; ++r) {
      const SafetensorsFile f(step / ("rank_" + std::to_string(r) + ".safetensors"));
      CHECK(f.metadata().at("rank") == std::to_string(r));
      CHECK(f.metadata().at("world_size") == "2");
      CHECK(f.metadata().at("step") == "4");
      CHECK(f.metadata().at("run_id") == "run-a");
      CHECK(f.metadata().at("save_id") == reader.save_id());
    }
    // Re-saving the step makes a new save id; an empty run id is this process's.
    save(dir.path, 4, "");
    const TrainStateReader again(dir.path, 4);
    CHECK(again.save_id() != reader.save_id());
    CHECK(again.run_id() == process_run_id());
    CHECK(make_run_id() != make_run_id());
    CHECK(check_whole(dir.path, 4, full) == "");
  }
  SECTION("swapped rank files") {
    TempDir dir;
    const fs::path step = save(dir.path, 3, "run-a");
    fs::rename(step / "rank_0.safetensors", step / "tmp");
    fs::rename(step / "rank_1.safetensors", step / "rank_0.safetensors");
    fs::rename(step / "tmp", step / "rank_1.safetensors");
    expect_error([&] { read_all(dir.path, 3); },
                 {"step_3", "rank file 'rank_0.safetensors' records rank 1", "file of rank 0", "swapped"});
  }
  SECTION("a rank file from another step of the same run") {
    TempDir dir;
    const fs::path step3 = save(dir.path, 3, "run-a");
    const fs::path step5 = save(dir.path, 5, "run-a");  // same tensors, same sizes
    fs::copy_file(step3 / "rank_1.safetensors", step5 / "rank_1.safetensors", fs::copy_options::overwrite_existing);
    expect_error([&] { read_all(dir.path, 5); }, {"step_5", "rank file 'rank_1.safetensors' records step 3",
                                                  "metadata.json records step 5", "another step"});
  }
  SECTION("a rank file from another run at the same step") {
    TempDir dir, other;
    const fs::path mine = save(dir.path, 3, "run-a");
    const fs::path theirs = save(other.path, 3, "run-b");
    fs::copy_file(theirs / "rank_0.safetensors", mine / "rank_0.safetensors", fs::copy_options::overwrite_existing);
    expect_error([&] { read_all(dir.path, 3); }, {"rank file 'rank_0.safetensors' records run_id run-b",
                                                  "metadata.json records run_id run-a", "another run"});
  }
  SECTION("a rank file from an earlier save of the same step and run") {
    TempDir dir, copy;
    const fs::path step = save(dir.path, 3, "run-a");
    fs::copy_file(step / "rank_1.safetensors", copy / "rank_1.safetensors");
    save(dir.path, 3, "run-a");
    fs::copy_file(copy / "rank_1.safetensors", step / "rank_1.safetensors", fs::copy_options::overwrite_existing);
    expect_error([&] { read_all(dir.path, 3); }, {"rank file 'rank_1.safetensors' records save_id", "another save"});
  }
  SECTION("a version 1 checkpoint (no ids) still loads; its rank files are still checked") {
    TempDir dir;
    const fs::path step = save(dir.path, 2, "run-a");
    nlohmann::json meta = nlohmann::json::parse(read_file(step / "metadata.json"));
    meta["version"] = 1;
    meta.erase("run_id");
    meta.erase("save_id");
    write_file(step / "metadata.json", meta.dump());
    const TrainStateReader reader(dir.path, 2);
    CHECK(reader.version() == 1);
    CHECK(reader.run_id().empty());
    CHECK(check_whole(dir.path, 2, full) == "");
    fs::rename(step / "rank_0.safetensors", step / "tmp");
    fs::rename(step / "rank_1.safetensors", step / "rank_0.safetensors");
    fs::rename(step / "tmp", step / "rank_1.safetensors");
    expect_error([&] { read_all(dir.path, 2); }, {"rank_0.safetensors' records rank 1"});
    meta["version"] = 3;
    write_file(step / "metadata.json", meta.dump());
    expect_error([&] { TrainStateReader(dir.path, 2); }, {"version 3", "reads versions 1 to 2"});
  }
}

TEST_CASE("train state save checks pieces on every rank and throws on all", "[io][train_state]") {
  TempDir dir;
  const auto full = full_state(6);
  const auto save_with = [&](auto&& edit) {
    comm::run_local_ranks(3, [&](comm::Comm& c) {
      std::vector<TensorPiece> pieces = pieces_of(full, 3, c.rank());
      edit(c.rank(), pieces);
      save_train_state(c, dir.path, 9, pieces);
    });
  };
  // run_local_ranks rethrows the first rank's error; every rank throws the
  // same one (a rank that returned normally would make another rank time out).
  expect_error(
      [&] {
        save_with([](int r, auto& p) {
          if (r == 1) p[1].end += 1;
        });
      },
      {"rank 1", "model.layers.0.mlp.weight", "holds 13 elements", "data is"});
  expect_error(
      [&] {
        save_with([](int r, auto& p) {
          if (r == 2) p.pop_back(), p.erase(p.begin() + 7);
        });
      },
      {"'mask'", "elements [30, 45) of 45 are held by no rank"});
  expect_error(
      [&] {
        save_with([&](int r, auto& p) {
          if (r == 2) p[5] = TensorPiece{"lm_head.bias", {3}, 0, 3, full[5]};  // overlaps ranks 0, 1
        });
      },
      {"'lm_head.bias'", "overlaps", "one rank only"});
  expect_error(
      [&] {
        save_with([](int r, auto& p) {
          if (r == 0) p[2].shape = Shape{30};
        });
      },
      {"exp_avg'", "(30,) on rank 0", "(5, 3, 2) on rank 1"});
  expect_error(
      [&] {
        save_with([](int r, auto& p) {
          if (r == 1) p.push_back(p[0]);
        });
      },
      {"rank 1", "more than one piece"});
  expect_error(
      [&] {
        save_with([](int r, auto& p) {
          if (r == 0) p[0].end = 999;
        });
      },
      {"rank 0", "out of bounds"});
  // Nothing became visible and nothing was left behind.
  CHECK(list_dir(dir.path).empty());
  CHECK_FALSE(latest_step(dir.path).has_value());

  expect_error(
      [&] {
        comm::run_local_ranks(1, [&](comm::Comm& c) { save_train_state(c, dir.path, 1, {}, nlohmann::json(3)); });
      },
      {"rank 0 failed", "metadata must be a JSON object"});
}

TEST_CASE("keep_last deletes old checkpoints after the new one, and re-saving a step replaces it",
          "[io][train_state]") {
  TempDir dir;
  TrainStateSaveOptions keep2;
  keep2.keep_last = 2;
  std::vector<std::string> events;
  keep2.on_event = [&](std::string_view e) { events.emplace_back(e); };
  for (int64_t step = 1; step <= 5; ++step) save_state(dir.path, step, 1, full_state(uint32_t(step)), keep2);
  CHECK(list_train_states(dir.path) == std::vector<int64_t>{4, 5});
  CHECK(latest_step(dir.path) == 5);
  CHECK(events.size() == 5 * (2 + specs().size() - 1 + 4));  // prepared, pieces with data, file, 4 rank-0 stages
  CHECK(events.back() == "pruned");

  // A leftover of an interrupted save goes with the next successful one.
  fs::create_directory(dir / "step_6.tmp-dead");
  write_file(dir / "step_6.tmp-dead" / "rank_0.safetensors", "partial");
  save_state(dir.path, 5, 1, full_state(55), keep2);  // re-save step 5 with other values
  CHECK(list_train_states(dir.path) == std::vector<int64_t>{4, 5});
  CHECK_FALSE(has_leftovers(dir.path));
  CHECK(check_whole(dir.path, 5, full_state(55)) == "");
  CHECK(check_whole(dir.path, 4, full_state(4)) == "");

  // Resuming from 4 and saving 4 again leaves the later step 5 alone.
  TrainStateSaveOptions keep1;
  keep1.keep_last = 1;
  save_state(dir.path, 4, 1, full_state(44), keep1);
  CHECK(list_train_states(dir.path) == std::vector<int64_t>{4, 5});
  CHECK(latest_step(dir.path) == 4);
  save_state(dir.path, 6, 1, full_state(6), keep1);
  CHECK(list_train_states(dir.path) == std::vector<int64_t>{6});
  CHECK(list_dir(dir.path) == std::vector<std::string>{"latest", "step_6"});
}

namespace {

// Runs `fn` in a child process and returns its wait status.
template <class F>
int in_child(F&& fn) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    int code = 0;
    try {
      fn();
    } catch (...) {
      code = 3;
    }
    ::_exit(code);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return status;
}

// What a crashed save must leave: `latest` names a complete step, every step
// directory is complete and bit-exact, and only steps 1 and 2 exist.
std::string check_after_crash(const fs::path& dir, const std::vector<Tensor>& step1, const std::vector<Tensor>& step2) {
  const std::optional<int64_t> latest = latest_step(dir);
  if (!latest || (*latest != 1 && *latest != 2)) return "latest is not step 1 or 2";
  for (const auto& name : list_dir(dir)) {
    const auto step = io::detail::parse_step_name(name);
    if (!step) continue;
    if (!fs::exists(dir / name / "metadata.json")) return name + " is visible but incomplete";
    if (*step != 1 && *step != 2) return "unexpected " + name;
    if (std::string err = check_whole(dir, *step, *step == 1 ? step1 : step2); !err.empty()) return name + ": " + err;
  }
  return check_whole(dir, *latest, *latest == 1 ? step1 : step2);
}

}  // namespace

TEST_CASE("a save killed at any stage leaves the previous checkpoint intact", "[io][train_state]") {
  const auto step1 = full_state(11), step2 = full_state(22);
  struct Stage {
    std::string event;
    int occurrence;    // kill at this occurrence of the event (on any rank)
    int64_t expected;  // latest after the kill
  };
  const std::vector<Stage> stages = {
      {"prepared", 1, 1},          {"tensor_written", 1, 1},   {"tensor_written", 7, 1}, {"rank_file_written", 1, 1},
      {"rank_file_written", 2, 1}, {"metadata_written", 1, 1}, {"published", 1, 1},      {"latest_updated", 1, 2},
  };
  for (const Stage& stage : stages) {
    INFO(stage.event << " #" << stage.occurrence);
    TempDir dir;
    save_state(dir.path, 1, 2, step1);
    const int status = in_child([&] {
      std::atomic<int> seen{0};
      TrainStateSaveOptions options;
      options.on_event = [&](std::string_view e) {
        if (e == stage.event && ++seen == stage.occurrence) ::raise(SIGKILL);
      };
      save_state(dir.path, 2, 2, step2, options);
    });
    REQUIRE(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGKILL);
    CHECK(latest_step(dir.path) == stage.expected);
    CHECK(check_after_crash(dir.path, step1, step2) == "");
    CHECK(check_whole(dir.path, 1, step1) == "");
    // The next save succeeds and clears what the killed one left.
    save_state(dir.path, 2, 2, step2);
    CHECK(latest_step(dir.path) == 2);
    CHECK(check_whole(dir.path, 2, step2) == "");
    CHECK_FALSE(has_leftovers(dir.path));
  }
}

TEST_CASE("saves killed at random times never expose a partial checkpoint", "[io][train_state]") {
  // Large enough that a save takes a while: 4 MiB of pieces over 2 ranks.
  // Step 1 holds one pattern, every later step another.
  const auto big = [](uint32_t seed) {
    std::vector<Tensor> out;
    for (int i = 0; i < 4; ++i) out.push_back(patterned({256, 1024}, DType::f32, seed + uint32_t(i)));
    return out;
  };
  const auto step1 = big(1), later = big(2);
  TrainStateSaveOptions keep3;
  keep3.keep_last = 3;
  const auto save_big = [&](const fs::path& dir, int64_t step) {
    const auto& full = step == 1 ? step1 : later;
    comm::run_local_ranks(2, [&](comm::Comm& c) {
      std::vector<TensorPiece> pieces;
      for (std::size_t i = 0; i < full.size(); ++i) {
        const Range r = dim0_range(full[i].shape(), 2, c.rank());
        pieces.push_back({"w" + std::to_string(i), full[i].shape(), r.begin, r.end,
                          full[i].flatten().view(r.begin, Shape{r.end - r.begin})});
      }
      save_train_state(c, dir, step, pieces, {{"step", step}}, keep3);
    });
  };
  // Every visible step is complete and bit-exact; `latest` is one of them.
  const auto check = [&](const fs::path& dir) -> std::string {
    const std::optional<int64_t> latest = latest_step(dir);
    if (!latest) return "no latest";
    const std::vector<int64_t> steps = list_train_states(dir);
    if (std::find(steps.begin(), steps.end(), *latest) == steps.end()) return "latest is not a listed step";
    for (int64_t step : steps) {
      const TrainStateReader reader(dir, step);
      if (reader.metadata() != nlohmann::json{{"step", step}}) return "metadata of step " + std::to_string(step);
      const auto& full = step == 1 ? step1 : later;
      for (std::size_t i = 0; i < full.size(); ++i)
        if (!same_bytes(reader.read_range("w" + std::to_string(i), 0, full[i].numel()), full[i].flatten()))
          return "step " + std::to_string(step) + " differs";
    }
    for (const auto& name : list_dir(dir))
      if (io::detail::parse_step_name(name) && !fs::exists(dir / name / "metadata.json")) return name + " incomplete";
    return "";
  };

  TempDir dir;
  save_big(dir.path, 1);
  const auto t0 = std::chrono::steady_clock::now();
  {
    TempDir timing;
    save_big(timing.path, 2);
  }
  const auto save_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0);
  std::mt19937 rng(12345);
  int killed = 0, advanced = 0;
  int64_t previous = 1;
  for (int trial = 0; trial < 16; ++trial) {
    const int64_t step = trial + 2;
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      try {
        save_big(dir.path, step);
      } catch (...) {
        ::_exit(3);
      }
      ::_exit(0);
    }
    const auto delay = std::uniform_int_distribution<int64_t>(0, save_us.count() * 5 / 4)(rng);
    std::this_thread::sleep_for(std::chrono::microseconds(delay));
    ::kill(pid, SIGKILL);
    int status = 0;
    REQUIRE(::waitpid(pid, &status, 0) == pid);
    killed += WIFSIGNALED(status) ? 1 : 0;
    if (WIFEXITED(status)) CHECK(WEXITSTATUS(status) == 0);
    INFO("trial " << trial << ", killed after " << delay << " us of a ~" << save_us.count() << " us save");
    REQUIRE(check(dir.path) == "");
    // `latest` moves only to the step being saved.
    const int64_t latest = *latest_step(dir.path);
    CHECK((latest == previous || latest == step));
    advanced += latest == step ? 1 : 0;
    previous = latest;
  }
  CHECK(killed > 0);
  UNSCOPED_INFO(killed << " of 16 saves killed, " << advanced << " completed before the kill");
}
