// The cuBLASLt product cache (gemm_cache.h).
#include "models/ops/gemm_cache.h"

#include <utility>

#include "core/error.h"

namespace models::ops::detail {
namespace {

// Split-K schemes allowed (linear.h, Determinism): one pass, or fp32 partials in the workspace
// reduced by a separate step.
constexpr std::uint32_t kDeterministicReductions =
    CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;

// Largest power of two (at most 256) dividing the address: what the kernel may assume.
std::uint32_t pointer_alignment(const void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  std::uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

const char* type_name(cudaDataType_t type) { return type == CUDA_R_32F ? "fp32" : "bf16"; }

// Preference descriptor, destroyed on every path out of create().
struct Preference {
  cublasLtMatmulPreference_t handle = nullptr;
  Preference() { CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&handle)); }
  ~Preference() { (void)cublasLtMatmulPreferenceDestroy(handle); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
  template <typename T>
  void set(cublasLtMatmulPreferenceAttributes_t attribute, T value) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(handle, attribute, &value, sizeof(value)));
  }
};

std::string describe(const GemmShape& s, const std::array<std::uint32_t, 3>& alignments) {
  auto op = [](cublasOperation_t t) { return t == CUBLAS_OP_T ? "T" : "N"; };
  return std::string("column-major product op_") + op(s.trans_a) + "(A) op_" + op(s.trans_b) + "(B), m " +
         std::to_string(s.m) + ", n " + std::to_string(s.n) + ", k " + std::to_string(s.k) + ", lda " +
         std::to_string(s.lda) + ", ldb " + std::to_string(s.ldb) + ", ldd " + std::to_string(s.ldd) + ", operands " +
         type_name(s.ab_type) + ", output " + type_name(s.d_type) + (s.accumulate ? " accumulated" : "") +
         ", pointer alignments (bytes) A " + std::to_string(alignments[0]) + ", B " + std::to_string(alignments[1]) +
         ", D " + std::to_string(alignments[2]);
}

}  // namespace

GemmCache::GemmCache(cublasLtHandle_t handle, cudaStream_t stream, std::string owner)
    : handle_(handle), stream_(stream), owner_(std::move(owner)) {}

GemmCache::~GemmCache() = default;

void GemmCache::run(const GemmShape& shape, const void* a, const void* b, void* d, DeviceWorkspace workspace) {
  const std::array<std::uint32_t, 3> alignments = {pointer_alignment(a), pointer_alignment(b), pointer_alignment(d)};
  const Key key{static_cast<std::int64_t>(shape.trans_a),
                static_cast<std::int64_t>(shape.trans_b),
                shape.m,
                shape.n,
                shape.k,
                shape.lda,
                shape.ldb,
                shape.ldd,
                static_cast<std::int64_t>(shape.d_type),
                shape.accumulate ? 1 : 0,
                static_cast<std::int64_t>(shape.ab_type),
                alignments[0],
                alignments[1],
                alignments[2]};
  auto found = entries_.find(key);
  if (found == entries_.end()) found = entries_.emplace(key, create(shape, alignments)).first;
  const Entry& entry = found->second;
  const float alpha = 1.0f;
  const float beta = shape.accumulate ? 1.0f : 0.0f;
  CUBLAS_CHECK(cublasLtMatmul(handle_, entry.desc, &alpha, a, entry.a, b, entry.b, &beta, d, entry.d, d, entry.d,
                              &entry.algo, workspace.data, entry.workspace_bytes, stream_));
}

GemmCache::Entry GemmCache::create(const GemmShape& s, const std::array<std::uint32_t, 3>& alignments) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    throw core::Error(owner_ + ": first use of a product shape inside a CUDA graph capture (" +
                      describe(s, alignments) +
                      "); run the step once before capturing so the algorithm is chosen outside the capture");
  }
  Entry entry;
  CUBLAS_CHECK(cublasLtMatmulDescCreate(&entry.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSA, &s.trans_a, sizeof(s.trans_a)));
  CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSB, &s.trans_b, sizeof(s.trans_b)));
  // Stored (pre-transposition) shapes: op_T(X) of an [r, c] result is stored [c, r].
  const bool ta = s.trans_a == CUBLAS_OP_T, tb = s.trans_b == CUBLAS_OP_T;
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.a, s.ab_type, ta ? s.k : s.m, ta ? s.m : s.k, s.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.b, s.ab_type, tb ? s.n : s.k, tb ? s.k : s.n, s.ldb));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.d, s.d_type, s.m, s.n, s.ldd));

  Preference preference;
  preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(kLinearWorkspaceBytes));
  preference.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, kDeterministicReductions);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignments[0]);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignments[1]);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignments[2]);
  preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignments[2]);

  cublasLtMatmulHeuristicResult_t result{};
  int returned = 0;
  const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, entry.desc, entry.a, entry.b, entry.d, entry.d,
                                                               preference.handle, 1, &result, &returned);
  if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned == 0)) {
    throw core::Error(owner_ + ": cuBLASLt has no algorithm for the " + describe(s, alignments) +
                      " with fp32 compute and split-K schemes NONE | COMPUTE_TYPE");
  }
  CUBLAS_CHECK(status);
  CUBLAS_CHECK(result.state);
  entry.algo = result.algo;
  entry.workspace_bytes = result.workspaceSize;
  return entry;
}

}  // namespace models::ops::detail
