// Host-side bf16 and fp16 conversion (round to nearest, ties to even), bit-exact with the
// CUDA intrinsics __float2bfloat16_rn / __float2half_rn, so CPU references and checkpoints
// produce the same 16-bit words as the GPU.
#pragma once

#include <cstdint>

namespace core {

std::uint16_t float_to_bf16(float x);
float bf16_to_float(std::uint16_t bits);
std::uint16_t float_to_fp16(float x);
float fp16_to_float(std::uint16_t bits);

}  // namespace core
