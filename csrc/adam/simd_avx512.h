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

// 32 values (a: elements 0..15, b: 16..31) to 32 contiguous bf16, the same bits as two
// to_bf16: each vector rounded in place (the bf16 in the upper half of every 32-bit lane),
// then one two-source word permute gathers the 32 upper halves (word j of the result is
// word 2j + 1 of a:b). That replaces two narrowing moves (vpmovdw, two uops each) and two
// shifts: the bf16 paths are compute-heavy enough for it to show (docs/adam.md).
inline __m512i round_bf16_in_upper_half(__m512 f) {
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC00000));
}

inline __m512i to_bf16_x32(__m512 a, __m512 b) {
  // Lane k holds the word indices 4k + 1 (low) and 4k + 3 (high).
  const __m512i odd_words = _mm512_setr_epi32(
      0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015, 0x001B0019,
      0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D, 0x00330031, 0x00370035,
      0x003B0039, 0x003F003D);
  return _mm512_permutex2var_epi16(round_bf16_in_upper_half(a), odd_words,
                                   round_bf16_in_upper_half(b));
}

// Elements i..i+15 from a, i+16..i+31 from b; kStream: one non-temporal 64-byte store
// for the 16-bit types (the address must then be 64-byte aligned).
template <DType D, bool kStream = false>
inline void store32(void* base, size_t i, __m512 a, __m512 b) {
  if constexpr (D == DType::kF32) {
    static_assert(!kStream, "fp32 pairs are two cache lines: stream them as two stores");
    _mm512_storeu_ps(static_cast<float*>(base) + i, a);
    _mm512_storeu_ps(static_cast<float*>(base) + i + 16, b);
  } else {
    __m512i h;
    if constexpr (D == DType::kBF16) {
      h = to_bf16_x32(a, b);
    } else {
      constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      h = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtps_ph(a, kRound)),
                             _mm512_cvtps_ph(b, kRound), 1);
    }
    auto* const at = reinterpret_cast<__m512i*>(static_cast<uint16_t*>(base) + i);
    if constexpr (kStream) {
      _mm512_stream_si512(at, h);
    } else {
      _mm512_storeu_si512(at, h);
    }
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
