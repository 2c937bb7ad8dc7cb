// The AVX2 + FMA + F16C kernel of the 8-bit Adam step: adam8bit_math.h on 8 fp32 lanes.
// Codes are dequantised with one gather from the 256-entry map and quantised with one
// gather from the lookup table ([Note: code lookup table], code_map.h), both moments' codes
// narrowed together. Compiled with the AVX2 flags (CMakeLists.txt) and called only when
// cpu_features().avx2 is set. Equal to the scalar reference bit for bit.
#include "adam8bit/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam/simd_avx2.h"
#include "adam8bit/adam8bit_math.h"

namespace offload {
namespace {

struct Avx2Lanes : Avx2Arith {
  using I = __m256i;
  static V dequant(const float* values, const uint8_t* codes, size_t i) {
    const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i));
    return _mm256_i32gather_ps(values, _mm256_cvtepu8_epi32(c), 4);
  }
  static void dequant_block(const CodeMap& map, const uint8_t* codes, size_t len, float* buf) {
    adam8bit_math::dequant_vectors<Avx2Lanes>(map, codes, len, buf);
  }
  static I zero_bits() { return _mm256_setzero_si256(); }
  static I max_abs_bits(I acc, V x) {
    const __m256i b = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
    return _mm256_max_epu32(acc, b);
  }
  static uint32_t reduce_max(I acc) {
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4E));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xB1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  // code_lookup (code_map.h) on 8 lanes, as 32-bit codes. The bucket needs no clamp from
  // above: a quantised |y| is at most 1 + 2^-23 (x times the rounded 1 / absmax), whose
  // bucket is the last one (|y| >= 1).
  static __m256i codes(const CodeMap& map, V y) {
    const __m256i bits = _mm256_castps_si256(y);
    const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
    const __m256i negative = _mm256_srai_epi32(bits, 31);  // all ones where y < 0
    __m256i b = _mm256_sub_epi32(_mm256_srli_epi32(mag, kLutShift), _mm256_set1_epi32(kLutBias));
    b = _mm256_max_epi32(b, _mm256_setzero_si256());
    b = _mm256_add_epi32(b, _mm256_and_si256(negative, _mm256_set1_epi32(kLutBuckets)));
    const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(map.lut), b, 4);
    const __m256i low = _mm256_and_si256(mag, _mm256_set1_epi32(kLutLowMask));
    const __m256i no_step = _mm256_cmpgt_epi32(_mm256_srli_epi32(e, 8), low);
    const __m256i delta = _mm256_or_si256(negative, _mm256_set1_epi32(1));  // +1 or -1
    return _mm256_add_epi32(_mm256_and_si256(e, _mm256_set1_epi32(0xFF)),
                            _mm256_andnot_si256(no_step, delta));
  }
  // codes() narrowed to 8 bytes at out + i.
  template <bool kSigned = false>  // map.is_signed, unused: the table holds both signs
  static void quantize(const CodeMap& map, uint8_t* out, size_t i, V y) {
    const __m256i q = codes(map, y);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packus_epi16(w, w));
  }
  // Both moments' codes of 8 elements, narrowed together: three shuffles instead of six.
  static constexpr bool kQuantizePair = true;
  static void quantize_pair(const CodeMap& mm, uint8_t* mcodes, V ym, const CodeMap& vm,
                            uint8_t* vcodes, V yv, size_t i) {
    // Per 128-bit lane: m's four codes, then v's four, as 16 bits; then as bytes (twice).
    const __m256i w = _mm256_packus_epi32(codes(mm, ym), codes(vm, yv));
    const __m256i bytes = _mm256_packus_epi16(w, w);
    // 32-bit groups: m 0-3, m 4-7, v 0-3, v 4-7.
    const __m128i both = _mm256_castsi256_si128(
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(mcodes + i), both);
    _mm_storeh_pd(reinterpret_cast<double*>(vcodes + i), _mm_castsi128_pd(both));
  }
};

struct Avx2Impl {
  template <DType G, DType O, bool L2>
  static void step(const Adam8bitBuffers& b, const AdamScalars& s, size_t block_begin,
                   size_t block_end) {
    adam8bit_math::step_blocks<Avx2Lanes, G, O, L2>(b, s, block_begin, block_end);
  }
  static void quantize(const float* src, uint8_t* codes, float* scales, size_t n,
                       const CodeMap& map, size_t block_begin, size_t block_end) {
    adam8bit_math::quantize_blocks<Avx2Lanes>(src, codes, scales, n, map, block_begin, block_end);
  }
};

}  // namespace

Adam8bitKernelSet avx2_adam8bit_kernels() {
  return adam8bit_select::make_kernel_set<Avx2Impl>(&adam8bit_math::adam8bit_traffic);
}

}  // namespace offload

#else  // not x86-64

namespace offload {
Adam8bitKernelSet avx2_adam8bit_kernels() { return {}; }
}  // namespace offload

#endif
