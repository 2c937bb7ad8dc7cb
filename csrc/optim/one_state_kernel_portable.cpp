// The portable kernels of Lion and Adagrad: one_state_math.h's element loop with
// branch-free conversions, shaped for the compiler's vectoriser (AArch64, where GCC and
// Clang turn it into NEON with FMA; x86-64 without AVX2). Same operations as every other
// kernel ([Note: one-state operation order]); only the form differs.
#include "adam/branch_free_conv.h"
#include "optim/kernel_select.h"
#include "optim/kernels.h"
#include "optim/one_state_math.h"

namespace offload {
namespace {

struct PortableImpl {
  template <class Op, DType G, DType S, DType O, bool F>
  static void kernel(const OneStateBuffers& b, const typename Op::Scalars& s, size_t begin,
                     size_t end) {
    one_state_math::run_elements<one_state_math::ScalarLanes<BranchFreeConv>, Op, G, S, O, F>(
        b, s, begin, end);
  }
};

}  // namespace

OneStateKernelSet portable_one_state_kernels() {
  return one_state_select::make_kernel_set<PortableImpl>(&one_state_math::one_state_traffic);
}

}  // namespace offload
