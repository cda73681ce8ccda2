// slime/ops/cuda/row_ops.hpp: host-callable launchers of the CUDA row-op
// kernels (src/ops/row_ops.cu), and the bias gradient's launch policy, which
// the host API also reads (without the CUDA backend) to size its workspace.
// Activations and tables are f32 or bf16 (one dtype per call); gradients of
// parameters and the resample's weights are f32; ids and taps are i32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

namespace slime::ops::cuda {

// bias_backward's first pass (tuning as data): blocks of kThreadsX x
// kThreadsY threads, kThreadsX vectors of 16 bytes of columns by kThreadsY row
// lanes, over chunks of rows. A chunk is at least kMinChunkRows rows and
// there are at most kMaxChunks chunks, so the partial sums (one fp32 row per
// chunk, the workspace) stay small. The chunking depends on the rows only, so
// the order of every column's sum, and the result's bits, do not depend on the
// GPU model or on whether the one-element or the vector kernel runs.
struct BiasBackwardPolicy {
  static constexpr int kThreadsX = 32;
  static constexpr int kThreadsY = 8;
  static constexpr int64_t kMinChunkRows = 128;
  static constexpr int64_t kMaxChunks = 1024;

  // Rows per chunk: a multiple of kThreadsY.
  static constexpr int64_t chunk_rows(int64_t rows) {
    const int64_t even = (rows + kMaxChunks - 1) / kMaxChunks;
    const int64_t r = even > kMinChunkRows ? even : kMinChunkRows;
    return (r + kThreadsY - 1) / kThreadsY * kThreadsY;
  }
  static constexpr int64_t chunks(int64_t rows) {
    return rows <= 0 ? 0 : (rows + chunk_rows(rows) - 1) / chunk_rows(rows);
  }
  // Bytes of workspace for dy [rows, n]: the partial sums, chunks x n fp32.
  static constexpr std::size_t workspace_bytes(int64_t rows, int64_t n) {
    return n <= 0 ? 0 : std::size_t(chunks(rows)) * std::size_t(n) * sizeof(float);
  }
};

}  // namespace slime::ops::cuda

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

struct BiasAddArgs {
  void* y;        // [rows, n], += bias
  const void* b;  // [n], y's dtype
  int64_t rows, n;
  DType dtype;
};

struct BiasBackwardArgs {
  const void* dy;   // [rows, n]
  float* db;        // [n]
  void* workspace;  // BiasBackwardPolicy::workspace_bytes(rows, n) bytes
  std::size_t workspace_bytes;
  int64_t rows, n;
  DType dtype;
  bool accumulate;  // db += sums, or db = sums
};

struct PosEmbedForwardArgs {
  const void* table;     // [S, D]
  const int32_t* ids;    // [4, P]
  const float* weights;  // [4, P]
  void* out;             // [P, D], table's dtype
  int64_t table_rows, dim, patches;
  DType dtype;
  bool accumulate;  // out += the blend, or out = the blend
};

struct PosEmbedBackwardArgs {
  const void* d_out;           // [P, D]
  const float* weights;        // [4, P]
  const int32_t* row_offsets;  // [S + 1]
  const int32_t* row_taps;     // [4P]: tap t = k * P + p, grouped by table row
  float* d_table;              // [S, D], accumulated
  int64_t table_rows, dim, patches;
  DType dtype;
};

// y += b (one fp32 add, rounded once): the same bits as the CPU reference.
void bias_add(const BiasAddArgs& args, StreamHandle stream);

// db (+)= column sums of dy, deterministic (see BiasBackwardPolicy): each
// block sums its chunk's rows per column in increasing row order per row
// lane, adds its kThreadsY lanes in lane order into the chunk's partial row of
// the workspace; a second kernel adds the partial rows in a fixed order. Throws
// if the workspace is too small.
void bias_backward(const BiasBackwardArgs& args, StreamHandle stream);

// out[p] (+)= sum_k w[k, p] * table[ids[k, p]] in fp32 (k in order), rounded
// once. A patch with an id outside [0, S) is written as NaN (all bits set)
// and reads nothing from the table.
void pos_embed_interpolate_forward(const PosEmbedForwardArgs& args, StreamHandle stream);

// d_table[s] += the sum from zero, over row s's taps in the given order, of
// w[t] * d_out[t mod P] in fp32; one block per table row, so no two threads
// add into one element and the result is the same bits run to run. The taps
// must be a grouping by row of valid ids (cpu::pos_embed_csr).
void pos_embed_interpolate_backward(const PosEmbedBackwardArgs& args, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
