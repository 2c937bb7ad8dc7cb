// The AVX-512 (F/BW/VL/DQ) lanes of the 8-bit Adam kernels: adam8bit_math.h's operations on
// 16 fp32 lanes, codes dequantised with one gather from the 256-entry map and quantised with
// one gather from the lookup table ([Note: code lookup table], code_map.h), mask registers
// for the compare and the conditional step. Included by the AVX-512 kernel files only
// (adam8bit_kernel_avx512.cpp, adam8bit_kernel_avx512vbmi.cpp), each compiled with its flags.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "adam/simd_avx512.h"
#include "adam8bit/adam8bit_math.h"

namespace offload {
// Internal linkage: see [Note: one copy per ISA] in csrc/adam/adam_math.h.
namespace {

struct Avx512Lanes {
  using V = __m512;
  using I = __m512i;
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
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V dequant(const float* values, const uint8_t* codes, size_t i) {
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i));
    return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(c), values, 4);
  }
  static void dequant_block(const CodeMap& map, const uint8_t* codes, size_t len, float* buf) {
    adam8bit_math::dequant_vectors<Avx512Lanes>(map, codes, len, buf);
  }
  static I zero_bits() { return _mm512_setzero_si512(); }
  static I max_abs_bits(I acc, V x) {
    const __m512i b = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
    return _mm512_max_epu32(acc, b);
  }
  static uint32_t reduce_max(I acc) { return _mm512_reduce_max_epu32(acc); }
  // code_lookup (code_map.h) on 16 lanes, then narrowed to 16 bytes.
  static void quantize(const CodeMap& map, uint8_t* codes, size_t i, V y) {
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i mag = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512i negative = _mm512_srai_epi32(bits, 31);  // all ones where y < 0
    __m512i b = _mm512_sub_epi32(_mm512_srli_epi32(mag, kLutShift), _mm512_set1_epi32(kLutBias));
    b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_setzero_si512()),
                         _mm512_set1_epi32(kLutBuckets - 1));
    b = _mm512_add_epi32(b, _mm512_and_si512(negative, _mm512_set1_epi32(kLutBuckets)));
    const __m512i e = _mm512_i32gather_epi32(b, map.lut, 4);
    const __m512i low = _mm512_and_si512(mag, _mm512_set1_epi32(kLutLowMask));
    const __mmask16 step = _mm512_cmpge_epu32_mask(low, _mm512_srli_epi32(e, 8));
    const __m512i delta = _mm512_or_si512(negative, _mm512_set1_epi32(1));  // +1 or -1
    const __m512i qlo = _mm512_and_si512(e, _mm512_set1_epi32(0xFF));
    const __m512i q = _mm512_mask_add_epi32(qlo, step, qlo, delta);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), _mm512_cvtepi32_epi8(q));
  }
};

}  // namespace
}  // namespace offload

#endif
