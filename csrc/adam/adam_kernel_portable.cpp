// The portable kernel: plain C++ shaped for the compiler's vectoriser, for CPUs without a
// hand-written kernel (AArch64, where GCC/Clang turn it into NEON with FMA; or x86-64
// without AVX2). Same operations as adam_math.h ([Note: operation order]); what differs
// is only the form: branch-free conversions (selects instead of ifs, which vectorise)
// and `#pragma GCC ivdep` (the arrays never overlap; Python checks that).
//
// On x86-64 without FMA hardware std::fma is a library call, so this path is correct but
// not vectorised there; every x86-64 CPU with AVX2 takes the AVX2 kernel instead.
#include "adam/adam_math.h"
#include "adam/branch_free_conv.h"
#include "adam/kernels.h"
#include "adam/roofline_impl.h"

namespace offload {
namespace {

template <DType G, DType M, DType O, bool L2>
void portable_kernel(const AdamBuffers& b, const AdamScalars& s, size_t begin, size_t end) {
  // Copies in locals so the vectoriser sees loop-invariant pointers and scalars.
  const AdamBuffers lb = b;
  const AdamScalars ls = s;
#pragma GCC ivdep
  for (size_t i = begin; i < end; ++i) {
    adam_math::adam_element<G, M, O, L2, BranchFreeConv>(lb, ls, i);
  }
}

OFFLOAD_ADAM_SELECTOR(select_portable, portable_kernel)

}  // namespace

KernelSet portable_kernels() {
  KernelSet k;
  k.select = &select_portable;
  OFFLOAD_ROOFLINE_VARIANTS(k);
  k.roofline_triad = &roofline_impl::triad;
  return k;
}

}  // namespace offload
