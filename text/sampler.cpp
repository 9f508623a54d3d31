// Seeded, rank-disjoint window sampler: a keyed Feistel permutation per epoch, cycle-walked into [0, W).
#include "text/sampler.h"

#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace text {
namespace {

std::uint64_t mix64(std::uint64_t x) {  // splitmix64 finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

constexpr int kFeistelRounds = 6;

std::uint64_t feistel(std::uint64_t value, std::uint64_t key, int half_bits) {
  const std::uint64_t mask = (std::uint64_t{1} << half_bits) - 1;
  std::uint64_t left = value >> half_bits;
  std::uint64_t right = value & mask;
  for (int round = 0; round < kFeistelRounds; ++round) {
    const std::uint64_t f =
        mix64(key ^ mix64(right + static_cast<std::uint64_t>(round) * 0x632BE59BD9B4E019ull)) & mask;
    const std::uint64_t next_right = left ^ f;
    left = right;
    right = next_right;
  }
  return (left << half_bits) | right;
}

std::uint64_t field(const nlohmann::json& json, const char* name) {
  if (!json.is_object() || !json.contains(name) || !json.at(name).is_number_unsigned()) {
    throw core::InputError(std::string("sampler cursor: field \"") + name + "\" must be a non-negative integer in " +
                           json.dump());
  }
  return json.at(name).get<std::uint64_t>();
}

}  // namespace

void to_json(nlohmann::json& json, const SamplerCursor& cursor) {
  json = nlohmann::json{{"epoch", cursor.epoch}, {"position", cursor.position}};
}

void from_json(const nlohmann::json& json, SamplerCursor& cursor) {
  cursor.epoch = field(json, "epoch");
  cursor.position = field(json, "position");
}

Sampler::Sampler(std::uint64_t token_count, std::int64_t seq_len, int world_size, int rank, std::uint64_t seed)
    : windows_(0), seq_len_(seq_len), world_size_(world_size), rank_(rank), seed_(seed), half_bits_(0) {
  if (seq_len < 1) throw core::InputError("sampler: seq_len must be at least 1, got " + std::to_string(seq_len));
  if (world_size < 1)
    throw core::InputError("sampler: world size must be at least 1, got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size) {
    throw core::InputError("sampler: rank " + std::to_string(rank) + " outside [0, " + std::to_string(world_size) +
                           ")");
  }
  windows_ = token_count == 0 ? 0 : (token_count - 1) / static_cast<std::uint64_t>(seq_len);
  if (windows_ < static_cast<std::uint64_t>(world_size)) {
    throw core::InputError("sampler: " + std::to_string(token_count) + " tokens hold " + std::to_string(windows_) +
                           " windows of " + std::to_string(seq_len + 1) + " tokens, fewer than the " +
                           std::to_string(world_size) + " ranks; use more data or a shorter seq_len");
  }
  while ((std::uint64_t{1} << (2 * half_bits_)) < windows_) ++half_bits_;
}

std::uint64_t Sampler::window_at(std::uint64_t epoch, std::uint64_t position) const {
  if (windows_ == 1) return 0;
  const std::uint64_t key = mix64(seed_ ^ mix64(epoch + 0x5EED));
  std::uint64_t value = position;
  do {
    value = feistel(value, key, half_bits_);
  } while (value >= windows_);
  return value;
}

std::uint64_t Sampler::next() {
  const auto world = static_cast<std::uint64_t>(world_size_);
  if (cursor_.position + world > windows_) {
    ++cursor_.epoch;
    cursor_.position = 0;
  }
  const std::uint64_t window = window_at(cursor_.epoch, cursor_.position + static_cast<std::uint64_t>(rank_));
  cursor_.position += world;
  return window * static_cast<std::uint64_t>(seq_len_);
}

void Sampler::restore(const SamplerCursor& cursor) {
  if (cursor.position > windows_) {
    throw core::InputError("sampler cursor position " + std::to_string(cursor.position) + " lies beyond the " +
                           std::to_string(windows_) +
                           " windows of an epoch (was the cursor saved for another shard or seq_len?)");
  }
  cursor_ = cursor;
}

}  // namespace text
