#include <fstream>
#include "support/test_support.h"

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace test {

std::uint64_t fresh_seed() {
  std::uint64_t seed = 0;
  if (const char* fixed = std::getenv("LLMTRAIN_TEST_SEED")) {
    seed = std::strtoull(fixed, nullptr, 10);
  } else {
    seed = static_cast<std::uint64_t>(std::chrono::high_resolution_clock::now().time_since_epoch().count()) ^
           std::random_device{}();
  }
  std::printf("[ seed     ] LLMTRAIN_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

std::vector<float> random_normal(std::mt19937_64& rng, std::size_t n, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> out(n);
  for (float& x : out) x = dist(rng);
  return out;
}

std::vector<float> random_grads(std::mt19937_64& rng, const optim::SlabLayout& layout, float scale) {
  std::vector<float> g(static_cast<std::size_t>(layout.total_elements()), 0.0f);
  std::normal_distribution<float> dist(0.0f, scale);
  for (const auto& t : layout.tensors()) {
    for (std::int64_t i = 0; i < t.numel; ++i) g[static_cast<std::size_t>(t.offset + i)] = dist(rng);
  }
  return g;
}

void poison_one_gradient(std::mt19937_64& rng, const std::vector<optim::Segment>& segments, std::vector<float>& grads) {
  if (segments.empty()) return;
  const optim::Segment& seg = segments[rng() % segments.size()];
  if (seg.length == 0) return;
  const auto at = seg.offset + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(seg.length));
  grads[static_cast<std::size_t>(at)] = (rng() % 2) ? NAN : -INFINITY;
}

std::vector<optim::ParamSpec> random_specs(std::mt19937_64& rng, int count, std::int64_t max_numel) {
  static const std::int64_t awkward[] = {0, 1, 2, 3, 5, 7, 63, 64, 65, 127, 255, 256, 257, 1000, 1023, 4097};
  std::vector<optim::ParamSpec> specs;
  std::uniform_int_distribution<int> pick(0, 9);
  for (int i = 0; i < count; ++i) {
    optim::ParamSpec s;
    s.name = "p" + std::to_string(i);
    const int kind = pick(rng);
    if (kind < 4) {
      s.shape = {awkward[std::uniform_int_distribution<std::size_t>(0, std::size(awkward) - 1)(rng)]};
    } else if (kind < 7) {
      const std::int64_t rows = std::uniform_int_distribution<std::int64_t>(1, 97)(rng);
      const std::int64_t cols =
          std::uniform_int_distribution<std::int64_t>(1, std::max<std::int64_t>(1, max_numel / rows))(rng);
      s.shape = {rows, cols};
    } else {
      s.shape = {std::uniform_int_distribution<std::int64_t>(1, max_numel)(rng)};
    }
    s.decay = pick(rng) < 7;
    s.lr_scale = pick(rng) < 8 ? 1.0f : 0.25f * static_cast<float>(pick(rng) + 1);
    specs.push_back(s);
  }
  return specs;
}

namespace {
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}
}  // namespace

cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& work) {
  cudaGraph_t graph = nullptr;
  check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "cudaStreamBeginCapture");
  work();
  check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
  return graph;
}

int kernel_nodes(cudaGraph_t graph) {
  std::size_t count = 0;
  check(cudaGraphGetNodes(graph, nullptr, &count), "cudaGraphGetNodes");
  std::vector<cudaGraphNode_t> nodes(count);
  check(cudaGraphGetNodes(graph, nodes.data(), &count), "cudaGraphGetNodes");
  int kernels = 0;
  for (auto node : nodes) {
    cudaGraphNodeType type;
    check(cudaGraphNodeGetType(node, &type), "cudaGraphNodeGetType");
    kernels += type == cudaGraphNodeTypeKernel;
  }
  return kernels;
}

::testing::AssertionResult all_close(const std::vector<float>& actual, const std::vector<float>& expected, double rtol,
                                     double atol) {
  if (actual.size() != expected.size()) {
    return ::testing::AssertionFailure() << "size " << actual.size() << " != expected " << expected.size();
  }
  std::size_t bad = 0, worst = 0;
  double worst_excess = -1;
  for (std::size_t i = 0; i < actual.size(); ++i) {
    const double a = actual[i], b = expected[i];
    const double limit = rtol * std::fabs(b) + atol;
    const double err = std::fabs(a - b);
    const bool ok = (std::isnan(a) && std::isnan(b)) || (a == b) || err <= limit;
    if (!ok) {
      ++bad;
      const double excess = std::isfinite(err) ? err / (limit > 0 ? limit : 1e-300) : 1e300;
      if (excess > worst_excess) {
        worst_excess = excess;
        worst = i;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream os;
  os.precision(9);
  os << bad << " of " << actual.size() << " elements differ (rtol " << rtol << ", atol " << atol << "); worst at ["
     << worst << "]: " << actual[worst] << " vs expected " << expected[worst];
  return ::testing::AssertionFailure() << os.str();
}

std::optional<std::filesystem::path> find_data(const char* variable, const std::filesystem::path& fallback) {
  if (const char* value = std::getenv(variable); value != nullptr && *value != '\0') {
    if (std::filesystem::is_regular_file(value)) return std::filesystem::path(value);
    return std::nullopt;
  }
  if (std::filesystem::is_regular_file(fallback)) return fallback;
  return std::nullopt;
}

std::string read_file(const std::filesystem::path& path) {
  std::ifstream file(path, std::ios::binary);
  std::ostringstream content;
  content << file.rdbuf();
  return std::move(content).str();
}

}  // namespace test
