// slime/io/train_state.hpp: sharded training state (parameters, optimizer
// states, schedule, RNG, data position) saved collectively as one safetensors
// file per rank plus metadata.json, published atomically, and loaded into any
// number of ranks (resharding on load).
//
// Layout of a checkpoint directory `dir`:
//   dir/step_<k>/rank_<r>.safetensors   the pieces rank r held, one 1-D tensor
//                                       per piece, named by its tensor; its
//                                       header records rank, world size, step,
//                                       run id and save id
//   dir/step_<k>/metadata.json          world size, run id, save id, every
//                                       tensor's dtype, full shape and pieces
//                                       (rank, [begin, end)), each rank file's
//                                       size, caller metadata
//   dir/latest                          "step_<k>": the newest complete step
//
// A piece is a flat element range [begin, end) of the row-major, unpadded
// full tensor, which is how FSDP holds dim-0 shards of flattened parameters
// and their optimizer states (the padding of the last shards is not saved).
// The pieces of a tensor, over all ranks, must tile [0, numel) exactly: save
// a replicated tensor from one rank only.
//
// Crash safety: a save writes into dir/step_<k>.tmp-<nonce>/, fsyncs every
// file and the directory, renames it to step_<k> (a step directory that
// exists is therefore complete), fsyncs dir, then replaces `latest` (temporary
// file, fsync, rename). A process killed at any point leaves the previous
// checkpoint and `latest` intact; leftovers of an interrupted save are removed
// by the next successful one. Old checkpoints are deleted only after the new
// one is published (TrainStateSaveOptions::keep_last), each renamed out of the
// step_<k> namespace before its files are removed.
//
// One process (or one group of ranks) saves into a directory at a time.
//
// Identity: a run id (random, chosen when a run starts and passed on by the
// trainer across resumes: TrainStateSaveOptions::run_id, read back with
// TrainStateReader::run_id) and a save id (random, new for every save) are
// written into metadata.json and into every rank file's header beside its
// rank, world size and step. The reader checks each rank file's header
// against metadata.json and the slot it is read as (rank_<r>.safetensors must
// say rank r), so a rank file swapped with another rank's, or copied from
// another step, another save or another run, is an error naming the file and
// the field instead of a silent resume with the wrong state. Version 1
// checkpoints (no run or save id) are still read; their rank, world size and
// step are checked.
//
// Compiled once in src/io/train_state.cpp (slime::core). The steps that
// allocate or copy tensors (gathering the ranks' strings, writing a piece's
// data, the staging copy of a read) stay inline here, because their code
// depends on whether the caller builds with CUDA.
#pragma once

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/comm/comm.hpp"
#include "slime/core/error.hpp"
#include "slime/core/tensor.hpp"
#include "slime/io/safetensors.hpp"
#include "slime/io/safetensors_writer.hpp"

namespace slime::io {

inline constexpr std::string_view kTrainStateFormat = "slime.train_state";
// Version 2 added the run id and save id (metadata.json and rank file
// headers). The reader accepts versions kTrainStateOldestVersion ..
// kTrainStateVersion.
inline constexpr int kTrainStateVersion = 2;
inline constexpr int kTrainStateOldestVersion = 1;
inline constexpr std::string_view kTrainStateMetadataFile = "metadata.json";
inline constexpr std::string_view kTrainStateLatestFile = "latest";

// One rank's piece of a tensor: elements [begin, end) of the flattened,
// unpadded full tensor `name` of shape `shape`. On save, `data` holds those
// end - begin elements (any shape; CPU or CUDA) in the tensor's dtype. On
// load, `data` is the destination (allocated by the caller; its dtype must be
// the saved one).
struct TensorPiece {
  std::string name;
  Shape shape;
  int64_t begin = 0, end = 0;
  Tensor data;
};

struct TrainStateSaveOptions {
  // After the new checkpoint is published, keep it and the keep_last - 1
  // newest complete checkpoints of lower steps; delete older ones. 0 keeps
  // everything. Steps above the saved one (left by an abandoned run) are
  // never deleted.
  int keep_last = 0;
  // Called on each rank at each stage of the save: "prepared" (rank 0),
  // "tensor_written" (after each piece), "rank_file_written", then on rank 0
  // "metadata_written", "published", "latest_updated", "pruned". For tests
  // (crash injection) and progress reporting.
  std::function<void(std::string_view event)> on_event;
  // The run this state belongs to (taken from rank 0). Empty: this process's
  // run id (process_run_id()). A trainer that resumes passes the loaded
  // checkpoint's TrainStateReader::run_id() so that one run keeps one id.
  std::string run_id;
};

// A new random run id: 32 hex digits.
std::string make_run_id();

// This process's run id: make_run_id() chosen on the first call, the same
// afterwards.
const std::string& process_run_id();

// dir/step_<step>.
inline std::filesystem::path train_state_step_dir(const std::filesystem::path& dir, int64_t step) {
  return dir / ("step_" + std::to_string(step));
}

namespace detail {

using ::slime::detail::concat;

// "step_<digits>" -> the step; anything else (tmp and deleting directories
// included) -> nullopt.
std::optional<int64_t> parse_step_name(std::string_view s);

// Every rank gets every rank's string (two all_gathers: lengths, then bytes
// padded to the longest). Collective.
inline std::vector<std::string> all_gather_strings(comm::Comm& comm, const std::string& s) {
  const Device device = comm.device();
  const int world = comm.size();
  Tensor length = Tensor::from_vector<int64_t>({int64_t(s.size())}, Shape{1}, device);
  Tensor lengths = Tensor::empty(Shape{world}, DType::i64, device);
  comm.all_gather(length, lengths);
  const std::vector<int64_t> n = lengths.to_vector<int64_t>();
  const int64_t longest = std::max<int64_t>(1, *std::max_element(n.begin(), n.end()));
  std::vector<uint8_t> padded(std::size_t(longest), 0);
  std::memcpy(padded.data(), s.data(), s.size());
  Tensor mine = Tensor::from_vector(padded, Shape{longest}, device);
  Tensor all = Tensor::empty(Shape{longest * world}, DType::u8, device);
  comm.all_gather(mine, all);
  const std::vector<uint8_t> bytes = all.to_vector<uint8_t>();
  std::vector<std::string> out(static_cast<std::size_t>(world));
  for (int r = 0; r < world; ++r)
    out[std::size_t(r)].assign(reinterpret_cast<const char*>(bytes.data()) + r * longest, std::size_t(n[r]));
  return out;
}

struct SavedPiece {
  int rank = 0;
  int64_t begin = 0, end = 0;
};

}  // namespace detail

// Steps of the complete checkpoints in `dir` (step_<k> directories holding
// metadata.json), ascending. Empty when `dir` does not exist.
std::vector<int64_t> list_train_states(const std::filesystem::path& dir);

// The step `dir/latest` names; nullopt when there is no `latest` file (no
// save has completed). Throws when `latest` is unreadable or names a step
// directory that is missing or incomplete.
std::optional<int64_t> latest_step(const std::filesystem::path& dir);

namespace detail {

// The steps of save_train_state that allocate or copy tensors, which its
// compiled body (built without CUDA) calls back into: bound by the inline
// save_train_state in the caller's translation unit.
struct TrainStateSaveOps {
  std::vector<std::string> (*all_gather_strings)(comm::Comm& comm, const std::string& s);
  void (*write_piece)(SafetensorsWriter& writer, std::string_view name, const Tensor& data);
};

void save_train_state_with(comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                           const std::vector<TensorPiece>& pieces, const nlohmann::json& metadata,
                           const TrainStateSaveOptions& options, const TrainStateSaveOps& ops);

inline void write_train_state_piece(SafetensorsWriter& writer, std::string_view name, const Tensor& data) {
  writer.write(name, data);
}

}  // namespace detail

// Saves this rank's `pieces` as step `step` of the checkpoint directory `dir`
// (created if needed). Collective: every rank of `comm` calls it with the
// same dir and step; `metadata` (a JSON object: schedule state, RNG seed and
// offset, data position, ...) is taken from rank 0. Returns on every rank
// once the checkpoint is published and `latest` names it. Re-saving an
// existing step replaces it atomically.
//
// Every rank checks its own pieces (names unique on the rank, ranges inside
// the shape, data of end - begin elements), all ranks check that the pieces
// agree on dtype and shape and tile every tensor; any failure, on any rank,
// throws on every rank (no rank is left waiting) and removes the partial
// checkpoint.
inline void save_train_state(comm::Comm& comm, const std::filesystem::path& dir, int64_t step,
                             const std::vector<TensorPiece>& pieces,
                             const nlohmann::json& metadata = nlohmann::json::object(),
                             const TrainStateSaveOptions& options = {}) {
  detail::save_train_state_with(comm, dir, step, pieces, metadata, options,
                                {&detail::all_gather_strings, &detail::write_train_state_piece});
}

// A saved training state, opened for reading by any rank of any world size.
// metadata.json is read and checked when the reader is constructed (and the
// presence of every rank file); a rank file is mapped, and its header checked
// against metadata.json, the first time a read needs it, and only the byte
// ranges a read asks for are copied. Reads are safe from several threads.
class TrainStateReader {
 public:
  TrainStateReader(const std::filesystem::path& dir, int64_t step);

  // The checkpoint `dir/latest` names; throws when there is none.
  static TrainStateReader open_latest(const std::filesystem::path& dir);

  // The step directory.
  const std::filesystem::path& path() const { return dir_; }
  int64_t step() const { return step_; }
  // The number of ranks that saved the checkpoint.
  int world_size() const { return world_; }
  // The JSON object rank 0 passed to save_train_state.
  const nlohmann::json& metadata() const { return metadata_; }
  // The format version of metadata.json (kTrainStateOldestVersion ..
  // kTrainStateVersion).
  int version() const { return version_; }
  // The run and save ids (empty for a version 1 checkpoint).
  const std::string& run_id() const { return run_id_; }
  const std::string& save_id() const { return save_id_; }

  std::vector<std::string> names() const;
  bool contains(std::string_view name) const { return tensors_.find(name) != tensors_.end(); }
  const Shape& shape(std::string_view name) const { return entry(name).shape; }
  DType dtype(std::string_view name) const { return entry(name).dtype; }

  // Elements [begin, end) of the flattened tensor `name` into `out` (end -
  // begin elements of any shape, the saved dtype; CPU, or CUDA through a host
  // copy that is complete on return), assembled from whichever rank files
  // hold them.
  void read_range(std::string_view name, int64_t begin, int64_t end, Tensor& out) const {
    check_range(name, begin, end, out);
    Tensor host = out.device().is_cpu() ? out : Tensor::empty(out.shape(), out.dtype());
    copy_range(name, begin, end, static_cast<std::byte*>(host.data_ptr()));
    if (!out.device().is_cpu()) {
      out.copy_from(host, out.stream());
      out.stream().synchronize();
    }
  }

  // The same into a new tensor of shape (end - begin,) on `device`.
  Tensor read_range(std::string_view name, int64_t begin, int64_t end, Device device = Device::cpu()) const {
    Tensor out = Tensor::empty(Shape{std::max<int64_t>(end - begin, 0)}, dtype(name), device);
    read_range(name, begin, end, out);
    return out;
  }

  // Fills piece.data with its range, after checking that the tensor exists
  // with the piece's shape and data dtype.
  void read(const TensorPiece& piece) const {
    const Entry& t = entry(piece.name);
    if (!(t.shape == piece.shape))
      fail("tensor '", piece.name, "' was saved with shape ", t.shape, " but the caller expects ", piece.shape);
    Tensor data = piece.data;
    read_range(piece.name, piece.begin, piece.end, data);
  }
  void read(std::span<const TensorPiece> pieces) const {
    for (const TensorPiece& p : pieces) read(p);
  }

 private:
  struct Entry {
    std::string name;
    DType dtype = DType::f32;
    Shape shape;
    std::vector<detail::SavedPiece> pieces;  // sorted by begin, tiling [0, numel)
  };

  template <class... Args>
  [[noreturn]] void fail(const Args&... args) const {
    SLIME_FAIL("train state '", dir_.string(), "': ", args...);
  }

  const Entry& entry(std::string_view name) const;

  void load_metadata();

  // read_range's checks of the range and the destination.
  void check_range(std::string_view name, int64_t begin, int64_t end, const Tensor& out) const;
  // Copies elements [begin, end) of `name` (checked) from the rank files to `dst`.
  void copy_range(std::string_view name, int64_t begin, int64_t end, std::byte* dst) const;

  // Rank r's file, mapped on first use and checked against metadata.json.
  const SafetensorsFile& rank_file(int r) const;
  // The header's identity (rank, world size, step, run and save id) against
  // metadata.json and the slot r.
  void check_rank_file_identity(int r, const SafetensorsFile& f) const;

  std::filesystem::path dir_;
  int64_t step_ = 0;
  int world_ = 0;
  int version_ = 0;
  std::string run_id_, save_id_;
  nlohmann::json metadata_;
  std::vector<uint64_t> file_bytes_;
  std::map<std::string, Entry, std::less<>> tensors_;
  std::unique_ptr<std::mutex> mutex_;
  mutable std::vector<std::unique_ptr<SafetensorsFile>> files_;
};

}  // namespace slime::io
