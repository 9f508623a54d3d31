// Row-major products on cuBLASLt (gemm_cuda.h). cuBLASLt is column-major: a row-major [r, c]
// matrix is the column-major [c, r] one, so C = op(A) op(B) is issued as C^T = op(B)^T op(A)^T,
// i.e. with the operands swapped and their transposition flags kept.
#include "models/e29a/gemm_cuda.h"

#include <array>
#include <map>
#include <string>
#include <utility>

#include <cublasLt.h>

#include "core/error.h"

namespace models::e29a {
namespace detail {
namespace {

constexpr std::uint32_t kDeterministicReductions =
    CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;

std::uint32_t pointer_alignment(const void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  std::uint32_t alignment = 256;
  while (alignment > 1 && address % alignment != 0) alignment /= 2;
  return alignment;
}

const char* type_name(cudaDataType_t type) { return type == CUDA_R_32F ? "fp32" : "bf16"; }

}  // namespace

class RowGemmCache {
 public:
  RowGemmCache(cublasLtHandle_t handle, cudaStream_t stream) : handle_(handle), stream_(stream) {}

  void run(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b, const Output& c,
           ops::DeviceWorkspace workspace) {
    if (m <= 0 || n <= 0 || k <= 0) {
      throw core::Error("e29a gemm: m, n, k must be positive, got " + std::to_string(m) + ", " + std::to_string(n) +
                        ", " + std::to_string(k));
    }
    if (a.type != b.type || (a.type != CUDA_R_32F && a.type != CUDA_R_16BF) ||
        (c.type != CUDA_R_32F && c.type != CUDA_R_16BF) || (c.accumulate && c.type != CUDA_R_32F)) {
      throw core::Error("e29a gemm: unsupported types (operands fp32 or bf16 alike, output fp32 or bf16, "
                        "accumulation into fp32 only)");
    }
    if (!a.data || !b.data || !c.data) throw core::Error("e29a gemm: null operand");
    if (workspace.data == nullptr || workspace.bytes < ops::kLinearWorkspaceBytes ||
        reinterpret_cast<std::uintptr_t>(workspace.data) % 256 != 0) {
      throw core::Error("e29a gemm: needs a 256-byte aligned workspace of linear_workspace_bytes()");
    }
    const std::array<std::uint32_t, 3> alignments = {pointer_alignment(b.data), pointer_alignment(a.data),
                                                     pointer_alignment(c.data)};
    const Key key{m, n, k, a.ld, b.ld, c.ld, static_cast<std::int64_t>(a.transpose), static_cast<std::int64_t>(b.transpose),
                  static_cast<std::int64_t>(a.type), static_cast<std::int64_t>(c.type), c.accumulate ? 1 : 0,
                  alignments[0], alignments[1], alignments[2]};
    auto found = entries_.find(key);
    if (found == entries_.end()) found = entries_.emplace(key, create(m, n, k, a, b, c, alignments)).first;
    const Entry& entry = found->second;
    const float alpha = 1.0f, beta = c.accumulate ? 1.0f : 0.0f;
    // Column-major: D^T [n, m] = op(B)^T [n, k] op(A)^T [k, m].
    CUBLAS_CHECK(cublasLtMatmul(handle_, entry.desc, &alpha, b.data, entry.a, a.data, entry.b, &beta, c.data, entry.d,
                                c.data, entry.d, &entry.algo, workspace.data, entry.workspace_bytes, stream_));
  }

 private:
  using Key = std::array<std::int64_t, 14>;

  struct Entry {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::size_t workspace_bytes = 0;

    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    Entry(Entry&& o) noexcept
        : desc(std::exchange(o.desc, nullptr)),
          a(std::exchange(o.a, nullptr)),
          b(std::exchange(o.b, nullptr)),
          d(std::exchange(o.d, nullptr)),
          algo(o.algo),
          workspace_bytes(o.workspace_bytes) {}
    Entry& operator=(Entry&&) = delete;
    ~Entry() {
      if (d) (void)cublasLtMatrixLayoutDestroy(d);
      if (b) (void)cublasLtMatrixLayoutDestroy(b);
      if (a) (void)cublasLtMatrixLayoutDestroy(a);
      if (desc) (void)cublasLtMatmulDescDestroy(desc);
    }
  };

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

  static std::string describe(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b,
                              const Output& c) {
    auto t = [](Transpose x) { return x == Transpose::yes ? "T" : "N"; };
    return std::string("row-major product C[") + std::to_string(m) + ", " + std::to_string(n) + "] = op_" +
           t(a.transpose) + "(A) op_" + t(b.transpose) + "(B), k " + std::to_string(k) + ", lda " +
           std::to_string(a.ld) + ", ldb " + std::to_string(b.ld) + ", ldc " + std::to_string(c.ld) + ", operands " +
           type_name(a.type) + ", output " + type_name(c.type) + (c.accumulate ? " accumulated" : "");
  }

  Entry create(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b, const Output& c,
               const std::array<std::uint32_t, 3>& alignments) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      throw core::Error("e29a gemm: first use of a product shape inside a CUDA graph capture (" +
                        describe(m, n, k, a, b, c) + ")");
    }
    // Column-major operands: first B (m' = n), then A (n' = m).
    const cublasOperation_t trans_first = b.transpose == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t trans_second = a.transpose == Transpose::yes ? CUBLAS_OP_T : CUBLAS_OP_N;
    Entry entry;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&entry.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans_first, sizeof(trans_first)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSB, &trans_second, sizeof(trans_second)));
    const bool tf = trans_first == CUBLAS_OP_T, ts = trans_second == CUBLAS_OP_T;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.a, b.type, tf ? k : n, tf ? n : k, b.ld));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.b, a.type, ts ? m : k, ts ? k : m, a.ld));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.d, c.type, n, m, c.ld));

    Preference preference;
    preference.set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, static_cast<std::uint64_t>(ops::kLinearWorkspaceBytes));
    preference.set(CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, kDeterministicReductions);
    preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, alignments[0]);
    preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, alignments[1]);
    preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, alignments[2]);
    preference.set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, alignments[2]);

    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, entry.desc, entry.a, entry.b, entry.d,
                                                                 entry.d, preference.handle, 1, &result, &returned);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned == 0)) {
      throw core::Error("e29a gemm: cuBLASLt has no algorithm for the " + describe(m, n, k, a, b, c) +
                        " with fp32 compute and split-K schemes NONE | COMPUTE_TYPE");
    }
    CUBLAS_CHECK(status);
    CUBLAS_CHECK(result.state);
    entry.algo = result.algo;
    entry.workspace_bytes = result.workspaceSize;
    return entry;
  }

  cublasLtHandle_t handle_;
  cudaStream_t stream_;
  std::map<Key, Entry> entries_;
};

}  // namespace detail

GemmPlan::GemmPlan(const core::DeviceContext& context) {
  if (!context.is_cuda()) throw core::Error("e29a GemmPlan needs a CUDA device context, got " + context.device().str());
  cache_ = std::make_unique<detail::RowGemmCache>(context.cublaslt(), context.stream());
}

GemmPlan::~GemmPlan() = default;
GemmPlan::GemmPlan(GemmPlan&&) noexcept = default;
GemmPlan& GemmPlan::operator=(GemmPlan&&) noexcept = default;

void GemmPlan::run(std::int64_t m, std::int64_t n, std::int64_t k, const Matrix& a, const Matrix& b, const Output& c,
                   ops::DeviceWorkspace workspace) {
  cache_->run(m, n, k, a, b, c, workspace);
}

}  // namespace models::e29a
