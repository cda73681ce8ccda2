// slime/io/train_state.cpp: the bodies of slime/io/train_state.hpp (the collective save, the
// metadata, pruning, the reader). Tensors are only inspected here (dtype, shape, views); the steps
// that allocate or copy them arrive as TrainStateSaveOps or stay inline in the header.
#include "slime/io/train_state.hpp"

#include "slime/core/json.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace slime::io {
namespace detail {
namespace {

std::string rank_file_name(int rank) { return "rank_" + std::to_string(rank) + ".safetensors"; }

std::string format_range(int64_t begin, int64_t end) { return concat("[", begin, ", ", end, ")"); }

// Empty when `pieces` (sorted by begin) tile [0, numel) exactly; else what
// is wrong.
std::string tiling_error(std::string_view name, int64_t numel, const std::vector<SavedPiece>& pieces) {
  int64_t covered = 0;
  const SavedPiece* previous = nullptr;
  for (const SavedPiece& p : pieces) {
    if (p.begin < 0 || p.end < p.begin || p.end > numel)
      return concat("tensor '", name, "': rank ", p.rank, " piece ", format_range(p.begin, p.end),
                    " is not a range inside [0, ", numel, ")");
    if (p.begin < covered)
      return concat("tensor '", name, "': rank ", p.rank, " piece ", format_range(p.begin, p.end), " overlaps rank ",
                    previous->rank, " piece ", format_range(previous->begin, previous->end),
                    " (save a replicated tensor from one rank only)");
    if (p.begin > covered)
      return concat("tensor '", name, "': elements ", format_range(covered, p.begin), " of ", numel,
                    " are held by no rank");
    covered = p.end;
    previous = &p;
  }
  if (covered != numel)
    return concat("tensor '", name, "': elements ", format_range(covered, numel), " of ", numel,
                  " are held by no rank");
  return {};
}

// j as an integer of type T: a JSON integer inside T's range, or a float
// that is integral and inside it (a JSON writer may print 1e3 for 1000).
// Anything else is an Error naming `what`, never an out-of-range cast.
template <class T>
T json_integer(const nlohmann::json& j, std::string_view what) {
  using L = std::numeric_limits<T>;
  if (j.is_number_unsigned()) {
    const uint64_t v = j.get<uint64_t>();
    if (v <= uint64_t(L::max())) return T(v);
  } else if (j.is_number_integer()) {
    const int64_t v = j.get<int64_t>();
    if (v >= int64_t(L::min()) && (v < 0 || uint64_t(v) <= uint64_t(L::max()))) return T(v);
  } else if (j.is_number_float()) {
    // Range check in double before the cast (a cast of an out-of-range
    // double is undefined): T holds [lo, hi) with hi = 2^digits exactly.
    const double d = j.get<double>();
    const double hi = std::ldexp(1.0, L::digits), lo = L::is_signed ? -hi : 0.0;
    if (std::isfinite(d) && d == std::trunc(d) && d >= lo && d < hi) return T(d);
  } else {
    SLIME_FAIL(what, " is not a number: ", json_excerpt(j));
  }
  SLIME_FAIL(what, " is ", json_excerpt(j), ", not an integer in [", L::min(), ", ", L::max(), "]");
}

template <class T>
std::vector<T> json_integers(const nlohmann::json& j, std::string_view what) {
  if (!j.is_array()) SLIME_FAIL(what, " is not an array: ", json_excerpt(j));
  std::vector<T> out;
  for (std::size_t i = 0; i < j.size(); ++i) out.push_back(json_integer<T>(j[i], concat(what, "[", i, "]")));
  return out;
}

std::string shape_json_str(const nlohmann::json& dims) {
  std::string s = "(";
  for (std::size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i].dump();
  return s + (dims.size() == 1 ? ",)" : ")");
}

// metadata.json from every rank's description of its pieces (the same
// result, or the same error, on every rank).
nlohmann::json build_train_state_metadata(int64_t step, const std::vector<nlohmann::json>& ranks,
                                          const nlohmann::json& user, const std::string& run_id,
                                          const std::string& save_id) {
  using nlohmann::json;
  const int world = int(ranks.size());
  struct Info {
    std::string dtype;
    json shape;
    int first_rank = 0;
    std::vector<SavedPiece> pieces;
  };
  std::map<std::string, Info> tensors;
  json files = json::array();
  for (int r = 0; r < world; ++r) {
    const json& d = ranks[std::size_t(r)];
    if (d.at("step").get<int64_t>() != step)
      SLIME_FAIL("rank ", r, " saves step ", d.at("step").get<int64_t>(), " but rank 0 saves step ", step);
    files.push_back({{"rank", r}, {"file", rank_file_name(r)}, {"bytes", d.at("bytes")}});
    for (const json& p : d.at("pieces")) {
      const std::string name = p.at("name").get<std::string>();
      auto [it, added] = tensors.try_emplace(name, Info{p.at("dtype").get<std::string>(), p.at("shape"), r, {}});
      Info& t = it->second;
      if (!added && (t.dtype != p.at("dtype").get<std::string>() || t.shape != p.at("shape")))
        SLIME_FAIL("tensor '", name, "' is ", t.dtype, " ", shape_json_str(t.shape), " on rank ", t.first_rank, " but ",
                   p.at("dtype").get<std::string>(), " ", shape_json_str(p.at("shape")), " on rank ", r);
      const int64_t begin = p.at("begin").get<int64_t>(), end = p.at("end").get<int64_t>();
      if (end > begin) t.pieces.push_back({r, begin, end});
    }
  }
  json out_tensors = json::object();
  for (auto& [name, t] : tensors) {
    std::sort(t.pieces.begin(), t.pieces.end(),
              [](const SavedPiece& a, const SavedPiece& b) { return a.begin < b.begin; });
    int64_t numel = 1;
    for (const json& e : t.shape) numel *= e.get<int64_t>();
    if (std::string err = tiling_error(name, numel, t.pieces); !err.empty()) SLIME_FAIL(err);
    json pieces = json::array();
    for (const SavedPiece& p : t.pieces) pieces.push_back({p.rank, p.begin, p.end});
    out_tensors[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"pieces", std::move(pieces)}};
  }
  return {{"format", kTrainStateFormat},
          {"version", kTrainStateVersion},
          {"step", step},
          {"world_size", world},
          {"run_id", run_id},
          {"save_id", save_id},
          {"files", std::move(files)},
          {"tensors", std::move(out_tensors)},
          {"metadata", user}};
}

}  // namespace

// "step_<digits>" -> the step; anything else (tmp and deleting directories
// included) -> nullopt.
std::optional<int64_t> parse_step_name(std::string_view s) {
  constexpr std::string_view pre = "step_";
  if (!s.starts_with(pre) || s.size() == pre.size()) return std::nullopt;
  s.remove_prefix(pre.size());
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < 0) return std::nullopt;
  return v;
}

}  // namespace detail

std::string make_run_id() {
  std::random_device rd;
  char buf[40];
  std::snprintf(buf, sizeof buf, "%08x%08x%08x%08x", rd(), rd(), rd(), rd());
  return buf;
}

const std::string& process_run_id() {
  static const std::string id = make_run_id();
  return id;
}

// Steps of the complete checkpoints in `dir` (step_<k> directories holding
// metadata.json), ascending. Empty when `dir` does not exist.
std::vector<int64_t> list_train_states(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::vector<int64_t> steps;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return steps;
  std::error_code list_ec;
  for (const auto& e : fs::directory_iterator(dir, list_ec)) {
    const auto step = detail::parse_step_name(e.path().filename().string());
    if (step && fs::is_regular_file(e.path() / kTrainStateMetadataFile, ec)) steps.push_back(*step);
  }
  if (list_ec) SLIME_FAIL("cannot list checkpoint directory '", dir.string(), "': ", list_ec.message());
  std::sort(steps.begin(), steps.end());
  return steps;
}

namespace detail {
namespace {

// Deletes what keep_last says is old, and leftovers of interrupted saves and
// deletions. A checkpoint leaves the step_<k> namespace (rename) before its
// files go.
void prune_train_states(const std::filesystem::path& dir, int64_t step, int keep_last) {
  namespace fs = std::filesystem;
  std::vector<fs::path> doomed;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("step_") &&
        (name.find(".tmp-") != std::string::npos || name.find(".deleting-") != std::string::npos))
      doomed.push_back(e.path());
  }
  if (ec) SLIME_FAIL("cannot list '", dir.string(), "': ", ec.message());
  if (keep_last > 0) {
    std::vector<int64_t> older;
    const std::vector<int64_t> steps = list_train_states(dir);
    for (auto it = steps.rbegin(); it != steps.rend(); ++it)
      if (*it < step) older.push_back(*it);
    bool renamed = false;
    for (std::size_t i = std::size_t(keep_last - 1); i < older.size(); ++i) {
      const fs::path from = train_state_step_dir(dir, older[i]);
      const fs::path to = from.string() + ".deleting-" + make_nonce();
      if (::rename(from.c_str(), to.c_str()) != 0)
        SLIME_FAIL("cannot move old checkpoint '", from.string(), "' aside to delete it: ", errno_text(errno));
      renamed = true;
      doomed.push_back(to);
    }
    if (renamed) fsync_directory(dir);
  }
  for (const fs::path& p : doomed) {
    fs::remove_all(p, ec);
    if (ec) SLIME_FAIL("cannot delete '", p.string(), "': ", ec.message());
  }
}

}  // namespace
}  // namespace detail

std::optional<int64_t> latest_step(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  const fs::path path = dir / kTrainStateLatestFile;
  std::error_code ec;
  if (!fs::exists(path, ec)) return std::nullopt;
  std::string text;
  {
    const detail::MappedFile file(path);
    text.assign(reinterpret_cast<const char*>(file.data()), file.size());
  }
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  const auto step = detail::parse_step_name(text);
  if (!step)
    SLIME_FAIL("checkpoint pointer '", path.string(), "' is corrupt: expected 'step_<k>', found '", text.substr(0, 64),
               "'");
  const fs::path meta = train_state_step_dir(dir, *step) / kTrainStateMetadataFile;
  if (!fs::is_regular_file(meta, ec))
    SLIME_FAIL("checkpoint pointer '", path.string(), "' names step ", *step, " but '", meta.string(),
               "' does not exist (the step directory was deleted or is incomplete)");
  return step;
}
namespace detail {

void save_train_state_with(comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                           const std::vector<TensorPiece>& pieces, const nlohmann::json& metadata,
                           const TrainStateSaveOptions& options, const TrainStateSaveOps& ops) {
  namespace fs = std::filesystem;
  using nlohmann::json;
  const int rank = comm.rank(), world = comm.size();
  const std::string where = slime::detail::concat("save_train_state('", dir.string(), "', step ", step, ")");
  const auto event = [&](std::string_view e) {
    if (options.on_event) options.on_event(e);
  };
  const auto error_json = [](const std::exception& e) {
    const auto* err = dynamic_cast<const Error*>(&e);
    return json{{"error", err != nullptr ? err->message() : std::string(e.what())}};
  };

  // 1. Rank 0 creates the temporary directory and tells every rank its name.
  json prepared = json::object();
  if (rank == 0) {
    try {
      SLIME_CHECK(step >= 0, "step must be non-negative");
      SLIME_CHECK(options.keep_last >= 0, "keep_last must be non-negative, got ", options.keep_last);
      SLIME_CHECK(metadata.is_object(), "metadata must be a JSON object, got a JSON ", metadata.type_name());
      std::error_code ec;
      fs::create_directories(dir, ec);
      if (ec) SLIME_FAIL("cannot create '", dir.string(), "': ", ec.message());
      const fs::path tmp = train_state_step_dir(dir, step).string() + ".tmp-" + detail::make_nonce();
      if (!fs::create_directory(tmp, ec) || ec) SLIME_FAIL("cannot create '", tmp.string(), "': ", ec.message());
      prepared["tmp"] = tmp.string();
      prepared["run_id"] = options.run_id.empty() ? process_run_id() : options.run_id;
      prepared["save_id"] = make_run_id();
      event("prepared");
    } catch (const std::exception& e) {
      prepared = error_json(e);
    }
  }
  const json from_root = json::parse(ops.all_gather_strings(comm, prepared.dump())[0]);
  if (from_root.contains("error")) SLIME_FAIL(where, ": rank 0 failed: ", from_root["error"].get<std::string>());
  const fs::path tmp = from_root.at("tmp").get<std::string>();
  const std::string run_id = from_root.at("run_id").get<std::string>();
  const std::string save_id = from_root.at("save_id").get<std::string>();
  // Rank 0 removes the temporary directory unless the save succeeds.
  std::optional<detail::TempDirGuard> guard;
  if (rank == 0) guard.emplace(tmp);

  // 2. Every rank writes its file and describes its pieces.
  json mine = {{"step", step}};
  try {
    json list = json::array();
    std::vector<SafetensorsEntry> entries;
    std::set<std::string_view> names;
    for (const TensorPiece& p : pieces) {
      const std::string what = slime::detail::concat("piece of tensor '", p.name, "'");
      SLIME_CHECK(!p.name.empty() && p.name != "__metadata__", "invalid tensor name '", p.name, "'");
      SLIME_CHECK(names.insert(p.name).second, "tensor '", p.name,
                  "' has more than one piece on this rank (one range per tensor and rank)");
      SLIME_CHECK(p.data.defined(), what, ": data is undefined");
      const int64_t numel = p.shape.numel();
      SLIME_CHECK(0 <= p.begin && p.begin <= p.end && p.end <= numel, what, ": range ",
                  detail::format_range(p.begin, p.end), " is out of bounds for shape ", p.shape, " (", numel,
                  " elements)");
      SLIME_CHECK(p.data.numel() == p.end - p.begin, what, ": range ", detail::format_range(p.begin, p.end), " holds ",
                  p.end - p.begin, " elements but the data is ", p.data.str());
      list.push_back({{"name", p.name},
                      {"dtype", safetensors_dtype_name(p.data.dtype())},
                      {"shape", std::vector<int64_t>(p.shape.begin(), p.shape.end())},
                      {"begin", p.begin},
                      {"end", p.end}});
      if (p.end > p.begin) entries.push_back({p.name, p.data.dtype(), Shape{p.end - p.begin}});
    }
    const fs::path file = tmp / detail::rank_file_name(rank);
    SafetensorsWriter writer(file, std::move(entries),
                             {{"format", std::string(kTrainStateFormat)},
                              {"version", std::to_string(kTrainStateVersion)},
                              {"rank", std::to_string(rank)},
                              {"world_size", std::to_string(world)},
                              {"step", std::to_string(step)},
                              {"run_id", run_id},
                              {"save_id", save_id}});
    for (const TensorPiece& p : pieces) {
      if (p.end == p.begin) continue;
      ops.write_piece(writer, p.name, p.data.flatten());
      event("tensor_written");
    }
    writer.commit();  // fsync, rename inside tmp, fsync tmp
    mine["pieces"] = std::move(list);
    mine["bytes"] = uint64_t(fs::file_size(file));
    event("rank_file_written");
  } catch (const std::exception& e) {
    mine = error_json(e);
  }
  std::vector<json> ranks;
  {
    std::string failures;
    for (const std::string& s : ops.all_gather_strings(comm, mine.dump())) {
      ranks.push_back(json::parse(s));
      if (ranks.back().contains("error"))
        failures += slime::detail::concat(failures.empty() ? "" : "; ", "rank ", ranks.size() - 1, ": ",
                                          ranks.back()["error"].get<std::string>());
    }
    if (!failures.empty()) SLIME_FAIL(where, " failed: ", failures);
  }
  // Every rank computes the same metadata (or throws the same error).
  json meta;
  try {
    meta = detail::build_train_state_metadata(step, ranks, rank == 0 ? metadata : json::object(), run_id, save_id);
  } catch (const Error& e) {
    SLIME_FAIL(where, ": ", e.message());
  }

  // 3. Rank 0 publishes; every rank learns the outcome.
  json published = json::object();
  if (rank == 0) {
    try {
      detail::write_file_atomically(tmp / kTrainStateMetadataFile, meta.dump(1) + "\n");
      event("metadata_written");
      detail::publish_directory(tmp, train_state_step_dir(dir, step));
      guard->release();
      event("published");
      detail::write_file_atomically(dir / kTrainStateLatestFile, "step_" + std::to_string(step) + "\n");
      event("latest_updated");
      try {
        detail::prune_train_states(dir, step, options.keep_last);
      } catch (const Error& e) {
        SLIME_FAIL("the checkpoint is complete, but deleting old ones failed: ", e.message());
      }
      event("pruned");
    } catch (const std::exception& e) {
      published = error_json(e);
    }
  }
  const json outcome = json::parse(ops.all_gather_strings(comm, published.dump())[0]);
  if (outcome.contains("error")) SLIME_FAIL(where, ": rank 0 failed: ", outcome["error"].get<std::string>());
}

}  // namespace detail

void TrainStateReader::check_range(std::string_view name, int64_t begin, int64_t end, const Tensor& out) const {
  const Entry& t = entry(name);
  const int64_t numel = t.shape.numel();
  if (!(0 <= begin && begin <= end && end <= numel))
    fail("range ", detail::format_range(begin, end), " of tensor '", name, "' is out of bounds for its shape ", t.shape,
         " (", numel, " elements)");
  if (!out.defined()) fail("destination for tensor '", name, "' is undefined");
  if (out.dtype() != t.dtype)
    fail("tensor '", name, "' was saved as ", dtype_name(t.dtype), " but the destination is ", out.str());
  if (out.numel() != end - begin)
    fail("range ", detail::format_range(begin, end), " of tensor '", name, "' holds ", end - begin,
         " elements but the destination ", out.str(), " holds ", out.numel());
}

void TrainStateReader::copy_range(std::string_view name, int64_t begin, int64_t end, std::byte* dst) const {
  const Entry& t = entry(name);
  const std::size_t esize = dtype_size(t.dtype);
  // Pieces are sorted by begin and tile [0, numel).
  auto it = std::upper_bound(t.pieces.begin(), t.pieces.end(), begin,
                             [](int64_t b, const detail::SavedPiece& p) { return b < p.end; });
  for (; it != t.pieces.end() && it->begin < end; ++it) {
    const int64_t lo = std::max(begin, it->begin), hi = std::min(end, it->end);
    const std::span<const std::byte> bytes = rank_file(it->rank).raw_bytes(t.name);
    std::memcpy(dst + std::size_t(lo - begin) * esize, bytes.data() + std::size_t(lo - it->begin) * esize,
                std::size_t(hi - lo) * esize);
  }
}

TrainStateReader::TrainStateReader(const std::filesystem::path& dir, int64_t step)
    : dir_(train_state_step_dir(dir, step)), step_(step), mutex_(std::make_unique<std::mutex>()) {
  load_metadata();
}

TrainStateReader TrainStateReader::open_latest(const std::filesystem::path& dir) {
  const std::optional<int64_t> step = latest_step(dir);
  if (!step)
    SLIME_FAIL("no checkpoint in '", dir.string(), "': '", (dir / kTrainStateLatestFile).string(), "' does not exist");
  return TrainStateReader(dir, *step);
}

std::vector<std::string> TrainStateReader::names() const {
  std::vector<std::string> out;
  for (const auto& [name, t] : tensors_) out.push_back(name);
  return out;
}

const TrainStateReader::Entry& TrainStateReader::entry(std::string_view name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) fail("no tensor named '", name, "' (the checkpoint holds ", tensors_.size(), " tensors)");
  return it->second;
}

void TrainStateReader::load_metadata() {
  namespace fs = std::filesystem;
  using nlohmann::json;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) fail("the step directory does not exist");
  const fs::path path = dir_ / kTrainStateMetadataFile;
  if (!fs::is_regular_file(path, ec)) fail("'", kTrainStateMetadataFile, "' is missing (incomplete checkpoint)");
  const auto corrupt = [&](const auto&... args) { fail("'", kTrainStateMetadataFile, "' is corrupt: ", args...); };
  // detail::json_integer(s), their errors as "corrupt".
  const auto integer = [&]<class T>(std::type_identity<T>, const json& j, std::string_view what) {
    try {
      return detail::json_integer<T>(j, what);
    } catch (const Error& e) {
      corrupt(e.message());
      __builtin_unreachable();  // corrupt throws
    }
  };
  const auto integers = [&](const json& j, std::string_view what) {
    try {
      return detail::json_integers<int64_t>(j, what);
    } catch (const Error& e) {
      corrupt(e.message());
      __builtin_unreachable();  // corrupt throws
    }
  };
  json meta;
  {
    const detail::MappedFile text(path);
    const char* p = reinterpret_cast<const char*>(text.data());
    try {
      meta = parse_json(std::string_view(p, text.size()), "the file");
    } catch (const Error& e) {
      corrupt(e.message());
    }
  }
  try {
    if (!meta.is_object() || meta.value("format", "") != kTrainStateFormat)
      corrupt("not a ", kTrainStateFormat, " file");
    constexpr std::type_identity<int> as_int;
    version_ = integer(as_int, meta.at("version"), "\"version\"");
    if (version_ < kTrainStateOldestVersion || version_ > kTrainStateVersion)
      corrupt("version ", version_, " (this build reads versions ", kTrainStateOldestVersion, " to ",
              kTrainStateVersion, ")");
    const int64_t step = integer(std::type_identity<int64_t>(), meta.at("step"), "\"step\"");
    if (step != step_) corrupt("it records step ", step, " in the directory of step ", step_);
    world_ = integer(as_int, meta.at("world_size"), "\"world_size\"");
    if (world_ < 1) corrupt("world_size ", world_);
    if (version_ >= 2) {
      run_id_ = meta.at("run_id").get<std::string>();
      save_id_ = meta.at("save_id").get<std::string>();
      if (run_id_.empty() || save_id_.empty()) corrupt("empty \"run_id\" or \"save_id\"");
    }
    metadata_ = meta.at("metadata");
    const json& files = meta.at("files");
    if (!files.is_array() || files.size() != std::size_t(world_))
      corrupt("\"files\" does not list ", world_, " rank files");
    for (int r = 0; r < world_; ++r) {
      const json& f = files[std::size_t(r)];
      const std::string at = detail::concat("\"files\"[", r, "]");
      if (integer(as_int, f.at("rank"), at + ".rank") != r ||
          f.at("file").get<std::string>() != detail::rank_file_name(r))
        corrupt(at, " is ", json_excerpt(f));
      file_bytes_.push_back(integer(std::type_identity<uint64_t>(), f.at("bytes"), at + ".bytes"));
      const fs::path file = dir_ / detail::rank_file_name(r);
      if (!fs::is_regular_file(file, ec))
        fail("rank file '", detail::rank_file_name(r), "' is missing (the checkpoint was saved by ", world_, " ranks)");
    }
    for (const auto& [name, t] : meta.at("tensors").items()) {
      Entry e;
      e.name = name;
      const SafetensorsDType* d = detail::find_safetensors_dtype(t.at("dtype").get<std::string>());
      if (d == nullptr || !d->dtype) corrupt("tensor '", name, "' has dtype ", json_excerpt(t.at("dtype")));
      e.dtype = *d->dtype;
      const auto dims = integers(t.at("shape"), detail::concat("tensor '", name, "' shape"));
      if (dims.size() > std::size_t(Shape::kMaxDims) ||
          std::any_of(dims.begin(), dims.end(), [](int64_t x) { return x < 0; }))
        corrupt("tensor '", name, "' has shape ", json_excerpt(t.at("shape")));
      int64_t numel = 1;
      for (int64_t x : dims)
        if (__builtin_mul_overflow(numel, x, &numel))
          corrupt("tensor '", name, "' has shape ", json_excerpt(t.at("shape")), " (more than 2^63 elements)");
      e.shape = Shape(std::span<const int64_t>(dims));
      for (const json& p : t.at("pieces")) {
        const auto v = integers(p, detail::concat("tensor '", name, "' piece"));
        if (v.size() != 3 || v[0] < 0 || v[0] >= world_) corrupt("tensor '", name, "' has piece ", json_excerpt(p));
        e.pieces.push_back({int(v[0]), v[1], v[2]});
      }
      std::sort(e.pieces.begin(), e.pieces.end(),
                [](const detail::SavedPiece& a, const detail::SavedPiece& b) { return a.begin < b.begin; });
      if (std::string err = detail::tiling_error(name, numel, e.pieces); !err.empty()) corrupt(err);
      tensors_.emplace(name, std::move(e));
    }
  } catch (const json::exception& e) {
    corrupt(e.what());
  }
  files_.resize(std::size_t(world_));
}

void TrainStateReader::check_rank_file_identity(int r, const SafetensorsFile& f) const {
  const std::string file = detail::rank_file_name(r);
  const std::map<std::string, std::string>& header = f.metadata();
  const auto field = [&](const std::string& key) -> std::string {
    auto it = header.find(key);
    if (it == header.end())
      fail("rank file '", file, "' has no \"", key, "\" in its header (not a ", kTrainStateFormat,
           " rank file of version ", version_, ")");
    return it->second;
  };
  const auto expect = [&](const std::string& key, const std::string& want, std::string_view against,
                          std::string_view hint) {
    const std::string got = field(key);
    if (got != want)
      fail("rank file '", file, "' records ", key, " ", got, " but ", against, " ", want, " (", hint, ")");
  };
  expect("format", std::string(kTrainStateFormat), "a train state rank file has format", "not a rank file");
  expect("rank", std::to_string(r), "it is the file of rank", "rank files swapped or renamed");
  expect("world_size", std::to_string(world_), "metadata.json records world_size", "a rank file of another checkpoint");
  expect("step", std::to_string(step_), "metadata.json records step", "a rank file of another step");
  if (version_ >= 2) {
    expect("run_id", run_id_, "metadata.json records run_id", "a rank file of another run");
    expect("save_id", save_id_, "metadata.json records save_id", "a rank file of another save");
  }
}

const SafetensorsFile& TrainStateReader::rank_file(int r) const {
  std::lock_guard lock(*mutex_);
  auto& slot = files_[std::size_t(r)];
  if (slot) return *slot;
  namespace fs = std::filesystem;
  const fs::path path = dir_ / detail::rank_file_name(r);
  const std::string file = detail::rank_file_name(r);
  std::error_code ec;
  const uint64_t size = fs::file_size(path, ec);
  if (ec) fail("rank file '", file, "' cannot be read: ", ec.message());
  const auto size_error = [&] {
    fail("rank file '", file, "' is ", size, " bytes but metadata.json records ", file_bytes_[std::size_t(r)],
         " (truncated or replaced)");
  };
  std::unique_ptr<SafetensorsFile> f;
  try {
    f = std::make_unique<SafetensorsFile>(path);
  } catch (const Error& e) {
    if (size != file_bytes_[std::size_t(r)]) size_error();
    fail("rank file '", file, "' is corrupt: ", e.message());
  }
  // Identity before size: a file of another rank, step or run names the
  // field that differs, whatever its size.
  check_rank_file_identity(r, *f);
  if (size != file_bytes_[std::size_t(r)]) size_error();
  std::size_t expected = 0;
  for (const auto& [name, t] : tensors_) {
    for (const detail::SavedPiece& p : t.pieces) {
      if (p.rank != r) continue;
      ++expected;
      if (!f->contains(name)) fail("rank file '", file, "' lacks tensor '", name, "' that metadata.json lists");
      const SafetensorsTensorInfo& info = f->info(name);
      if (info.dtype != t.dtype || info.dims != std::vector<int64_t>{p.end - p.begin})
        fail("rank file '", file, "' holds tensor '", name, "' as ", info.dtype_name, " ",
             detail::shape_json_str(nlohmann::json(info.dims)), " but metadata.json records ", dtype_name(t.dtype),
             " piece ", detail::format_range(p.begin, p.end));
    }
  }
  if (f->size() != expected)
    fail("rank file '", file, "' holds ", f->size(), " tensors but metadata.json lists ", expected);
  slot = std::move(f);
  return *slot;
}

}  // namespace slime::io
