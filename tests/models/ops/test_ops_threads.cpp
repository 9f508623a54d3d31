// The CPU references promise results that do not depend on the number of OpenMP threads
// (every output element is reduced by one thread in a fixed order): run the ops with reductions
// across rows on 1 and on 3 threads and require bit-identical outputs.
#include <omp.h>

#include "models/ops/attention.h"
#include "models/ops/cross_entropy.h"
#include "models/ops/embedding.h"
#include "models/ops/linear.h"
#include "models/ops/rmsnorm.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;

// Runs `body` with `threads` OpenMP threads and returns what it produced.
template <typename Body>
auto with_threads(int threads, Body&& body) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  auto result = body();
  omp_set_num_threads(saved);
  return result;
}

TEST(OpsThreads, ResultsDoNotDependOnThreadCount) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t tokens = 45, dim = 96, vocab = 301, hidden = 130;
  const auto x = test::random_normal(rng, tokens * dim), dy = test::random_normal(rng, tokens * hidden);
  const auto w = test::random_normal(rng, hidden * dim), table = test::random_normal(rng, vocab * dim, 0.3f);
  const auto norm_weight = test::random_normal(rng, dim);
  std::vector<std::int32_t> ids(tokens);
  for (std::int64_t n = 0; n < tokens; ++n) ids[n] = static_cast<std::int32_t>((n * 7) % 13);
  const ops::AttentionShape s{2, 15, 4, 2, 48};
  const auto q = test::random_normal(rng, 2 * 15 * 4 * 48), k = test::random_normal(rng, 2 * 15 * 2 * 48);
  const auto v = test::random_normal(rng, k.size()), dout = test::random_normal(rng, q.size());

  auto run_all = [&] {
    std::vector<std::vector<float>> results;
    std::vector<float> dx(x.size()), dw(w.size(), 0.0f);
    ops::linear_backward_cpu<float>(dy, x, w, tokens, dim, hidden, dx, dw);
    results.push_back(dx);
    results.push_back(dw);

    std::vector<float> dtable(table.size(), 0.0f);
    ops::embedding_backward_cpu<float>(ids, x, vocab, dim, dtable);
    results.push_back(dtable);

    std::vector<float> y(x.size()), rstd(tokens), dnorm(x.size()), dnorm_weight(dim, 0.0f);
    ops::rmsnorm_forward_cpu<float>(x, norm_weight, tokens, dim, 1e-6, y, rstd);
    ops::rmsnorm_backward_cpu<float>(x, x, norm_weight, rstd, tokens, dim, dnorm, dnorm_weight);
    results.push_back(dnorm_weight);

    std::vector<float> out(q.size()), lse(2 * 4 * 15), dq(q.size()), dk(k.size()), dv(v.size());
    ops::attention_forward_cpu<float>(s, q, k, v, out, lse);
    ops::attention_backward_cpu<float>(s, q, k, v, out, lse, dout, dq, dk, dv);
    results.insert(results.end(), {out, dq, dk, dv});

    std::vector<std::int32_t> targets(ids.begin(), ids.end());
    targets[3] = ops::kIgnoreIndex;
    std::vector<float> dhidden(x.size()), dhead(table.size(), 0.0f);
    const auto ce = ops::cross_entropy_backward_cpu<float>(x, table, targets, dim, vocab, dhidden, dhead, 1.0, 16);
    results.insert(results.end(), {dhidden, dhead, {static_cast<float>(ce.loss)}});
    return results;
  };
  const auto one = with_threads(1, run_all);
  const auto three = with_threads(3, run_all);
  ASSERT_EQ(one.size(), three.size());
  for (std::size_t i = 0; i < one.size(); ++i) EXPECT_EQ(one[i], three[i]) << "result " << i;
}

}  // namespace
