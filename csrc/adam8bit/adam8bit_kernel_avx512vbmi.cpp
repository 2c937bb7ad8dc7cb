// The AVX-512 kernel of the 8-bit Adam step on CPUs with AVX512-VBMI (Ice Lake and later,
// Zen 4 and later): lanes_avx512.h's lanes with dequantisation by byte permutes instead of
// gathers. Compiled with the AVX-512 flags plus -mavx512vbmi (CMakeLists.txt); dispatch
// (adam8bit.cpp) takes it for isa 'avx512' when the CPU has VBMI. Equal to the scalar
// reference bit for bit: it looks up the same values, only by another route.
//
// [Note: byte-plane lookup] A zmm gather costs ~5 ns per 16 lanes on Zen 5 (measured: four
// per 16 elements capped the step at ~750 Mparam/s per core in cache); a lookup of 64 codes
// here costs ~4 ns. The map's 256 floats are held as four 256-byte tables, byte k of every
// value (CodeMap::value_bytes); vpermi2b looks 64 codes up in 128 bytes at once, so per byte
// table two permutes (code bit 7 clear / set) and a blend by the codes' top bit, and four
// such give the four bytes of 64 values, which two rounds of unpacks interleave into floats.
// The unpacks work within 128-bit lanes, so the codes are first permuted by kGroupTranspose
// (4-byte groups transposed 4 x 4) to make the floats come out in element order.
#include "adam8bit/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "adam8bit/adam8bit_math.h"
#include "adam8bit/lanes_avx512.h"

namespace offload {
namespace {

// Output position 16 L + 4 R + s (128-bit lane L, 4-byte group R, byte s) takes code
// 16 R + 4 L + s.
#define OFFLOAD_GROUP(L, R) 16 * R + 4 * L, 16 * R + 4 * L + 1, 16 * R + 4 * L + 2, 16 * R + 4 * L + 3
alignas(64) constexpr uint8_t kGroupTranspose[64] = {
    OFFLOAD_GROUP(0, 0), OFFLOAD_GROUP(0, 1), OFFLOAD_GROUP(0, 2), OFFLOAD_GROUP(0, 3),
    OFFLOAD_GROUP(1, 0), OFFLOAD_GROUP(1, 1), OFFLOAD_GROUP(1, 2), OFFLOAD_GROUP(1, 3),
    OFFLOAD_GROUP(2, 0), OFFLOAD_GROUP(2, 1), OFFLOAD_GROUP(2, 2), OFFLOAD_GROUP(2, 3),
    OFFLOAD_GROUP(3, 0), OFFLOAD_GROUP(3, 1), OFFLOAD_GROUP(3, 2), OFFLOAD_GROUP(3, 3)};
#undef OFFLOAD_GROUP

// vpermt2b's index: bytes 0..15 take byte 0 of each 32-bit lane of the first source (a
// moment's codes), bytes 16..31 byte 0 of each lane of the second (index bit 6).
#define OFFLOAD_LOW4(k) 4 * (k), 4 * (k + 1), 4 * (k + 2), 4 * (k + 3)
alignas(64) constexpr uint8_t kLowBytesOfTwo[64] = {
    OFFLOAD_LOW4(0),  OFFLOAD_LOW4(4),  OFFLOAD_LOW4(8),  OFFLOAD_LOW4(12),
    OFFLOAD_LOW4(16), OFFLOAD_LOW4(20), OFFLOAD_LOW4(24), OFFLOAD_LOW4(28)};
#undef OFFLOAD_LOW4

struct Avx512VbmiLanes : Avx512Lanes {
  // Both moments' codes of 16 elements (exp_avg on the signed map, exp_avg_sq on the unsigned
  // one), narrowed together by one byte permute: two vpmovdb take twice its port time.
  static constexpr bool kQuantizePair = true;
  static void quantize_pair(const CodeMap& mm, uint8_t* mcodes, V ym, const CodeMap& vm,
                            uint8_t* vcodes, V yv, size_t i) {
    const __m512i qm = codes<true>(mm, ym);
    const __m512i qv = codes<false>(vm, yv);
    const __m256i both = _mm512_castsi512_si256(
        _mm512_permutex2var_epi8(qm, _mm512_load_si512(kLowBytesOfTwo), qv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mcodes + i), _mm256_castsi256_si128(both));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vcodes + i), _mm256_extracti128_si256(both, 1));
  }
  // [Note: byte-plane lookup]: map.values[codes[j]] for j < len, 64 at a time.
  static void dequant_block(const CodeMap& map, const uint8_t* codes, size_t len, float* buf) {
    size_t j = 0;
    if (len >= 64) {
      __m512i table[4][4];
      for (int k = 0; k < 4; ++k) {
        for (int q = 0; q < 4; ++q) table[k][q] = _mm512_load_si512(map.value_bytes[k] + 64 * q);
      }
      const __m512i transpose = _mm512_load_si512(kGroupTranspose);
      for (; j + 64 <= len; j += 64) {
        const __m512i c = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(codes + j));
        const __mmask64 upper = _mm512_movepi8_mask(c);  // code >= 128
        __m512i byte[4];
        for (int k = 0; k < 4; ++k) {
          const __m512i lo = _mm512_permutex2var_epi8(table[k][0], c, table[k][1]);
          const __m512i hi = _mm512_permutex2var_epi8(table[k][2], c, table[k][3]);
          byte[k] = _mm512_mask_blend_epi8(upper, lo, hi);
        }
        const __m512i lo01 = _mm512_unpacklo_epi8(byte[0], byte[1]);
        const __m512i hi01 = _mm512_unpackhi_epi8(byte[0], byte[1]);
        const __m512i lo23 = _mm512_unpacklo_epi8(byte[2], byte[3]);
        const __m512i hi23 = _mm512_unpackhi_epi8(byte[2], byte[3]);
        _mm512_storeu_si512(buf + j, _mm512_unpacklo_epi16(lo01, lo23));
        _mm512_storeu_si512(buf + j + 16, _mm512_unpackhi_epi16(lo01, lo23));
        _mm512_storeu_si512(buf + j + 32, _mm512_unpacklo_epi16(hi01, hi23));
        _mm512_storeu_si512(buf + j + 48, _mm512_unpackhi_epi16(hi01, hi23));
      }
    }
    for (; j < len; ++j) buf[j] = map.values[codes[j]];
  }
};

struct Avx512VbmiImpl {
  template <DType G, DType O, bool L2>
  static void step(const Adam8bitBuffers& b, const AdamScalars& s, size_t block_begin,
                   size_t block_end) {
    adam8bit_math::step_blocks<Avx512VbmiLanes, G, O, L2>(b, s, block_begin, block_end);
  }
  static void quantize(const float* src, uint8_t* codes, float* scales, size_t n,
                       const CodeMap& map, size_t block_begin, size_t block_end) {
    adam8bit_math::quantize_blocks<Avx512VbmiLanes>(src, codes, scales, n, map, block_begin,
                                                    block_end);
  }
};

}  // namespace

Adam8bitKernelSet avx512vbmi_adam8bit_kernels() {
  return adam8bit_select::make_kernel_set<Avx512VbmiImpl>(&adam8bit_math::adam8bit_traffic);
}

}  // namespace offload

#else  // not x86-64

namespace offload {
Adam8bitKernelSet avx512vbmi_adam8bit_kernels() { return {}; }
}  // namespace offload

#endif
