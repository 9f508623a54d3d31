// Embedding: forward is an exact gather, backward adds into the table gradient (repeated ids
// summed, unused rows untouched), finite differences in fp64, and rejection of bad ids and sizes.
#include <limits>

#include "models/ops/embedding.h"
#include "op_test_support.h"

namespace {

namespace ops = models::ops;

std::vector<std::int32_t> random_ids(std::mt19937_64& rng, std::size_t n, std::int32_t vocab) {
  std::uniform_int_distribution<std::int32_t> pick(0, vocab - 1);
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = pick(rng);
  return ids;
}

TEST(Embedding, ForwardGathersRowsExactly) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 37, dim = 130;
  const auto ids = random_ids(rng, 53, vocab);
  const auto table = test::random_normal(rng, vocab * dim);
  std::vector<float> out(ids.size() * dim, std::numeric_limits<float>::quiet_NaN());
  ops::embedding_forward_cpu<float>(ids, table, vocab, dim, out);
  for (std::size_t n = 0; n < ids.size(); ++n) {
    for (std::int64_t d = 0; d < dim; ++d) ASSERT_EQ(out[n * dim + d], table[ids[n] * dim + d]) << n << "," << d;
  }
}

TEST(Embedding, BackwardAccumulatesRepeatedIdsAndLeavesUnusedRows) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 29, dim = 67;
  auto ids = random_ids(rng, 200, 11);  // many repeats, rows 11..28 unused
  ids.push_back(28);
  const auto dout = test::random_normal(rng, ids.size() * dim);
  const auto initial = test::random_normal(rng, vocab * dim);
  std::vector<double> expected(initial.begin(), initial.end());
  for (std::size_t n = 0; n < ids.size(); ++n) {
    for (std::int64_t d = 0; d < dim; ++d) expected[ids[n] * dim + d] += dout[n * dim + d];
  }
  auto dtable = initial;
  ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, dtable);
  EXPECT_TRUE(test::all_close(dtable, optest::narrow(expected), 1e-6, 1e-6));
  for (std::int64_t v = 11; v < 28; ++v) {
    for (std::int64_t d = 0; d < dim; ++d) ASSERT_EQ(dtable[v * dim + d], initial[v * dim + d]) << "unused row " << v;
  }
}

TEST(Embedding, GradientMatchesFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 13, dim = 7;
  const auto ids = random_ids(rng, 19, vocab);
  auto table = optest::random_doubles(rng, vocab * dim);
  const auto weights = optest::random_doubles(rng, ids.size() * dim);
  std::vector<double> out(ids.size() * dim);
  auto loss = [&] {
    ops::embedding_forward_cpu<double>(ids, table, vocab, dim, out);
    return optest::weighted_sum(out, weights);
  };
  std::vector<double> dtable(table.size(), 0.0);
  ops::embedding_backward_cpu<double>(ids, weights, vocab, dim, dtable);
  EXPECT_TRUE(optest::matches_finite_differences("dtable", table, dtable, loss, rng));
}

TEST(Embedding, RejectsOutOfRangeIdsAndWrongSizes) {
  const std::int64_t vocab = 10, dim = 4;
  std::vector<float> table(vocab * dim, 1.0f), out(3 * dim), dtable(vocab * dim);
  const std::vector<std::int32_t> too_big = {1, 10, 2}, negative = {-1, 0, 0}, fine = {0, 1, 2};
  EXPECT_OP_ERROR(ops::embedding_forward_cpu<float>(too_big, table, vocab, dim, out), "token id 10 at position 1");
  EXPECT_OP_ERROR(ops::embedding_forward_cpu<float>(negative, table, vocab, dim, out), "token id -1 at position 0");
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(too_big, out, vocab, dim, dtable), "token id 10");
  std::vector<float> short_out(3 * dim - 1);
  EXPECT_OP_ERROR(ops::embedding_forward_cpu<float>(fine, table, vocab, dim, short_out), "out has 11 elements");
  EXPECT_OP_ERROR(ops::embedding_forward_cpu<float>(fine, table, vocab + 1, dim, out), "table has 40 elements");
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(fine, std::span<const float>(table.data(), 3 * dim), vocab, dim,
                                                    std::span<float>(table)),
                  "dtable overlaps the input dout");
  const std::vector<std::int32_t> none;
  std::vector<float> empty;
  EXPECT_NO_THROW(ops::embedding_forward_cpu<float>(none, table, vocab, dim, empty));
}

}  // namespace
