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
