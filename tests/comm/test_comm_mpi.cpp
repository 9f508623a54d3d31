// Multi-rank checks of comm::Communicator, run under mpirun with any number of ranks (or alone):
// every collective on fresh random data, seeded per rank, against a host reference built from
// every rank's regenerated data; odd counts; the chunked MPI paths (a small chunk limit); host
// collectives; argument errors. `--hang MODE` instead checks that the watchdog aborts a job in
// which rank 1 never joins a collective. `--device cuda` runs the same checks through NCCL (one
// GPU per rank, device_for) and prints SKIPPED without enough GPUs.
//
// usage: test_comm_mpi [--device cpu|cuda] [--hang barrier|all_reduce|first_all_reduce]
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <mpi.h>

#include "comm/communicator.h"
#include "comm/host_communicator.h"
#include "comm/mpi_comm.h"
#include "comm/mpi_communicator.h"
#include "comm/watchdog.h"
#include "core/buffer.h"
#include "core/device.h"
#include "core/error.h"
#include "core/half.h"
#include "core/rng.h"

namespace {

using comm::ReduceOp;

int g_rank = 0;
int g_failures = 0;
int g_checks = 0;

void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "rank %d: FAILED: %s\n", g_rank, what.c_str());
  }
}

template <typename F>
void expect_error(const std::string& name, const std::string& needle, F&& f) {
  try {
    f();
    check(false, name + ": no exception");
  } catch (const core::Error& e) {
    check(std::string(e.what()).find(needle) != std::string::npos,
          name + ": message '" + e.what() + "' lacks '" + needle + "'");
  }
}

const char* op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
  }
  return "?";
}

// ---- element types -----------------------------------------------------------------------------

struct Bf16 {
  std::uint16_t bits;
  bool operator==(const Bf16&) const = default;
};
struct F16 {
  std::uint16_t bits;
  bool operator==(const F16&) const = default;
};

std::uint64_t bits64(std::uint64_t seed, std::size_t i) { return core::splitmix64(seed ^ core::splitmix64(i)); }
// Small integers in [-8, 8]: sums over a few ranks stay exact in 16-bit floats.
float small_integer(std::uint64_t seed, std::size_t i) {
  return static_cast<float>(static_cast<int>(bits64(seed, i) % 17) - 8);
}

template <typename T>
struct Traits;
template <>
struct Traits<float> {
  static constexpr core::DType dtype = core::DType::f32;
  static constexpr bool floating = true;
  static constexpr double eps = 0x1p-24;
  static float make(std::uint64_t seed, std::size_t i) { return 8.0f * core::uniform01(seed, i) - 4.0f; }
  static double value(float x) { return x; }
};
template <>
struct Traits<double> {
  static constexpr core::DType dtype = core::DType::f64;
  static constexpr bool floating = true;
  static constexpr double eps = 0x1p-53;
  static double make(std::uint64_t seed, std::size_t i) {
    return 8.0 * static_cast<double>(bits64(seed, i) >> 11) * 0x1p-53 - 4.0;
  }
  static double value(double x) { return x; }
};
template <>
struct Traits<Bf16> {
  static constexpr core::DType dtype = core::DType::bf16;
  static constexpr bool floating = true;
  static constexpr double eps = 0x1p-8;
  static Bf16 make(std::uint64_t seed, std::size_t i) { return {core::float_to_bf16(small_integer(seed, i))}; }
  static double value(Bf16 x) { return core::bf16_to_float(x.bits); }
};
template <>
struct Traits<F16> {
  static constexpr core::DType dtype = core::DType::f16;
  static constexpr bool floating = true;
  static constexpr double eps = 0x1p-11;
  static F16 make(std::uint64_t seed, std::size_t i) { return {core::float_to_fp16(small_integer(seed, i))}; }
  static double value(F16 x) { return core::fp16_to_float(x.bits); }
};
template <>
struct Traits<std::uint64_t> {
  static constexpr core::DType dtype = core::DType::u64;
  static constexpr bool floating = false;
  static std::uint64_t make(std::uint64_t seed, std::size_t i) { return bits64(seed, i); }  // sums wrap: exact anyway
};
template <>
struct Traits<std::int32_t> {
  static constexpr core::DType dtype = core::DType::i32;
  static constexpr bool floating = false;
  static std::int32_t make(std::uint64_t seed, std::size_t i) {
    return static_cast<std::int32_t>(bits64(seed, i) >> 40) - (1 << 23);
  }
};
template <>
struct Traits<std::int64_t> {
  static constexpr core::DType dtype = core::DType::i64;
  static constexpr bool floating = false;
  static std::int64_t make(std::uint64_t seed, std::size_t i) {
    return static_cast<std::int64_t>(bits64(seed, i) >> 8) - (std::int64_t{1} << 55);
  }
};
template <>
struct Traits<std::uint8_t> {
  static constexpr core::DType dtype = core::DType::u8;
  static constexpr bool floating = false;
  static std::uint8_t make(std::uint64_t seed, std::size_t i) { return static_cast<std::uint8_t>(bits64(seed, i)); }
};

template <typename T>
std::vector<T> make_data(std::uint64_t seed, std::size_t n) {
  std::vector<T> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = Traits<T>::make(seed, i);
  return out;
}

template <typename T>
std::string show(T x) {
  if constexpr (Traits<T>::floating) {
    char text[64];
    std::snprintf(text, sizeof text, "%.17g", Traits<T>::value(x));
    return text;
  } else if constexpr (std::is_signed_v<T>) {
    return std::to_string(static_cast<long long>(x));
  } else {
    return std::to_string(static_cast<unsigned long long>(x));
  }
}

// Compares got[got_offset + i] with the reduction over ranks of inputs[r][in_offset + i], i < n.
// Floating point: within the rounding error of any summation order; integers: exactly.
template <typename T>
void check_reduction(const std::string& name, const std::vector<T>& got, std::size_t got_offset,
                     const std::vector<std::vector<T>>& inputs, std::size_t in_offset, std::size_t n, ReduceOp op) {
  const int world = static_cast<int>(inputs.size());
  for (std::size_t i = 0; i < n; ++i) {
    const T actual = got[got_offset + i];
    bool ok = true;
    std::string expected_text;
    if constexpr (Traits<T>::floating) {
      double sum = 0;
      double sum_abs = 0;
      double max = -INFINITY;
      for (const auto& input : inputs) {
        const double v = Traits<T>::value(input[in_offset + i]);
        sum += v;
        sum_abs += std::fabs(v);
        max = std::max(max, v);
      }
      double expected = sum;
      double tolerance = 2.0 * (world + 1) * Traits<T>::eps * sum_abs;
      if (op == ReduceOp::avg) {
        expected = sum / world;
        tolerance = tolerance / world + 2.0 * Traits<T>::eps * std::fabs(expected);
      } else if (op == ReduceOp::max) {
        expected = max;
        tolerance = 0;
      }
      ok = std::fabs(Traits<T>::value(actual) - expected) <= tolerance;
      if (!ok) expected_text = std::to_string(expected) + " +- " + std::to_string(tolerance);
    } else {
      using U = std::make_unsigned_t<T>;
      U sum = 0;
      T max = inputs[0][in_offset + i];
      for (const auto& input : inputs) {
        sum = static_cast<U>(sum + static_cast<U>(input[in_offset + i]));
        max = std::max(max, input[in_offset + i]);
      }
      const T expected = op == ReduceOp::max ? max : static_cast<T>(sum);
      ok = actual == expected;
      if (!ok) expected_text = show(expected);
    }
    if (!ok) {
      check(false, name + ": element " + std::to_string(i) + " is " + show(actual) + ", expected " + expected_text);
      return;
    }
  }
  check(true, name);
}

// ---- the test suite ------------------------------------------------------------------------------

// A buffer on the communicator's device, filled from and read back into host vectors on the
// compute stream (so the collectives' ordering against that stream is exercised too).
class DeviceData {
 public:
  DeviceData(const core::DeviceContext& context, std::size_t bytes)
      : context_(context), buffer_(context.device(), bytes) {}
  void* data() { return buffer_.data(); }
  template <typename T>
  void upload(const std::vector<T>& host) {
    core::copy_bytes(buffer_.data(), host.data(), host.size() * sizeof(T), context_.stream());
  }
  template <typename T>
  std::vector<T> download() {
    std::vector<T> host(buffer_.bytes() / sizeof(T));
    core::copy_bytes(host.data(), buffer_.data(), buffer_.bytes(), context_.stream());
    context_.synchronize();
    return host;
  }

 private:
  const core::DeviceContext& context_;
  core::Buffer buffer_;
};

class Suite {
 public:
  Suite(comm::Communicator& communicator, const core::DeviceContext& context, std::uint64_t seed, std::string label)
      : comm_(communicator), context_(context), seed_(seed), label_(std::move(label)) {}

  // Fresh seeds for rank r of the next case (the same sequence on every rank).
  std::uint64_t next_case() { return ++case_; }
  std::uint64_t seed(std::uint64_t case_id, int rank) const {
    return core::splitmix64(seed_ ^ core::splitmix64(case_id * 4099 + static_cast<std::uint64_t>(rank)));
  }
  std::string name(const std::string& what) const { return label_ + " " + what; }

  template <typename T>
  std::vector<std::vector<T>> all_inputs(std::uint64_t case_id, std::size_t n) const {
    std::vector<std::vector<T>> inputs;
    for (int r = 0; r < comm_.world(); ++r) inputs.push_back(make_data<T>(seed(case_id, r), n));
    return inputs;
  }

  template <typename T>
  void all_reduce(std::size_t count, ReduceOp op) {
    const auto case_id = next_case();
    const auto inputs = all_inputs<T>(case_id, count);
    DeviceData data(context_, count * sizeof(T));
    data.upload(inputs[comm_.rank()]);
    comm_.all_reduce(data.data(), Traits<T>::dtype, count, op, "test all_reduce");
    const std::string what = "all_reduce " + std::string(core::dtype_name(Traits<T>::dtype)) + " " + op_name(op) +
                             " count " + std::to_string(count);
    check_reduction(name(what), data.download<T>(), 0, inputs, 0, count, op);
  }

  template <typename T>
  void reduce_scatter(std::size_t count_per_rank, ReduceOp op) {
    const auto case_id = next_case();
    const std::size_t world = static_cast<std::size_t>(comm_.world());
    const auto inputs = all_inputs<T>(case_id, world * count_per_rank);
    DeviceData data(context_, world * count_per_rank * sizeof(T));
    data.upload(inputs[comm_.rank()]);
    comm_.reduce_scatter(data.data(), Traits<T>::dtype, count_per_rank, op, "test reduce_scatter");
    const std::size_t mine = static_cast<std::size_t>(comm_.rank()) * count_per_rank;
    const std::string what = "reduce_scatter " + std::string(core::dtype_name(Traits<T>::dtype)) + " " + op_name(op) +
                             " count per rank " + std::to_string(count_per_rank);
    check_reduction(name(what), data.download<T>(), mine, inputs, mine, count_per_rank, op);
  }

  template <typename T>
  void reduce(std::size_t count, ReduceOp op, int root) {
    const auto case_id = next_case();
    const auto inputs = all_inputs<T>(case_id, count);
    DeviceData data(context_, count * sizeof(T));
    data.upload(inputs[comm_.rank()]);
    comm_.reduce(data.data(), Traits<T>::dtype, count, op, root, "test reduce");
    const auto got = data.download<T>();
    if (comm_.rank() == root) {
      const std::string what = "reduce " + std::string(core::dtype_name(Traits<T>::dtype)) + " " + op_name(op) +
                               " to root " + std::to_string(root) + " count " + std::to_string(count);
      check_reduction(name(what), got, 0, inputs, 0, count, op);
    }
  }

  template <typename T>
  void all_gather(std::size_t count_per_rank) {
    const auto case_id = next_case();
    const std::size_t world = static_cast<std::size_t>(comm_.world());
    // Own part from this rank's seed, the other parts garbage.
    std::vector<T> mine = make_data<T>(seed(case_id, comm_.rank()) ^ 0xabcdefull, world * count_per_rank);
    const std::vector<T> own = make_data<T>(seed(case_id, comm_.rank()), count_per_rank);
    std::copy(own.begin(), own.end(), mine.begin() + static_cast<std::ptrdiff_t>(comm_.rank() * count_per_rank));
    DeviceData data(context_, mine.size() * sizeof(T));
    data.upload(mine);
    comm_.all_gather(data.data(), Traits<T>::dtype, count_per_rank, "test all_gather");
    const auto got = data.download<T>();
    const std::string what = "all_gather " + std::string(core::dtype_name(Traits<T>::dtype)) + " count per rank " +
                             std::to_string(count_per_rank);
    for (int r = 0; r < comm_.world(); ++r) {
      const auto expected = make_data<T>(seed(case_id, r), count_per_rank);
      const bool same = std::memcmp(got.data() + r * count_per_rank, expected.data(), count_per_rank * sizeof(T)) == 0;
      check(same, name(what) + ": part of rank " + std::to_string(r) + " differs");
    }
  }

  // Pieces of unequal size broadcast from every rank into one buffer, in one group (ZeRO-3's
  // gather): every rank ends with every piece, bit for bit.
  template <typename T>
  void broadcast_pieces(std::size_t count) {
    const auto case_id = next_case();
    const std::size_t world = static_cast<std::size_t>(comm_.world());
    std::vector<T> all(count);
    std::vector<std::size_t> start(world + 1);
    for (std::size_t r = 0; r <= world; ++r) start[r] = count * r * r / (world * world);  // unequal pieces
    for (std::size_t r = 0; r < world; ++r) {
      const auto part = make_data<T>(seed(case_id, static_cast<int>(r)), start[r + 1] - start[r]);
      std::copy(part.begin(), part.end(), all.begin() + static_cast<std::ptrdiff_t>(start[r]));
    }
    std::vector<T> mine = make_data<T>(seed(case_id, comm_.rank()) ^ 0x5555ull, count);  // garbage elsewhere
    const auto own = static_cast<std::size_t>(comm_.rank());
    std::copy(all.begin() + static_cast<std::ptrdiff_t>(start[own]),
              all.begin() + static_cast<std::ptrdiff_t>(start[own + 1]),
              mine.begin() + static_cast<std::ptrdiff_t>(start[own]));
    DeviceData data(context_, count * sizeof(T));
    data.upload(mine);
    comm_.group_start();
    for (std::size_t r = 0; r < world; ++r) {
      comm_.broadcast(static_cast<T*>(data.data()) + start[r], Traits<T>::dtype, start[r + 1] - start[r],
                      static_cast<int>(r), "test broadcast piece");
    }
    comm_.group_end();
    const auto got = data.download<T>();
    check(std::memcmp(got.data(), all.data(), count * sizeof(T)) == 0,
          name("broadcast of unequal pieces, count " + std::to_string(count)));
  }

  // Two all-reduces in one group (an NCCL group on cuda, a no-op bracket on cpu).
  void grouped(std::size_t count) {
    const auto case_a = next_case();
    const auto case_b = next_case();
    const auto a = all_inputs<float>(case_a, count);
    const auto b = all_inputs<double>(case_b, count + 3);
    DeviceData da(context_, count * sizeof(float));
    DeviceData db(context_, (count + 3) * sizeof(double));
    da.upload(a[comm_.rank()]);
    db.upload(b[comm_.rank()]);
    comm_.group_start();
    comm_.all_reduce(da.data(), core::DType::f32, count, ReduceOp::sum, "group part a");
    comm_.all_reduce(db.data(), core::DType::f64, count + 3, ReduceOp::max, "group part b");
    comm_.group_end();
    check_reduction(name("grouped all_reduce a"), da.download<float>(), 0, a, 0, count, ReduceOp::sum);
    check_reduction(name("grouped all_reduce b"), db.download<double>(), 0, b, 0, count + 3, ReduceOp::max);
  }

  // The ZeRO-2 pattern: pieces of one send buffer reduced out of place onto different roots in one
  // detached group, compute waiting only at the marker, after which the send buffer is
  // overwritten (the reductions must have read it by then). recv holds a sentinel everywhere
  // except the piece this rank is root of; send is never written by the collective.
  void detached_pieces(std::size_t count) {
    const auto case_id = next_case();
    const int world = comm_.world();
    const auto inputs = all_inputs<float>(case_id, count);
    DeviceData send(context_, count * sizeof(float));
    DeviceData recv(context_, count * sizeof(float));
    send.upload(inputs[comm_.rank()]);
    const std::vector<float> sentinel(count, -7.25f);
    recv.upload(sentinel);
    auto piece = [&](int r) {
      return std::pair<std::size_t, std::size_t>{
          count * static_cast<std::size_t>(r) / static_cast<std::size_t>(world),
          count * static_cast<std::size_t>(r + 1) / static_cast<std::size_t>(world)};
    };
    auto* send_f = static_cast<float*>(send.data());
    auto* recv_f = static_cast<float*>(recv.data());
    comm_.set_detached(true);
    comm_.group_start();
    for (int r = world - 1; r >= 0; --r) {  // roots in reverse order: any order must work
      const auto [begin, end] = piece(r);
      comm_.reduce_into(send_f + begin, comm_.rank() == r ? recv_f + begin : nullptr, core::DType::f32, end - begin,
                        ReduceOp::avg, r, "test detached piece");
    }
    comm_.group_end();
    const std::uint64_t marker = comm_.marker();
    comm_.set_detached(false);
    comm_.wait_for(marker);
    send.upload(std::vector<float>(count, 1e30f));  // after the wait: must not change any result
    const auto got = recv.download<float>();
    const auto [mine_begin, mine_end] = piece(comm_.rank());
    check_reduction(name("detached out-of-place reduce, count " + std::to_string(count)), got, mine_begin, inputs,
                    mine_begin, mine_end - mine_begin, ReduceOp::avg);
    bool untouched = true;
    for (std::size_t i = 0; i < count; ++i) {
      if ((i < mine_begin || i >= mine_end) && got[i] != -7.25f) untouched = false;
    }
    check(untouched, name("detached out-of-place reduce leaves recv outside the own piece untouched"));
  }

  void device_collectives(const std::vector<std::size_t>& counts) {
    const int world = comm_.world();
    const int last = world - 1;
    for (std::size_t count : counts) {
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        all_reduce<float>(count, op);
        all_reduce<double>(count, op);
      }
      all_reduce<std::uint64_t>(count, ReduceOp::sum);
      all_reduce<std::uint64_t>(count, ReduceOp::max);
      all_reduce<std::int32_t>(count, ReduceOp::sum);
      all_reduce<std::int64_t>(count, ReduceOp::max);
      reduce_scatter<float>(count, ReduceOp::avg);
      reduce_scatter<double>(count, ReduceOp::avg);
      reduce_scatter<std::uint64_t>(count, ReduceOp::sum);
      reduce_scatter<float>(count, ReduceOp::max);
      all_gather<float>(count);
      all_gather<std::uint8_t>(count);  // odd byte counts
      all_gather<std::uint64_t>(count);
      reduce<double>(count, ReduceOp::sum, last);
      reduce<float>(count, ReduceOp::avg, last);
      reduce<std::uint64_t>(count, ReduceOp::max, world > 1 ? 1 : 0);
      if (context_.is_cuda()) {
        all_reduce<Bf16>(count, ReduceOp::sum);
        all_reduce<F16>(count, ReduceOp::max);
        all_reduce<Bf16>(count, ReduceOp::avg);
        reduce_scatter<Bf16>(count, ReduceOp::sum);
        all_gather<F16>(count);
      }
      grouped(count);
      detached_pieces(count);
      broadcast_pieces<float>(count);
      if (context_.is_cuda()) broadcast_pieces<Bf16>(count);
    }
  }

  void host_collectives() {
    const int world = comm_.world();
    const int rank = comm_.rank();
    const int last = world - 1;
    comm_.barrier(label_.c_str());
    check(comm_.all_reduce_host(rank + 1.0, ReduceOp::sum, "host sum") == world * (world + 1) / 2.0,
          name("all_reduce_host sum"));
    check(comm_.all_reduce_host(rank + 1.0, ReduceOp::avg, "host avg") == (world + 1) / 2.0,
          name("all_reduce_host avg"));
    check(comm_.all_reduce_host(rank + 1.0, ReduceOp::max, "host max") == world, name("all_reduce_host max"));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      const auto case_id = next_case();
      const auto inputs = all_inputs<double>(case_id, 1001);
      const auto got = comm_.all_reduce_host(inputs[rank], op, "host vector");
      check(got.size() == 1001, name("all_reduce_host vector size"));
      if (got.size() == 1001)
        check_reduction(name(std::string("all_reduce_host vector ") + op_name(op)), got, 0, inputs, 0, 1001, op);
    }
    check(comm_.all_reduce_host(std::vector<double>{}, ReduceOp::sum, "host empty").empty(),
          name("all_reduce_host empty"));

    // Strings of different lengths, empty on rank 0.
    const auto case_id = next_case();
    auto string_of = [&](int r) {
      const auto bytes = make_data<std::uint8_t>(seed(case_id, r), static_cast<std::size_t>(r) * 37 % 101 + (r > 0));
      return std::string(bytes.begin(), bytes.end());
    };
    const auto gathered = comm_.gather_strings(string_of(rank), last, "strings");
    if (rank == last) {
      bool ok = gathered.size() == static_cast<std::size_t>(world);
      for (int r = 0; ok && r < world; ++r) ok = gathered[r] == string_of(r);
      check(ok, name("gather_strings to the last rank"));
    } else {
      check(gathered.empty(), name("gather_strings: empty off the root"));
    }
    const auto long_bytes = make_data<std::uint8_t>(seed(case_id, 1000), 100003);
    const std::string long_text(long_bytes.begin(), long_bytes.end());
    const std::string sent = comm_.broadcast_string(rank == last ? long_text : std::string("other"), last, "long text");
    check(sent == long_text, name("broadcast_string from the last rank"));
    const std::string empty = comm_.broadcast_string(rank == 0 ? std::string() : std::string("not empty"), 0, "empty");
    check(empty.empty(), name("broadcast_string of an empty string"));
  }

  void argument_errors() {
    const int world = comm_.world();
    std::vector<std::uint64_t> u(4, 1);
    std::vector<float> f(4, 1.0f);
    DeviceData du(context_, u.size() * sizeof(std::uint64_t));
    DeviceData df(context_, f.size() * sizeof(float));
    expect_error(name("avg of u64"), "avg needs a floating-point type",
                 [&] { comm_.all_reduce(du.data(), core::DType::u64, 4, ReduceOp::avg, "bad avg"); });
    expect_error(name("reduce to a root outside the job"), "is not a rank",
                 [&] { comm_.reduce(df.data(), core::DType::f32, 4, ReduceOp::sum, world, "bad root"); });
    expect_error(name("gather_strings to root -1"), "is not a rank",
                 [&] { (void)comm_.gather_strings("x", -1, "bad root"); });
    if (!context_.is_cuda()) {
      expect_error(name("bf16 on the cpu backend"), "cannot reduce",
                   [&] { comm_.all_reduce(df.data(), core::DType::bf16, 4, ReduceOp::sum, "bf16"); });
    }
  }

 private:
  comm::Communicator& comm_;
  const core::DeviceContext& context_;
  std::uint64_t seed_;
  std::string label_;
  std::uint64_t case_ = 0;
};

// ---- checks that need no other rank ------------------------------------------------------------

void local_checks(const comm::Environment& environment) {
  // for_each_chunk: pieces in order, covering everything, none larger than the limit.
  std::vector<std::pair<std::size_t, std::size_t>> pieces;
  comm::detail::for_each_chunk(10, 3, [&](std::size_t o, std::size_t n) { pieces.emplace_back(o, n); });
  check(pieces == std::vector<std::pair<std::size_t, std::size_t>>{{0, 3}, {3, 3}, {6, 3}, {9, 1}},
        "for_each_chunk 10 by 3");
  pieces.clear();
  comm::detail::for_each_chunk(0, 3, [&](std::size_t o, std::size_t n) { pieces.emplace_back(o, n); });
  check(pieces.empty(), "for_each_chunk of nothing");
  comm::detail::for_each_chunk(2, 0, [&](std::size_t o, std::size_t n) { pieces.emplace_back(o, n); });
  check(pieces.size() == 2 && pieces[1] == std::make_pair<std::size_t, std::size_t>(1, 1),
        "for_each_chunk limit 0 acts as 1");
  const std::size_t big = std::size_t{5} * INT_MAX + 17;
  std::size_t covered = 0;
  std::size_t largest = 0;
  comm::detail::for_each_chunk(big, big, [&](std::size_t o, std::size_t n) {
    check(o == covered, "for_each_chunk beyond INT_MAX: contiguous");
    covered += n;
    largest = std::max(largest, n);
  });
  check(covered == big && largest == static_cast<std::size_t>(INT_MAX),
        "for_each_chunk beyond INT_MAX: pieces of INT_MAX");

  // Placement.
  const comm::Placement& p = environment.placement();
  check(p.rank >= 0 && p.rank < p.world, "placement rank within world");
  check(p.local_rank >= 0 && p.local_rank < p.local_world && p.local_world <= p.world, "placement local rank");
  check(comm::device_for(comm::Placement{5, 8, 3, 4}, 2) == 1, "device_for: local rank modulo devices");
  expect_error("device_for without devices", "none is visible", [] { (void)comm::device_for(comm::Placement{}, 0); });
  {
    comm::Environment second(nullptr, nullptr);  // shares the first one's MPI
    check(second.placement().rank == p.rank && second.placement().world == p.world, "a second Environment");
  }
  int finalized = 1;
  MPI_Finalized(&finalized);
  check(!finalized, "MPI stays initialised while the first Environment lives");

  // Watchdog bookkeeping (host entries; no CUDA).
  comm::Watchdog watchdog(p.rank, comm::CommOptions{5, 50}, -1);
  check(watchdog.timeout_s() == 50, "watchdog: first-step timeout first");
  {
    auto a = watchdog.watch_host("barrier", "a");
    auto b = watchdog.watch_host("barrier", "b");
    check(watchdog.pending() == 2, "watchdog: two host entries");
  }
  check(watchdog.pending() == 0, "watchdog: entries leave with their scope");
  watchdog.mark_first_step_done();
  check(watchdog.timeout_s() == 5, "watchdog: normal timeout after the first step");
}

std::uint64_t shared_seed(comm::Communicator& communicator) {
  std::string text;
  if (communicator.rank() == 0) {
    const char* fixed = std::getenv("LLMTRAIN_TEST_SEED");
    text = fixed ? fixed : std::to_string(std::random_device{}() * 0x100000001ull ^ std::random_device{}());
  }
  text = communicator.broadcast_string(text, 0, "seed");
  return std::stoull(text);
}

int hang_test(comm::Environment& environment, const core::DeviceContext& context, const std::string& mode) {
  comm::CommOptions options;
  options.timeout_s = 2;
  options.first_step_timeout_s = 30;  // the test's 20 s limit fails if mark_first_step_done() is ignored
  auto communicator = comm::make_communicator(environment, context, options);
  if (communicator->world() < 2) {
    std::fprintf(stderr, "FAILED: --hang needs at least 2 ranks\n");
    return 1;
  }
  // Warm-up: connections exist afterwards, so on cuda the hung all-reduce is enqueued at once and
  // only its event (the device side) never completes.
  DeviceData data(context, 1000 * sizeof(float));
  data.upload(std::vector<float>(1000, 1.0f));
  // first_all_reduce skips it: NCCL then blocks on the host, connecting to the missing peer.
  communicator->barrier("warm-up");
  if (mode != "first_all_reduce") {
    communicator->all_reduce(data.data(), core::DType::f32, 1000, ReduceOp::sum, "warm-up");
    communicator->synchronize();
  }
  communicator->mark_first_step_done();
  if (communicator->rank() == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(60));  // never joins in time
  } else if (mode == "barrier") {
    communicator->barrier("hang test");
  } else {
    communicator->all_reduce(data.data(), core::DType::f32, 1000, ReduceOp::sum, "hang test");
    communicator->synchronize();
  }
  std::fprintf(stderr, "rank %d: FAILED: the watchdog did not abort the job\n", communicator->rank());
  return 1;
}

int run(int argc, char** argv, comm::Environment& environment) {
  std::string device = "cpu";
  std::string hang;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--device" && i + 1 < argc) {
      device = argv[++i];
    } else if (arg == "--hang" && i + 1 < argc) {
      hang = argv[++i];
    } else {
      std::fprintf(stderr, "usage: test_comm_mpi [--device cpu|cuda] [--hang barrier|all_reduce|first_all_reduce]\n");
      return 2;
    }
  }
  if ((device != "cpu" && device != "cuda") ||
      (!hang.empty() && hang != "barrier" && hang != "all_reduce" && hang != "first_all_reduce")) {
    std::fprintf(stderr, "test_comm_mpi: bad --device or --hang\n");
    return 2;
  }
  const comm::Placement& placement = environment.placement();
  g_rank = placement.rank;

  core::Device where = core::Device::cpu();
  if (device == "cuda") {
    const int gpus = core::cuda_device_count();  // cpu runs never touch CUDA
    if (gpus < placement.local_world) {
      std::printf("SKIPPED: %d GPU(s) for %d rank(s) on this node\n", gpus, placement.local_world);
      return 0;
    }
    where = core::Device::cuda(comm::device_for(placement, gpus));
  }
  core::DeviceContext context(where);
  if (!hang.empty()) return hang_test(environment, context, hang);

  local_checks(environment);
  auto communicator = comm::make_communicator(environment, context, comm::CommOptions{});
  const std::uint64_t seed = shared_seed(*communicator);
  if (placement.rank == 0) {
    std::printf("%d rank(s) on %s, seed %" PRIu64 " (replay with LLMTRAIN_TEST_SEED=%" PRIu64 ")\n", placement.world,
                where.str().c_str(), seed, seed);
  }

  {
    Suite suite(*communicator, context, seed, device);
    suite.host_collectives();
    suite.argument_errors();
    suite.device_collectives({1, 7, 1000003});
    communicator->mark_first_step_done();
    suite.device_collectives({5});
  }
  {
    // Collectives that each finish in time never trip the watchdog, however long the run goes on:
    // a 2 s timeout and 2.5 s of collectives (the first round under the first-step allowance).
    auto brief = comm::make_communicator(environment, context, comm::CommOptions{2, 30});
    DeviceData data(context, 1001 * sizeof(float));
    data.upload(std::vector<float>(1001, 1.0f));
    for (int i = 0; i < 10; ++i) {
      brief->barrier("brief barrier");
      brief->all_reduce(data.data(), core::DType::f32, 1001, ReduceOp::max, "brief all_reduce");
      if (i == 0) brief->mark_first_step_done();
      std::this_thread::sleep_for(std::chrono::milliseconds(250));
    }
    brief->synchronize();
    check(data.download<float>() == std::vector<float>(1001, 1.0f), "collectives under a short timeout");
  }
  if (device == "cpu") {
    // The chunked paths: 40004 bytes per MPI call (10001 f32, 5000 f64; reduce_scatter and
    // all_gather divide by the world), then 12 bytes (one element per call, packing every element).
    for (std::size_t limit : {std::size_t{40004}, std::size_t{12}}) {
      comm::MpiCommunicator chunked(placement, comm::CommOptions{}, limit);
      Suite suite(chunked, context, seed ^ limit, "cpu chunk " + std::to_string(limit));
      suite.host_collectives();
      suite.device_collectives(limit > 100 ? std::vector<std::size_t>{1, 7, 1000003}
                                           : std::vector<std::size_t>{1, 7, 101});
    }
  } else {
    communicator->synchronize();
    auto* host = dynamic_cast<comm::detail::HostCommunicator*>(communicator.get());
    if (host) {
      for (int i = 0; i < 100 && host->watchdog().pending() > 0; ++i)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      check(host->watchdog().pending() == 0, "cuda: every watched collective finished");
      check(host->watchdog().events_created() <= 8,
            "cuda: pooled events reused (" + std::to_string(host->watchdog().events_created()) + " created)");
    }
  }

  const double failures = communicator->all_reduce_host(g_failures, ReduceOp::sum, "failures");
  std::printf("rank %d: %d checks, %d failed\n", placement.rank, g_checks, g_failures);
  std::fflush(stdout);
  communicator->barrier("end");
  if (placement.rank == 0) {
    if (failures == 0) {
      std::printf("PASSED\n");
    } else {
      std::printf("FAILED: %g failed checks in all\n", failures);
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    comm::Environment environment(&argc, &argv);
    try {
      return run(argc, argv, environment);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: FAILED: exception: %s\n", g_rank, e.what());
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, 1);  // the other ranks may be waiting in a collective
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: exception: %s\n", e.what());
    return 1;
  }
}
