// Embedding: forward is an exact gather, backward adds into the table gradient (repeated ids
// summed, unused rows untouched), finite differences in fp64, and rejection of bad ids and sizes.
#include <algorithm>
#include <limits>
#include <span>
#include <string>

#include "models/ops/embedding.h"
#include "support/op_test_support.h"

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

// Windows [0, 3), [3, 10), [10, V) of the backward, each into its own rows between two sentinel
// guard rows: together bit-identical to the full backward, guards and unused rows untouched.
TEST(Embedding, BackwardInRowWindowsMatchesTheFullBackward) {
  std::mt19937_64 rng(test::fresh_seed());
  const std::int64_t vocab = 23, dim = 5;
  auto ids = random_ids(rng, 150, 14);  // many repeats, rows 14..21 unused
  ids.push_back(22);
  const auto dout = test::random_normal(rng, ids.size() * dim);
  const auto initial = test::random_normal(rng, vocab * dim);
  auto full = initial;
  ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, full);

  constexpr float kSentinel = -12345.0f;
  const std::int64_t edges[] = {0, 3, 10, vocab};
  std::vector<float> assembled(initial.size(), kSentinel);
  for (int w = 0; w < 3; ++w) {
    const std::int64_t begin = edges[w], end = edges[w + 1], rows = end - begin;
    SCOPED_TRACE("rows [" + std::to_string(begin) + ", " + std::to_string(end) + ")");
    std::vector<float> guarded((rows + 2) * dim, kSentinel);
    std::copy(initial.begin() + begin * dim, initial.begin() + end * dim, guarded.begin() + dim);
    ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, begin, end,
                                       std::span<float>(guarded).subspan(dim, rows * dim));
    for (std::int64_t d = 0; d < dim; ++d) {
      ASSERT_EQ(guarded[d], kSentinel) << "guard row before, column " << d;
      ASSERT_EQ(guarded[(rows + 1) * dim + d], kSentinel) << "guard row after, column " << d;
    }
    std::copy(guarded.begin() + dim, guarded.begin() + (rows + 1) * dim, assembled.begin() + begin * dim);
  }
  for (std::size_t i = 0; i < full.size(); ++i) ASSERT_EQ(assembled[i], full[i]) << "element " << i;
  for (std::int64_t v = 14; v < 22; ++v) {
    for (std::int64_t d = 0; d < dim; ++d)
      ASSERT_EQ(assembled[v * dim + d], initial[v * dim + d]) << "unused row " << v;
  }
  // Against the naive sum as well, so a window that drops its tokens cannot pass.
  std::vector<double> expected(initial.begin(), initial.end());
  for (std::size_t n = 0; n < ids.size(); ++n) {
    for (std::int64_t d = 0; d < dim; ++d) expected[ids[n] * dim + d] += dout[n * dim + d];
  }
  EXPECT_TRUE(test::all_close(assembled, optest::narrow(expected), 1e-6, 1e-6));

  // An empty window is a no-op, also at the vocabulary's end.
  std::vector<float> none;
  EXPECT_NO_THROW(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, 7, 7, none));
  EXPECT_NO_THROW(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, vocab, vocab, none));
}

TEST(Embedding, RowWindowRejectsBadWindowsAndSizes) {
  const std::int64_t vocab = 10, dim = 4;
  const std::vector<std::int32_t> ids = {0, 5, 9}, too_big = {0, 10, 2};
  std::vector<float> dout(3 * dim, 1.0f), rows(3 * dim);
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, -1, 2, rows), "row window [-1, 2)");
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, 8, 11, rows), "row window [8, 11)");
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, 5, 4, rows), "row window [5, 4)");
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(ids, dout, vocab, dim, 2, 4, rows), "dtable_rows has 12 elements");
  // Ids outside the window must still be valid.
  EXPECT_OP_ERROR(ops::embedding_backward_cpu<float>(too_big, dout, vocab, dim, 0, 3, rows), "token id 10");
  EXPECT_OP_ERROR(
      ops::embedding_backward_cpu<float>(ids, std::span<const float>(rows), vocab, dim, 0, 3, std::span<float>(rows)),
      "dtable_rows overlaps the input dout");
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
