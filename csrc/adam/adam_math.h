// The Adam update of one element and the fp32 <-> bf16/fp16 conversions, in plain C++.
// This is the definition every kernel reproduces bit for bit: the scalar kernel calls it
// per element, the SIMD kernels call it for their tails and perform the same operations
// in the same order on vectors.
//
// [Note: operation order] Per element, in fp32, with FMA (one rounding) exactly where
// written below and nowhere else:
//   g  = grad * grad_scale
//   g  = fma(p, l2, g)                     Adam's L2 decay (only when l2 != 0)
//   p  = p * decay                         AdamW's decoupled decay (decay = 1 when off)
//   m  = fma(1 - beta1, g - m, m)          torch's lerp_ (weight < 0.5 branch) is this fma
//   v  = fma((1 - beta2) * g, g, v * beta2)
//   d  = fma(sqrt(v), inv_bc2_sqrt, eps)
//   p  = fma(-step_size, m / d, p)
// torch evaluates `v.mul_(b2).addcmul_(g, g, value=1-b2)`, `sqrt(v) / bc2_sqrt + eps`
// and `p.addcdiv_(m, d, value=-step_size)` op by op, so results differ from torch's in
// the last bits (a few ulp per step); the SIMD kernels match this definition exactly,
// because IEEE sqrt, division and FMA are correctly rounded in every ISA.
// Build note: a compiler may contract `a * b + c` into an FMA on targets that have one;
// the expressions here never feed a product straight into an addition, so there is
// nothing to contract and the scalar result does not depend on -ffp-contract.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam/adam.h"

namespace offload {
// [Note: one copy per ISA] Everything here has internal linkage (an unnamed namespace
// in a header): each kernel file compiles its own copy with its own ISA flags. Inline
// functions with external linkage would be merged by the linker into one copy, possibly
// the AVX2-compiled one, which the baseline kernels would then call on CPUs without AVX2.
namespace adam_math {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, keep the upper
// half. NaN becomes the canonical quiet NaN 0x7FC0 (as c10::BFloat16 does), because the
// addition could carry a NaN's payload into the exponent or the sign.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Exact: every fp16 is an fp32.
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  uint32_t u;
  if (exp == 0) {
    u = bits_of(static_cast<float>(mant) * 0x1p-24f);  // zero or subnormal, exact
  } else if (exp == 31) {
    u = 0x7F800000u | (mant << 13);                    // inf or NaN (payload kept)
  } else {
    u = ((exp + 112u) << 23) | (mant << 13);           // rebias 15 -> 127
  }
  return float_of(sign | u);
}

// Round to nearest even, overflow to inf, NaN quieted with its payload truncated: the
// same results as F16C's vcvtps2ph with _MM_FROUND_TO_NEAREST_INT.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  uint32_t h;
  if (a > 0x7F800000u) {
    h = 0x7E00u | ((a >> 13) & 0x3FFu);
  } else if (a >= 0x477FF000u) {
    h = 0x7C00u;  // >= 65520 rounds to inf (65504 has an odd mantissa, so the tie goes up)
  } else if (a >= 0x38800000u) {
    // Normal in fp16 (>= 2^-14): rebias the exponent, then round away 13 mantissa bits;
    // a carry out of the mantissa correctly bumps the exponent.
    const uint32_t r = a - 0x38000000u;
    h = (r + 0xFFFu + ((r >> 13) & 1u)) >> 13;
  } else {
    // Subnormal in fp16: in [0.5, 1) the fp32 ulp is 2^-24, the fp16 subnormal quantum,
    // so adding 0.5 rounds |f| to a multiple of it (nearest even, the FPU's default
    // mode) and the low bits are the fp16 mantissa. A tie that rounds up to 2^-14 yields
    // 0x400, the smallest normal: also right.
    h = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  }
  return static_cast<uint16_t>(sign | h);
}

// Per-element loads and stores in the straightforward (branching) conversions above.
struct ScalarConv {
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

// One element of the update, [Note: operation order].
template <DType G, DType M, DType O, bool kL2, class Conv = ScalarConv>
inline void adam_element(const AdamBuffers& b, const AdamScalars& s, size_t i) {
  float g = Conv::template load<G>(b.grad, i) * s.grad_scale;
  float p = b.master[i];
  if constexpr (kL2) g = std::fma(p, s.l2, g);
  p = p * s.decay;
  float m = Conv::template load<M>(b.exp_avg, i);
  float v = Conv::template load<M>(b.exp_avg_sq, i);
  m = std::fma(s.one_minus_beta1, g - m, m);
  const float vb = v * s.beta2;
  v = std::fma(s.one_minus_beta2 * g, g, vb);
  const float d = std::fma(std::sqrt(v), s.inv_bc2_sqrt, s.eps);
  p = std::fma(s.neg_step_size, m / d, p);
  b.master[i] = p;
  Conv::template store<M>(b.exp_avg, i, m);
  Conv::template store<M>(b.exp_avg_sq, i, v);
  if constexpr (O != DType::kNone) Conv::template store<O>(b.out, i, p);
}

}  // namespace
}  // namespace adam_math
}  // namespace offload
