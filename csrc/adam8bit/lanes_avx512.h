// The AVX-512 (F/BW/VL/DQ) lanes of the 8-bit Adam kernels: adam8bit_math.h's operations on
// 16 fp32 lanes, codes dequantised with one gather from the 256-entry map and quantised by
// arithmetic and in-register permutes ([Note: arithmetic quantiser], code_map.h), with one
// gather from the lookup table ([Note: code lookup table]) for the rare vector holding an
// uncertain lane. Included by the AVX-512 kernel files only
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

struct Avx512Lanes : Avx512Arith {
  using I = __m512i;
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
  // code_fast ([Note: arithmetic quantiser], code_map.h) on 16 lanes, as 32-bit codes; a
  // vector with an uncertain lane takes code_lookup's answer for it. kSigned is map.is_signed.
  // The binade index needs no clamp from above: a quantised |y| is at most 1 + 2^-23 (x times
  // the rounded 1 / absmax), so the index is at most 23 < kFastBinades (the permutes read its
  // low 5 bits).
  template <bool kSigned>
  static __m512i codes(const CodeMap& map, V y) {
    const FastQuant& f = map.fast;
    const __m512i bits = _mm512_castps_si512(y);
    const __m512i mag_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
    const __m512 mag = _mm512_castsi512_ps(mag_bits);
    // max(exponent - kFastFirstExponent, 0): a saturating subtract on the upper 16 bits.
    const __m512i e = _mm512_srli_epi32(
        _mm512_subs_epu16(mag_bits, _mm512_set1_epi32(kFastFirstExponent << 23)), 23);
    const __m512i seg_start = _mm512_permutex2var_epi32(
        _mm512_load_si512(f.seg_start), e, _mm512_load_si512(f.seg_start + 16));
    const __m512 t =
        _mm512_permutex2var_ps(_mm512_load_ps(f.trans), e, _mm512_load_ps(f.trans + 16));
    const __mmask16 past = _mm512_cmp_ps_mask(mag, t, _CMP_GT_OQ);
    const __m512i seg = _mm512_mask_add_epi32(seg_start, past, seg_start, _mm512_set1_epi32(1));
    const __m512 u = _mm512_fmsub_ps(mag, _mm512_permutexvar_ps(seg, _mm512_load_ps(f.a)),
                                     _mm512_permutexvar_ps(seg, _mm512_load_ps(f.c)));
    const __m512 frac = _mm512_reduce_ps(u, _MM_FROUND_TO_ZERO);  // u - trunc(u)
    const __mmask16 uncertain =
        _mm512_cmp_ps_mask(frac, _mm512_set1_ps(2.0f * kFastDelta), _CMP_LT_OQ);
    const __m512i off = _mm512_min_epi32(_mm512_cvttps_epi32(u),
                                         _mm512_permutexvar_epi32(seg, _mm512_load_si512(f.top)));
    const __mmask16 negative = _mm512_movepi32_mask(bits);
    __m512i q;
    if constexpr (kSigned) {
      const __m512i zero_code = _mm512_set1_epi32(127);
      q = _mm512_mask_sub_epi32(_mm512_add_epi32(zero_code, off), negative, zero_code, off);
      q = _mm512_max_epi32(q, _mm512_setzero_si512());
    } else {
      q = _mm512_maskz_mov_epi32(_knot_mask16(negative), off);
    }
    if (uncertain != 0) q = _mm512_mask_blend_epi32(uncertain, q, lookup(map, y));
    return q;
  }
  // codes() narrowed to 16 bytes at codes + i.
  template <bool kSigned>
  static void quantize(const CodeMap& map, uint8_t* codes_out, size_t i, V y) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes_out + i),
                     _mm512_cvtepi32_epi8(codes<kSigned>(map, y)));
  }
  // code_lookup (code_map.h) on 16 lanes: one gather from the table.
  static __m512i lookup(const CodeMap& map, V y) {
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
    return _mm512_mask_add_epi32(qlo, step, qlo, delta);
  }
};

}  // namespace
}  // namespace offload

#endif
