// Causal GQA attention: forward and lse against a naive softmax(QK^T / sqrt(d)) V over the
// whole masked score matrix, no leak from future positions, gradients against fp64 finite
// differences (GQA groups 1, 2 and 4; head dims 5, 64 and 128; T = 1), fp32 against fp64.
#include <limits>

#include "models/ops/attention.h"
#include "support/op_test_support.h"

namespace {

namespace ops = models::ops;
using ops::AttentionShape;

std::string describe(const AttentionShape& s) {
  return "B=" + std::to_string(s.batch) + " T=" + std::to_string(s.seq) + " Hq=" + std::to_string(s.q_heads) +
         " Hkv=" + std::to_string(s.kv_heads) + " hd=" + std::to_string(s.head_dim);
}

std::int64_t q_size(const AttentionShape& s) { return s.batch * s.seq * s.q_heads * s.head_dim; }
std::int64_t kv_size(const AttentionShape& s) { return s.batch * s.seq * s.kv_heads * s.head_dim; }
std::int64_t lse_size(const AttentionShape& s) { return s.batch * s.q_heads * s.seq; }

// softmax(scale * Q K^T + causal mask) V with the full [T, T] matrix per (batch, head), in double.
void naive_attention(const AttentionShape& s, const std::vector<float>& q, const std::vector<float>& k,
                     const std::vector<float>& v, std::vector<double>& out, std::vector<double>& lse) {
  const std::int64_t T = s.seq, D = s.head_dim, group = s.q_heads / s.kv_heads;
  out.assign(q_size(s), 0.0);
  lse.assign(lse_size(s), 0.0);
  std::vector<double> scores(T * T);
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t h = 0; h < s.q_heads; ++h) {
      const std::int64_t g = h / group;
      for (std::int64_t i = 0; i < T; ++i) {
        for (std::int64_t j = 0; j < T; ++j) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d) {
            dot += double(q[((b * T + i) * s.q_heads + h) * D + d]) * k[((b * T + j) * s.kv_heads + g) * D + d];
          }
          scores[i * T + j] = j <= i ? dot / std::sqrt(double(D)) : -std::numeric_limits<double>::infinity();
        }
      }
      for (std::int64_t i = 0; i < T; ++i) {
        double max_score = -std::numeric_limits<double>::infinity(), sum = 0.0;
        for (std::int64_t j = 0; j < T; ++j) max_score = std::max(max_score, scores[i * T + j]);
        for (std::int64_t j = 0; j < T; ++j) sum += std::exp(scores[i * T + j] - max_score);
        lse[(b * s.q_heads + h) * T + i] = max_score + std::log(sum);
        for (std::int64_t j = 0; j < T; ++j) {
          const double p = std::exp(scores[i * T + j] - max_score) / sum;
          for (std::int64_t d = 0; d < D; ++d) {
            out[((b * T + i) * s.q_heads + h) * D + d] += p * v[((b * T + j) * s.kv_heads + g) * D + d];
          }
        }
      }
    }
  }
}

TEST(Attention, MatchesNaiveSoftmaxAttention) {
  std::mt19937_64 rng(test::fresh_seed());
  const AttentionShape shapes[] = {
      {2, 13, 4, 4, 64}, {2, 13, 4, 2, 128}, {1, 19, 4, 1, 64}, {3, 1, 2, 1, 128}, {2, 9, 6, 3, 5}};
  for (const auto& s : shapes) {
    const auto q = test::random_normal(rng, q_size(s), 1.5f);
    const auto k = test::random_normal(rng, kv_size(s), 1.5f);
    const auto v = test::random_normal(rng, kv_size(s));
    std::vector<float> out(q.size()), lse(lse_size(s));
    ops::attention_forward_cpu<float>(s, q, k, v, out, lse);
    std::vector<double> expected_out, expected_lse;
    naive_attention(s, q, k, v, expected_out, expected_lse);
    EXPECT_TRUE(test::all_close(out, optest::narrow(expected_out), 1e-5, 1e-6)) << describe(s);
    EXPECT_TRUE(test::all_close(lse, optest::narrow(expected_lse), 1e-6, 1e-6)) << describe(s);
  }
}

TEST(Attention, FuturePositionsNeverLeak) {
  std::mt19937_64 rng(test::fresh_seed());
  const AttentionShape s{2, 17, 4, 2, 64};
  const auto q = test::random_normal(rng, q_size(s));
  auto k = test::random_normal(rng, kv_size(s));
  auto v = test::random_normal(rng, kv_size(s));
  std::vector<float> out(q.size()), lse(lse_size(s)), out2(q.size()), lse2(lse_size(s));
  ops::attention_forward_cpu<float>(s, q, k, v, out, lse);
  const std::int64_t changed = 11;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t i = 0; i < s.kv_heads * s.head_dim; ++i) {
      const std::size_t at = (b * s.seq + changed) * s.kv_heads * s.head_dim + i;
      k[at] += 10.0f;
      v[at] = -v[at] * 3.0f + 1.0f;
    }
  }
  ops::attention_forward_cpu<float>(s, q, k, v, out2, lse2);
  const std::int64_t row = s.q_heads * s.head_dim;
  for (std::int64_t b = 0; b < s.batch; ++b) {
    for (std::int64_t t = 0; t < s.seq; ++t) {
      const auto first = out.begin() + (b * s.seq + t) * row, first2 = out2.begin() + (b * s.seq + t) * row;
      const bool same = std::equal(first, first + row, first2);
      EXPECT_EQ(same, t < changed) << "batch " << b << " position " << t;
      for (std::int64_t h = 0; h < s.q_heads; ++h) {
        const std::size_t at = (b * s.q_heads + h) * s.seq + t;
        if (t < changed) {
          EXPECT_EQ(lse[at], lse2[at]) << "lse batch " << b << " head " << h << " position " << t;
        }
      }
    }
  }
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  std::mt19937_64 rng(test::fresh_seed());
  const AttentionShape shapes[] = {{2, 7, 2, 2, 5},   {1, 6, 4, 2, 5}, {1, 5, 4, 1, 64},
                                   {1, 4, 2, 1, 128}, {2, 1, 2, 2, 5}, {1, 11, 1, 1, 3}};
  for (const auto& s : shapes) {
    SCOPED_TRACE(describe(s));
    auto q = optest::random_doubles(rng, q_size(s));
    auto k = optest::random_doubles(rng, kv_size(s));
    auto v = optest::random_doubles(rng, kv_size(s));
    const auto weights = optest::random_doubles(rng, q_size(s));
    std::vector<double> out(q.size()), lse(lse_size(s));
    auto loss = [&] {
      ops::attention_forward_cpu<double>(s, q, k, v, out, lse);
      return optest::weighted_sum(out, weights);
    };
    loss();
    std::vector<double> dq(q.size()), dk(k.size()), dv(v.size());
    ops::attention_backward_cpu<double>(s, q, k, v, out, lse, weights, dq, dk, dv);
    EXPECT_TRUE(optest::matches_finite_differences("dq", q, dq, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dk", k, dk, loss, rng));
    EXPECT_TRUE(optest::matches_finite_differences("dv", v, dv, loss, rng));
  }
}

TEST(Attention, FloatMatchesDouble) {
  std::mt19937_64 rng(test::fresh_seed());
  for (const AttentionShape& s : {AttentionShape{2, 37, 4, 2, 64}, AttentionShape{1, 23, 8, 2, 128}}) {
    const auto q = test::random_normal(rng, q_size(s)), k = test::random_normal(rng, kv_size(s));
    const auto v = test::random_normal(rng, kv_size(s)), dout = test::random_normal(rng, q_size(s));
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::vector<float> out(q.size()), lse(lse_size(s)), dq(q.size(), nan), dk(k.size(), nan), dv(v.size(), nan);
    ops::attention_forward_cpu<float>(s, q, k, v, out, lse);
    ops::attention_backward_cpu<float>(s, q, k, v, out, lse, dout, dq, dk, dv);
    const auto qd = optest::widen(q), kd = optest::widen(k), vd = optest::widen(v), doutd = optest::widen(dout);
    std::vector<double> outd(q.size()), lsed(lse.size()), dqd(q.size()), dkd(k.size()), dvd(v.size());
    ops::attention_forward_cpu<double>(s, qd, kd, vd, outd, lsed);
    ops::attention_backward_cpu<double>(s, qd, kd, vd, outd, lsed, doutd, dqd, dkd, dvd);
    EXPECT_TRUE(test::all_close(out, optest::narrow(outd), 1e-5, 1e-6)) << describe(s);
    EXPECT_TRUE(test::all_close(dq, optest::narrow(dqd), 1e-4, 1e-5)) << describe(s);
    EXPECT_TRUE(test::all_close(dk, optest::narrow(dkd), 1e-4, 1e-5)) << describe(s);
    EXPECT_TRUE(test::all_close(dv, optest::narrow(dvd), 1e-4, 1e-5)) << describe(s);
  }
}

TEST(Attention, RejectsBadShapes) {
  const AttentionShape s{1, 4, 4, 2, 8};
  std::vector<float> q(q_size(s)), k(kv_size(s)), v(kv_size(s)), out(q_size(s)), lse(lse_size(s));
  EXPECT_OP_ERROR(ops::attention_forward_cpu<float>({1, 4, 4, 3, 8}, q, k, v, out, lse),
                  "q_heads (4) must be a multiple of kv_heads (3)");
  EXPECT_OP_ERROR(ops::attention_forward_cpu<float>(s, q, q, v, out, lse), "k has 128 elements, expected 64");
  EXPECT_OP_ERROR(ops::attention_forward_cpu<float>(s, q, k, v, out, std::span<float>(lse.data(), 15)),
                  "lse has 15 elements, expected 16");
  EXPECT_OP_ERROR(ops::attention_backward_cpu<float>(s, q, k, v, out, lse, out, std::span<float>(out), k, v),
                  "dq overlaps");
  std::vector<float> none;
  EXPECT_NO_THROW(ops::attention_forward_cpu<float>({0, 4, 4, 2, 8}, none, none, none, none, none));
}

}  // namespace
