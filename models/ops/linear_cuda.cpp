// GPU linear layer: the three products of a bias-free linear layer (forward, input gradient,
// weight gradient) as cuBLASLt matmuls on bf16 operands with fp32 accumulation, and the cache that
// makes a steady-state call a map lookup plus one cublasLtMatmul (linear.h states the conventions).
//
// cuBLASLt is column-major; a row-major matrix [r, c] is the column-major matrix [c, r] with
// leading dimension c, so each row-major product is issued as its transpose:
//   forward   y[N, Out]   = x[N, In] W^T      ->  y^T  = op_T(W) x^T      (m Out, n N,   k In)
//   dgrad     dx[N, In]   = dy[N, Out] W      ->  dx^T = W^T dy^T         (m In,  n N,   k Out)
//   wgrad     dW[Out, In] += dy^T x           ->  dW^T += x^T op_T(dy^T)  (m In,  n Out, k N)
#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core/error.h"
#include "models/ops/linear.h"
#include "models/ops/op_checks.h"

namespace models::ops {

std::size_t linear_workspace_bytes() { return kLinearWorkspaceBytes; }

namespace detail {
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

}  // namespace

// One column-major product D = alpha * op(A) op(B) + beta * C with C = D, as cuBLASLt sees it.
struct GemmShape {
  cublasOperation_t trans_a;
  cublasOperation_t trans_b;
  std::int64_t m, n, k;
  std::int64_t lda, ldb, ldd;
  cudaDataType_t d_type;  // A and B are always bf16
  bool accumulate;        // beta = 1 (C = D read) instead of beta = 0
};

class GemmCache {
 public:
  GemmCache(cublasLtHandle_t handle, cudaStream_t stream) : handle_(handle), stream_(stream) {}

  void run(const GemmShape& shape, const void* a, const void* b, void* d, DeviceWorkspace workspace) {
    const std::array<std::uint32_t, 3> alignments = {pointer_alignment(a), pointer_alignment(b), pointer_alignment(d)};
    const Key key{static_cast<std::int64_t>(shape.trans_a), static_cast<std::int64_t>(shape.trans_b), shape.m, shape.n,
                  shape.k, shape.lda, shape.ldb, shape.ldd, static_cast<std::int64_t>(shape.d_type),
                  shape.accumulate ? 1 : 0, alignments[0], alignments[1], alignments[2]};
    auto found = entries_.find(key);
    if (found == entries_.end()) found = entries_.emplace(key, create(shape, alignments)).first;
    const Entry& entry = found->second;
    const float alpha = 1.0f;
    const float beta = shape.accumulate ? 1.0f : 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(handle_, entry.desc, &alpha, a, entry.a, b, entry.b, &beta, d, entry.d, d, entry.d,
                                &entry.algo, workspace.data, entry.workspace_bytes, stream_));
  }

  std::size_t size() const { return entries_.size(); }

 private:
  using Key = std::array<std::int64_t, 13>;

  // Owns the descriptors of one cached configuration.
  struct Entry {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
    std::size_t workspace_bytes = 0;

    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    Entry(Entry&& other) noexcept
        : desc(std::exchange(other.desc, nullptr)),
          a(std::exchange(other.a, nullptr)),
          b(std::exchange(other.b, nullptr)),
          d(std::exchange(other.d, nullptr)),
          algo(other.algo),
          workspace_bytes(other.workspace_bytes) {}
    Entry& operator=(Entry&&) = delete;
    ~Entry() {
      // Destruction must not throw; these calls only free host memory.
      if (d) (void)cublasLtMatrixLayoutDestroy(d);
      if (b) (void)cublasLtMatrixLayoutDestroy(b);
      if (a) (void)cublasLtMatrixLayoutDestroy(a);
      if (desc) (void)cublasLtMatmulDescDestroy(desc);
    }
  };

  // Preference descriptor, destroyed on every path out of create().
  struct Preference {
    cublasLtMatmulPreference_t handle = nullptr;
    Preference() { CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&handle)); }
    ~Preference() { (void)cublasLtMatmulPreferenceDestroy(handle); }
    Preference(const Preference&) = delete;
    Preference& operator=(const Preference&) = delete;
    template <typename T> void set(cublasLtMatmulPreferenceAttributes_t attribute, T value) {
      CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(handle, attribute, &value, sizeof(value)));
    }
  };

  static std::string describe(const GemmShape& s, const std::array<std::uint32_t, 3>& alignments) {
    auto op = [](cublasOperation_t t) { return t == CUBLAS_OP_T ? "T" : "N"; };
    return std::string("column-major product op_") + op(s.trans_a) + "(A) op_" + op(s.trans_b) + "(B), m " +
           std::to_string(s.m) + ", n " + std::to_string(s.n) + ", k " + std::to_string(s.k) + ", lda " +
           std::to_string(s.lda) + ", ldb " + std::to_string(s.ldb) + ", ldd " + std::to_string(s.ldd) + ", output " +
           (s.d_type == CUDA_R_32F ? "fp32" : "bf16") + (s.accumulate ? " accumulated" : "") +
           ", pointer alignments (bytes) A " + std::to_string(alignments[0]) + ", B " + std::to_string(alignments[1]) +
           ", D " + std::to_string(alignments[2]);
  }

  Entry create(const GemmShape& s, const std::array<std::uint32_t, 3>& alignments) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    CUDA_CHECK(cudaStreamIsCapturing(stream_, &capture));
    if (capture != cudaStreamCaptureStatusNone) {
      throw core::Error("LinearPlan: first use of a product shape inside a CUDA graph capture (" + describe(s, alignments) +
                        "); run the step once before capturing so the algorithm is chosen outside the capture");
    }
    Entry entry;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&entry.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSA, &s.trans_a, sizeof(s.trans_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(entry.desc, CUBLASLT_MATMUL_DESC_TRANSB, &s.trans_b, sizeof(s.trans_b)));
    // Stored (pre-transposition) shapes: op_T(X) of an [r, c] result is stored [c, r].
    const bool ta = s.trans_a == CUBLAS_OP_T, tb = s.trans_b == CUBLAS_OP_T;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.a, CUDA_R_16BF, ta ? s.k : s.m, ta ? s.m : s.k, s.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&entry.b, CUDA_R_16BF, tb ? s.n : s.k, tb ? s.k : s.n, s.ldb));
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
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, entry.desc, entry.a, entry.b, entry.d,
                                                                 entry.d, preference.handle, 1, &result, &returned);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && returned == 0)) {
      throw core::Error("LinearPlan: cuBLASLt has no algorithm for the " + describe(s, alignments) +
                        " with bf16 operands, fp32 compute and split-K schemes NONE | COMPUTE_TYPE");
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

namespace {

using checks::Region;

void check_shape(std::string_view op, std::int64_t rows, std::int64_t in_features, std::int64_t out_features) {
  checks::require_non_negative(op, "rows", rows);
  checks::require_positive(op, "in_features", in_features);
  checks::require_positive(op, "out_features", out_features);
}

// A device matrix argument: present, aligned to its element, and the byte range it covers.
template <typename Element>
Region matrix(std::string_view op, std::string_view name, const Element* data, std::int64_t elements) {
  if (data == nullptr) checks::fail(op, std::string(name) + " is null");
  if (reinterpret_cast<std::uintptr_t>(data) % sizeof(Element) != 0) {
    checks::fail(op, std::string(name) + " is not aligned to its " + std::to_string(sizeof(Element)) +
                         "-byte element");
  }
  return {name, data, static_cast<std::size_t>(elements) * sizeof(Element)};
}

void check_workspace(std::string_view op, DeviceWorkspace workspace) {
  if (workspace.data == nullptr || workspace.bytes < kLinearWorkspaceBytes) {
    checks::fail(op, "needs a device workspace of linear_workspace_bytes() = " + std::to_string(kLinearWorkspaceBytes) +
                         " bytes, got " + std::to_string(workspace.bytes) + (workspace.data ? "" : " (null)"));
  }
  if (reinterpret_cast<std::uintptr_t>(workspace.data) % 256 != 0) checks::fail(op, "workspace is not 256-byte aligned");
}

}  // namespace

LinearPlan::LinearPlan(const core::DeviceContext& context) {
  if (!context.is_cuda()) throw core::Error("LinearPlan needs a CUDA device context, got " + context.device().str());
  gemms_ = std::make_unique<detail::GemmCache>(context.cublaslt(), context.stream());
}

LinearPlan::~LinearPlan() = default;
LinearPlan::LinearPlan(LinearPlan&& other) noexcept = default;
LinearPlan& LinearPlan::operator=(LinearPlan&& other) noexcept = default;

std::size_t LinearPlan::cached_configurations() const { return gemms_->size(); }

void LinearPlan::forward(const __nv_bfloat16* x, const __nv_bfloat16* weight, std::int64_t rows,
                         std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* y,
                         DeviceWorkspace workspace) {
  constexpr std::string_view op = "linear_forward (cuda)";
  check_shape(op, rows, in_features, out_features);
  check_workspace(op, workspace);
  if (rows == 0) return;
  const Region x_region = matrix(op, "x", x, rows * in_features);
  const Region w_region = matrix(op, "weight", weight, out_features * in_features);
  const Region y_region = matrix(op, "y", y, rows * out_features);
  checks::require_disjoint(op, {y_region}, {x_region, w_region});
  const detail::GemmShape shape{CUBLAS_OP_T, CUBLAS_OP_N, out_features, rows, in_features,
                                in_features, in_features, out_features, CUDA_R_16BF, false};
  gemms_->run(shape, weight, x, y, workspace);
}

void LinearPlan::backward_input(const __nv_bfloat16* dy, const __nv_bfloat16* weight, std::int64_t rows,
                                std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* dx,
                                DeviceWorkspace workspace, GradOutput dx_mode) {
  constexpr std::string_view op = "linear_backward_input (cuda)";
  check_shape(op, rows, in_features, out_features);
  check_workspace(op, workspace);
  if (rows == 0) return;
  const Region dy_region = matrix(op, "dy", dy, rows * out_features);
  const Region w_region = matrix(op, "weight", weight, out_features * in_features);
  const Region dx_region = matrix(op, "dx", dx, rows * in_features);
  checks::require_disjoint(op, {dx_region}, {dy_region, w_region});
  const detail::GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_N, in_features, rows, out_features,
                                in_features, out_features, in_features, CUDA_R_16BF,
                                dx_mode == GradOutput::accumulate};
  gemms_->run(shape, weight, dy, dx, workspace);
}

void LinearPlan::backward_weight(const __nv_bfloat16* dy, const __nv_bfloat16* x, std::int64_t rows,
                                 std::int64_t in_features, std::int64_t out_features, float* dweight,
                                 DeviceWorkspace workspace) {
  constexpr std::string_view op = "linear_backward_weight (cuda)";
  check_shape(op, rows, in_features, out_features);
  check_workspace(op, workspace);
  if (rows == 0) return;  // dweight += 0
  const Region dy_region = matrix(op, "dy", dy, rows * out_features);
  const Region x_region = matrix(op, "x", x, rows * in_features);
  const Region dw_region = matrix(op, "dweight", dweight, out_features * in_features);
  checks::require_disjoint(op, {dw_region}, {dy_region, x_region});
  const detail::GemmShape shape{CUBLAS_OP_N, CUBLAS_OP_T, in_features, out_features, rows,
                                in_features, out_features, in_features, CUDA_R_32F, true};
  gemms_->run(shape, x, dy, dweight, workspace);
}

void LinearPlan::backward(const __nv_bfloat16* dy, const __nv_bfloat16* x, const __nv_bfloat16* weight,
                          std::int64_t rows, std::int64_t in_features, std::int64_t out_features, __nv_bfloat16* dx,
                          float* dweight, DeviceWorkspace workspace, GradOutput dx_mode) {
  if (rows > 0) {
    checks::require_disjoint("linear_backward (cuda)",
                             {Region{"dx", dx, static_cast<std::size_t>(rows * in_features) * sizeof(*dx)},
                              Region{"dweight", dweight, static_cast<std::size_t>(out_features * in_features) * sizeof(float)}},
                             {});
  }
  backward_input(dy, weight, rows, in_features, out_features, dx, workspace, dx_mode);
  backward_weight(dy, x, rows, in_features, out_features, dweight, workspace);
}

}  // namespace models::ops
