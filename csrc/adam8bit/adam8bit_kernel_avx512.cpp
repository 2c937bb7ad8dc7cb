// The AVX-512 (F/BW/VL/DQ) kernel of the 8-bit Adam step: lanes_avx512.h's lanes in
// adam8bit_math.h's templates. Compiled with the AVX-512 flags (CMakeLists.txt) and called
// only when cpu_features().avx512 is set and the CPU lacks AVX512-VBMI (which takes the
// adam8bit_kernel_avx512vbmi.cpp variant). Equal to the scalar reference bit for bit.
#include "adam8bit/kernels.h"

#if defined(__x86_64__) || defined(_M_X64)

#include "adam8bit/adam8bit_math.h"
#include "adam8bit/lanes_avx512.h"

namespace offload {
namespace {

struct Avx512Impl {
  template <DType G, DType O, bool L2>
  static void step(const Adam8bitBuffers& b, const AdamScalars& s, size_t block_begin,
                   size_t block_end) {
    adam8bit_math::step_blocks<Avx512Lanes, G, O, L2>(b, s, block_begin, block_end);
  }
  static void quantize(const float* src, uint8_t* codes, float* scales, size_t n,
                       const CodeMap& map, size_t block_begin, size_t block_end) {
    adam8bit_math::quantize_blocks<Avx512Lanes>(src, codes, scales, n, map, block_begin,
                                                block_end);
  }
};

}  // namespace

Adam8bitKernelSet avx512_adam8bit_kernels() {
  return adam8bit_select::make_kernel_set<Avx512Impl>(&adam8bit_math::adam8bit_traffic);
}

}  // namespace offload

#else  // not x86-64

namespace offload {
Adam8bitKernelSet avx512_adam8bit_kernels() { return {}; }
}  // namespace offload

#endif
