// fp32 <-> bf16/fp16 loads and stores on 16 AVX-512 lanes, for the kernel files compiled
// with the AVX-512 flags (CMakeLists.txt): the Adam kernel and the one-state optimizers'
// (csrc/optim). Include only from *_avx512.cpp files. Results equal adam_math.h's scalar
// conversions bit for bit (tests/test_adam.py, tests/test_native_optimizers.py).
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
inline __m512 load16(const void* base, size_t i) {
  if constexpr (D == DType::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (D == DType::kBF16) {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    return _mm512_cvtph_ps(h);
  }
}

// fp32 -> bf16, round to nearest even; NaN -> 0x7FC0 (adam_math::f32_to_bf16).
inline __m256i to_bf16(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);  // truncating narrow; values fit in 16 bits
}

template <DType D>
inline void store16(void* base, size_t i, __m512 f) {
  if constexpr (D == DType::kF32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, f);
  } else if constexpr (D == DType::kBF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        to_bf16(f));
  } else if constexpr (D == DType::kF16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i),
                        _mm512_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The fp32 arithmetic every kernel family's AVX-512 lanes share (csrc/optim's one-state
// lanes, csrc/adam8bit's 8-bit lanes derive from it and add their own operations).
struct Avx512Arith {
  using V = __m512;
  static constexpr size_t kWidth = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <DType D>
  static V load(const void* base, size_t i) {
    return load16<D>(base, i);
  }
  template <DType D>
  static void store(void* base, size_t i, V v) {
    store16<D>(base, i, v);
  }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};

}  // namespace
}  // namespace offload

#endif
