// The portable kernel of the 8-bit Adam step: adam8bit_math.h one element at a time with the
// branch-free conversions and the code lookup table ([Note: code lookup table]), shaped for
// the compiler's vectoriser (AArch64; x86-64 without AVX2). Same results as the scalar
// reference, bit for bit: the table is the threshold search tabulated.
#include "adam/branch_free_conv.h"
#include "adam8bit/adam8bit_math.h"
#include "adam8bit/kernels.h"

namespace offload {
namespace {

using Lanes = adam8bit_math::ScalarLanes<BranchFreeConv, true>;

struct PortableImpl {
  template <DType G, DType O, bool L2>
  static void step(const Adam8bitBuffers& b, const AdamScalars& s, size_t block_begin,
                   size_t block_end) {
    adam8bit_math::step_blocks<Lanes, G, O, L2>(b, s, block_begin, block_end);
  }
  static void quantize(const float* src, uint8_t* codes, float* scales, size_t n,
                       const CodeMap& map, size_t block_begin, size_t block_end) {
    adam8bit_math::quantize_blocks<Lanes>(src, codes, scales, n, map, block_begin, block_end);
  }
};

}  // namespace

Adam8bitKernelSet portable_adam8bit_kernels() {
  return adam8bit_select::make_kernel_set<PortableImpl>(&adam8bit_math::adam8bit_traffic);
}

}  // namespace offload
