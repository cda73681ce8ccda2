// The cuBLAS backend of the grouped GEMM (slime/ops/cuda/grouped_gemm.hpp):
// group sizes known on the host, cublasGemmGroupedBatchedEx for the passes
// whose type combination it has, one cublasGemmEx per expert for the others;
// the backend choice (explicit, process-wide, environment).
//
// Per expert e with n_e > 0 rows starting at row r0, the row-major product
// C[m, n] = op(A) · op(B) (as ops::cuda::gemm maps it to column-major):
//   pass             m     n    k     A (lda)                  B (ldb)                    C (ldc)
//   forward          n_e   out  in    x + r0·in     (in)       w_e [out, in]ᵀ (in)        y + r0·out   (out)
//   backward_input   n_e   in   out   dy + r0·out   (out)      w_e [out, in]  (in)        dx + r0·in   (in)
//   backward_weight  out   in   n_e   (dy + r0·out)ᵀ (out)     x + r0·in      (in)        dw_e [out, in] (in)
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <utility>
#include <vector>

#include "slime/core/device.hpp"
#include "slime/core/error.hpp"
#include "slime/core/host_sync.hpp"
#include "slime/core/memory.hpp"
#include "slime/core/stream.hpp"
#include "slime/ops/batch_invariant.hpp"
#include "slime/ops/cuda/grouped_gemm.hpp"
#include "slime/ops/cuda/linear.hpp"

namespace slime::ops::cuda {

// Declared in src/ops/grouped_gemm.cu, which dispatches here.
void grouped_gemm_cublas(const GroupedGemmParams& p, StreamHandle stream);
void check_grouped_gemm_host_offsets(const int32_t* o, int64_t experts, int64_t rows);

namespace {

using Pass = GroupedGemmPass;

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    SLIME_FAIL("cuBLAS error ", cublasGetStatusName(status), " (", cublasGetStatusString(status), ") in ", what);
}

cudaDataType_t cuda_type(DType t) { return t == DType::bf16 ? CUDA_R_16BF : CUDA_R_32F; }

// ---- the backend choice ---------------------------------------------------------------

std::atomic<int> g_backend{-1};       // -1: not read from the environment yet
std::atomic<int64_t> g_fallbacks{0};  // grouped calls refused with NOT_SUPPORTED

GroupedGemmBackend backend_from_env() {
  const char* v = std::getenv("SLIME_GROUPED_GEMM_BACKEND");
  const std::string_view s = v == nullptr ? std::string_view() : std::string_view(v);
  if (s.empty() || s == "auto" || s == "automatic") return GroupedGemmBackend::automatic;
  if (s == "kernel") return GroupedGemmBackend::kernel;
  if (s == "cublas") return GroupedGemmBackend::cublas;
  SLIME_FAIL("SLIME_GROUPED_GEMM_BACKEND = \"", s, "\": expected kernel, cublas or auto");
}

// ---- per (thread, device) state: a cuBLAS handle and the pointer ring -----------------

class DeviceState {
 public:
  DeviceState() = default;
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  // Runs at thread exit (with the device made current by the owner); errors
  // are dropped, CUDA may be tearing down.
  void release(int device) noexcept {
    const Stream legacy = Stream::default_for(Device::cuda(device));
    for (cudaEvent_t& e : events_) {
      if (e == nullptr) continue;
      (void)cudaEventSynchronize(e);
      (void)cudaEventDestroy(e);
      e = nullptr;
    }
    free_ring(legacy);
    if (handle_ != nullptr) {
      (void)cublasDestroy(handle_);  // synchronises the device first
      handle_ = nullptr;
      deallocate(MemoryKind::device, workspace_, kCublasWorkspaceBytes, legacy);
      workspace_ = nullptr;
    }
    (void)cudaGetLastError();
  }

  // The handle, bound to `stream` with this state's workspace (device current).
  cublasHandle_t handle(int device, cudaStream_t stream) {
    if (handle_ == nullptr) create(device);
    // cublasSetStream resets the workspace to cuBLAS's pool: set ours again.
    check_cublas(cublasSetStream(handle_, stream), "cublasSetStream");
    check_cublas(cublasSetWorkspace(handle_, workspace_, kCublasWorkspaceBytes), "cublasSetWorkspace");
    return handle_;
  }

  // The next slot of at least `n` pointers: host (pinned) and device halves
  // and the event that guards both. Blocks until the slot's last GEMM is done
  // (at once unless the host is kGroupedGemmPointerSlots calls ahead).
  struct Slot {
    void** host;
    void** dev;
    cudaEvent_t event;
  };
  Slot acquire(int device, std::size_t n) {
    if (n > capacity_) grow(device, n);
    const int i = next_;
    next_ = (next_ + 1) % kGroupedGemmPointerSlots;
    note_host_sync();  // the slot's last use done (at once unless the GPU lags a ring behind)
    SLIME_CUDA_CHECK(cudaEventSynchronize(events_[std::size_t(i)]));  // never recorded: returns at once
    return {pinned_ + std::size_t(i) * capacity_, device_ + std::size_t(i) * capacity_, events_[std::size_t(i)]};
  }

  // Host-side arrays of the grouped call, reused (they keep their capacity).
  std::vector<std::pair<int32_t, int32_t>> problems;  // (rows, expert) of the experts with rows
  std::vector<cublasOperation_t> trans_a, trans_b;
  std::vector<int> m, n, k, lda, ldb, ldc, group_size;
  std::vector<float> alpha, beta;

 private:
  void create(int device) {
    const Stream legacy = Stream::default_for(Device::cuda(device));
    void* ws = allocate(MemoryKind::device, kCublasWorkspaceBytes, legacy);
    legacy.synchronize();  // ordered on the legacy stream; used on others
    cublasHandle_t h = nullptr;
    const cublasStatus_t status = cublasCreate(&h);
    if (status != CUBLAS_STATUS_SUCCESS) {
      deallocate(MemoryKind::device, ws, kCublasWorkspaceBytes, legacy);
      check_cublas(status, "cublasCreate");
    }
    // fp32 split-K partial sums, as Linear's handles (the accumulation contract).
    const cublasStatus_t mode =
        cublasSetMathMode(h, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (mode != CUBLAS_STATUS_SUCCESS) {
      (void)cublasDestroy(h);
      deallocate(MemoryKind::device, ws, kCublasWorkspaceBytes, legacy);
      check_cublas(mode, "cublasSetMathMode");
    }
    handle_ = h;
    workspace_ = ws;
  }

  std::size_t ring_bytes() const { return std::size_t(kGroupedGemmPointerSlots) * capacity_ * sizeof(void*); }

  void free_ring(const Stream& legacy) noexcept {
    deallocate(MemoryKind::device, device_, ring_bytes(), legacy);
    deallocate(MemoryKind::pinned, pinned_, ring_bytes());
    device_ = pinned_ = nullptr;
    capacity_ = 0;
  }

  // All slots at once, after every slot's last use has completed.
  void grow(int device, std::size_t n) {
    const Stream legacy = Stream::default_for(Device::cuda(device));
    for (cudaEvent_t& e : events_) {
      if (e == nullptr) {
        SLIME_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
      } else {
        SLIME_CUDA_CHECK(cudaEventSynchronize(e));
      }
    }
    free_ring(legacy);
    // 3 · 256 pointers (A, B, C of 256 problems) at least; 2 pointers (16 bytes) granularity.
    std::size_t cap = std::max<std::size_t>(n, 3 * 256);
    cap = (cap + 1) / 2 * 2;
    capacity_ = cap;
    device_ = static_cast<void**>(allocate(MemoryKind::device, ring_bytes(), legacy));
    pinned_ = static_cast<void**>(allocate(MemoryKind::pinned, ring_bytes()));
    legacy.synchronize();
    next_ = 0;
  }

  cublasHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  std::size_t capacity_ = 0;  // pointers per slot
  void** device_ = nullptr;   // kGroupedGemmPointerSlots · capacity_
  void** pinned_ = nullptr;   // likewise, page-locked
  std::array<cudaEvent_t, kGroupedGemmPointerSlots> events_{};
  int next_ = 0;
};

class ThreadStates {
 public:
  ThreadStates() = default;
  ThreadStates(const ThreadStates&) = delete;
  ThreadStates& operator=(const ThreadStates&) = delete;
  ~ThreadStates() {
    for (int d = 0; d < int(states_.size()); ++d) {
      if (!used_[std::size_t(d)]) continue;
      if (cudaSetDevice(d) == cudaSuccess) states_[std::size_t(d)].release(d);
      (void)cudaGetLastError();
    }
  }
  DeviceState& get(int device) {
    SLIME_CHECK(device >= 0 && device < int(states_.size()), "CUDA device index ", device, " out of range");
    used_[std::size_t(device)] = true;
    return states_[std::size_t(device)];
  }

 private:
  std::array<DeviceState, ::slime::detail::kMaxDevices> states_{};
  std::array<bool, ::slime::detail::kMaxDevices> used_{};
};

// ---- one expert's product -------------------------------------------------------------

struct Geometry {
  Pass pass;
  const char* a;
  const char* b;
  char* c;
  std::size_t in_bytes, out_bytes;  // element sizes
  int64_t in_f, out_f;

  // Row-major C = op(A) · op(B) of expert e with rows [r0, r0 + rows).
  GemmParams of(int64_t e, int64_t r0, int64_t rows) const {
    GemmParams g;
    const int64_t K = in_f, No = out_f;
    switch (pass) {
      case Pass::forward:
        g.a = a + std::size_t(r0 * K) * in_bytes;
        g.b = b + std::size_t(e * No * K) * in_bytes;
        g.c = c + std::size_t(r0 * No) * out_bytes;
        g.m = rows, g.n = No, g.k = K;
        g.lda = K, g.ldb = K, g.ldc = No;
        g.trans_b = true;
        break;
      case Pass::backward_input:
        g.a = a + std::size_t(r0 * No) * in_bytes;
        g.b = b + std::size_t(e * No * K) * in_bytes;
        g.c = c + std::size_t(r0 * K) * out_bytes;
        g.m = rows, g.n = K, g.k = No;
        g.lda = No, g.ldb = K, g.ldc = K;
        break;
      case Pass::backward_weight:
        g.a = a + std::size_t(r0 * No) * in_bytes;
        g.b = b + std::size_t(r0 * K) * in_bytes;
        g.c = c + std::size_t(e * No * K) * out_bytes;
        g.m = No, g.n = K, g.k = rows;
        g.lda = No, g.ldb = K, g.ldc = K;
        g.trans_a = true;
        break;
    }
    return g;
  }
};

// One cublasGemmEx per expert with rows.
void run_loop(const GroupedGemmParams& p, const Geometry& geo, const int32_t* off, float beta, int device,
              cudaStream_t stream) {
  for (int64_t e = 0; e < p.experts; ++e) {
    const int64_t rows = int64_t(off[e + 1]) - off[e];
    if (rows == 0) continue;
    GemmParams g = geo.of(e, off[e], rows);
    g.ab_dtype = p.in_dtype;
    g.c_dtype = p.out_dtype;
    g.beta = beta;
    gemm(g, device, stream);
  }
}

// One cublasGemmGroupedBatchedEx over the experts with rows, those of equal
// row counts in one group. False when cuBLAS does not support the types.
bool run_grouped(const GroupedGemmParams& p, const Geometry& geo, const int32_t* off, float beta, int device,
                 cudaStream_t stream) {
  thread_local ThreadStates states;
  DeviceState& st = states.get(device);
  auto& probs = st.problems;
  probs.clear();
  for (int64_t e = 0; e < p.experts; ++e)
    if (off[e + 1] > off[e]) probs.emplace_back(off[e + 1] - off[e], int32_t(e));
  if (probs.empty()) return true;
  std::sort(probs.begin(), probs.end());  // by rows, then expert: deterministic
  const std::size_t P = probs.size(), stride = (P + 1) / 2 * 2;

  st.trans_a.clear(), st.trans_b.clear(), st.m.clear(), st.n.clear(), st.k.clear();
  st.lda.clear(), st.ldb.clear(), st.ldc.clear(), st.group_size.clear(), st.alpha.clear(), st.beta.clear();
  cublasHandle_t h = st.handle(device, stream);
  const DeviceState::Slot slot = st.acquire(device, 3 * stride);
  for (std::size_t i = 0; i < P; ++i) {
    const auto [rows, e] = probs[i];
    const GemmParams g = geo.of(e, off[e], rows);
    // Column-major Cᵀ = op(B)ᵀ · op(A)ᵀ: cuBLAS's A is our B and vice versa.
    slot.host[i] = const_cast<void*>(g.b);
    slot.host[stride + i] = const_cast<void*>(g.a);
    slot.host[2 * stride + i] = g.c;
    if (i > 0 && probs[i - 1].first == rows) {
      ++st.group_size.back();
      continue;
    }
    st.trans_a.push_back(g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N);
    st.trans_b.push_back(g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N);
    st.m.push_back(int(g.n));
    st.n.push_back(int(g.m));
    st.k.push_back(int(g.k));
    st.lda.push_back(int(g.ldb));
    st.ldb.push_back(int(g.lda));
    st.ldc.push_back(int(g.ldc));
    st.alpha.push_back(1.f);
    st.beta.push_back(beta);
    st.group_size.push_back(1);
  }
  SLIME_CUDA_CHECK(cudaMemcpyAsync(slot.dev, slot.host, 3 * stride * sizeof(void*), cudaMemcpyHostToDevice, stream));
  const cudaDataType_t ab = cuda_type(p.in_dtype), ct = cuda_type(p.out_dtype);
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      h, st.trans_a.data(), st.trans_b.data(), st.m.data(), st.n.data(), st.k.data(), st.alpha.data(),
      const_cast<const void* const*>(slot.dev), ab, st.lda.data(), const_cast<const void* const*>(slot.dev + stride),
      ab, st.ldb.data(), st.beta.data(), slot.dev + 2 * stride, ct, st.ldc.data(), int(st.group_size.size()),
      st.group_size.data(), CUBLAS_COMPUTE_32F);
  // Recorded whatever the status: the copy above reads the pinned slot.
  SLIME_CUDA_CHECK(cudaEventRecord(slot.event, stream));
  if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
    g_fallbacks.fetch_add(1, std::memory_order_relaxed);
    return false;
  }
  if (status != CUBLAS_STATUS_SUCCESS) [[unlikely]]
    SLIME_FAIL("cuBLAS error ", cublasGetStatusName(status), " (", cublasGetStatusString(status),
               ") in cublasGemmGroupedBatchedEx: ", P, " experts in ", st.group_size.size(), " groups, pass ",
               int(p.pass), ", in ", dtype_name(p.in_dtype), ", out ", dtype_name(p.out_dtype), ", in_features ",
               p.in_features, ", out_features ", p.out_features, ", on cuda:", device);
  return true;
}

}  // namespace

void check_grouped_gemm_host_offsets(const int32_t* o, int64_t experts, int64_t rows) {
  SLIME_CHECK(o[0] == 0, "grouped_gemm: host offsets[0] = ", o[0], ", expected 0");
  for (int64_t e = 0; e < experts; ++e)
    SLIME_CHECK(o[e + 1] >= o[e], "grouped_gemm: host offsets must be non-decreasing, got offsets[", e, "] = ", o[e],
                " > offsets[", e + 1, "] = ", o[e + 1]);
  SLIME_CHECK(o[experts] == rows, "grouped_gemm: host offsets[", experts, "] = ", o[experts],
              ", expected the row count ", rows);
}

namespace {
std::atomic<bool> g_grouped_api{true};
}  // namespace

void set_grouped_gemm_cublas_grouped_api(bool on) { g_grouped_api.store(on, std::memory_order_relaxed); }
bool grouped_gemm_cublas_grouped_api() { return g_grouped_api.load(std::memory_order_relaxed); }

void set_grouped_gemm_backend(GroupedGemmBackend b) { g_backend.store(int(b), std::memory_order_relaxed); }

GroupedGemmBackend grouped_gemm_backend() {
  int b = g_backend.load(std::memory_order_relaxed);
  if (b < 0) {
    int expected = -1;
    g_backend.compare_exchange_strong(expected, int(backend_from_env()), std::memory_order_relaxed);
    b = g_backend.load(std::memory_order_relaxed);
  }
  return GroupedGemmBackend(b);
}

GroupedGemmBackend grouped_gemm_backend_for(const GroupedGemmParams& p) {
  if (p.tile != GroupedGemmTile::automatic) return GroupedGemmBackend::kernel;
  // What only the kernels run: one implicit group, a custom pitch or scale.
  if (p.offsets == nullptr || p.ldc != 0 || p.alpha != 1.f) return GroupedGemmBackend::kernel;
  if (p.backend != GroupedGemmBackend::automatic) return p.backend;
  // The batch-invariant mode: results that do not depend on the group sizes.
  if (batch_invariant()) return GroupedGemmBackend::kernel;
  const GroupedGemmBackend b = grouped_gemm_backend();
  if (b != GroupedGemmBackend::automatic) return b;
  // Host offsets pick cuBLAS unless the Hopper kernels take these inputs.
  if (p.host_offsets == nullptr) return GroupedGemmBackend::kernel;
  const GroupedGemmTile t = grouped_gemm_tile_for(p);
  const bool hopper = t == GroupedGemmTile::sm90_m128n256 || t == GroupedGemmTile::sm90_m128n128;
  return hopper ? GroupedGemmBackend::kernel : GroupedGemmBackend::cublas;
}

int64_t grouped_gemm_cublas_fallbacks() { return g_fallbacks.load(std::memory_order_relaxed); }

const char* grouped_gemm_backend_name(GroupedGemmBackend b) {
  switch (b) {
    case GroupedGemmBackend::automatic:
      return "automatic";
    case GroupedGemmBackend::kernel:
      return "kernel";
    case GroupedGemmBackend::cublas:
      return "cublas";
  }
  return "unknown";
}

void grouped_gemm_cublas(const GroupedGemmParams& p, StreamHandle stream) {
  int device = 0;
  SLIME_CUDA_CHECK(cudaGetDevice(&device));
  // Host offsets: given (validated by grouped_gemm), or fetched (forced
  // backend without them: one copy and a stream synchronisation).
  std::vector<int32_t> fetched;
  const int32_t* off = p.host_offsets;
  if (off == nullptr) {
    fetched.resize(std::size_t(p.experts + 1));
    SLIME_CUDA_CHECK(
        cudaMemcpyAsync(fetched.data(), p.offsets, fetched.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
    note_host_sync();
    SLIME_CUDA_CHECK(cudaStreamSynchronize(stream));
    check_grouped_gemm_host_offsets(fetched.data(), p.experts, p.rows);
    off = fetched.data();
  }

  const bool wgrad = p.pass == Pass::backward_weight;
  const int64_t out_extent = p.pass == Pass::forward ? p.out_features : p.in_features;
  if (p.rows == 0 || p.out_features == 0 || p.in_features == 0) {
    // wgrad adds nothing; y / dx are empty, or (nothing to sum) get zeros.
    if (wgrad || p.rows == 0 || out_extent == 0 || p.accumulate) return;
    SLIME_CUDA_CHECK(cudaMemsetAsync(p.c, 0, std::size_t(p.rows * out_extent) * dtype_size(p.out_dtype), stream));
    return;
  }

  const Geometry geo{p.pass,
                     static_cast<const char*>(p.a),
                     static_cast<const char*>(p.b),
                     static_cast<char*>(p.c),
                     dtype_size(p.in_dtype),
                     dtype_size(p.out_dtype),
                     p.in_features,
                     p.out_features};
  const float beta = wgrad || p.accumulate ? 1.f : 0.f;
  // The grouped call when selected and cuBLAS has the type combination; the
  // per-expert loop otherwise (and where it answers NOT_SUPPORTED, checked
  // before it launches anything).
  if (grouped_gemm_cublas_grouped_api() && !wgrad && p.out_dtype == p.in_dtype &&
      run_grouped(p, geo, off, beta, device, stream))
    return;
  run_loop(p, geo, off, beta, device, stream);
}

}  // namespace slime::ops::cuda
