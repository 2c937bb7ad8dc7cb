// Branch-free fp32 <-> bf16/fp16 conversions (selects instead of ifs, which vectorise),
// with the same results as adam_math.h's: the element loads and stores of the portable
// kernels (Adam's and the one-state optimizers', csrc/optim), which leave vectorising to
// the compiler.
#pragma once

#include <cstddef>
#include <cstdint>

#include "adam/adam_math.h"

namespace offload {
// Internal linkage: see [Note: one copy per ISA] in adam_math.h.
namespace {

using adam_math::bits_of;
using adam_math::float_of;

// Branch-free versions of adam_math's conversions, same results. Selects are written as
// masks: GCC keeps nested ?: on integers as control flow and then refuses to vectorise.
inline uint32_t select(bool c, uint32_t if_true, uint32_t if_false) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return if_false ^ ((if_true ^ if_false) & mask);
}

inline float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(select((u & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, rounded));
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  const uint32_t sub = bits_of(static_cast<float>(mant) * 0x1p-24f);
  const uint32_t special = 0x7F800000u | (mant << 13);
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const uint32_t u = select(exp == 0, sub, select(exp == 31, special, normal));
  return float_of(sign | u);
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t nan = 0x7E00u | ((a >> 13) & 0x3FFu);
  const uint32_t r = a - 0x38000000u;
  const uint32_t normal = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  const uint32_t sub = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  uint32_t h = select(a >= 0x38800000u, normal, sub);
  h = select(a >= 0x477FF000u, 0x7C00u, h);
  h = select(a > 0x7F800000u, nan, h);
  return static_cast<uint16_t>(sign | h);
}

struct BranchFreeConv {
  template <DType D>
  static float load(const void* base, size_t i) {
    if constexpr (D == DType::kF32) {
      return static_cast<const float*>(base)[i];
    } else if constexpr (D == DType::kBF16) {
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    } else {
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    }
  }

  template <DType D>
  static void store(void* base, size_t i, float f) {
    if constexpr (D == DType::kF32) {
      static_cast<float*>(base)[i] = f;
    } else if constexpr (D == DType::kBF16) {
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(f);
    } else if constexpr (D == DType::kF16) {
      static_cast<uint16_t*>(base)[i] = f32_to_f16(f);
    }
  }
};

}  // namespace
}  // namespace offload
