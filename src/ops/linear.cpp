// cuBLAS GEMMs for slime/ops/cuda/linear.hpp: the per-thread handle cache, the
// row-major-to-column-major mapping, and the three Linear products.
#include "slime/ops/cuda/linear.hpp"

#include <cublas_v2.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdint>

#include "slime/core/device.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/stream.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"

namespace slime::ops::cuda {
namespace {

[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* expr, const char* file, int line) {
  ::slime::detail::throw_error(file, line,
                               ::slime::detail::concat("cuBLAS error ", cublasGetStatusName(status), " (",
                                                       cublasGetStatusString(status), ") in ", expr));
}

}  // namespace
}  // namespace slime::ops::cuda

// Throws slime::Error naming the status and the failed call.
#define SLIME_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                         \
    const cublasStatus_t slime_cublas_status_ = (expr);                                        \
    if (slime_cublas_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                            \
      ::slime::ops::cuda::throw_cublas_error(slime_cublas_status_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace slime::ops::cuda {
namespace {

// One handle and its workspace. cuBLAS handles are not thread-safe, so each
// thread owns its own, one per device, destroyed when the thread exits.
struct HandleSlot {
  cublasHandle_t handle = nullptr;
  void* workspace = nullptr;
};

class ThreadHandles {
 public:
  ThreadHandles() = default;
  ThreadHandles(const ThreadHandles&) = delete;
  ThreadHandles& operator=(const ThreadHandles&) = delete;

  ~ThreadHandles() {
    for (int d = 0; d < int(slots_.size()); ++d) {
      HandleSlot& s = slots_[std::size_t(d)];
      if (s.handle == nullptr) continue;
      // cublasDestroy synchronises the device, so no GEMM still reads the
      // workspace when it goes back to the pool. Errors are dropped: this runs
      // at thread exit, possibly while the process is tearing CUDA down.
      if (cudaSetDevice(d) == cudaSuccess) {
        (void)cublasDestroy(s.handle);
        deallocate(MemoryKind::device, s.workspace, kCublasWorkspaceBytes, Stream::default_for(Device::cuda(d)));
      }
      (void)cudaGetLastError();
    }
  }

  // This thread's workspace on `device` (current on entry), created with
  // its handle: the batch-invariant GEMM's K-split partials use it in
  // cuBLAS's stead, ordered on the stream of the call like cuBLAS's own use.
  void* workspace(int device) {
    SLIME_CHECK(device >= 0 && device < int(slots_.size()), "CUDA device index ", device, " out of range");
    HandleSlot& s = slots_[std::size_t(device)];
    if (s.handle == nullptr) create(device, s);
    return s.workspace;
  }

  // The handle for `device` (current on entry), bound to `stream` with this
  // slot's workspace.
  cublasHandle_t get(int device, cudaStream_t stream) {
    SLIME_CHECK(device >= 0 && device < int(slots_.size()), "CUDA device index ", device, " out of range");
    HandleSlot& s = slots_[std::size_t(device)];
    if (s.handle == nullptr) create(device, s);
    // cublasSetStream resets the workspace to cuBLAS's own pool, so the
    // workspace is set again after it on every call (both are host-only).
    SLIME_CUBLAS_CHECK(cublasSetStream(s.handle, stream));
    SLIME_CUBLAS_CHECK(cublasSetWorkspace(s.handle, s.workspace, kCublasWorkspaceBytes));
    return s.handle;
  }

 private:
  static void create(int device, HandleSlot& s) {
    const Stream legacy = Stream::default_for(Device::cuda(device));
    void* workspace = allocate(MemoryKind::device, kCublasWorkspaceBytes, legacy);
    // The workspace was ordered on the legacy stream; GEMMs on non-blocking
    // streams may use it only once that allocation has completed.
    legacy.synchronize();
    cublasHandle_t h = nullptr;
    const cublasStatus_t status = cublasCreate(&h);
    if (status != CUBLAS_STATUS_SUCCESS) {
      deallocate(MemoryKind::device, workspace, kCublasWorkspaceBytes, legacy);
      SLIME_CUBLAS_CHECK(status);
    }
    // Split-K partial sums stay in fp32 even when C is bf16 (the fp32
    // accumulation contract); TF32 is chosen per call through the compute type.
    const cublasStatus_t mode =
        cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (mode != CUBLAS_STATUS_SUCCESS) {
      (void)cublasDestroy(h);
      deallocate(MemoryKind::device, workspace, kCublasWorkspaceBytes, legacy);
      SLIME_CUBLAS_CHECK(mode);
    }
    s.handle = h;
    s.workspace = workspace;
  }

  std::array<HandleSlot, ::slime::detail::kMaxDevices> slots_{};
};

ThreadHandles& thread_handles() {
  thread_local ThreadHandles handles;
  return handles;
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f32:
      return CUDA_R_32F;
    default:
      SLIME_FAIL("cuBLAS GEMM: unsupported dtype ", dtype_name(t));
  }
}

int checked_int(int64_t v, const char* what) {
  SLIME_CHECK(v >= 0 && v <= INT_MAX, "cuBLAS GEMM: ", what, " = ", v, " does not fit in int32");
  return int(v);
}

// The batch-invariant mode's GEMM (slime/ops/batch_invariant.hpp): the
// forward form C = alpha · A · Bᵀ (A [m, k], B [n, k], both unpadded, beta 0)
// on slime's grouped GEMM kernels with one group, whose per-element sums do
// not depend on m. False for the other forms (they stay on cuBLAS).
bool batch_invariant_gemm(const GemmParams& p, int device, StreamHandle stream) {
  if (p.trans_a || !p.trans_b || p.beta != 0.f || p.lda != p.k || p.ldb != p.k) return false;
  GroupedGemmParams g;
  g.pass = GroupedGemmPass::forward;
  g.a = p.a;
  g.b = p.b;
  g.c = p.c;
  g.offsets = nullptr;  // one group of all m rows
  g.in_dtype = p.ab_dtype;
  g.out_dtype = p.c_dtype;
  g.experts = 1;
  g.rows = p.m;
  g.out_features = p.n;
  g.in_features = p.k;
  g.ldc = p.ldc == p.n ? 0 : p.ldc;
  g.alpha = p.alpha;
  DeviceGuard guard(Device::cuda(device));
  g.workspace = thread_handles().workspace(device);
  g.workspace_bytes = kCublasWorkspaceBytes;
  grouped_gemm(g, stream);
  return true;
}

}  // namespace

void gemm(const GemmParams& p, int device, StreamHandle stream) {
  const bool types_ok =
      (p.ab_dtype == DType::bf16 || p.ab_dtype == DType::f32) && (p.c_dtype == p.ab_dtype || p.c_dtype == DType::f32);
  SLIME_CHECK(types_ok, "cuBLAS GEMM: unsupported dtypes A/B = ", dtype_name(p.ab_dtype),
              ", C = ", dtype_name(p.c_dtype), " (supported: A/B bf16 or f32, C the same or f32)");
  const int m = checked_int(p.m, "m"), n = checked_int(p.n, "n"), k = checked_int(p.k, "k");
  // Leading dimensions must be at least the stored row length (and >= 1).
  const int64_t a_cols = p.trans_a ? p.m : p.k, b_cols = p.trans_b ? p.k : p.n;
  SLIME_CHECK(p.lda >= a_cols && p.ldb >= b_cols && p.ldc >= p.n, "cuBLAS GEMM: leading dimensions lda=", p.lda,
              " ldb=", p.ldb, " ldc=", p.ldc, " below the row lengths ", a_cols, ", ", b_cols, ", ", p.n);
  const int lda = std::max(1, checked_int(p.lda, "lda")), ldb = std::max(1, checked_int(p.ldb, "ldb")),
            ldc = std::max(1, checked_int(p.ldc, "ldc"));
  if (m == 0 || n == 0) return;
  if (batch_invariant() && batch_invariant_gemm(p, device, stream)) return;

  DeviceGuard guard(Device::cuda(device));
  if (k == 0) {  // an empty sum: C = beta · C, which cuBLAS does not accept with k = 0
    if (p.beta == 1.f) return;
    SLIME_CHECK(p.beta == 0.f, "cuBLAS GEMM: k = 0 with beta = ", p.beta, " is not supported (only 0 or 1)");
    const std::size_t elem = dtype_size(p.c_dtype);
    SLIME_CUDA_CHECK(cudaMemset2DAsync(p.c, std::size_t(ldc) * elem, 0, std::size_t(n) * elem, std::size_t(m), stream));
    return;
  }

  cublasHandle_t h = thread_handles().get(device, stream);
  const cublasComputeType_t compute =
      p.ab_dtype == DType::f32 && p.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, and a
  // row-major buffer read column-major is its transpose: pass B first, A
  // second, each transposed exactly when its row-major form is.
  const cublasOperation_t op_b = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_a = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cudaDataType_t ab = cuda_type(p.ab_dtype), c = cuda_type(p.c_dtype);
  const cublasStatus_t status = cublasGemmEx(h, op_b, op_a, n, m, k, &p.alpha, p.b, ab, ldb, p.a, ab, lda, &p.beta, p.c,
                                             c, ldc, compute, CUBLAS_GEMM_DEFAULT);
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    SLIME_FAIL("cuBLAS error ", cublasGetStatusName(status), " (", cublasGetStatusString(status),
               ") in cublasGemmEx for row-major C[", m, ", ", n, "] = op(A)·op(B) with k = ", k, ", A/B ",
               dtype_name(p.ab_dtype), (p.trans_a ? " (A transposed)" : ""), (p.trans_b ? " (B transposed)" : ""),
               ", C ", dtype_name(p.c_dtype), ", lda/ldb/ldc = ", lda, "/", ldb, "/", ldc, ", on cuda:", device);
}

void linear_forward(const void* x, const void* w, void* y, DType in_dtype, DType out_dtype, int64_t tokens,
                    int64_t in_features, int64_t out_features, int device, StreamHandle stream) {
  GemmParams p;
  p.a = x;  // [tokens, in]
  p.b = w;  // [out, in] = op(B)ᵀ
  p.c = y;  // [tokens, out]
  p.ab_dtype = in_dtype;
  p.c_dtype = out_dtype;
  p.m = tokens, p.n = out_features, p.k = in_features;
  p.lda = in_features, p.ldb = in_features, p.ldc = out_features;
  p.trans_b = true;
  gemm(p, device, stream);
}

void linear_backward_input(const void* dy, const void* w, void* dx, DType in_dtype, DType out_dtype, int64_t tokens,
                           int64_t in_features, int64_t out_features, bool accumulate, int device,
                           StreamHandle stream) {
  GemmParams p;
  p.a = dy;  // [tokens, out]
  p.b = w;   // [out, in]
  p.c = dx;  // [tokens, in]
  p.ab_dtype = in_dtype;
  p.c_dtype = out_dtype;
  p.m = tokens, p.n = in_features, p.k = out_features;
  p.lda = out_features, p.ldb = in_features, p.ldc = in_features;
  p.beta = accumulate ? 1.f : 0.f;
  gemm(p, device, stream);
}

void linear_backward_weight(const void* dy, const void* x, float* dw, DType in_dtype, int64_t tokens,
                            int64_t in_features, int64_t out_features, int device, StreamHandle stream) {
  GemmParams p;
  p.a = dy;  // [tokens, out] = op(A)ᵀ
  p.b = x;   // [tokens, in]
  p.c = dw;  // [out, in], f32
  p.ab_dtype = in_dtype;
  p.c_dtype = DType::f32;
  p.m = out_features, p.n = in_features, p.k = tokens;
  p.lda = out_features, p.ldb = in_features, p.ldc = in_features;
  p.trans_a = true;
  p.beta = 1.f;
  gemm(p, device, stream);
}

}  // namespace slime::ops::cuda
