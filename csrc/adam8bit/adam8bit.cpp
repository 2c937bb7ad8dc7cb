// Dispatch for the 8-bit Adam step: the code maps (built once), kernel choice for the CPU
// and the dtypes, and threading by whole blocks on the pool the fp32 step uses.
#include "adam8bit/adam8bit.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <string>

#include "adam/parallel.h"
#include "adam/thread_pool.h"
#include "adam8bit/code_maps.h"
#include "adam8bit/kernels.h"
#include "common/cpu_features.h"
#include "common/errors.h"

namespace offload {
namespace {

using adam_math::bits_of;
using adam_math::float_of;

[[noreturn]] void broken_map(const char* what) {
  // Only a bad edit of code_maps.h or of the table layout gets here; the message says which.
  throw ValueError(std::string("8-bit Adam code map: ") + what);
}

// [Note: arithmetic quantiser] (code_map.h): the segment and binade tables, then the proof
// that code_fast's certain answers equal code_search's for every fp32 y in [-2, 2].
void build_fast_quant(CodeMap& map) {
  FastQuant& f = map.fast;
  const bool is_signed = map.is_signed;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  // Segments: 0 the zero code, 1..7 decades 0..6, 8 the code of 1. Offsets count from the zero
  // code on the positive side: decade i holds 2^i (signed) or 2^(i+1) codes.
  int first[9], count[9];
  first[0] = 0;
  count[0] = 1;
  for (int seg = 1; seg <= 7; ++seg) {
    count[seg] = is_signed ? 1 << (seg - 1) : 1 << seg;
    first[seg] = is_signed ? count[seg] : count[seg] - 1;
  }
  first[8] = is_signed ? 128 : 255;
  count[8] = 1;
  for (int seg = 0; seg < kFastSegments; ++seg) {  // constant offsets (8 and up: the code of 1)
    const int off = seg == 0 ? 0 : first[8];
    f.a[seg] = 0.0f;
    f.c[seg] = -(static_cast<float>(off) + 0.5f);  // u = off + 0.5: always certain
    f.top[seg] = off;
  }
  for (int seg = 1; seg <= 7; ++seg) {
    // Decade i = seg - 1 covers 10^(i-6) * [0.1, 1] in `count` equal steps; u = first + j at
    // the j-th step's end, which is the j-th threshold inside the decade.
    const double decade = std::pow(10.0, seg - 7);
    f.a[seg] = static_cast<float>(count[seg] / (0.9 * decade));
    f.c[seg] = static_cast<float>(count[seg] / 9.0 - first[seg] - kFastDelta);
    f.top[seg] = first[seg] + count[seg] - 1;
  }
  // The magnitude at which segment `seg` (1..8) starts: the threshold below its first offset.
  const auto boundary = [&](int seg) {
    const float t = map.thresholds[(is_signed ? 127 : 0) + first[seg] - 1];
    return std::fabs(t);  // positive side: exactly the threshold
  };
  // The zero code's segment: offset 0, on a line that reaches u = 1 + kFastDelta at the first
  // threshold, so that a |y| exactly there (which stays in this segment) is uncertain like
  // every other boundary ([Note: arithmetic quantiser]); below it u < 1 + kFastDelta.
  f.a[0] = (0.5f + kFastDelta) / boundary(1);
  f.c[0] = -0.5f;
  for (int e = 0; e < kFastBinades; ++e) {
    const float lo = e == 0 ? 0.0f : std::ldexp(1.0f, e + kFastFirstExponent - 127);
    const float hi = std::ldexp(1.0f, e + 1 + kFastFirstExponent - 127);
    int seg = 0, inside = 0;
    float t = kInf;
    for (int k = 1; k <= 8; ++k) {
      const float b = boundary(k);
      if (b <= lo) {
        seg = k;
      } else if (b < hi) {
        // Segments start past trans. The code of 1's starts at its threshold itself: the
        // decade below it is not uncertain there, and the sign does not matter (no code
        // below -1 exists: a negative |y| there has code 0 from either segment).
        t = k == 8 ? std::nextafter(b, 0.0f) : b;
        ++inside;
      }
    }
    if (inside > 1) broken_map("two segment boundaries in one binade (arithmetic quantiser)");
    f.seg_start[e] = seg;
    f.trans[e] = t;
  }

  // The proof. code_fast is monotone in y inside a segment and binade (fma, trunc and min are
  // monotone, a >= 0); check that it does not decrease where either changes...
  bool unc = false;
  const auto fast = [&](float y) { return code_fast(map, y, &unc); };
  for (int e = 0; e < kFastBinades; ++e) {
    const float binade_start = e == 0 ? 0.0f : std::ldexp(1.0f, e + kFastFirstExponent - 127);
    // The segment changes between trans and the next float up ([Note: arithmetic quantiser]).
    for (const float p : {binade_start, f.trans[e], std::nextafter(f.trans[e], kInf)}) {
      if (!(p > 0.0f && p <= 2.0f)) continue;
      const float below = std::nextafter(p, 0.0f);
      if (fast(p) < fast(below) || fast(-p) > fast(-below)) {
        broken_map("the arithmetic quantiser is not monotone");
      }
    }
  }
  // ...then it equals code_search at the first and the last certain y of every interval on
  // which code_search is constant: [-2, t[0]), [t[j-1], t[j]), [t[254], 2].
  constexpr long kMaxScan = 1L << 20;  // uncertain stretches are ~1e4 ulps at most
  for (int j = 0; j < 256; ++j) {
    const float lo = j == 0 ? -2.0f : map.thresholds[j - 1];
    const float last = j == 255 ? 2.0f : std::nextafter(map.thresholds[j], -kInf);
    for (int dir = 0; dir < 2; ++dir) {
      float y = dir == 0 ? lo : last;
      const float stop = dir == 0 ? last : lo;
      long steps = 0;
      for (;;) {
        const uint32_t q = fast(y);
        if (!unc) {
          if (q != static_cast<uint32_t>(j) || code_search(map, y) != static_cast<uint32_t>(j)) {
            broken_map("the arithmetic quantiser misses a code");
          }
          break;
        }
        if (y == stop) break;  // uncertain throughout: the lookup decides every y here
        if (++steps > kMaxScan) {
          broken_map("an uncertain stretch of the arithmetic quantiser is too wide");
        }
        y = std::nextafter(y, dir == 0 ? kInf : -kInf);
      }
    }
  }
}

// [Note: nearest code] and [Note: code lookup table] (code_map.h), from the sorted values.
CodeMap build_code_map(const float (&values)[256]) {
  CodeMap map{};
  int zero = -1;
  for (int j = 0; j < 256; ++j) {
    map.values[j] = values[j];
    if (!std::isfinite(values[j]) || (j > 0 && !(values[j - 1] < values[j]))) {
      broken_map("values must be finite and strictly ascending");
    }
    if (values[j] == 0.0f) zero = j;
  }
  if (zero < 0) broken_map("0 must be a code");
  map.zero_code = static_cast<uint8_t>(zero);
  for (int j = 0; j < 255; ++j) {
    // Exact in double: two floats of at most 2^23 ratio sum without rounding.
    const double mid = (static_cast<double>(values[j]) + values[j + 1]) * 0.5;
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) < mid) t = std::nextafter(t, std::numeric_limits<float>::infinity());
    map.thresholds[j] = t;
  }
  map.thresholds[255] = std::numeric_limits<float>::infinity();
  for (int j = 0; j < 256; ++j) {
    const uint32_t u = bits_of(values[j]);
    for (int k = 0; k < 4; ++k) map.value_bytes[k][j] = static_cast<uint8_t>(u >> (8 * k));
  }

  // Each bucket's count at its start, and where (if anywhere) in it the count steps.
  const uint32_t first_bucket_mag = static_cast<uint32_t>(kLutMinExponent) << 23;
  const uint32_t last_bucket_mag = 127u << 23;  // 1.0
  for (uint32_t sign = 0; sign < 2; ++sign) {
    const auto code_at = [&](uint32_t mag) { return code_search(map, float_of((sign << 31) | mag)); };
    for (int32_t b = 0; b < kLutBuckets; ++b) {
      uint32_t lo, hi;
      if (b == 0) {
        lo = 0;
        hi = first_bucket_mag - 1;
      } else if (b == kLutBuckets - 1) {
        lo = last_bucket_mag;
        hi = 0x7F7FFFFFu;  // the largest finite float
      } else {
        lo = static_cast<uint32_t>(b + kLutBias) << kLutShift;
        hi = lo | kLutLowMask;
      }
      const uint32_t q_lo = code_at(lo);
      const uint32_t q_hi = code_at(hi);
      uint32_t offset = kLutNever;
      if (q_hi != q_lo) {
        const uint32_t expected = sign ? q_lo - 1 : q_lo + 1;
        if (b == 0 || b == kLutBuckets - 1 || q_hi != expected) {
          broken_map("a lookup bucket spans more than one threshold (raise kLutMantBits)");
        }
        // The smallest offset whose count is q_hi: the count is monotone in the magnitude.
        uint32_t below = 0, at = hi - lo;
        while (at - below > 1) {
          const uint32_t mid = below + (at - below) / 2;
          (code_at(lo + mid) == q_hi ? at : below) = mid;
        }
        offset = at;
      }
      map.lut[sign * kLutBuckets + b] = q_lo | (offset << 8);
    }
  }
  map.is_signed = values[0] < 0.0f;
  build_fast_quant(map);
  return map;
}

std::atomic<bool> g_vbmi_enabled{true};

bool vbmi_supported() {
#if defined(__x86_64__) || defined(_M_X64)
  // cpu_features().avx512 has already checked that the OS saves the zmm state.
  static const bool ok = cpu_features().avx512 && __builtin_cpu_supports("avx512vbmi") &&
                         avx512vbmi_adam8bit_kernels().select != nullptr;
  return ok;
#else
  return false;
#endif
}

// Isa::kAvx512 has two builds: with VBMI byte permutes where the CPU has them
// ([Note: byte-plane lookup]), else with gathers. Both give the same bits.
const Adam8bitKernelSet& kernels_for(Isa isa) {
  static const Adam8bitKernelSet sets[5] = {
      scalar_adam8bit_kernels(), portable_adam8bit_kernels(), avx2_adam8bit_kernels(),
      avx512_adam8bit_kernels(), avx512vbmi_adam8bit_kernels()};
  if (isa == Isa::kAvx512 && vbmi_supported() && g_vbmi_enabled.load(std::memory_order_relaxed)) {
    return sets[4];
  }
  return sets[static_cast<int>(isa)];
}

// kAuto -> the best this CPU runs; a forced one must run here (isa_supported is the Adam
// step's: every kernel file of an ISA is built under the same condition).
const Adam8bitKernelSet& resolve(Isa isa) {
  if (isa == Isa::kAuto) return kernels_for(best_isa());
  if (!isa_supported(isa) || kernels_for(isa).select == nullptr) {
    throw ValueError(std::string("the '") + isa_name(isa) +
                     "' 8-bit Adam kernel cannot run on this CPU (or was not built for it); "
                     "pass isa=None to use the best supported one (here '" +
                     isa_name(best_isa()) + "')");
  }
  return kernels_for(isa);
}

size_t num_blocks(size_t n) { return (n + kAdam8bitBlock - 1) / kAdam8bitBlock; }

// range(block_begin, block_end) over the blocks of n elements, in chunks of whole blocks
// sized as parallel.h's [Note: chunking] sizes element chunks, on `threads` threads.
template <class Range>
void parallel_blocks(size_t n, int threads, const Range& range) {
  const size_t blocks = num_blocks(n);
  const size_t chunk = (parallel::chunk_elems(n, threads) + kAdam8bitBlock - 1) / kAdam8bitBlock;
  const size_t nchunks = (blocks + chunk - 1) / chunk;
  if (nchunks <= 1 || threads <= 1) {
    range(size_t{0}, blocks);
    return;
  }
  ThreadPool::instance().run(nchunks, threads, [&](size_t c) {
    const size_t begin = c * chunk;
    range(begin, std::min(blocks, begin + chunk));
  });
}

}  // namespace

const CodeMap& code_map(bool is_signed) {
  static const CodeMap signed_map = build_code_map(adam8bit_maps::kSigned);
  static const CodeMap unsigned_map = build_code_map(adam8bit_maps::kUnsigned);
  return is_signed ? signed_map : unsigned_map;
}

const float* adam8bit_code_values(bool is_signed) { return code_map(is_signed).values; }

const char* adam8bit_avx512_variant() {
  if (!isa_supported(Isa::kAvx512)) return "none";
  return vbmi_supported() && g_vbmi_enabled.load(std::memory_order_relaxed) ? "vbmi" : "gather";
}

void set_adam8bit_vbmi(bool enabled) { g_vbmi_enabled.store(enabled, std::memory_order_relaxed); }

void adam8bit_step(const Adam8bitBuffers& b, const AdamScalars& s, Isa isa, int threads) {
  if (b.n == 0) return;
  if (b.master == nullptr || b.grad == nullptr || b.exp_avg_codes == nullptr ||
      b.exp_avg_scales == nullptr || b.exp_avg_sq_codes == nullptr ||
      b.exp_avg_sq_scales == nullptr || (b.out_dtype != DType::kNone && b.out == nullptr)) {
    throw ValueError("adam8bit_step: a buffer address is null");
  }
  const Adam8bitKernel kernel = resolve(isa).select(b.grad_dtype, b.out_dtype, s.l2 != 0.0f);
  if (kernel == nullptr) {
    throw ValueError("adam8bit_step: unsupported dtype combination (grad " +
                     std::to_string(static_cast<int>(b.grad_dtype)) + ", out " +
                     std::to_string(static_cast<int>(b.out_dtype)) + ")");
  }
  code_map(true);  // built before the threads start, not inside the first chunk
  parallel_blocks(b.n, parallel::threads_for_call(threads),
                  [&](size_t begin, size_t end) { kernel(b, s, begin, end); });
}

void quantize_blockwise(const float* src, uint8_t* codes, float* scales, size_t n,
                        bool is_signed, Isa isa, int threads) {
  if (n == 0) return;
  if (src == nullptr || codes == nullptr || scales == nullptr) {
    throw ValueError("quantize_blockwise: a buffer address is null");
  }
  const QuantizeKernel kernel = resolve(isa).quantize;
  const CodeMap& map = code_map(is_signed);
  parallel_blocks(n, parallel::threads_for_call(threads), [&](size_t begin, size_t end) {
    kernel(src, codes, scales, n, map, begin, end);
  });
}

void dequantize_blockwise(const uint8_t* codes, const float* scales, float* dst, size_t n,
                          bool is_signed, int threads) {
  if (n == 0) return;
  if (codes == nullptr || scales == nullptr || dst == nullptr) {
    throw ValueError("dequantize_blockwise: a buffer address is null");
  }
  // Not a step's hot path (conversions, tests): one plain loop, which the compiler vectorises.
  const float* values = code_map(is_signed).values;
  parallel_blocks(n, parallel::threads_for_call(threads), [&](size_t begin, size_t end) {
    const size_t stop = std::min(n, end * kAdam8bitBlock);
    for (size_t i = begin * kAdam8bitBlock; i < stop; ++i) {
      dst[i] = values[codes[i]] * scales[i / kAdam8bitBlock];
    }
  });
}

void roofline_adam8bit(float* p, const float* g, uint8_t* cm, uint8_t* cv, size_t n,
                       int threads) {
  const RooflineAdam8bitKernel k = kernels_for(best_isa()).roofline;
  parallel_blocks(n, parallel::threads_for_call(threads), [&](size_t begin, size_t end) {
    k(p, g, cm, cv, begin * kAdam8bitBlock, std::min(n, end * kAdam8bitBlock));
  });
}

}  // namespace offload
