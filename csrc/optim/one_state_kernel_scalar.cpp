// The scalar reference kernels of Lion and Adagrad: one_state_math.h applied one element at
// a time with adam_math.h's straightforward conversions. Every other kernel is tested
// against these, bit for bit. Built with -fno-tree-vectorize (CMakeLists.txt) so that
// "scalar" stays a genuinely independent path, and a readable one in a profile.
#include "optim/kernel_select.h"
#include "optim/kernels.h"
#include "optim/one_state_math.h"

namespace offload {
namespace {

struct ScalarImpl {
  template <class Op, DType G, DType S, DType O, bool F>
  static void kernel(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                     size_t end) {
    one_state_math::run_elements<one_state_math::ScalarLanes<>, Op, G, S, O, F>(b, s, begin,
                                                                                 end);
  }
};

}  // namespace

OneStateKernelSet scalar_one_state_kernels() {
  return one_state_select::make_kernel_set<ScalarImpl>(&one_state_math::one_state_traffic);
}

}  // namespace offload
