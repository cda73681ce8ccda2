// slime/ops/cuda/embedding.hpp: host-callable launchers of the CUDA embedding
// kernels (src/ops/embedding.cu). ids are i32 or i64; table, y and dy are f32
// or bf16 (one dtype); dtable is f32.
#pragma once

#include <cstddef>
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/core/dtype.hpp"

#if SLIME_HAS_CUDA
namespace slime::ops::cuda {

// y[t] = table[ids[t]]. A row whose id is outside [0, vocab) is written as NaN
// (all bits set) and never read from the table; when maybe_bad_flag is not
// null the kernel also stores 1 there (it never stores 0).
void embedding_forward(const void* ids, DType id_dtype, const void* table, DType dtype, int64_t tokens, int64_t vocab,
                       int64_t dim, void* y, int32_t* maybe_bad_flag, StreamHandle stream);

// Writes into *first_bad (a device u64) the smallest position t whose id is
// outside [0, vocab), or UINT64_MAX when there is none. Asynchronous.
void embedding_find_bad_id(const void* ids, DType id_dtype, int64_t tokens, int64_t vocab, uint64_t* first_bad,
                           StreamHandle stream);

// Bytes of device workspace embedding_backward needs for `tokens` ids.
std::size_t embedding_backward_workspace_bytes(int64_t tokens);

// dtable[v] += sum over t with ids[t] == v of dy[t], deterministic: a stable
// radix sort of the positions by id, then one pass per distinct id adding its
// dy rows in increasing token order in fp32. Ids outside [0, vocab) are
// skipped. Throws if workspace_bytes is too small.
void embedding_backward(const void* ids, DType id_dtype, const void* dy, DType dtype, int64_t tokens, int64_t vocab,
                        int64_t dim, float* dtable, void* workspace, std::size_t workspace_bytes, StreamHandle stream);

}  // namespace slime::ops::cuda
#endif
