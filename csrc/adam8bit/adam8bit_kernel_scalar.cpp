// The scalar reference kernel of the 8-bit Adam step: adam8bit_math.h one element at a time,
// with adam_math.h's straightforward conversions and the threshold search of [Note: nearest
// code] (no lookup table). Every other kernel is tested against it, bit for bit. Built with
// -fno-tree-vectorize (CMakeLists.txt) so that "scalar" stays an independent path.
#include "adam8bit/adam8bit_math.h"
#include "adam8bit/kernels.h"

namespace offload {
namespace {

using Lanes = adam8bit_math::ScalarLanes<adam_math::ScalarConv, false>;

struct ScalarImpl {
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

Adam8bitKernelSet scalar_adam8bit_kernels() {
  return adam8bit_select::make_kernel_set<ScalarImpl>(&adam8bit_math::adam8bit_traffic);
}

}  // namespace offload
