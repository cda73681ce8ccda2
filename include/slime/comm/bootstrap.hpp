// slime/comm/bootstrap.hpp: launcher detection and the broadcast of rank 0's bytes to all ranks.
//
// process_info_from_env() reads rank and world from torchrun, OpenMPI or Slurm; broadcast_blob()
// hands rank 0's bytes (an ncclUniqueId, typically) to every rank over TCP or, where TCP between
// hosts is not allowed, through a shared directory. Host-only, no CUDA or NCCL. Linux: uses
// accept4, SOCK_CLOEXEC and MSG_NOSIGNAL. Compiled once in src/comm/bootstrap.cpp (slime::core).
#pragma once

// The socket and poll headers stay here for callers that use them beside the bootstrap (its tests
// open sockets and poll child processes).
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "slime/comm/detail_time.hpp"
#include "slime/core/error.hpp"
#include "slime/core/file_descriptor.hpp"

namespace slime::comm {

// Where this process sits in the job, as its launcher described it.
struct ProcessInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  // index among the processes on this host; picks the GPU
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";  // host of rank 0
  int master_port = 29500;
  std::string launcher = "single";  // "torchrun", "openmpi", "slurm" or "single"
};

// Reads one environment variable; std::nullopt when it is unset. Tests pass a map lookup.
using GetenvFn = std::function<std::optional<std::string>(const char*)>;

// How broadcast_blob meets the other ranks. Every rank must pass the same host, port, file_dir
// and run_id.
struct RendezvousOptions {
  std::string host;  // rank 0 listens here, the others connect here
  int port = 0;      // TCP port; in file mode it only names the file
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::string file_dir;  // non-empty: rendezvous through this shared directory instead of TCP
  // File mode only: rank 0 stamps the file with it and the others accept only a file with the
  // same stamp, so a file left by an earlier run in the same directory is not read.
  std::string run_id;
};

// Largest blob broadcast_blob carries. An ncclUniqueId is 128 bytes; the cap keeps a corrupt
// length field from turning into a huge allocation.
inline constexpr std::size_t kMaxBlobBytes = std::size_t{1} << 20;

namespace detail {

using Clock = std::chrono::steady_clock;

// The socket and file owner of the bootstrap (one type for the whole library).
using Fd = ::slime::FileDescriptor;

// Milliseconds left until `deadline`, rounded up so that a poll never spins with a 0 ms timeout
// while time remains; 0 once the deadline has passed.
int remaining_ms(Clock::time_point deadline);

// The pieces of the TCP rendezvous that its tests drive by hand (a stray connection, a hello with a
// bad rank); the rest lives in src/comm/bootstrap.cpp.

// "host:port", with brackets around an IPv6 literal.
std::string endpoint(const std::string& host, int port);

enum class IoStatus { kDone, kTimeout, kEof, kError };

struct IoResult {
  IoStatus status = IoStatus::kDone;
  int err = 0;  // errno for kError
};

// Sends every byte on a non-blocking socket, across partial writes and EINTR. MSG_NOSIGNAL: a
// peer that went away is an EPIPE here, not a SIGPIPE that kills the process.
IoResult send_all(int fd, const void* data, std::size_t size, Clock::time_point deadline);

// Receives exactly `size` bytes on a non-blocking socket, across partial reads and EINTR.
IoResult recv_all(int fd, void* data, std::size_t size, Clock::time_point deadline);

// The process environment (GetenvFn of the non-test paths).
std::optional<std::string> system_getenv(const char* name);

// A positive number of seconds, fractions allowed ("0.5"), from environment variable `name`;
// throws naming the variable otherwise.
std::chrono::milliseconds parse_env_seconds(const char* name, const std::string& value);

// strerror, thread-safe.
std::string errno_text(int err);

// A non-blocking listening socket on opt.host:opt.port (SO_REUSEADDR); throws naming `where`.
Fd listen_on(const RendezvousOptions& opt, int backlog, const std::string& where);

// Connects to rank 0, retrying with a short backoff: "connection refused" is normal while rank 0
// is still starting.
Fd connect_with_retry(const RendezvousOptions& opt, int rank, Clock::time_point deadline, const std::string& where);

// ---- TCP wire format. Integers are big-endian. ----
// hello, client -> rank 0: magic, version, rank, world_size (u32 each).
// reply, rank 0 -> client: magic, status (u32 each), payload length (u64), payload; the payload
// is the blob (kStatusBlob) or rank 0's error message (kStatusAbort).
inline constexpr std::uint32_t kMagic = 0x534c4d45;  // "SLME"
inline constexpr std::uint32_t kProtocolVersion = 1;
inline constexpr std::size_t kHelloBytes = 16;
inline constexpr std::size_t kReplyHeaderBytes = 16;
inline constexpr std::uint32_t kStatusBlob = 0;
inline constexpr std::uint32_t kStatusAbort = 1;
inline constexpr std::size_t kMaxAbortMessageBytes = 4096;

inline void put_u32(unsigned char* p, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<unsigned char>(v >> (24 - 8 * i));
}
inline std::uint32_t get_u32(const unsigned char* p) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v = (v << 8) | p[i];
  return v;
}
inline void put_u64(unsigned char* p, std::uint64_t v) {
  put_u32(p, static_cast<std::uint32_t>(v >> 32));
  put_u32(p + 4, static_cast<std::uint32_t>(v));
}
inline std::uint64_t get_u64(const unsigned char* p) { return (std::uint64_t{get_u32(p)} << 32) | get_u32(p + 4); }

struct Hello {
  std::uint32_t magic = 0;
  std::uint32_t version = 0;
  std::int64_t rank = 0;
  std::int64_t world_size = 0;
};

inline std::array<unsigned char, kHelloBytes> encode_hello(int rank, int world_size, std::uint32_t magic = kMagic,
                                                           std::uint32_t version = kProtocolVersion) {
  std::array<unsigned char, kHelloBytes> out{};
  put_u32(out.data(), magic);
  put_u32(out.data() + 4, version);
  put_u32(out.data() + 8, static_cast<std::uint32_t>(rank));
  put_u32(out.data() + 12, static_cast<std::uint32_t>(world_size));
  return out;
}

}  // namespace detail

// Rank and world of this process from its launcher's environment, checked first to last:
//   torchrun: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT
//   OpenMPI:  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   Slurm:    SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE (else all tasks
//             count as local)
//   none of these: a single process.
// A launcher counts as detected when its rank or size variable is set (Slurm: SLURM_PROCID); its
// other rank variables are then required. OpenMPI and Slurm take MASTER_ADDR/MASTER_PORT when
// set; Slurm otherwise uses SLURM_LAUNCH_NODE_IPADDR; the defaults are 127.0.0.1:29500. A plain
// `sbatch` script outside srun can carry SLURM_PROCID=0 and the job's SLURM_NTASKS, so it would
// wait for ranks that never start: launch ranks with srun. Throws slime::Error naming the variable and its value when a
// number does not parse completely, a rank lies outside its size, or a port is not in [1, 65534].
ProcessInfo process_info_from_env(const GetenvFn& getenv_fn);
ProcessInfo process_info_from_env();

// Where broadcast_blob meets: rank 0's host at MASTER_PORT+1. Not MASTER_PORT itself, because
// torchrun's agent already listens there (its TCPStore) and a second bind would fail.
// SLIME_BOOTSTRAP_TIMEOUT_S (seconds, fractions allowed) replaces the 5-minute timeout;
// SLIME_BOOTSTRAP_DIR selects the shared-directory rendezvous; SLIME_BOOTSTRAP_RUN_ID stamps its
// file (give each run a distinct value, e.g. the Slurm job id, when the directory is reused).
RendezvousOptions rendezvous_options(const ProcessInfo& info, const GetenvFn& getenv_fn);
RendezvousOptions rendezvous_options(const ProcessInfo& info);

// Collective: every rank calls it once with the same `opt`; each gets rank 0's `blob_on_root`
// (arbitrary bytes, zeros included, at most kMaxBlobBytes; ignored on other ranks). With one
// process it returns at once.
//
// TCP (opt.file_dir empty): rank 0 listens on opt.host:opt.port and replies only once every rank
// has connected, so a return also means all ranks were alive. Ranks may start in any order;
// clients retry until opt.timeout. A mismatched world size, a duplicate or out-of-range rank
// aborts rank 0 and every waiting client with the reason; a timeout at rank 0 names the ranks that
// never arrived. Rank 0 holds one socket per rank and raises its soft open-file limit if needed.
//
// Shared directory (opt.file_dir set): rank 0 atomically writes <dir>/slime-bootstrap-<port>.bin
// and returns without waiting; the others poll for it until opt.timeout. The file is left behind
// (rank 0 cannot tell when all have read it). Limitation: if a previous run left a file with the
// same port, world size and run id, and this run's rank 0 has not yet replaced it, a rank can read
// the stale blob. A distinct opt.run_id per run (SLIME_BOOTSTRAP_RUN_ID) rules that out: readers
// skip a file with another run id and keep waiting.
//
// Every wait is bounded by opt.timeout; failures throw slime::Error.
std::string broadcast_blob(const ProcessInfo& info, const std::string& blob_on_root, const RendezvousOptions& opt);

}  // namespace slime::comm
