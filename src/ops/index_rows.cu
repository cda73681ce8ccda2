// CUDA kernel of slime/ops/index_rows.hpp: row gather / scatter by an i32
// index. One block-stride loop per row; 16-byte words when the row size and
// both base pointers allow, else 4-byte words, else bytes. An index outside
// [0, bound) traps (the op's documented behaviour) instead of writing
// outside the tensor.
#include <cstdint>

#include "slime/core/cuda_runtime.hpp"
#include "slime/ops/index_rows.hpp"

namespace slime::ops::cuda {
namespace {

template <class Word>
__global__ void index_rows_kernel(const Word* __restrict__ src, Word* __restrict__ dst,
                                  const int32_t* __restrict__ index, int64_t n, int64_t row_words, int64_t bound,
                                  bool scatter) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t j = index[i];
    if (j < 0 || j >= bound) __trap();
    const Word* s = src + (scatter ? i : j) * row_words;
    Word* d = dst + (scatter ? j : i) * row_words;
    for (int64_t w = threadIdx.x; w < row_words; w += blockDim.x) d[w] = s[w];
  }
}

template <class Word>
void launch(const void* src, void* dst, const int32_t* index, int64_t n, int64_t row_bytes, int64_t bound, bool scatter,
            StreamHandle stream) {
  const int64_t words = row_bytes / int64_t(sizeof(Word));
  const int threads = words >= 256 ? 256 : (words >= 64 ? 64 : 32);
  const unsigned blocks = unsigned(n < 65535 * 8 ? n : 65535 * 8);
  index_rows_kernel<Word><<<blocks, threads, 0, stream>>>(static_cast<const Word*>(src), static_cast<Word*>(dst), index,
                                                          n, words, bound, scatter);
  SLIME_CUDA_CHECK_LAUNCH();
}

bool aligned_to(const void* p, int64_t row_bytes, int64_t a) {
  return reinterpret_cast<uintptr_t>(p) % uintptr_t(a) == 0 && row_bytes % a == 0;
}

}  // namespace

void index_rows(const void* src, void* dst, const int32_t* index, int64_t n, int64_t row_bytes, int64_t bound,
                bool scatter, StreamHandle stream) {
  if (n == 0 || row_bytes == 0) return;
  if (aligned_to(src, row_bytes, 16) && aligned_to(dst, row_bytes, 16)) {
    launch<uint4>(src, dst, index, n, row_bytes, bound, scatter, stream);
  } else if (aligned_to(src, row_bytes, 4) && aligned_to(dst, row_bytes, 4)) {
    launch<uint32_t>(src, dst, index, n, row_bytes, bound, scatter, stream);
  } else {
    launch<uint8_t>(src, dst, index, n, row_bytes, bound, scatter, stream);
  }
}

}  // namespace slime::ops::cuda
