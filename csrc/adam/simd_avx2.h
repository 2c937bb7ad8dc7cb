// fp32 <-> bf16/fp16 loads and stores on 8 AVX2 lanes (F16C for fp16), for the kernel
// files compiled with the AVX2 flags (CMakeLists.txt): the Adam kernel and the one-state
// optimizers' (csrc/optim). Include only from *_avx2.cpp files. Results equal adam_math.h's
// scalar conversions bit for bit (tests/test_adam.py, tests/test_native_optimizers.py).
#pragma once

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/adam.h"

namespace offload {
// Internal linkage: see [Note: one copy per ISA] in adam_math.h.
namespace {

template <DType D>
inline __m256 load8(const void* base, size_t i) {
  if constexpr (D == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    // bf16 is the upper half of an fp32: widen to 32 bits and shift into place.
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_cvtph_ps(h);
  }
}

// [Note: bf16 rounding on AVX2] fp32 -> bf16, round to nearest even, NaN -> 0x7FC0
// (adam_math::f32_to_bf16): bits + 0x7FFF + lsb, upper half kept. The narrowing to 16 bits
// is done for two vectors at once (one shift, one word blend, one byte shuffle, one
// permute for 16 values) rather than per vector (pack + permute each): the step is bound
// by the sqrt/divide unit, and every extra shuffle competes with it for issue slots. In
// cache on Zen 2 this took bf16 output from 1450 to 1750 Mparam/s per core (fp32: 2600).
// (Measured and rejected: computing the lsb with a compare instead of a shift, four
// vectors per iteration, storing the moments before the sqrt/div chain: no gain or worse.)
inline __m256i round_bf16_in_upper_half(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  const __m256 nan = _mm256_cmp_ps(f, f, _CMP_UNORD_Q);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(nan));
}

// 16 values (a: elements 0..7, b: 8..15) to 16 contiguous bf16.
inline __m256i to_bf16_x16(__m256 a, __m256 b) {
  const __m256i lo = _mm256_srli_epi32(round_bf16_in_upper_half(a), 16);
  const __m256i hi = round_bf16_in_upper_half(b);
  // Per 32-bit lane: low word a_k, high word b_k; then per 128-bit lane gather the a's and
  // the b's ([a0..3 b0..3 | a4..7 b4..7]) and order the 64-bit blocks as a0..7 b0..7.
  const __m256i mixed = _mm256_blend_epi16(lo, hi, 0xAA);
  const __m256i grouped = _mm256_shuffle_epi8(
      mixed, _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                              0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm256_permute4x64_epi64(grouped, 0xD8);
}

// 8 values to 8 bf16 (the remainder loop).
inline __m128i to_bf16_x8(__m256 f) {
  return _mm256_castsi256_si128(to_bf16_x16(f, f));
}

template <DType D>
inline void store8(void* base, size_t i, __m256 f) {
  if constexpr (D == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, f);
  } else if constexpr (D == DType::kBF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     to_bf16_x8(f));
  } else if constexpr (D == DType::kF16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i),
                     _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// Elements i..i+7 from a, i+8..i+15 from b. kStream (16-bit types only): one
// non-temporal 32-byte store, to a 32-byte aligned address.
template <DType D, bool kStream = false>
inline void store16(void* base, size_t i, __m256 a, __m256 b) {
  if constexpr (kStream) {
    static_assert(D != DType::kF32, "streamed stores are for the 16-bit copy-out");
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m256i h = D == DType::kBF16 ? to_bf16_x16(a, b)
                                        : _mm256_set_m128i(_mm256_cvtps_ph(b, kRound),
                                                           _mm256_cvtps_ph(a, kRound));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i), h);
  } else if constexpr (D == DType::kBF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        to_bf16_x16(a, b));
  } else {
    store8<D>(base, i, a);
    store8<D>(base, i + 8, b);
  }
}

// The fp32 arithmetic every kernel family's AVX2 lanes share (csrc/optim's one-state lanes,
// csrc/adam8bit's 8-bit lanes derive from it and add their own operations).
struct Avx2Arith {
  using V = __m256;
  static constexpr size_t kWidth = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  template <DType D>
  static V load(const void* base, size_t i) {
    return load8<D>(base, i);
  }
  template <DType D>
  static void store(void* base, size_t i, V v) {
    store8<D>(base, i, v);
  }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};

}  // namespace
}  // namespace offload

#endif
