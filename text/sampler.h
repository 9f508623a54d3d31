// Seeded, rank-disjoint sampler of training windows over one token shard.
//
// The shard's `count` tokens hold W = (count - 1) / seq_len windows; window w covers tokens
// [w * seq_len, w * seq_len + seq_len + 1): seq_len inputs and their seq_len next-token targets.
// Each epoch visits the windows in an order permuted by (seed, epoch); at every step rank r takes
// entry `position + r` of that order and all ranks advance `position` by the world size, so the
// ranks never share a window within an epoch and together cover floor(W / world) * world of them
// (the remainder, fewer than `world` windows of that epoch's order, is skipped). The permutation is
// a keyed Feistel network with cycle walking: O(1) memory and random access, the same on every platform.
//
// The cursor (epoch, position) is the same on every rank and is saved in checkpoints; restoring it
// continues the sequence exactly, also with another world size (the ranks then split the rest of the
// epoch's order among themselves).
#pragma once

#include <cstdint>

#include <nlohmann/json_fwd.hpp>

namespace text {

struct SamplerCursor {
  std::uint64_t epoch = 0;
  std::uint64_t position = 0;  // entries of the epoch's order consumed by all ranks together
  bool operator==(const SamplerCursor&) const = default;
};

// {"epoch": E, "position": P}
void to_json(nlohmann::json& json, const SamplerCursor& cursor);
// Throws core::InputError when a field is missing or not a non-negative integer.
void from_json(const nlohmann::json& json, SamplerCursor& cursor);

class Sampler {
 public:
  // Throws core::InputError when seq_len < 1, world_size < 1, rank outside [0, world_size), or the
  // shard holds fewer windows than ranks.
  Sampler(std::uint64_t token_count, std::int64_t seq_len, int world_size, int rank, std::uint64_t seed);

  std::uint64_t windows() const { return windows_; }  // W
  std::uint64_t steps_per_epoch() const { return windows_ / static_cast<std::uint64_t>(world_size_); }
  std::int64_t seq_len() const { return seq_len_; }

  // Token offset of this rank's next window (seq_len + 1 tokens from there); advances the cursor,
  // starting the next epoch when fewer than world_size entries of the order remain.
  std::uint64_t next();

  // Window index at entry `position` of epoch `epoch`'s order (a permutation of [0, W)).
  std::uint64_t window_at(std::uint64_t epoch, std::uint64_t position) const;

  SamplerCursor cursor() const { return cursor_; }
  // Throws core::InputError when the position lies beyond the epoch's W entries.
  void restore(const SamplerCursor& cursor);

 private:
  std::uint64_t windows_;
  std::int64_t seq_len_;
  int world_size_;
  int rank_;
  std::uint64_t seed_;
  int half_bits_;  // the Feistel network permutes [0, 4^half_bits) >= W
  SamplerCursor cursor_;
};

}  // namespace text
