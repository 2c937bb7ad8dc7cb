// A code map with what the quantiser needs to find the nearest code fast: the midpoint
// thresholds (the definition) and a lookup table on the value's bit pattern (the SIMD
// kernels' path to the same answer). Built once per map at first use (adam8bit.cpp), read by
// every kernel.
//
// [Note: nearest code] For sorted codes c[0..255], thresholds[j] is the smallest fp32 >=
// (c[j] + c[j+1]) / 2 (the midpoint is exact in double, then rounded up to fp32), and the
// code of an fp32 y is #{j < 255 : thresholds[j] <= y}: the nearest code, ties (y exactly on
// a representable midpoint) to the larger one. `code_search` evaluates that count with a
// branch-free binary search (8 compares); it is the scalar reference.
//
// [Note: code lookup table] The SIMD kernels look the count up instead. The bucket of |y| is
// its exponent and top kLutMantBits mantissa bits; within one bucket the count changes at
// most once (the builder checks it for every bucket, or throws), so one 32-bit entry holds
// the count at the bucket's start (low 8 bits) and the offset of the low mantissa bits at
// which it steps by one (bits 8..24; kLutNever: no step), up for y > 0, down for y < 0. One
// gather, a compare and an add per vector instead of eight dependent gathers. The buckets
// cover |y| in [2^-23, 1) with 2^7 per binade (the unsigned map's densest binade, [0.5, 1),
// holds 72 thresholds 0.007 apart and needs 7 bits); |y| < 2^-23 (below every nonzero
// code's midpoint) and |y| >= 1 take one constant bucket each. Per sign 23 * 128 + 2
// entries: 23.6 KB per map, of which a step touches the few binades its values fall into.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "adam/adam_math.h"

namespace offload {

constexpr int kLutMantBits = 7;
constexpr int kLutShift = 23 - kLutMantBits;            // low mantissa bits inside a bucket
constexpr uint32_t kLutLowMask = (1u << kLutShift) - 1;
constexpr int32_t kLutMinExponent = 127 - 23;           // biased exponent of 2^-23
constexpr int32_t kLutBias = (kLutMinExponent << kLutMantBits) - 1;  // bucket 1 starts at 2^-23
constexpr int32_t kLutBuckets = 23 * (1 << kLutMantBits) + 2;        // per sign
constexpr uint32_t kLutNever = 1u << kLutShift;         // an offset no low bits reach

// [Note: arithmetic quantiser] The AVX-512 kernels' fast path to the same count: arithmetic
// and in-register permutes, no memory lookup per element. (A 16-lane gather costs ~5 ns on
// Zen 5; with one per 16 elements and moment, quantisation was ~70 % of the step.) The dynamic
// map is 0, seven decades of codes at the centres of equal steps of [0.1, 1] * 10^(i-6), and 1,
// so inside decade i the thresholds sit where u = |y| * a_i - c_i crosses an integer, u being
// the code's offset from the zero code on y's side. |y|'s segment (the zero code, decade 0..6,
// the code of 1) is that of its binade's start, plus one if |y| is past the one segment
// boundary a binade can hold (FastQuant::trans, the threshold there; boundaries are ten-fold
// apart, binades two-fold).
// Then off = min(trunc(u), top_s), and the code is 127 + off (sign bit clear) or
// max(127 - off, 0) (set) on the signed map, off or 0 on the unsigned one. The fp32 u is within
// ~1e-4 of the ideal, so off is exact except near an integer. The tables hold c_i - kFastDelta,
// so that one truncation serves both purposes: a lane whose u + kFastDelta has a fractional
// part below 2 kFastDelta (u within kFastDelta of an integer) is "uncertain", and a vector
// holding one (~2 % of them in a step) takes the lookup table's answers for those lanes. A |y|
// exactly on a decade's first threshold (where a midpoint that fp32 holds exactly ties
// differently on the two signs) stays in the lower segment, whose u there is its top offset
// + 2 within fp32 rounding (the zero code's segment is a line to 1 there): uncertain, so the
// boundary needs no test of its own; the code of 1's segment starts at its threshold. The
// builder (adam8bit.cpp) proves the certain lanes exact for every
// fp32 y in [-2, 2] (a step's |y| is at most 1 + 2^-23): code_fast is monotone in y, so it
// suffices that it equals code_search at the first and the last certain y of every interval
// between two thresholds, and that it does not decrease where the segment or binade changes.
constexpr float kFastDelta = 1.0f / 4096;  // 16x the smallest the proof passes (2^-16)
constexpr int32_t kFastFirstExponent = 127 - 23;  // binade index 0: |y| < 2^-22
constexpr int kFastBinades = 32;
constexpr int kFastSegments = 16;                // 9 used: zero, decades 0..6, one

struct FastQuant {
  alignas(64) int32_t seg_start[kFastBinades];  // segment at the binade's start
  alignas(64) float trans[kFastBinades];        // the segment boundary inside it, or +inf
  alignas(64) float a[kFastSegments];
  alignas(64) float c[kFastSegments];
  alignas(64) int32_t top[kFastSegments];       // the segment's largest offset
};

struct CodeMap {
  float values[256];      // ascending
  float thresholds[256];  // [Note: nearest code]; [255] = +inf, never read by the search
  uint32_t lut[2 * kLutBuckets];  // [Note: code lookup table]: y >= 0, then y < 0
  uint8_t zero_code;      // the index of 0.0: what zeros and non-finite blocks store
  // value_bytes[k][c]: byte k (little-endian) of values[c]: four 256-byte tables that the
  // AVX512-VBMI kernel permutes bytes from instead of gathering floats.
  alignas(64) uint8_t value_bytes[4][256];
  bool is_signed;
  FastQuant fast;  // [Note: arithmetic quantiser]
};

// The map of exp_avg (signed) or exp_avg_sq (unsigned); thread-safe, built on first call.
const CodeMap& code_map(bool is_signed);

// Internal linkage: see [Note: one copy per ISA] in csrc/adam/adam_math.h.
namespace {

// [Note: nearest code]: the count of thresholds <= y, by binary search.
inline uint32_t code_search(const CodeMap& map, float y) {
  uint32_t q = 0;
  for (uint32_t step = 128; step != 0; step >>= 1) {
    q += map.thresholds[q + step - 1] <= y ? step : 0;
  }
  return q;
}

// The bucket of a bit pattern's magnitude, clamped to the table ([Note: code lookup table]).
inline int32_t lut_bucket(uint32_t magnitude_bits) {
  const int32_t b = static_cast<int32_t>(magnitude_bits >> kLutShift) - kLutBias;
  return b < 0 ? 0 : (b > kLutBuckets - 1 ? kLutBuckets - 1 : b);
}

// The same count by table lookup: what the SIMD kernels compute, one element at a time.
inline uint32_t code_lookup(const CodeMap& map, float y) {
  const uint32_t bits = adam_math::bits_of(y);
  const uint32_t mag = bits & 0x7FFFFFFFu;
  const uint32_t negative = bits >> 31;
  const uint32_t e = map.lut[lut_bucket(mag) + (negative ? kLutBuckets : 0)];
  const bool step = (mag & kLutLowMask) >= (e >> 8);
  return (e & 0xFFu) + (step ? (negative ? 0xFFFFFFFFu : 1u) : 0u);
}

// [Note: arithmetic quantiser] on one element: the code, and whether it is uncertain (then
// only code_search / code_lookup's answer counts). The AVX-512 lanes compute exactly this.
inline uint32_t code_fast(const CodeMap& map, float y, bool* uncertain) {
  const FastQuant& f = map.fast;
  const uint32_t bits = adam_math::bits_of(y);
  const uint32_t mag_bits = bits & 0x7FFFFFFFu;
  const float mag = adam_math::float_of(mag_bits);
  int32_t e = static_cast<int32_t>(mag_bits >> 23) - kFastFirstExponent;
  e = e < 0 ? 0 : (e > kFastBinades - 1 ? kFastBinades - 1 : e);
  const float t = f.trans[e];
  const int32_t seg = f.seg_start[e] + (mag > t ? 1 : 0);
  const float u = std::fma(mag, f.a[seg], -f.c[seg]);  // u + kFastDelta of the Note
  const int32_t trunc = static_cast<int32_t>(u);  // u >= 0.2 > -1: no overflow, no NaN
  const float frac = u - std::trunc(u);           // exact, as vreduceps toward zero
  *uncertain = frac < 2.0f * kFastDelta;
  const int32_t off = trunc < f.top[seg] ? trunc : f.top[seg];
  const bool negative = (bits >> 31) != 0;
  if (map.is_signed) {
    const int32_t code = negative ? 127 - off : 127 + off;
    return static_cast<uint32_t>(code < 0 ? 0 : code);
  }
  return negative ? 0u : static_cast<uint32_t>(off);
}

}  // namespace
}  // namespace offload
